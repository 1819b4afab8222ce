"""The offloading connector's scheduler half (vLLM: ``OffloadingConnectorScheduler`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``; lesson 12).

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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from kvlab.distributed.kv_events import KVCacheEvent
from kvlab.core.kv_cache_utils import get_manager_class
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import _group_kv_bytes_per_block, get_offloading_group_ids
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from kvlab.kv_cache_interface import KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    LoadJob,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    StoreJob,
)
from kvlab.kv_offload.cpu.common import CPUOffloadingInfo
from kvlab.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
    OffloadingKVEventsConfig,
    get_offload_block_hash,
    make_offload_key,
)
from kvlab.kv_offload.stats import OffloadingConnectorStats, _ConnectorMetricName, _TransferMetricName
from kvlab.kv_offload.tiering.staged import StorePlan, StagedTieringManager

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from kvlab.kv_cache_interface import KVCacheConfig
    from kvlab.kv_offload.base import OffloadingSpec
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request
    from kvlab.eventlog.events import EventLog


logger = logging.getLogger(__name__)

#: The ``kv_transfer_params`` entry that limits which tiers may serve a request's loads
#: (vLLM 0.33): a list of matchers, e.g. ``[{"medium": "cpu"}]`` -- host memory only.
KV_LOAD_TIERS_KEY = "kv_load_tiers"
MATCHER_MEDIUM_KEY = "medium"
MATCHER_LOCALITY_KEY = "locality"


_E = TypeVar("_E", Medium, Locality)


def _enum_or_none(enum_cls: type[_E], raw: Any) -> _E | None:
    """``enum_cls`` named by ``raw`` in any case; None for a value it does not name."""
    try:
        return enum_cls(raw.upper())
    except (ValueError, AttributeError):
        return None


def _parse_tier_filter(raw: Any) -> TierFilter:
    """The :class:`TierFilter` that ``kv_transfer_params["kv_load_tiers"]`` asks for.

    Each entry is a dict with an optional ``"medium"`` (CPU or STORAGE) and ``"locality"``
    (LOCAL or REMOTE), any case; a missing one matches every tier. The parameter comes from
    a client, so nothing here fails the request: a malformed entry is skipped with a
    warning, and when nothing usable is left -- or ``raw`` is not a list -- every tier may
    serve (``TierFilter.ALL``), as if the parameter were absent. Only an explicit empty list
    means "no tier": the request then loads nothing and computes its whole prompt."""
    if not isinstance(raw, list):
        logger.warning("%s must be a list of matcher dicts, got %s; ignoring it", KV_LOAD_TIERS_KEY, type(raw).__name__)
        return TierFilter.ALL
    matchers: list[TierMatcher] = []
    for entry in raw:
        if not isinstance(entry, dict):
            logger.warning("%s: entry %r is not a dict; skipping it", KV_LOAD_TIERS_KEY, entry)
            continue
        raw_medium, raw_locality = entry.get(MATCHER_MEDIUM_KEY), entry.get(MATCHER_LOCALITY_KEY)
        medium = None if raw_medium is None else _enum_or_none(Medium, raw_medium)
        if raw_medium is not None and medium is None:
            logger.warning(
                "%s: unknown medium %r (one of %s); skipping the entry", KV_LOAD_TIERS_KEY, raw_medium, [m.value for m in Medium]
            )
            continue
        locality = None if raw_locality is None else _enum_or_none(Locality, raw_locality)
        if raw_locality is not None and locality is None:
            logger.warning(
                "%s: unknown locality %r (one of %s); skipping the entry", KV_LOAD_TIERS_KEY, raw_locality, [x.value for x in Locality]
            )
            continue
        matchers.append(TierMatcher(medium=medium, locality=locality))
    if matchers:
        return TierFilter(matchers=tuple(matchers))
    return TierFilter(matchers=()) if not raw else TierFilter.ALL


def _create_req_context(req: Request) -> ReqContext:
    """The tiers' record of ``req``: its id, its ``kv_transfer_params`` and hints, and the
    tiers it may load from (``kv_load_tiers``; every tier when it is absent)."""
    params = getattr(req, "kv_transfer_params", None)
    raw = params.get(KV_LOAD_TIERS_KEY) if params else None
    return ReqContext(
        req_id=req.request_id,
        kv_transfer_params=params,
        kv_hints=getattr(req, "kv_hints", None),
        load_tier_filter=TierFilter.ALL if raw is None else _parse_tier_filter(raw),
    )


def _token_cap(params: Any, name: str) -> int | None:
    """``params[name]`` when it is a non-negative int (a bool is not one), else None; a value
    of another kind is logged and ignored, as vLLM 0.33 does -- a request is never refused
    for a hint."""
    raw = params.get(name) if params else None
    if type(raw) is int and raw >= 0:
        return raw
    if raw is not None:
        logger.warning("%s must be a non-negative int, got %r; ignoring", name, raw)
    return None


class GroupOffloadConfig(NamedTuple):
    """How the scheduler half offloads one KV-cache group (vLLM 0.33)."""

    group_idx: int  # the group's index in the KVCacheConfig
    tokens_per_block: int
    tokens_per_chunk: int  # a tier's unit: blocks_per_chunk blocks
    hashes_per_chunk: int  # block hashes per chunk; a chunk's key is its last one's
    kv_event_group_spec: OffloadingEventGroupSpec  # what its KV events say of the group
    sliding_window_size_in_chunks: int | None  # chunks a request still reads; None: full attention
    kv_cache_spec: KVCacheSpec
    manager_cls: type[SingleTypeKVCacheManager]  # the manager that runs the group (its hit rule)
    requires_cow_source: bool = False  # a Mamba "align" group: a partial tail is copied from a CoW source
    is_eagle_group: bool = False  # a drafter's group: its last chunk is volatile, never stored or loaded

    def load_window_size_in_chunks(self, num_tokens: int) -> int | None:
        """The chunks a load of ``num_tokens`` tokens must fill in this group (None: all).
        A window's hit ends at the hit, not at the chunk edge the lookup rounded up to, so
        the window may start up to a chunk further left: one more chunk may be needed."""
        window = self.sliding_window_size_in_chunks
        spec = self.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            assert window is not None
            pad = -num_tokens % self.tokens_per_chunk
            reach = spec.sliding_window - 1 + spec.extra_retained_tokens + pad
            window = max(window, -(-reach // self.tokens_per_chunk))
        return window


def resolve_mamba_align_size(spec: OffloadingSpec, kv_cache_config: KVCacheConfig) -> int | None:
    """The chunk, in tokens, that a hit on a Mamba group in "align" mode must be a multiple
    of (its state is saved only at chunk edges); None when no such group is offloaded. Every
    such group must agree."""
    size: int | None = None
    for group in spec.config.groups:
        kv_spec = kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec
        if isinstance(kv_spec, MambaSpec) and kv_spec.mamba_cache_mode == "align":
            chunk = group.tokens_per_block * spec.blocks_per_chunk
            if size is not None and size != chunk:
                raise AssertionError(f"Mamba groups in align mode disagree on their offload chunk: {size} and {chunk} tokens")
            size = chunk
    return size


class SchedulerOffloadConfig(NamedTuple):
    """The scheduler half's view of the offload (vLLM 0.33): one :class:`GroupOffloadConfig`
    per offloaded group, and what applies to all of them."""

    kv_group_configs: tuple[GroupOffloadConfig, ...]
    blocks_per_chunk: int
    tokens_per_hash: int
    num_workers: int  # a transfer is done when every worker reported it
    offload_prompt_only: bool
    supports_partial_tail: bool  # a prompt's last, partial block may be offloaded too
    alignment_tokens: int | None = None  # loads end on multiples of this (the full-attention chunk)
    retention_interval: int | None = None
    dcp_world_size: int = 1
    sync_load_budget_bytes: int = 0  # KV bytes per step one worker may load before the forward pass (0: none)
    kv_bytes_per_token: int = 0  # KV bytes per token on one worker, over the offloaded groups

    @classmethod
    def from_spec(cls, spec: OffloadingSpec, vllm_config: Any, kv_cache_config: KVCacheConfig) -> SchedulerOffloadConfig:
        per_chunk = spec.blocks_per_chunk
        # Loads end on a full-attention chunk edge (a window block earlier in a chunk can
        # never serve a hit). Models with no full-attention group fall back to their largest
        # chunk, so a retention interval still has a grain.
        full_chunks = {g.tokens_per_block * per_chunk for g in spec.config.groups if g.sliding_window_size_in_chunks is None}
        alignment: int | None = None
        if len(full_chunks) == 1:
            (alignment,) = full_chunks
        elif not full_chunks and spec.tokens_per_block:
            alignment = max(t * per_chunk for t in spec.tokens_per_block)
        retention = vllm_config.cache_config.prefix_cache_retention_interval
        eagle_groups = {g.group_id for g in spec.config.groups if kv_cache_config.kv_cache_groups[g.group_id].is_eagle_group}
        configs = []
        for group in spec.config.groups:
            kv_group = kv_cache_config.kv_cache_groups[group.group_id]
            kv_spec = kv_group.kv_cache_spec
            chunk = group.tokens_per_block * per_chunk
            configs.append(
                GroupOffloadConfig(
                    group_idx=group.group_id,
                    tokens_per_block=group.tokens_per_block,
                    tokens_per_chunk=chunk,
                    hashes_per_chunk=chunk // spec.tokens_per_hash,
                    sliding_window_size_in_chunks=group.sliding_window_size_in_chunks,
                    kv_cache_spec=kv_spec,
                    manager_cls=get_manager_class(kv_spec),
                    kv_event_group_spec=get_offloading_event_group_spec(kv_group),
                    is_eagle_group=group.group_id in eagle_groups,
                    requires_cow_source=isinstance(kv_spec, MambaSpec) and kv_spec.mamba_cache_mode == "align",
                )
            )
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        # A partial tail needs one block per chunk, one block size, no window group but the
        # Mamba ones that copy their tail, a Mamba group whose block is split by hashes, no DCP.
        partial_tail = (
            per_chunk == 1
            and len({c.tokens_per_block for c in configs}) == 1
            and any(c.requires_cow_source and c.tokens_per_block > spec.tokens_per_hash for c in configs)
            and all(c.sliding_window_size_in_chunks is None or c.requires_cow_source for c in configs)
            and dcp == 1
        )
        if retention is not None:
            if retention < 0:
                raise ValueError(f"prefix_cache_retention_interval ({retention}) must be non-negative.")
            for c in configs:
                if c.sliding_window_size_in_chunks is not None and retention % c.tokens_per_chunk:
                    raise ValueError(
                        f"prefix_cache_retention_interval ({retention}) must be a multiple of tokens_per_chunk ({c.tokens_per_chunk})."
                    )
        return cls(
            kv_group_configs=tuple(configs),
            blocks_per_chunk=per_chunk,
            tokens_per_hash=spec.tokens_per_hash,
            num_workers=vllm_config.parallel_config.world_size,
            offload_prompt_only=spec.offload_prompt_only,
            supports_partial_tail=partial_tail,
            alignment_tokens=alignment,
            retention_interval=retention,
            dcp_world_size=dcp,
            sync_load_budget_bytes=int(spec.extra_config.get("sync_load_budget_bytes", 0)),
            kv_bytes_per_token=sum(
                _group_kv_bytes_per_block(kv_cache_config.kv_cache_groups[g.group_id]) // g.tokens_per_block for g in spec.config.groups
            ),
        )


@dataclass(slots=True)
class RequestOffloadState:
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


class OffloadingConnectorScheduler:
    def __init__(
        self, manager: StagedTieringManager, block_size: int, offload_prompt_only: bool = True, self_describing_kv_events: bool = False
    ) -> None:
        self.manager = manager
        self.block_size = block_size
        self.offload_prompt_only = offload_prompt_only
        self.self_describing_kv_events = self_describing_kv_events
        self._reqs: dict[str, RequestOffloadState] = {}
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
    def _state(self, request: Request) -> RequestOffloadState:
        """The request's record; the first call is the tiers' ``on_new_request``."""
        st = self._reqs.get(request.request_id)
        if st is None or st.req is not request:
            ctx = _create_req_context(request)
            st = self._reqs[request.request_id] = RequestOffloadState(request, ctx)
            st.max_load_tokens = _token_cap(ctx.kv_transfer_params, "max_load_tokens")
            st.max_offload_tokens = _token_cap(ctx.kv_transfer_params, "max_offload_tokens")
            self.manager.on_new_request(ctx)
        return st

    def _keys(self, st: RequestOffloadState, start: int, end: int) -> list[OffloadKey]:
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

    # -- vLLM 0.33's two scans over a tier's answers ----------------------------------------------
    def _maximal_prefix_lookup(
        self, keys: Iterable[OffloadKey], req_context: ReqContext, req: Request, group_config: GroupOffloadConfig, start_chunk_idx: int
    ) -> int | None:
        """How many of ``keys``, from the first on, the tiers hold: a full-attention group can
        load only an unbroken prefix, so the first MISS ends the scan. Returns None when the
        request must ask again next step -- a chunk still being written (HIT_PENDING) or a
        tier still looking (RETRY). Those do not stop the scan: asking about the later keys
        is what starts their promotions in this step rather than one step per chunk.

        Every chunk found (ready or pending) has its payload kept by the events tracker
        while the request is alive, so its later ``BlockStored`` can describe its tokens.
        kvlab's in-step tiers answer only HIT or MISS; vLLM's asynchronous ones all four.
        (Lesson 12b's ``promotion_scan`` exercise is this scan.)"""
        hits, wait = 0, False
        for i, key in enumerate(keys):
            answer = self.manager.lookup(key, req_context)
            if answer is LookupResult.MISS:
                break
            if answer is LookupResult.RETRY:
                wait = True
                continue
            self._events_tracker.record_lookup(req, group_config, start_chunk_idx + i, key)
            hits += 1
            wait = wait or answer is LookupResult.HIT_PENDING
        return None if wait else hits

    def _sliding_window_lookup(
        self, keys: Sequence[OffloadKey], sliding_window_size: int, req_context: ReqContext, initial_window_size: int | None = None
    ) -> int | None:
        """Where the last usable window of ``keys`` ends: a sliding-window group needs only
        the ``sliding_window_size`` chunks before the point it resumes from, so the scan runs
        from the end and stops at the first run that long (the run ending at the last key
        may need ``initial_window_size`` instead, when the last chunk is partial). Returns
        that run's end index; with no such run, the run of hits at the very start (which
        needs no chunk before it) -- 0 when the first key misses. None when a chunk of the
        run found is still being written, or when any tier is still looking: ask again.

        A RETRY or MISS breaks the run, and after it only full windows count."""
        wait = pending = False
        run = 0
        need = initial_window_size or sliding_window_size
        for idx in range(len(keys) - 1, -1, -1):
            answer = self.manager.lookup(keys[idx], req_context)
            if answer is LookupResult.HIT or answer is LookupResult.HIT_PENDING:
                run += 1
                pending = pending or answer is LookupResult.HIT_PENDING
            else:
                wait = wait or answer is LookupResult.RETRY
                run, pending, need = 0, False, sliding_window_size
            if run == need:
                return None if wait or pending else idx + need
        return None if wait or pending else run

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        self._num_builds += 1
        self._expire_stale_jobs()
        for job in self._pending_loads:
            self._job_build[job.job_id] = self._num_builds
        meta = OffloadingConnectorMetadata(loads=self._pending_loads, block_size=self.block_size)
        self._pending_loads = []
        for nr in scheduler_output.scheduled_new_reqs:  # new or resumed: the whole table
            st = self._reqs.get(nr.req_id)
            if st is not None:
                st.block_ids = list(nr.block_ids[self.group_id])
        c = scheduler_output.scheduled_cached_reqs
        for rid, new_ids in zip(c.req_ids, c.new_block_ids):
            st = self._reqs.get(rid)
            if st is not None and new_ids is not None:
                st.block_ids.extend(new_ids[self.group_id])
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
        wm = connector_output.worker_meta
        if not isinstance(wm, OffloadingWorkerMetadata):
            return
        if wm.block_nbytes and not self.manager.chunk_size_bytes:
            self.manager.chunk_size_bytes = wm.block_nbytes  # one chunk is one block here
            cpu = self.manager.primary
            # The CPU tier's facts, for the first metrics payload: its size in bytes. (The
            # tokens it holds at max_model_len stay unknown: the connector is not told it.)
            cpu.set_info(CPUOffloadingInfo(cpu.num_blocks, 1, cpu.num_blocks * wm.block_nbytes, None))
        ts = wm.transfer_stats
        if not ts.is_empty():
            transfer = OffloadingConnectorStats()
            for d, (nbytes, secs, size) in (
                (ts.load, (_TransferMetricName.LOAD_BYTES, _TransferMetricName.LOAD_TIME, _TransferMetricName.LOAD_SIZE)),
                (ts.store, (_TransferMetricName.STORE_BYTES, _TransferMetricName.STORE_TIME, _TransferMetricName.STORE_SIZE)),
            ):
                if d.is_empty():
                    continue
                transfer.increase_counter(nbytes, d.bytes)
                transfer.increase_counter(secs, d.time)
                for n in d.sizes:
                    transfer.observe_histogram(size, n)
            self._connector_stats.aggregate(transfer)
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
        stats: OffloadingConnectorStats | None = None
        if not self._connector_stats.is_empty():
            stats, self._connector_stats = self._connector_stats, OffloadingConnectorStats()
        manager_stats = self.manager.get_stats()
        if manager_stats is not None:
            stats = manager_stats if stats is None else stats.aggregate(manager_stats)
        if not self._info_sent:
            if stats is None:
                stats = OffloadingConnectorStats()
            stats.set_info(self.manager.config_info())
            self._info_sent = True
        return stats

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
