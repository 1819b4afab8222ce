"""kvlab's in-step scheduler half of the offloading connector (lesson 12): the books of
:class:`~kvlab.kv_offload.tiering.staged.StagedTieringManager`, whose CPU and disk tiers move
every block within the step, so each answer is HIT or MISS and each job is one block per
chunk of one KV-cache group. vLLM 0.33's own half -- built from an offloading spec, for any
number of groups, with asynchronous tiers -- is ``OffloadingConnectorScheduler`` in
:mod:`.scheduler`; this one keeps the same hook names and reads the same request caps.

* **Lookup** (``get_num_new_matched_tokens``): after the GPU prefix hit ends, walk the
  request's block hashes through the tiers (CPU first, then storage) and count the run of
  blocks they hold -- whole blocks, and never the prompt's last token (the model must
  compute it to sample the next one), nor past a bound the connector passes (HiSparse:
  the host pool's prefix) or the request's own ``max_load_tokens``. Those tokens are
  external computed tokens.
* **Load** (``update_state_after_alloc``): the scheduler gave the request GPU blocks for
  them; pin the blocks in their tiers and plan a load job into those GPU blocks.
* **Store** (``build_connector_meta``): every block that becomes full in this step is
  offered to the tiers -- only the prompt's blocks, vLLM's default
  (``offload_prompt_only``), and none past the request's ``max_offload_tokens``
  (``kv_transfer_params``, vLLM 0.33); blocks the request got from a prefix hit or a load are
  skipped (they came from the cache in the first place). The worker copies them after the
  forward pass; the CPU tier cascades them to disk.
* **Completion** (``update_connector_output``): the worker's report unpins loads, makes
  stores readable, and drops entries that failed (a missing or corrupt file).

The tiers keep one KV-cache group's blocks (``group_id``, set when bound): the only group,
or HiSparse's indexer group; each key carries that group's index, as in vLLM.

Every decision is written to the event log (``KVTransfer``, ``OffloadEvicted``), so the
lesson's pictures show stores, loads and which tier served each hit, step by step. With KV
events on, the tiers' changes are also queued as vLLM 0.33 publishes them (``take_events``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvlab.core.kv_cache_utils import get_manager_class
from kvlab.distributed.kv_events import KVCacheEvent
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    LoadJob,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    StoreJob,
)
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker, get_offloading_event_group_spec
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    _create_req_context,
    _token_cap,
    _yield_req_data,
    collect_stats,
    transfer_metrics,
)
from kvlab.kv_offload.base import (
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    get_offload_block_hash,
    CACHE_HIT_SOURCE_OF_MEDIUM,
    make_offload_key,
)
from kvlab.kv_offload.cpu.common import CPUOffloadingInfo
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.kv_offload.stats import OffloadingConnectorStats, _ConnectorMetricName
from kvlab.kv_offload.tiering.staged import StagedTieringManager, StorePlan

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.eventlog.events import EventLog
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StagedRequestState:
    req: Request
    req_context: ReqContext  # what the tiers keep about the request (its keys' positions, its rank)
    block_ids: list[int] = field(default_factory=list)  # the offloaded group's table as the worker knows it
    next_stored_block_idx: int = 0  # blocks before it were stored, or came from a cache
    num_locally_computed_tokens: int = 0
    lookup_media: list[str] = field(default_factory=list)
    max_end_block: int | None = None  # the lookup's bound (blocks), when it has one
    # vLLM 0.33's per-request caps (``kv_transfer_params``; experimental there): at most this
    # many tokens loaded past the local hit, at most this many of the request's tokens stored.
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None


class StagedOffloadingConnectorScheduler:
    def __init__(
        self, manager: StagedTieringManager, block_size: int, offload_prompt_only: bool = True, self_describing_kv_events: bool = False
    ) -> None:
        self.manager = manager
        self.block_size = block_size
        self.offload_prompt_only = offload_prompt_only
        self.self_describing_kv_events = self_describing_kv_events
        self._reqs: dict[str, StagedRequestState] = {}
        self._pending_loads: list[LoadJob] = []
        self._jobs: dict[int, LoadJob | StoreJob] = {}
        self._job_build: dict[int, int] = {}  # job id -> the build_connector_meta call it left with
        self._num_builds = 0
        self._next_job_id = 0
        self._kv_events: list[KVCacheEvent] = []
        self._orders: dict[str, list[tuple[OffloadKey, int]]] = {}  # per tier: the order last recorded
        self.events: EventLog | None = None  # the engine's EventLog, once bound
        self.use_int_hashes = True
        self.collect_kv_events = False  # set by bind(): the pool's enable_kv_cache_events
        self.group_id = 0  # set by bind(): the KV-cache group whose blocks the tiers keep
        self.group_config: GroupOffloadConfig | None = None  # set by bind(): how that group is offloaded
        # The tiers' changes as KV events (placeholders, or payloads when self-describing).
        self._events_tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(False, self_describing_kv_events))
        # Per tier, tokens served by loads (a lesson's and the bench's hit counts).
        self.num_hit_tokens: dict[str, int] = {t.medium: 0 for t in manager.tiers}
        # vLLM 0.33's metrics payload: the worker's transfers, this half's lookups and failed
        # allocations, the manager's gauges; the static facts go out with the first one.
        self._connector_stats = OffloadingConnectorStats()
        self._info_sent = False
        # Workers that copy each job (vLLM 0.33: the world size -- every tensor-parallel rank
        # moves its own heads); a job is done when all of them reported it. Until then the
        # reports so far wait here, merged, by job id.
        self.num_workers = 1
        self._partial_reports: dict[int, OffloadingWorkerMetadata] = {}

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        """Check that this half can serve ``kv_cache_manager`` and take what it reads from it.
        Refused before anything changes: a config with more than one offloaded group (kvlab's
        tiers keep one group's blocks), a group of another block size, hashes of another
        granularity, caching off."""
        config = kv_cache_manager.kv_cache_config
        groups = kv_cache_manager.kv_cache_groups
        offloaded = get_offloading_group_ids(config)
        if config.hisparse_host_num_blocks is None:
            if len(groups) != 1 or getattr(groups[0], "type_name", "full") != "full":
                raise ValueError(
                    "the offloading connector needs one full-attention KV-cache group (vLLM's connectors "
                    f"without the hybrid allocator), or a HiSparse config; got {[type(g).__name__ for g in groups]}"
                )
        elif len(offloaded) != 1:
            raise ValueError(
                f"with HiSparse the offloading connector stores the indexer group alone; this config has {len(offloaded)} "
                "HISPARSE_INDEXER groups (kvlab's tiers keep one group's blocks)"
            )
        group_id = offloaded[0]
        if groups[group_id].block_size != self.block_size:
            raise ValueError(
                f"the connector was built for block_size={self.block_size}, "
                f"the KV-cache manager's group {group_id} uses {groups[group_id].block_size}"
            )
        if kv_cache_manager.hash_block_size != self.block_size:
            raise ValueError(
                f"the connector keys one block by one block hash: the manager hashes every {kv_cache_manager.hash_block_size} "
                f"tokens, its blocks hold {self.block_size}"
            )
        if not kv_cache_manager.enable_caching:
            raise ValueError("offloading works by block hash: build the KV-cache manager with enable_caching=True")
        group = config.kv_cache_groups[group_id]
        self.group_id = group_id
        self.group_config = GroupOffloadConfig(
            group_idx=group_id,
            tokens_per_block=self.block_size,
            tokens_per_chunk=self.block_size,  # kvlab's tiers keep one block per chunk
            hashes_per_chunk=1,
            kv_event_group_spec=get_offloading_event_group_spec(group),
            sliding_window_size_in_chunks=None,  # a full-attention group (or HiSparse's indexer)
            kv_cache_spec=group.kv_cache_spec,
            manager_cls=get_manager_class(group.kv_cache_spec),
        )
        self.events = kv_cache_manager.events
        self.use_int_hashes = kv_cache_manager.block_pool.kv_events_use_int_block_hashes
        # vLLM's tiers queue KV events only when KV events are on (as the pool does): with them
        # off nobody takes the queue, and it would grow with every store for ever.
        self.collect_kv_events = kv_cache_manager.block_pool.enable_kv_cache_events
        self._events_tracker = OffloadingEventsTracker(
            OffloadingKVEventsConfig(self.collect_kv_events, self.self_describing_kv_events),
            {group_id: self.group_config.kv_event_group_spec},
            use_int_block_hashes=self.use_int_hashes,
        )
        if self.events is not None:
            self.events.record(
                "offload_tiers_created", tiers=[{"medium": t.medium, "num_blocks": t.num_blocks} for t in self.manager.tiers]
            )

    # -- helpers ---------------------------------------------------------------------------------
    def _state(self, request: Request) -> StagedRequestState:
        """The request's record; the first call is the tiers' ``on_new_request``."""
        st = self._reqs.get(request.request_id)
        if st is None or st.req is not request:
            ctx = _create_req_context(request)
            st = self._reqs[request.request_id] = StagedRequestState(request, ctx)
            st.max_load_tokens = _token_cap(ctx.kv_transfer_params, "max_load_tokens")
            st.max_offload_tokens = _token_cap(ctx.kv_transfer_params, "max_offload_tokens")
            self.manager.on_new_request(ctx)
        return st

    def _keys(self, st: StagedRequestState, start: int, end: int) -> list[OffloadKey]:
        """The offload keys of the request's blocks ``start:end``, each recorded with its
        end-token position (vLLM 0.33's policies order a request's blocks by it)."""
        bs, ctx = self.block_size, st.req_context
        keys = []
        for i, h in enumerate(st.req.block_hashes[start:end], start):
            key = make_offload_key(h, self.group_id)
            ctx.set_offload_key_position(key, (i + 1) * bs)
            keys.append(key)
        return keys

    def _job_id(self) -> int:
        self._next_job_id += 1
        return self._next_job_id

    def _drain(self) -> None:
        """Turn the tiers' queued changes into timeline events (removals) and vLLM KV events."""
        events = list(self.manager.take_events())
        if self.collect_kv_events:
            self._kv_events.extend(self._events_tracker.take_events(events))
        if self.events is None:
            return
        merged: list = []
        for ev in events:  # one line per run of same-kind removals
            last = merged[-1] if merged else None
            if last is not None and ev.removed and last.removed and (last.medium, last.reason) == (ev.medium, ev.reason):
                last.keys = last.keys + ev.keys
                last.slots = last.slots + ev.slots
            else:
                merged.append(replace(ev))  # a copy: merging must not change the tier's event
        for ev in merged:
            if ev.removed:
                hashes = [get_offload_block_hash(k) for k in ev.keys]
                self.events.record("offload_evicted", medium=ev.medium, block_hashes=hashes, chunk_ids=list(ev.slots), reason=ev.reason)

    def _record_orders(self) -> None:
        """Record each tier's eviction order where it changed since last recorded (after the
        transfers and evictions of a hook, so a replay ends on the tiers' true order)."""
        if self.events is None:
            return
        for t in self.manager.tiers:
            order = t.entries()
            if order != self._orders.get(t.medium):
                self._orders[t.medium] = order
                self.events.record(
                    "offload_tier_order",
                    medium=t.medium,
                    block_hashes=[get_offload_block_hash(k) for k, _ in order],
                    chunk_ids=[c for _, c in order],
                )

    # -- the hooks -------------------------------------------------------------------------------
    def tier_hits(self, request: Request, num_computed_tokens: int) -> list[str]:
        """The tier that serves each block after the local hit, in order, as far as the
        tiers hold the run: whole blocks, never the prompt's last token, CPU before disk,
        and not past ``max_num_new_tokens`` when the lookup is bounded (HiSparse).
        (The ``tier_hits`` exercise swaps this method.)"""
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # whole blocks, never the last token
        st = self._state(request)
        if st.max_end_block is not None:
            end = min(end, st.max_end_block)
        keys = self._keys(st, start, end)
        return self.manager.lookup_chain(keys, st.req_context) if keys else []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int, bool]:
        """The tokens the tiers can load after the local hit, whole blocks. With
        ``max_num_new_tokens`` (vLLM 0.33; the connector passes it under HiSparse) the load
        ends within that many tokens of ``num_computed_tokens``: past it a group the tiers do
        not keep holds nothing, and the loaded keys would face unwritten K/V. A request's
        ``kv_transfer_params["max_load_tokens"]`` bounds it the same way (a caller that wants
        part of a prefix recomputed, e.g. to measure)."""
        st = self._state(request)
        bounds = [n for n in (max_num_new_tokens, st.max_load_tokens) if n is not None]
        st.max_end_block = max(0, (num_computed_tokens + min(bounds)) // self.block_size) if bounds else None
        lookup_start = time.monotonic()  # observed for the metrics only; nothing decides on it
        media = self.tier_hits(request, num_computed_tokens)
        if st.max_end_block is not None:  # a swapped tier_hits may not know the bound
            media = media[: max(0, st.max_end_block - num_computed_tokens // self.block_size)]
        self._connector_stats.observe_histogram(_ConnectorMetricName.LOOKUP_SYNC_DELAY, time.monotonic() - lookup_start)
        self._drain()  # a lookup may find a file gone and drop its entry
        self._record_orders()
        st.num_locally_computed_tokens = num_computed_tokens
        st.lookup_media = media
        return len(media) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._state(request)
        bs = self.block_size
        start = st.num_locally_computed_tokens // bs
        n = num_external_tokens // bs
        st.next_stored_block_idx = max(st.next_stored_block_idx, start + n)
        if n == 0:
            return
        keys = self._keys(st, start, start + n)
        media = st.lookup_media[:n]
        # Every loaded block ends up in the CPU tier (a disk block passes through a CPU slot):
        # its payload is taken now, while the request is here to read it from.
        if self.group_config is not None:
            for i, key in enumerate(keys, start):
                self._events_tracker.record_lookup(request, self.group_config, i, key)
        items = self.manager.prepare_load(keys, media, st.req_context)
        self._drain()
        gpu_ids = [b.block_id for b in blocks.blocks[self.group_id][start : start + n]]
        job = LoadJob(self._job_id(), request.request_id, gpu_ids, items)
        self._jobs[job.job_id] = job
        self._pending_loads.append(job)
        for m in media:
            self.num_hit_tokens[m] = self.num_hit_tokens.get(m, 0) + bs
        if self.events is not None:
            self.events.record(
                "kv_transfer",
                direction="load",
                request_id=request.request_id,
                media=list(media),
                block_ids=gpu_ids,
                block_hashes=[get_offload_block_hash(k) for k in keys],
                chunk_ids=[it.cpu_slot for it in items],
                paths=[it.path or "" for it in items],
                num_tokens=n * bs,
            )
        self._record_orders()

    def _expire_stale_jobs(self) -> None:
        """Jobs of an earlier step that were never reported: that step never finished (an
        exception or an interrupt undid it). Unpin their loads and forget their stores, so
        an undone step leaves no block pinned in a tier."""
        for job_id in [j for j, b in self._job_build.items() if b < self._num_builds]:
            job = self._jobs.pop(job_id, None)
            del self._job_build[job_id]
            self._partial_reports.pop(job_id, None)  # some worker never reported it
            if isinstance(job, LoadJob):
                self.manager.complete_load(job.items, loaded=())  # none ran: no promoted slot holds its block
            elif isinstance(job, StoreJob):
                self.manager.complete_store(job.plan, success=False)
        self._drain()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The loaded tokens per tier (vLLM 0.33's split, for the prefix-cache stats): each
        block counts for the tier its lookup found it in -- host memory, or the disk even
        though it passes through a CPU slot on its way."""
        if num_external_tokens == 0:
            return {}
        st = self._state(request)
        bs = self.block_size
        out: dict[CacheHitSource, int] = {}
        for medium in st.lookup_media[: num_external_tokens // bs]:
            source = CACHE_HIT_SOURCE_OF_MEDIUM.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + bs
        return out

    def reset_cache(self) -> bool:
        """Empty the CPU tier (vLLM 0.33's ``reset_cache``; the disk tier keeps its files, as
        vLLM's does). This half's jobs finish within their step, so a job still in flight means
        a worker has not reported one yet (or the reset came in the middle of a step): then it
        says False -- not now -- and changes nothing. Running requests store their blocks again
        from the first one, as in vLLM: what they stored is gone."""
        if self._jobs or self._pending_loads:
            return False
        self.manager.reset_cache()
        self._drain()
        for st in self._reqs.values():
            st.next_stored_block_idx = 0
        self._events_tracker.reset()  # the tier is empty: pending payloads are stale
        self._record_orders()
        return True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        self._num_builds += 1
        self._expire_stale_jobs()
        for job in self._pending_loads:
            self._job_build[job.job_id] = self._num_builds
        meta = OffloadingConnectorMetadata(loads=self._pending_loads, block_size=self.block_size)
        self._pending_loads = []
        for rid, id_groups, whole in _yield_req_data(scheduler_output):
            st = self._reqs.get(rid)
            if st is None or id_groups is None:
                continue
            if whole:  # new or resumed: the whole table
                st.block_ids = list(id_groups[self.group_id])
            else:
                st.block_ids.extend(id_groups[self.group_id])
        bs = self.block_size
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.req
            after = req.num_computed_tokens + n
            limit = req.num_prompt_tokens if self.offload_prompt_only else req.num_tokens
            if st.max_offload_tokens is not None:
                limit = min(limit, st.max_offload_tokens)
            full = min(after, limit) // bs
            if full <= st.next_stored_block_idx:
                continue
            first = st.next_stored_block_idx
            keys = self._keys(st, first, full)
            st.next_stored_block_idx = full
            plan = self.manager.prepare_store(keys, st.req_context)
            self._drain()
            if plan is None:  # no unpinned room: a future miss
                self._connector_stats.increase_counter(_ConnectorMetricName.ALLOCATION_FAILURE)
                continue
            if not plan.keys:
                continue  # the tiers hold them already
            index = {k: first + i for i, k in enumerate(keys)}
            if self.group_config is not None:
                for k in plan.keys:
                    self._events_tracker.record_store(req, self.group_config, index[k], k)
            gpu_ids = [st.block_ids[index[k]] for k in plan.keys]
            store = StoreJob(self._job_id(), rid, gpu_ids, plan)
            self._jobs[store.job_id] = store
            self._job_build[store.job_id] = self._num_builds
            meta.stores.append(store)
            self._emit_store(rid, gpu_ids, plan)
        self._record_orders()
        new_req_ids = [nr.req_id for nr in scheduler_output.scheduled_new_reqs]
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids, scheduler_output.preempted_req_ids))
        return meta

    def _emit_store(self, rid: str, gpu_ids: list[int], plan: StorePlan) -> None:
        if self.events is None:
            return
        self.events.record(
            "kv_transfer",
            direction="store",
            request_id=rid,
            media=["CPU"] * len(plan.keys),
            block_ids=gpu_ids,
            block_hashes=[get_offload_block_hash(k) for k in plan.keys],
            chunk_ids=list(plan.cpu_slots),
            num_tokens=len(plan.keys) * self.block_size,
        )
        if plan.cascade_keys:
            self.events.record(
                "kv_transfer",
                direction="store",
                request_id=rid,
                media=["STORAGE"] * len(plan.cascade_keys),
                block_hashes=[get_offload_block_hash(k) for k in plan.cascade_keys],
                chunk_ids=list(plan.cascade_slots),
                paths=list(plan.cascade_paths),
                num_tokens=len(plan.cascade_keys) * self.block_size,
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, OffloadingWorkerMetadata):
            return
        if wm.block_nbytes and not self.manager.chunk_size_bytes:
            self.manager.chunk_size_bytes = wm.block_nbytes  # one chunk is one block here
            cpu = self.manager.primary
            # The CPU tier's facts, for the first metrics payload: its size in bytes. (The
            # tokens it holds at max_model_len stay unknown: the connector is not told it.)
            cpu.set_info(CPUOffloadingInfo(cpu.num_blocks, 1, cpu.num_blocks * wm.block_nbytes, None))
        self._connector_stats.aggregate(transfer_metrics(wm.transfer_stats))
        wm = self._completed(wm)
        for job_id, res in wm.loads.items():
            self._job_build.pop(job_id, None)
            job = self._jobs.pop(job_id, None)
            if isinstance(job, LoadJob):
                failed = [res.failed_key] if res.failed_key is not None else []
                loaded = [it.key for it in job.items[: res.num_loaded]]
                self.manager.complete_load(
                    job.items, failed, reason=res.reason or "load failed", loaded=loaded, transfer_time=res.read_time
                )
        for job_id, (stored, cascaded, _err) in wm.stores.items():
            self._job_build.pop(job_id, None)
            job = self._jobs.pop(job_id, None)
            if isinstance(job, StoreJob):
                self.manager.complete_store(
                    job.plan, stored, cascaded, cascade_bytes=wm.cascade_bytes.get(job_id), cascade_time=wm.cascade_time.get(job_id)
                )
        self._drain()
        self._record_orders()

    def _completed(self, wm: OffloadingWorkerMetadata) -> OffloadingWorkerMetadata:
        """The jobs of ``wm`` that every worker has now reported, each with its workers'
        results merged; the others wait in ``_partial_reports`` for the rest."""
        if self.num_workers == 1 and not self._partial_reports:
            return wm
        done = OffloadingWorkerMetadata()
        for job_id in wm.completed_jobs:
            part = wm.job(job_id)
            earlier = self._partial_reports.pop(job_id, None)
            if earlier is not None:
                part = earlier.aggregate(part)
            if part.completed_jobs[job_id] >= self.num_workers:
                done = done.aggregate(part)
            else:
                self._partial_reports[job_id] = part
        return done

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The metrics since the last call (vLLM 0.33): this half's own, then the offload
        manager's; the manager's static facts (``config_info``) ride on the first payload."""
        return collect_stats(self)

    def request_finished(self, request: Request) -> None:
        """The tiers commit what the request read and stored (vLLM 0.33: its blocks' recency)."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self.manager.on_request_finished(st.req_context)
            self._drain()
            self._record_orders()

    def take_events(self) -> list[KVCacheEvent]:
        events, self._kv_events = self._kv_events, []
        return events

    def check_invariants(self) -> None:
        """Tiers consistent, and no block pinned once every job finished (nothing leaks)."""
        self.manager.check_invariants()
        if not self._jobs and not self._pending_loads:
            for t in self.manager.tiers:
                assert not t.pinned(), f"{t.medium} tier: blocks still pinned with no job in flight: {t.pinned()}"
