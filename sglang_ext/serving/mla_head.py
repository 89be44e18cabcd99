"""MLA-format (DeepSeek-style) Eagle3 heads for SGLang 0.5.17, generalised.

Extends ``sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM`` (the lightseekorg
``*-eagle3-mla`` layout, loaded unchanged) where upstream stops:

* ``q_lora_rank: null`` -- a plain ``q_proj`` over the doubled (embedding + hidden) input instead
  of the low-rank query. Upstream raises, and its loader would silently drop
  ``kv_a_proj_with_mqa`` while waiting for a ``q_a_proj`` that never comes.
* more architecture names (``config.architectures.MLA_ARCHITECTURES``) served by this class and treated as MLA
  by ``ModelConfig`` (whose MLA list is hard-coded): see ``serving.registry``.

With ``q_lora_rank: null`` upstream's layer is built by `init_plain_q` (serving.registry's hook on
``Eagle3MLADecoderLayer.__init__``; upstream's refuses); its forward is upstream's.

EAGLE-3.1 ``fc_norm`` / ``norm_output``, ``d2t`` and the target's embedding / lm_head sharing are
upstream's and unchanged.
"""

from __future__ import annotations

import logging

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA, DeepseekV2MLP
from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
from sglang.srt.utils import add_prefix
from torch import nn

from sglang_ext.config.weights import WeightMap
from sglang_ext.serving import compat

logger = logging.getLogger(__name__)


def _rope(config):
    params = getattr(config, "rope_parameters", None)
    if params is not None:
        return params.get("rope_theta", 10000), (params if params.get("rope_type") != "default" else None)
    return config.rope_theta, config.rope_scaling


def init_plain_q(self, config, layer_id: int = 0, quant_config=None, prefix: str = "") -> None:
    """The Eagle3 MLA layer without a query low-rank projection. Upstream's forward runs it unchanged: MLA's
    q_lora_rank-None path reads ``q_proj`` / ``kv_a_proj_with_mqa`` directly."""
    nn.Module.__init__(self)
    self.hidden_size = config.hidden_size
    rope_theta, rope_scaling = _rope(config)
    self.self_attn = DeepseekV2AttentionMLA(
        config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, q_lora_rank=None, kv_lora_rank=config.kv_lora_rank,
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
        layer_id=layer_id, reduce_results=True, prefix=add_prefix("self_attn", prefix))
    attn = self.self_attn
    # Eagle3 feeds concat(input_layernorm(embed), hidden_norm(h)): twice the hidden width
    attn.q_proj = ColumnParallelLinear(
        2 * config.hidden_size, attn.num_heads * attn.qk_head_dim, bias=False, quant_config=quant_config,
        prefix=add_prefix("self_attn.q_proj", prefix), **compat.same_ranks_as(attn.q_proj))
    attn.kv_a_proj_with_mqa = ReplicatedLinear(
        2 * config.hidden_size, attn.kv_lora_rank + attn.qk_rope_head_dim, bias=False,
        quant_config=quant_config, prefix=add_prefix("self_attn.kv_a_proj_with_mqa", prefix))
    self.mlp = DeepseekV2MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                             hidden_act=config.hidden_act, quant_config=quant_config,
                             prefix=add_prefix("mlp", prefix))
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Eagle3MLAHeadForCausalLM(Eagle3DeepseekV2ForCausalLM):
    """Upstream's MLA Eagle3 head, also for ``q_lora_rank: null`` (its layer: `init_plain_q`)."""

    def load_weights(self, weights):
        if self.config.q_lora_rank is not None:
            return super().load_weights(weights)
        params = dict(self.named_parameters())
        rest = []
        for name, tensor in weights:  # upstream's loader waits for a q_a_proj that never comes: these go directly
            if "kv_a_proj_with_mqa" in name or ".q_proj." in name:
                param = params[WeightMap.sglang_parameter(name)]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                rest.append((name, tensor))
        return super().load_weights(rest)
EntryClass = [Eagle3MLAHeadForCausalLM]
