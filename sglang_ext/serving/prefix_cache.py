"""Radix-cache eviction in batches, and its counters in /get_server_info.

Once the cached prefixes fill the KV pool, every allocation (each prefill batch, each decode step) finds too few free
tokens, and SGLang evicts exactly the shortfall (``mem_cache.common.evict_from_tree_cache``, 0.5.17;
``evict_for_alloc``, 0.5.23). Each ``RadixCache.evict`` lists every evictable leaf, asks the eviction policy for its
priority and heapifies them, whatever it then frees: Python work linear in the leaves, on the scheduler's thread.
With ~20k cached requests that is ~50 ms per call on a 2-core CPU (eval/radix_eviction_bench.py), paid on nearly
every step. In a 10-minute FA3 soak (256 clients, mixed prompts to 32k, 30% shared prefixes) output throughput halved
at the minute the pool filled -- the allocator's live blocks, one per tree node, rose by 21k and then stayed flat --
and the depth-0 step time of the same batch size went from 15 to 32 ms with the GPU 0-23% busy.

Upstream knows the cost (sglang-omni issue #1723; sglang PRs #38454 / #38371 keep a persistent heap instead, open
for UnifiedRadixCache); 0.5.17 - 0.5.23's RadixCache rebuilds the heap on every call.

So an eviction of n > 0 tokens frees at least ``--radix-eviction-batch`` of the pool (default 1%): the scan runs once
per that many tokens allocated instead of once per step. What it costs: the least recently used 1% of the cache goes
a little earlier than it would have (multi-turn conversations on the CPU: 65.86% of prompt tokens cached, upstream
65.88%). 0 restores upstream's shortfall-only eviction.

Extends (hooks registered by sglang_ext.plugin), SGLang 0.5.17 - 0.5.23:
  * ``sglang.srt.mem_cache.radix_cache.RadixCache.evict`` (AROUND) -- the batch floor above, and per-process counters:
    evictions, the tokens they freed, their host time (subclasses that call ``super().evict`` are counted too;
    HiRadixCache's own eviction is not hooked).
  * ``sglang.srt.managers.scheduler.Scheduler.get_internal_state`` (AFTER) -- the counters, the evictable leaves and
    the batch as ``internal_states[0].sglang_ext_prefix_cache`` of ``/get_server_info``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from sglang_ext import settings
from sglang_ext.serving.hooks import Hook


class EvictionCounters:
    """What every radix-cache eviction of this process did (one scheduler per process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.tokens_requested = 0  # what the callers asked for
        self.tokens_evicted = 0  # what was freed (whole leaves: usually more than asked)
        self.seconds = 0.0

    def add(self, requested: int, evicted: int, seconds: float) -> None:
        with self.lock:
            self.calls += 1
            self.tokens_requested += requested
            self.tokens_evicted += evicted
            self.seconds += seconds

    def to_dict(self) -> dict:
        with self.lock:
            return {"evictions": self.calls, "tokens_requested": self.tokens_requested,
                    "tokens_evicted": self.tokens_evicted, "evict_seconds": round(self.seconds, 6)}


COUNTERS = EvictionCounters()


def batch_tokens(cache, share: float) -> int:
    """The least number of tokens one eviction frees: `share` of the cache's KV pool (0 without a pool)."""
    size = getattr(getattr(cache, "token_to_kv_pool_allocator", None), "size", 0) or 0
    return int(size * share)


def evict(original_fn, self, params, *args, **kwargs):
    requested = int(getattr(params, "num_tokens", 0) or 0)
    if getattr(self, "disable", False) or requested <= 0:  # nothing to free (a mamba- or SWA-only eviction)
        return original_fn(self, params, *args, **kwargs)
    floor = batch_tokens(self, settings.current().radix_eviction_batch)
    if floor > requested:
        params = dataclasses.replace(params, num_tokens=floor)
    start = time.perf_counter()
    result = original_fn(self, params, *args, **kwargs)
    COUNTERS.add(requested, int(getattr(result, "num_tokens_evicted", 0) or 0), time.perf_counter() - start)
    return result


def state(cache) -> dict:
    out = COUNTERS.to_dict()
    leaves = getattr(cache, "evictable_leaves", None)
    out.update(evictable_leaves=None if leaves is None else len(leaves),
               evictable_tokens=int(cache.evictable_size()) if hasattr(cache, "evictable_size") else None,
               batch_share=settings.current().radix_eviction_batch,
               batch_tokens=batch_tokens(cache, settings.current().radix_eviction_batch))
    return out


def internal_state_after(result, self, *args, **kwargs):
    internal = getattr(result, "internal_state", None)
    cache = getattr(self, "tree_cache", None)
    if isinstance(internal, dict) and cache is not None:
        internal["sglang_ext_prefix_cache"] = state(cache)
    return result


HOOKS = (
    Hook("sglang.srt.mem_cache.radix_cache.RadixCache.evict", "around", evict,
         feature="radix-cache eviction in batches (--radix-eviction-batch)"),
    Hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after", internal_state_after,
         feature="the radix-cache eviction counters in /get_server_info"),
)
