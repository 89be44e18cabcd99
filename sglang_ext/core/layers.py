"""Building blocks of the Eagle3 heads, in plain torch: RMSNorm, RoPE (default, linear, llama3,
DeepSeek-YaRN; NeoX or interleaved pairs), the SiLU MLP, masked attention and a KV cache.
Numerics follow SGLang's / transformers' reference implementations (fp32 norm and rope math)."""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act={act!r}: only 'silu' is supported (Eagle3 heads of Llama/DeepSeek)")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------- RoPE


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rot * 2 * math.pi))) / (2 * math.log(base))


def rope_parameters(config: Mapping) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a config dict in either transformers 4 (rope_theta +
    rope_scaling) or 5 (rope_parameters) style."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = dict(params)
    if isinstance(scaling, Mapping) and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)


class RotaryEmbedding(nn.Module):
    """cos/sin for positions; `interleaved` rotates (x0,x1),(x2,x3).. pairs (DeepSeek MLA,
    SGLang is_neox_style=False), otherwise the two halves (Llama, NeoX style)."""

    def __init__(self, dim: int, theta: float, scaling: Mapping | None, interleaved: bool):
        super().__init__()
        self.dim, self.interleaved = dim, interleaved
        self.cos_sin_scale = 1.0  # YaRN's mscale on cos/sin
        self.softmax_scale_factor = 1.0  # DeepSeek-YaRN's mscale_all_dim^2 on the softmax scale
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        inv_freq = 1.0 / base
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            factor = float(scaling["factor"])
            low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
            old = float(scaling["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv_freq
            smooth = (old / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
            mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            is_mid = (wavelen <= old / low) & (wavelen >= old / high)
            inv_freq = torch.where(is_mid, mid, scaled)
        elif kind in ("yarn", "deepseek_yarn"):
            factor = float(scaling["factor"])
            old = int(scaling.get("original_max_position_embeddings", 4096))
            lo = max(math.floor(_yarn_correction_dim(float(scaling.get("beta_fast", 32)), dim, theta, old)), 0)
            hi = min(math.ceil(_yarn_correction_dim(float(scaling.get("beta_slow", 1)), dim, theta, old)), dim - 1)
            hi = hi + 0.001 if lo == hi else hi
            ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo), 0, 1)
            extrapolate = (1 - ramp) * float(scaling.get("extrapolation_factor", 1.0))
            inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
            mscale, mscale_all = float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0))
            self.cos_sin_scale = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                                  * float(scaling.get("attn_factor", 1.0)))
            if mscale_all:
                self.softmax_scale_factor = yarn_get_mscale(factor, mscale_all) ** 2
        elif kind not in (None, "default"):
            raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported; use default, linear, llama3 or yarn")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, dim], positions [B, T] -> rotated x."""
        freqs = positions.to(torch.float32)[:, None, :, None] * self.inv_freq.to(x.device)  # [B,1,T,dim/2]
        cos, sin = freqs.cos() * self.cos_sin_scale, freqs.sin() * self.cos_sin_scale
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = xf[..., : self.dim // 2], xf[..., self.dim // 2:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


# ------------------------------------------------------------------------------ attention + cache


class KVCache:
    """Keys and values of one attention layer, [B, kv_heads, S, D], grown by `append`. Entries are
    addressed by index; callers (drafting, TTT) pass a boolean mask over them."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def attend(self, q, k, v, mask, scale: float) -> torch.Tensor:
        """Append this step's keys/values, then attend over the whole cache under `mask`."""
        k, v = self.append(k, v)
        return attention(q, k, v, mask, scale)

    def truncate(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only entries `index` (1-D, ordered), e.g. a verified tree path."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(2, index), self.v.index_select(2, index)


def causal_mask(t_new: int, s_total: int, device=None) -> torch.Tensor:
    """[t_new, s_total] bool: the new tokens sit at the end of the cache."""
    offset = s_total - t_new
    q = torch.arange(t_new, device=device)[:, None] + offset
    return torch.arange(s_total, device=device)[None, :] <= q


def expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys/values [B, Hkv, S, D] -> [B, heads, S, D] (as is when already that wide)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def attention(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B,Hq,T,D], k/v [B,Hkv,S,D*], mask [T,S] or [B,T,S] bool (True = may attend)."""
    k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
    if mask is None:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask.dim() == 3:
        mask = mask[:, None]
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # MLA: v narrower than q/k; equal widths keep every fused SDPA kernel eligible
        v = F.pad(v, (0, q.shape[-1] - dv))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
