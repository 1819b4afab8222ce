"""kvlab: vLLM's paged KV cache, small enough to read, run, watch and break.

The layout mirrors vLLM's tree: ``kvlab/core`` is ``vllm/v1/core`` (block pool, managers,
``sched/``), ``kvlab/worker`` is ``vllm/v1/worker`` (model runner), ``kvlab/engine`` and
``kvlab/executor`` are ``vllm/v1/engine`` and ``vllm/v1/executor``. kvlab's own parts sit
beside them: ``timeline`` (events, snapshots, the Timeline, KV-event streams: the data
layer), ``viz`` (the pictures), ``show`` (wires an engine, a scenario, a log or a stream to a
player), ``routing`` (KV-aware routing across replica processes), ``scenarios``,
``workloads``, ``exercises``, ``lessons``, ``bench``. ``kvlab/distributed`` and
``kvlab/entrypoints`` are vLLM's: the KV-event wire format, publisher and subscriber, and an
engine in its own process.

Every name below is importable from here (``from kvlab import LLMEngine``), but each is
loaded on first use: importing ``kvlab.viz.pool`` must not load the engine, and importing
the engine must not load plotly. The core is pure Python; torch, Triton (``kvlab.kernels``)
and plotly are imported only by the parts that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it (strings: nothing is imported until the name is used)
_EXPORTS: dict[str, str] = {
    "BlockPool": "kvlab.core.block_pool",
    "CachingMetrics": "kvlab.metrics.stats",
    "ChunkedLocalAttentionSpec": "kvlab.kv_cache_interface",
    "EventLog": "kvlab.eventlog.events",
    "FreeKVCacheBlockQueue": "kvlab.core.kv_cache_utils",
    "FullAttentionSpec": "kvlab.kv_cache_interface",
    "KVCacheBlock": "kvlab.core.kv_cache_utils",
    "KVCacheBlocks": "kvlab.core.kv_cache_manager",
    "KVCacheManager": "kvlab.core.kv_cache_manager",
    "KVCacheMetricsCollector": "kvlab.core.kv_cache_metrics",
    "KVStream": "kvlab.timeline.kv_stream",
    "LLMEngine": "kvlab.engine.llm_engine",
    "LoadedModel": "kvlab.model_loader",
    "MLAAttentionSpec": "kvlab.kv_cache_interface",
    "MambaSpec": "kvlab.kv_cache_interface",
    "RSWASpec": "kvlab.kv_cache_interface",
    "MultiModalFeature": "kvlab.request",
    "PrefixCacheStats": "kvlab.metrics.stats",
    "Request": "kvlab.request",
    "RequestStatus": "kvlab.request",
    "Scheduler": "kvlab.core.sched.scheduler",
    "SchedulerOutput": "kvlab.core.sched.output",
    "SimulatedExecutor": "kvlab.executor.simulated",
    "SlidingWindowSpec": "kvlab.kv_cache_interface",
    "Snapshot": "kvlab.timeline.snapshot",
    "StepSeries": "kvlab.timeline.timeline",
    "Timeline": "kvlab.timeline.timeline",
    "build_engine": "kvlab.engine.llm_engine",
    "export_html": "kvlab.show",
    "get_hash_fn_by_name": "kvlab.utils.hashing",
    "predict": "kvlab.learner.prediction",
    "hash_block_tokens": "kvlab.core.kv_cache_utils",
    "load_model": "kvlab.model_loader",
    "replay": "kvlab.timeline.timeline",
}
# Modules exported by name: ``kvlab.show`` (callable) and ``kvlab.kv_events`` (vLLM's KV-cache
# events, kvlab/distributed/kv_events.py).
_MODULES = {"show": "kvlab.show", "kv_events": "kvlab.kv_events"}
__all__ = sorted([*_EXPORTS, *_MODULES])

if TYPE_CHECKING:  # for type checkers and IDEs only
    from kvlab.core.block_pool import BlockPool
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
    from kvlab.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.engine.llm_engine import LLMEngine, build_engine
    from kvlab.show import export_html
    from kvlab.executor.simulated import SimulatedExecutor
    from kvlab.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SlidingWindowSpec,
    )
    from kvlab.learner.prediction import predict
    from kvlab.model_loader import LoadedModel, load_model
    from kvlab.metrics.stats import CachingMetrics, PrefixCacheStats
    from kvlab.request import MultiModalFeature, Request, RequestStatus
    from kvlab.eventlog.events import EventLog
    from kvlab.timeline.kv_stream import KVStream
    from kvlab.timeline.snapshot import Snapshot
    from kvlab.timeline.timeline import StepSeries, Timeline, replay
    from kvlab.utils.hashing import get_hash_fn_by_name


def __getattr__(name: str) -> Any:
    """Load an exported name on first use (``kvlab.show`` is the callable module ``kvlab/show.py``)."""
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
