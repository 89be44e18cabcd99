"""The reference speculative decoder: greedy speculation is exactly the target's greedy decoding
(chain and tree, MHA and MLA heads, DeepseekV3 and Llama targets); a head that predicts the target
gets every draft accepted and a random one ~none; sampling verification is lossless."""

import math

import pytest
import torch

from sglang_ext.core import tiny
from sglang_ext.core.decoder import ReferenceDecoder
from sglang_ext.core.drafting import DraftTree
from sglang_ext.core.verify import SamplingParams, target_probs, verify

SPEC = [(1, None), (4, 8)]  # chain (topk 1, 3 steps); tree (topk 4, 3 steps, 8 draft tokens)


@pytest.fixture(scope="module")
def targets64():
    return {"ds": tiny.build_target(tiny.deepseek_v3_config(num_layers=4, moe_layers=1), dtype=torch.float64),
            "llama": tiny.build_target(tiny.llama_config(num_layers=4), dtype=torch.float64)}


@pytest.mark.parametrize("tgt", ["ds", "llama"])
@pytest.mark.parametrize("fmt", ["mha", "mla"])
@pytest.mark.parametrize("topk,ndt", SPEC)
def test_greedy_speculation_equals_target_greedy(targets64, tgt, fmt, topk, ndt):
    t = targets64[tgt]
    head = tiny.random_head(tiny.head_config_for(t.config, fmt, [0, 1, 3]), t, seed=3).double()
    dec = ReferenceDecoder(t, head, num_steps=3, topk=topk, num_draft_tokens=ndt)
    for seed in range(2):
        prompt = torch.randint(3, 500, (12 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        spec = dec.generate(prompt, 48)
        plain = dec.generate(prompt, 48, speculative=False)
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == 48 and spec.finish_reason == "length"
        # accounting invariant: completion tokens = sum(a + 1) + 1 (the prefill token)
        assert len(spec.tokens) == sum(a + 1 for a in spec.accepted_per_step) + 1
        assert spec.stats.accepted_drafts_per_step < 0.5  # a random head is (almost) never right
    dec.close()


def successor_pair(V=40, hd=64, c=4.0, s=4.0):
    """A 2-layer Llama target (layers zeroed) whose next token is f(current token) for a fixed permutation f, and an
    MHA Eagle3 head built to predict exactly f(fed token) at every draft step (attention locked on
    the current position through RoPE on a constant embedding component)."""
    H = 1 + V + 7
    cfg = tiny.llama_config(num_layers=2, hidden=H, heads=1, kv_heads=1, vocab=V, head_dim=hd)
    t = tiny.build_target(cfg, dtype=torch.float64)
    f = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    inv = torch.argsort(f)
    E = torch.zeros(V, H, dtype=torch.float64)
    E[:, 0] = c
    E[torch.arange(V), 1 + torch.arange(V)] = s
    with torch.no_grad():
        t.get_input_embeddings().weight.copy_(E)
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        lm = torch.zeros(V, H, dtype=torch.float64)
        lm[torch.arange(V), 1 + inv] = 1.0  # logit_y peaks where f^-1(y) is the current token
        t.lm_head.weight.copy_(lm)
    hc = tiny.head_config_for(cfg, "mha", [0, 1], num_key_value_heads=1, head_dim=hd, num_attention_heads=1,
                              rope_theta=100.0)
    head = tiny.random_head(hc, t).double()
    r = math.sqrt((c * c + s * s) / H)  # RMS of every embedding row
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2 and p is not head.embed_tokens.weight:
                p.zero_()
        a = head.layer.self_attn
        alpha = 12.0  # q/k on the 8 fastest rotary pairs: self scores beat any other offset by >= 200
        a.q_proj.weight[:8, 0] = alpha * r / c
        a.k_proj.weight[:8, 0] = alpha * r / c
        a.v_proj.weight[torch.arange(V), 1 + torch.arange(V)] = r / s  # value = one-hot of the fed token ...
        # ... minus the fed hidden state (the previous step's one-hot, RMS 1/sqrt(H)), which the residual adds back
        a.v_proj.weight[torch.arange(V), H + 1 + torch.arange(V)] = -1.0 / math.sqrt(H)
        a.o_proj.weight[1 + torch.arange(V), torch.arange(V)] = 1.0
        head.lm_head.weight[torch.arange(V), 1 + inv] = 1.0
    return t, head


@pytest.mark.parametrize("topk,ndt", SPEC)
def test_exact_head_gets_every_draft_accepted(topk, ndt):
    t, head = successor_pair()
    dec = ReferenceDecoder(t, head, num_steps=3, topk=topk, num_draft_tokens=ndt)
    g = dec.generate([5, 9, 11], 40)
    assert g.tokens == dec.generate([5, 9, 11], 40, speculative=False).tokens
    full_steps = g.accepted_per_step[:-1]  # the last step may stop inside its run (max_new_tokens)
    assert full_steps and all(a == 3 for a in full_steps)
    assert g.stats.per_position_acceptance[:2] == [1.0, 1.0]
    assert len(g.tokens) == sum(a + 1 for a in g.accepted_per_step) + 1


def test_random_head_on_the_same_target_gets_none_accepted():
    t, exact = successor_pair()
    rnd = tiny.random_head(exact.config, t, seed=7).double()
    g = ReferenceDecoder(t, rnd, num_steps=3).generate([5, 9, 11], 40)
    assert g.stats.accepted_drafts_per_step < 0.2


# -------------------------------------------------------------------------- sampling is lossless

def _tree_two_children():
    # root -> nodes 0 (token 1), 1 (token 2); node 0 -> node 2 (token 3)
    return DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, -1, 0]),
                     depths=torch.tensor([1, 1, 2]), scores=torch.tensor([0.5, 0.3, 0.2]))


def _sample_first_two(tree, logits, sp, n, seed, buggy=False):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1], logits.shape[-1])
    for _ in range(n):
        if buggy:  # a wrong rule: accept child c with probability p(c), never renormalise
            p = target_probs(logits[0], sp)
            first = next((int(tree.tokens[c]) for c in tree.children(-1)
                          if torch.rand((), generator=gen) < p[int(tree.tokens[c])]), None)
            if first is None:
                first = int(torch.multinomial(p, 1, generator=gen))
            counts[first, 0] += 1
            continue
        r = verify(tree, logits, sp, gen)
        toks = r.accepted_tokens + [r.bonus_token]
        counts[toks[0], toks[1] if len(toks) > 1 else 0] += 1 if len(toks) > 1 else 0
        if len(toks) == 1:
            counts[toks[0], 0] += 1
    return counts


def test_sampling_verification_preserves_the_target_distribution():
    scipy_stats = pytest.importorskip("scipy.stats")
    V = 6
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 1.5
    sp = SamplingParams(temperature=1.0)
    tree = _tree_two_children()
    n = 20000
    counts = _sample_first_two(tree, logits, sp, n, seed=0)
    p0 = target_probs(logits[0], sp)
    first = counts.sum(1)
    chi = scipy_stats.chisquare(first.numpy(), (p0 * n).numpy())
    assert chi.pvalue > 1e-3, chi
    # given the first token was draft node 0's token (1), the second follows the target at node 0
    second = counts[1]
    p1 = target_probs(logits[1], sp)
    chi2 = scipy_stats.chisquare(second.numpy(), (p1 * second.sum()).numpy())
    assert chi2.pvalue > 1e-3, chi2
    # the test has power: a rule that skips renormalisation is rejected
    bad = _sample_first_two(tree, logits, sp, n, seed=0, buggy=True).sum(1)
    assert scipy_stats.chisquare(bad.numpy(), (p0 * n).numpy()).pvalue < 1e-6


def test_top_p_top_k_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and p.sum().item() == pytest.approx(1.0)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
def test_sampled_speculation_matches_plain_sampling_end_to_end():
    scipy_stats = pytest.importorskip("scipy.stats")
    t = tiny.build_target(tiny.llama_config(num_layers=2, vocab=12, hidden=64), dtype=torch.float64)
    with torch.no_grad():
        t.lm_head.weight.mul_(20)  # a peaked, non-trivial distribution
    head = tiny.random_head(tiny.head_config_for(t.config, "mha", [0, 1]), t, seed=0).double()
    dec = ReferenceDecoder(t, head, num_steps=2, topk=2, num_draft_tokens=4)
    sp = SamplingParams(temperature=1.0)
    n = 600
    spec = torch.zeros(12)
    plain = torch.zeros(12)
    for i in range(n):
        spec[dec.generate([3, 4, 5], 3, sp, seed=i).tokens[2]] += 1
        plain[dec.generate([3, 4, 5], 3, sp, seed=10_000 + i, speculative=False).tokens[2]] += 1
    keep = (spec + plain) > 0
    table = torch.stack([spec[keep], plain[keep]]).numpy()
    assert scipy_stats.chi2_contingency(table).pvalue > 1e-3
