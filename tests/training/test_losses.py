"""sglang_ext.training.losses.soft_cross_entropy: the TTT unroll's soft-label cross-entropy with a hand-written
backward (it keeps no fp32 copies of the logits); it must equal -(p * log_softmax(z)).sum(-1) in value and
gradient, in chunks or not, for bf16 logits as autocast gives them."""

import pytest
import torch
import torch.nn.functional as F

from sglang_ext.training.losses import soft_cross_entropy


def reference(logits, target, rows, cols):
    return -(target[rows, cols] * F.log_softmax(logits.float(), dim=-1)).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_value_and_gradient_equal_the_log_softmax_formula(chunk):
    g = torch.Generator().manual_seed(0)
    target = F.softmax(3 * torch.randn(2, 9, 37, generator=g, dtype=torch.float64), -1)
    rows = torch.tensor([0, 0, 1, 1, 1, 0, 1])
    cols = torch.tensor([3, 8, 0, 4, 4, 1, 7])  # a target row used twice
    z = (2 * torch.randn(7, 37, generator=g, dtype=torch.float64)).requires_grad_()
    w = torch.randn(7, generator=g, dtype=torch.float64)  # a weighted sum, not just the mean, upstream
    ours = soft_cross_entropy(z, target, rows, cols, chunk=chunk)
    (ours * w).sum().backward()
    g_ours = z.grad.clone()
    z.grad = None
    ref = reference(z, target, rows, cols)
    (ref * w).sum().backward()
    assert ours.dtype == torch.float32
    assert torch.allclose(ours.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(g_ours, z.grad, atol=1e-6, rtol=1e-5)


def test_bf16_logits_get_a_bf16_gradient_equal_to_the_fp32_upcast_formula():
    g = torch.Generator().manual_seed(1)
    target = F.softmax(torch.randn(1, 16, 64, generator=g), -1)
    rows, cols = torch.zeros(12, dtype=torch.long), torch.arange(12)
    z = torch.randn(12, 64, generator=g).bfloat16().requires_grad_()
    soft_cross_entropy(z, target, rows, cols, chunk=4).mean().backward()
    g_ours = z.grad.clone()
    z.grad = None
    reference(z, target, rows, cols).mean().backward()  # what the trainer computed before: .float(), log_softmax
    # both round an fp32 gradient to bf16; the fp32 values differ in summation order only: one bf16 step at most
    assert g_ours.dtype == torch.bfloat16
    assert torch.allclose(g_ours.float(), z.grad.float(), rtol=2 ** -7, atol=1e-7)


def test_mismatched_indices_are_refused():
    with pytest.raises(ValueError, match="one \\(row, column\\) per lane"):
        soft_cross_entropy(torch.zeros(3, 4), torch.zeros(1, 2, 4), torch.zeros(2, dtype=torch.long),
                           torch.zeros(2, dtype=torch.long))
