"""Triton kernels of the verify-as-decode path (sglang_ext.serving.mla_verify) for draft trees: the KV index
list of every verify query, read from EAGLE's verify mask. Kept apart so that importing the plugin does not
import Triton.

EAGLE's target-verify mask (SGLang 0.5.17, ``spec_info.custom_mask``) is packed per request: request b owns
``n x (seq_len_b + n)`` cells from ``mask_indptr[b]``, row i being what verify token i may see -- the whole
prefix, then the draft tokens (its ancestors and itself). The draft tokens' cache slots are
``req_to_token[pool_b, seq_len_b : seq_len_b + n]`` (EAGLE v2 reads ``out_cache_loc`` from there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_query_lengths(seq_lens, mask, mask_indptr, lens, N: tl.constexpr, N_POW2: tl.constexpr):
    q = tl.program_id(0)
    b = q // N
    i = q % N
    prefix = tl.load(seq_lens + b).to(tl.int64)
    row = tl.load(mask_indptr + b).to(tl.int64) + i * (prefix + N) + prefix
    j = tl.arange(0, N_POW2)
    seen = tl.load(mask + row + j, mask=j < N, other=0).to(tl.int32)
    tl.store(lens + q, (prefix + tl.sum(seen, axis=0)).to(tl.int32))


@triton.jit
def _tree_query_indices(req_to_token, req_pool_indices, seq_lens, mask, mask_indptr, kv_indptr, kv_indices,
                        stride: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, BLOCK: tl.constexpr):
    q = tl.program_id(0)
    b = q // N
    i = q % N
    pool = tl.load(req_pool_indices + b).to(tl.int64)
    prefix = tl.load(seq_lens + b).to(tl.int64)
    start = tl.load(kv_indptr + q).to(tl.int64)
    base = req_to_token + pool * stride
    for k in range(0, tl.cdiv(prefix, BLOCK)):  # the prefix, as the chain path copies it
        off = k * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        keep = off < prefix
        tl.store(kv_indices + start + off, tl.load(base + off, mask=keep), mask=keep)
    row = tl.load(mask_indptr + b).to(tl.int64) + i * (prefix + N) + prefix
    j = tl.arange(0, N_POW2)
    seen = tl.load(mask + row + j, mask=j < N, other=0).to(tl.int32)
    slot = tl.load(base + prefix + j, mask=j < N, other=0)
    at = tl.cumsum(seen, axis=0) - seen  # compacted: the draft tokens this query sees, in draft order
    tl.store(kv_indices + start + prefix + at, slot, mask=seen > 0)


def tree_verify_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        num_draft_tokens: int, custom_mask: torch.Tensor, mask_indptr: torch.Tensor,
                        kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> torch.Tensor:
    """Fill `kv_indptr` and `kv_indices` for bs*n decode queries of a tree verify; returns the lengths."""
    n = num_draft_tokens
    queries = req_pool_indices.shape[0] * n
    lens = torch.empty(queries, dtype=torch.int32, device=seq_lens.device)
    n_pow2 = triton.next_power_of_2(n)
    _tree_query_lengths[(queries,)](seq_lens, custom_mask, mask_indptr, lens, N=n, N_POW2=n_pow2)
    kv_indptr[0] = 0
    kv_indptr[1: queries + 1] = torch.cumsum(lens, dim=0)
    _tree_query_indices[(queries,)](req_to_token, req_pool_indices, seq_lens, custom_mask, mask_indptr, kv_indptr,
                                    kv_indices, stride=req_to_token.stride(0), N=n, N_POW2=n_pow2, BLOCK=512)
    return lens
