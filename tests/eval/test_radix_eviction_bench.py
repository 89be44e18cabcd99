"""eval/radix_eviction_bench.py drives SGLang's own RadixCache as the scheduler allocates on a full pool: upstream's
shortfall eviction runs on every step, the plugin's batch once per batch of tokens, and the table says so."""


def test_the_benchmark_counts_one_eviction_per_step_upstream_and_one_per_batch_with_it(capsys):
    from sglang_ext.eval import radix_eviction_bench as B

    upstream = B.run_arm(50, 0.0, steps=40, step_tokens=20, leaf_tokens=20)
    batched = B.run_arm(50, 0.2, steps=40, step_tokens=20, leaf_tokens=20)  # 200 of the 1,000-token pool at once
    assert upstream["evictions"] == 40 and upstream["leaves_after"] >= 45  # the pool stays full of cached requests
    assert batched["evictions"] == 40 * 20 // 200 and batched["leaves_after"] >= 35
    assert B.main(["--leaves", "50", "--shares", "0,0.2", "--steps", "40", "--step-tokens", "20",
                   "--leaf-tokens", "20"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 50 ")]
    assert [r.split(" | ")[1:4] for r in rows] == [["shortfall only (upstream)", "40", "40"], ["0.2", "40", "4"]]


def test_an_arm_leaves_the_process_as_it_found_it(monkeypatch):
    import os

    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_ext.eval import radix_eviction_bench as B
    from sglang_ext.serving import prefix_cache

    monkeypatch.delenv("SGLANG_EXT_RADIX_EVICTION_BATCH", raising=False)
    evict, counters = RadixCache.evict, prefix_cache.COUNTERS
    B.run_arm(20, 0.1, steps=5, step_tokens=20, leaf_tokens=20)
    assert "SGLANG_EXT_RADIX_EVICTION_BATCH" not in os.environ
    assert RadixCache.evict is evict and prefix_cache.COUNTERS is counters


def test_the_hit_rate_arm_serves_conversations_from_the_cache_with_either_eviction(capsys):
    """Multi-turn conversations on a full pool: most prompt tokens are found cached (the conversation so far), the
    batch evicts fewer times for the same tokens and finds about as many cached."""
    from sglang_ext.eval import radix_eviction_bench as B

    small = dict(pool_tokens=20_000, conversations=200, turns=600, warmup_turns=200)
    upstream, batched = B.hit_rate_arm(0.0, **small), B.hit_rate_arm(0.1, **small)
    assert upstream["evicted_tokens"] > 20_000 and batched["evicted_tokens"] > 20_000  # the pool turned over
    assert batched["evictions"] < upstream["evictions"] / 2  # 2,000 tokens at once, a turn needing 280+
    assert 0.3 < upstream["hit_rate"] < 1 and abs(batched["hit_rate"] - upstream["hit_rate"]) < 0.02
    print(B.hit_rate_table([upstream, batched]))
    out = capsys.readouterr().out
    assert "| shortfall only (upstream) | 400 |" in out and "| 0.1 | 400 |" in out
