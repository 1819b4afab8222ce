"""What the offloading connector's two halves tell each other (vLLM:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from kvlab.kv_offload.base import OffloadKey
from kvlab.kv_offload.tiering.manager import LoadItem, StorePlan


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


@dataclass(slots=True)
class OffloadingWorkerMetadata:
    """The worker's report for one step (vLLM: ``OffloadingWorkerMetadata``)."""

    loads: dict[int, LoadResult] = field(default_factory=dict)
    stores: dict[int, tuple[bool, bool, str]] = field(default_factory=dict)  # job id -> (stored, cascaded, error)
    cascade_bytes: dict[int, int] = field(default_factory=dict)  # job id -> bytes its cascade wrote to files
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    num_stored_tokens: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # req id -> why its load failed
