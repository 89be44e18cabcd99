"""Eagle3 heads (MHA and MLA): forward against an independent naive implementation, KV-cache and
training-time-test layouts, save/load, and the config fields SGLang's loaders read."""

import json
import math
import os
import re

import pytest
import torch

from sglang_ext.errors import ConfigError
from sglang_ext.core import tiny
from sglang_ext.config import Eagle3DraftConfig
from sglang_ext.core.heads import Eagle3Head
from sglang_ext.core.layers import KVCache, RotaryEmbedding

TOL = 1e-5


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope_naive(x, pos, theta, interleaved):
    """x [T, d] one head; rotate pairs with complex multiplication (independent of the module)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None].double() * freqs)
    xd = x.double()
    pairs = torch.complex(xd[:, 0::2], xd[:, 1::2]) if interleaved else torch.complex(xd[:, : d // 2], xd[:, d // 2:])
    y = pairs * rot
    if interleaved:
        return torch.stack([y.real, y.imag], -1).flatten(-2).to(x.dtype)
    return torch.cat([y.real, y.imag], -1).to(x.dtype)


def naive_head(W, cfg: Eagle3DraftConfig, emb_table, ids, hidden, pos, mask):
    """One Eagle3 step from raw checkpoint tensors; mask [T, T] (True = attend)."""
    p = "midlayer." if cfg.head_format == "mha" else "layers.0."
    e = emb_table[ids]
    h = hidden @ W["fc.weight"].T if hidden.shape[-1] != cfg.hidden_size else hidden
    x = torch.cat([rms(e, W[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                   rms(h, W[p + "hidden_norm.weight"], cfg.rms_norm_eps)], -1)
    T = len(ids)
    heads = []
    if cfg.head_format == "mha":
        d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = (x @ W[p + "self_attn.q_proj.weight"].T).view(T, nh, d)
        k = (x @ W[p + "self_attn.k_proj.weight"].T).view(T, nkv, d)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).view(T, nkv, d)
        for i in range(nh):
            qi = rope_naive(q[:, i], pos, cfg.rope_theta, False)
            ki = rope_naive(k[:, i // (nh // nkv)], pos, cfg.rope_theta, False)
            s = (qi @ ki.T) / math.sqrt(d)
            heads.append(torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v[:, i // (nh // nkv)])
    else:
        nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            qa = rms(x @ W[p + "self_attn.q_a_proj.weight"].T, W[p + "self_attn.q_a_layernorm.weight"], cfg.rms_norm_eps)
            q = (qa @ W[p + "self_attn.q_b_proj.weight"].T).view(T, nh, dn + dr)
        else:
            q = (x @ W[p + "self_attn.q_proj.weight"].T).view(T, nh, dn + dr)
        kva = x @ W[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        c, kpe = kva[:, : cfg.kv_lora_rank], kva[:, cfg.kv_lora_rank:]
        kv = (rms(c, W[p + "self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps)
              @ W[p + "self_attn.kv_b_proj.weight"].T).view(T, nh, dn + dv)
        kpe = rope_naive(kpe, pos, cfg.rope_theta, True)
        for i in range(nh):
            qi = torch.cat([q[:, i, :dn], rope_naive(q[:, i, dn:], pos, cfg.rope_theta, True)], -1)
            ki = torch.cat([kv[:, i, :dn], kpe], -1)
            s = (qi @ ki.T) / math.sqrt(dn + dr)
            heads.append(torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ kv[:, i, dn:])
    attn = torch.cat(heads, -1) @ W[p + "self_attn.o_proj.weight"].T
    r = attn + h
    m = rms(r, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    g = torch.nn.functional.silu(m @ W[p + "mlp.gate_proj.weight"].T) * (m @ W[p + "mlp.up_proj.weight"].T)
    out = g @ W[p + "mlp.down_proj.weight"].T + r
    logits = rms(out, W["norm.weight"], cfg.rms_norm_eps) @ W["lm_head.weight"].T
    return logits, out


@pytest.fixture(scope="module")
def targets():
    return {"ds": tiny.build_target(tiny.deepseek_v3_config(num_layers=4)),
            "llama": tiny.build_target(tiny.llama_config(num_layers=4))}


HEADS = [("mha", "llama", {}), ("mha", "ds", {}), ("mla", "ds", {}), ("mla", "ds", {"q_lora_rank": None}),
         ("mla", "llama", {})]


def make_head(fmt, tgt, targets, extra, seed=0):
    t = targets[tgt]
    cfg = tiny.head_config_for(t.config, fmt, [0, 1, 3], **extra)
    head = tiny.random_head(cfg, t, seed=seed, std=0.05)
    with torch.no_grad():  # non-trivial norms so a misplaced norm shows
        for n, p in head.named_parameters():
            if n.endswith("norm.weight") or ".norm." in n:
                p.uniform_(0.5, 1.5)
    return head


@pytest.mark.parametrize("fmt,tgt,extra", HEADS)
def test_forward_matches_naive(fmt, tgt, extra, targets):
    head = make_head(fmt, tgt, targets, extra)
    cfg = head.config
    W = head.checkpoint_state()
    T = 7
    ids = torch.randint(0, cfg.vocab_size, (T,))
    aux = torch.randn(T, cfg.num_aux * cfg.target_hidden_size)
    pos = torch.arange(3, 3 + T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = head(ids[None], aux[None], pos[None])
    ref_logits, ref_out = naive_head(W, cfg, head.embed_tokens.weight, ids, aux, pos, causal)
    assert torch.allclose(out.logits[0], ref_logits, atol=TOL, rtol=TOL)
    assert torch.allclose(out.hidden[0], ref_out, atol=TOL, rtol=TOL)
    # a draft step: hidden-size input skips fc
    h2 = out.hidden[0]
    out2 = head(ids[None], h2[None], pos[None] + 1)
    ref2, _ = naive_head(W, cfg, head.embed_tokens.weight, ids, h2, pos + 1, causal)
    assert torch.allclose(out2.logits[0], ref2, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("fmt,tgt,extra", HEADS[:3])
def test_incremental_cache_and_ttt_layout(fmt, tgt, extra, targets):
    head = make_head(fmt, tgt, targets, extra)
    cfg = head.config
    T = 9
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    aux = torch.randn(1, T, cfg.num_aux * cfg.target_hidden_size)
    pos = torch.arange(T)[None]
    full = head(ids, aux, pos)
    cache = KVCache()
    a = head(ids[:, :5], aux[:, :5], pos[:, :5], cache)
    b = head(ids[:, 5:], aux[:, 5:], pos[:, 5:], cache)
    assert len(cache) == T
    assert torch.allclose(torch.cat([a.logits, b.logits], 1), full.logits, atol=TOL, rtol=TOL)
    # training-time test, step 1: queries at t attend to context keys <= t and their own step-1 key
    cache = KVCache()
    step0 = head(ids, aux, pos, cache)
    ids1 = torch.randint(0, cfg.vocab_size, (1, T))
    mask = torch.cat([torch.ones(T, T, dtype=torch.bool).tril(), torch.eye(T, dtype=torch.bool)], dim=1)
    step1 = head(ids1, step0.hidden, pos + 1, cache, mask)
    # the same as decoding each position t alone after its context
    for t in (0, 4, T - 1):
        c = KVCache()
        head(ids[:, : t + 1], aux[:, : t + 1], pos[:, : t + 1], c)
        one = head(ids1[:, t:t + 1], step0.hidden[:, t:t + 1], pos[:, t:t + 1] + 1, c)
        assert torch.allclose(one.logits[0, 0], step1.logits[0, t], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("fmt,tgt,extra", HEADS)
def test_save_load_round_trip_is_exact(fmt, tgt, extra, targets, tmp_path):
    head = make_head(fmt, tgt, targets, extra)
    hot = torch.randperm(head.config.vocab_size)[:64].sort().values
    cfg = tiny.head_config_for(targets[tgt].config, fmt, [0, 1, 3], draft_vocab_size=64, **extra)
    head = tiny.random_head(cfg, targets[tgt])
    head.set_vocab_mapping(hot)
    head.save_pretrained(str(tmp_path), dtype=torch.float32)
    again = Eagle3Head.from_pretrained(str(tmp_path), target_embedding=targets[tgt].get_input_embeddings().weight)
    for (n1, a), (n2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    assert torch.equal(again.draft_to_target(torch.arange(64)), hot)
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["eagle_config"] == {"use_aux_hidden_state": True, "aux_layer_convention": "output",
                                     "eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    names = set(head.checkpoint_state())
    prefix = "midlayer." if fmt == "mha" else "layers.0."
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", prefix + "hidden_norm.weight"} <= names
    assert not any(n.startswith("embed_tokens") for n in names)  # shared from the target


def _sglang_config_reads(module_file):
    """Attributes SGLang reads as config.X (required) in a model file."""
    src = open(module_file).read()
    return set(re.findall(r"[^_a-z]config_?\.([a-z_]+)", src))


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_config_has_every_field_sglang_reads(fmt, targets):
    sglang = pytest.importorskip("sglang")
    models = os.path.join(os.path.dirname(sglang.__file__), "srt", "models")
    file = "llama_eagle3.py" if fmt == "mha" else "kimi_k25_eagle3.py"
    needed = _sglang_config_reads(os.path.join(models, file))
    needed -= {"intermediate_size_mlp", "model_type", "rope_parameters", "rope_scaling"}  # llama4-only / optional
    if fmt == "mha":  # LlamaDecoderLayer / LlamaAttention read these without a default
        needed |= {"num_attention_heads", "num_key_value_heads"}
    d = tiny.head_config_for(targets["ds"].config, fmt, [0, 1, 3]).to_dict()
    assert not needed - set(d), needed - set(d)
    assert d["num_hidden_layers"] == 1 and d["draft_vocab_size"] == d["vocab_size"]
    assert d["architectures"] == (["LlamaForCausalLMEagle3"] if fmt == "mha" else ["Eagle3DeepseekV2ForCausalLM"])
    again = Eagle3DraftConfig.from_dict(d)
    assert again.to_dict() == d


def test_yarn_rope_matches_transformers_deepseek_v3():
    """DeepSeek-V3 / Kimi-K2.5 YaRN: inv_freq, cos/sin mscale and softmax scale as transformers computes them."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    cfg = DeepseekV3Config(hidden_size=256, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
                           qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, rope_parameters=yarn,
                           max_position_embeddings=163840)
    theirs = DeepseekV3RotaryEmbedding(cfg)
    ours = RotaryEmbedding(64, 10000.0, yarn, interleaved=True)
    assert torch.allclose(ours.inv_freq, theirs.inv_freq.float(), rtol=1e-6)
    assert ours.cos_sin_scale == pytest.approx(theirs.attention_scaling)
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    assert (96 ** -0.5) * ours.softmax_scale_factor == pytest.approx(attn.scaling)


def test_undeclared_convention_survives_a_load_save_round_trip(targets, tmp_path):
    # a SpecForge-style export without a declared convention must not be re-stamped as 'output'
    d = tiny.head_config_for(targets["ds"].config, "mha", [2, 3, 4]).to_dict()
    del d["eagle_config"]["aux_layer_convention"]
    again = Eagle3DraftConfig.from_dict(d).to_dict()
    assert again["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 3, 4]}


def test_export_names_the_layers_for_vllm_too(targets):
    """vLLM reads the top-level eagle_aux_hidden_state_layer_ids as input ids (not eagle_config's): the export
    writes it, so both engines capture the layers the head was trained on."""
    from sglang_ext.config import Eagle3DraftConfig, TargetConfig
    from sglang_ext.config.aux_layers import engine_output_ids

    d = tiny.head_config_for(targets["ds"].config, "mha", [0, 1, 3]).to_dict()
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert d["eagle_config"]["aux_layer_convention"] == "output" and d["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    target = TargetConfig.from_dict(targets["ds"].config.to_dict())
    draft = Eagle3DraftConfig.from_dict(d)
    assert engine_output_ids("sglang-ext", target, draft) == engine_output_ids("vllm", target, draft) == [0, 1, 3]
    assert Eagle3DraftConfig.from_dict(d).to_dict() == d


def test_head_configs_no_loader_serves_are_refused_before_training(targets):
    cfg = targets["ds"].config
    with pytest.raises(ConfigError) as e:  # SGLang would take the target's embedding as lm_head, d2t or not
        tiny.head_config_for(cfg, "mha", [0, 1, 3], draft_vocab_size=16, tie_word_embeddings=True)
    assert e.value.field == "tie_word_embeddings"
    with pytest.raises(ConfigError) as e:  # no MLA loader has the input norm
        tiny.head_config_for(cfg, "mla", [0, 1, 3], norm_before_fc=True)
    assert e.value.field == "norm_before_fc"
