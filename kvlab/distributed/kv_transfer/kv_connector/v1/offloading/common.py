"""What the offloading connector's two halves tell each other (vLLM:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from kvlab.kv_offload.base import OffloadKey
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
class OffloadingConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    block_size: int = 16


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
    """The worker's report for one step (vLLM: ``OffloadingWorkerMetadata``)."""

    loads: dict[int, LoadResult] = field(default_factory=dict)
    stores: dict[int, tuple[bool, bool, str]] = field(default_factory=dict)  # job id -> (stored, cascaded, error)
    cascade_bytes: dict[int, int] = field(default_factory=dict)  # job id -> bytes its cascade wrote to files
    cascade_time: dict[int, float] = field(default_factory=dict)  # job id -> seconds its cascade took
    block_nbytes: int = 0  # bytes of one block in host memory (the scheduler half has no tensors)
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    num_stored_tokens: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # req id -> why its load failed
    transfer_stats: TransferStats = field(default_factory=TransferStats)
