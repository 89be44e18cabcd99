"""The draft's KV pool: sized from its real bytes per token, with its own cache dtype.

Extends (hooks registered by sglang_ext.plugin):
  * ``sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__`` (AROUND) --
    upstream budgets an EAGLE draft as "one more target layer" (target bytes/token x (1 + 1/L)),
    right for an MTP layer, wrong for an Eagle3 head: an MHA head under an MLA target caches full K
    and V per head (Kimi-K2.5: 4 KiB/token against ~1.1 KiB/token for a target layer), so the pools
    outgrow the memory SGLang was given. The target's per-token cost becomes target + draft
    (config.kv.draft_kv_bytes_per_token), and the split is logged.
  * ``...DefaultPoolConfigurator.calculate_pool_sizes`` (AFTER) -- logs tokens and GiB per pool.
  * ``sglang.srt.model_executor.model_runner.ModelRunner.configure_kv_cache_dtype`` (AROUND) -- the
    draft runner caches in ``--speculative-draft-kv-cache-dtype`` (bf16 | fp8_e4m3; default auto: the
    target's). From SGLang 0.5.18 the flag is SGLang's own, and SGLang applies it to the draft runner: the plugin
    then reads it (compat.draft_kv_dtype) for the pool's size and its checks, and refuses
    ``SGLANG_EXT_DRAFT_KV_CACHE_DTYPE`` naming another dtype. An MLA head shares the target's latent layout and is
    refused another dtype at startup.
  * ``sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool`` (AFTER) -- logs what
    each pool really allocated, so the arithmetic can be checked against the allocator.

The draft indexes the target's token allocator, so both pools always hold the same number of tokens:
a cheaper draft token (fp8, or an MLA head) buys more tokens for both.
"""

from __future__ import annotations

import logging

import torch

from sglang_ext.config import kv
from sglang_ext.config.kv import DRAFT_KV_DTYPE_FIELD, PoolSplit, draft_kv_bytes_per_token, kv_dtype_errors
from sglang_ext.errors import ConfigError
from sglang_ext.serving import compat
from sglang_ext.serving.context import server_args, server_draft
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

TORCH_KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                   torch.float8_e4m3fn: "fp8_e4m3"}
KV_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                   "fp8_e4m3": torch.float8_e4m3fn}
SGLANG_DTYPE_STR = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "fp8_e4m3"}


def _attn_tp_size(kvc=None) -> int:
    """Ranks the draft's attention heads are split over (compat.draft_attn_tp_size)."""
    return compat.draft_attn_tp_size(kvc)


def _is_eagle3_target(kvc) -> bool:
    algo = getattr(kvc, "spec_algorithm", None)
    return algo is not None and algo.is_eagle3() and not kvc.is_draft_worker


def pool_configurator_init(original_fn, self, kvc, *args, **kwargs):
    original_fn(self, kvc, *args, **kwargs)
    from sglang.srt.configs.hybrid_arch import mambaish_config

    drafted = server_draft() if _is_eagle3_target(kvc) else None
    if drafted is None or mambaish_config(kvc.model_config):  # hybrid targets: upstream's sizing
        return
    if compat.fused_draft_entry_bytes(kvc) is not None:  # the draft's KV inside the target's entries (0.5.23)
        logger.info("[sglang_ext] the draft's KV is fused into the target pool's entries: sized by SGLang")
        return
    draft, _ = drafted
    target_dtype = TORCH_KV_DTYPES.get(kvc.kv_cache_dtype)
    draft_dtype = compat.draft_kv_dtype() or target_dtype
    if target_dtype is None or draft_dtype is None:
        logger.warning("[sglang_ext] KV cache dtype %s: draft pool left as upstream sizes it", kvc.kv_cache_dtype)
        return
    target_bytes = self._compute_cell_size(kvc, kvc.layer_info.num_effective_layers)
    draft_bytes = draft_kv_bytes_per_token(draft, draft_dtype, _attn_tp_size(kvc)) * compat.draft_loc_space_scale()
    upstream_draft = self._cell_size - target_bytes
    self._cell_size = target_bytes + draft_bytes
    self._sglang_ext_split = (target_bytes, draft_bytes)
    logger.info("[sglang_ext] KV bytes/token per rank: target %d (%s), draft %d (%s head, %s); upstream SGLang "
                "would budget the draft at %d", target_bytes, target_dtype, draft_bytes,
                draft.head_format.upper(), draft_dtype, upstream_draft)


def pool_sizes_after(result, self, available_bytes, page_size, *args, **kwargs):
    split = getattr(self, "_sglang_ext_split", None)
    if split is not None and result is not None:
        budget = max(int(available_bytes) - compat.fixed_pool_overhead_bytes(self), 0)
        s = PoolSplit(budget, split[0], split[1], int(page_size))
        cap = getattr(server_args(), "max_total_tokens", None)  # SGLang applies it after this sizing
        capped = f" (--max-total-tokens {cap} caps both pools)" if cap and cap < result.max_total_num_tokens else ""
        logger.info("[sglang_ext] KV pool split: %s; SGLang sized %d tokens%s", s.describe(),
                    result.max_total_num_tokens, capped)
    return result


def configure_kv_cache_dtype(original_fn, self, *args, **kwargs):
    original_fn(self, *args, **kwargs)
    if not getattr(self, "is_draft_worker", False):
        return
    option = compat.draft_kv_dtype()  # refuses our variable contradicting SGLang's own flag (0.5.18+)
    if option is None:
        return
    by_sglang = compat.upstream_draft_kv_cache_dtype() is not None  # 0.5.18+: SGLang applied it to this runner
    drafted = server_draft()
    if drafted is None:
        if by_sglang:  # SGLang's own flag, applied by SGLang: nothing of the plugin's to check against
            return
        raise ConfigError(DRAFT_KV_DTYPE_FIELD, option, "set, but the server has no readable Eagle3 draft config",
                          "leave it at auto or pass --speculative-draft-model-path to a local directory")
    draft, _ = drafted
    own = TORCH_KV_DTYPES.get(self.kv_cache_dtype, str(self.kv_cache_dtype))
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    errors = kv_dtype_errors(draft, option, _target_kv_dtype(self, own) if by_sglang else own, capability)
    if errors:
        raise errors[0]
    if option != own and not by_sglang:
        self.kv_cache_dtype = KV_TORCH_DTYPES[option]
        self.kv_cache_dtype_str = SGLANG_DTYPE_STR[option]
        logger.info("[sglang_ext] draft KV cache dtype %s (target %s) from %s", option, own, DRAFT_KV_DTYPE_FIELD)


def _target_kv_dtype(runner, own: str) -> str:
    """The target's KV cache dtype, seen from a draft runner SGLang already switched to the draft's own (0.5.18+)."""
    name = getattr(server_args(), "kv_cache_dtype", None)
    if name in (None, "auto"):
        return TORCH_KV_DTYPES.get(getattr(runner, "dtype", None), own)
    try:
        return kv.target_kv_dtype(name)
    except ConfigError:
        return own


def alloc_memory_pool_after(result, self, *args, **kwargs):
    if getattr(self.server_args, "speculative_algorithm", None) is None:
        return result
    pool = getattr(self, "token_to_kv_pool", None)
    try:
        size = pool.get_kv_size_bytes()
    except Exception:
        return result
    total = sum(size) if isinstance(size, (tuple, list)) else int(size)
    slots = pool.size + getattr(pool, "page_size", 1)  # SGLang allocates one padding page
    logger.info("[sglang_ext] %s KV pool allocated: %d tokens, %.3f GiB, %d B/token (%s)",
                "draft" if self.is_draft_worker else "target", self.max_total_num_tokens, total / 2 ** 30,
                total // max(1, slots), TORCH_KV_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype))
    return result


HOOKS = (
    Hook("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__", "around",
         pool_configurator_init, feature="the draft pool's size"),
    Hook("sglang.srt.model_executor.model_runner.ModelRunner.configure_kv_cache_dtype", "around",
         configure_kv_cache_dtype, feature="the draft KV cache dtype"),
    Hook("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes", "after",
         pool_sizes_after, feature="the pool split log line"),
    Hook("sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool", "after", alloc_memory_pool_after,
         feature="the allocated pools' log lines"),
)
