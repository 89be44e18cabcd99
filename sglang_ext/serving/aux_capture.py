"""Aux hidden-state capture for Eagle3 under SGLang 0.5.17 - 0.5.23, by the one aux-layer resolver
(sglang_ext.config.aux_layers).

Extends (AROUND hooks):
  * ``sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`` -- also
    serves DeepseekV3ForCausalLM / DeepseekV32ForCausalLM (subclasses) and
    KimiK25ForConditionalGeneration (delegates to its DeepseekV3 language model). Upstream shifts
    ids by one only when the first id is 1, and cannot capture the last layer's output.
  * ``sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture`` -- Llama-family
    targets through the same path.

The replacement resolves the physical layers from the draft's config (declared convention, fc width) and the
``--speculative-eagle3-aux-layers`` option, sets the model's ``layers_to_capture`` and logs one line naming the
layers and where they came from. The pair itself was checked at startup (serving/startup.py). The output of the
last layer (which SGLang's layer loop never reaches) is captured from the final norm's residual sum.
"""

from __future__ import annotations

import logging
import os

import torch

from sglang_ext import settings
from sglang_ext.config import TargetConfig, resolve
from sglang_ext.config.aux_layers import AuxLayerPlan, plan_for_ids, to_output_ids
from sglang_ext.errors import ConfigError, combined
from sglang_ext.serving import compat, feature_capture
from sglang_ext.serving.context import load_draft, local_dir, server_draft_path
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)


def plan_for_target(text_config: dict, architecture: str, layer_ids, draft_path: str | None,
                    override: str | None) -> AuxLayerPlan:
    """The layers to capture; raises one ConfigError with every problem. Without a readable draft (a hub id SGLang
    downloads later), the ids SGLang passed, read its way."""
    target = TargetConfig.from_dict(dict(text_config, architectures=[architecture]))
    directory = local_dir(draft_path)
    if directory is None:
        plan, errors = plan_for_ids(target, layer_ids, None, override)
        if errors:
            raise combined(errors)
        return plan
    from sglang_ext import checkpoint

    draft, shapes = load_draft(directory)
    return resolve(target, draft, override, checkpoint.fc_in_features(shapes))


def _apply_plan(model, plan: AuxLayerPlan, num_layers: int, family: str) -> None:
    inner = model.model
    indices = plan.capture_indices
    start = getattr(inner, "start_layer", 0)
    early = [k - 1 for k in indices if k < start]  # SGLang captures on the last PP stage only
    if early:
        raise ConfigError("eagle_aux_hidden_state_layer_ids", list(plan.output_ids),
                          f"with pipeline parallelism SGLang {compat.version()} captures aux states only on the last "
                          f"stage, which starts at layer {start}; layer(s) {early} are on an earlier stage",
                          "use fewer pipeline stages or capture layers of the last stage")
    model.capture_aux_hidden_states = True
    inner.layers_to_capture = [k for k in indices if k < num_layers]
    capture_final = num_layers in indices
    dump_dir = settings.current().aux_dump_dir
    feature_dir = feature_capture.directory()
    if capture_final or dump_dir or feature_dir:
        _wrap_forward(inner, capture_final, dump_dir, family, feature_dir)


def _wrap_forward(inner, capture_final: bool, dump_dir: str | None, family: str,
                  feature_dir: str | None = None) -> None:
    """Instance-level forward wrapper (zero cost for models that need neither feature); once per model, even
    if SGLang sets the layers again."""
    if getattr(inner, "_sglang_ext_wrapped", False):
        inner.forward = inner._sglang_ext_original_forward
        if getattr(inner, "_sglang_ext_norm_hook", None) is not None:
            inner._sglang_ext_norm_hook.remove()
            inner._sglang_ext_norm_hook = None
    stash: dict[str, torch.Tensor] = {}

    def keep_final(_module, args, output):
        # fused add-norm returns (normed, hidden + residual): the last layer's output
        stash["final"] = output[1] if isinstance(output, tuple) else args[0]

    if capture_final:
        inner._sglang_ext_norm_hook = inner.norm.register_forward_hook(keep_final)
    original = inner.forward
    inner._sglang_ext_original_forward, inner._sglang_ext_wrapped = original, True
    dumped = [0]
    dump_max = settings.current().aux_dump_max

    def forward(input_ids, positions, forward_batch, *args, **kwargs):
        stash.clear()
        out = original(input_ids, positions, forward_batch, *args, **kwargs)
        if capture_final and not isinstance(out, torch.Tensor) and not isinstance(out, tuple):
            return out  # PP proxy tensors of an earlier stage
        if capture_final:
            hidden, aux = out if isinstance(out, tuple) else (out, None)
            final = stash.get("final", hidden)  # idle batches skip the norm; hidden is empty then
            if aux is None:
                aux = [final] if family == "llama" else final.clone()
            elif isinstance(aux, torch.Tensor):
                aux = torch.cat([aux, final], dim=-1)
            else:
                aux = list(aux) + [final]
            out = (hidden, aux)
        if feature_dir and isinstance(out, tuple):  # the inner model's output is the final norm's
            feature_capture.write_batch(feature_dir, forward_batch, input_ids, out[1], out[0])
        if dump_dir and dumped[0] < dump_max:
            if not isinstance(out, tuple):
                _skip(f"the model returned {type(out).__name__}, no aux states")
            elif _dump(dump_dir, dumped[0], input_ids, positions, forward_batch, out[1]):
                dumped[0] += 1
        return out

    inner.forward = forward


_DUMP_SKIPS_LOGGED: set[str] = set()


def _skip(reason: str) -> bool:
    """The first batch skipped for each reason is logged: a debug dump that writes nothing says why."""
    if reason not in _DUMP_SKIPS_LOGGED:
        _DUMP_SKIPS_LOGGED.add(reason)
        logger.info("[sglang_ext] aux dump: a batch not written (%s); only prefill batches are", reason)
    return False


def _dump(dump_dir, index, input_ids, positions, forward_batch, aux) -> bool:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if forward_batch.forward_mode != ForwardMode.EXTEND:
        return _skip(f"forward mode {forward_batch.forward_mode.name}")
    if torch.cuda.is_current_stream_capturing():
        return _skip("CUDA graph capture")
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    except Exception:
        rank = 0
    if rank != 0:
        return False
    from safetensors.torch import save_file

    if not isinstance(aux, torch.Tensor):
        aux = torch.cat(list(aux), dim=-1)
    os.makedirs(dump_dir, exist_ok=True)
    save_file({"input_ids": input_ids.detach().cpu().contiguous(),
               "positions": positions.detach().cpu().contiguous(),
               "aux_hidden_states": aux.detach().float().cpu().contiguous()},
              os.path.join(dump_dir, f"aux-{index:03d}.safetensors"))
    if index == 0:
        logger.info("[sglang_ext] aux dump: first prefill batch written to %s (%d tokens)", dump_dir,
                    input_ids.shape[0])
    return True


def make_hook(family: str):
    """AROUND hook for ``set_eagle3_layers_to_capture(self, layer_ids=None)``."""

    def set_eagle3_layers_to_capture(original_fn, self, layer_ids=None):
        if not self.pp_group.is_last_rank:
            return original_fn(self, layer_ids)  # upstream: nothing to capture off the last stage
        config = self.config.to_dict() if hasattr(self.config, "to_dict") else dict(vars(self.config))
        arch = (getattr(self.config, "architectures", None) or [type(self).__name__])[0]
        if family == "deepseek" and arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                                                 "DeepseekV32ForCausalLM"):
            arch = "DeepseekV3ForCausalLM"  # a VL wrapper's text model (Kimi-K2.5) is a DeepseekV3
        plan = plan_for_target(config, arch, layer_ids, server_draft_path(), settings.current().aux_layers)
        num_layers = int(config["num_hidden_layers"])
        _apply_plan(self, plan, num_layers, family)
        upstream = None
        if layer_ids is not None:
            upstream = to_output_ids(layer_ids, "sglang", family)
        note = "" if upstream in (None, list(plan.output_ids)) else \
            f" (upstream SGLang would capture outputs of {upstream})"
        logger.info("[sglang_ext] %s%s", plan.describe(num_layers), note)
        self._sglang_ext_aux_plan = plan
        return None

    set_eagle3_layers_to_capture.__sglang_ext_family__ = family
    return set_eagle3_layers_to_capture


HOOKS = (
    Hook("sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture", "around",
         make_hook("deepseek"), feature="aux-layer capture (DeepSeek-V2/V3, Kimi-K2.5 targets)"),
    Hook("sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture", "around", make_hook("llama"),
         feature="aux-layer capture (Llama-family targets)"),
)
