"""Architecture names for MLA-format Eagle3 heads.

Extends (AROUND hooks, registered by sglang_ext.plugin):
  * ``sglang.srt.model_loader.utils.get_model_architecture`` -- every name in
    ``conventions.MLA_ARCHITECTURES`` (upstream's ``Eagle3DeepseekV2ForCausalLM`` and ours) resolves
    to ``serving.mla_head.Eagle3MLAHeadForCausalLM`` (upstream's class, generalised).
  * ``sglang.srt.configs.model_config.ModelConfig._derive_model_shapes`` -- upstream's list of MLA
    architectures is hard-coded; our names take upstream's MLA branch (latent KV pool, MLA backend).
Both run the upstream function with the architecture read as ``Eagle3DeepseekV2ForCausalLM`` so that
every attribute upstream derives from it is derived the same way.
"""

from __future__ import annotations

import contextlib

from sglang_ext.conventions import MLA_ARCHITECTURES

UPSTREAM_MLA_HEAD = "Eagle3DeepseekV2ForCausalLM"


@contextlib.contextmanager
def _read_as_upstream(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs and archs[0] in MLA_ARCHITECTURES and archs[0] != UPSTREAM_MLA_HEAD:
        hf_config.architectures = [UPSTREAM_MLA_HEAD] + archs[1:]
        try:
            yield
        finally:
            hf_config.architectures = archs
    else:
        yield


def get_model_architecture(original_fn, model_config):
    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if not archs or archs[0] not in MLA_ARCHITECTURES:
        return original_fn(model_config)
    with _read_as_upstream(model_config.hf_config):
        _, arch = original_fn(model_config)
    from sglang_ext.serving.mla_head import Eagle3MLAHeadForCausalLM

    return Eagle3MLAHeadForCausalLM, arch


def derive_model_shapes(original_fn, self, *args, **kwargs):
    with _read_as_upstream(self.hf_config):
        return original_fn(self, *args, **kwargs)


HOOKS = {
    "sglang.srt.model_loader.utils.get_model_architecture": get_model_architecture,
    "sglang.srt.configs.model_config.ModelConfig._derive_model_shapes": derive_model_shapes,
}
