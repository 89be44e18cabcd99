"""Head-format checks and KV pool arithmetic (sglang_ext.config.pair, sglang_ext.config.kv), also through inspect-draft."""

import json
import os

import pytest

from conftest import kimi_k25_config, write_head, write_model_dir
from sglang_ext import checkpoint
from sglang_ext.config import Eagle3DraftConfig, TargetConfig, WeightMap, weight_map
from sglang_ext.config.values import load_json
from sglang_ext.errors import ConfigError
from sglang_ext.config import Eagle3DraftConfig
from sglang_ext.core.heads import Eagle3Head
from sglang_ext.config.pair import pair_errors
from sglang_ext.config.kv import (
    PoolSplit,
    canonical_kv_dtype,
    draft_kv_bytes_per_token,
    kv_dtype_errors,
    target_kv_bytes_per_token,
    upstream_draft_bytes_per_token,
)

BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=300, target_hidden_size=64)
HEADS = {
    "mha": dict(head_format="mha", num_key_value_heads=2, head_dim=16),
    "mha-vocab-fcnorm-normfc": dict(head_format="mha", draft_vocab_size=100, fc_norm=True, norm_before_fc=True),
    "mha-narrow": dict(head_format="mha", hidden_size=32, draft_vocab_size=100),
    "mla-qlora": dict(head_format="mla", q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16),
    "mla-plain-q-tied": dict(head_format="mla", q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=True, fc_norm=True),
}


@pytest.mark.parametrize("name", HEADS)
def test_expected_weights_are_what_the_core_exports(name):
    """The schema SGLang's loaders are checked against == the names and shapes our export writes."""
    cfg = Eagle3DraftConfig(**dict(BASE, **HEADS[name]))
    head = Eagle3Head(cfg)
    exported = {WeightMap.canonical(k): list(v.shape) for k, v in head.checkpoint_state().items()}
    required, optional = weight_map(cfg.head_format).expected(Eagle3DraftConfig.from_dict(cfg.to_dict()))
    assert set(required) <= set(exported), sorted(set(required) - set(exported))
    assert set(exported) <= set(required) | set(optional), sorted(set(exported) - set(required) - set(optional))
    for k, shape in exported.items():
        assert shape == required.get(k, optional.get(k)), k
    if cfg.hidden_size != cfg.target_hidden_size:
        assert "embed_tokens.weight" in exported  # SGLang cannot share the target's embedding


def test_legacy_names_are_normalised():
    assert WeightMap.canonical("midlayer.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert WeightMap.canonical("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert WeightMap.canonical("aux_norm_mid.weight") == "fc_norm.1.weight"


@pytest.fixture
def tiny_target(tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 512, "vocab_size": 512,
           "num_attention_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128}
    return TargetConfig.from_dict(cfg), write_model_dir(tmp_path / "t", cfg)


def _errors(target, path):
    return pair_errors(target, Eagle3DraftConfig.from_dict(load_json(path)), checkpoint.weight_shapes(path))


def _edit(path, **changes):
    cfg = load_json(path)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _drop_tensor(path, name):
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    t.pop(name)
    save_file(t, f)


def test_a_well_formed_pair_has_no_errors(tmp_path, tiny_target):
    target, _ = tiny_target
    for fmt in ("mha", "mla"):
        d = write_head(tmp_path / fmt, fmt, hidden=512, target_hidden=512, vocab=512, draft_vocab=128)
        assert _errors(target, d) == []


REFUSALS = [
    # (format, edit, field, words in the problem)
    ("mha", lambda d: _edit(d, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
     "draft.kv_lora_rank", "MLA fields"),
    ("mla", lambda d: _edit(d, kv_lora_rank=None), "draft.kv_lora_rank", "needs"),
    ("mha", lambda d: _edit(d, target_hidden_size=384), "draft.target_hidden_size", "aux states of width 384"),
    ("mha", lambda d: _edit(d, vocab_size=1000), "draft.vocab_size", "differs from the target's vocab_size 512"),
    ("mha", lambda d: _edit(d, draft_vocab_size=100), "draft.weights[d2t]", "length != draft_vocab_size 100"),
    ("mha", lambda d: _drop_tensor(d, "midlayer.self_attn.k_proj.weight"), "draft.weights", "missing"),
    ("mla", lambda d: _edit(d, q_lora_rank=None), "draft.weights", "does not have"),  # q_a_proj etc. are extra
    ("mla", lambda d: _edit(d, num_hidden_layers=2), "draft.num_hidden_layers", "one-layer"),
    ("mha", lambda d: _edit(d, num_attention_heads=8), "draft.weights[layers.0.self_attn.q_proj.weight]",
     "shape differs"),
]


@pytest.mark.parametrize("fmt,edit,field,words", REFUSALS)
def test_each_refusal_names_field_value_and_fix(tmp_path, tiny_target, run_cli, fmt, edit, field, words):
    target, target_dir = tiny_target
    d = write_head(tmp_path / "d", fmt, hidden=512, target_hidden=512, vocab=512, draft_vocab=128,
                   **({"q_lora_rank": 64} if fmt == "mla" else {}))
    if fmt == "mla":  # write_head's MLA default has no q_lora_rank; give it one so the last cases can drop it
        Eagle3Head(Eagle3DraftConfig.from_dict(load_json(d)).evolve(q_lora_rank=64)).save_pretrained(d)
    edit(d)
    errors = _errors(target, d)
    assert any(e.field == field and words in e.problem and e.fix for e in errors), [str(e) for e in errors]
    if words == "missing":  # the error lists the tensors by name
        assert next(e for e in errors if "missing" in e.problem).value == ["layers.0.self_attn.k_proj.weight"]
    rc, out = run_cli("inspect-draft", d, "--target", target_dir, "--json")
    assert rc == 1 and any(e["field"] == field for e in json.loads(out)["errors"])


def test_kv_dtype_option():
    assert canonical_kv_dtype(None) is None and canonical_kv_dtype("auto") is None
    assert canonical_kv_dtype("fp8") == "fp8_e4m3" and canonical_kv_dtype("bfloat16") == "bf16"
    with pytest.raises(ConfigError) as e:
        canonical_kv_dtype("int4")
    assert e.value.field == "--speculative-draft-kv-cache-dtype (SGLANG_EXT_DRAFT_KV_CACHE_DTYPE)" and "fp8_e4m3" in e.value.fix
    mha = Eagle3DraftConfig.from_dict({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "vocab_size": 10})
    mla = Eagle3DraftConfig.from_dict({"architectures": ["Eagle3DeepseekV2ForCausalLM"], "hidden_size": 64, "vocab_size": 10})
    assert kv_dtype_errors(mha, "fp8_e4m3", "bf16", (9, 0)) == []
    assert "cannot cache fp8_e4m3" in kv_dtype_errors(mha, "fp8_e4m3", "bf16", (8, 0))[0].problem  # A100
    assert "shares the target's latent KV layout" in kv_dtype_errors(mla, "fp8_e4m3", "bf16", (9, 0))[0].problem
    assert kv_dtype_errors(mla, "bf16", "bf16", (9, 0)) == []


def _kimi_heads():
    target = TargetConfig.from_dict(kimi_k25_config())
    mha = Eagle3DraftConfig.from_dict({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168, "vocab_size": 163840,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128})
    mla = Eagle3DraftConfig.from_dict({"architectures": ["Eagle3DeepseekV2ForCausalLM"], "hidden_size": 7168, "vocab_size": 163840,
                       "num_attention_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                       "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536})
    return target, mha, mla


def test_pool_arithmetic_kimi_k25_by_hand():
    target, mha, mla = _kimi_heads()
    # target: (kv_lora_rank 512 + qk_rope 64) x 61 layers x 2 bytes, replicated on every TP rank
    assert target_kv_bytes_per_token(target, "bf16") == 576 * 61 * 2 == 70272
    assert target_kv_bytes_per_token(target, "bf16", tp_size=8) == 70272
    assert target_kv_bytes_per_token(target, "fp8_e4m3") == 35136
    # upstream budgets a one-layer draft as one more target layer
    assert upstream_draft_bytes_per_token(target, "bf16") == 1152
    # MHA head: 8 KV heads x (K + V) x 128 x 2 bytes = 4 KiB; fp8 halves it; TP 8 leaves 1 KV head per rank
    assert draft_kv_bytes_per_token(mha, "bf16") == 8 * 2 * 128 * 2 == 4096
    assert draft_kv_bytes_per_token(mha, "fp8_e4m3") == 2048
    assert draft_kv_bytes_per_token(mha, "bf16", tp_size=8) == 512
    # MLA head: the target's latent layout, one layer
    assert draft_kv_bytes_per_token(mla, "bf16") == 1152 and draft_kv_bytes_per_token(mla, "bf16", 8) == 1152


def test_pool_split_by_hand():
    split = PoolSplit(budget_bytes=10 * 2 ** 30, target_bytes_per_token=70272, draft_bytes_per_token=4096, page_size=64)
    tokens = (10 * 2 ** 30 // (70272 + 4096)) // 64 * 64
    assert split.tokens == tokens == 144320  # 144382 tokens, down to whole 64-token pages
    assert split.target_bytes + split.draft_bytes <= 10 * 2 ** 30
    # upstream's sizing for the same pair overruns the budget by tokens x (4096 - 1152) bytes
    upstream = PoolSplit(10 * 2 ** 30, 70272, 1152, 64).tokens
    assert upstream * (70272 + 4096) > 10 * 2 ** 30
    # fp8 draft KV: half the draft bytes per token, more tokens for both pools
    assert PoolSplit(10 * 2 ** 30, 70272, 2048, 64).tokens > tokens


def test_pool_arithmetic_tiny_models():
    t = TargetConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 512,
                      "vocab_size": 512, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 8})
    assert target_kv_bytes_per_token(t) == 576 * 8 * 2 == 9216
    from sglang_ext.core import tiny

    cfg = tiny.deepseek_v3_config(num_layers=8, moe_layers=1, hidden=512, heads=8, vocab=512, q_lora_rank=256,
                                  kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128)
    mha = Eagle3DraftConfig.from_dict(tiny.head_config_for(cfg, "mha", [1, 3, 5]).to_dict())
    mla = Eagle3DraftConfig.from_dict(tiny.head_config_for(cfg, "mla", [1, 3, 5]).to_dict())
    assert draft_kv_bytes_per_token(mha) == 8 * 2 * 64 * 2 == 2048  # 8 KV heads, head_dim 64 under an MLA target
    assert draft_kv_bytes_per_token(mla) == 576 * 2 == 1152


def test_inspect_draft_prints_format_bytes_and_split(tmp_path, run_cli):
    t = write_model_dir(tmp_path / "kimi", kimi_k25_config())
    d = write_model_dir(tmp_path / "mha", {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168,
                                           "intermediate_size": 18432, "num_attention_heads": 64,
                                           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 163840,
                                           "draft_vocab_size": 32000, "num_hidden_layers": 1})
    rc, out = run_cli("inspect-draft", d, "--target", t, "--gpu-memory-gib", "141", "--mem-fraction-static", "0.9",
                      "--json")
    k = json.loads(out)["kv_pools"]
    assert rc == 0 and k["head_format"] == "mha"
    assert (k["target_bytes_per_token"], k["draft_bytes_per_token"], k["upstream_draft_bytes_per_token"]) == \
        (70272, 4096, 1152)
    assert k["split"]["tokens"] == int(k["split"]["budget_gib"] * 2 ** 30) // (70272 + 4096)
    assert k["upstream_overshoot_gib"] > 0
    rc, text = run_cli("inspect-draft", d, "--target", t, "--draft-kv-cache-dtype", "fp8")
    assert rc == 0 and "draft 2048 B/token (MHA head, fp8_e4m3)" in text and "split:" in text
    rc, text = run_cli("inspect-draft", d, "--target", t, "--draft-kv-cache-dtype", "int4")
    assert rc == 1 and "int4" in text


def test_triton_mla_latent_rule_mirrors_sglangs_decode_kernel():
    """SGLang 0.5.17's Triton MLA decode kernel compiled for DeepSeek's 512 + 64 and refused 256 + 64 on
    an H200 (`incompatible dimensions ... 256 and 512`): the rule computes its two tile widths."""
    from sglang_ext.config.pair import triton_mla_blocks, triton_mla_errors

    assert triton_mla_blocks(512, 64) == (512, 512) and triton_mla_blocks(256, 64) == (512, 256)
    assert triton_mla_blocks(256, 32) == (256, 256) and triton_mla_blocks(448, 64) == (512, 512)
    assert triton_mla_errors("target", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}) == []
    assert triton_mla_errors("target", {"hidden_size": 64}) == []  # not MLA
    (e,) = triton_mla_errors("draft", {"kv_lora_rank": 256, "qk_rope_head_dim": 64})
    assert e.field == "draft.kv_lora_rank" and e.value == 256 and "512" in e.fix and "attention-backend" in e.fix


def test_inspect_draft_refuses_an_mla_latent_triton_cannot_decode(tmp_path, run_cli):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 512, "vocab_size": 512,
           "num_attention_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 256, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128}
    t = write_model_dir(tmp_path / "t", cfg)
    d = write_head(tmp_path / "d", "mla", hidden=512, target_hidden=512, vocab=512, draft_vocab=128)
    rc, text = run_cli("inspect-draft", d, "--target", t)
    assert rc == 0 and "note: with --attention-backend triton: target.kv_lora_rank=256" in text
    rc, out = run_cli("inspect-draft", d, "--target", t, "--attention-backend", "triton", "--json")
    assert rc == 1 and "target.kv_lora_rank" in {e["field"] for e in json.loads(out)["errors"]}
