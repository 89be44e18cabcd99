"""Draft-training features computed by an SGLang target server (for targets too big for transformers in one
process -- Kimi-K2.5, DeepSeek-V3 at TP=8 -- captured by the engine that serves them, tensor parallel, prefill
only).

Start the target alone with the plugin, ``--eagle3-feature-dir <dir>`` and ``--disable-radix-cache``
(a prefix-cache hit would skip the tokens it covers). Every prefill chunk of a request whose rid starts
with ``RID_PREFIX`` is written by attention-TP rank 0 (the residual stream is whole on every rank) as
``<dir>/<rid>/<start>.safetensors``: ``input_ids`` [n], ``aux`` [n, layers x hidden] (the convention's
layers, as for a draft: ``--speculative-eagle3-aux-layers`` or the default ids) and ``last_hidden``
[n, hidden] (after the final norm: what the lm_head reads), bf16. Other requests are served as usual.
The client is ``sglang_ext.training.features.ServerFeatureExtractor`` (same records as the in-process extractor).

Extends (hooks registered only when the option is set), SGLang 0.5.17 - 0.5.23:
  * ``sglang.srt.model_executor.model_runner.ModelRunner.load_model`` (AFTER) -- on the target's runner:
    refuses a radix cache, then switches aux capture on without speculation through the model's
    ``set_eagle3_layers_to_capture`` (our aux_capture hook: plan, checks, the startup line), before CUDA
    graphs are captured.
  * aux_capture's forward wrapper calls ``write_batch`` after every forward of the target model.
"""

from __future__ import annotations

import logging
import os

import torch

from sglang_ext import settings
from sglang_ext.errors import ConfigError
from sglang_ext.serving import compat
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

OPTION = settings.BY_ATTR["feature_dir"].flag
RID_PREFIX = "sglang-ext-features-"
PLAN_FILE = "aux_layer_plan.json"  # the layers this server captures (AuxLayerPlan.to_dict), checked by the trainer


def directory() -> str | None:
    return settings.current().feature_dir


def request_dir(root: str, rid: str) -> str:
    return os.path.join(root, rid)


def write_chunks(root: str, rids, prefix_lens, seq_lens, input_ids: torch.Tensor, aux, last_hidden) -> int:
    """The rows of one extend batch (requests packed back to back, `seq_lens[i]` new tokens of request i
    starting at position `prefix_lens[i]`) for the requests named RID_PREFIX...; returns files written.
    Each file appears whole (written aside, then renamed): a reader never sees half a chunk."""
    from safetensors.torch import save_file

    if not isinstance(aux, torch.Tensor):
        aux = torch.cat(list(aux), dim=-1)
    written, offset = 0, 0
    for rid, start, n in zip(rids, prefix_lens, seq_lens):
        start, n = int(start), int(n)
        if isinstance(rid, str) and rid.startswith(RID_PREFIX) and n > 0:
            rows = slice(offset, offset + n)
            out = request_dir(root, rid)
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, f"{start:09d}.safetensors")
            save_file({"input_ids": input_ids[rows].detach().to("cpu", torch.long).contiguous(),
                       "aux": aux[rows].detach().to("cpu", torch.bfloat16).contiguous(),
                       "last_hidden": last_hidden[rows].detach().to("cpu", torch.bfloat16).contiguous()},
                      path + ".part")
            os.replace(path + ".part", path)
            written += 1
        offset += n
    return written


def write_batch(root: str, forward_batch, input_ids: torch.Tensor, aux, last_hidden) -> int:
    """After a forward of the target model: prefill (extend) batches only, never while a CUDA graph is
    being captured (no real requests there)."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_extend() or last_hidden is None:
        return 0
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return 0
    rids = getattr(forward_batch, "rids", None) or []
    if not any(isinstance(r, str) and r.startswith(RID_PREFIX) for r in rids):
        return 0
    from sglang_ext.serving.acceptance import is_reporting_rank  # one writer

    if not is_reporting_rank():
        return 0
    return write_chunks(root, rids, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu,
                        input_ids, aux, last_hidden)


def check_server(args) -> None:
    """Refused at startup, with the fix."""
    if args is not None and getattr(args, "speculative_algorithm", None):
        raise ConfigError("--speculative-algorithm", args.speculative_algorithm,
                          f"a feature server ({OPTION}) serves the target alone: its aux layers are the convention's "
                          "for training, not a draft's", "start it without speculative decoding")
    if args is not None and not getattr(args, "disable_radix_cache", False):
        raise ConfigError("--disable-radix-cache", False,
                          f"{OPTION} writes every prompt token's hidden states, but a radix-cache hit skips the "
                          "tokens it covers", "start the feature server with --disable-radix-cache")


def after_load_model(result, self, *args, **kwargs):
    if getattr(self, "is_draft_worker", False):
        return result
    check_server(compat.resolved(getattr(self, "server_args", None)))  # 0.5.21+: the record is the raw input
    model = self.model
    if not getattr(model, "capture_aux_hidden_states", False):
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise ConfigError(OPTION, directory(), f"{type(model).__name__} cannot capture aux hidden states in "
                              f"SGLang {compat.version()}",
                              "capture features in-process (sglang_ext.training.features.FeatureExtractor)")
        model.set_eagle3_layers_to_capture(None)  # our aux_capture hook: default ids or the override
    language = getattr(model, "language_model", None)  # a VL wrapper (Kimi-K2.5) delegates to its text model
    if getattr(model, "_sglang_ext_aux_plan", None) is None and getattr(language, "_sglang_ext_aux_plan", None) is None:
        # upstream's capture alone writes nothing
        raise ConfigError(OPTION, directory(), f"the plugin captures features for DeepseekV2/V3, Kimi-K2.5 and Llama-"
                          f"family targets, not {type(model).__name__}",
                          "capture features in-process (sglang_ext.training.features.FeatureExtractor)")
    plan = getattr(model, "_sglang_ext_aux_plan", None) or getattr(language, "_sglang_ext_aux_plan", None)
    from sglang_ext.serving.acceptance import is_reporting_rank

    if is_reporting_rank():
        import json

        os.makedirs(directory(), exist_ok=True)
        path = os.path.join(directory(), PLAN_FILE)
        with open(path + ".part", "w") as f:
            json.dump(plan.to_dict(), f)
        os.replace(path + ".part", path)
    logger.info("[sglang_ext] feature server: prefill chunks of requests named %s* are written to %s (aux layers %s)",
                RID_PREFIX, directory(), list(plan.output_ids))
    return result


HOOKS = (Hook("sglang.srt.model_executor.model_runner.ModelRunner.load_model", "after", after_load_model,
              when=lambda s: bool(s.feature_dir), option="--eagle3-feature-dir", feature="the feature server"),)
