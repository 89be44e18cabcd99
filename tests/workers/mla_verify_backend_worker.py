"""Run under TRITON_INTERPRET=1 by tests/serving/test_mla_verify.py (argument `tree` for a draft tree, else a
chain; `deterministic`: SGLang's deterministic mode, verify rows against plain decode rows bit for bit): the
installed SGLang's own TritonAttnBackend methods (0.5.17; from 0.5.21 with what their __init__ and forward batch
also carry) on a target-verify batch of an MLA layer, on the CPU -- upstream's path
(`init_forward_metadata` + `forward_extend`: the extend kernel) against the plugin's hooks
(sglang_ext.serving.mla_verify: the same methods, then `forward_decode`: the grouped decode kernel),
both eager and through the CUDA-graph metadata path (`init_cuda_graph_state`,
`init_forward_metadata_out_graph` capture and replay). Real pools (MLATokenToKVPool; req_to_token as ReqToTokenPool holds it),
a real RadixAttention layer and real kernels; the backend object is built without its __init__
(which needs a model runner and a GPU) and given the attributes that __init__ would set. Prints JSON."""

import dataclasses
import json
import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.attention.verify_mask import VerifyMask, tree_mask_numel  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.eagle_utils import TreeMaskMode  # noqa: E402

from sglang_ext.serving import compat, mla_verify  # noqa: E402

if compat.at_least("0.5.21"):
    # SGLang 0.5.21+ reads the parallel topology from the runtime context, which a server publishes; this process
    # states the one the pools and the backend run in here (one rank, no context parallelism)
    from sglang.srt.runtime_context import get_parallel  # noqa: E402

    get_parallel().override_permanently(dcp_enabled=False, attn_dcp_size=1)

TREE = "tree" in sys.argv[1:]  # else a chain
DETERMINISTIC = "deterministic" in sys.argv[1:]  # --enable-deterministic-inference: KV splits by a fixed tile
torch.manual_seed(0)
H, RANK, ROPE = 4, 512, 64
LK, LV = RANK + ROPE, RANK
n, pool_size, max_ctx, max_bs = 4, 160, 32, 4
prefix = torch.tensor([9, 3, 14], dtype=torch.int64)
bs = len(prefix)
req_pool_indices = torch.tensor([2, 0, 1], dtype=torch.int64)

kv_pool = MLATokenToKVPool(pool_size, 1, torch.float32, RANK, ROPE, 1, "cpu", False)
req_to_token = torch.zeros(max_bs, max_ctx, dtype=torch.int32)
perm = torch.randperm(pool_size - 1) + 1
used = 0
for b in range(bs):
    L = int(prefix[b]) + n
    req_to_token[req_pool_indices[b], :L] = perm[used: used + L].to(torch.int32)
    used += L
layer = RadixAttention(H, LK, LK ** -0.5, 1, 0, v_head_dim=LV)
# the prefix's latent KV, as earlier steps stored it
for b in range(bs):
    slots = req_to_token[req_pool_indices[b], : prefix[b]].long()
    kv_pool.set_kv_buffer(layer, slots, torch.randn(len(slots), 1, LK), torch.randn(len(slots), 1, LV))
out_cache_loc = torch.cat([req_to_token[req_pool_indices[b], prefix[b]: prefix[b] + n].long() for b in range(bs)])
q = torch.randn(bs * n, H * LK)
k_new = torch.randn(bs * n, 1, LK)
v_new = k_new[..., :LV].clone()  # MLA: the value is the latent part of the key


TRANSLATOR = None  # SGLang 0.5.21+: the model runner's KV index translator (passthrough: a plain pool)
if compat.at_least("0.5.21"):
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402

    TRANSLATOR = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=None,
                                   token_to_kv_pool=kv_pool, page_size=1, device="cpu")


def planned(fb):
    """SGLang 0.5.23+: a forward batch carries its KV location plan (its own, as a forward that is its own iteration)."""
    if TRANSLATOR is not None and hasattr(TRANSLATOR, "own_plan"):
        TRANSLATOR.own_plan(fb).bind(fb, TRANSLATOR)
        fb.mha_one_shot, fb.attn_attend_prefix_cache = False, False  # no dense one-shot MLA prefill here
        fb.extend_seq_lens_cpu = getattr(fb, "extend_seq_lens_cpu", None)
    return fb


def backend() -> TritonAttnBackend:
    be = TritonAttnBackend.__new__(TritonAttnBackend)
    torch.nn.Module.__init__(be) if isinstance(be, torch.nn.Module) else None
    be.__dict__.update(
        decode_attention_fwd=decode_attention_fwd, extend_attention_fwd=extend_attention_fwd, skip_prefill=False,
        sliding_window_size=None, token_to_kv_pool=kv_pool, req_to_token=req_to_token, use_sliding_window_kv_pool=False,
        page_size=1, _translate_kv_loc=None, num_draft_tokens=n, speculative_num_steps=n - 1, topk=2 if TREE else 1,
        use_verify_splitkv=False, use_mla=True, dcp_size=1, dcp_rank=0, num_head=H, num_kv_head=1, v_head_dim=LV,
        swa_v_head_dim=None, max_context_len=max_ctx, device=torch.device("cpu"), device_core_count=4,
        static_kv_splits=False, max_kv_splits=4, use_pdl=False, allow_bidirectional_attention_in_extend=False,
        enable_deterministic=DETERMINISTIC, split_tile_size=4 if DETERMINISTIC else None,
        kv_indptr=torch.zeros(max_bs * n + 1, dtype=torch.int32),
        window_kv_indptr=None, qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int64),
        mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int64), forward_metadata=None, _verify_mask=None,
        is_draft_runner=False)
    if TRANSLATOR is not None:  # what SGLang 0.5.21+'s __init__ also sets
        be.__dict__.update(
            kv_index_translator=TRANSLATOR,
            target_verify_num_tokens_per_req=n, dllm_block_size=None, dllm_attention=None,
            enable_lean_attention=False, use_verify_shared_kv=False, is_hip_dspark_draft=False,
            _dense_one_shot_kv_indptr=None, use_dense_fp8_chunked_prefill=False, prepare_chunked_prefill_qkv=None,
            pack_prefix_chunk_kv=None, lean_total_programs=1, lean_block_m=1)  # lean decode: off, tiny buffers
    return be


def batch():
    # EAGLE's verify mask: row i sees the whole prefix and, of the draft tokens, its ancestors and itself --
    # a chain's 0..i, or a tree (root 0; 1 and 2 children of 0; 3 a child of 1), request-major rows
    draft = torch.ones(n, n, dtype=torch.bool).tril() if not TREE else torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.cat([torch.ones(n, int(p), dtype=torch.bool), draft], dim=1).reshape(-1) for p in prefix])
    spec = types.SimpleNamespace(draft_token_num=n, custom_mask=mask, kv_indptr=None,
                                 num_tokens_per_req=-1)  # SGLang 0.5.21+: nonpositive -> the captured width
    return planned(types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, batch_size=bs,
                                         req_pool_indices=req_pool_indices, seq_lens=prefix,
                                         seq_lens_sum=int(prefix.sum()), seq_lens_cpu=prefix,
                                         out_cache_loc=out_cache_loc, encoder_lens=None, extend_prefix_lens=None,
                                         extend_seq_lens=None))


def run(be, fb, use_graph_path: bool):
    if use_graph_path:
        be.init_forward_metadata_out_graph(fb, in_capture=True)
        mla_verify.init_forward_metadata_out_graph_after(None, be, fb, in_capture=True)
    else:
        be.init_forward_metadata(fb)
        mla_verify.init_forward_metadata_after(None, be, fb)
    out = mla_verify.forward_extend(TritonAttnBackend.forward_extend, be, q.clone(), k_new.clone(), v_new.clone(),
                                    layer, fb, True)
    return out.view(bs * n, H, LV)


result = {}
if DETERMINISTIC:
    # SGLang's deterministic mode: every decode query splits its KV by a fixed tile, so a verify query run as a
    # decode query must equal, bit for bit, the plain decode of that token -- the property that makes greedy
    # speculation reproduce the target alone exactly
    be = backend()
    ours = run(be, batch(), use_graph_path=False)  # also stores the draft tokens' latent KV
    worst = 0.0
    for i in range(n):
        rows = torch.arange(bs) * n + i
        fb = planned(types.SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=None, batch_size=bs,
                                           req_pool_indices=req_pool_indices, seq_lens=prefix + i + 1,
                                           seq_lens_sum=int((prefix + i + 1).sum()), seq_lens_cpu=prefix + i + 1,
                                           out_cache_loc=out_cache_loc[rows], encoder_lens=None))
        dec = backend()
        dec.init_forward_metadata(fb)
        plain = dec.forward_decode(q[rows].clone(), k_new[rows].clone(), v_new[rows].clone(), layer, fb, True)
        worst = max(worst, float((plain.view(bs, H, LV) - ours[rows]).abs().max()))
    result["verify_vs_plain_decode_max_diff"] = worst
    result["kv_splits"] = be.forward_metadata.num_kv_splits.tolist()
    result["upstream_norm"] = float(ours.abs().mean())
    print(json.dumps(result))
    sys.exit(0)
up = backend()
fb = batch()
up.init_forward_metadata(fb)
upstream = up.forward_extend(q.clone(), k_new.clone(), v_new.clone(), layer, fb, True).view(bs * n, H, LV)
ours = run(backend(), batch(), use_graph_path=False)
result["eager_max_diff"] = float((ours - upstream).abs().max())
be = backend()
be.init_cuda_graph_state(max_bs, max_bs * n)
mla_verify.init_cuda_graph_state_after(None, be, max_bs, max_bs * n)
# the GPU's layout (TreeMaskMode.FULL_MASK; on a CPU upstream would allocate the other one)
be._verify_mask = VerifyMask(buffer=torch.zeros(tree_mask_numel(TreeMaskMode.FULL_MASK, max_bs, n, max_ctx),
                                                dtype=torch.bool), mode=TreeMaskMode.FULL_MASK, max_bs=max_bs)
graph = run(be, batch(), use_graph_path=True)
result["graph_max_diff"] = float((graph - upstream).abs().max())
# replay preparation refills the buffers the captured metadata points at -- also when an eager batch ran in
# between and left its own metadata (no verify mask) on the backend, as the server's prefills do
captured = be.forward_metadata
be.forward_metadata = dataclasses.replace(captured, custom_mask=None, mask_indptr=None)
for buf in (getattr(be, mla_verify.INDPTR), be.cuda_graph_kv_indices, be.cuda_graph_num_kv_splits):
    buf.zero_()
be.init_forward_metadata_out_graph(batch(), in_capture=False)
mla_verify.init_forward_metadata_out_graph_after(None, be, batch(), in_capture=False)
result["replay_same_buffers"] = captured.kv_indptr.data_ptr() == getattr(be, mla_verify.INDPTR).data_ptr()
be.forward_metadata = captured  # what the replayed graph reads: the captured buffers, refilled
replayed = mla_verify.forward_extend(TritonAttnBackend.forward_extend, be, q.clone(), k_new.clone(), v_new.clone(),
                                     layer, batch(), True).view(bs * n, H, LV)
result["replay_max_diff"] = float((replayed - upstream).abs().max())
# a prefill (not verify) batch after it goes to upstream's extend path untouched
result["flag_after_verify"] = getattr(be, mla_verify.FLAG)
prefill = batch()
prefill.forward_mode = ForwardMode.EXTEND
mla_verify.init_forward_metadata_after(None, be, prefill)
result["flag_after_prefill"] = getattr(be, mla_verify.FLAG)
result["prefill_goes_upstream"] = mla_verify.forward_extend(lambda *a, **k: "upstream", be, q, k_new, v_new, layer,
                                                            prefill, True) == "upstream"
result["upstream_norm"] = float(upstream.abs().mean())
print(json.dumps(result))
