"""The draft's prefill computes its last layer's output projection and MLP only for the rows it uses.

Why: after the target's prefill, upstream runs the Eagle3 head over every prompt token
(``EagleDraftWorker._draft_extend_for_prefill``) to fill the draft's KV cache, and keeps one hidden state per
request (``CaptureHiddenMode.LAST``) for its first draft step. A token's draft KV depends only on that token's
inputs (embedding, ``fc`` of the target's aux states, the layer's norms, its K/V projection), so everything after the
last layer's attention -- its output projection and MLP -- matters only at each request's last token. For the
bench's 1B MHA head (hidden 7168, MLP 18432) those are 455 of its 756 M multiply-adds per token (60%); measured on
FA3, a 128-request prefill of the 16-layer bench target takes 3.4% less time (docs/benchmarks.md, 2026-12-07).

What: around the draft's prefill forward, the last decoder layer's ``self_attn.o_proj`` and ``mlp`` run on the
last token of each request's extend (``extend_start_loc + extend_seq_lens - 1``) and their other output rows are
zero. The draft KV, the hidden state kept for drafting and the draft's logits are those of upstream's forward (up to
the GEMM's row count); only rows nothing reads change. Earlier layers of a multi-layer head are left whole (their
outputs feed the later layers' KV).

When: only in the eager runner (a prefill CUDA graph -- SGLang's breakable graph for batches of up to its capture
size -- replays the shapes it captured, so those batches keep upstream's forward); only for batches that capture
the LAST hidden state without logprobs or DP attention (what ``_draft_extend_for_prefill`` builds); only for the
Eagle3 head classes whose layer ends with ``self.mlp``. The default (``--speculative-draft-prefill last``): on FA3
both head formats' deterministic trees equal the target alone with it, at upstream's acceptance; ``full`` keeps
upstream's forward.

Extends (SGLang 0.5.17 - 0.5.23):
  * ``speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill`` (AROUND) -- on first use, wraps the
    draft model's last layer's ``o_proj`` / ``mlp`` and the draft runner's eager runner on their instances, then
    marks the call so those wrappers act on that one forward.
"""

from __future__ import annotations

import logging

import torch

from sglang_ext import settings
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

OPTION = settings.BY_ATTR["draft_prefill"].flag
TARGET = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill"
STATE = "_sglang_ext_draft_prefill"
# the Eagle3 heads whose decoder layer is attention then `self.mlp(...)`, its output going only to the final norm
HEAD_CLASSES = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")


class LastRows:
    """The rows one draft prefill forward uses (None outside it), shared by the wrappers of one draft worker."""

    def __init__(self):
        self.armed = False  # inside _draft_extend_for_prefill
        self.rows: torch.Tensor | None = None  # inside its eager forward: each request's last extend token
        self.tokens = 0
        self.wrapped: tuple[int, int] | None = None  # ids of the model and eager runner wrapped

    def select(self, forward_batch) -> torch.Tensor | None:
        """The last token of each request's extend, where only those rows are read; else None."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        mode = forward_batch.forward_mode
        if not self.armed or mode.is_idle() or not mode.is_extend() or mode.is_target_verify():
            return None
        if forward_batch.capture_hidden_mode not in (CaptureHiddenMode.LAST, CaptureHiddenMode.NULL, None) \
                or forward_batch.return_logprob or forward_batch.global_num_tokens_cpu is not None:
            return None
        starts, lens = forward_batch.extend_start_loc, forward_batch.extend_seq_lens
        if starts is None or lens is None or len(lens) >= forward_batch.input_ids.shape[0]:
            return None  # one token per request: nothing to leave out
        return (starts + lens - 1).long()

    def wrap_module(self, module: torch.nn.Module) -> None:
        """`module.forward` on the selected rows only (the rest zero) while a forward is selected."""
        original = module.forward

        def forward(x, *args, **kwargs):
            rows = self.rows
            if rows is None or x.shape[0] != self.tokens:
                return original(x, *args, **kwargs)
            out = original(x.index_select(0, rows), *args, **kwargs)
            if isinstance(out, tuple):  # linear layers return (output, bias)
                return (_scatter(out[0], rows, self.tokens),) + tuple(out[1:])
            return _scatter(out, rows, self.tokens)

        module.forward = forward

    def wrap_runner(self, runner) -> None:
        """The eager runner's execute selects the rows of a draft prefill forward (graph runners never do)."""
        original = runner.execute

        def execute(forward_batch, *args, **kwargs):
            rows = self.select(forward_batch)
            if rows is None:
                return original(forward_batch, *args, **kwargs)
            self.rows, self.tokens = rows, forward_batch.input_ids.shape[0]
            try:
                return original(forward_batch, *args, **kwargs)
            finally:
                self.rows, self.tokens = None, 0

        runner.execute = execute


def _scatter(rows_out: torch.Tensor, rows: torch.Tensor, tokens: int) -> torch.Tensor:
    full = rows_out.new_zeros((tokens,) + tuple(rows_out.shape[1:]))
    return full.index_copy_(0, rows, rows_out)


def last_layer(model) -> torch.nn.Module | None:
    """The last decoder layer of an Eagle3 head SGLang serves (None for another draft model)."""
    if not any(c.__name__ in HEAD_CLASSES for c in type(model).__mro__):
        return None
    inner = getattr(model, "model", None)
    layer = getattr(inner, "midlayer", None)
    if layer is None:
        layers = getattr(inner, "layers", None)
        layer = layers[-1] if layers is not None and len(layers) else None
    attn = getattr(layer, "self_attn", None)
    if not isinstance(getattr(layer, "mlp", None), torch.nn.Module) or \
            not isinstance(getattr(attn, "o_proj", None), torch.nn.Module):
        return None
    return layer


def install(worker) -> LastRows | None:
    """The worker's LastRows, its wrappers installed on first use, and again where SGLang rebuilt the eager runner or
    reloaded the model since (None where the path does not apply)."""
    runner = getattr(worker, "draft_runner", None)
    model = getattr(runner, "model", None)
    eager = getattr(runner, "eager_runner", None)
    state = getattr(worker, STATE, None)
    if hasattr(worker, STATE) and (state is None or state.wrapped == (id(model), id(eager))):
        return state
    state, layer = None, last_layer(model)
    if layer is not None and eager is not None and hasattr(eager, "execute"):
        state = LastRows()
        state.wrap_module(layer.self_attn.o_proj)
        state.wrap_module(layer.mlp)
        state.wrap_runner(eager)
        state.wrapped = (id(model), id(eager))
        logger.info("[sglang_ext] draft prefill: the output projection and MLP of %s's last layer run on each "
                    "request's last token only (%s full: every token)", type(model).__name__, OPTION)
    setattr(worker, STATE, state)
    return state


def draft_extend_for_prefill(original_fn, self, *args, **kwargs):
    state = install(self) if _requested(settings.current()) else None
    if state is None:
        return original_fn(self, *args, **kwargs)
    state.armed = True
    try:
        return original_fn(self, *args, **kwargs)
    finally:
        state.armed = False


def _requested(s: settings.Settings) -> bool:
    return s.draft_prefill == "last"


HOOKS = (
    Hook(TARGET, "around", draft_extend_for_prefill, when=_requested,
         option=f"{OPTION} last (the default)",
         feature="the draft's prefill computing its last layer's output projection and MLP only at the rows it uses"),
)
