"""The host time SGLang's radix cache spends evicting once cached prefixes fill the KV pool, with and without the
plugin's eviction batch (serving/prefix_cache.py), on SGLang's own RadixCache and token allocator (CPU tensors: what
is measured is the scheduler's Python work, which runs on the host whatever the device).

Each arm fills a pool with `leaves` cached requests of `--leaf-tokens` tokens, then runs `--steps` decode steps the
way the scheduler allocates them (evict the shortfall, allocate `--step-tokens`), the tokens held turning into
cached requests of the same size as they accumulate, so the pool stays full and the leaves stay as many. Prints a
table: per step, the host time of the whole allocation path and of the evictions in it.

What the batch costs in cache hits (`--hit-rate`): multi-turn conversations, each turn's prompt the conversation so
far plus a new message, the conversation picked Zipf-like (a few hot, many revisited after long gaps), served one
at a time as the scheduler does (match the prefix and lock it, allocate the rest, evicting the shortfall, insert the
whole sequence, unlock). Prints the share of prompt tokens found cached with each eviction batch.

    python -m sglang_ext.eval.radix_eviction_bench --leaves 1000,5000,20000 --shares 0,0.01
    python -m sglang_ext.eval.radix_eviction_bench --hit-rate --shares 0,0.01,0.05
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


class _Hooked:
    """The plugin's eviction hook on RadixCache.evict with `share`, fresh counters; the process as it was after."""

    def __init__(self, share: float):
        self.share = share

    def __enter__(self):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        from sglang_ext.serving import prefix_cache

        self.saved = (os.environ.get(SHARE_ENV), prefix_cache.COUNTERS, RadixCache.evict)
        os.environ[SHARE_ENV] = str(self.share)
        counters = prefix_cache.COUNTERS = prefix_cache.EvictionCounters()
        original = RadixCache.evict
        RadixCache.evict = lambda cache, params: prefix_cache.evict(original, cache, params)
        return counters

    def __exit__(self, *exc):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        from sglang_ext.serving import prefix_cache

        env, prefix_cache.COUNTERS, RadixCache.evict = self.saved
        if env is None:
            os.environ.pop(SHARE_ENV, None)
        else:
            os.environ[SHARE_ENV] = env


SHARE_ENV = "SGLANG_EXT_RADIX_EVICTION_BATCH"


def run_arm(leaves: int, share: float, steps: int, step_tokens: int, leaf_tokens: int) -> dict:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    with _Hooked(share) as counters:
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


def hit_rate_arm(share: float, pool_tokens: int = 200_000, conversations: int = 2000, turns: int = 6000,
                 warmup_turns: int = 2000, message_tokens: int = 200, reply_tokens: int = 80,
                 max_history: int = 4000, zipf: float = 1.0, seed: int = 0) -> dict:
    """Prompt tokens found cached, over the turns after `warmup_turns`, with eviction batch `share`."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    rng = random.Random(seed)
    weights = [1 / (k + 1) ** zipf for k in range(conversations)]
    with _Hooked(share) as counters:
        alloc = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", None, False)
        cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                           page_size=1))
        history: dict[int, list[int]] = {}
        started = 0
        prompt_tokens = cached_tokens = 0
        for turn in range(turns):
            c = rng.choices(range(conversations), weights)[0]
            if len(history.get(c, [])) + message_tokens + reply_tokens > max_history or c not in history:
                started += 1  # a new conversation in this slot: its own first token, nothing of it cached
                history[c] = [10 ** 6 + started]
            prompt = history[c] + [rng.randrange(1, 30000) for _ in range(message_tokens)]
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
            node = match.last_device_node
            cached = cache.path_device_indices(node) if hasattr(cache, "path_device_indices") \
                else match.device_indices
            cache.inc_lock_ref(node)  # a running request's prefix is not evictable
            new = len(prompt) + reply_tokens - len(cached)
            evict_from_tree_cache(cache, new)
            got = alloc.alloc(new)
            if got is None:
                raise RuntimeError(f"turn {turn}: {new} tokens not allocatable after the eviction")
            sequence = prompt + [rng.randrange(1, 30000) for _ in range(reply_tokens)]
            value = torch.cat([cached, got])
            inserted = cache.insert(InsertParams(key=RadixKey(sequence), value=value))
            if inserted.prefix_len > len(cached):  # already cached by an earlier insert: ours are duplicates
                alloc.free(value[len(cached):inserted.prefix_len])
            cache.dec_lock_ref(node)
            history[c] = sequence
            if turn >= warmup_turns:
                prompt_tokens += len(prompt)
                cached_tokens += len(cached)
        c = counters.to_dict()
        return {"share": share, "turns": turns - warmup_turns, "pool_tokens": pool_tokens,
                "hit_rate": cached_tokens / prompt_tokens, "evictions": c["evictions"],
                "evicted_tokens": c["tokens_evicted"], "evict_ms_per_turn": 1e3 * c["evict_seconds"] / turns}


def hit_rate_table(rows: list[dict]) -> str:
    out = ["| eviction batch (share of pool) | turns measured | prompt tokens cached | evictions | tokens evicted | "
           "host ms evicting per turn |", "|---|---|---|---|---|---|"]
    for r in rows:
        batch = "shortfall only (upstream)" if r["share"] == 0 else f"{r['share']:g}"
        out.append(f"| {batch} | {r['turns']} | {100 * r['hit_rate']:.2f}% | {r['evictions']} | "
                   f"{r['evicted_tokens']:,} | {r['evict_ms_per_turn']:.3f} |")
    return "\n".join(out)


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
    p.add_argument("--hit-rate", action="store_true", help="the prompt tokens found cached under multi-turn "
                   "conversations with each batch (--shares), instead of the host time")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the scheduler's host work is one thread; two made each free-list torch.cat ~8 ms here
    if a.hit_rate:
        print(hit_rate_table([hit_rate_arm(float(s)) for s in a.shares.split(",")]))
        return 0
    rows = [run_arm(int(n), float(s), a.steps, a.step_tokens, a.leaf_tokens)
            for n in a.leaves.split(",") for s in a.shares.split(",")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
