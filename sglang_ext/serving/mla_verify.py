"""Target-verify of an MLA target as grouped decode attention (Triton backend; chains by default).

Why: SGLang 0.5.17's Triton backend runs EAGLE target-verify through its prefill kernel
(``extend_attention_fwd``), which walks each request's whole prefix once per query block and per
head. With 4 verify tokens per request that block is mostly empty, so a verify step costs ~0.8 ms
per running request on an H200 with Kimi-K2.5 shapes: at 128 requests speculation ran at 0.43x of
plain decoding at 2 accepted drafts per step, and a draft that never accepts at 0.15x. As decode
attention the same chain ran at 0.87x at 128 and 1.1-2.4x below (2.0x upstream's speed at 64-128
requests; docs/benchmarks.md, run 2). Upstream has a split-KV verify kernel, but only for AMD (gfx95).

What: for a chain (topk 1) each verify token i of request b attends to exactly the request's prefix
plus draft tokens 0..i -- a causal window; in a tree (topk > 1), the prefix plus its ancestors and
itself, as EAGLE's verify mask says. So the verify batch of bs x n tokens is run as bs x n decode
queries through the same grouped MLA decode kernel plain decoding uses (heads grouped over the one
latent KV head, split-KV), with per-query KV index lists built on the GPU from ``req_to_token``
(EAGLE v2 has already written the draft tokens' slots there: ``eagle_prepare_for_verify`` reads
``out_cache_loc`` from it) and, for trees, the mask (``verify_kernels.py``).

``--speculative-mla-verify`` (``SGLANG_EXT_MLA_VERIFY``): ``auto`` (default) -- chains (topk 1) as decode attention, draft trees
on upstream's kernel; ``decode`` -- trees too (their CUDA-graph replay is CPU-checked, not yet run on a
GPU); ``extend`` -- upstream's kernel only (the hooks are not registered). In SGLang's deterministic mode
a verify row is then computed bit for bit as that token's decode row. Extends (hooks registered by
sglang_ext.plugin unless ``extend``), SGLang 0.5.17:
  * ``TritonAttnBackend.init_forward_metadata`` (AFTER) -- eager verify metadata: expanded KV
    indices, decode split buffers;
  * ``TritonAttnBackend.init_cuda_graph_state`` (AFTER) -- one more address-stable buffer (the
    expanded indptr) beside upstream's;
  * ``TritonAttnBackend.init_forward_metadata_out_graph`` (AFTER) -- the same into the CUDA-graph
    buffers (capture and replay);
  * ``TritonAttnBackend.forward_extend`` (AROUND) -- a verify batch with that metadata goes to
    ``forward_decode`` (which also stores the tokens' latent KV, as the extend path would).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from sglang_ext import settings
from sglang_ext.serving import compat
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

OPTION = settings.BY_ATTR["mla_verify"].flag
FLAG = "_sglang_ext_verify_as_decode"  # set on the backend while its metadata is ours
INDPTR = "_sglang_ext_verify_indptr"  # [max_num_tokens + 1] int32, beside the backend's CUDA-graph buffers


def mode() -> str:
    """'auto' (the default): chain verify as decode attention, draft trees on upstream's kernel; 'decode': chains
    and trees; 'extend': upstream's kernel only (the hooks are then not registered)."""
    return settings.current().mla_verify


def applies(backend) -> bool:
    """Only where the decode kernel computes exactly what the extend kernel would, and for draft trees only when
    asked for (their CUDA-graph path is checked on the CPU, not yet on a GPU)."""
    ok = getattr(backend, "_sglang_ext_verify_ok", None)
    if ok is None:
        chosen = mode()
        reasons = []
        if chosen == "extend":
            reasons.append(f"{OPTION} extend")
        if not getattr(backend, "use_mla", False):
            reasons.append("the target is not MLA")
        if (getattr(backend, "topk", 0) or 0) > 1 and chosen != "decode":
            reasons.append(f"draft trees (topk {backend.topk}) use upstream's kernel unless {OPTION} decode")
        if getattr(backend, "dcp_size", 1) > 1:
            reasons.append("decode context parallelism")
        if getattr(backend, "sliding_window_size", None) not in (None, -1, 0):
            reasons.append("sliding-window attention")
        if compat.translates_kv_loc(backend):
            reasons.append("a unified (translated) KV pool")
        if getattr(backend, "page_size", 1) != 1:
            reasons.append(f"page size {backend.page_size}")
        ok = not reasons
        backend._sglang_ext_verify_ok = ok
        if ok:
            logger.info("[sglang_ext] MLA target verify runs as grouped decode attention (%s %s)", OPTION, chosen)
        elif getattr(backend, "use_mla", False):
            logger.info("[sglang_ext] MLA target verify on upstream's extend kernel: %s", "; ".join(reasons))
    return ok


def verify_window_lengths(seq_lens: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """KV length of each verify query, request-major: prefix + 1 .. prefix + n."""
    steps = torch.arange(1, num_draft_tokens + 1, device=seq_lens.device, dtype=seq_lens.dtype)
    return (seq_lens[:, None] + steps[None, :]).reshape(-1)


def expand_verify_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          num_draft_tokens: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> torch.Tensor:
    """Fill `kv_indptr` (>= bs*n + 1 entries) and `kv_indices` for bs*n decode queries, query (b, i) reading
    req_to_token[req_pool_indices[b], : seq_lens[b] + i + 1]; returns the per-query lengths. GPU work only
    (no host synchronisation), so it runs inside CUDA-graph replay preparation."""
    create_flashinfer_kv_indices_triton = compat.create_flashinfer_kv_indices_triton()  # moved in 0.5.23
    n = num_draft_tokens
    lens = verify_window_lengths(seq_lens, n)
    pools = req_pool_indices.repeat_interleave(n)
    queries = lens.shape[0]
    kv_indptr[0] = 0
    kv_indptr[1: queries + 1] = torch.cumsum(lens, dim=0)
    create_flashinfer_kv_indices_triton[(queries,)](
        req_to_token, pools, lens, kv_indptr, None, kv_indices, req_to_token.stride(0))
    return lens


def _fill(backend, forward_batch, bs: int, n: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
          tree_mask) -> torch.Tensor:
    """Per-query KV index lists: a chain's causal windows, or for a tree (topk > 1) the rows of EAGLE's
    verify mask, packed per request; `tree_mask()` gives (mask, mask_indptr), asked only for a tree."""
    pools, seq_lens = forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs]
    if (getattr(backend, "topk", 0) or 0) <= 1:
        return expand_verify_indices(backend.req_to_token, pools, seq_lens, n, kv_indptr, kv_indices)
    mask, mask_indptr = tree_mask()
    if mask is None or mask_indptr is None:
        raise RuntimeError(f"verify as decode attention: a tree verify batch without its mask; set {OPTION}=extend "
                           "(upstream's kernel) and report this")
    from sglang_ext.serving.verify_kernels import tree_verify_indices

    return tree_verify_indices(backend.req_to_token, pools, seq_lens, n, mask, mask_indptr, kv_indptr, kv_indices)


def _graph_mask(backend, forward_batch, bs: int):
    """The verify mask a CUDA-graph verify reads: upstream's address-stable mask buffer and mask indptr, both
    refilled by upstream's replay preparation just before our hook (``_update_target_verify_buffers``).
    Not ``backend.forward_metadata``: at replay that is whatever the last eager batch left there."""
    spec = forward_batch.spec_info
    vm = getattr(backend, "_verify_mask", None)
    if vm is None or getattr(spec, "custom_mask", None) is None:
        return None, None
    if int(vm.mode) != 0:  # TreeMaskMode.FULL_MASK, the layout verify_kernels reads (the GPU default)
        raise RuntimeError(f"verify as decode attention: verify mask layout {vm.mode!r} is not supported; "
                           f"set {OPTION}=extend")
    return vm.buffer, backend.mask_indptr[: bs + 1]


def _draft_tokens(backend, forward_batch) -> int:
    return compat.verify_tokens_per_req(backend, forward_batch.spec_info)


def _is_verify(forward_batch) -> bool:
    return forward_batch.forward_mode.is_target_verify() and forward_batch.spec_info is not None


def init_forward_metadata_after(result, self, forward_batch, *args, **kwargs):
    """Eager (no CUDA graph) verify batch."""
    setattr(self, FLAG, False)
    if not _is_verify(forward_batch) or not applies(self):
        return result
    n = _draft_tokens(self, forward_batch)
    bs = len(forward_batch.req_pool_indices)
    total = (n * forward_batch.seq_lens_sum + bs * n * n if forward_batch.seq_lens_sum is not None
             else bs * n * self.max_context_len)  # at most: every query sees its prefix and all n tokens
    kv_indptr = torch.empty(bs * n + 1, dtype=torch.int32, device=self.device)
    kv_indices = torch.empty(total, dtype=torch.int64, device=self.device)
    meta = self.forward_metadata  # upstream's, just built for this batch
    lens = _fill(self, forward_batch, bs, n, kv_indptr, kv_indices, lambda: (meta.custom_mask, meta.mask_indptr))
    num_kv_splits = torch.empty(bs * n, dtype=torch.int32, device=self.device)
    self.get_num_kv_splits(num_kv_splits, lens)
    self.forward_metadata = dataclasses.replace(
        self.forward_metadata,
        attn_logits=torch.empty((bs * n, self.num_head, self.max_kv_splits, self.v_head_dim), dtype=torch.float32,
                                device=self.device),
        attn_lse=torch.empty((bs * n, self.num_head, self.max_kv_splits), dtype=torch.float32, device=self.device),
        num_kv_splits=num_kv_splits, kv_indptr=kv_indptr, kv_indices=kv_indices)
    setattr(self, FLAG, True)
    return result


def init_forward_metadata_out_graph_after(result, self, forward_batch, in_capture: bool = False, *args, **kwargs):
    """CUDA-graph verify batch: capture points the metadata at address-stable buffers; replay refills them."""
    if not _is_verify(forward_batch) or not applies(self):
        if in_capture:
            setattr(self, FLAG, False)
        return result
    n = _draft_tokens(self, forward_batch)
    bs = forward_batch.batch_size
    queries = bs * n
    buf = getattr(self, INDPTR, None)  # allocated with the backend's other CUDA-graph buffers
    if buf is None or queries + 1 > buf.shape[0] or queries > self.cuda_graph_attn_logits.shape[0]:
        raise RuntimeError(f"verify as decode attention: {queries} verify queries exceed the CUDA-graph buffers "
                           f"({None if buf is None else buf.shape[0] - 1}); set {OPTION}=extend (upstream's kernel) "
                           "and report this")
    lens = _fill(self, forward_batch, bs, n, buf, self.cuda_graph_kv_indices,
                 lambda: _graph_mask(self, forward_batch, bs))
    self.get_num_kv_splits(self.cuda_graph_num_kv_splits[:queries], lens)
    if in_capture:
        self.forward_metadata = dataclasses.replace(
            self.forward_metadata, attn_logits=self.cuda_graph_attn_logits, attn_lse=self.cuda_graph_attn_lse,
            num_kv_splits=self.cuda_graph_num_kv_splits, kv_indptr=buf[: queries + 1],
            kv_indices=self.cuda_graph_kv_indices)
        setattr(self, FLAG, True)
    return result


def init_cuda_graph_state_after(result, self, max_bs: int, max_num_tokens: int, *args, **kwargs):
    """Our one extra CUDA-graph buffer (the expanded indptr), paired with upstream's: a backend whose graph
    state is rebuilt gets a new one with it, so replay always refills what its graphs captured."""
    setattr(self, INDPTR, torch.zeros(max_num_tokens + 1, dtype=torch.int32, device=self.device))
    return result


def forward_extend(original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
    if not (getattr(self, FLAG, False) and forward_batch.forward_mode.is_target_verify()):
        return original_fn(self, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    # k and v None: the model stored this step's latent KV already (the extend path reads it back)
    out = self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache and k is not None)
    preset = getattr(forward_batch, "_attn_output", None)
    if preset is not None:
        preset.copy_(out.view_as(preset))
        return preset
    return out


def _requested(s: settings.Settings) -> bool:
    return s.mla_verify != "extend"


ON = "--speculative-mla-verify auto (the default) or decode"  # the option that registers these hooks
HOOKS = (
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_cuda_graph_state", "after",
         init_cuda_graph_state_after, when=_requested, option=ON, feature="MLA verify as decode attention (Triton)"),
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_forward_metadata", "after",
         init_forward_metadata_after, when=_requested, option=ON, feature="MLA verify as decode attention (Triton)"),
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_forward_metadata_out_graph", "after",
         init_forward_metadata_out_graph_after, when=_requested, option=ON, feature="MLA verify as decode attention (Triton)"),
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend", "around", forward_extend,
         when=_requested, option=ON, feature="MLA verify as decode attention (Triton)"),
)
