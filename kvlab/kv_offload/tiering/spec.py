"""A CPU tier with secondary tiers behind it, as an offloading backend (vLLM 0.33:
``TieringOffloadingSpec`` in ``vllm/v1/kv_offload/tiering/spec.py``).

``kv_connector_extra_config``: what :class:`~kvlab.kv_offload.cpu.spec.CPUOffloadingSpec`
reads (``cpu_bytes_to_use``, ``eviction_policy``, ``cache_policy_module_path``; not
``store_threshold`` >= 2, which this manager does not apply), plus

* ``secondary_tiers``: a list of tier configs, ``{"type": "fs", "root_dir": ...}`` -- ``type``
  a registered tier or, with ``module_path``, a class of your own; every other key goes to
  the tier's constructor (:class:`~kvlab.kv_offload.tiering.factory.SecondaryTierFactory`);
* ``backpressure``: a default back-pressure config for every tier; a tier's own
  ``backpressure`` overrides it key by key (so ``{}`` in a tier takes the defaults);
* ``tier_poll_interval_s``: the pause of the thread that serves tiers between steps (<= 0:
  no thread, tiers are served once per step).

Why every platform uses the shared region here, unlike the CPU spec: the secondary tiers run
in the scheduler process and read the CPU tier's rows, so the scheduler maps the same file
the workers write (``rank=None``: the whole row). The worker module is loaded on first use:
this module is one of the scheduler's books and imports no worker code (import-linter).
"""

from __future__ import annotations

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
)
from kvlab.kv_offload.config import OffloadingConfig
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.kv_offload.cpu.spec import CPUOffloadingSpec, load_worker_attr
from kvlab.kv_offload.tiering.base import TIER_LABEL, SecondaryTierManager, TieringOffloadingMetrics
from kvlab.kv_offload.tiering.factory import SecondaryTierFactory
from kvlab.kv_offload.tiering.manager import DEFAULT_TIER_POLL_INTERVAL_S, CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from kvlab.utils.checks import check_int, check_number

if TYPE_CHECKING:
    from kvlab.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

logger = logging.getLogger(__name__)

_SYNC_LOOKUP_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1)
_ASYNC_LOOKUP_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)
_PROMOTION_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def __getattr__(name: str) -> Any:
    if name == "CPUOffloadingWorker":
        return load_worker_attr(globals(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tier_configs(extra_config: Mapping[str, Any]) -> list[dict[str, Any]]:
    tiers = extra_config.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise ValueError(f"secondary_tiers must be a list of tier configurations, got {type(tiers).__name__}")
    for i, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            raise TypeError(f"secondary_tiers[{i}] must be a dict with 'type', got {type(tier).__name__}")
    return [dict(t) for t in tiers]


class TieringOffloadingSpec(CPUOffloadingSpec):
    """The CPU tier (the only one that touches GPU memory) and the configured secondary tiers."""

    BLOCK_SIZE_ALIGNMENT = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        M, per_tier = TieringOffloadingMetrics, (TIER_LABEL,)
        defs = super().build_metric_definitions(extra_config)
        defs.update(
            {
                M.LOOKUP_SYNC_DELAY: OffloadingHistogramMetadata(
                    "Seconds a tier lookup blocked before it answered hit or miss, per tier.", per_tier, _SYNC_LOOKUP_BUCKETS
                ),
                M.LOOKUP_ASYNC_DELAY: OffloadingHistogramMetadata(
                    "Seconds from a tier lookup's first 'retry' to its hit or miss, per tier.", per_tier, _ASYNC_LOOKUP_BUCKETS
                ),
                M.READ_BYTES: OffloadingCounterMetadata("Bytes promoted from a secondary tier into the CPU tier, per tier.", per_tier),
                M.READ_TIME: OffloadingCounterMetadata(
                    "Seconds spent promoting from a secondary tier, per tier (tiers that time their jobs only).", per_tier
                ),
                M.WRITE_BYTES: OffloadingCounterMetadata("Bytes cascaded from the CPU tier into a secondary tier, per tier.", per_tier),
                M.WRITE_TIME: OffloadingCounterMetadata(
                    "Seconds spent cascading into a secondary tier, per tier (tiers that time their jobs only).", per_tier
                ),
                M.PROMOTION_JOB_FAILURES: OffloadingCounterMetadata("Promotion jobs that failed, per tier.", per_tier),
                M.CASCADE_JOB_FAILURES: OffloadingCounterMetadata("Cascade jobs that failed, per tier.", per_tier),
                M.CHUNK_QUERIES: OffloadingCounterMetadata("Chunk lookups sent to a tier, per tier.", per_tier),
                M.CHUNK_HITS: OffloadingCounterMetadata("Chunk lookups a tier answered with a hit, per tier.", per_tier),
                M.PROMOTION_ALLOCATION_FAILURES: OffloadingCounterMetadata("Promotions dropped: the CPU tier had no room for them."),
                M.PRIMARY_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                    "Share of the CPU tier being filled by promotions, per tier.", per_tier
                ),
                M.PRIMARY_READ_USAGE_PERC: OffloadingGaugeMetadata("Share of the CPU tier being read by cascades, per tier.", per_tier),
                M.ACTIVE_PROMOTION_JOBS: OffloadingGaugeMetadata("Promotion jobs in flight, per tier.", per_tier),
                M.ACTIVE_CASCADE_JOBS: OffloadingGaugeMetadata("Cascade jobs in flight, per tier.", per_tier),
                M.PROMOTION_LATENCY: OffloadingHistogramMetadata(
                    "Seconds from a promotion job's creation to the manager seeing it end (queueing included), per tier and result.",
                    (TIER_LABEL, "result"),
                    _PROMOTION_LATENCY_BUCKETS,
                ),
            }
        )
        for tier_config, tier_cls in cls._get_secondary_tiers(extra_config):
            defs.update(tier_cls.build_metric_definitions(tier_config))
        defs[M.BACKPRESSURE_STORE_LATENCY_EMA] = OffloadingGaugeMetadata(
            "Moving average of a tier's store latency, in s/MiB (what back-pressure watches), per tier.", per_tier
        )
        defs[M.BACKPRESSURE_STORES_DROPPED] = OffloadingCounterMetadata("Cascades dropped by a tier's back-pressure, per tier.", per_tier)
        defs[M.BACKPRESSURE_BLOCKS_DROPPED] = OffloadingCounterMetadata(
            "Blocks in the cascades dropped by a tier's back-pressure, per tier.", per_tier
        )
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The CPU tier's labels, ``TIER_LABEL``, then every tier's labels (each name once)."""
        keys = dict.fromkeys(super().config_info_keys(extra_config))
        keys[TIER_LABEL] = None
        for tier_config, tier_cls in cls._get_secondary_tiers(extra_config):
            tier_keys = tier_cls.config_info_keys(tier_config)
            assert TIER_LABEL not in tier_keys, f"{tier_cls.__name__} must not declare the reserved label {TIER_LABEL!r}"
            keys.update(dict.fromkeys(tier_keys))
        return tuple(keys)

    @classmethod
    def _get_secondary_tiers(cls, extra_config: Mapping[str, Any]) -> list[tuple[dict[str, Any], type[SecondaryTierManager]]]:
        """(tier config, tier class) per configured tier, in order (the order is the tier index)."""
        return [(cfg, SecondaryTierFactory.get_tier_class(cfg)) for cfg in _tier_configs(extra_config)]

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # Copies: the resolved back-pressure goes into them, never into the caller's config.
        self.secondary_tier_configs = _tier_configs(self.extra_config)
        self.tier_poll_interval_s = float(
            check_number("tier_poll_interval_s", self.extra_config.get("tier_poll_interval_s", DEFAULT_TIER_POLL_INTERVAL_S))
        )
        defaults = self.extra_config.get("backpressure")
        if defaults is not None and not isinstance(defaults, Mapping):
            raise TypeError(f"backpressure must be None or a dict, got {type(defaults).__name__}")
        for i, tier_cfg in enumerate(self.secondary_tier_configs):
            own = tier_cfg.get("backpressure")
            if own is not None and not isinstance(own, Mapping):
                raise TypeError(f"secondary_tiers[{i}]['backpressure'] must be None or a dict, got {type(own).__name__}")
            merged = {**(defaults or {}), **(own or {})}
            # A tier with no back-pressure anywhere stays without a detector.
            if merged or "backpressure" in tier_cfg:
                tier_cfg["backpressure"] = merged
        self._scheduler_mmap: SharedOffloadRegion | None = None
        self.all_layers_portable: bool | None = None  # set by create_worker in the canonical layout
        self._engine_id = config.engine_id  # one per data-parallel replica: names its region

    def get_manager(self) -> OffloadingManager:
        """The tiering manager over a CPU primary tier; on any failure what was built is shut
        down again, in reverse, and the error raised."""
        if self._manager is not None:
            return self._manager
        if check_int("store_threshold", self.extra_config.get("store_threshold", 0), 0) >= 2:
            raise ValueError("store_threshold is not supported for TieringOffloadingSpec (use CPUOffloadingSpec)")
        region: SharedOffloadRegion | None = None
        primary: CPUPrimaryTierOffloadingManager | None = None
        tiers: list[SecondaryTierManager] = []
        try:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=None,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._scheduler_mmap = region
            primary = CPUPrimaryTierOffloadingManager(
                num_chunks=self.num_chunks,
                mmap_region=region,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                info=self.cpu_info,
            )
            view = primary.get_kv_memoryview()
            for tier_config in self.secondary_tier_configs:
                tiers.append(SecondaryTierFactory.create_secondary_tier(tier_config, view, self))
            self._manager = TieringOffloadingManager(
                primary_tier=primary, secondary_tiers=tiers, tier_poll_interval_s=self.tier_poll_interval_s
            )
        except Exception:
            self._release_partial(region, primary, tiers)
            raise
        logger.info(
            "TieringOffloadingManager: CPU tier (%s, %d chunks) and %d secondary tier(s)", self.eviction_policy, self.num_chunks, len(tiers)
        )
        return self._manager

    def _release_partial(
        self, region: SharedOffloadRegion | None, primary: CPUPrimaryTierOffloadingManager | None, tiers: list[SecondaryTierManager]
    ) -> None:
        for tier in reversed(tiers):
            try:
                tier.shutdown()
            except Exception:
                logger.exception("Failed to shut down a secondary tier while undoing get_manager")
        try:
            if primary is not None:
                primary.shutdown()  # releases the region too
            elif region is not None:
                region.cleanup()
        except Exception:
            logger.exception("Failed to release the CPU tier while undoing get_manager")
        self._scheduler_mmap = None

    def _uses_shared_region(self) -> bool:
        return True  # every platform: the scheduler's tiers read the rows (module docstring)

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        worker_cls = load_worker_attr(globals(), "CPUOffloadingWorker")
        try:
            if self.config.canonical_layout:
                self._validate_canonical_refs(kv_caches)
            return worker_cls(  # the class, or a stand-in set on the module
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                mmap_region=region,
                canonical_layout=self.config.canonical_layout,
            )
        except Exception:
            region.cleanup()
            raise

    def _validate_canonical_refs(self, kv_caches: CanonicalKVCaches) -> None:
        """The canonical layout needs a certified mapping for every layer; records whether
        all of them are parallelism-agnostic. Refuses rather than store bytes whose layout
        the files would misname."""
        refs = [ref for group in kv_caches.group_data_refs for ref in group]
        if any(ref.mapping is None for ref in refs):
            raise RuntimeError(
                "canonical_layout was requested but some layer's KV layout has no certified canonical mapping "
                "(the offload workers must be exactly the TP group; packed or cross-layer layouts are not supported). "
                "Remove canonical_layout from kv_connector_extra_config."
            )
        self.all_layers_portable = all(ref.mapping is not None and ref.mapping.parallelism_agnostic for ref in refs)
        if self.config.parallel.is_parallelism_agnostic and not self.all_layers_portable:
            raise RuntimeError(
                "canonical_layout could not certify every layer as parallelism-agnostic, but the storage namespace "
                "is shared across parallel layouts. Remove canonical_layout or turn off parallelism-agnostic tiers."
            )
