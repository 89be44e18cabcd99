"""Attention of a training-time-test (TTT) unroll, computed for what it is: a causal attention plus a few
diagonal terms.

In step k of the unroll (k = 0..K-1) lane t attends to the sequence's own keys 0..t (step 0's keys,
causally) and to one key per earlier step i = 1..k, the one at its own lane t (the token the head itself
proposed there). Written as one dense mask over the concatenated cache, step k scores (k+1) L^2 pairs, all
but ~L^2/2 + kL of them masked: 28 L^2 over a 7-step unroll, through a masked attention kernel. Here the
causal block runs through the fused causal kernel (flash attention, which also returns the row's
log-sum-exp) and the k diagonal scores are plain dot products; the two parts are merged by log-sum-exp.
The backward calls the causal kernel's backward with the merged output and log-sum-exp (as ring attention
does for each key block), which gives the exact gradient of the merged softmax, and the diagonal's
gradient in closed form. SpecForge reaches the same sparsity with flex attention and a block mask.

Used by the trainer only (`TTTCache` in `sglang_ext.training.trainer.ttt_loss`); the dense path (`fused=False`, and
wherever the fused kernel is unavailable: fp32 on CUDA, head dims it does not take) computes the same
function and is what the tests compare against.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from sglang_ext.core.layers import attention, expand_kv_heads


def _flash_forward(q, k, v, scale):
    """Causal flash attention: (out [B,H,L,D], lse [B,H,L] fp32 natural log, what the backward needs)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], r[2:8]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _flash_backward(dout, q, k, v, out, lse, aux, scale):
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale)


class _CausalPlusDiagonal(torch.autograd.Function):
    """softmax over [causal scores q_t.k0_j (j <= t), diagonal scores q_t.kd_{t,i} (i < n)] applied to
    [v0_j, vd_{t,i}]. q, k0 [B,H,L,D]; v0 [B,H,L,Dv] with Dv <= D (zero-padded to D for the kernel);
    kd [B,H,L,n,D]; vd [B,H,L,n,Dv]."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, scale):
        dv, acc = v0.shape[-1], torch.promote_types(q.dtype, torch.float32)  # acc: the merge's precision
        v0p = F.pad(v0, (0, q.shape[-1] - dv)) if dv != q.shape[-1] else v0
        # the merge in `acc` as written: under the trainer's autocast einsum would drop to bf16
        with torch.autocast(device_type=q.device.type, enabled=False):
            o_c, lse_c, aux = _flash_forward(q, k0, v0p, scale)
            d = torch.einsum("bhld,bhlnd->bhln", q.to(acc), kd.to(acc)) * scale
            lse = torch.logaddexp(lse_c, torch.logsumexp(d, dim=-1))
            out = torch.exp(lse_c - lse)[..., None] * o_c[..., :dv].to(acc) + \
                torch.einsum("bhln,bhlnd->bhld", torch.exp(d - lse[..., None]), vd.to(acc))
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0p, kd, vd, out, lse, *[a for a in aux if torch.is_tensor(a)])
        ctx.aux = aux
        ctx.scale, ctx.dv = scale, dv
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0p, kd, vd, out, lse = ctx.saved_tensors[:7]
        tensors = iter(ctx.saved_tensors[7:])
        aux = tuple(next(tensors) if torch.is_tensor(a) else a for a in ctx.aux)
        scale, dv = ctx.scale, ctx.dv
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        pad = q.shape[-1] - dv
        outp, doutp = (F.pad(out, (0, pad)), F.pad(dout, (0, pad))) if pad else (out, dout)
        # the causal block's gradient under the *merged* softmax: its kernel's backward given the merged
        # output and log-sum-exp (rowsum(dout * out) and exp(s - lse) are then the merged ones)
        dq, dk0, dv0 = _flash_backward(doutp, q, k0, v0p, outp.contiguous(), lse.contiguous(), aux, scale)
        d = torch.einsum("bhld,bhlnd->bhln", q.to(acc), kd.to(acc)) * scale
        p = torch.exp(d - lse[..., None])  # [B,H,L,n]: the diagonal's probabilities
        g = dout.to(acc)
        delta = (g * out.to(acc)).sum(-1, keepdim=True)  # [B,H,L,1]
        ds = p * (torch.einsum("bhld,bhlnd->bhln", g, vd.to(acc)) - delta) * scale
        dq = (dq.to(acc) + torch.einsum("bhln,bhlnd->bhld", ds, kd.to(acc))).to(q.dtype)
        dkd = (ds[..., None] * q.to(acc)[:, :, :, None, :]).to(kd.dtype)
        dvd = (p[..., None] * g[:, :, :, None, :]).to(vd.dtype)
        return dq, dk0, dv0[..., :dv], dkd, dvd, None


_CHECKED: dict[tuple, bool] = {}
PATHS_USED: set[str] = set()  # which paths this process ran (the trainer reports it)


def _fused_usable(q: torch.Tensor) -> bool:
    """Whether the fused causal kernel takes these inputs -- on CUDA checked once per (device, dtype,
    head dim) against the dense path on small random inputs, so that a kernel whose conventions differ
    (log-sum-exp layout or base) costs speed, never correctness."""
    if q.is_cuda:
        if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
            return False
    elif q.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        return False
    key = (q.device.type, q.device.index, q.dtype, q.shape[-1])
    if q.is_cuda and key not in _CHECKED:
        try:
            _CHECKED[key] = _self_check(q.device, q.dtype, q.shape[-1])
        except RuntimeError:  # e.g. a kernel that refuses these shapes
            _CHECKED[key] = False
        if not _CHECKED[key]:
            warnings.warn(f"TTT attention: the fused causal kernel disagrees with the dense path for {key}; "
                          "using the dense path (slower, same result)")
    return _CHECKED.get(key, True)


def _self_check(device, dtype, dim: int) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, 2, 96, dim)
    q, k0, k1, k2 = (torch.randn(*shape, generator=g).to(device, dtype).requires_grad_() for _ in range(4))
    v0, v1, v2 = (torch.randn(1, 2, 96, dim - 8, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    grads = []
    for fused in (True, False):
        out = ttt_attention(q, [k0, k1, k2], [v0, v1, v2], dim ** -0.5, fused=fused)
        out.float().square().sum().backward()
        grads.append([out.detach().float()] + [t.grad.float() for t in (q, k0, k1, k2, v0, v1, v2)])
        for t in (q, k0, k1, k2, v0, v1, v2):
            t.grad = None
    tol = 3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    return all(((a - b).abs().max() <= tol * (1 + b.abs().max())).item() for a, b in zip(*grads))


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                  fused: bool | None = None) -> torch.Tensor:
    """q [B,H,L,D]; ks[i] [B,Hkv,L,D] and vs[i] [B,Hkv,L,Dv] the keys/values of unroll steps 0..k.
    Lane t sees ks[0][.., :t+1, :] and ks[i][.., t, :] for i >= 1. fused=None: the fused kernel where it
    applies; False: the dense masked attention over the concatenated keys (the reference)."""
    heads, L = q.shape[1], q.shape[2]
    if fused is None:
        fused = _fused_usable(q)
    PATHS_USED.add("fused" if fused else "dense")
    if not fused:
        k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        eye = torch.eye(L, dtype=torch.bool, device=q.device)
        return attention(q, k, v, torch.cat([causal] + [eye] * (len(ks) - 1), dim=1), scale)
    k0, v0 = expand_kv_heads(ks[0], heads), expand_kv_heads(vs[0], heads)
    if len(ks) == 1:
        dv = v0.shape[-1]
        v0p = F.pad(v0, (0, q.shape[-1] - dv)) if dv != q.shape[-1] else v0
        return F.scaled_dot_product_attention(q, k0, v0p, is_causal=True, scale=scale)[..., :dv]
    kd = torch.stack([expand_kv_heads(k, heads) for k in ks[1:]], dim=3)
    vd = torch.stack([expand_kv_heads(v, heads) for v in vs[1:]], dim=3)
    return _CausalPlusDiagonal.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), kd, vd, scale)


class TTTCache:
    """The keys and values of one TTT unroll, a block per step (see the module docstring); the attention
    modules call `attend` as they would a `layers.KVCache`'s."""

    def __init__(self, fused: bool | None = None):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.fused = fused

    def __len__(self) -> int:
        return sum(k.shape[2] for k in self.k)

    def attend(self, q, k, v, mask, scale: float) -> torch.Tensor:
        if mask is not None:
            raise ValueError("TTTCache: the unroll's attention pattern is fixed; pass mask=None")
        if self.k and k.shape[2] != self.k[0].shape[2]:
            raise ValueError(f"TTTCache: step of {k.shape[2]} lanes after steps of {self.k[0].shape[2]}; "
                             "every unroll step covers the same lanes")
        # grouped-query blocks widened once here, not once per later step that reads them
        self.k.append(expand_kv_heads(k, q.shape[1]))
        self.v.append(expand_kv_heads(v, q.shape[1]))
        return ttt_attention(q, self.k, self.v, scale, self.fused)
