"""The CPU tier as an offloading backend (vLLM 0.33: ``CPUOffloadingSpec`` in ``vllm/v1/kv_offload/cpu/spec.py``).

From ``kv_connector_extra_config["cpu_bytes_to_use"]`` and the bytes one worker keeps per
GPU block, the spec derives the tier's shape, the same on the scheduler and every worker:

* a chunk holds ``blocks_per_chunk`` blocks of every worker (one copy in all when the layout
  is *replicated*: every worker would store the same bytes, pure MLA under tensor parallel),
  padded up to ``BLOCK_SIZE_ALIGNMENT`` (a page: the shared region maps whole pages) --
  ``kv_bytes_per_chunk``; one worker's part of it is ``cpu_page_size_per_worker``;
* ``num_chunks`` = ``cpu_bytes_to_use // kv_bytes_per_chunk`` (0 when a block has no bytes).

``get_manager`` builds the books (:class:`~kvlab.kv_offload.cpu.manager.CPUOffloadingManager`:
``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``, ``max_tracker_size``);
``get_worker`` the copies (:class:`~kvlab.kv_offload.cpu.gpu_worker.CPUOffloadingWorker`),
over a :class:`SharedOffloadRegion` on a CUDA (not ROCm) or XPU machine -- only a file every
worker maps can hold one copy for all -- and over private host tensors elsewhere.

kvlab differs in one place: vLLM refuses ``get_worker`` without a GPU; kvlab's worker copies
host memory, so it builds one anywhere. The worker module is loaded on first use (this
module's ``CPUOffloadingWorker`` attribute): the tiering spec, one of the scheduler's books,
extends this class and must not import worker code (an import-linter contract).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvlab.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from kvlab.kv_offload.config import OffloadingConfig
from kvlab.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from kvlab.kv_offload.cpu.host_register import current_platform
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.utils.checks import check_int
from kvlab.utils.math_utils import round_up

if TYPE_CHECKING:
    from kvlab.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

logger = logging.getLogger(__name__)

#: Files the shared region is split over, so workers pre-fault them in parallel (the kernel
#: fills one shm file's pages one at a time).
_REGION_SEGMENTS = 32
_ALLOCATION_SIZE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


def load_worker_attr(module_globals: dict[str, Any], name: str) -> Any:
    """A module's lazily loaded worker class: the one set on the module (a test may swap it)
    or, the first time, ``kvlab.kv_offload.cpu.gpu_worker``'s, kept for the next call."""
    if name not in module_globals:
        module_globals[name] = getattr(importlib.import_module("kvlab.kv_offload.cpu.gpu_worker"), name)
    return module_globals[name]


def __getattr__(name: str) -> Any:
    if name == "CPUOffloadingWorker":
        return load_worker_attr(globals(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CPUOffloadingSpec(OffloadingSpec):
    """One CPU tier (see the module docstring for how it is sized)."""

    BLOCK_SIZE_ALIGNMENT = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                "Share of the CPU tier's chunks held by transfers in flight (0: idle, 1: full); "
                "a high value means stores and promotions may be dropped for lack of room."
            ),
            CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                "Share of the CPU tier's chunks held by stores not yet completed."
            ),
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                "Share of the CPU tier's chunks held by loads not yet completed."
            ),
            CPUOffloadingMetrics.CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
                "Chunks each prepare_store asked the CPU tier for.", buckets=_ALLOCATION_SIZE_BUCKETS
            ),
        }
        if check_int("store_threshold", extra_config.get("store_threshold", 0), 0) >= 2:
            defs[CPUOffloadingMetrics.STORES_SKIPPED] = OffloadingCounterMetadata(
                "Stores the CPU tier turned away: the block was not offered store_threshold times yet."
            )
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        cpu_bytes = self.extra_config.get("cpu_bytes_to_use")
        if not cpu_bytes:
            raise ValueError(
                f"cpu_bytes_to_use must be specified in kv_connector_extra_config (bytes of host memory, > 0), got {cpu_bytes!r}"
            )
        cpu_bytes_to_use = check_int("cpu_bytes_to_use", cpu_bytes, 1)
        self.eviction_policy: str = self.extra_config.get("eviction_policy", "lru")
        self.cache_policy_module_path: str | None = self.extra_config.get("cache_policy_module_path")
        # A replicated layout keeps one copy for all workers: only on memory they all map.
        self.replicated_layout = bool(config.replicated_layout) and self._uses_shared_region()
        world_size = config.parallel.world_size
        self.num_chunks = 0
        self.kv_bytes_per_chunk = 0
        self.cpu_page_size_per_worker = 0
        if config.worker_kv_bytes_per_block > 0 and world_size > 0:
            copies = 1 if self.replicated_layout else world_size
            chunk_bytes = config.worker_kv_bytes_per_block * copies * self.blocks_per_chunk
            self.cpu_page_size_per_worker = chunk_bytes // copies
            # The padding is part of the chunk: the tier's size in bytes counts it.
            self.kv_bytes_per_chunk = round_up(chunk_bytes, self.BLOCK_SIZE_ALIGNMENT)
            self.num_chunks = cpu_bytes_to_use // self.kv_bytes_per_chunk
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # store_threshold >= 2: a block is stored once offered that many times (0, 1: always).
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=self.extra_config.get("store_threshold", 0),
                max_tracker_size=self.extra_config.get("max_tracker_size", 64_000),
                info=self.cpu_info,
            )
        return self._manager

    def _uses_shared_region(self) -> bool:
        """Whether the worker's CPU side is the shared mmap region (not private tensors)."""
        return (current_platform.is_cuda_alike() and not current_platform.is_rocm()) or current_platform.is_xpu()

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        """A new worker; with a shared region, this worker's slot of it (one slot for all
        when replicated: each worker then pre-faults its share of the rows)."""
        region: SharedOffloadRegion | None = None
        # A region of zero rows cannot be mapped: an empty tier keeps the tensor path.
        if self._uses_shared_region() and self.num_chunks > 0:
            parallel = self.config.parallel
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
                barrier=None,  # kvlab maps the region in one process group; nobody to wait for
                num_segments=_REGION_SEGMENTS,
                populate_shard=(parallel.rank, parallel.world_size) if self.replicated_layout else None,
            )
        worker_cls = load_worker_attr(globals(), "CPUOffloadingWorker")
        try:
            return worker_cls(  # the class, or a stand-in set on the module
                kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk, num_cpu_chunks=self.num_chunks, mmap_region=region
            )
        except Exception:
            if region is not None:
                region.cleanup()  # the worker owns the region only once built
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
