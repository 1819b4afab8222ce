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
and the job reports through ``get_finished_jobs`` a step or more later. kvlab's worker runs
both kinds inside the step that planned them (the promotion just before its GPU copy, the
cascade just after its store), so a kvlab job is always finished by the time the step's
metrics are read -- which is why the "active jobs" gauges read 0 at every report.
vLLM's asynchronous tier interface (``SecondaryTierManager``, ``ParentManager``) is not
built: kvlab's disk tier is a synchronous one (:mod:`kvlab.kv_offload.tiering.fs.manager`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from kvlab.kv_offload.base import OffloadKey, ReqContext

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
