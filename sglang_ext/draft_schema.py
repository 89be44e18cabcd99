"""What a (target, Eagle3 head) pair must look like to be served, and what its KV pools cost.

Pure Python (no torch, no SGLang): `inspect-draft` runs it on a laptop, the serving adapters run
the same functions at server start, and the CPU tests pin both against hand-computed values.

* `pair_errors(target, draft, shapes)`: every reason to refuse the pair (ConfigError with field,
  value, problem, fix): MLA fields on an MHA architecture and the reverse, hidden size or
  vocabulary incompatible with the target, `d2t` length, missing / extra / mis-shaped weights.
* `expected_weights(draft)`: the serving checkpoint's names and shapes, in the layout SGLang
  0.5.17's `LlamaForCausalLMEagle3` / `Eagle3DeepseekV2ForCausalLM` load (also vLLM's).
* KV pool arithmetic: bytes per token of the target pool and of the draft pool (per TP rank), and
  the split of a KV budget between them. SGLang's draft shares the target's token allocator, so both
  pools always hold the same number of tokens; what differs is what each token costs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from sglang_ext.conventions import MLA_FIELDS, ConfigError, DraftSpec, TargetSpec, is_int, positive_number

DRAFT_KV_DTYPE_ENV = "SGLANG_EXT_DRAFT_KV_CACHE_DTYPE"

# cache dtype name -> (bytes per element, minimum CUDA compute capability to cache it)
KV_DTYPES = {"bf16": (2, (8, 0)), "fp16": (2, (7, 0)), "fp8_e4m3": (1, (8, 9)), "fp32": (4, (7, 0))}
KV_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3",
                    "float8_e4m3fn": "fp8_e4m3", "float32": "fp32"}


def canonical_kv_dtype(name: str | None, field: str = DRAFT_KV_DTYPE_ENV) -> str | None:
    """None / "auto" -> None (follow the target); else one of KV_DTYPES."""
    if name is None or str(name).strip().lower() in ("", "auto"):
        return None
    key = str(name).strip().lower()
    key = KV_DTYPE_ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ConfigError(field, name, "unknown KV cache dtype",
                          f"use one of auto, {', '.join(k for k in KV_DTYPES if k != 'fp32')}")
    return key


# SGLang 0.5.17's --kv-cache-dtype choices (server_args.py) -> bytes per element for the pool arithmetic
# (None: a packed 4-bit recipe with scales, not sized here)
TARGET_KV_DTYPES = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1,
                    "nvfp4": None, "fp4_mx_block16": None, "fp4_e2m1": None}


def target_kv_dtype(name: str | None, field: str = "--kv-cache-dtype") -> str:
    """The target's KV cache dtype as SGLang's --kv-cache-dtype takes it (auto: the bf16 model dtype)."""
    key = "auto" if name is None else str(name).strip().lower()
    if key not in TARGET_KV_DTYPES:
        raise ConfigError(field, name, "not one of SGLang 0.5.17's --kv-cache-dtype choices",
                          f"use one of {', '.join(TARGET_KV_DTYPES)}")
    return {"auto": "bf16", "bfloat16": "bf16"}.get(key, key)


def draft_kv_dtype_option() -> str | None:
    """The operator's draft KV dtype (environment; SGLang 0.5.17 has no per-draft server argument)."""
    return canonical_kv_dtype(os.environ.get(DRAFT_KV_DTYPE_ENV))


def kv_dtype_errors(draft: DraftSpec, draft_dtype: str | None, target_dtype: str,
                    compute_capability: tuple[int, int] | None = None) -> list[ConfigError]:
    """A draft KV dtype is allowed for a head that owns its layout (MHA); an MLA head caches in
    the target's latent layout and dtype (one MLA attention backend serves both)."""
    errors = []
    if draft_dtype is None or draft_dtype == target_dtype:
        return errors
    if draft.head_format == "mla":
        errors.append(ConfigError(DRAFT_KV_DTYPE_ENV, draft_dtype,
                                  f"an MLA head shares the target's latent KV layout and dtype ({target_dtype}); "
                                  "SGLang 0.5.17 builds one MLA attention backend configuration for both",
                                  f"unset {DRAFT_KV_DTYPE_ENV} (or set it to {target_dtype}), or change the "
                                  "target's --kv-cache-dtype, which the MLA head then follows"))
    need = KV_DTYPES[draft_dtype][1]
    if compute_capability is not None and tuple(compute_capability) < need:
        errors.append(ConfigError(DRAFT_KV_DTYPE_ENV, draft_dtype,
                                  f"this GPU (compute capability {compute_capability[0]}.{compute_capability[1]}) "
                                  f"cannot cache {draft_dtype} (needs {need[0]}.{need[1]}+)",
                                  f"use {DRAFT_KV_DTYPE_ENV}=bf16 or auto"))
    return errors


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def triton_mla_blocks(kv_lora_rank: int, qk_rope_head_dim: int) -> tuple[int, int]:
    """(BLOCK_DMODEL, BLOCK_DV) that SGLang 0.5.17's Triton MLA decode kernel picks
    (`sglang.kernels.ops.attention.decode_attention._decode_grouped_att_m_fwd`: Lk = latent + rope,
    Lv = latent; 576 and 288 are special-cased, anything else rounds up to a power of two)."""
    lk = kv_lora_rank + qk_rope_head_dim
    model = 512 if lk == 576 else 256 if lk == 288 else _next_pow2(lk)
    return model, _next_pow2(kv_lora_rank)


def triton_mla_errors(who: str, config: Mapping[str, Any]) -> list[ConfigError]:
    """An MLA latent the Triton decode kernel cannot tile: its tiles for the latent and for the value
    (the same latent) must have one width, else every decode step (CUDA-graph capture first) fails
    with a Triton compile error `incompatible dimensions ... 256 and 512`. Seen on an H200 with
    kv_lora_rank 256 + qk_rope_head_dim 64."""
    if not (is_int(config.get("kv_lora_rank")) and is_int(config.get("qk_rope_head_dim"))) or \
            config["kv_lora_rank"] <= 0 or config["qk_rope_head_dim"] < 0:
        return []  # not an MLA latent, or a field error reported elsewhere
    latent, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    model, dv = triton_mla_blocks(latent, rope)
    if model == dv:
        return []
    return [ConfigError(f"{who}.kv_lora_rank", latent,
                        f"with qk_rope_head_dim {rope}, SGLang 0.5.17's Triton MLA decode kernel tiles the latent+rope "
                        f"({latent + rope}) at {model} and the value ({latent}) at {dv}; it cannot compile that",
                        "use kv_lora_rank 512 with qk_rope_head_dim 64 (DeepSeek-V3 / Kimi-K2 layout), or a latent "
                        "whose width and width+rope round up to the same power of two, or another "
                        "--attention-backend")]


def triton_pair_errors(target: TargetSpec, draft: DraftSpec, target_triton: bool = True,
                       draft_triton: bool = True) -> list[ConfigError]:
    """triton_mla_errors for the MLA parts of a pair that decode on the Triton backend."""
    errors = []
    if target.is_mla and target_triton:
        errors += triton_mla_errors("target", target.text_config)
    if draft.head_format == "mla" and draft_triton:
        errors += triton_mla_errors("draft", draft.config)
    return errors


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def _num_aux(cfg: Mapping[str, Any]) -> int:
    if cfg.get("num_aux_hidden_states"):
        return int(cfg["num_aux_hidden_states"])
    eagle = eagle_config_of(cfg)
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    return len(ids) if ids else 3


def normalise_weight_name(name: str) -> str:
    """Checkpoint name -> canonical (`layers.0.` for the decoder layer, no `model.` prefix), the
    mappings SGLang's Eagle3 loaders apply (`midlayer` -> `layers.0`, legacy aux-norm names)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    for i, legacy in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
        name = name.replace(legacy, f"fc_norm.{i}")
    return name


def expected_weights(cfg: Mapping[str, Any], head_format: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(required, optional) {canonical name: shape} of an Eagle3 head checkpoint."""
    h = int(cfg["hidden_size"])
    th = int(cfg.get("target_hidden_size") or h)
    vocab = int(cfg["vocab_size"])
    dv = int(cfg.get("draft_vocab_size") or vocab)
    inter = int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    n_aux = _num_aux(cfg)
    eagle = eagle_config_of(cfg)
    p = "layers.0."
    req: dict[str, list[int]] = {"fc.weight": [h, th * n_aux], "norm.weight": [h]}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        req[f"{p}{n}.weight"] = [h]
    req.update({f"{p}mlp.gate_proj.weight": [inter, h], f"{p}mlp.up_proj.weight": [inter, h],
                f"{p}mlp.down_proj.weight": [h, inter]})
    if head_format == "mha":
        hd = int(cfg.get("head_dim") or h // heads)
        kv = int(cfg.get("num_key_value_heads") or heads)
        req.update({f"{p}self_attn.q_proj.weight": [heads * hd, 2 * h],
                    f"{p}self_attn.k_proj.weight": [kv * hd, 2 * h],
                    f"{p}self_attn.v_proj.weight": [kv * hd, 2 * h],
                    f"{p}self_attn.o_proj.weight": [h, heads * hd]})
        if eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)):
            req["input_norm.weight"] = [th * n_aux]
        if attention_bias(cfg):  # llama_eagle3.py keeps o_proj's bias (its qkv_proj is rebuilt without one)
            req[f"{p}self_attn.o_proj.bias"] = [h]
    else:
        nope, rope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
        kvr = int(cfg["kv_lora_rank"])
        a = f"{p}self_attn."
        if cfg.get("q_lora_rank") is not None:
            qr = int(cfg["q_lora_rank"])
            req.update({a + "q_a_proj.weight": [qr, 2 * h], a + "q_a_layernorm.weight": [qr],
                        a + "q_b_proj.weight": [heads * (nope + rope), qr]})
        else:
            req[a + "q_proj.weight"] = [heads * (nope + rope), 2 * h]
        req.update({a + "kv_a_proj_with_mqa.weight": [kvr + rope, 2 * h], a + "kv_a_layernorm.weight": [kvr],
                    a + "kv_b_proj.weight": [heads * (nope + vd), kvr], a + "o_proj.weight": [h, heads * vd]})
    if cfg.get("fc_norm") or cfg.get("use_aux_norm"):
        for i in range(n_aux):
            req[f"fc_norm.{i}.weight"] = [th]
    opt: dict[str, list[int]] = {"embed_tokens.weight": [vocab, h]}
    lm_head = {"lm_head.weight": [dv, h]}
    # SGLang takes the target's lm_head when the config names no draft vocabulary (or ties it)
    (opt if cfg.get("tie_word_embeddings") or cfg.get("draft_vocab_size") is None else req).update(lm_head)
    mapping = {"d2t": [dv], "t2d": [vocab]}
    if dv < vocab:
        req["d2t"] = mapping.pop("d2t")
    opt.update(mapping)
    if not uses_aux_states(cfg):  # a head of the last hidden state alone has no fc (weight_errors refuses one)
        opt["fc.weight"] = req.pop("fc.weight")
    return req, opt


def eagle_config_of(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The draft's eagle_config, {} when absent or not an object (parse_draft refuses the latter)."""
    eagle = cfg.get("eagle_config")
    return eagle if isinstance(eagle, Mapping) else {}


def uses_aux_states(cfg: Mapping[str, Any]) -> bool:
    """SGLang 0.5.17 (spec_aux_hidden_state.py) captures the target's aux states unless the draft's
    eagle_config.use_aux_hidden_state is false; without them the head is fed the last hidden state and its fc is
    skipped (llama_eagle3.py applies fc only when the widths differ)."""
    return bool(eagle_config_of(cfg).get("use_aux_hidden_state", True))


def attention_bias(cfg: Mapping[str, Any]) -> bool:
    """SGLang 0.5.17's LlamaDecoderLayer: `attention_bias` or `bias` gives the layer's o_proj a bias."""
    return bool(cfg.get("attention_bias") or cfg.get("bias"))


def weight_errors(draft: DraftSpec, shapes: Mapping[str, Mapping[str, Any]]) -> list[ConfigError]:
    """Missing, extra and mis-shaped tensors (by safetensors header), each list in one error."""
    if not shapes:
        return []
    req, opt = expected_weights(draft.config, draft.head_format)
    got = {normalise_weight_name(k): list(v["shape"]) for k, v in shapes.items()}
    errors = []
    missing = sorted(set(req) - set(got))
    extra = sorted(set(got) - set(req) - set(opt))
    if missing:
        errors.append(ConfigError("draft.weights", missing, f"{len(missing)} tensor(s) missing from the checkpoint",
                                  "export the head again (the names listed are what SGLang's "
                                  f"{draft.architecture} loads)"))
    if extra:
        errors.append(ConfigError("draft.weights", extra, f"{len(extra)} tensor(s) the {draft.head_format.upper()} "
                                  "head does not have (SGLang would skip them silently)",
                                  "check head format and config (fc_norm, q_lora_rank, norm_before_fc) "
                                  "or remove the tensors"))
    if draft.hidden_size != (draft.target_hidden_size or draft.hidden_size) and "embed_tokens.weight" not in got:
        errors.append(ConfigError("draft.weights", "embed_tokens.weight absent",
                                  f"the head's hidden size {draft.hidden_size} differs from the target's, so SGLang "
                                  "cannot share the target's embedding and would run with an uninitialised one",
                                  "ship embed_tokens.weight in the checkpoint"))
    if "fc.weight" in got and not uses_aux_states(draft.config):
        errors.append(ConfigError("draft.eagle_config.use_aux_hidden_state", False,
                                  f"false, but the checkpoint has fc.weight (in_features {got['fc.weight'][-1]}): "
                                  "the head was trained on the target's aux states, and SGLang would capture none "
                                  "and feed it the last hidden state instead (fc skipped, or a shape error)",
                                  "set eagle_config.use_aux_hidden_state to true (the default), or remove fc.weight "
                                  "for a head trained on the last hidden state alone"))
        return errors
    for name, shape in sorted(got.items()):
        want = req.get(name, opt.get(name))
        if want is not None and shape != want:
            errors.append(ConfigError(f"draft.weights[{name}]", shape, f"shape differs from the config's {want}",
                                      "fix hidden_size / heads / ranks / vocab in config.json or re-export"))
    return errors


# ---------------------------------------------------------------------------------------------
# Config compatibility
# ---------------------------------------------------------------------------------------------


# what transformers turns into a torch dtype (getattr(torch, name)) and SGLang serves
CONFIG_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
# rope_scaling types SGLang 0.5.17's get_rope builds (layers/rotary_embedding/factory.py)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "deepseek_yarn", "llama3", "longrope", "proportional")


# fields with a default that transformers 5.12's strict config classes refuse as null (LlamaConfig for an MHA head,
# DeepseekV3Config for an MLA head); exporters that fill a template from the model's attributes write such nulls
NULL_REFUSED = {"mha": ("initializer_range", "use_cache", "mlp_bias"),
                "mla": ("initializer_range", "use_cache", "moe_intermediate_size", "n_shared_experts",
                        "n_routed_experts", "routed_scaling_factor")}


def field_errors(draft: DraftSpec) -> list[ConfigError]:
    """Fields SGLang's loaders read, checked for type and range before anything computes with them: a
    string, float, null or zero there is a crash (or a mis-sized layer) after the target has loaded."""
    cfg, errors = draft.config, []

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
            errors.append(ConfigError(f"draft.{key}", v, f"must be at least {minimum}", f"set {key} >= {minimum}"))

    integer("intermediate_size", True)
    integer("num_attention_heads", True)
    integer("num_key_value_heads", False, allow_null=True)
    integer("head_dim", False, allow_null=True)
    integer("draft_vocab_size", False, allow_null=True)
    integer("target_hidden_size", False)  # llama_eagle3.py: hasattr -> null would be None * num_aux
    integer("max_position_embeddings", False)  # null: transformers refuses it; a RoPE cache needs a length
    integer("num_nextn_predict_layers", False, minimum=0, allow_null=True)  # SGLang int()s it for the pool budget
    if draft.head_format == "mla":
        for key in MLA_FIELDS:
            integer(key, False, allow_null=True)
        integer("q_lora_rank", False, allow_null=True)
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if draft.head_format == "mha" and is_int(heads) and is_int(kv) and heads > 0 and kv > 0 and heads % kv:
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
    for key in NULL_REFUSED[draft.head_format]:
        if key in cfg and cfg[key] is None:
            errors.append(ConfigError(f"draft.{key}", None, "null: transformers 5 refuses it when SGLang loads the "
                                      "config (the server fails after the target has loaded)",
                                      f"remove {key} (its default applies) or give it a value"))
    bools = ("attention_bias", "bias", "tie_word_embeddings") + (("mlp_bias",) if draft.head_format == "mha" else ())
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
    dv = cfg.get("draft_vocab_size")
    if cfg.get("tie_word_embeddings") is True and is_int(dv) and dv < draft.vocab_size:
        errors.append(ConfigError("draft.tie_word_embeddings", True,
                                  f"a tied head uses the target's embedding as its lm_head (all {draft.vocab_size} "
                                  f"rows), but draft_vocab_size {dv} maps draft ids through d2t: SGLang would score "
                                  "the first rows of the embedding and ignore the shipped lm_head.weight",
                                  "set tie_word_embeddings to false (the head's own lm_head is then loaded)"))
    return errors


# the target's (text) config fields this tool computes with -- head counts for TP splits, the MLA latent for the KV
# pools -- when present; null means "not set" for the nullable ones (no kv_lora_rank: not an MLA target)
TARGET_INT_FIELDS = {"num_attention_heads": False, "num_key_value_heads": True, "head_dim": True,
                     "kv_lora_rank": True, "q_lora_rank": True, "qk_rope_head_dim": False, "qk_nope_head_dim": False,
                     "v_head_dim": False}


def target_field_errors(target: TargetSpec) -> list[ConfigError]:
    """Typed fields of the target's config: a float or string there would size the KV pools wrongly (int(1.5) is 1)
    or fail in a layer's constructor after the weights have loaded."""
    prefix = "target.text_config." if target.nested_text_config else "target."
    errors = []
    for key, nullable in TARGET_INT_FIELDS.items():
        if key not in target.text_config:
            continue
        v = target.text_config[key]
        if v is None and nullable:
            continue
        if not is_int(v) or v < 1:
            errors.append(ConfigError(f"{prefix}{key}", v, "not an integer >= 1" + (" (or null)" if nullable else ""),
                                      f"fix {key} in the target's config.json (the model card's value)"))
    return errors


def config_errors(target: TargetSpec, draft: DraftSpec) -> list[ConfigError]:
    cfg = draft.config
    errors = target_field_errors(target) + field_errors(draft)
    if errors:  # the checks below compute with these fields
        return errors
    mla_fields = [f for f in ("q_lora_rank",) + MLA_FIELDS if cfg.get(f) is not None]
    if draft.head_format == "mha" and [f for f in mla_fields if f != "q_lora_rank"]:
        errors.append(ConfigError(f"draft.{mla_fields[0]}", cfg.get(mla_fields[0]),
                                  f"MLA fields {mla_fields} on the MHA architecture {draft.architecture}",
                                  "set architectures to ['Eagle3DeepseekV2ForCausalLM'] for an MLA head, "
                                  "or remove the MLA fields"))
    if draft.head_format == "mla":
        missing = [f for f in MLA_FIELDS if cfg.get(f) is None]
        if missing:
            errors.append(ConfigError(f"draft.{missing[0]}", None,
                                      f"the MLA architecture {draft.architecture} needs {list(MLA_FIELDS)}; "
                                      f"missing {missing}",
                                      "add them (for a Llama-style head use 'LlamaForCausalLMEagle3')"))
    if draft.num_hidden_layers != 1:
        errors.append(ConfigError("draft.num_hidden_layers", draft.num_hidden_layers,
                                  "SGLang 0.5.17 serves one-layer Eagle3 heads", "set num_hidden_layers to 1"))
    th = draft.target_hidden_size or draft.hidden_size
    if th != target.hidden_size:
        field = "draft.target_hidden_size" if draft.target_hidden_size else "draft.hidden_size"
        errors.append(ConfigError(field, th, f"the head reads aux states of width {th}, the target's hidden "
                                  f"size is {target.hidden_size}",
                                  f"set target_hidden_size to {target.hidden_size} (or train the head on this "
                                  "target)"))
    if draft.vocab_size != target.vocab_size:
        errors.append(ConfigError("draft.vocab_size", draft.vocab_size,
                                  f"differs from the target's vocab_size {target.vocab_size}",
                                  "a head shares the target's tokenizer: train it on this target"))
    dv = draft.draft_vocab_size
    if dv is not None and not 0 < dv <= draft.vocab_size:
        errors.append(ConfigError("draft.draft_vocab_size", dv, f"outside 1..vocab_size ({draft.vocab_size})",
                                  "set it to the length of d2t"))
    if draft.hidden_size != target.hidden_size and dv is None:
        errors.append(ConfigError("draft.hidden_size", draft.hidden_size,
                                  f"differs from the target's {target.hidden_size} and the head has no lm_head of "
                                  "its own (draft_vocab_size unset), so SGLang would share a mis-sized lm_head",
                                  "set draft_vocab_size and ship lm_head.weight"))
    return errors


def d2t_errors(draft: DraftSpec, shapes: Mapping[str, Mapping[str, Any]]) -> list[ConfigError]:
    dv = draft.draft_vocab_size or draft.vocab_size
    for name, meta in shapes.items():
        if normalise_weight_name(name) == "d2t" and list(meta["shape"]) != [dv]:
            return [ConfigError("draft.weights[d2t]", list(meta["shape"]),
                                f"length != draft_vocab_size {dv}", "re-export d2t with one entry per draft token, "
                                "or fix draft_vocab_size")]
    return []


def pair_errors(target: TargetSpec, draft: DraftSpec, shapes: Mapping[str, Mapping[str, Any]]) -> list[ConfigError]:
    errors = config_errors(target, draft)
    if not errors:  # shapes only mean something once the config is coherent
        errors = d2t_errors(draft, shapes) or weight_errors(draft, shapes)
    return errors


def tp_errors(target: TargetSpec, draft: DraftSpec, tp_size: int) -> list[ConfigError]:
    """Head counts a tensor-parallel size must split (SGLang asserts them in each attention layer's
    constructor): attention heads divisible by TP; KV heads divisible by TP, or TP by them (replicated)."""
    errors = []

    def check(who, heads, kv):
        if not is_int(heads) or heads <= 0:
            return
        if heads % tp_size:
            errors.append(ConfigError("--tp-size", tp_size, f"does not divide the {who}'s {heads} attention heads",
                                      "use a TP size that divides the head count (e.g. 1, 2, 4, 8)"))
        elif is_int(kv) and kv > 0 and (kv % tp_size if kv >= tp_size else tp_size % kv):
            errors.append(ConfigError("--tp-size", tp_size, f"and the {who}'s {kv} KV heads: neither divides the "
                                      "other", "use a TP size that divides the KV head count, or a multiple of it"))

    t = target.text_config
    check("target", t.get("num_attention_heads"), None if target.is_mla else t.get("num_key_value_heads"))
    c = draft.config
    check("draft", c.get("num_attention_heads"), c.get("num_key_value_heads") if draft.head_format == "mha" else None)
    return errors


# ---------------------------------------------------------------------------------------------
# KV pool arithmetic (SGLang 0.5.17: DefaultPoolConfigurator._compute_cell_size)
# ---------------------------------------------------------------------------------------------


def dtype_bytes(name: str) -> int:
    """Bytes per cached element: a draft dtype (KV_DTYPES) or a sized target dtype (TARGET_KV_DTYPES)."""
    if name in KV_DTYPES:
        return KV_DTYPES[name][0]
    size = TARGET_KV_DTYPES.get(name)
    if size is None:
        raise ValueError(f"KV cache dtype {name!r} is not sized by this tool")
    return size


def target_kv_bytes_per_token(target: TargetSpec, dtype: str = "bf16", tp_size: int = 1) -> int:
    """Per rank, all layers. MLA: the latent (kv_lora_rank + qk_rope_head_dim) is replicated on
    every rank; MHA: K and V of the rank's KV heads."""
    t = target.text_config
    layers = target.num_hidden_layers
    if target.is_mla:
        return (int(t["kv_lora_rank"]) + int(t["qk_rope_head_dim"])) * layers * dtype_bytes(dtype)
    heads = int(t["num_attention_heads"])
    kv = max(1, int(t.get("num_key_value_heads") or heads) // tp_size)
    hd = int(t.get("head_dim") or target.hidden_size // heads)
    return kv * 2 * hd * layers * dtype_bytes(dtype)


def draft_kv_bytes_per_token(draft: DraftSpec, dtype: str = "bf16", tp_size: int = 1) -> int:
    cfg = draft.config
    if draft.head_format == "mla":
        return (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * dtype_bytes(dtype)
    heads = int(cfg["num_attention_heads"])
    kv = max(1, int(cfg.get("num_key_value_heads") or heads) // tp_size)
    hd = int(cfg.get("head_dim") or draft.hidden_size // heads)
    return kv * 2 * hd * dtype_bytes(dtype)


def upstream_draft_bytes_per_token(target: TargetSpec, dtype: str = "bf16", tp_size: int = 1) -> int:
    """What SGLang 0.5.17 reserves for a one-layer draft: one more target layer."""
    return target_kv_bytes_per_token(target, dtype, tp_size) // target.num_hidden_layers


@dataclasses.dataclass(frozen=True)
class PoolSplit:
    budget_bytes: int
    target_bytes_per_token: int
    draft_bytes_per_token: int
    page_size: int = 1

    @property
    def tokens(self) -> int:
        per = self.target_bytes_per_token + self.draft_bytes_per_token
        n = self.budget_bytes // per if per else 0
        return n // self.page_size * self.page_size

    @property
    def target_bytes(self) -> int:
        return self.tokens * self.target_bytes_per_token

    @property
    def draft_bytes(self) -> int:
        return self.tokens * self.draft_bytes_per_token

    def to_dict(self) -> dict:
        gib = 2 ** 30
        return {"budget_gib": self.budget_bytes / gib, "tokens": self.tokens,
                "target_bytes_per_token": self.target_bytes_per_token,
                "draft_bytes_per_token": self.draft_bytes_per_token,
                "target_gib": self.target_bytes / gib, "draft_gib": self.draft_bytes / gib}

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"{self.tokens} tokens in both pools; target {self.target_bytes_per_token} B/token = "
                f"{self.target_bytes / gib:.3f} GiB, draft {self.draft_bytes_per_token} B/token = "
                f"{self.draft_bytes / gib:.3f} GiB (budget {self.budget_bytes / gib:.3f} GiB)")


def quantized_bytes_per_weight(config: Mapping[str, Any]) -> tuple[float | None, bool]:
    """(bytes per quantized linear weight, whether only the routed experts are quantized) from a target's
    `quantization_config`: DeepSeek-V3/R1's block fp8 (every decoder linear layer), Kimi-K2.x's
    compressed-tensors INT4 (routed experts; group scales included), other n-bit schemes (every linear
    layer). (None, False) when the weights are not quantized."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(q, Mapping):
        return None, False
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8" or "fp8" in str(q.get("fmt", "")).lower():
        return 1.0, False
    bits, group = q.get("bits") or q.get("num_bits") or q.get("w_bit"), q.get("group_size") or q.get("q_group_size")
    groups = q.get("config_groups")
    for g in (groups.values() if isinstance(groups, Mapping) else ()):  # compressed-tensors
        w = g.get("weights") if isinstance(g, Mapping) else None
        if isinstance(w, Mapping):  # anything else is not a scheme this estimate reads: unquantized bytes
            bits, group = w.get("num_bits", bits), w.get("group_size", group)
    if is_int(bits) and 0 < bits < 16:
        scale = 2.0 / group if is_int(group) and group > 0 else 0.0  # one bf16 scale per group
        return bits / 8 + scale, method == "compressed-tensors"
    return None, False


def estimate_weight_bytes(text_config: Mapping[str, Any], dtype_size: int = 2, tp_size: int = 1,
                          config: Mapping[str, Any] | None = None) -> int:
    """A per-rank parameter-byte estimate from a decoder config (DeepSeek/Kimi MoE or Llama), for
    inspect-draft's split when the target's safetensors are not at hand; `config` (the whole config)
    supplies the quantization. The server measures the real figure."""
    c = text_config
    h, v, layers = int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    if c.get("kv_lora_rank") is not None:
        nope, rope, vd, kvr = (int(c.get("qk_nope_head_dim") or 128), int(c.get("qk_rope_head_dim") or 64),
                               int(c.get("v_head_dim") or 128), int(c["kv_lora_rank"]))
        qr = c.get("q_lora_rank")
        q = (h * int(qr) + int(qr) * heads * (nope + rope)) if qr else h * heads * (nope + rope)
        attn = q + h * (kvr + rope) + kvr * heads * (nope + vd) + heads * vd * h
    else:
        hd = int(c.get("head_dim") or h // heads)
        kv = int(c.get("num_key_value_heads") or heads)
        attn = h * hd * (2 * heads + 2 * kv)
    inter = int(c.get("intermediate_size") or 4 * h)
    dense = 3 * h * inter
    n_routed = int(c.get("n_routed_experts") or 0)
    first_dense = int(c.get("first_k_dense_replace") or 0)
    if n_routed:
        moe_inter = int(c.get("moe_intermediate_size") or inter)
        routed = (layers - first_dense) * 3 * h * moe_inter * n_routed
        other_mlp = first_dense * dense + (layers - first_dense) * (
            3 * h * moe_inter * int(c.get("n_shared_experts") or 0) + h * n_routed)
    else:
        routed, other_mlp = 0, layers * dense
    embed = v * h * (1 if c.get("tie_word_embeddings") else 2)
    qbytes, experts_only = quantized_bytes_per_weight(config or c)
    if qbytes is None:
        qbytes = dtype_size
    if experts_only:
        total = routed * qbytes + (layers * attn + other_mlp + embed) * dtype_size
    else:
        total = (routed + layers * attn + other_mlp) * qbytes + embed * dtype_size
    return int(total) // tp_size
