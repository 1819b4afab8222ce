"""kvlab: vLLM's paged KV cache, small enough to read, run, watch and break.

The core (request, hashing, block pool, managers, scheduler) is pure Python; the Triton
kernels and the tiny model live in ``kvlab.kernels``, ``kvlab.model`` and
``kvlab.runner`` and are imported only when used.
"""
from kvlab.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvlab.events import EventLog
from kvlab.hashing import get_hash_fn_by_name, hash_block_tokens
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvlab.metrics import CachingMetrics, PrefixCacheStats
from kvlab.request import MultiModalFeature, Request, RequestStatus

__all__ = [
    "BlockPool",
    "CachingMetrics",
    "EventLog",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "SlidingWindowSpec",
    "get_hash_fn_by_name",
    "hash_block_tokens",
]

try:  # the scheduler lands separately; keep the core importable without it
    from kvlab.sched_output import SchedulerOutput
    from kvlab.scheduler import Scheduler

    __all__ += ["Scheduler", "SchedulerOutput"]
except ImportError:  # pragma: no cover
    pass


def __getattr__(name: str):
    """``kvlab.show(engine_or_log)``: the Player, imported on first use (plotly is slow to import)."""
    if name == "show":
        from kvlab.viz import show

        return show
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
