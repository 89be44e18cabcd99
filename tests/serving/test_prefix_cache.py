"""Radix-cache eviction in batches (serving/prefix_cache.py), on SGLang's own RadixCache and token allocator (CPU
tensors): a full pool evicts once per batch instead of once per allocation, nothing is lost or freed twice, a locked
prefix is never evicted, and the counters reach /get_server_info."""

import random

import pytest

SHARE = "SGLANG_EXT_RADIX_EVICTION_BATCH"


def full_cache(leaves: int, leaf_len: int, spare: int = 0):
    """A RadixCache holding `leaves` distinct cached requests of `leaf_len` tokens, the pool full but `spare`."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    alloc = TokenToKVPoolAllocator(leaves * leaf_len + spare, torch.float16, "cpu", None, False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                       page_size=1))
    rng = random.Random(0)
    keys = []
    for i in range(leaves):
        key = [i + 1] + [rng.randrange(1, 30000) for _ in range(leaf_len - 1)]  # distinct first tokens: one leaf each
        cache.insert(InsertParams(key=RadixKey(key), value=alloc.alloc(leaf_len)))
        keys.append(key)
    return cache, alloc, keys


@pytest.fixture
def hooked(monkeypatch):
    """RadixCache.evict wrapped by the plugin's hook, as SGLang's HookRegistry applies an AROUND hook (undone after
    the test), with this test's own counters."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_ext.serving import prefix_cache

    original = RadixCache.evict
    monkeypatch.setattr(RadixCache, "evict", lambda self, params: prefix_cache.evict(original, self, params))
    monkeypatch.setattr(prefix_cache, "COUNTERS", prefix_cache.EvictionCounters())
    return prefix_cache.COUNTERS


def evict(cache, tokens: int):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_ext.serving import prefix_cache

    return prefix_cache.evict(RadixCache.evict, cache, EvictParams(num_tokens=tokens))


@pytest.mark.parametrize("share, freed", [("0.05", 500), ("0", 50)])
def test_an_eviction_frees_at_least_the_batch_share_of_the_pool(monkeypatch, share, freed):
    monkeypatch.setenv(SHARE, share)
    cache, alloc, _ = full_cache(200, 50)  # a 10,000-token pool
    assert alloc.available_size() == 0
    result = evict(cache, 10)
    assert result.num_tokens_evicted == freed == alloc.available_size()  # whole leaves: 10 of them, or the one
    assert len(cache.evictable_leaves) == 200 - freed // 50


def _serve(cache, alloc, keys, steps: int, per_step: int, finish_every: int):
    """Decode steps on a full pool as the scheduler allocates them (evict the shortfall, then allocate), a request
    finishing into the cache every `finish_every` steps with the tokens it held. Returns the tokens held by running
    requests at the end."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    held = []
    for step in range(steps):
        evict_from_tree_cache(cache, per_step)
        got = alloc.alloc(per_step)
        assert got is not None, f"step {step}: {per_step} tokens not allocatable after the eviction"
        held.append(got)
        if step % finish_every == finish_every - 1:
            import torch

            value = torch.cat(held[:finish_every])
            del held[:finish_every]
            key = [10 ** 6 + step] + list(range(1, len(value)))
            cache.insert(InsertParams(key=RadixKey(key), value=value))
            keys.append(key)
    return sum(len(h) for h in held)


@pytest.mark.parametrize("share", ["0", "0.02"])
def test_a_full_pool_evicts_once_per_batch_and_loses_no_token(monkeypatch, hooked, share):
    """Upstream's shortfall-only eviction scans every evictable leaf on each of these steps; a 2% batch on a
    12,000-token pool (240 tokens) scans on one step in 15 at 16 tokens a step. Either way every step allocates,
    the pool's tokens are all accounted for (free + cached + held by running requests), and the prefixes locked by
    running requests are still cached."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    monkeypatch.setenv(SHARE, share)
    cache, alloc, keys = full_cache(250, 48)
    locked = keys[:5]  # the oldest: the first an LRU eviction would take
    for key in locked:
        cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=RadixKey(key))).last_device_node)
    held = _serve(cache, alloc, keys, steps=600, per_step=16, finish_every=3)
    evictions = hooked.to_dict()["evictions"]
    if share == "0":
        assert evictions >= 600 * 16 // 48 - 1  # a 48-token leaf per three steps
    else:
        assert 600 * 16 // 240 - 5 <= evictions <= 600 * 16 // 240 + 1
    assert alloc.available_size() + cache.total_size() + held == 250 * 48
    for key in locked:
        assert matched_tokens(cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))) == len(key)


def matched_tokens(match) -> int:
    """A prefix match's length: `device_indices` until 0.5.22, `device_prefix_len` in 0.5.23."""
    return match.device_prefix_len if hasattr(match, "device_prefix_len") else len(match.device_indices)


def test_the_counters_reach_the_server_info(monkeypatch):
    import types

    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    from sglang_ext.serving import prefix_cache

    monkeypatch.setenv(SHARE, "0.1")
    monkeypatch.setattr(prefix_cache, "COUNTERS", prefix_cache.EvictionCounters())
    cache, _, _ = full_cache(100, 20)
    evict(cache, 1)
    out = prefix_cache.internal_state_after(GetInternalStateReqOutput(internal_state={}),
                                            types.SimpleNamespace(tree_cache=cache))
    got = out.internal_state["sglang_ext_prefix_cache"]
    assert got["evictions"] == 1 and got["tokens_requested"] == 1 and got["tokens_evicted"] == 200
    assert got["evictable_leaves"] == 90 and got["evictable_tokens"] == 1800
    assert got["batch_share"] == 0.1 and got["batch_tokens"] == 200 and got["evict_seconds"] > 0


def test_a_disabled_cache_and_an_eviction_of_no_tokens_pass_through(monkeypatch):
    from sglang_ext.serving import prefix_cache

    monkeypatch.setenv(SHARE, "0.1")
    monkeypatch.setattr(prefix_cache, "COUNTERS", prefix_cache.EvictionCounters())
    cache, alloc, _ = full_cache(100, 20)
    assert evict(cache, 0).num_tokens_evicted == 0 and alloc.available_size() == 0
    cache.disable = True
    assert evict(cache, 5).num_tokens_evicted == 0 and alloc.available_size() == 0
    assert prefix_cache.COUNTERS.to_dict()["evictions"] == 0
