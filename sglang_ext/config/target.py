"""A target model's config, as far as serving an Eagle3 head under it needs: depth, width, vocabulary, attention
layout (MLA or not), family (how upstream SGLang reads aux-layer ids for it). Read from the raw config.json, the
decoder's fields nested under ``text_config`` for VL wrappers (Kimi-K2.5)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sglang_ext.config.architectures import architecture_of, target_family
from sglang_ext.config.values import is_int, load_json, require_int
from sglang_ext.errors import ConfigError

# the target's (text) config fields the pair checks compute with -- head counts for TP splits, the MLA latent for
# the KV pools -- when present; True: null means "not set" (no kv_lora_rank: not an MLA target)
INT_FIELDS = {"num_attention_heads": False, "num_key_value_heads": True, "head_dim": True, "kv_lora_rank": True,
              "q_lora_rank": True, "qk_rope_head_dim": False, "qk_nope_head_dim": False, "v_head_dim": False}


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    architecture: str  # architectures[0], else the one its model_type implies ("?" if neither)
    num_hidden_layers: int  # decoder layers
    hidden_size: int  # the residual stream's width: each aux state's width
    vocab_size: int
    text_config: Mapping[str, Any]  # the decoder's config (nested for VL wrappers)
    nested_text_config: bool  # whether the decoder's fields sit under text_config
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the whole config (quantization)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "TargetConfig":
        arch = architecture_of(cfg)
        nested = isinstance(cfg.get("text_config"), Mapping)
        text = cfg["text_config"] if nested else cfg
        prefix = "target.text_config." if nested else "target."
        return cls(architecture=arch, num_hidden_layers=require_int(text, "num_hidden_layers", prefix),
                   hidden_size=require_int(text, "hidden_size", prefix),
                   vocab_size=require_int(text, "vocab_size", prefix),
                   text_config=text, nested_text_config=nested, config=cfg)

    @classmethod
    def load(cls, path: str) -> "TargetConfig":
        """A target directory (or its config.json)."""
        return cls.from_dict(load_json(path))

    @property
    def family(self) -> str:
        return target_family(self.architecture)

    @property
    def is_mla(self) -> bool:
        return self.text_config.get("kv_lora_rank") is not None

    def field_errors(self) -> list[ConfigError]:
        """Typed fields: a float or string there would size the KV pools wrongly (int(1.5) is 1) or fail in a
        layer's constructor after the weights have loaded."""
        prefix = "target.text_config." if self.nested_text_config else "target."
        errors = []
        for key, nullable in INT_FIELDS.items():
            if key not in self.text_config:
                continue
            v = self.text_config[key]
            if v is None and nullable:
                continue
            if not is_int(v) or v < 1:
                errors.append(ConfigError(f"{prefix}{key}", v, "not an integer >= 1" + (" (or null)" if nullable else ""),
                                          f"fix {key} in the target's config.json (the model card's value)"))
        return errors
