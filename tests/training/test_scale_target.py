"""The MLA scale target (training/scale_target.py): SmolLM2's weights mapped into a DeepseekV3 (MLA)
student where shapes allow, RoPE kept exactly for KV group 0, a small CPU variant built end to end,
saved, loaded back by transformers, and deterministic given its seed."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from sglang_ext.training import scale_target as st

pytestmark = pytest.mark.slow  # loads SmolLM2: `make test`, not `make test-fast`


def test_group0_rope_survives_the_layout_change():
    """SmolLM2 rotates pairs (i, i + 32); DeepSeek's checkpoints store the rope part interleaved
    (pairs 2i, 2i + 1). `_interleave` must make q . k identical after each model's own RoPE."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    d, T = 64, 9
    q, k = torch.randn(1, 1, T, d), torch.randn(1, 1, T, d)
    inv = 1.0 / (100000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(T).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    q1, k1 = apply_rotary_pos_emb(q, k, cos, sin)
    qi, ki = st._interleave(q[0, 0].T).T[None, None], st._interleave(k[0, 0].T).T[None, None]
    q2, k2 = apply_rotary_pos_emb_interleave(qi, ki, cos, sin)
    torch.testing.assert_close(q1 @ k1.transpose(-1, -2), q2 @ k2.transpose(-1, -2), rtol=1e-4, atol=1e-4)


def test_factorisation_is_exact_at_full_rank():
    torch.manual_seed(0)
    m = torch.randn(40, 24)
    b, a = st._factor(m, 24)
    torch.testing.assert_close(b @ a, m, rtol=1e-5, atol=1e-5)
    b, a = st._factor(m, 8)
    assert a.shape == (8, 24) and b.shape == (40, 8) and (b @ a - m).norm() < m.norm()


@pytest.fixture(scope="module")
def smollm2():
    from sglang_ext.core.targets import load_target

    return load_target("smollm2")


def test_init_copies_what_shapes_allow(smollm2):
    from transformers import AutoModelForCausalLM

    cfg = st.student_config(smollm2.config, layers=3, moe_layers=1)
    assert cfg.first_k_dense_replace == 2 and cfg.qk_rope_head_dim == 64 and cfg.v_head_dim == 64
    student = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation="eager")
    errors = st.init_from_teacher(student, smollm2, torch.randint(0, 1000, (1, 32)), seed=0)
    assert 0 <= errors["q"] < 0.2 and 0 <= errors["kv"] < 0.2
    t, s = smollm2.model, student.model
    assert torch.equal(s.embed_tokens.weight, t.embed_tokens.weight)
    assert torch.equal(student.lm_head.weight, smollm2.lm_head.weight)
    for i in range(2):  # dense layers: MLP, o_proj and norms exactly
        assert torch.equal(s.layers[i].mlp.down_proj.weight, t.layers[i].mlp.down_proj.weight)
        assert torch.equal(s.layers[i].self_attn.o_proj.weight, t.layers[i].self_attn.o_proj.weight)
        assert torch.equal(s.layers[i].input_layernorm.weight, t.layers[i].input_layernorm.weight)
    moe = s.layers[2].mlp  # the MoE layer: experts ~ the dense MLP, the shared expert silent
    gate = t.layers[2].mlp.gate_proj.weight
    assert (moe.experts.gate_up_proj[1][: gate.shape[0]] - gate).norm() / gate.norm() < 0.02
    assert float(moe.shared_experts.down_proj.weight.abs().sum()) == 0.0
    # group 0's key is the shared rope key, interleaved
    rope_rows = s.layers[0].self_attn.kv_a_proj_with_mqa.weight[cfg.kv_lora_rank:]
    assert torch.equal(rope_rows, st._interleave(t.layers[0].self_attn.k_proj.weight[:64]))


def _build(tmp_path, name):
    import argparse

    ns = argparse.Namespace(teacher="smollm2", data="sharegpt:pkg:12", out=str(tmp_path / name), layers=2,
                            moe_layers=1, q_lora_rank=64, kv_lora_rank=64, steps=3, batch=1, seq_len=64, lr=1e-3,
                            heldout_windows=2, max_minutes=None, gsm8k_examples=0, gsm8k_data="", seed=0,
                            device="cpu")
    return st.build(ns, log=lambda *_: None)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One small build shared by the tests below (a build takes about a minute on CI's two cores)."""
    root = tmp_path_factory.mktemp("scale")
    return root / "a", _build(root, "a")


def test_small_cpu_variant_end_to_end_and_deterministic(built, tmp_path):
    from transformers import AutoModelForCausalLM

    out, r1 = built
    r2 = _build(tmp_path, "b")
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["q_lora_rank"] == 64
    assert cfg["moe_layer_freq"] == 1 and cfg["first_k_dense_replace"] == 1  # fields SGLang reads
    assert os.path.exists(out / "tokenizer.json") and os.path.exists(out / "scale_target_report.json")
    w1, w2 = load_file(out / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for k, v in w1.items() if v.is_floating_point())
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)  # same seed, same weights
    assert r1["kl_last"] == r2["kl_last"] and r1["steps"] == 3
    # the report says what the target was distilled on (the same recipe on other data is another target)
    d = r1["data"]
    assert d["spec"] == "sharegpt:pkg:12" and 1 <= d["conversations"] <= 12
    assert d["train_tokens"] >= 3 * 64 and d["heldout_tokens"] == 2 * 64
    assert d["epochs"] == round(3 / (d["train_tokens"] // 64), 2)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert model.config.kv_lora_rank == 64
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()


def test_widening_the_kv_latent_keeps_the_function(built, tmp_path):
    """A target built with a latent SGLang's Triton MLA decode cannot serve (the old 256 + rope 64) is
    rewritten with a repeated latent: same logits, a servable width, and the CLI refuses to build one."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "a")
    shutil.copytree(built[0], out)  # widened in place: a copy, so the shared build stays as built
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    before = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert st.widen_kv_latent(out, 128) == 64
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.kv_lora_rank == 128
    assert torch.allclose(model(ids).logits, before, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not a multiple"):
        st.widen_kv_latent(out, 192)
    with pytest.raises(SystemExit):
        st.main(["--kv-lora-rank", "256", "--device", "cpu", "--out", str(tmp_path / "c")])
