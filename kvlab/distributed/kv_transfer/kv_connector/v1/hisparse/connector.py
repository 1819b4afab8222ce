"""HiSparse's connector, scheduler half (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/hisparse/connector.py``).

HiSparse's coordinator (:mod:`kvlab.core.hisparse_coordinator`) decides what moves between
the GPU and the host pool; the connector is how those decisions reach the worker and how the
worker's completions come back. Each step, ``build_connector_meta`` runs the coordinator's
per-step work for every scheduled request (write-backs, residency), then packs the
transfers, the host copy-on-write pairs, the host blocks handed out this step, the rows the
step will write (to mirror to the host), whether the whole context is on the GPU, and the
residency updates. ``update_connector_output`` feeds the workers' counts back: a transfer
completes once every worker ran it, which is what lets a page be unpinned.

The worker half (CUDA copies between the pools, the hot buffer's top-k bookkeeping) is not
built: ``HiSparseConnector`` refuses the worker role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA
from kvlab.distributed.kv_transfer.kv_connector.v1.hisparse.stats import HiSparseKVConnectorStats

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    from kvlab.core.hisparse_coordinator import (
        HiSparseCoordinator,
        SparseKVOffloadCommand,
        SparseKVResidencyUpdate,
        SparseKVRowMirror,
    )
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.kv_cache_utils import KVCacheBlockCopy
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.request import Request

__all__ = ["HiSparseConnector", "HiSparseConnectorMetadata", "HiSparseConnectorScheduler", "HiSparseConnectorWorkerMetadata"]


@dataclass
class HiSparseConnectorMetadata(KVConnectorMetadata):
    """One step's HiSparse work for the worker."""

    command: SparseKVOffloadCommand | None
    host_block_copies: tuple[KVCacheBlockCopy, ...]
    source_block_ids: tuple[int, ...]  # host blocks handed out this step
    row_mirrors: dict[str, tuple[SparseKVRowMirror, ...]]
    all_context_pages_resident: bool
    residency_updates: dict[str, SparseKVResidencyUpdate]


@dataclass
class HiSparseConnectorWorkerMetadata:
    """One worker's report: transfers it queued and finished (transfer id -> count), and the
    host copies it ran (by destination block id)."""

    enqueued_transfer_counts: dict[int, int]
    completed_transfer_counts: dict[int, int]
    completed_host_copy_dst_ids: tuple[int, ...] = ()

    def aggregate(self, other: HiSparseConnectorWorkerMetadata) -> HiSparseConnectorWorkerMetadata:
        """Two workers' reports as one: counts add up; every worker runs the same host
        copies, so theirs are one set."""
        if not isinstance(other, HiSparseConnectorWorkerMetadata):
            raise TypeError(f"other must be a HiSparseConnectorWorkerMetadata, got {type(other).__name__}")

        def add(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
            out = dict(a)
            for tid, n in b.items():
                out[tid] = out.get(tid, 0) + n
            return out

        return HiSparseConnectorWorkerMetadata(
            add(self.enqueued_transfer_counts, other.enqueued_transfer_counts),
            add(self.completed_transfer_counts, other.completed_transfer_counts),
            tuple(dict.fromkeys((*self.completed_host_copy_dst_ids, *other.completed_host_copy_dst_ids))),
        )


class HiSparseConnectorScheduler:
    """The scheduler half's state: the coordinator and the requests it serves.

    ``async_speculative``: with asynchronous scheduling and speculative decoding, a request's
    last ``num_output_placeholders`` positions are not settled yet, so the rows mirrored to
    the host start that far back (read live: drafts are accepted between steps);
    ``draft_kv_lookahead``: rows past the scheduled ones a drafter writes too."""

    def __init__(self, *, async_speculative: bool, draft_kv_lookahead: int = 0) -> None:
        self.coordinator: HiSparseCoordinator | None = None
        self.async_speculative = async_speculative
        self.draft_kv_lookahead = draft_kv_lookahead
        self.requests: dict[str, Any] = {}

    def bind_coordinator(self, coordinator: HiSparseCoordinator) -> None:
        if self.coordinator is not None:
            raise RuntimeError("this connector is bound to a coordinator already")
        self.coordinator = coordinator

    def _bound(self) -> HiSparseCoordinator:
        if self.coordinator is None:
            raise RuntimeError("no HiSparse coordinator is bound: bind_kv_cache_manager() first")
        return self.coordinator

    def get_kv_connector_stats(self) -> HiSparseKVConnectorStats | None:
        """The host pool's level now (how full, write-backs in flight) and its sampled
        residencies that ended since the last call; None before a coordinator is bound."""
        if self.coordinator is None:
            return None
        host_pool = self.coordinator.get_host_block_pool()
        assert host_pool is not None  # a coordinator is built only with a host pool
        stats = HiSparseKVConnectorStats()
        stats.record_host_usage(host_pool.get_usage(), len(self.coordinator.pending_spills))
        if host_pool.metrics_collector is not None:
            stats.record_host_evictions(host_pool.metrics_collector.drain_events())
        return stats

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiSparseConnectorMetadata:
        coord = self._bound()
        # The worker rebinds its state every step, so the load starts before the forward.
        scheduler_output.has_sync_kv_loads = True
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled = tuple((rid, computed[rid], n) for rid, n in scheduler_output.num_scheduled_tokens.items())
        # First: this step's write-backs and residency changes.
        coord.advance_scheduled((rid, min(start + n, self.requests[rid].num_tokens)) for rid, start, n in scheduled)
        command = coord.build_offload_command()
        host_copies = coord.take_host_block_copies()
        gid = coord.host_group_id
        assert gid is not None  # a coordinator without a host group is refused when built
        source_ids = [bid for r in scheduler_output.scheduled_new_reqs for bid in r.block_ids[gid]]
        for new_ids in cached.new_block_ids:
            if new_ids is not None:
                source_ids.extend(new_ids[gid])
        mirrors = {}
        for rid, start, n in scheduled:
            first = start
            if self.async_speculative:
                first = max(0, start - self.requests[rid].num_output_placeholders)
            mirrors[rid] = coord.build_row_mirrors(((rid, first, n + start - first + self.draft_kv_lookahead),))
        return HiSparseConnectorMetadata(
            command,
            host_copies,
            tuple(source_ids),
            mirrors,
            coord.all_context_pages_resident(scheduled),
            coord.take_residency_updates(scheduler_output.num_scheduled_tokens),
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Finished imports, then the workers' host copies and transfer counts."""
        coord = self._bound()
        failed = connector_output.failed_recving or ()
        for rid in connector_output.finished_recving or ():
            coord.finish_host_import(rid, failed=rid in failed)
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, HiSparseConnectorWorkerMetadata):
            raise TypeError(f"kv_connector_worker_meta must be a HiSparseConnectorWorkerMetadata, got {type(meta).__name__}")
        coord.release_completed_host_copies(meta.completed_host_copy_dst_ids)
        coord.update_spills(meta.enqueued_transfer_counts, meta.completed_transfer_counts)


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    """HiSparse's connector: it supplies no tokens of its own (the host pool is the source
    group's, found by the prefix lookup), it carries the coordinator's work to the worker."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config.hisparse_host_num_blocks is None:
            raise ValueError("HiSparseConnector needs a HiSparse host pool: kv_cache_config.hisparse_host_num_blocks is None")
        if role is not KVConnectorRole.SCHEDULER:
            raise ValueError(f"role must be KVConnectorRole.SCHEDULER: kvlab builds HiSparse's scheduler half only, got {role!r}")
        spec = getattr(vllm_config, "speculative_config", None)
        self.connector_scheduler: HiSparseConnectorScheduler | None = HiSparseConnectorScheduler(
            async_speculative=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False) and spec is not None),
            draft_kv_lookahead=getattr(vllm_config, "num_lookahead_tokens", 0),
        )

    def _scheduler(self) -> HiSparseConnectorScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("this HiSparseConnector has no scheduler half")
        return self.connector_scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        coord = getattr(kv_cache_manager, "hisparse", None)  # a manager with a host pool starts it
        if coord is None:
            raise ValueError("the KV cache manager runs no HiSparse coordinator: build it from a config with hisparse_host_num_blocks")
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().bind_coordinator(coord)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Block-outermost pages ("BLHNC"): a host page copies as one contiguous run."""
        return "BLHNC"

    def get_kv_connector_stats(self) -> HiSparseKVConnectorStats | None:
        return self.connector_scheduler.get_kv_connector_stats() if self.connector_scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiSparseKVConnectorStats:
        return HiSparseKVConnectorStats(data=data) if data is not None else HiSparseKVConnectorStats()

    def has_pending_push_work(self) -> bool:
        return self._scheduler()._bound().has_pending_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler()._bound().has_pending_reclamation()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().requests.pop(request.request_id, None)
        return False, None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # -- worker side: not built -------------------------------------------------------------
    def _no_worker(self) -> None:
        raise NotImplementedError("kvlab builds HiSparse's scheduler half only: the worker half moves CUDA pages")

    def start_load_kv(self, **kwargs: Any) -> None:
        self._no_worker()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        return None
