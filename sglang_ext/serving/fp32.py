"""Serving a DeepseekV3-family target with ``--dtype float32``: the reference that separates the dtype from
the kernels when SGLang's greedy output is compared with transformers' (tests/gpu/scale_pipeline.py).

Why: SGLang 0.5.17 cannot serve an MLA target in fp32. An RMSNorm without a residual (every layer's input
norm, MLA's q/kv latent norms) calls sgl_kernel's ``rmsnorm``, whose compiled library holds fp16 and bf16
instantiations only: the server dies at its first CUDA-graph capture ("failed to dispatch data type
Float"). And the Triton fused-MoE kernel casts its accumulator to fp16 for any input that is not bf16, so
an fp32 MoE layer silently computes in fp16. Extends, SGLang 0.5.17 (every other dtype passes through
unchanged: one dtype check per eager call, nothing inside a CUDA graph):
  * ``RMSNorm.forward_cuda`` (AROUND) -- fp32 input: upstream's own ``forward_native`` (pure torch, the same
    formula, with or without the residual);
  * ``fused_moe.invoke_fused_moe_kernel`` (AROUND) -- fp32 input: ``compute_type`` fp32 (the kernel uses it
    only to cast its accumulator for the store).
Triton compiles an fp32 ``tl.dot`` as TF32 unless ``TRITON_F32_DEFAULT=ieee`` is set in the server's
environment; the fp32 reference server of the pipeline sets it.
"""

from __future__ import annotations

import torch

from sglang_ext.serving.hooks import Hook


def rmsnorm_forward_cuda(original_fn, self, x, residual=None, post_residual_addition=None, *args, **kwargs):
    if x.dtype == torch.float32:
        return self.forward_native(x, residual, post_residual_addition)
    return original_fn(self, x, residual, post_residual_addition, *args, **kwargs)


def invoke_fused_moe_kernel(original_fn, A, *args, **kwargs):
    if A.dtype == torch.float32 and "compute_type" in kwargs:
        import triton.language as tl

        kwargs["compute_type"] = tl.float32
    return original_fn(A, *args, **kwargs)


HOOKS = (
    Hook("sglang.srt.layers.layernorm.RMSNorm.forward_cuda", "around", rmsnorm_forward_cuda,
         feature="fp32 MLA targets (RMSNorm)"),
    Hook("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.invoke_fused_moe_kernel", "around",
         invoke_fused_moe_kernel, feature="fp32 MLA targets (fused MoE)"),
)
