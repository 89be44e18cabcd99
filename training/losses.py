"""Soft-label cross-entropy for the TTT unroll, without materialising what autograd would keep.

    loss_row = -sum_v p_v log softmax(z)_v = logsumexp(z) * sum_v p_v - sum_v p_v z_v
    d loss_row / d z = softmax(z) * sum_v p_v - p

Written as `-(p * log_softmax(z.float())).sum(-1)` over the selected lanes, every TTT step kept the fp32
log-softmax and a gathered fp32 copy of the target rows for the backward: two [lanes, draft vocab] fp32
tensors per step (0.5 GB per step at 2,048 lanes and a 32,000-token draft vocabulary). Here a step keeps only the logits in their own dtype (bf16 under autocast) and the
lanes' indices into the one target tensor shared by all steps; the backward recomputes the softmax,
chunk by chunk. Same function and gradient (tests/training/test_losses.py)."""

from __future__ import annotations

import torch


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, rows, cols, chunk):
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            z = logits[s: s + chunk].float()
            p = target[rows[s: s + chunk], cols[s: s + chunk]].float()
            out[s: s + chunk] = torch.logsumexp(z, dim=-1) * p.sum(-1) - (p * z).sum(-1)
        ctx.save_for_backward(logits, target, rows, cols)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, target, rows, cols = ctx.saved_tensors
        g = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            z = logits[s: s + ctx.chunk].float()
            p = target[rows[s: s + ctx.chunk], cols[s: s + ctx.chunk]].float()
            d = torch.softmax(z, dim=-1) * p.sum(-1, keepdim=True) - p
            g[s: s + ctx.chunk] = (d * grad[s: s + ctx.chunk, None].float()).to(logits.dtype)
        return g, None, None, None, None


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                       chunk: int = 1024) -> torch.Tensor:
    """Per-lane -sum_v p_v log softmax(logits)_v, with p = target[rows, cols] ([lanes, V] probabilities
    gathered from a [B, T, V] tensor that is not differentiated). logits: [lanes, V], any float dtype;
    the result is fp32."""
    if logits.shape[0] != rows.shape[0] or rows.shape != cols.shape:
        raise ValueError(f"soft_cross_entropy: {logits.shape[0]} lanes of logits, {rows.shape[0]} rows and "
                         f"{cols.shape[0]} columns of target indices: give one (row, column) per lane")
    return _SoftCrossEntropy.apply(logits, target.detach(), rows, cols, chunk)
