"""kvlab: vLLM's paged KV cache, small enough to read, run, watch and break.

The layout mirrors vLLM's tree: ``kvlab/core`` is ``vllm/v1/core`` (block pool, managers,
``sched/``), ``kvlab/worker`` is ``vllm/v1/worker`` (model runner), ``kvlab/engine`` and
``kvlab/executor`` are ``vllm/v1/engine`` and ``vllm/v1/executor``. kvlab's own parts sit
beside them: ``timeline`` (events, snapshots: the data layer), ``viz`` (the pictures),
``workloads``, ``exercises``, ``lessons``, ``bench``.

The core is pure Python; torch, Triton (``kvlab.kernels``) and plotly are imported only
by the parts that need them.
"""
from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvlab.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from kvlab.core.sched.output import SchedulerOutput
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.metrics.stats import CachingMetrics, PrefixCacheStats
from kvlab.request import MultiModalFeature, Request, RequestStatus
from kvlab.timeline.events import EventLog
from kvlab.timeline.snapshot import Snapshot, Timeline, replay
from kvlab.utils.hashing import get_hash_fn_by_name

__all__ = [
    "BlockPool",
    "CachingMetrics",
    "EventLog",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "LLMEngine",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SimulatedExecutor",
    "SlidingWindowSpec",
    "Snapshot",
    "Timeline",
    "build_engine",
    "get_hash_fn_by_name",
    "hash_block_tokens",
    "replay",
]


def __getattr__(name: str):
    """``kvlab.show(engine_or_log)``: the Player, imported on first use (plotly is slow to import)."""
    if name == "show":
        from kvlab.viz import show

        return show
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
