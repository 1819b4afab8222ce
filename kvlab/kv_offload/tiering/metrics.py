"""What the tiering manager counts (vLLM 0.33: ``TieringMetricsTracker`` in
``vllm/v1/kv_offload/tiering/metrics.py``).

Three kinds of observation, each labelled by tier (``"0:primary"`` is the CPU tier,
``"{i+1}:{tier_type}"`` the ``i``-th tier behind it):

* **Lookups.** A chunk query counts once per request, tier and key, and only while the
  request waits for its first allocation: a request the scheduler looks up again next step
  does not inflate the counts, and lookups after it was scheduled are not counted at all.
  A HIT also counts as a chunk hit. RETRY (a tier still looking) counts nothing yet; the
  answer that follows also records how long the request waited for it.
* **Jobs.** A finished promotion adds to the tier's read bytes, a finished cascade to its
  write bytes: keys times the CPU chunk's size (a cascade counts every key it was given,
  including keys the tier already had and skipped, as vLLM does). A failed job counts a
  failure instead -- except that a promotion that failed part-way still counts the bytes
  of the keys that made it.
* **Gauges**, read at every report: jobs in flight and the share of CPU chunks they hold.

Durations are recorded (vLLM's histograms) but nothing decides on them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvlab.kv_offload.base import LookupResult, OffloadKey, ReqContext
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.kv_offload.tiering.base import JobResult, TieringOffloadingMetrics, TransferJob

TierLabel = tuple[str]
PRIMARY_TIER_LABEL: TierLabel = ("0:primary",)

M = TieringOffloadingMetrics


class JobMetadataLike(Protocol):
    @property
    def transfer_job(self) -> TransferJob: ...

    @property
    def tier_idx(self) -> int: ...


class HasDetector(Protocol):
    @property
    def bp_detector(self) -> BackpressureDetector | None: ...


@dataclass(slots=True)
class _RequestMetricsState:
    # tier -> key -> None once counted, or when a RETRY first kept it waiting. None for
    # the whole map once the request was allocated: nothing more is counted for it.
    observed_lookups: dict[TierLabel, dict[OffloadKey, float | None]] | None = field(default_factory=dict)


@dataclass
class _TierState:
    active_promotion_count: int = 0
    active_cascade_count: int = 0
    primary_write_chunk_count: int = 0
    primary_read_chunk_count: int = 0


class TieringMetricsTracker:
    def __init__(self, tier_types: list[str], num_primary_chunks: int, primary_chunk_size: int) -> None:
        self._tier_types = list(tier_types)
        self._num_primary_chunks = num_primary_chunks
        #: Bytes of one CPU chunk. kvlab's connector learns it from the worker's first
        #: report (the scheduler half has no tensors) and sets it here.
        self.primary_chunk_size = primary_chunk_size
        self._request_states: dict[str, _RequestMetricsState] = {}
        self._tier_states = [_TierState() for _ in self._tier_types]
        self._stats = OffloadingConnectorStats()

    def tier_label(self, tier_idx: int) -> TierLabel:
        return (f"{tier_idx + 1}:{self._tier_types[tier_idx]}",)

    @property
    def primary_tier_label(self) -> TierLabel:
        return PRIMARY_TIER_LABEL

    # -- a request's life ---------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> None:
        self._request_states[req_context.req_id] = _RequestMetricsState()

    def on_request_allocated(self, req_context: ReqContext) -> None:
        state = self._request_states.get(req_context.req_id)
        if state is not None:
            state.observed_lookups = None

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._request_states.pop(req_context.req_id, None)

    def on_lookup(
        self, req_context: ReqContext, key: OffloadKey, tier_label: TierLabel, result: LookupResult, lookup_duration: float
    ) -> None:
        state = self._request_states.setdefault(req_context.req_id, _RequestMetricsState())
        seen = state.observed_lookups
        if seen is None:
            return
        if result in (LookupResult.HIT, LookupResult.MISS):
            observed = seen.setdefault(tier_label, {})
            waited_since = observed.get(key)
            if key not in observed or waited_since is not None:  # first answer for this key
                observed[key] = None
                self._observe_resolved_lookup(tier_label, result, lookup_duration, waited_since)
        elif result is LookupResult.RETRY:
            seen.setdefault(tier_label, {}).setdefault(key, time.monotonic() - lookup_duration)

    # -- jobs -------------------------------------------------------------------------------------
    def on_job_registered(self, job_metadata: JobMetadataLike) -> None:
        job, state = job_metadata.transfer_job, self._tier_states[job_metadata.tier_idx]
        if job.is_promotion:
            state.active_promotion_count += 1
            state.primary_write_chunk_count += len(job.chunk_ids)
        else:
            state.active_cascade_count += 1
            state.primary_read_chunk_count += len(job.chunk_ids)

    def on_job_finished(self, job_metadata: JobMetadataLike, result: JobResult) -> None:
        self._observe_finished_job(job_metadata, result)
        job = job_metadata.transfer_job
        if job.is_promotion:
            outcome = "success" if result.success else "failure"
            latency = time.monotonic() - job.submit_time
            self._stats.observe_histogram(M.PROMOTION_LATENCY, latency, (*self.tier_label(job_metadata.tier_idx), outcome))
        state = self._tier_states[job_metadata.tier_idx]
        if job.is_promotion:
            assert state.active_promotion_count > 0, "a promotion finished that was never registered"
            state.active_promotion_count -= 1
            state.primary_write_chunk_count -= len(job.chunk_ids)
            assert state.primary_write_chunk_count >= 0
        else:
            assert state.active_cascade_count > 0, "a cascade finished that was never registered"
            state.active_cascade_count -= 1
            state.primary_read_chunk_count -= len(job.chunk_ids)
            assert state.primary_read_chunk_count >= 0

    def on_promotion_allocation_failure(self) -> None:
        self._stats.increase_counter(M.PROMOTION_ALLOCATION_FAILURES)

    def record_backpressure(self, tiers: Sequence[HasDetector]) -> None:
        """Each tier's back-pressure: the detector's average store latency, and the stores
        and blocks its policy dropped since the last call."""
        for i, tier in enumerate(tiers):
            detector = tier.bp_detector
            if detector is None:
                continue
            label = self.tier_label(i)
            ema = detector.stats.get("store_latency_ema")
            if ema is not None:
                self._stats.set_gauge(M.BACKPRESSURE_STORE_LATENCY_EMA, ema, labelvalues=label)
            stores_dropped, blocks_dropped = detector.policy.pop_stores_dropped()
            if stores_dropped > 0:
                self._stats.increase_counter(M.BACKPRESSURE_STORES_DROPPED, stores_dropped, labelvalues=label)
            if blocks_dropped > 0:
                self._stats.increase_counter(M.BACKPRESSURE_BLOCKS_DROPPED, blocks_dropped, labelvalues=label)

    def take_stats(self) -> OffloadingConnectorStats | None:
        """The gauges as they stand, then everything counted since the last call (None:
        no secondary tier and nothing counted)."""
        stats = OffloadingConnectorStats()
        for tier_idx, state in enumerate(self._tier_states):
            label = self.tier_label(tier_idx)
            n = self._num_primary_chunks
            stats.set_gauge(M.PRIMARY_WRITE_USAGE_PERC, state.primary_write_chunk_count / n if n > 0 else 0.0, label)
            stats.set_gauge(M.PRIMARY_READ_USAGE_PERC, state.primary_read_chunk_count / n if n > 0 else 0.0, label)
            stats.set_gauge(M.ACTIVE_PROMOTION_JOBS, state.active_promotion_count, label)
            stats.set_gauge(M.ACTIVE_CASCADE_JOBS, state.active_cascade_count, label)
        if not self._stats.is_empty():
            stats.aggregate(self._stats)
            self._stats = OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    def assert_idle(self) -> None:
        assert all(s == _TierState() for s in self._tier_states), "transfer jobs still counted as in flight"

    # -- the counting -------------------------------------------------------------------------------
    def _observe_finished_job(self, job_metadata: JobMetadataLike, result: JobResult) -> None:
        job = job_metadata.transfer_job
        label = self.tier_label(job_metadata.tier_idx)
        num_keys = len(job.keys)
        if not result.success:
            self._stats.increase_counter(M.PROMOTION_JOB_FAILURES if job.is_promotion else M.CASCADE_JOB_FAILURES, labelvalues=label)
            if not (job.is_promotion and result.successful_keys):
                return
            num_keys = len(result.successful_keys)
        self._stats.increase_counter(M.READ_BYTES if job.is_promotion else M.WRITE_BYTES, num_keys * self.primary_chunk_size, label)
        if result.transfer_time is not None:
            self._stats.increase_counter(M.READ_TIME if job.is_promotion else M.WRITE_TIME, result.transfer_time, label)

    def _observe_resolved_lookup(
        self, tier_label: TierLabel, result: LookupResult, lookup_duration: float, waited_since: float | None
    ) -> None:
        self._stats.increase_counter(M.CHUNK_QUERIES, labelvalues=tier_label)
        if result is LookupResult.HIT:
            self._stats.increase_counter(M.CHUNK_HITS, labelvalues=tier_label)
        self._stats.observe_histogram(M.LOOKUP_SYNC_DELAY, lookup_duration, tier_label)
        if waited_since is not None:
            self._stats.observe_histogram(M.LOOKUP_ASYNC_DELAY, time.monotonic() - waited_since, tier_label)
