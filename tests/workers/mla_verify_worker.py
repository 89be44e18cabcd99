"""Run under TRITON_INTERPRET=1 (Triton kernels on the CPU) by tests/serving/test_mla_verify.py: a chain verify
batch of an MLA target through SGLang's own kernels, upstream's way (extend_attention_fwd with the
verify tokens' K/V beside the prefix) and ours (sglang_ext.serving.mla_verify: bs x n decode queries
through decode_attention_fwd, the grouped MLA kernel), against plain attention. Prints JSON."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402

from sglang_ext.serving.mla_verify import expand_verify_indices  # noqa: E402

torch.manual_seed(0)
H, LK, LV = 4, 576, 512  # DeepSeek/Kimi latent: kv_lora 512 + rope 64; 4 query heads over one latent head
n = 4  # verify tokens per request (chain: 3 drafts + the last accepted token)
prefix = torch.tensor([9, 3, 14], dtype=torch.int32)
bs = len(prefix)
pool_size, max_ctx = 128, 32
req_pool_indices = torch.tensor([2, 0, 1], dtype=torch.int64)
req_to_token = torch.zeros(3, max_ctx, dtype=torch.int32)
perm = torch.randperm(pool_size - 1) + 1  # slot 0 is SGLang's padding sink
used = 0
for b in range(bs):
    L = int(prefix[b]) + n
    req_to_token[req_pool_indices[b], :L] = perm[used: used + L].to(torch.int32)
    used += L
k_buffer = torch.randn(pool_size, 1, LK)
v_buffer = k_buffer[..., :LV]  # MLA: the value is the latent part of the key
q = torch.randn(bs * n, H, LK)
scale = LK ** -0.5
out_cache_loc = torch.cat([req_to_token[req_pool_indices[b], prefix[b]: prefix[b] + n].long() for b in range(bs)])

# plain attention: query (b, i) over the request's prefix and draft tokens 0..i
ref = torch.zeros(bs * n, H, LV)
for b in range(bs):
    for i in range(n):
        slots = req_to_token[req_pool_indices[b], : prefix[b] + i + 1].long()
        p = torch.softmax(q[b * n + i] @ k_buffer[slots, 0].T * scale, dim=-1)
        ref[b * n + i] = p @ v_buffer[slots, 0]

# upstream: prefix indices + the verify tokens' K/V passed as the extend part, causal
kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
kv_indptr[1:] = torch.cumsum(prefix, 0)
kv_indices = torch.cat([req_to_token[req_pool_indices[b], : prefix[b]].long() for b in range(bs)])
qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32)
o_ext = torch.zeros(bs * n, H, LV)
extend_attention_fwd(q, k_buffer[out_cache_loc].contiguous(), v_buffer[out_cache_loc].contiguous(), o_ext,
                     k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, None, True, None, n, 1.0, 1.0,
                     sm_scale=scale)

# ours
max_splits = 4
exp_indptr = torch.zeros(bs * n + 1, dtype=torch.int32)
exp_indices = torch.zeros(bs * n * max_ctx, dtype=torch.int64)
lens = expand_verify_indices(req_to_token, req_pool_indices, prefix, n, exp_indptr, exp_indices)
o_dec = torch.zeros(bs * n, H, LV)
decode_attention_fwd(q, k_buffer, v_buffer, o_dec, exp_indptr, exp_indices,
                     torch.zeros(bs * n, H, max_splits, LV), torch.zeros(bs * n, H, max_splits),
                     torch.full((bs * n,), max_splits, dtype=torch.int32), max_splits, scale, 1.0, 1.0, has_mla=True)
print(json.dumps({"lens": lens.tolist(), "indptr": exp_indptr.tolist(),
                  "first_query_slots": exp_indices[: int(exp_indptr[1])].tolist(),
                  "expected_first_query_slots": req_to_token[req_pool_indices[0], : prefix[0] + 1].tolist(),
                  "extend_vs_ref": float((o_ext - ref).abs().max()), "decode_vs_ref": float((o_dec - ref).abs().max()),
                  "decode_vs_extend": float((o_dec - o_ext).abs().max())}))
