"""The scheduler's CUDA allocator counters in /get_server_info (sglang_ext.serving.memory): what a soak reads each
minute to tell memory held by tensors from memory the allocator caches."""

import types

import torch

from sglang_ext.serving import memory

STATS = {"allocated_bytes.all.current": 3 << 20, "allocated_bytes.all.peak": 5 << 20,
         "reserved_bytes.all.current": 8 << 20, "reserved_bytes.small_pool.current": 2 << 20,
         "segment.all.current": 4, "num_ooms": 0, "requested_bytes.all.current": 1}


def test_allocator_counters_are_reported_under_their_names():
    assert memory.cuda_memory(STATS) == {"allocated_bytes": 3 << 20, "allocated_bytes_peak": 5 << 20,
                                         "reserved_bytes": 8 << 20, "small_pool_reserved_bytes": 2 << 20,
                                         "segments": 4, "ooms": 0}


def test_server_info_carries_them_only_where_the_scheduler_uses_cuda(monkeypatch):
    result = types.SimpleNamespace(internal_state={"memory_usage": {}})
    assert memory.internal_state_after(result, object()) is result
    assert "sglang_ext_cuda_memory" not in result.internal_state  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: dict(STATS))
    memory.internal_state_after(result, object())
    assert result.internal_state["sglang_ext_cuda_memory"]["reserved_bytes"] == 8 << 20
    assert result.internal_state["memory_usage"] == {}  # SGLang's own fields untouched


def test_the_pool_split_line_says_when_max_total_tokens_caps_the_pools(monkeypatch, caplog):
    """SGLang applies --max-total-tokens after the sizing this line reports: without saying so, a capped server's log
    reads as if it held millions of tokens (check_serving on FA3, 2026-12-07: sized 4,246,733, allocated 65,536)."""
    import logging

    from sglang_ext.serving import kv_pools

    configurator = types.SimpleNamespace(_sglang_ext_split=(9216, 2048))
    result = types.SimpleNamespace(max_total_num_tokens=4_246_733)
    for cap, tail in ((65536, " (--max-total-tokens 65536 caps both pools)"), (None, ""), (10 ** 8, "")):
        monkeypatch.setattr(kv_pools, "server_args", lambda: types.SimpleNamespace(max_total_tokens=cap))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=kv_pools.logger.name):
            assert kv_pools.pool_sizes_after(result, configurator, 45 * 2 ** 30, 1) is result
        line = next(r.getMessage() for r in caplog.records if "KV pool split" in r.getMessage())
        assert line.endswith("SGLang sized 4246733 tokens" + tail), line
