"""Prefix-cache statistics with vLLM's names (lesson 08).

vLLM: ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py``, ``CachingMetrics`` in
``vllm/v1/metrics/loggers.py``. Two views of the same counts: the Prometheus counters
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``) are cumulative, while the hit
rate in the logs is over a rolling window of the most recent ~1,000 requests -- so the two
can disagree after the workload changes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvlab.logger import init_logger
from kvlab.metrics.cache_hit_source import CacheHitSource

logger = init_logger(__name__)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the last ``make_prefix_cache_stats()``, in *tokens*.

    A lookup by a request that was preempted is counted apart: its hits are mostly its own
    surviving blocks, which would flatter the hit rate of genuinely new traffic.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    #: The connector's hits split by the tier that supplied them (vLLM 0.33; connector stats
    #: only, new requests only): a hit rate alone cannot tell a host-memory hit from a disk one.
    hits_by_source: dict[CacheHitSource, int] = field(default_factory=dict)

    def record(self, num_tokens: int, num_hits: int, preempted: bool, hits_by_source: dict[CacheHitSource, int] | None = None) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        if hits_by_source is None:
            return
        if sum(hits_by_source.values()) != num_hits:
            # A split that does not add up cannot be trusted in part: all of it is unknown.
            logger.warning_once(
                "Connector attributed %s for %d cached tokens; reporting them as %s.",
                str(hits_by_source),
                num_hits,
                CacheHitSource.EXTERNAL_UNSPECIFIED.value,
            )
            hits_by_source = {CacheHitSource.EXTERNAL_UNSPECIFIED: num_hits}
        for source, n in hits_by_source.items():
            if n:
                self.hits_by_source[source] = self.hits_by_source.get(source, 0) + n

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def copy(self) -> PrefixCacheStats:
        """An independent copy (cheap: the engine checkpoints it every step)."""
        return PrefixCacheStats(
            self.reset,
            self.requests,
            self.queries,
            self.hits,
            self.preempted_requests,
            self.preempted_queries,
            self.preempted_hits,
            dict(self.hits_by_source),
        )


@dataclass(slots=True)
class CachingMetrics:
    """Hit rate over the most recent ``max_recent_requests`` requests."""

    max_recent_requests: int = 1000
    aggregated_requests: int = 0
    aggregated_query_total: int = 0
    aggregated_query_hit: int = 0
    query_queue: deque = field(default_factory=deque)  # (requests, queries, hits) per observation

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        # Drop whole observations from the old end until the window holds at most
        # max_recent_requests requests -- but always keep the newest one (vLLM's rule).
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            r, q, h = self.query_queue.popleft()
            self.aggregated_requests -= r
            self.aggregated_query_total -= q
            self.aggregated_query_hit -= h

    def reset(self) -> None:
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0
        self.query_queue.clear()

    def copy(self) -> CachingMetrics:
        """An independent copy (cheap: the engine checkpoints it every step)."""
        return CachingMetrics(
            self.max_recent_requests,
            self.aggregated_requests,
            self.aggregated_query_total,
            self.aggregated_query_hit,
            self.query_queue.copy(),
        )

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        return self.aggregated_query_hit / self.aggregated_query_total if self.aggregated_query_total else 0.0


@dataclass(slots=True)
class KVCacheEvictionEvent:
    """One sampled block residency that ended (``KVCacheMetricsCollector``, lesson 08)."""

    lifetime_seconds: float  # allocation -> eviction
    idle_seconds: float  # last access (or allocation) -> eviction
    reuse_gaps_seconds: tuple[float, ...]  # between its last few prefix-hit accesses


@dataclass(slots=True)
class SchedulerStats:
    """What vLLM's ``/metrics`` endpoint reports, at the end of a step."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    prefix_cache_hit_rate_window: float  # over the last ~1,000 requests
    step: int
    # vLLM 0.33: the KV connector's metrics of the step, as its payload's plain data (for the
    # offloading connector: OffloadingConnectorStats.data); None without a connector.
    kv_connector_stats: dict[str, Any] | None = None
    # vLLM 0.33, with a connector: its lookups (cumulative, tokens; new requests only) and the
    # hit tokens by the tier that supplied them, the GPU's own cache ("device") included.
    external_prefix_cache_queries: int | None = None
    external_prefix_cache_hits: int | None = None
    prompt_tokens_cached_by_source: dict[CacheHitSource, int] | None = None

    def to_prometheus(self, model_name: str = "kvlab-tiny") -> str:
        """Prometheus text exposition with vLLM's metric names."""
        lbl = f'{{model_name="{model_name}"}}'
        rows = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "", self.num_running_reqs),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "", self.num_waiting_reqs),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "", self.kv_cache_usage),
            ("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.", "_total", self.num_preemptions),
            (
                "vllm:prefix_cache_queries",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
                "_total",
                self.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
                "_total",
                self.prefix_cache_hits,
            ),
        ]
        if self.external_prefix_cache_queries is not None:
            rows += [
                (
                    "vllm:external_prefix_cache_queries",
                    "counter",
                    "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
                    "_total",
                    self.external_prefix_cache_queries,
                ),
                (
                    "vllm:external_prefix_cache_hits",
                    "counter",
                    "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
                    "_total",
                    self.external_prefix_cache_hits or 0,
                ),
            ]
        out = []
        for name, typ, help_, suffix, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name}{suffix}{lbl} {float(value)!r}"]
        by_source = self.prompt_tokens_cached_by_source
        if by_source is not None:  # one series per tier, every tier listed (at 0 until it serves), as vLLM registers them
            name = "vllm:prompt_tokens_cached_by_source"
            out += [
                f"# HELP {name} Prefix-cache hit tokens by the cache tier that supplied them.",
                f"# TYPE {name} counter",
            ]
            out += [
                f'{name}_total{{model_name="{model_name}",source="{src.value}"}} {float(by_source.get(src, 0))!r}' for src in CacheHitSource
            ]
        return "\n".join(out) + "\n"


@dataclass(slots=True)
class IterationStats:
    """What the engine knows about one step that the scheduler does not (lesson 08).

    vLLM keeps per-iteration facts (timestamps, token counts) in an ``IterationStats`` of
    its own (``vllm/v1/metrics/stats.py``); kvlab's engine hands these to
    ``Scheduler.update_from_output``, so that the step's one ``StepFinished`` event carries
    every per-step number: the scheduler's gauges and counters *and* the simulated clock.
    """

    time: float  # the simulated clock after the step (seconds)
    num_prefill_tokens: int  # prompt (or recomputed) tokens computed in the step
    num_decode_tokens: int  # requests that each generated one token from a full context
