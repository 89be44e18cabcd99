"""Depth 0 of adaptive speculation as the target's plain decode step.

Why: under ``--speculative-adaptive`` SGLang 0.5.17 runs depth 0 (no drafting) as a one-token target verify:
a TARGET_VERIFY CUDA graph of width 1 (EAGLE captures no DECODE graph for the target at all), verify
preparation (slot assignment on the plan stream, a mask fill), EAGLE's verify sampling and hidden-state
capture for the draft. On an H200 with a Kimi-K2.5-shaped target that step cost 1.04x a plain decode step at
batch 1 and ~1.08x at 32-128 requests (docs/benchmarks.md, run 3), which held a draft that never accepts at
0.92x of no speculation even when the cost policy stopped drafting.

What: at depth 0 a decode batch runs the step a server without speculation runs -- input the bonus token,
the KV slot the spec-v2 scheduler already reserved at ``seq_lens``, DECODE CUDA graphs (captured in place of
depth 0's width-1 verify graphs: no extra memory), SGLang's normal sampler -- and returns what a depth-0
verify returns: one accepted token per request, the sampled token as the next bonus token, the new lengths.
The draft extend (which keeps the draft's KV and last hidden state current) runs only in the
``WARM_LEAD_STEPS`` steps before the policy's next probe; on the other depth-0 steps upstream's stub stands in for
it. On every depth-0 step it cost 1.2x a plain decode step at 64-128 requests on an H200.
``--speculative-adaptive-depth0-draft-extend``: ``warm`` (that, the default), ``keep`` (every step, as upstream's
depth 0) or ``skip`` (never; also upstream's ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``, and then no hidden
state is captured either).

Batches that need what only the verify path does (grammar, logprobs, returned hidden states, custom logit
processors, DP attention, a batch larger than the captured graphs) keep upstream's path; at depth 0 that
verify then runs eagerly, since depth 0's graphs are decode graphs.

``--speculative-adaptive-depth0``: ``decode`` (the default whenever the cost policy is on) or ``verify``
(upstream's one-token verify). Extends (registered with the cost policy's hooks), SGLang 0.5.17:
  * ``EAGLEWorkerV2.build_adaptive_runtime_state`` (AROUND) -- for depth 0, upstream's own build, during which
    the target's ``DecodeCudaGraphRunner`` is made a ``PlainDecodeGraphRunner`` (pinned to DECODE);
  * ``DecodeCudaGraphRunner.__init__`` (AROUND) -- a runner built inside that depth-0 build is one, from its
    first line (before it captures);
  * ``EAGLEWorkerV2.forward_batch_generation`` (AROUND) -- a decode batch at depth 0 runs ``plain_decode_step``.
"""

from __future__ import annotations

import contextvars
import functools
import logging

from sglang_ext import settings
from sglang_ext.serving import adaptive, compat
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

OPTION = settings.BY_ATTR["adaptive_depth0"].flag
WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_BUILDING_DEPTH0 = contextvars.ContextVar("sglang_ext_building_depth0", default=False)


def mode() -> str:
    """'decode' (the default) or 'verify'."""
    return settings.current().adaptive_depth0


def enabled() -> bool:
    return adaptive.enabled() and mode() == "decode"


# steps before a probe in which the draft extend runs again (warm mode): the probe then drafts from a current
# last hidden state and the recent tokens' draft KV
WARM_LEAD_STEPS = 32


def extend_mode() -> str:
    """The draft extend at depth 0: 'warm' (unset; only in the steps before a probe), 'keep' (every step, as
    upstream's depth 0) or 'skip' (never; also what upstream's SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 means,
    and then the draft's KV misses the tokens decoded at depth 0; docs/design.md)."""
    from sglang.srt.environ import envs

    mode_ = settings.current().adaptive_depth0_draft_extend
    return "skip" if envs.SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND.get() else mode_


def skip_draft_extend() -> bool:
    """No draft extend at any depth-0 step."""
    return extend_mode() == "skip"


def slot_policy(worker, batch_size: int):
    """The cost policy of the adaptive slot this batch size routes to (None before its first decision)."""
    controller = getattr(worker, "adaptive_controller", None)
    try:
        slot = controller.params._route(batch_size)  # upstream's own routing (AdaptiveSpeculativeParams)
    except AttributeError:
        return None
    return getattr(slot, "_sglang_ext_policy", None)


def draft_extend_now(worker, batch_size: int) -> bool:
    """Whether this depth-0 step runs the draft extend. In 'warm' mode only when the slot's policy is about to
    draft (the steps before a probe); without a policy yet, yes (the safe side: a current draft state)."""
    mode_ = extend_mode()
    if mode_ != "warm":
        return mode_ == "keep"
    policy = slot_policy(worker, batch_size)
    return policy is None or policy.needs_draft_state(WARM_LEAD_STEPS)


def lead_step(policy) -> bool:
    """Whether this slot's depth-0 step runs the draft extend only because a probe follows (warm mode): the cost
    policy then keeps the step's time out of depth 0's (CostModelPolicy.observe, before_probe)."""
    return enabled() and extend_mode() == "warm" and policy.shape.steps == 0 and policy.needs_draft_state(WARM_LEAD_STEPS)


def hidden_mode():
    """What the depth-0 target step captures: the aux hidden states only when the draft extend reads them."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    return CaptureHiddenMode.NULL if skip_draft_extend() else CaptureHiddenMode.FULL


@functools.lru_cache(maxsize=None)
def plain_decode_runner_class():
    """``DecodeCudaGraphRunner`` pinned to plain DECODE graphs at one token per request. Upstream chooses the
    capture mode inside ``__init__`` from the server's speculative algorithm (TARGET_VERIFY for EAGLE), before
    ``capture()``; this subclass resets it at ``capture()``, captures no speculative input, and refuses to
    replay anything but a decode batch (upstream's ``can_run_graph`` does not check the mode)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    class PlainDecodeGraphRunner(DecodeCudaGraphRunner):
        def capture(self) -> None:
            if self.captured_req_width != 1:
                raise RuntimeError(f"[sglang_ext] depth 0 as plain decode: {self.captured_req_width} tokens per "
                                   f"request (expected 1); start the server with {OPTION} verify and report this")
            self.capture_forward_mode = ForwardMode.DECODE
            self.ragged_verify_mode = False  # a verify-only layout (SGLANG_RAGGED_VERIFY_MODE)
            self.capture_hidden_mode = max(self.capture_hidden_mode, hidden_mode())
            super().capture()

        def get_spec_info(self, num_tokens: int):
            return None

        def can_run_graph(self, forward_batch) -> bool:
            return forward_batch.forward_mode.is_decode() and super().can_run_graph(forward_batch)

    return PlainDecodeGraphRunner


def build_runtime_state(original_fn, self, speculative_num_steps, *args, **kwargs):
    if speculative_num_steps != 0 or not enabled():
        return original_fn(self, speculative_num_steps, *args, **kwargs)
    token = _BUILDING_DEPTH0.set(True)
    try:
        state = original_fn(self, speculative_num_steps, *args, **kwargs)
    finally:
        _BUILDING_DEPTH0.reset(token)
    runner = state.target_graph_runner
    logger.info("[sglang_ext] adaptive depth 0 runs the target as a plain decode step (%s decode): decode graphs "
                "for batch sizes %s, hidden states %s", OPTION, getattr(runner, "capture_bs", None),
                getattr(getattr(runner, "capture_hidden_mode", None), "name", None))
    return state


def runner_init(original_fn, self, *args, **kwargs):
    """A decode graph runner built for depth 0 is a PlainDecodeGraphRunner from its first line: upstream's
    ``__init__`` chooses the capture mode and captures, and the subclass's methods must be the ones it calls."""
    if _BUILDING_DEPTH0.get() and type(self).__name__ == "DecodeCudaGraphRunner":
        self.__class__ = plain_decode_runner_class()
    return original_fn(self, *args, **kwargs)


def plain_step_applies(worker, batch) -> bool:
    """Whether this decode batch at depth 0 can run as a plain decode step (else upstream's verify path)."""
    runner = worker._target_worker.model_runner.decode_cuda_graph_runner
    if not isinstance(runner, plain_decode_runner_class()) or getattr(runner, "require_mlp_sync", False):
        return False
    spec = batch.spec_info
    sampling = batch.sampling_info
    return (getattr(spec, "bonus_tokens", None) is not None and worker.topk == 1
            and len(batch.seq_lens) <= runner.max_bs  # graphs only: an eager decode needs host sequence lengths
            and not batch.has_grammar and not batch.return_logprob and not batch.return_hidden_states
            and not (sampling is not None and sampling.has_custom_logit_processor))


def decode_view(seq_lens, seq_lens_cpu, seq_lens_sum):
    """Spec v2 keeps ``seq_lens`` as the length before this step's token; a decode step counts it."""
    bs = len(seq_lens)
    return (seq_lens + 1, None if seq_lens_cpu is None else seq_lens_cpu + 1,
            None if seq_lens_sum is None else seq_lens_sum + bs)


def plain_decode_step(worker, batch, on_publish=None):
    """The depth-0 step of ``EAGLEWorkerV2.forward_batch_generation`` as a plain decode forward + sample."""
    import torch
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context, speculative_moe_backend_context
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    bs = len(batch.seq_lens)
    draft_input = batch.spec_info
    before = batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum
    batch.input_ids = draft_input.bonus_tokens
    # the slot the scheduler reserved for this step's token (eagle_prepare_for_verify reads the same entry); one
    # gather, no host synchronisation
    batch.out_cache_loc = worker.req_to_token_pool.req_to_token[batch.req_pool_indices, batch.seq_lens].to(torch.int64)
    batch.forward_mode = ForwardMode.DECODE
    batch.spec_info = None
    batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = decode_view(*before)
    try:
        result = worker.target_worker.forward_batch_generation(batch, capture_hidden_mode=hidden_mode())
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = before
        batch.spec_info = draft_input
    seq_lens = before[0]
    accept_lens = torch.ones(bs, dtype=torch.int32, device=seq_lens.device)
    result.next_token_ids = result.next_token_ids.to(torch.int32)
    result.accept_lens = accept_lens
    result.new_seq_lens = seq_lens + accept_lens
    result.speculative_num_draft_tokens = 1
    result.next_draft_input = EagleDraftInput(bonus_tokens=result.next_token_ids)
    result.extra_keep_alive_refs = [batch.input_ids, batch.out_cache_loc]
    if on_publish is not None:
        on_publish(result.new_seq_lens)
    if not draft_extend_now(worker, bs):
        worker._stub_skipped_draft_extend(batch, result)
    else:
        draft = worker.draft_worker
        with compat.draft_tp_context(draft), speculative_moe_backend_context(), speculative_moe_a2a_backend_context():
            draft._draft_extend_for_decode(batch, result)
    return result


def forward_batch_generation(original_fn, self, batch, *args, **kwargs):
    forward_mode = batch.forward_mode
    if forward_mode.is_extend() or batch.is_extend_in_batch or forward_mode.is_idle() or not enabled():
        return original_fn(self, batch, *args, **kwargs)
    self.activate_step_by_batch(batch.seq_lens.shape[0])  # upstream does it first thing too (idempotent)
    if self.speculative_num_steps != 0 or not plain_step_applies(self, batch):
        return original_fn(self, batch, *args, **kwargs)
    on_publish = kwargs.get("on_publish", args[0] if args else None)
    return plain_decode_step(self, batch, on_publish)


def _requested(s: settings.Settings) -> bool:
    return adaptive.requested(s) and s.adaptive_depth0 == "decode"


ON = "--speculative-adaptive-policy cost (depth 0: decode)"  # the option that registers these hooks
HOOKS = (
    Hook(f"{WORKER}.build_adaptive_runtime_state", "around", build_runtime_state, when=_requested, option=ON,
         feature="depth 0 as a plain decode step"),
    Hook(f"{RUNNER}.__init__", "around", runner_init, when=_requested, option=ON, feature="depth 0 as a plain decode step"),
    Hook(f"{WORKER}.forward_batch_generation", "around", forward_batch_generation, when=_requested, option=ON,
         feature="depth 0 as a plain decode step"),
)
