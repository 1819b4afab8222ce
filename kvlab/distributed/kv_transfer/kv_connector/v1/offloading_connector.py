"""The offloading connector: CPU and disk tiers behind the GPU pool (vLLM:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``; lesson 12).

Without it, a cached prefix lives only as long as its blocks stay in the GPU pool: once
LRU eviction reuses them, the next request with that prefix recomputes it. With it, every
prompt block the engine computes is also copied to host memory (and from there to a file),
each tier with its own LRU; a prefix that left the GPU pool is still found in a tier and
*loaded* back -- a copy instead of a prefill. The scheduler sees those blocks as external
computed tokens.

Which blocks: a model with one full-attention group, that group's; under HiSparse (vLLM
0.33) the indexer group's alone -- the source K/V already lives whole in HiSparse's host
pool -- and a load never reaches past the prefix the host pool still holds
(``_max_loadable_tokens``), since nothing would fill the source K/V beyond it.

One class, two roles, as in vLLM: built with ``KVConnectorRole.SCHEDULER`` it keeps the
tiers' books (:mod:`...offloading.staged_scheduler`), with ``KVConnectorRole.WORKER`` it moves the
bytes (:mod:`...offloading.worker`). Both are built from the same ``KVTransferConfig``
(``kv_connector="OffloadingConnector"``; extra config ``num_cpu_blocks``,
``storage_path`` and ``num_storage_blocks`` for a disk tier, ``offload_prompt_only``,
``self_describing_kv_events``; the CPU
tier's ``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``; the disk tier's
``backpressure``).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import resolve_blocks_per_chunk, get_offloading_group_ids
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.staged_scheduler import StagedOffloadingConnectorScheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.worker import StagedOffloadingConnectorWorker
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.tiering.factory import create_backpressure_detector
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.staged import StagedTieringManager
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.utils.checks import check_int

if TYPE_CHECKING:
    from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request

_KNOWN = {
    "num_cpu_blocks",
    "storage_path",
    "num_storage_blocks",
    "offload_prompt_only",
    "eviction_policy",
    "cache_policy_module_path",
    "store_threshold",
    "backpressure",
    "self_describing_kv_events",
    "block_size",
    "blocks_per_chunk",
}


class OffloadingConnector(KVConnectorBase_V1):
    #: The scheduler half's class: a seam (the ``tier_hits`` exercise plugs a subclass in).
    scheduler_cls: type[StagedOffloadingConnectorScheduler] = StagedOffloadingConnectorScheduler

    def __init__(self, role: KVConnectorRole, block_size: int, extra_config: dict[str, Any] | None = None) -> None:
        super().__init__(role)
        cfg = dict(extra_config or {})
        unknown = set(cfg) - _KNOWN
        if unknown:
            raise ValueError(f"OffloadingConnector: unknown extra config {sorted(unknown)}; known: {sorted(_KNOWN)}")
        self.block_size = check_int("block_size", block_size, 1)
        # vLLM 0.33 may coalesce several GPU blocks into one tier chunk (extra config
        # "blocks_per_chunk", or "block_size" in tokens); kvlab's tiers keep one block each.
        per_chunk = resolve_blocks_per_chunk(cfg, (self.block_size,))
        if per_chunk != 1:
            raise ValueError(
                f"kvlab's offloading tiers keep one GPU block per chunk; the extra config asks for {per_chunk} "
                f"(blocks_per_chunk=1, or block_size={self.block_size})"
            )
        self.num_cpu_blocks = check_int("num_cpu_blocks", cfg.get("num_cpu_blocks", 64), 1)
        path = cfg.get("storage_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise TypeError(f"storage_path must be None or a directory path, got {path!r}")
        self.storage_path = path
        self.num_storage_blocks = check_int("num_storage_blocks", cfg.get("num_storage_blocks", 4 * self.num_cpu_blocks), 1)
        offload_prompt_only = cfg.get("offload_prompt_only", True)
        if not isinstance(offload_prompt_only, bool):
            raise TypeError(f"offload_prompt_only must be a bool, got {offload_prompt_only!r}")
        # With KV events on, publish the tiers' stores with their tokens and every block hash
        # (vLLM 0.33's opt-in), not placeholders that name one hash.
        self_describing = cfg.get("self_describing_kv_events", False)
        if not isinstance(self_describing, bool):
            raise TypeError(f"self_describing_kv_events must be a bool, got {self_describing!r}")
        # The CPU tier's cache policy and admission (vLLM's CPU spec reads the same keys).
        self.eviction_policy = cfg.get("eviction_policy", "lru")
        self.cache_policy_module_path = cfg.get("cache_policy_module_path")
        self.store_threshold = check_int("store_threshold", cfg.get("store_threshold", 0), 0)
        # The disk tier's back-pressure (vLLM 0.33's "backpressure" dict); built here, before
        # any tier, so a bad config leaves nothing half made.
        detector = create_backpressure_detector(cfg.get("backpressure"), StagedFileSystemTier.tier_type)
        if detector is not None and path is None:
            raise ValueError("backpressure applies to the disk tier: set storage_path too")
        self.connector_scheduler: StagedOffloadingConnectorScheduler | None = None
        self.connector_worker: StagedOffloadingConnectorWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            storage = (
                StagedFileSystemTier(self.num_storage_blocks, path, block_size=self.block_size, backpressure_detector=detector)
                if path is not None
                else None
            )
            cpu = CPUOffloadingManager(
                self.num_cpu_blocks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=True,
                store_threshold=self.store_threshold,
            )
            manager = StagedTieringManager(cpu, storage)
            self.connector_scheduler = self.scheduler_cls(manager, self.block_size, offload_prompt_only, self_describing)
        else:
            self.connector_worker = StagedOffloadingConnectorWorker(self.num_cpu_blocks, self.block_size)

    @property
    def scheduler(self) -> StagedOffloadingConnectorScheduler:
        scheduler = self.connector_scheduler
        if scheduler is None:
            self._check_role(KVConnectorRole.SCHEDULER, "scheduler")
        assert scheduler is not None
        return scheduler

    @property
    def worker(self) -> StagedOffloadingConnectorWorker:
        self._check_role(KVConnectorRole.WORKER, "worker")
        assert self.connector_worker is not None
        return self.connector_worker

    @property
    def manager(self) -> StagedTieringManager:
        """The tiers' books (scheduler side): ``manager.primary`` is the CPU tier."""
        return self.scheduler.manager

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Any) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores copy every layer at once, in wait_for_save (as vLLM's offloading connector)

    def wait_for_save(self, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        self.worker.wait_for_save(meta, skip_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.build_connector_worker_meta()

    # -- scheduler side ---------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Bind the scheduler's manager (the scheduler half checks it can serve it first:
        a refused manager leaves the connector as it was). The config is kept too: which
        groups bound a load is read from it (``_bounding_group_ids``)."""
        scheduler = self.__dict__.get("connector_scheduler")
        if isinstance(scheduler, StagedOffloadingConnectorScheduler):  # not a test's stand-in
            scheduler.bind(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_cache_config = kv_cache_manager.kv_cache_config
        self.__dict__.pop("_bounding_group_ids", None)  # read again from this config

    @cached_property
    def _bounding_group_ids(self) -> tuple[int, ...]:
        """The prefix-cacheable groups this connector does not offload (vLLM 0.33): under
        HiSparse, the source group, whose K/V lives in the host pool. A load must not reach
        past such a group's own cached prefix -- nothing would fill its K/V there. Empty
        before a manager is bound (no config to read)."""
        config = self._kv_cache_config
        if config is None:
            return ()
        offloaded = set(get_offloading_group_ids(config))
        return tuple(
            group_id
            for group_id, group in enumerate(config.kv_cache_groups)
            if group.kv_cache_spec.prefix_cacheable and group_id not in offloaded
        )

    def _max_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """How far past ``num_computed_tokens`` a load may reach: None when unbounded (every
        prefix-cacheable group is offloaded), else the shortest cached prefix among the
        groups this connector does not keep, less what is computed already."""
        if not self._bounding_group_ids:
            return None
        manager = self._kv_cache_manager
        if manager is None:
            raise RuntimeError("no KV cache manager is bound: the scheduler binds it before it asks")
        # A bounding group beside an offloaded one: two groups or more, so a hybrid coordinator.
        coordinator = cast("HybridKVCacheCoordinator", manager.coordinator)
        _, per_group_hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, request.num_tokens - 1)
        bound = min(per_group_hits[group_id] for group_id in self._bounding_group_ids)
        return max(0, bound - num_computed_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens, max_num_new_tokens=self._max_loadable_tokens(request, num_computed_tokens)
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Layer-outermost pages ("LBHNC"), or block-outermost ("BLHNC") under HiSparse, whose
        host pages copy whole (vLLM 0.33)."""
        attention = getattr(vllm_config, "attention_config", None)
        return "BLHNC" if getattr(attention, "hisparse_config", None) is not None else "LBHNC"

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """The scheduler half's metrics payload (the worker half reports through its
        metadata, so it has none of its own)."""
        return self.connector_scheduler.get_stats() if self.connector_scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadingConnectorStats:
        return OffloadingConnectorStats(data=data) if data is not None else OffloadingConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]
    ) -> Any:
        """The offload metrics as Prometheus metrics (:class:`OffloadPromMetrics`). The
        metrics a backend reports come from its spec class (``spec_name``); kvlab's own tiers
        (a config without ``spec_name`` or vLLM's ``cpu_bytes_to_use``) report as vLLM's
        tiering spec does -- a CPU tier in front, a file tier behind it when there is one."""
        import copy
        import dataclasses

        from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        if "spec_name" not in extra and "cpu_bytes_to_use" not in extra:
            # The same engine config, its extra config naming the tiering spec and its tiers.
            tiers = [{"type": "fs", "root_dir": extra["storage_path"]}] if extra.get("storage_path") else []
            extra = {**extra, "spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}
            vllm_config = copy.copy(vllm_config)
            vllm_config.kv_transfer_config = dataclasses.replace(transfer, kv_connector_extra_config=extra)
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> list[Any]:
        return self.scheduler.take_events()
