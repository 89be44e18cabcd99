"""The host time SGLang's radix cache spends evicting once cached prefixes fill the KV pool, with and without the
plugin's eviction batch (serving/prefix_cache.py), on SGLang's own RadixCache and token allocator (CPU tensors: what
is measured is the scheduler's Python work, which runs on the host whatever the device).

Each arm fills a pool with `leaves` cached requests of `--leaf-tokens` tokens, then runs `--steps` decode steps the
way the scheduler allocates them (evict the shortfall, allocate `--step-tokens`), the tokens held turning into
cached requests of the same size as they accumulate, so the pool stays full and the leaves stay as many. Prints a
table: per step, the host time of the whole allocation path and of the evictions in it.

    python -m sglang_ext.eval.radix_eviction_bench --leaves 1000,5000,20000 --shares 0,0.01
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time


def build(leaves: int, leaf_tokens: int, seed: int = 0):
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    alloc = TokenToKVPoolAllocator(leaves * leaf_tokens, torch.float16, "cpu", None, False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                       page_size=1))
    rng = random.Random(seed)
    for i in range(leaves):
        key = [i + 1] + [rng.randrange(1, 30000) for _ in range(leaf_tokens - 1)]
        cache.insert(InsertParams(key=RadixKey(key), value=alloc.alloc(leaf_tokens)))
    return cache, alloc


def run_arm(leaves: int, share: float, steps: int, step_tokens: int, leaf_tokens: int) -> dict:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from sglang_ext.serving import prefix_cache

    env, saved = "SGLANG_EXT_RADIX_EVICTION_BATCH", (os.environ.get("SGLANG_EXT_RADIX_EVICTION_BATCH"),
                                                     prefix_cache.COUNTERS)
    os.environ[env] = str(share)
    counters = prefix_cache.COUNTERS = prefix_cache.EvictionCounters()
    original = RadixCache.evict
    RadixCache.evict = lambda self, params: prefix_cache.evict(original, self, params)  # as the plugin's hook
    try:
        cache, alloc = build(leaves, leaf_tokens)
        gc.collect()  # the arm before's tree (parent-child cycles) is not this arm's to collect
        held, step_s, next_key = [], [], 10 ** 7
        for _ in range(steps):
            start = time.perf_counter()
            evict_from_tree_cache(cache, step_tokens)
            got = alloc.alloc(step_tokens)
            if got is None:
                raise RuntimeError(f"{step_tokens} tokens not allocatable after the eviction")
            held.append(got)
            pending = torch.cat(held)
            while len(pending) >= leaf_tokens:  # requests finishing into the cache
                cache.insert(InsertParams(key=RadixKey([next_key] + list(range(1, leaf_tokens))),
                                          value=pending[:leaf_tokens]))
                next_key, pending = next_key + 1, pending[leaf_tokens:]
            held = [pending]
            step_s.append(time.perf_counter() - start)
        c = counters.to_dict()
        return {"leaves": leaves, "share": share, "steps": steps, "evictions": c["evictions"],
                "step_ms": 1e3 * statistics.mean(step_s), "evict_ms_per_step": 1e3 * c["evict_seconds"] / steps,
                "leaves_after": len(cache.evictable_leaves)}
    finally:  # the process as it was: this arm's setting, counters and hook undone
        RadixCache.evict = original
        prefix_cache.COUNTERS = saved[1]
        if saved[0] is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved[0]


def table(rows: list[dict]) -> str:
    out = ["| cached requests (leaves) | eviction batch (share of pool) | steps | evictions | host ms per step | "
           "of it evicting |", "|---|---|---|---|---|---|"]
    for r in rows:
        batch = "shortfall only (upstream)" if r["share"] == 0 else f"{r['share']:g}"
        out.append(f"| {r['leaves']:,} | {batch} | {r['steps']} | {r['evictions']} | {r['step_ms']:.2f} | "
                   f"{r['evict_ms_per_step']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", default="1000,5000,20000", help="cached requests filling the pool, comma-separated")
    p.add_argument("--shares", default="0,0.01", help="eviction batches to compare (0: upstream), comma-separated")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-tokens", type=int, default=512, help="tokens a decode step allocates (128 requests x 4)")
    p.add_argument("--leaf-tokens", type=int, default=280, help="tokens of one cached request")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the scheduler's host work is one thread; two made each free-list torch.cat ~8 ms here
    rows = [run_arm(int(n), float(s), a.steps, a.step_tokens, a.leaf_tokens)
            for n in a.leaves.split(",") for s in a.shares.split(",")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
