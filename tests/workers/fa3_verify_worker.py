"""Run by tests/serving/test_fa3_verify.py: the installed SGLang's own FlashAttentionBackend (0.5.17, 0.5.23) on a
draft-tree target-verify batch of an MLA layer, on the CPU -- its own metadata (`init_forward_metadata`: the prefix
table and the "expand" table of each verify token's visible draft tokens) and its own `forward_extend` (cascade
attention: a prefix pass, an expand pass, a merge), against the plugin's decode-row verify
(sglang_ext.serving.fa3_verify, wrapped on the instance by its real `built_after` hook) and against attention
computed directly from EAGLE's verify mask.

The FA3 kernels are CUDA-only, so the two it calls are stood in by exact float64 torch code of what they compute:
`flash_attn_with_kvcache` (paged attention, page size 1, absorbed MLA: scores from q_rope . k_rope + q_nope . c_kv,
values c_kv, causal aligned to each sequence's end) and sgl_kernel's `merge_state_v2` (two partial softmaxes by their
log-sum-exp). The stand-in records each call's arguments, so the decode-row call is compared with the call upstream's
`forward_decode` makes for a plain decode batch. Real pools (MLATokenToKVPool), a real RadixAttention layer; the
backend is built without its __init__ (it needs a model runner and a GPU) and given the attributes __init__ sets.
Prints JSON."""

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def merge_state_v2(o_a, s_a, o_b, s_b):
    """Two partial attentions over disjoint keys, by their log-sum-exp ([tokens, heads])."""
    s = torch.logaddexp(s_a, s_b)
    return o_a * torch.exp(s_a - s)[..., None] + o_b * torch.exp(s_b - s)[..., None], s


sys.modules.setdefault("sgl_kernel", types.ModuleType("sgl_kernel")).merge_state_v2 = merge_state_v2

from sglang.srt.layers.attention import flashattention_backend as fa  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_ext.serving import compat, fa3_verify  # noqa: E402

if compat.at_least("0.5.21"):
    # SGLang 0.5.21+ reads the parallel topology from the runtime context, which a server publishes; this process
    # states the one the pools and the backend run in here (one rank, no context parallelism)
    from sglang.srt.runtime_context import get_parallel  # noqa: E402

    get_parallel().override_permanently(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0)

CALLS = []


def flash_attn_with_kvcache(q, k_cache, v_cache, qv=None, page_table=None, cache_seqlens=None, cu_seqlens_q=None,
                            max_seqlen_q=None, softmax_scale=None, causal=False, return_softmax_lse=False, **kwargs):
    CALLS.append(dict(kwargs, causal=causal, max_seqlen_q=max_seqlen_q, return_softmax_lse=return_softmax_lse,
                      qv=qv is not None, rows=len(cu_seqlens_q) - 1))
    k_rope, c_kv = k_cache.reshape(k_cache.shape[0], -1).double(), v_cache.reshape(v_cache.shape[0], -1).double()
    out = torch.zeros(q.shape[0], q.shape[1], c_kv.shape[1], dtype=torch.float64)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, lk = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cache_seqlens[b])
        slots = page_table[b, :lk].long()
        for i in range(q0, q1):
            seen = lk - (q1 - i) + 1 if causal else lk  # bottom-right aligned
            kr, kv = k_rope[slots[:seen]], c_kv[slots[:seen]]
            scores = (q[i].double() @ kr.T + qv[i].double() @ kv.T) * softmax_scale  # [heads, keys]
            lse[:, i] = torch.logsumexp(scores, dim=-1)
            out[i] = torch.softmax(scores, dim=-1) @ kv
    return (out, lse) if return_softmax_lse else out


fa.flash_attn_with_kvcache = flash_attn_with_kvcache  # the module's name for it: upstream's paths and ours read it

torch.manual_seed(0)
H, RANK, ROPE = 4, 32, 16
LK, LV = RANK + ROPE, RANK
n, pool_size, max_ctx = 4, 160, 40
prefix = torch.tensor([9, 3, 14], dtype=torch.int64)
bs = len(prefix)
req_pool_indices = torch.tensor([2, 0, 1], dtype=torch.int64)
# EAGLE's tree (root 0; 1 and 2 children of 0; 3 a child of 1): draft token j sees its ancestors and itself
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

kv_pool = MLATokenToKVPool(pool_size, 1, torch.float32, RANK, ROPE, 2, "cpu", False)
req_to_token = torch.zeros(4, max_ctx, dtype=torch.int32)
perm = torch.randperm(pool_size - 1) + 1
used = 0
for b in range(bs):
    L = int(prefix[b]) + n
    req_to_token[req_pool_indices[b], :L] = perm[used: used + L].to(torch.int32)
    used += L
layers = [RadixAttention(H, LK, LK ** -0.5, 1, i, v_head_dim=LV) for i in range(2)]
for layer in layers:  # the prefix's latent KV, as earlier steps stored it
    for b in range(bs):
        slots = req_to_token[req_pool_indices[b], : prefix[b]].long()
        kv_pool.set_kv_buffer(layer, slots, torch.randn(len(slots), 1, LK), torch.randn(len(slots), 1, LV))
out_cache_loc = torch.cat([req_to_token[req_pool_indices[b], prefix[b]: prefix[b] + n].long() for b in range(bs)])


def backend(deterministic: bool):
    be = fa.FlashAttentionBackend.__new__(fa.FlashAttentionBackend)
    be.__dict__.update(
        forward_metadata=None, forward_metadata_spec_decode_expand=None, max_context_len=max_ctx,
        device=torch.device("cpu"), req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        req_to_token=req_to_token, token_to_kv_pool=kv_pool, kv_cache_dtype=torch.float32, kv_cache_dtype_str="auto",
        page_size=1, use_mla=True, topk=2, speculative_num_steps=2, speculative_num_draft_tokens=n,
        speculative_step_id=0, is_draft_runner=False, has_swa=False, has_local_attention=False,
        attention_chunk_size=None, sliding_window_size=None, attn_cp_size=1, fa_impl_ver=3, fa_skip_kv_cache=False,
        kv_cache_is_mxfp8=False, num_splits=1 if deterministic else 0, is_encoder_decoder=False,
        is_prefill_aware_swa=False, use_sliding_window_kv_pool=False, full_cg_prefill_metadata=None,
        _sched_meta_buf=None, skip_prefill=False, _unified_dense=False,
        _get_scheduler_metadata=None,
        # SGLang 0.5.23's __init__ also sets these (no index translation, no KV sharding, the FA3 split policy)
        kv_index_translator=types.SimpleNamespace(is_translating=False), _kv_shard_pool=None, local_attn_builder=None,
        _get_fa_runtime_policy=None, decode_num_splits=1 if deterministic else 0,
        _decode_uses_static_max_seqlen_k=False, _verify_mask=None)
    return be


def verify_batch():
    mask = torch.cat([torch.cat([torch.ones(n, int(p), dtype=torch.bool), TREE], dim=1).reshape(-1) for p in prefix])
    spec = types.SimpleNamespace(custom_mask=mask, draft_token_num=n, topk=2, positions=None,
                                 ragged_verify_layout=None)
    return types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, batch_size=bs,
                                 req_pool_indices=req_pool_indices, seq_lens=prefix, seq_lens_cpu=prefix,
                                 seq_lens_sum=int(prefix.sum()), out_cache_loc=out_cache_loc, encoder_lens=None,
                                 attn_cp_metadata=None, attn_attend_prefix_cache=None, _attn_output=None,
                                 out_cache_loc_is_physical=True)  # 0.5.23's KV write location: no translation


def run(be, fb, q, q_rope, k, k_rope):
    be.init_forward_metadata(fb)
    return [be.forward_extend(q[i], k[i], k[i], layer, fb, True, q_rope=q_rope[i], k_rope=k_rope[i]).double()
            for i, layer in enumerate(layers)]


def direct(q, q_rope, layer_index):
    """Each verify token (b, j): the prefix and the draft tokens TREE[j] lets it see, read straight from the pool."""
    kv = kv_pool.get_key_buffer(layer_index).reshape(-1, LK).double()
    out = []
    for b in range(bs):
        row = req_to_token[req_pool_indices[b]].long()
        for j in range(n):
            slots = torch.cat([row[: prefix[b]], row[prefix[b]: prefix[b] + n][TREE[j]]])
            t = b * n + j
            qn = q[layer_index][t].view(H, LV).double()
            qr = q_rope[layer_index][t].view(H, ROPE).double()
            s = (qr @ kv[slots, LV:].T + qn @ kv[slots, :LV].T) * LK ** -0.5
            out.append((torch.softmax(s, -1) @ kv[slots, :LV]).reshape(-1))
    return torch.stack(out)


q = [torch.randn(bs * n, H * LV) for _ in layers]
q_rope = [torch.randn(bs * n, H, ROPE) for _ in layers]
k = [torch.randn(bs * n, 1, LV) for _ in layers]
k_rope = [torch.randn(bs * n, 1, ROPE) for _ in layers]

result = {}
upstream = backend(deterministic=True)
CALLS.clear()
up = run(upstream, verify_batch(), q, q_rope, k, k_rope)
result["upstream_calls_per_layer"] = len(CALLS) // len(layers)  # the cascade: prefix pass + expand pass
direct_out = [direct(q, q_rope, i) for i in range(len(layers))]  # after the verify stored the draft tokens' KV

BUILT = []


class CountedRows(fa3_verify.DecodeRows):
    def __init__(self, *args):
        BUILT.append(self)
        super().__init__(*args)


fa3_verify.DecodeRows = CountedRows
ours = backend(deterministic=True)
server = types.SimpleNamespace(server_args=types.SimpleNamespace(enable_deterministic_inference=True))
fa3_verify.built_after(ours, model_runner=server, backend_str="fa3")
result["wrapped"] = isinstance(ours.__dict__.get("forward_extend"), type(fa3_verify.built_after)) or \
    "forward_extend" in ours.__dict__
CALLS.clear()
mine = run(ours, verify_batch(), q, q_rope, k, k_rope)
verify_calls = list(CALLS)
rows_first = ours.__dict__[fa3_verify.ROWS][1]
result["our_calls_per_layer"] = len(verify_calls) // len(layers)
result["rows_built_in_first_forward"] = len(BUILT)  # two layers, one build
run(ours, verify_batch(), q, q_rope, k, k_rope)
result["rows_built_in_two_forwards"] = len(BUILT)
result["row_lengths"] = rows_first.cache_seqlens.tolist()
result["ours_vs_cascade"] = max(float((a - b).abs().max()) for a, b in zip(mine, up))
result["ours_vs_direct"] = max(float((a.view(bs * n, -1) - d).abs().max()) for a, d in zip(mine, direct_out))
result["cascade_vs_direct"] = max(float((a.view(bs * n, -1) - d).abs().max()) for a, d in zip(up, direct_out))
result["output_norm"] = float(mine[0].norm())

# --speculative-mla-verify auto outside deterministic mode, and extend: upstream's cascade, not wrapped
for name, deterministic, mode in (("auto_nondeterministic", False, "auto"), ("extend", True, "extend")):
    os.environ["SGLANG_EXT_MLA_VERIFY"] = mode
    be = backend(deterministic)
    fa3_verify.built_after(be, model_runner=types.SimpleNamespace(
        server_args=types.SimpleNamespace(enable_deterministic_inference=deterministic)), backend_str="fa3")
    result[f"{name}_wrapped"] = "forward_extend" in be.__dict__
os.environ.pop("SGLANG_EXT_MLA_VERIFY")

# an over-wide prefix table with stale entries past each prefix (CUDA-graph replay's table is as wide as the
# context and only rewritten up to each length): the rows read nothing of it
normal, expand = ours.forward_metadata, ours.forward_metadata_spec_decode_expand
wide = torch.cat([normal.page_table, torch.randint(1, pool_size, (bs, 7), dtype=torch.int32)], dim=1)
for b in range(bs):
    wide[b, prefix[b]:] = torch.randint(1, pool_size, (wide.shape[1] - int(prefix[b]),), dtype=torch.int32)
rows = fa3_verify.DecodeRows(wide, normal.cache_seqlens_int32, expand.page_table, expand.cache_seqlens_int32)
narrow = fa3_verify.DecodeRows(normal.page_table, normal.cache_seqlens_int32, expand.page_table,
                               expand.cache_seqlens_int32)
result["wide_rows_equal"] = all(
    torch.equal(rows.page_table[r, : rows.cache_seqlens[r]], narrow.page_table[r, : narrow.cache_seqlens[r]])
    for r in range(bs * n)) and torch.equal(rows.cache_seqlens, narrow.cache_seqlens)

# the call a plain decode batch makes (upstream's forward_decode, MLA), against ours
plain = backend(deterministic=True)
decode = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=None, batch_size=bs,
                               req_pool_indices=req_pool_indices, seq_lens=prefix + 1, seq_lens_cpu=prefix + 1,
                               seq_lens_sum=int(prefix.sum()) + bs, out_cache_loc=out_cache_loc[::n],
                               encoder_lens=None, attn_cp_metadata=None, _attn_output=None,
                               out_cache_loc_is_physical=True)
plain.init_forward_metadata(decode)
CALLS.clear()
plain.forward_decode(q[0][::n], k[0][::n], k[0][::n], layers[0], decode, True, q_rope=q_rope[0][::n],
                     k_rope=k_rope[0][::n])


def form(call):
    return {key: (value if isinstance(value, (bool, int, float, str, type(None), tuple)) else type(value).__name__)
            for key, value in call.items() if key != "rows"}


result["decode_call"] = form(CALLS[0])
result["our_call"] = form(verify_calls[0])
print(json.dumps(result))
