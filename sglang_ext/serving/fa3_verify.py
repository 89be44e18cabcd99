"""Draft-tree target verify of an MLA target on FA3 as decode attention: exact in SGLang's deterministic mode.

Why: on FA3 (SGLang 0.5.17, ``FlashAttentionBackend.forward_extend``) a target-verify batch with topk > 1 runs as
cascade attention: one pass over each request's committed prefix (all its verify tokens as one query block), one over
the draft tokens each verify token may see (upstream's "expand" metadata), and a merge of the two partial softmaxes.
A plain decode step computes the same token's attention in one pass, and the two-pass sum is not the one-pass sum: in
deterministic mode trees on FA3 gave the target's own greedy output on 61-70 of 200 prompts where chains (one causal
pass) gave 200 of 200 (docs/results.md, "On FA3").

What: each verify token becomes one decode row. Its page table is its request's prefix followed by the slots of its
ancestors and itself (upstream's expand table already lists them first, in draft-token order, which is position
order), its length the prefix's plus their count, and the whole batch is one ``flash_attn_with_kvcache`` call with
one query per row and the backend's split count: the call ``forward_decode`` makes for a decode batch. In
deterministic mode (one KV split) a row is then computed as that token's plain decode step.

Cost: the rows' page table, bs x n rows x (the prefix table's width + n) int32, built once per forward at its first
attention layer. Under CUDA graphs the prefix table is as wide as the context: 128 requests x 8 draft tokens x 163,840
x 4 B = 671 MB for Kimi-K2.5, rewritten every verify step. So ``--speculative-mla-verify auto`` (the default) takes
this path only under ``--enable-deterministic-inference``; ``decode`` takes it always (its speed is not measured);
``extend`` never.

Extends (SGLang 0.5.17; 0.5.23's FA3 backend reads the same and passes the CPU check, not yet registered: see
docs/design.md):
  * ``attention_backend_setup._build_full_attention_backend_from_str`` (AFTER) -- an FA3 backend for which the path
    applies gets its ``forward_extend`` wrapped on the instance. The FA3 module imports sgl_kernel at import time, so
    its class cannot be hooked by name where sgl_kernel is absent (the plugin's CPU tests and tools); every attention
    backend SGLang builds, hybrid prefill/decode ones included, is built by this function.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from sglang_ext import settings
from sglang_ext.config import kv
from sglang_ext.serving.hooks import Hook, releases

logger = logging.getLogger(__name__)

OPTION = settings.BY_ATTR["mla_verify"].flag
BUILT = "sglang.srt.model_executor.model_runner_components.attention_backend_setup." \
        "_build_full_attention_backend_from_str"
ROWS = "_sglang_ext_tree_rows"  # (first layer id of the forward that built them, DecodeRows)


def reasons(backend, deterministic: bool, mode: str) -> list[str]:
    """Why the tree verify of this FA3 backend stays upstream's cascade (empty: it runs as decode rows)."""
    out = []
    if mode == "extend":
        out.append(f"{OPTION} extend")
    elif mode == "auto" and not deterministic:
        out.append(f"{OPTION} auto takes it only with --enable-deterministic-inference ({OPTION} decode: always)")
    if not getattr(backend, "use_mla", False):
        out.append("the target is not MLA")
    if (getattr(backend, "topk", 0) or 0) <= 1:
        out.append("a chain (topk 1) is one causal pass already")
    if getattr(backend, "is_draft_runner", False):
        out.append("a draft model's backend")
    if getattr(backend, "fa_impl_ver", 3) != 3:
        out.append(f"FlashAttention {backend.fa_impl_ver}")
    if getattr(backend, "page_size", 1) != 1:
        out.append(f"page size {backend.page_size}")
    if kv.target_kv_dtype(getattr(backend, "kv_cache_dtype_str", None)) != "bf16":
        out.append(f"KV cache dtype {backend.kv_cache_dtype_str}")
    if getattr(backend, "has_swa", False) or getattr(backend, "has_local_attention", False):
        out.append("sliding-window or local attention")
    # 0.5.17 marks a unified pool `_unified_dense`; 0.5.23 a translating `kv_index_translator` (page tables of
    # virtual indices) or a sharded pool: the rows' page table would need the same translation
    if getattr(backend, "_unified_dense", False) or \
            getattr(getattr(backend, "kv_index_translator", None), "is_translating", False):
        out.append("a unified (translated) KV pool")
    if getattr(backend, "_kv_shard_pool", None) is not None:
        out.append("a sharded KV pool")
    if getattr(backend, "attn_cp_size", 1) > 1:
        out.append("attention context parallelism")
    return out


def server_reason(s: settings.Settings, kv_cache_dtype: str | None) -> str | None:
    """What the server's flags alone say (the startup check's warning): None where a draft tree on FA3 under
    deterministic mode is verified as decode rows, else why not."""
    if s.mla_verify == "extend":
        return f"{OPTION} extend"
    if not HOOKS[0].covers():
        return f"the decode-row tree verify is built for SGLang {', '.join(HOOKS[0].releases)}"
    if kv.target_kv_dtype(kv_cache_dtype) != "bf16":
        return f"--kv-cache-dtype {kv_cache_dtype}"
    return None


class DecodeRows:
    """The decode-row form of a tree verify batch (see the module docstring): page_table [rows, W + n],
    cache_seqlens / cu_seqlens_q / cu_seqlens_k as FA3 reads them. GPU work only, so it is captured in CUDA graphs
    and recomputed from the refilled metadata at replay."""

    def __init__(self, prefix_table: torch.Tensor, prefix_lens: torch.Tensor, draft_table: torch.Tensor,
                 draft_lens: torch.Tensor):
        bs, width = prefix_table.shape
        rows, n = draft_table.shape
        if rows % bs:
            raise ValueError(f"tree verify as decode rows: {rows} draft rows for {bs} requests")
        per = rows // bs
        table = prefix_table.new_zeros(rows, width + n)
        table[:, :width].view(bs, per, width).copy_(prefix_table[:, None, :].expand(bs, per, width))
        lens = prefix_lens.to(torch.int32).repeat_interleave(per)
        cols = lens[:, None].long() + torch.arange(n, device=table.device)[None, :]
        # draft slots past a row's own count land past its length, where FA3 reads nothing
        table.scatter_(1, cols, draft_table.to(table.dtype))
        self.page_table = table
        self.cache_seqlens = lens + draft_lens.to(torch.int32)
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=table.device)
        self.cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(self.cache_seqlens, 0, dtype=torch.int32), (1, 0))


def _rows(backend, layer) -> DecodeRows:
    """Built at a forward's first attention layer (a layer id not above the last one seen starts a new forward),
    kept for its other layers."""
    kept = getattr(backend, ROWS, None)
    if kept is None or layer.layer_id <= kept[0]:
        normal, expand = backend.forward_metadata, backend.forward_metadata_spec_decode_expand
        kept = [layer.layer_id, DecodeRows(normal.page_table, normal.cache_seqlens_int32, expand.page_table,
                                           expand.cache_seqlens_int32)]
        setattr(backend, ROWS, kept)
    kept[0] = layer.layer_id
    return kept[1]


def forward_extend(original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                   **kwargs):
    """A tree verify batch as one decode call over its rows; every other batch (and any call with arguments this
    path does not carry: sinks, score mods, scales) to upstream's forward_extend."""
    if not forward_batch.forward_mode.is_target_verify() or any(x is not None for x in kwargs.values()):
        return original_fn(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope, k_rope=k_rope, **kwargs)
    if k is not None and save_kv_cache and not getattr(self, "fa_skip_kv_cache", False):
        self.token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
    rows = _rows(self, layer)
    # as forward_decode reads the latent cache and splits the query (absorbed MLA)
    kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
    rope_dim = layer.head_dim - layer.v_head_dim
    k_rope_cache = kv_cache[:, :, layer.v_head_dim:].view(-1, 1, layer.tp_k_head_num, rope_dim)
    c_kv_cache = kv_cache[:, :, : layer.v_head_dim].view(-1, 1, layer.tp_v_head_num, layer.v_head_dim)
    if q_rope is not None:
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        q_rope = q_rope.view(-1, layer.tp_q_head_num, rope_dim)
    else:
        q_all = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        q_nope, q_rope = q_all[:, :, : layer.v_head_dim], q_all[:, :, layer.v_head_dim:]
    flash_attn_with_kvcache = sys.modules[type(self).__module__].flash_attn_with_kvcache  # upstream's own import
    o = flash_attn_with_kvcache(
        q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q_nope, page_table=rows.page_table,
        cache_seqlens=rows.cache_seqlens, cu_seqlens_q=rows.cu_seqlens_q, cu_seqlens_k_new=rows.cu_seqlens_k,
        max_seqlen_q=1, softmax_scale=layer.scaling, causal=True, softcap=layer.logit_cap,
        k_descale=None, v_descale=None, num_splits=self.num_splits, ver=self.fa_impl_ver)
    return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def built_after(result, *args, model_runner=None, backend_str=None, **kwargs):
    """Wrap an FA3 backend's forward_extend where the decode-row tree verify applies (logged either way for an MLA
    target with a draft tree)."""
    if type(result).__name__ != "FlashAttentionBackend" or model_runner is None:
        return result
    # deterministic: the operator's flag, or the one KV split the backend resolved (0.5.23 resolves deterministic
    # mode from other flags too, e.g. --rl-on-policy-target, leaving the raw server_args flag False)
    deterministic = bool(getattr(model_runner.server_args, "enable_deterministic_inference", False)) or \
        getattr(result, "num_splits", 0) == 1
    why = reasons(result, deterministic, settings.current().mla_verify)
    if not why:
        result.forward_extend = functools.partial(forward_extend, result.forward_extend, result)
        logger.info("[sglang_ext] FA3 draft-tree verify runs as decode attention (one row per verify token)")
    elif getattr(result, "use_mla", False) and (getattr(result, "topk", 0) or 0) > 1 \
            and not getattr(result, "is_draft_runner", False):
        logger.info("[sglang_ext] FA3 draft-tree verify on upstream's cascade attention: %s", "; ".join(why))
    return result


def _requested(s: settings.Settings) -> bool:
    return s.mla_verify != "extend"


HOOKS = (
    Hook(BUILT, "after", built_after, releases=releases(until="0.5.17"), when=_requested,
         option="--speculative-mla-verify auto (the default) or decode",
         feature="FA3 draft-tree verify as decode attention (exact in deterministic mode)"),
)
