"""Architecture names for MLA-format Eagle3 heads.

Extends (hooks):
  * ``sglang.srt.configs.model_config.get_config`` (AFTER) -- a draft whose architecture is one of our MLA head
    names (config.architectures.MLA_ARCHITECTURES, e.g. ``Eagle3DeepseekV3ForCausalLM``) is read under upstream's
    name, ``Eagle3DeepseekV2ForCausalLM``: every attribute SGLang derives from it (the MLA branch of
    ``ModelConfig._derive_model_shapes``, whose list of MLA architectures is hard-coded; the latent KV pool; the MLA
    attention backend) is derived as for upstream's head.
  * ``sglang.srt.model_loader.utils.get_model_architecture`` (AROUND) -- upstream's MLA head class resolves to
    ``serving.mla_head.Eagle3MLAHeadForCausalLM`` (upstream's, generalised to ``q_lora_rank: null``).
  * ``sglang.srt.models.kimi_k25_eagle3.Eagle3MLADecoderLayer.__init__`` (AROUND) -- with ``q_lora_rank: null``
    the layer is built by ``serving.mla_head.init_plain_q`` (upstream's refuses).
SGLang's model modules are imported only when these run (serving.mla_head imports them).
"""

from __future__ import annotations

from sglang_ext.config.architectures import MLA_ARCH, MLA_ARCHITECTURES
from sglang_ext.serving.hooks import Hook


def get_config_after(result, *args, **kwargs):
    archs = list(getattr(result, "architectures", None) or [])
    if archs and archs[0] in MLA_ARCHITECTURES and archs[0] != MLA_ARCH:
        result.architectures = [MLA_ARCH] + archs[1:]
    return result


def get_model_architecture(original_fn, model_config):
    cls, arch = original_fn(model_config)
    if arch == MLA_ARCH:
        from sglang_ext.serving.mla_head import Eagle3MLAHeadForCausalLM

        return Eagle3MLAHeadForCausalLM, arch
    return cls, arch


def layer_init(original_fn, self, config, *args, **kwargs):
    if getattr(config, "q_lora_rank", None) is None:
        from sglang_ext.serving.mla_head import init_plain_q

        return init_plain_q(self, config, *args, **kwargs)
    return original_fn(self, config, *args, **kwargs)


HOOKS = (
    Hook("sglang.srt.configs.model_config.get_config", "after", get_config_after,
         feature="MLA heads under the name Eagle3DeepseekV3ForCausalLM"),
    Hook("sglang.srt.model_loader.utils.get_model_architecture", "around", get_model_architecture,
         feature="MLA heads with q_lora_rank null"),
    Hook("sglang.srt.models.kimi_k25_eagle3.Eagle3MLADecoderLayer.__init__", "around", layer_init,
         feature="MLA heads with q_lora_rank null"),
)
