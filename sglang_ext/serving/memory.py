"""The scheduler's CUDA allocator counters in /get_server_info, to tell a long run's memory growth apart.

  * ``sglang.srt.managers.scheduler.Scheduler.get_internal_state`` (AFTER) -- ``internal_states[0].
    sglang_ext_cuda_memory``: PyTorch's caching-allocator counters of the scheduler's device (`CUDA_MEMORY_FIELDS`).

Why: `nvidia-smi` reads a process's whole footprint, in which a caching allocator reserving one more 2 MiB segment for
small blocks and a tensor kept per finished request look alike (three H200 soaks grew by 1-10 MiB a minute with the
KV pool flat). Bytes allocated and the allocator's segments, read from the server each minute, say which: memory
allocated that keeps rising is held by something, reserved memory rising with allocated flat is the allocator's
cache. Reading them is a few host-side counters (no device sync, no allocation).
"""

from __future__ import annotations

from sglang_ext.serving.hooks import Hook

# torch.cuda.memory_stats keys, under the names they are reported by
CUDA_MEMORY_FIELDS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "allocated_bytes_peak": "allocated_bytes.all.peak",
    "reserved_bytes": "reserved_bytes.all.current",
    "reserved_bytes_peak": "reserved_bytes.all.peak",
    "small_pool_reserved_bytes": "reserved_bytes.small_pool.current",
    "large_pool_reserved_bytes": "reserved_bytes.large_pool.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "segments": "segment.all.current",
    "active_blocks": "active.all.current",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def cuda_memory(stats: dict) -> dict:
    """`torch.cuda.memory_stats()` as reported (a counter the running torch lacks is left out)."""
    return {name: int(stats[key]) for name, key in CUDA_MEMORY_FIELDS.items() if key in stats}


def internal_state_after(result, self, *args, **kwargs):
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["sglang_ext_cuda_memory"] = cuda_memory(torch.cuda.memory_stats())
    return result


HOOKS = (
    Hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after", internal_state_after,
         feature="the CUDA allocator counters in /get_server_info"),
)
