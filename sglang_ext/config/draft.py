"""`Eagle3DraftConfig`: an Eagle3 draft head's config.json, typed. The only reader of a draft's config: the server's
startup check and capture hook, inspect-draft, the core heads, the trainer's export and the pair checks use it.

Two head formats, one config:

* ``mha`` -- Llama-style attention (SGLang's ``LlamaForCausalLMEagle3``, vLLM's ``Eagle3LlamaForCausalLM``):
  ``num_key_value_heads`` / ``head_dim`` shape the attention, its KV cache is K and V per KV head.
* ``mla`` -- DeepSeek multi-latent attention (``Eagle3DeepseekV2ForCausalLM``, lightseekorg's ``*-eagle3-mla``;
  ``Eagle3DeepseekV3ForCausalLM`` with this plugin): ``q_lora_rank`` (null: a plain q_proj), ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; its KV cache is the target's latent layout.

`from_dict` reads what SGLang's loaders read (and refuses a config they cannot read at all: no known architecture,
a malformed eagle_config, no hidden_size / vocab_size); `errors()` lists every other problem -- a field of the
wrong type or range, a contradiction between fields, a field no Eagle3 config has -- each naming the field, the
value and the fix. `load` (a directory or config.json) does both and refuses on any error.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from sglang_ext.config.architectures import (
    MHA_ARCH,
    MHA_ARCHITECTURES,
    MLA_ARCH,
    MLA_ARCHITECTURES,
    MLA_FIELDS,
    OTHER_DRAFT_ARCHITECTURES,
)
from sglang_ext.config.aux_layers import (
    CONVENTION_ALIASES,
    CONVENTION_FIELD,
    LAYER_IDS_FIELD,
    canonical_convention,
    from_output_ids,
    to_output_ids,
)
from sglang_ext.config.values import check_int, is_int, load_json, positive_number, require_int
from sglang_ext.errors import ConfigError, combined

# what transformers turns into a torch dtype (getattr(torch, name)) and SGLang serves
CONFIG_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
# rope_scaling types SGLang 0.5.17's get_rope builds (layers/rotary_embedding/factory.py)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "deepseek_yarn", "llama3", "longrope", "proportional")
# fields with a default that transformers 5.12's strict config classes refuse as null (LlamaConfig for an MHA head,
# DeepseekV3Config for an MLA head); exporters that fill a template from the model's attributes write such nulls
NULL_REFUSED = {"mha": ("initializer_range", "use_cache", "mlp_bias"),
                "mla": ("initializer_range", "use_cache", "moe_intermediate_size", "n_shared_experts",
                        "n_routed_experts", "routed_scaling_factor")}

# Fields a draft's config.json may carry that this config does not type: what transformers' PretrainedConfig,
# LlamaConfig and DeepseekV2/V3Config write (4.x and 5.x), which SGLang's loaders read or ignore. Kept on save.
PASSTHROUGH_FIELDS = frozenset({
    # PretrainedConfig (transformers 5) and its 4.x attributes
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "transformers_version", "model_type", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "id2label", "label2id",
    "output_attentions", "output_hidden_states", "problem_type", "return_dict", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder",
    "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "quantization_config",
    # LlamaConfig
    "initializer_range", "use_cache", "pretraining_tp", "attention_dropout", "mlp_bias", "rope_parameters",
    # DeepseekV2/V3Config (an MLA head is one dense DeepSeek layer; SGLang reads some of these for any DeepSeek config)
    "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "moe_intermediate_size", "n_shared_experts",
    "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group", "topk_method",
    "scoring_func", "norm_topk_prob", "aux_loss_alpha", "seq_aux", "ep_size", "rope_interleave", "qk_head_dim",
    # Qwen2/3-, Gemma- and MoE-derived templates (SpecForge, AngelSlim): read by neither engine for these heads, or by
    # vLLM only (layer_types, sliding_window, qkv_bias, is_causal, logit_scale)
    "max_window_layers", "sliding_window", "use_sliding_window", "layer_types", "decoder_sparse_step",
    "output_router_logits", "router_aux_loss_coef", "qkv_bias", "is_causal", "logit_scale", "final_logit_softcapping",
    "original_max_position_embeddings", "partial_rotary_factor", "rope_is_neox_style", "intermediate_size_mlp",
    "num_aux_layers", "norm_before_residual",
    # exporters' bookkeeping (TorchSpec, SpecForge, AngelSlim, transformers)
    "_torchspec_version", "target_model_type", "auto_map", "_attn_implementation", "modal_type", "use_mrope",
    "norm_bias",  # refused when true (errors())
    # legacy EAGLE fields SGLang still reads
    "bias",
})
# eagle_config's fields: SGLang's (eagle_aux_hidden_state_layer_ids, use_aux_hidden_state, norm_before_fc), vLLM's
# layer_ids, ours (aux_layer_convention)
# ModelOpt's and TorchSpec's layer-norm and parallel-draft switches, which no engine reads for an Eagle3 head
EAGLE_CONFIG_FIELDS = frozenset({LAYER_IDS_FIELD, "use_aux_hidden_state", "norm_before_fc", "layer_ids",
                                 CONVENTION_FIELD, "use_input_layernorm_in_first_layer", "use_last_layernorm",
                                 "use_mtp_layernorm", "next_layer_regular", "parallel_draft_step",
                                 "parallel_draft_heads_num_layers"})


def eagle_config_of(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The draft's eagle_config, {} when absent or not an object (from_dict refuses the latter)."""
    eagle = cfg.get("eagle_config")
    return eagle if isinstance(eagle, Mapping) else {}


def _layer_ids(value: Any, field: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(is_int(i) for i in value):
        raise ConfigError(field, value, "not a list of integers", "write a list such as [1, 29, 57]")
    return tuple(value)


def _rope(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """(rope_theta, rope_scaling) from a config of either transformers generation (v5 keeps both in
    rope_parameters; a rope_type of "default" is no scaling)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type"))
        return params.get("rope_theta", cfg.get("rope_theta", 10000.0)), (None if kind in (None, "default") else scaling)
    return cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")


@dataclasses.dataclass(frozen=True)
class Eagle3DraftConfig:
    """An Eagle3 head. One draft step: h = fc(concat(aux states)) (or the previous step's hidden state);
    x = concat(input_layernorm(embed(token)), hidden_norm(h)); r = attention(x) + h; out = mlp(norm(r)) + r;
    logits = lm_head(norm(out))."""

    head_format: str  # "mha" (Llama-style attention) or "mla" (DeepSeek multi-latent attention)
    hidden_size: int  # the head's width (its embedding, attention output, MLP input)
    intermediate_size: int  # the MLP's hidden width
    num_attention_heads: int  # query heads
    vocab_size: int  # the target's vocabulary: the head shares its tokenizer and embedding
    target_hidden_size: int | None = None  # width of one aux state (the target's hidden size); None: hidden_size
    num_aux: int = 3  # aux states concatenated into fc: num_aux_hidden_states, else len(aux_layer_ids), else 3
    aux_layer_ids: tuple[int, ...] | None = None  # the aux-layer ids as written (eagle_config's, else vLLM's field)
    aux_layer_convention: str | None = "output"  # how to read them (aux_layers.py); None: undeclared (SGLang's way)
    aux_ids_source: str = "eagle_config"  # where aux_layer_ids came from: "eagle_config" | "top-level" (vLLM's)
    vllm_layer_ids: tuple[int, ...] | None = None  # vLLM's field (top-level, else eagle_config.layer_ids): input ids
    draft_vocab_size: int | None = None  # the head's own output vocabulary (d2t maps it to target ids); None: full
    num_key_value_heads: int | None = None  # MHA: grouped-query KV heads (None: num_attention_heads)
    head_dim: int | None = None  # MHA: per-head width (None: hidden_size // num_attention_heads)
    q_lora_rank: int | None = None  # MLA: query low-rank width; None: a plain q_proj
    kv_lora_rank: int | None = None  # MLA: the latent KV width (what the KV cache holds, with qk_rope_head_dim)
    qk_nope_head_dim: int | None = None  # MLA: per-head query/key width without RoPE
    qk_rope_head_dim: int | None = None  # MLA: the decoupled RoPE key width (shared by all heads)
    v_head_dim: int | None = None  # MLA: per-head value width
    rms_norm_eps: float = 1e-6  # every RMSNorm's epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: Mapping[str, Any] | None = None  # RoPE scaling (rope_type one of ROPE_TYPES), None: none
    max_position_embeddings: int = 4096  # RoPE cache length
    hidden_act: str = "silu"  # the MLP's activation (SGLang's Eagle3 MLP supports only silu)
    tie_word_embeddings: bool = False  # lm_head is the embedding (only with the full vocabulary)
    attention_bias: bool = False  # o_proj has a bias (SGLang's Llama Eagle3 layer keeps only that one)
    use_aux_hidden_state: bool = True  # eagle_config: the target's aux states feed fc (false: its last hidden state)
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux state before fc (also written use_aux_norm)
    norm_before_fc: bool = False  # MHA: one RMSNorm over the concatenated aux states (eagle_config.norm_before_fc)
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads norm(out) instead of out
    num_hidden_layers: int = 1  # decoder layers (SGLang serves one-layer heads)
    architecture: str | None = None  # the class name as written; None: the format's canonical name
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # PASSTHROUGH_FIELDS as read, kept on save
    raw: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)  # config.json as read; None: built

    def __post_init__(self):
        if self.head_format not in ("mha", "mla"):
            raise ConfigError("head_format", self.head_format, "not a head format", "use 'mha' or 'mla'")
        if self.architecture is None:
            object.__setattr__(self, "architecture", MHA_ARCH if self.head_format == "mha" else MLA_ARCH)
        for key in ("aux_layer_ids", "vllm_layer_ids"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.raw is not None:
            return  # a config read from a file: errors() reports its contradictions, all of them
        # built in code (the trainer): refused when the config is made, before any training
        if self.tie_word_embeddings and self.draft_vocab < self.vocab_size:
            raise ConfigError("tie_word_embeddings", True,
                              f"a tied head's lm_head is the target's embedding (all {self.vocab_size} rows), which "
                              f"a draft vocabulary of {self.draft_vocab} cannot index; SGLang would drop the trained "
                              "lm_head", "leave tie_word_embeddings false (the default)")
        if self.norm_before_fc and self.head_format == "mla":
            raise ConfigError("norm_before_fc", True, "no MLA Eagle3 loader (SGLang 0.5.17's "
                              "Eagle3DeepseekV2ForCausalLM, vLLM's deepseek_eagle3) has the input norm; it would be "
                              "skipped at load", "use fc_norm (a norm per aux state, which they read) or an MHA head")

    def evolve(self, **changes) -> "Eagle3DraftConfig":
        """A copy with `changes`, as a config built in code (no longer the file as read)."""
        return dataclasses.replace(self, raw=None, **changes)

    # ------------------------------------------------------------------------------------ derived
    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def has_vocab_mapping(self) -> bool:
        return self.draft_vocab < self.vocab_size

    @property
    def target_hidden(self) -> int:
        """Width of one aux state."""
        return self.target_hidden_size or self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def mha_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def source(self) -> Mapping[str, Any]:
        """The config's fields as SGLang reads them: the file as read, else what to_dict writes."""
        return self.raw if self.raw is not None else self.to_dict()

    # ------------------------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "Eagle3DraftConfig":
        """Read a config.json object; refuses what no loader can read (see the module docstring)."""
        archs = cfg.get("architectures")
        if archs is not None and (not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs)):
            raise ConfigError("draft.architectures", archs, "not a list of class names",
                              'write a list such as ["LlamaForCausalLMEagle3"]')
        arch = (archs or [None])[0]
        if arch in MHA_ARCHITECTURES:
            fmt = "mha"
        elif arch in MLA_ARCHITECTURES:
            fmt = "mla"
        else:
            known = OTHER_DRAFT_ARCHITECTURES.get(arch)
            if known is None and "speculators_config" in cfg:
                known = OTHER_DRAFT_ARCHITECTURES["Eagle3Speculator"]
            generic = ('set architectures to ["LlamaForCausalLMEagle3"] (an MHA, Llama-style head) or '
                       '["Eagle3DeepseekV2ForCausalLM"] (an MLA, DeepSeek-style head)')
            raise ConfigError("draft.architectures", archs,
                              "missing" if arch is None else "not an Eagle3 head architecture SGLang 0.5.17 serves",
                              known or generic)
        eagle = cfg.get("eagle_config") or {}
        if not isinstance(eagle, Mapping):
            raise ConfigError("draft.eagle_config", eagle, "not an object", "write eagle_config as a JSON object")
        ids = _layer_ids(eagle.get(LAYER_IDS_FIELD), f"draft.eagle_config.{LAYER_IDS_FIELD}")
        top = _layer_ids(cfg.get(LAYER_IDS_FIELD), f"draft.{LAYER_IDS_FIELD}")
        vllm_ids = top if top is not None else _layer_ids(eagle.get("layer_ids"), "draft.eagle_config.layer_ids")
        declared = eagle.get(CONVENTION_FIELD)
        conv = canonical_convention(declared, f"draft.eagle_config.{CONVENTION_FIELD}") if declared is not None else None
        source = "eagle_config"
        if ids is None and top is not None:  # only vLLM's field: its ids are vLLM's (input ids) unless declared
            ids, source = top, "top-level"
            conv = conv or "input"
        num_aux = cfg.get("num_aux_hidden_states")
        num_aux = num_aux if is_int(num_aux) and num_aux > 0 else (len(ids) if ids else 3)
        theta, scaling = _rope(cfg)

        def typed(key, ok, default=None):
            v = cfg.get(key, default)
            return v if v is not None and ok(v) else default

        integer = lambda v: is_int(v) and v > 0  # noqa: E731
        return cls(
            head_format=fmt, architecture=arch,
            hidden_size=require_int(cfg, "hidden_size", "draft."),
            vocab_size=require_int(cfg, "vocab_size", "draft."),
            num_hidden_layers=check_int(cfg.get("num_hidden_layers", 1), "draft.num_hidden_layers", 1),
            intermediate_size=typed("intermediate_size", integer, 0),
            num_attention_heads=typed("num_attention_heads", integer, 0),
            target_hidden_size=typed("target_hidden_size", integer),
            num_aux=num_aux, aux_layer_ids=ids, aux_layer_convention=conv, aux_ids_source=source,
            vllm_layer_ids=vllm_ids, draft_vocab_size=typed("draft_vocab_size", integer),
            num_key_value_heads=typed("num_key_value_heads", integer), head_dim=typed("head_dim", integer),
            q_lora_rank=typed("q_lora_rank", integer), kv_lora_rank=typed("kv_lora_rank", integer),
            qk_nope_head_dim=typed("qk_nope_head_dim", integer), qk_rope_head_dim=typed("qk_rope_head_dim", integer),
            v_head_dim=typed("v_head_dim", integer),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6) if positive_number(cfg.get("rms_norm_eps", 1e-6)) else 1e-6,
            rope_theta=theta if positive_number(theta) else 10000.0,
            rope_scaling=scaling if isinstance(scaling, Mapping) else None,
            max_position_embeddings=typed("max_position_embeddings", integer, 4096),
            hidden_act=typed("hidden_act", lambda v: isinstance(v, str), "silu"),
            tie_word_embeddings=cfg.get("tie_word_embeddings") is True,
            attention_bias=bool(cfg.get("attention_bias") is True or cfg.get("bias") is True),
            use_aux_hidden_state=eagle.get("use_aux_hidden_state", True) is not False,
            fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm", False)),
            norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            norm_output=bool(cfg.get("norm_output", False)),
            extra={k: v for k, v in cfg.items() if k in PASSTHROUGH_FIELDS and k not in _WRITTEN},
            raw=dict(cfg))

    @classmethod
    def load(cls, path: str, strict: bool = True) -> "Eagle3DraftConfig":
        """A draft directory (or its config.json); `strict`: refuse it on any of `errors()` (one ConfigError
        carrying all of them)."""
        config = cls.from_dict(load_json(path))
        problems = config.errors() if strict else []
        if problems:
            raise combined(problems)
        return config

    # ------------------------------------------------------------------------------------ checks
    def errors(self) -> list[ConfigError]:
        """Every problem of this config on its own (pair_errors adds the target's): fields SGLang's loaders read,
        checked for type and range before anything computes with them -- a string, float, null or zero there is a
        crash (or a mis-sized layer) after the target has loaded -- contradictions, and fields no Eagle3 config has."""
        cfg, errors = self.source, []

        def integer(key, required, minimum=1, allow_null=False):
            if key not in cfg:
                if required:
                    errors.append(ConfigError(f"draft.{key}", None, "missing", f"set {key} in config.json"))
                return
            v = cfg[key]
            if v is None:
                if not allow_null:
                    errors.append(ConfigError(f"draft.{key}", None, "null (SGLang reads it as a number)",
                                              f"set {key} to an integer, or remove the key"))
            elif not is_int(v):
                errors.append(ConfigError(f"draft.{key}", v, "not an integer", f"write {key} as a JSON integer"))
            elif v < minimum:
                errors.append(ConfigError(f"draft.{key}", v, f"must be at least {minimum}",
                                          f"set {key} >= {minimum}"))

        integer("intermediate_size", True)
        integer("num_attention_heads", True)
        integer("num_key_value_heads", False, allow_null=True)
        integer("head_dim", False, allow_null=True)
        integer("draft_vocab_size", False, allow_null=True)
        integer("target_hidden_size", False)  # llama_eagle3.py: hasattr -> null would be None * num_aux
        integer("max_position_embeddings", False)  # null: transformers refuses it; a RoPE cache needs a length
        integer("num_nextn_predict_layers", False, minimum=0, allow_null=True)  # SGLang int()s it for the pool budget
        integer("num_aux_hidden_states", False)
        if self.head_format == "mla":
            for key in MLA_FIELDS:
                integer(key, False, allow_null=True)
            integer("q_lora_rank", False, allow_null=True)
        heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if self.head_format == "mha" and is_int(heads) and is_int(kv) and heads > 0 and kv > 0 and heads % kv:
            errors.append(ConfigError("draft.num_key_value_heads", kv, f"does not divide num_attention_heads {heads}",
                                      "use a divisor of num_attention_heads (grouped-query attention)"))
        for key in ("torch_dtype", "dtype"):
            v = cfg.get(key)
            if v is not None and (not isinstance(v, str) or v.replace("torch.", "") not in CONFIG_DTYPES):
                errors.append(ConfigError(f"draft.{key}", v, "not a dtype transformers and SGLang load",
                                          "use bfloat16 (the exported heads' dtype), float16 or float32"))
        if "hidden_act" in cfg and cfg["hidden_act"] != "silu":  # null too: transformers refuses it at config load
            errors.append(ConfigError("draft.hidden_act", cfg["hidden_act"],
                                      "SGLang 0.5.17's Eagle3 MLP supports only silu",
                                      'set hidden_act to "silu" (and train the head with it)'))
        rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
        for key, where in (("rms_norm_eps", cfg), ("rope_theta", cfg), ("rope_theta", rope_params)):
            if key in where and not positive_number(where[key]):  # a NaN eps or a negative RoPE base loads, then NaNs
                field = f"draft.{key}" if where is cfg else f"draft.rope_parameters.{key}"
                errors.append(ConfigError(field, where[key], "not a positive finite number",
                                          f"set {key} to the value the head was trained with (e.g. "
                                          f"{'1e-05' if key == 'rms_norm_eps' else '10000.0'})"))
        for key in NULL_REFUSED[self.head_format]:
            if key in cfg and cfg[key] is None:
                errors.append(ConfigError(f"draft.{key}", None, "null: transformers 5 refuses it when SGLang loads "
                                          "the config (the server fails after the target has loaded)",
                                          f"remove {key} (its default applies) or give it a value"))
        bools = ("attention_bias", "bias", "tie_word_embeddings") + (("mlp_bias",) if self.head_format == "mha" else ())
        for key in bools:
            if key in cfg and not isinstance(cfg[key], bool):
                errors.append(ConfigError(f"draft.{key}", cfg[key], "not a boolean", f"write {key} as true or false"))
        if "model_type" in cfg and not (isinstance(cfg["model_type"], str) and cfg["model_type"]):
            errors.append(ConfigError("draft.model_type", cfg["model_type"], "not a model type name",
                                      'write it as a string, e.g. "llama" (MHA head) or "deepseek_v3" (MLA head)'))
        eagle = eagle_config_of(cfg)
        if not isinstance(eagle.get("use_aux_hidden_state", True), bool):
            errors.append(ConfigError("draft.eagle_config.use_aux_hidden_state", eagle["use_aux_hidden_state"],
                                      "not a boolean", "write it as true (a head that reads the target's aux states, "
                                      "the default) or false"))
        rope = cfg.get("rope_scaling")
        if rope is not None:
            kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
            if kind not in ROPE_TYPES:
                errors.append(ConfigError("draft.rope_scaling", rope, "not a RoPE scaling SGLang 0.5.17 builds",
                                          f"use null or an object whose rope_type is one of {', '.join(ROPE_TYPES)}"))
        if cfg.get("norm_bias"):
            errors.append(ConfigError("draft.norm_bias", cfg["norm_bias"], "neither SGLang nor vLLM loads biases of an "
                                      "Eagle3 head's norms: they would be dropped silently",
                                      "export the head without norm biases (retrain it with bias-free RMSNorms)"))
        if self.head_format == "mha" and "draft_vocab_size" not in cfg and cfg.get("tie_word_embeddings") is not True:
            errors.append(ConfigError("draft.draft_vocab_size", None, "absent: SGLang 0.5.17's LlamaForCausalLMEagle3 "
                                      "reads config.draft_vocab_size with no default (the server fails at load)",
                                      "set draft_vocab_size to the rows of the head's lm_head.weight (or null to "
                                      "share the target's lm_head)"))
        dv = cfg.get("draft_vocab_size")
        if cfg.get("tie_word_embeddings") is True and is_int(dv) and dv < self.vocab_size:
            errors.append(ConfigError("draft.tie_word_embeddings", True,
                                      f"a tied head uses the target's embedding as its lm_head (all {self.vocab_size} "
                                      f"rows), but draft_vocab_size {dv} maps draft ids through d2t: SGLang would score "
                                      "the first rows of the embedding and ignore the shipped lm_head.weight",
                                      "set tie_word_embeddings to false (the head's own lm_head is then loaded)"))
        if errors:  # the checks below compute with these fields
            return errors + self._unknown_field_errors(cfg, eagle)
        mla_fields = [f for f in ("q_lora_rank",) + MLA_FIELDS if cfg.get(f) is not None]
        if self.head_format == "mha" and [f for f in mla_fields if f != "q_lora_rank"]:
            errors.append(ConfigError(f"draft.{mla_fields[0]}", cfg.get(mla_fields[0]),
                                      f"MLA fields {mla_fields} on the MHA architecture {self.architecture}",
                                      "set architectures to ['Eagle3DeepseekV2ForCausalLM'] for an MLA head, "
                                      "or remove the MLA fields"))
        if self.head_format == "mla":
            missing = [f for f in MLA_FIELDS if cfg.get(f) is None]
            if missing:
                errors.append(ConfigError(f"draft.{missing[0]}", None,
                                          f"the MLA architecture {self.architecture} needs {list(MLA_FIELDS)}; "
                                          f"missing {missing}",
                                          "add them (for a Llama-style head use 'LlamaForCausalLMEagle3')"))
            if self.norm_before_fc:
                errors.append(ConfigError("draft.eagle_config.norm_before_fc", True,
                                          "no MLA Eagle3 loader (SGLang 0.5.17's Eagle3DeepseekV2ForCausalLM, vLLM's "
                                          "deepseek_eagle3) has the input norm; it would be skipped at load",
                                          "remove it, or use fc_norm (a norm per aux state, which they read)"))
        if self.num_hidden_layers != 1:
            errors.append(ConfigError("draft.num_hidden_layers", self.num_hidden_layers,
                                      "SGLang 0.5.17 serves one-layer Eagle3 heads", "set num_hidden_layers to 1"))
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            errors.append(ConfigError("draft.draft_vocab_size", self.draft_vocab_size,
                                      f"outside 1..vocab_size ({self.vocab_size})", "set it to the length of d2t"))
        if self.aux_layer_ids is not None and is_int(cfg.get("num_aux_hidden_states")) and \
                cfg["num_aux_hidden_states"] != len(self.aux_layer_ids):
            errors.append(ConfigError("draft.num_aux_hidden_states", cfg["num_aux_hidden_states"],
                                      f"differs from the {len(self.aux_layer_ids)} aux-layer ids "
                                      f"{list(self.aux_layer_ids)}", "remove num_aux_hidden_states (the ids count "
                                      "the aux states) or list as many ids"))
        return errors + self._unknown_field_errors(cfg, eagle)

    @staticmethod
    def _unknown_field_errors(cfg: Mapping[str, Any], eagle: Mapping[str, Any]) -> list[ConfigError]:
        """Fields no Eagle3 config has: a misspelled field is a field SGLang silently does not read."""
        errors = []
        for where, keys, known in (("draft.", cfg, KNOWN_FIELDS), ("draft.eagle_config.", eagle, EAGLE_CONFIG_FIELDS)):
            for key in keys:
                if key in known:
                    continue
                near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
                errors.append(ConfigError(f"{where}{key}", keys[key], "not a field of an Eagle3 draft config (SGLang "
                                          "and vLLM do not read it)",
                                          f"did you mean {near[0]!r}?" if near else "remove it"))
        return errors

    # ------------------------------------------------------------------------------------ writing
    def to_dict(self) -> dict:
        """config.json as SGLang 0.5.17 (llama_eagle3.py / kimi_k25_eagle3.py) and vLLM read it."""
        d = dict(self.extra)
        d.update(architectures=[self.architecture],
                 model_type="llama" if self.head_format == "mha" else "deepseek_v3",
                 hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                 num_attention_heads=self.num_attention_heads, num_hidden_layers=1,
                 vocab_size=self.vocab_size, draft_vocab_size=self.draft_vocab,
                 target_hidden_size=self.target_hidden, rms_norm_eps=self.rms_norm_eps,
                 rope_theta=self.rope_theta, rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
                 max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act,
                 tie_word_embeddings=self.tie_word_embeddings, torch_dtype="bfloat16",
                 attention_bias=self.attention_bias, mlp_bias=False)
        if self.fc_norm:
            d["fc_norm"] = True
        if self.norm_output:
            d["norm_output"] = True
        if self.num_aux != (len(self.aux_layer_ids) if self.aux_layer_ids else 3):
            d["num_aux_hidden_states"] = self.num_aux
        if self.head_format == "mha":
            d.update(num_key_value_heads=self.kv_heads, head_dim=self.mha_head_dim)
        else:
            d.update(num_key_value_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
                     kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                     qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
            # DeepSeek config fields SGLang reads even for a dense one-layer draft (no None values:
            # transformers 5 validates DeepseekV3Config fields strictly)
            for k, v in dict(first_k_dense_replace=1, moe_layer_freq=1, num_nextn_predict_layers=0,
                             moe_intermediate_size=self.intermediate_size).items():
                d.setdefault(k, v)
        eagle: dict[str, Any] = {"use_aux_hidden_state": self.use_aux_hidden_state}
        if self.aux_layer_convention:  # a loaded undeclared config stays undeclared (read upstream's way)
            eagle[CONVENTION_FIELD] = self.aux_layer_convention
        if self.aux_layer_ids is not None:
            eagle[LAYER_IDS_FIELD] = list(self.aux_layer_ids)
        if self.norm_before_fc:
            eagle["norm_before_fc"] = True
        d["eagle_config"] = eagle
        conv = CONVENTION_ALIASES.get(str(self.aux_layer_convention).lower()) if self.aux_layer_convention else None
        if self.aux_layer_ids is not None and conv in ("output", "input"):
            # vLLM's field: it reads the top-level key (not eagle_config's), as input ids (docs/conventions.md)
            d[LAYER_IDS_FIELD] = from_output_ids(to_output_ids(self.aux_layer_ids, conv), "input")
        return d


# every field to_dict writes or from_dict reads by name
_WRITTEN = frozenset({
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
    "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "hidden_act", "tie_word_embeddings", "torch_dtype", "attention_bias", "mlp_bias",
    "fc_norm", "use_aux_norm", "norm_output", "norm_before_fc", "num_aux_hidden_states", "num_key_value_heads",
    "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "eagle_config",
    LAYER_IDS_FIELD, "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "moe_intermediate_size",
})
KNOWN_FIELDS = PASSTHROUGH_FIELDS | _WRITTEN
