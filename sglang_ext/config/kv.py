"""What KV pools cost: the cache dtypes (the target's SGLang --kv-cache-dtype, the draft's own), bytes per token of the
target pool and of the draft pool per TP rank, the split of a KV budget between them, and a target's weight bytes
when only its config is at hand. SGLang's draft shares the target's token allocator, so both pools always hold the
same number of tokens; what differs is what each token costs (SGLang 0.5.17: DefaultPoolConfigurator)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from sglang_ext.config.values import is_int
from sglang_ext.errors import ConfigError
from sglang_ext.settings import BY_ATTR

if TYPE_CHECKING:
    from sglang_ext.config.draft import Eagle3DraftConfig
    from sglang_ext.config.target import TargetConfig

DRAFT_KV_DTYPE_FIELD = BY_ATTR["draft_kv_cache_dtype"].label  # the server option (SGLang 0.5.18's flag name)

# cache dtype name -> (bytes per element, minimum CUDA compute capability to cache it)
KV_DTYPES = {"bf16": (2, (8, 0)), "fp16": (2, (7, 0)), "fp8_e4m3": (1, (8, 9)), "fp32": (4, (7, 0))}
KV_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3",
                    "float8_e4m3fn": "fp8_e4m3", "float32": "fp32"}


def canonical_kv_dtype(name: str | None, field: str = DRAFT_KV_DTYPE_FIELD) -> str | None:
    """None / "auto" -> None (follow the target); else one of KV_DTYPES."""
    if name is None or str(name).strip().lower() in ("", "auto"):
        return None
    key = str(name).strip().lower()
    key = KV_DTYPE_ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ConfigError(field, name, "unknown KV cache dtype",
                          f"use one of auto, {', '.join(k for k in KV_DTYPES if k != 'fp32')}")
    return key


# SGLang 0.5.18+'s own --speculative-draft-kv-cache-dtype choices (server_args / arg_groups/fields/spec.py) -> ours
# (fp8_e5m2 is not among the plugin's own choices; it is sized and cached as SGLang does)
UPSTREAM_DRAFT_KV_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def effective_draft_kv_dtype(option: str | None, upstream: str | None) -> str | None:
    """The draft's KV cache dtype (None: the target's) from the plugin's option (its variable; None: unset or auto)
    and SGLang's own flag of the same name (0.5.18+; None: not given or auto): the option where it names a dtype,
    else SGLang's; the two naming different dtypes are refused."""
    if upstream is None or str(upstream).strip().lower() in ("", "auto"):
        return option
    key = str(upstream).strip().lower()
    theirs = UPSTREAM_DRAFT_KV_DTYPES.get(key, key)
    if option is not None and option != theirs:
        raise ConfigError(DRAFT_KV_DTYPE_FIELD, option, f"names another draft KV cache dtype than SGLang's own "
                          f"--speculative-draft-kv-cache-dtype {upstream}, which this SGLang release parses",
                          f"pass the dtype once, as --speculative-draft-kv-cache-dtype, and unset "
                          f"{BY_ATTR['draft_kv_cache_dtype'].env}")
    return theirs


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


def kv_dtype_errors(draft: "Eagle3DraftConfig", draft_dtype: str | None, target_dtype: str,
                    compute_capability: tuple[int, int] | None = None) -> list[ConfigError]:
    """A draft KV dtype is allowed for a head that owns its layout (MHA); an MLA head caches in
    the target's latent layout and dtype (one MLA attention backend serves both)."""
    errors = []
    if draft_dtype is None or draft_dtype == target_dtype:
        return errors
    if draft.head_format == "mla":
        errors.append(ConfigError(DRAFT_KV_DTYPE_FIELD, draft_dtype,
                                  f"an MLA head shares the target's latent KV layout and dtype ({target_dtype}); "
                                  "SGLang 0.5.17 builds one MLA attention backend configuration for both",
                                  f"leave {DRAFT_KV_DTYPE_FIELD} at auto (or set it to {target_dtype}), or change the "
                                  "target's --kv-cache-dtype, which the MLA head then follows"))
    need = KV_DTYPES[draft_dtype][1] if draft_dtype in KV_DTYPES else None  # else one SGLang (0.5.18+) checks itself
    if compute_capability is not None and need is not None and tuple(compute_capability) < need:
        errors.append(ConfigError(DRAFT_KV_DTYPE_FIELD, draft_dtype,
                                  f"this GPU (compute capability {compute_capability[0]}.{compute_capability[1]}) "
                                  f"cannot cache {draft_dtype} (needs {need[0]}.{need[1]}+)",
                                  f"use {DRAFT_KV_DTYPE_FIELD} bf16 or auto"))
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


def target_kv_bytes_per_token(target: "TargetConfig", dtype: str = "bf16", tp_size: int = 1) -> int:
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


def draft_kv_bytes_per_token(draft: "Eagle3DraftConfig", dtype: str = "bf16", tp_size: int = 1) -> int:
    """Per rank, the head's one layer. MLA: the latent, replicated; MHA: K and V of the rank's KV heads."""
    if draft.head_format == "mla":
        return (draft.kv_lora_rank + draft.qk_rope_head_dim) * dtype_bytes(dtype)
    return max(1, draft.kv_heads // tp_size) * 2 * draft.mha_head_dim * dtype_bytes(dtype)


def upstream_draft_bytes_per_token(target: "TargetConfig", dtype: str = "bf16", tp_size: int = 1) -> int:
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
