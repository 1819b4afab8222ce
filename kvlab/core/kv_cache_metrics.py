"""Sampled block residency: how long a KV block lives, and how long it idles before its
memory is reused (lesson 08).

vLLM: ``vllm/v1/core/kv_cache_metrics.py`` (``BlockMetricsState``,
``KVCacheMetricsCollector``; enabled with ``--kv-cache-metrics``, sampled at
``--kv-cache-metrics-sample``, default 1 % of allocations). The block pool reports three
moments: a block is *allocated* (a new residency may start, if this allocation is
sampled), *accessed* (a prefix hit touched it), *evicted* (it was popped from the free
queue to be reused -- the residency ends). Each finished residency becomes a
``KVCacheEvictionEvent``: its lifetime (allocation to eviction), its idle time (last access
to eviction) and the gaps between its last few accesses. vLLM turns them into the
histograms ``vllm:kv_block_lifetime_seconds``, ``vllm:kv_block_idle_before_evict_seconds``
and ``vllm:kv_block_reuse_gap_seconds``.

Why it matters for tuning: if blocks are evicted after idling only a few seconds while the
same prefixes come back a minute later, the cache is too small for the reuse distance of
the workload -- more KV memory (or a CPU tier) would turn those misses into hits.

kvlab reads time from a clock you give it (``clock``: seconds as a float); inside an
``LLMEngine`` that is the engine's simulated clock, so residencies are in simulated
seconds. Sampling uses its own seeded ``random.Random`` so a lesson reruns identically.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvlab.metrics.stats import KVCacheEvictionEvent
from kvlab.utils.checks import AssertedValueError

Clock = Callable[[], float]


class BlockMetricsState:
    """One sampled residency: birth, last access, and the last 4 access times (ns)."""

    __slots__ = ("birth_time_ns", "last_access_ns", "access_history", "_clock_ns")

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        now_ns = clock_ns()
        self._clock_ns = clock_ns
        self.birth_time_ns = now_ns
        self.last_access_ns = now_ns
        # Bounded: a block hit thousands of times keeps only its most recent gaps.
        self.access_history: deque[int] = deque(maxlen=4)

    def record_access(self) -> None:
        now_ns = self._clock_ns()
        self.last_access_ns = now_ns
        self.access_history.append(now_ns)

    def get_lifetime_seconds(self) -> float:
        return (self._clock_ns() - self.birth_time_ns) / 1e9

    def get_idle_time_seconds(self) -> float:
        return (self._clock_ns() - self.last_access_ns) / 1e9

    def get_reuse_gaps_seconds(self) -> list[float]:
        h = list(self.access_history)
        return [(h[i] - h[i - 1]) / 1e9 for i in range(1, len(h))]


class SampleRateError(AssertedValueError):
    """A sample rate outside (0, 1]. vLLM's collector asserts the range, so its callers (and
    its tests) expect an AssertionError; kvlab refuses a bad argument with a ValueError. This
    is both, so either ``except`` catches it."""


class KVCacheMetricsCollector:
    """Collects residency samples from a ``BlockPool`` (pass it as ``metrics_collector``)."""

    def __init__(self, sample_rate: float = 0.01, *, clock: Clock | None = None, seed: int | None = 0) -> None:
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1.0:
            raise SampleRateError(f"sample_rate must be in (0, 1.0], got {sample_rate!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        self.sample_rate = float(sample_rate)
        # None: wall clock (time.monotonic_ns, as vLLM); an LLMEngine binds its simulated clock.
        self.clock: Clock | None = clock
        self._rng = random.Random(seed)
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def _now_ns(self) -> int:
        clock = self.clock
        return time.monotonic_ns() if clock is None else round(clock() * 1e9)

    def should_sample_block(self) -> bool:
        return self._rng.random() < self.sample_rate

    def on_block_allocated(self, block: Any) -> None:
        if self.should_sample_block():
            self.block_metrics[block.block_id] = BlockMetricsState(self._now_ns)

    def on_block_accessed(self, block: Any) -> None:
        m = self.block_metrics.get(block.block_id)
        if m is not None:
            m.record_access()

    def on_block_evicted(self, block: Any) -> None:
        m = self.block_metrics.pop(block.block_id, None)
        if m is None:
            return
        self._eviction_events.append(
            KVCacheEvictionEvent(
                lifetime_seconds=m.get_lifetime_seconds(),
                idle_seconds=m.get_idle_time_seconds(),
                reuse_gaps_seconds=tuple(m.get_reuse_gaps_seconds()),
            )
        )

    def reset(self) -> None:
        """Forget everything (the prefix cache was reset)."""
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        events, self._eviction_events = self._eviction_events, []
        return events
