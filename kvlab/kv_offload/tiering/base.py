"""The tiering layer's job records and metric names (vLLM 0.33:
``vllm/v1/kv_offload/tiering/base.py``).

Between the CPU tier and a tier behind it (a disk), data moves in *jobs*, each one way:

* a **cascade** (``is_promotion=False``) copies CPU chunks out to the secondary tier after a
  store from the GPU landed in them;
* a **promotion** (``is_promotion=True``) reads a block the CPU tier lacks from the
  secondary tier into a CPU chunk, the only door back to the GPU.

:class:`TransferJob` is what was asked, :class:`JobResult` what happened; the tiering
manager's metrics (:mod:`kvlab.kv_offload.tiering.metrics`) are counted from the two.

vLLM runs every job asynchronously: a lookup that starts a promotion answers "not yet",
and the job reports through ``get_finished_jobs`` a step or more later. That interface is
here: a :class:`SecondaryTierManager` is one tier behind the CPU tier, driven by
:class:`~kvlab.kv_offload.tiering.manager.TieringOffloadingManager`, and a
:class:`ParentManager` is the handle a tier gets to serve requests that arrive from outside
the engine (a peer asking for blocks).

kvlab's connector and its worker use a synchronous variant instead
(:mod:`kvlab.kv_offload.tiering.staged`): the worker runs both kinds of job inside the step
that planned them (the promotion just before its GPU copy, the cascade just after its
store), so there a job is always finished by the time the step's metrics are read -- which
is why the "active jobs" gauges read 0 at every report of the lessons' runs.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvlab.kv_offload.base import (
    CACHE_HIT_SOURCE_OF_MEDIUM,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.metrics.cache_hit_source import CacheHitSource

JobId = int

#: The label that names a tier in the tiering metrics and in ``config_info``.
TIER_LABEL = "tier"


class TieringOffloadingMetrics:
    """The tiering manager's metric names (vLLM 0.33). Tier-labelled ones carry
    ``("0:primary",)`` for the CPU tier and ``("1:fs",)`` for the first tier behind it."""

    LOOKUP_SYNC_DELAY = "vllm:kv_offload_tiering_lookup_sync_delay_seconds"  # histogram, per tier
    LOOKUP_ASYNC_DELAY = "vllm:kv_offload_tiering_lookup_async_delay_seconds"  # after a RETRY
    READ_BYTES = "vllm:kv_offload_tiering_read_bytes"  # promotions: secondary -> CPU
    READ_TIME = "vllm:kv_offload_tiering_read_time"
    WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"  # cascades: CPU -> secondary
    WRITE_TIME = "vllm:kv_offload_tiering_write_time"
    PROMOTION_JOB_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
    CASCADE_JOB_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
    CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"  # lookups answered HIT or MISS
    CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
    PRIMARY_WRITE_USAGE_PERC = "vllm:kv_offload_tiering_primary_write_usage_perc"  # CPU chunks promotions fill
    PRIMARY_READ_USAGE_PERC = "vllm:kv_offload_tiering_primary_read_usage_perc"  # CPU chunks cascades read
    PROMOTION_ALLOCATION_FAILURES = "vllm:kv_offload_tiering_promotion_allocation_failures"
    ACTIVE_PROMOTION_JOBS = "vllm:kv_offload_tiering_active_promotion_jobs"
    ACTIVE_CASCADE_JOBS = "vllm:kv_offload_tiering_active_cascade_jobs"
    BACKPRESSURE_STORE_LATENCY_EMA = "vllm:kv_offload_tiering_backpressure_store_latency_ema"
    BACKPRESSURE_STORES_DROPPED = "vllm:kv_offload_tiering_backpressure_stores_dropped"
    BACKPRESSURE_BLOCKS_DROPPED = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
    PROMOTION_LATENCY = "vllm:kv_offload_tiering_promotion_latency_seconds"  # labelled (tier, outcome)


@dataclass
class TransferJob:
    """One job between the CPU tier and a secondary tier: ``keys`` in the CPU chunks
    ``chunk_ids`` (written by a promotion, read by a cascade)."""

    job_id: JobId
    keys: Collection[OffloadKey]
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext
    submit_time: float = field(default_factory=time.monotonic)  # for the latency histogram only


@dataclass
class JobResult:
    """How a job ended. ``success`` only if every key made it; for a promotion that failed
    part-way, ``successful_keys`` names the keys that did (a subset of the job's; None:
    every key shares ``success``)."""

    job_id: JobId
    success: bool
    successful_keys: Collection[OffloadKey] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None


class ParentManager(ABC):
    """What a secondary tier may ask of the tiering manager while it serves a request that
    came from outside the engine (``serve_external_requests``). Calls go to every tier but
    the asking one. The order per remote request: ``on_new_request``, then ``lookup`` per
    chunk and ``create_store_job`` for the chunks to send (in any order), then
    ``on_request_finished`` -- always, even when nothing was found, or per-request state
    leaks."""

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    @abstractmethod
    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob:
        """Pin ``keys`` in the CPU tier and register a job reading them; the tier moves the
        bytes itself and reports the job through ``get_finished_jobs``."""

    @abstractmethod
    def on_request_finished(self, req_context: ReqContext) -> None: ...


class SecondaryTierManager(ABC):
    """One tier behind the CPU tier (disk, a peer, an object store). It never touches GPU
    memory: a store reaches it as a *cascade* out of CPU chunks, a load leaves it as a
    *promotion* into CPU chunks (``primary_kv_view[c]`` is chunk ``c``'s bytes).

    Every method runs on the scheduler's side, under the tiering manager's lock, and must
    not block: ``submit_store``/``submit_load`` start a job and return; the job's end is
    reported by ``get_finished_jobs``. A tier with ``tolerates_off_thread_polling`` is also
    polled from the manager's tier-poll thread between steps (so a peer is not kept waiting
    a whole step); it must then keep no per-thread state.
    """

    medium: ClassVar[Medium | None] = None
    #: Where a hit served from this tier is reported to come from (derived from ``medium``
    #: unless a subclass sets it).
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cache_hit_source" not in cls.__dict__ and cls.medium is not None:
            cls.cache_hit_source = CACHE_HIT_SOURCE_OF_MEDIUM.get(Medium(cls.medium), CacheHitSource.EXTERNAL_UNSPECIFIED)

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        # A memoryview must be the CPU tier's rows; any other object only needs row strides
        # (vLLM's own tests hand a mock, and a tier may wrap the rows in a view type of its own).
        if isinstance(primary_kv_view, memoryview):
            if primary_kv_view.ndim != 2:
                raise TypeError(f"primary_kv_view must be the CPU tier's 2-D memoryview (one row per chunk), got {primary_kv_view.ndim}-D")
        elif not hasattr(primary_kv_view, "strides"):
            raise TypeError(
                f"primary_kv_view must be the CPU tier's 2-D memoryview (one row per chunk), got {type(primary_kv_view).__name__}"
            )
        assert primary_kv_view.strides is not None, "primary_kv_view.strides cannot be None"
        if backpressure_detector is not None and not isinstance(backpressure_detector, BackpressureDetector):
            raise TypeError(f"backpressure_detector must be None or a BackpressureDetector, got {type(backpressure_detector).__name__}")
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self._block_size_bytes: int = primary_kv_view.strides[0]
        self.tier_type = tier_type
        self.locality: Locality | None = None
        self._bp_detector = backpressure_detector

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one CPU chunk (the view's row stride)."""
        return self._block_size_bytes

    @property
    def bp_detector(self) -> BackpressureDetector | None:
        return self._bp_detector

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT (here and ready), MISS, or RETRY (still finding out, or moving: ask again)."""

    @abstractmethod
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Start copying the pinned CPU chunks ``job_metadata.chunk_ids`` into this tier
        (skipping keys it has, evicting for room)."""

    @abstractmethod
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Start copying ``job_metadata.keys`` into the reserved CPU chunks ``chunk_ids``."""

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs that ended since the last call (each reported once)."""

    def has_pending_work(self) -> bool:
        """True keeps the engine stepping (and polling) with nothing scheduled."""
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """This tier's wish for the request: CHUNK_LEVEL (new blocks only) or REQUEST_LEVEL
        (every block, prefix hits included)."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more calls for the request will come (its jobs may still be running)."""
        return

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Serve requests from outside the engine through ``parent`` (once per step, before
        the step's promotions are submitted)."""
        return

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        return

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job ended (failed or not) and its result is queued
        for ``get_finished_jobs``. Never abort a copy half-way; queued ones may fail."""

    def shutdown(self) -> None:
        return

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return {}

    def get_stats(self) -> OffloadingConnectorStats | None:
        return None

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """The label names of this tier's ``config_info`` (never ``TIER_LABEL``)."""
        return ()

    def config_info(self) -> ConfigInfoMapping:
        return {}
