"""Whether a (target, Eagle3 head) pair can be served, and under which server options: every reason to refuse it,
each a ConfigError naming the field, the value and the fix. Pure Python: inspect-draft runs it on a laptop and the
server's startup check runs the same functions before any weight is read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from sglang_ext.config.values import is_int
from sglang_ext.config.weights import weight_map
from sglang_ext.errors import ConfigError

if TYPE_CHECKING:
    from sglang_ext.config.draft import Eagle3DraftConfig
    from sglang_ext.config.target import TargetConfig


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


def triton_pair_errors(target: "TargetConfig", draft: "Eagle3DraftConfig", target_triton: bool = True,
                       draft_triton: bool = True) -> list[ConfigError]:
    """triton_mla_errors for the MLA parts of a pair that decode on the Triton backend."""
    errors = []
    if target.is_mla and target_triton:
        errors += triton_mla_errors("target", target.text_config)
    if draft.head_format == "mla" and draft_triton:
        errors += triton_mla_errors("draft", draft.source)
    return errors


def config_errors(target: "TargetConfig", draft: "Eagle3DraftConfig") -> list[ConfigError]:
    """Each config on its own, then the one against the other (widths, vocabulary)."""
    errors = target.field_errors() + draft.errors()
    if errors:  # the checks below compute with these fields
        return errors
    th = draft.target_hidden
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
    if draft.hidden_size != target.hidden_size and draft.draft_vocab_size is None:
        errors.append(ConfigError("draft.hidden_size", draft.hidden_size,
                                  f"differs from the target's {target.hidden_size} and the head has no lm_head of "
                                  "its own (draft_vocab_size unset), so SGLang would share a mis-sized lm_head",
                                  "set draft_vocab_size and ship lm_head.weight"))
    return errors


def pair_errors(target: "TargetConfig", draft: "Eagle3DraftConfig",
                shapes: Mapping[str, Mapping[str, Any]]) -> list[ConfigError]:
    """The configs, then (once they are coherent) the checkpoint's tensors against them."""
    errors = config_errors(target, draft)
    if not errors:  # shapes only mean something once the config is coherent
        errors = weight_map(draft.head_format).errors(draft, shapes)
    return errors


def tp_errors(target: "TargetConfig", draft: "Eagle3DraftConfig", tp_size: int) -> list[ConfigError]:
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
    check("draft", draft.num_attention_heads, draft.num_key_value_heads if draft.head_format == "mha" else None)
    return errors


def backend_errors(target: "TargetConfig", draft: "Eagle3DraftConfig", backend: str | None, draft_backend: str | None,
                   topk: int, deterministic: bool, adaptive: bool = False,
                   fa3_trees_inexact: str | None = "") -> tuple[list[ConfigError], list[str]]:
    """(refusals, warnings) for the pair on the server's attention backends (`backend` None: not known yet).
    `fa3_trees_inexact`: None where an FA3 draft tree is verified as decode rows (exact in deterministic mode,
    serving.fa3_verify), else why it is not ('' not known).

    Measured on an H200, SGLang 0.5.17, the tiny DeepseekV3 target of tests/gpu/check_serving.py (docs/results.md,
    "Attention backends"): on FlashInfer a draft tree (topk > 1) under an MLA target served greedy outputs that parted
    from the target alone's on 125 of 200 prompts (50 on FA3, 0 in a batch-invariant FA3 chain) -- wrong answers, not
    bf16 ties -- and an MLA head's tree failed at start inside a scheduler process ("Flashinfer MLA only supports
    topk=1"); on FA3 under --enable-deterministic-inference a chain equals the target alone token for token, a tree
    does not (64-69 of 200 identical). On FlashMLA (page size 64) an MLA head's chain serves with exact counters; an
    MHA head does not start (the draft's FlashMLA backend reads `kv_lora_rank`, which an MHA head has not -- upstream
    fails the same way), --speculative-adaptive fails in the draft's CUDA-graph capture, and SGLang itself refuses
    trees there (page size > 1)."""
    errors: list[ConfigError] = []
    warnings: list[str] = []
    if backend == "triton" or draft_backend == "triton":
        errors += triton_pair_errors(target, draft, backend == "triton", draft_backend == "triton")
    if target.is_mla and topk > 1 and "flashinfer" in (backend, draft_backend):
        errors.append(ConfigError("--speculative-eagle-topk", topk,
                                  "draft trees on the flashinfer attention backend under an MLA target: greedy outputs "
                                  "part from the target's (measured on 125 of 200 prompts), and an MLA head's tree "
                                  "does not start",
                                  "use --attention-backend fa3 (SGLang's default on Hopper) or triton for trees, or "
                                  "--speculative-eagle-topk 1 (chains) on flashinfer"))
    if draft_backend == "flashmla" and draft.head_format == "mha":
        errors.append(ConfigError("--attention-backend" if backend == "flashmla" else "--speculative-draft-attention-backend",
                                  "flashmla", "the draft's FlashMLA attention reads a latent KV layout (kv_lora_rank) that "
                                  f"an MHA-format head ({draft.architecture}) does not have: the server would fail "
                                  "building the draft worker",
                                  "serve an MLA-format head (Eagle3DeepseekV2ForCausalLM) on flashmla, or use "
                                  "--attention-backend fa3 (SGLang's default on Hopper) for an MHA head"))
    if adaptive and "flashmla" in (backend, draft_backend):
        errors.append(ConfigError("--speculative-adaptive", True, "on the flashmla attention backend the adaptive "
                                  "draft depths fail in CUDA-graph capture (FlashMLA's fixed query shape per step)",
                                  "use --attention-backend fa3 (SGLang's default on Hopper) or triton for adaptive "
                                  "drafting and the cost protection, or leave --speculative-adaptive off on flashmla"))
    if deterministic and topk > 1 and backend == "fa3" and target.is_mla and fa3_trees_inexact is not None:
        why = f" ({fa3_trees_inexact})" if fa3_trees_inexact else ""
        warnings.append("--enable-deterministic-inference with draft trees (--speculative-eagle-topk "
                        f"{topk}) on fa3 verified by upstream's cascade attention{why}: outputs are reproducible but "
                        "not equal to the target alone's (a chain's are); for exact greedy trees use "
                        "--speculative-mla-verify auto (the default) on SGLang 0.5.17 with a bf16 KV cache, or "
                        "--attention-backend triton --speculative-mla-verify decode")
    return errors, warnings
