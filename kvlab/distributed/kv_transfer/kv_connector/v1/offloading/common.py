"""What the offloading connector's two halves tell each other (vLLM:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from kvlab.kv_offload.base import LoadStoreSpec, OffloadKey
from kvlab.kv_offload.tiering.staged import LoadItem, StorePlan


@dataclass(slots=True)
class LoadJob:
    """Fill GPU blocks ``gpu_block_ids`` of ``req_id`` from the tiers, block by block."""

    job_id: int
    req_id: str
    gpu_block_ids: list[int]
    items: list[LoadItem]


@dataclass(slots=True)
class StoreJob:
    """Copy GPU blocks ``gpu_block_ids`` of ``req_id`` out to the CPU slots of ``plan`` (and
    on to files: ``plan.cascade_*``), after the forward pass computed them."""

    job_id: int
    req_id: str
    gpu_block_ids: list[int]
    plan: StorePlan


@dataclass(slots=True)
class TransferJob:
    """One copy between the GPU and a backend, as vLLM 0.33's spec-built worker half takes it
    (keyed by the scheduler's job id): ``src_spec`` -> ``dst_spec``. ``sync`` (loads only):
    the request runs in this very step, so the worker waits for the copy before the forward
    pass instead of reporting the request as received later."""

    req_id: str
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec
    sync: bool = False


@dataclass(slots=True)
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's jobs for the worker half. kvlab's in-step tiers send ``loads`` and
    ``stores`` (block-by-block plans through the CPU tier to files); a backend built from an
    offloading spec gets vLLM 0.33's ``load_jobs`` / ``store_jobs`` by job id, and
    ``jobs_to_flush``: stores that must land before their GPU blocks are reused (a
    preempted request's)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    block_size: int = 16
    load_jobs: dict[int, TransferJob] = field(default_factory=dict)
    store_jobs: dict[int, TransferJob] = field(default_factory=dict)
    jobs_to_flush: set[int] | None = None


@dataclass(slots=True)
class LoadResult:
    """How far a load job got: ``failed_key`` could not be loaded (``reason`` says why);
    blocks before it loaded, the ones after it were not tried."""

    num_loaded: int
    failed_key: OffloadKey | None = None
    reason: str = ""
    read_time: float | None = None  # seconds its storage blocks' file reads took (None: it read none)


@dataclass(slots=True)
class DirectionalTransferStats:
    """Transfers in one direction, as the worker finished them: total bytes and seconds, and
    each transfer's size (the histogram's samples)."""

    bytes: int = 0
    time: float = 0.0
    sizes: list[int | float] = field(default_factory=list)

    def aggregate(self, other: DirectionalTransferStats) -> DirectionalTransferStats:
        return DirectionalTransferStats(self.bytes + other.bytes, self.time + other.time, [*self.sizes, *other.sizes])

    def record(self, num_bytes: int, time: float) -> None:
        self.bytes += num_bytes
        self.time += time
        self.sizes.append(num_bytes)

    def is_empty(self) -> bool:
        return self.bytes == 0 and self.time == 0.0 and not self.sizes


@dataclass(slots=True)
class TransferStats:
    """A step's finished loads (storage -> GPU) and stores (GPU -> CPU) (vLLM 0.33)."""

    load: DirectionalTransferStats = field(default_factory=DirectionalTransferStats)
    store: DirectionalTransferStats = field(default_factory=DirectionalTransferStats)

    def aggregate(self, other: TransferStats) -> TransferStats:
        return TransferStats(self.load.aggregate(other.load), self.store.aggregate(other.store))

    def is_empty(self) -> bool:
        return self.load.is_empty() and self.store.is_empty()


@dataclass(slots=True)
class OffloadingWorkerMetadata:
    """The worker's report for one step (vLLM: ``OffloadingWorkerMetadata``).

    ``completed_jobs`` counts, per job, the workers that finished it: each worker reports
    ``{job_id: 1}`` (``mark_completed``), and the engine sums the reports of its workers
    (``aggregate``) -- under tensor parallelism every rank copies its own heads of a block,
    so a transfer is done only when all of them are (the scheduler half waits for
    ``num_workers``). A job with a result below and no count was reported by one worker.
    kvlab's per-job results merge too: a load is as far as its least advanced worker got, a
    store stored only if every worker stored its part."""

    completed_jobs: dict[int, int] = field(default_factory=dict)
    loads: dict[int, LoadResult] = field(default_factory=dict)
    stores: dict[int, tuple[bool, bool, str]] = field(default_factory=dict)  # job id -> (stored, cascaded, error)
    cascade_bytes: dict[int, int] = field(default_factory=dict)  # job id -> bytes its cascade wrote to files
    cascade_time: dict[int, float] = field(default_factory=dict)  # job id -> seconds its cascade took
    block_nbytes: int = 0  # bytes of one block in host memory (the scheduler half has no tensors)
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    num_stored_tokens: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # req id -> why its load failed
    transfer_stats: TransferStats = field(default_factory=TransferStats)

    def __post_init__(self) -> None:
        for job_id in (*self.loads, *self.stores):
            self.completed_jobs.setdefault(job_id, 1)

    def mark_completed(self, job_id: int) -> None:
        """This worker finished ``job_id``."""
        self.completed_jobs[job_id] = 1

    def aggregate(self, other: OffloadingWorkerMetadata) -> OffloadingWorkerMetadata:
        """Two workers' reports (or two partial sums) as one: counts added, results merged."""
        if not isinstance(other, OffloadingWorkerMetadata):
            raise TypeError(f"can only aggregate an OffloadingWorkerMetadata, got {type(other).__name__}")
        counts = dict(self.completed_jobs)
        for job_id, n in other.completed_jobs.items():
            counts[job_id] = counts.get(job_id, 0) + n
        loads = dict(self.loads)
        for job_id, res in other.loads.items():
            mine = loads.get(job_id)
            if mine is None or res.num_loaded < mine.num_loaded or (res.num_loaded == mine.num_loaded and mine.failed_key is None):
                loads[job_id] = res
        stores = dict(self.stores)
        for job_id, (ok, cascaded, err) in other.stores.items():
            mine_s = stores.get(job_id)
            stores[job_id] = (ok, cascaded, err) if mine_s is None else (mine_s[0] and ok, mine_s[1] and cascaded, mine_s[2] or err)
        return OffloadingWorkerMetadata(
            completed_jobs=counts,
            loads=loads,
            stores=stores,
            cascade_bytes=_merged(self.cascade_bytes, other.cascade_bytes, lambda a, b: a + b),  # each rank writes its share
            cascade_time=_merged(self.cascade_time, other.cascade_time, max),  # the ranks write side by side
            block_nbytes=self.block_nbytes or other.block_nbytes,
            num_loaded_tokens=_merged(self.num_loaded_tokens, other.num_loaded_tokens, max),  # the same tokens on every rank
            num_stored_tokens=_merged(self.num_stored_tokens, other.num_stored_tokens, max),
            errors={**other.errors, **self.errors},
            transfer_stats=self.transfer_stats.aggregate(other.transfer_stats),
        )

    def job(self, job_id: int) -> OffloadingWorkerMetadata:
        """The part of this report about ``job_id`` (its count and its results)."""
        return OffloadingWorkerMetadata(
            completed_jobs={job_id: self.completed_jobs.get(job_id, 0)},
            loads={job_id: self.loads[job_id]} if job_id in self.loads else {},
            stores={job_id: self.stores[job_id]} if job_id in self.stores else {},
            cascade_bytes={job_id: self.cascade_bytes[job_id]} if job_id in self.cascade_bytes else {},
            cascade_time={job_id: self.cascade_time[job_id]} if job_id in self.cascade_time else {},
        )


_K = TypeVar("_K")
_V = TypeVar("_V", int, float)


def _merged(a: dict[_K, _V], b: dict[_K, _V], combine: Callable[[_V, _V], _V]) -> dict[_K, _V]:
    out = dict(a)
    for k, v in b.items():
        out[k] = combine(out[k], v) if k in out else v
    return out
