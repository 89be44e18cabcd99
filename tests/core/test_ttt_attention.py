"""The TTT unroll's attention (sglang_ext/core/ttt_attention.py): the fused causal + diagonal path
computes the dense masked attention's function and gradients, for MHA (grouped-query) and MLA (values
narrower than keys) shapes, and the trainer's loss and gradients do not depend on which path runs."""

import pytest
import torch

from sglang_ext.core.heads import Eagle3Head, head_config_for
from sglang_ext.core.ttt_attention import TTTCache, ttt_attention


def _blocks(steps, b, hkv, L, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(b, hkv, L, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps)]
    vs = [torch.randn(b, hkv, L, dv, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps)]
    return ks, vs


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("heads,hkv,d,dv", [(4, 2, 16, 16), (4, 4, 24, 16)])  # GQA; MLA-like (v narrower)
def test_fused_equals_dense_with_gradients(steps, heads, hkv, d, dv):
    b, L = 2, 37
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, heads, L, d, generator=g, dtype=torch.float64).requires_grad_()
    ks, vs = _blocks(steps, b, hkv, L, d, dv, 2)
    w = torch.randn(b, heads, L, dv, generator=g, dtype=torch.float64)
    results = []
    for fused in (True, False):
        out = ttt_attention(q, ks, vs, d ** -0.5, fused=fused)
        grads = torch.autograd.grad((out * w).sum(), [q, *ks, *vs])
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    assert o1.shape == (b, heads, L, dv)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)  # the CPU kernel accumulates in fp32
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_a_lane_sees_only_its_prefix_and_its_own_diagonal():
    """Changing a later lane's keys/values (any step) or another lane's diagonal leaves lane t's output as it was."""
    b, h, L, d = 1, 2, 12, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, L, d, generator=g, dtype=torch.float64)
    ks, vs = _blocks(3, b, h, L, d, d, 4)
    ks, vs = [k.detach() for k in ks], [v.detach() for v in vs]
    base = ttt_attention(q, ks, vs, 0.3, fused=True)
    t = 5
    ks2, vs2 = [k.clone() for k in ks], [v.clone() for v in vs]
    ks2[0][:, :, t + 1:] += 1.0  # later lanes of the causal block
    vs2[1][:, :, :t] -= 2.0  # other lanes' diagonal entries
    ks2[2][:, :, t + 1:] *= 3.0
    moved = ttt_attention(q, ks2, vs2, 0.3, fused=True)
    torch.testing.assert_close(moved[:, :, t], base[:, :, t])
    assert not torch.allclose(moved[:, :, t + 1:], base[:, :, t + 1:])


def test_cache_refuses_a_mask_and_steps_of_other_lengths():
    c = TTTCache()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="mask=None"):
        c.attend(q, q, q, torch.ones(4, 4, dtype=torch.bool), 0.3)
    c.attend(q, q, q, None, 0.3)
    with pytest.raises(ValueError, match="same lanes"):
        c.attend(q[:, :, :3], q[:, :, :3], q[:, :, :3], None, 0.3)


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_trainer_loss_and_gradients_do_not_depend_on_the_attention_path(fmt):
    from sglang_ext.core import tiny
    from sglang_ext.training.features import Features
    from sglang_ext.training.trainer import ttt_loss

    cfg = tiny.deepseek_v3_config(num_layers=3, hidden=64, vocab=300, moe_layers=0)
    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(cfg, fmt, [0, 1, 2], draft_vocab_size=128))
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(5)
    feats = []
    for n in (23, 17):  # a right-padded batch of two
        mask = torch.ones(n, dtype=torch.uint8)
        mask[:4] = 0
        feats.append(Features(torch.randint(0, cfg.vocab_size, (n,), generator=g), mask,
                              torch.randn(n, 3 * h, generator=g),
                              torch.randn(n, h, generator=g)))
    lm_rows = torch.randn(head.config.draft_vocab, h, generator=g)
    params = [p for p in head.parameters() if p.requires_grad]
    out = []
    for fused in (True, False):
        loss, acc, cnt = ttt_loss(head, feats, lm_rows, 4, 0.8, torch.device("cpu"), fused_attention=fused)
        out.append((loss.detach(), acc, cnt, torch.autograd.grad(loss, params)))
    (l1, a1, c1, g1), (l2, a2, c2, g2) = out
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    assert a1 == a2 and c1 == c2
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)


def test_under_bf16_autocast_the_fused_path_runs_and_agrees():
    """The trainer's GPU mode is bf16 autocast: the fused path must take the head's bf16 q/k/v (not fall
    back to the dense path) and agree with the dense path to bf16 rounding; its merge stays in fp32."""
    from sglang_ext.core import tiny, ttt_attention as T
    from sglang_ext.training.features import Features
    from sglang_ext.training.trainer import ttt_loss

    cfg = tiny.deepseek_v3_config(num_layers=3, hidden=64, vocab=300, moe_layers=0)
    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(cfg, "mha", [0, 1, 2], draft_vocab_size=128))
    g = torch.Generator().manual_seed(7)
    feats = [Features(torch.randint(0, 300, (40,), generator=g), torch.ones(40, dtype=torch.uint8),
                      torch.randn(40, 192, generator=g), torch.randn(40, 64, generator=g))]
    lm_rows = torch.randn(128, 64, generator=g)
    T.PATHS_USED.clear()
    fused = ttt_loss(head, feats, lm_rows, 4, 0.8, torch.device("cpu"), autocast=True)[0]
    assert T.PATHS_USED == {"fused"}
    dense = ttt_loss(head, feats, lm_rows, 4, 0.8, torch.device("cpu"), autocast=True, fused_attention=False)[0]
    assert T.PATHS_USED == {"fused", "dense"}
    torch.testing.assert_close(fused, dense, rtol=2e-2, atol=1e-3)
