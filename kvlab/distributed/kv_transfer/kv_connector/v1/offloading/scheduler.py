"""vLLM 0.33's scheduler half of the offloading connector (``OffloadingConnectorScheduler`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``; lesson 12b): built
from an offloading spec, the engine config and the KV-cache config, for any number of KV-cache
groups, over a manager that may answer asynchronously.

Per request it keeps, for each offloaded group (:class:`RequestGroupState`), the offload key
of each chunk (a chunk is ``blocks_per_chunk`` blocks, keyed by its last block hash), the
group's GPU block ids as the worker knows them and the first chunk not yet stored.

* **Lookup** (``get_num_new_matched_tokens``): past the GPU prefix hit, each full-attention
  group scans for an unbroken run of chunks the tiers hold, each window group for one usable
  window ending at the hit; every group can only shorten the hit, so the groups are asked
  again until the hit stops moving (``_lookup_complete_chunks``). A tier still looking, or a
  chunk still being written or loaded for another request, makes the request ask again next
  step (None).
* **Load** (``update_state_after_alloc``): one job for all groups, into the GPU blocks the
  scheduler just allocated; asynchronous unless it fits the step's sync-load byte budget.
* **Store** (``build_connector_meta``): per group, the chunks that became full, skipping
  those no later hit could read (a window's old chunks, Mamba states between alignments,
  a drafter group's volatile last chunk); one job per request per step.
* **Fences**: a store still copying out of a GPU block that the pool hands to someone else
  must finish first -- the worker is told to flush it (``jobs_to_flush``); likewise for a
  preempted request's jobs.
* **Completion** (``update_connector_output``): a job is done when every worker reported it.

* **Partial tails** (a Mamba "align" hybrid whose block holds several hash blocks): a hit may
  end inside a block, on a hash boundary, where every group holds a partial entry; the core
  hands the connector each saved Mamba state with its exact block
  (``SchedulerOutput.kv_connector_block_state``), stored on a chunk edge alone or, inside a
  block, with the other groups' partial entries at that boundary.

kvlab's own engine runs the in-step half (:mod:`.staged_scheduler`), whose tiers keep one group.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from kvlab.core.kv_cache_utils import eagle_proof_margin, get_manager_class
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
    TransferStats,
)
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import _group_kv_bytes_per_block
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from kvlab.kv_cache_interface import KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvlab.kv_offload.base import (
    GPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)
from kvlab.logger import init_logger
from kvlab.kv_offload.stats import OffloadingConnectorStats, _ConnectorMetricName, _TransferMetricName
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.request import RequestStatus
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheBlocks
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from kvlab.distributed.kv_events import KVCacheEvent
    from kvlab.kv_cache_interface import KVCacheConfig
    from kvlab.kv_offload.base import OffloadingSpec
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request


logger = init_logger(__name__)

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


class _StatsSource(Protocol):
    _connector_stats: OffloadingConnectorStats
    _info_sent: bool

    @property
    def manager(self) -> Any: ...


def transfer_metrics(stats: TransferStats) -> OffloadingConnectorStats:
    """The worker's transfer sizes and times as the connector's metrics (bytes and seconds
    counted per direction, each transfer's size into a histogram)."""
    out = OffloadingConnectorStats()
    for direction, (nbytes, secs, size) in (
        (stats.load, (_TransferMetricName.LOAD_BYTES, _TransferMetricName.LOAD_TIME, _TransferMetricName.LOAD_SIZE)),
        (stats.store, (_TransferMetricName.STORE_BYTES, _TransferMetricName.STORE_TIME, _TransferMetricName.STORE_SIZE)),
    ):
        if direction.is_empty():
            continue
        out.increase_counter(nbytes, direction.bytes)
        out.increase_counter(secs, direction.time)
        for n in direction.sizes:
            out.observe_histogram(size, n)
    return out


def collect_stats(half: _StatsSource) -> OffloadingConnectorStats | None:
    """A scheduler half's metrics since the last call (vLLM 0.33's ``get_stats``): its own,
    then its manager's; the manager's static facts (``config_info``) ride on the first
    payload, sent even when empty so the metric exists whenever offloading runs."""
    stats: OffloadingConnectorStats | None = None
    if not half._connector_stats.is_empty():
        stats, half._connector_stats = half._connector_stats, OffloadingConnectorStats()
    manager_stats = half.manager.get_stats()
    if manager_stats is not None:
        stats = manager_stats if stats is None else stats.aggregate(manager_stats)
    if not half._info_sent:
        if stats is None:
            stats = OffloadingConnectorStats()
        stats.set_info(half.manager.config_info())
        half._info_sent = True
    return stats


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
            window = max(window, cdiv(reach, self.tokens_per_chunk))
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
class TransferJobStatus:
    """The scheduler's record of one transfer job until every worker reported it."""

    req_id: str
    pending_count: int  # workers yet to report it; the job is done at 0
    keys: set[OffloadKey]  # what complete_store / complete_load is told
    is_store: bool
    is_sync_load: bool = False  # a load finished before the step's forward pass
    # A store's source blocks: window blocks are watched from the start (the window frees them
    # while the request runs), the others only once the request finished (until then the
    # request's own reference keeps them from being reused).
    deferred_fence_block_ids: list[int] | None = None
    fenced_block_ids: list[int] | None = None


@dataclass
class RequestGroupState:
    """One request's offload books for one KV-cache group."""

    offload_keys: list[OffloadKey] = field(default_factory=list)  # one per complete chunk
    block_ids: list[int] = field(default_factory=list)  # the group's GPU table (0: a skipped block)
    next_stored_chunk_idx: int = 0  # chunks before it were stored, or came from a cache
    num_hit_chunks: int = 0  # chunks the request found cached (GPU or tiers) when it started
    lookup_hit_end_chunk_idx: int = 0  # end of the chunks the last scan confirmed


@dataclass(slots=True)
class RequestOffloadState:
    """One request's offload books (vLLM 0.33's shape): per group, and for the request."""

    config: SchedulerOffloadConfig
    req: Request
    req_context: ReqContext
    offloading_context: RequestOffloadingContext
    group_states: tuple[RequestGroupState, ...] = field(init=False)
    max_load_tokens: int | None = None  # kv_transfer_params caps (None: no cap)
    max_offload_tokens: int | None = None
    num_locally_computed_tokens: int = 0  # the GPU prefix hit
    # In-flight jobs: one load, or any number of stores (a load waits for none).
    transfer_jobs: set[int] = field(default_factory=set)
    deferred_lookup_start_time: float | None = None  # for the async-delay histogram only
    partial_tail_boundary: int | None = None  # a partial-tail hit's end, from the lookup to the load
    loaded_from_offload: bool = False
    # (first token, end token, key) of each loaded key: what get_external_cache_hit_sources splits.
    load_key_ranges: list[tuple[int, int, OffloadKey]] = field(default_factory=list)
    finished_signaled: bool = False  # the manager was told on_request_finished

    def __post_init__(self) -> None:
        self.group_states = tuple(RequestGroupState() for _ in self.config.kv_group_configs)
        params = self.req.kv_transfer_params
        self.max_load_tokens = _token_cap(params, "max_load_tokens")
        self.max_offload_tokens = _token_cap(params, "max_offload_tokens")

    def update_offload_keys(self) -> None:
        """Key every chunk that became complete since the last call (by its last block hash),
        recording where each key's tokens end."""
        for group_config, group_state in zip(self.config.kv_group_configs, self.group_states):
            per_chunk = group_config.hashes_per_chunk
            first = per_chunk * (len(group_state.offload_keys) + 1) - 1
            for block_hash in islice(self.req.block_hashes, first, None, per_chunk):
                key = make_offload_key(block_hash, group_config.group_idx)
                group_state.offload_keys.append(key)
                self.req_context.set_offload_key_position(key, len(group_state.offload_keys) * group_config.tokens_per_chunk)

    def update_block_id_groups(self, new_block_id_groups: tuple[list[int], ...] | None) -> None:
        if new_block_id_groups is None:
            return
        for group_config, group_state in zip(self.config.kv_group_configs, self.group_states):
            group_state.block_ids.extend(new_block_id_groups[group_config.group_idx])

    def storable_chunks(self, group_config: GroupOffloadConfig, group_state: RequestGroupState, num_offloadable_tokens: int) -> int:
        """Leading chunks of the group that are computed, allocated and keyed.

        A drafter (EAGLE/MTP) group's last chunk is left out while the request decodes: a
        rejected draft may still rewrite its last position. In the prefill it is stable, and
        once the request finished nothing rewrites it. Every place that moves
        ``next_stored_chunk_idx`` must apply the same rule, or the left-out chunk would be
        stepped over and never stored -- a hole that ends every later prefix hit there."""
        num_chunks = num_offloadable_tokens // group_config.tokens_per_chunk
        decoding = num_offloadable_tokens > self.req.num_prompt_tokens
        if group_config.is_eagle_group and decoding and not self.req.is_finished():
            num_chunks = max(0, num_chunks - 1)
        allocated = len(group_state.block_ids) // self.config.blocks_per_chunk
        return min(num_chunks, allocated, len(group_state.offload_keys))

    def advance_stored_idx(self, num_offloadable_tokens: int) -> None:
        # Never backwards: a drafter group's storable count drops by one when decoding starts.
        for group_config, group_state in zip(self.config.kv_group_configs, self.group_states):
            group_state.next_stored_chunk_idx = max(
                group_state.next_stored_chunk_idx, self.storable_chunks(group_config, group_state, num_offloadable_tokens)
            )

    def update_num_hit_chunks(self, num_cached_tokens: int) -> None:
        for group_config, group_state in zip(self.config.kv_group_configs, self.group_states):
            group_state.num_hit_chunks = num_cached_tokens // group_config.tokens_per_chunk


def _round_down(a: int, b: int) -> int:
    return a - a % b


# A cache reset's fence held this long is logged once (a log line; nothing decides on it).
_RESET_FENCE_WARN_S = 60


class OffloadingConnectorScheduler:
    """vLLM 0.33's scheduler half (see the module docstring)."""

    # The manager lock held for the whole of one schedule() (opened by its first hook that
    # touches the manager, closed at the end of build_connector_meta), or None between steps.
    # On the class, so a half built without __init__ (vLLM's unit tests) reads None.
    _step_region: ExitStack | None = None

    def __init__(self, spec: OffloadingSpec, vllm_config: Any, kv_cache_config: KVCacheConfig) -> None:
        self.config = SchedulerOffloadConfig.from_spec(spec, vllm_config, kv_cache_config)
        self.manager: OffloadingManager = spec.get_manager()
        self._connector_stats = OffloadingConnectorStats()
        self._info_sent = False  # the static facts ride on the first stats payload

        configs = self.config.kv_group_configs
        full = [i for i, c in enumerate(configs) if c.sliding_window_size_in_chunks is None]
        # Window groups widest first: the widest window is the likeliest to shorten the hit.
        windows = sorted(
            (i for i, c in enumerate(configs) if c.sliding_window_size_in_chunks is not None),
            key=lambda i: configs[i].sliding_window_size_in_chunks or 0,
            reverse=True,
        )
        self._full_attention_groups: tuple[int, ...] = tuple(full)
        self._sliding_window_groups: tuple[int, ...] = tuple(windows)
        self._lookup_groups = self._full_attention_groups + self._sliding_window_groups
        self._mamba_align_size = resolve_mamba_align_size(spec, kv_cache_config)
        self._cow_source_groups = frozenset(c.group_idx for c in configs if c.requires_cow_source)
        # Partial tails (one block per chunk, one block size): a hit may end inside a block,
        # on any hash boundary. An EAGLE group's partial entry is keyed past the boundary by
        # the margin core's prefix cache matches it and drops (the "proof").
        self._partial_tail_block_size = configs[0].tokens_per_block if self.config.supports_partial_tail else 0
        alignment = kv_cache_config.cache_hit_alignment_tokens
        fine_hits = alignment is not None and alignment < self._partial_tail_block_size
        self._eagle_proof_margins: dict[int, int] = {
            c.group_idx: eagle_proof_margin(
                self._partial_tail_block_size, self.config.tokens_per_hash, fine_hits and c.manager_cls.supports_fine_grained_hash_lookup
            )
            for c in configs
            if self.config.supports_partial_tail and c.is_eagle_group and not c.requires_cow_source
        }
        self._max_eagle_proof_margin = max(self._eagle_proof_margins.values(), default=0)

        self._req_status: dict[str, RequestOffloadState] = {}
        # This step's loads, sync loads (and their bytes), jobs the workers must flush, and
        # GPU blocks the pool handed out (a pending store reading one of them must finish first).
        self._current_batch_load_jobs: dict[int, TransferJob] = {}
        self._current_batch_sync_loads: set[str] = set()
        self._current_batch_sync_load_bytes = 0
        self._current_batch_jobs_to_flush: set[int] = set()
        self._current_batch_allocated_block_ids: set[int] = set()
        # Keys being loaded asynchronously; with GPU prefix caching on, another request that
        # needs one of them waits for that load rather than loading the chunk twice.
        self._chunks_being_loaded: set[OffloadKey] | None = set() if vllm_config.cache_config.enable_prefix_caching else None

        self._job_counter = 0  # one counter for loads and stores
        self._stale_job_threshold = 0  # ids below it were issued before the last cache reset
        # A cache reset releases every in-flight job's chunks at once, but a worker may still
        # be writing them: job id -> reports still due. The manager hears on_reset_flushed()
        # once all came in.
        self._reset_fence: dict[int, int] = {}
        self._reset_fence_since = 0.0
        self._jobs: dict[int, TransferJobStatus] = {}
        # GPU block id -> stores still reading it: a reused block's stores are flushed first.
        self._block_id_to_pending_jobs: dict[int, set[int]] = {}
        self._events_tracker = OffloadingEventsTracker(spec.kv_events_config, {c.group_idx: c.kv_event_group_spec for c in configs})

    # -- the manager lock -------------------------------------------------------------------------
    # A manager may be polled by a thread of its own. schedule() holds the lock for the whole
    # step: a lookup's HIT in get_num_new_matched_tokens must still hold when
    # update_state_after_alloc pins it with prepare_load, and prepare_store evicts after both.
    # Hooks outside schedule() hold it only for their own call.
    def _acquire_step(self) -> None:
        if self._step_region is not None:
            return
        region = ExitStack()
        region.enter_context(self.manager.lock)
        self._step_region = region

    def _release_step(self) -> None:
        region, self._step_region = self._step_region, None
        if region is not None:
            region.close()

    @contextmanager
    def _manager_locked(self) -> Iterator[None]:
        """The lock for one hook outside schedule(). Finding the step's region still open
        means a schedule() raised before build_connector_meta: release it, do not deadlock."""
        if self._step_region is not None:
            logger.error("Offloading manager lock was left held by a previous schedule(); releasing it before continuing.")
            self._release_step()
        with self.manager.lock:
            yield

    # -- small helpers ----------------------------------------------------------------------------
    def _maybe_observe_lookup_async_delay(self, req_status: RequestOffloadState) -> None:
        start = req_status.deferred_lookup_start_time
        if start is not None:
            req_status.deferred_lookup_start_time = None
            self._connector_stats.observe_histogram(_ConnectorMetricName.LOOKUP_ASYNC_DELAY, time.monotonic() - start)

    def _generate_job_id(self) -> int:
        job_id = self._job_counter
        self._job_counter += 1
        return job_id

    def _remove_pending_job(self, job_id: int, block_ids: list[int] | None) -> None:
        for bid in block_ids or ():
            pending = self._block_id_to_pending_jobs[bid]
            pending.remove(job_id)
            if not pending:
                del self._block_id_to_pending_jobs[bid]

    def _calc_num_offloadable_tokens(self, req_status: RequestOffloadState, num_computed_tokens: int) -> int:
        num = min(num_computed_tokens, req_status.req.num_tokens)
        if req_status.max_offload_tokens is not None:
            num = min(num, req_status.max_offload_tokens)
        if self.config.offload_prompt_only:
            num = min(num, req_status.req.num_prompt_tokens)
        return num

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

    # -- lookup -----------------------------------------------------------------------------------
    def _lookup_complete_chunks(self, req_status: RequestOffloadState, max_num_new_tokens: int | None = None) -> int | None:
        """How many tokens past the GPU hit every group can load, in whole chunks (0: none;
        None: ask again next step).

        Full-attention groups scan first (a prefix), then window groups (a window ending at
        the hit). Each group can only lower the bound; when one lowers it below what an
        earlier group confirmed, the groups whose answer depended on the old bound are asked
        again, until the hit stops moving. A drafter (EAGLE) group is asked one chunk further
        and gives that chunk back (its last chunk is never loaded), once per bound."""
        computed = req_status.num_locally_computed_tokens
        req = req_status.req
        bound = req.num_tokens
        if max_num_new_tokens is not None:
            bound = min(bound, computed + max_num_new_tokens)
        if req_status.max_load_tokens is not None:
            bound = min(bound, computed + req_status.max_load_tokens)
        if self._sliding_window_groups:
            # A window group recomputes the prompt's last token (for its logprobs); leave one
            # token so the hit survives that.
            bound -= 1
            if self._mamba_align_size is not None:
                bound = _round_down(bound, self._mamba_align_size)

        num_hit_tokens = 0
        defer = False
        for state in req_status.group_states:
            state.lookup_hit_end_chunk_idx = 0
        eagle_verified: set[int] = set()  # drafter groups that gave back their chunk at this bound
        to_ask = self._lookup_groups
        while to_ask:
            asked_window = False
            groups, to_ask = to_ask, ()
            for idx in groups:
                gc = self.config.kv_group_configs[idx]
                gs = req_status.group_states[idx]
                chunk = gc.tokens_per_chunk
                keys = gs.offload_keys
                assert len(keys) >= req.num_tokens // chunk
                unverified_eagle = gc.is_eagle_group and idx not in eagle_verified
                bound = min(bound, len(keys) * chunk)
                if req_status.max_load_tokens is not None:
                    bound = _round_down(bound, chunk)
                if bound - computed < chunk:
                    return 0  # less than a chunk left to load
                window = gc.sliding_window_size_in_chunks
                # A drafter group asks one chunk more, which it gives back; without the extra
                # chunk, giving one back could drop the hit below a coarser group's chunk edge.
                query_end = min(bound + chunk, len(keys) * chunk) if unverified_eagle else bound
                num_chunks = min(cdiv(query_end, chunk), len(keys))
                start = computed // chunk
                asked = keys[start:num_chunks]
                found: int | None
                if window is None:
                    found = self._maximal_prefix_lookup(asked, req_status.req_context, req, gc, start)
                    gs.lookup_hit_end_chunk_idx = start + (found or 0)
                else:
                    need = window + int(unverified_eagle)
                    candidate_end = min(bound, (num_chunks - int(unverified_eagle)) * chunk)
                    initial = gc.load_window_size_in_chunks(candidate_end)
                    assert initial is not None
                    found = self._sliding_window_lookup(asked, need, req_status.req_context, initial + int(unverified_eagle))
                if found == 0:
                    return 0
                if found is None:
                    defer = True
                else:
                    if unverified_eagle:
                        found -= 1
                        eagle_verified.add(idx)
                    bound = min(bound, chunk * (start + found))
                new_hit = bound - computed
                if new_hit < chunk:
                    return 0
                if new_hit < num_hit_tokens:
                    if not gc.is_eagle_group:
                        eagle_verified.clear()  # a new bound: each drafter gives back again
                    if defer:
                        defer = False  # ask every group again: the wait may be moot now
                        to_ask = self._lookup_groups
                    elif asked_window and not to_ask:
                        to_ask = self._sliding_window_groups  # confirm the windows at the new bound
                asked_window = asked_window or window is not None
                num_hit_tokens = new_hit

        if defer:
            logger.debug("Offloading manager delayed request %s as backend requested", req.request_id)
            return None
        if self._chunks_being_loaded:
            # A chunk of this hit is being loaded for another request: wait for it.
            end = computed + num_hit_tokens
            for gc, gs in zip(self.config.kv_group_configs, req_status.group_states):
                chunk = gc.tokens_per_chunk
                keys = gs.offload_keys[computed // chunk : cdiv(end, chunk)]
                window = gc.load_window_size_in_chunks(end)
                if window is not None:
                    keys = keys[-window:]
                if any(k in self._chunks_being_loaded for k in keys):
                    logger.debug("Delaying request %s since some of its chunks are already being loaded", req.request_id)
                    return None
        logger.debug("Request %s hit %s offloaded tokens after %s GPU hit tokens", req.request_id, num_hit_tokens, computed)
        return num_hit_tokens

    def _lookup(self, req_status: RequestOffloadState, max_num_new_tokens: int | None = None) -> int | None:
        """The request's hit past its GPU hit: whole chunks, then -- with partial tails -- the
        furthest hash boundary inside the next block (or the one after it, for an EAGLE
        proof) at which every group holds a partial entry."""
        complete_hit = self._lookup_complete_chunks(req_status, max_num_new_tokens)
        req_status.partial_tail_boundary = None
        if complete_hit is None or not self.config.supports_partial_tail:
            return complete_hit
        local = req_status.num_locally_computed_tokens
        req = req_status.req
        complete_end = local + complete_hit
        per_hash = self.config.tokens_per_hash
        block = self._partial_tail_block_size
        blocks_searched = 2 if self._max_eagle_proof_margin else 1
        max_boundary = min(req.num_prompt_tokens - 1, complete_end + blocks_searched * block - 1)
        if self._max_eagle_proof_margin:  # the proof key needs a hash past the boundary
            max_boundary = min(max_boundary, len(req.block_hashes) * per_hash - self._max_eagle_proof_margin)
        if max_num_new_tokens is not None:
            max_boundary = min(max_boundary, local + max_num_new_tokens)
        if req_status.max_load_tokens is not None:
            max_boundary = min(max_boundary, local + req_status.max_load_tokens)
        max_boundary = _round_down(max_boundary, per_hash)
        if max_boundary <= complete_end:
            return complete_hit
        # A boundary past the block the complete hit ends in also loads that block's whole
        # chunk (the "bridge"): asked once, and only when needed.
        bridge_idx = complete_end // block
        bridge_end = (bridge_idx + 1) * block
        unconfirmed: list[tuple[GroupOffloadConfig, OffloadKey]] = []
        pending = False
        if max_boundary >= bridge_end:
            for gc, gs in zip(self.config.kv_group_configs, req_status.group_states):
                if gc.requires_cow_source:
                    continue
                key = gs.offload_keys[bridge_idx]
                pending |= key in (self._chunks_being_loaded or ())
                if gs.lookup_hit_end_chunk_idx <= bridge_idx:  # an EAGLE group confirmed the chunk it gave back
                    unconfirmed.append((gc, key))
            for _, key in unconfirmed:
                answer = self.manager.lookup(key, req_status.req_context)
                if answer is LookupResult.MISS:
                    max_boundary = bridge_end - per_hash
                    break
                pending |= answer is not LookupResult.HIT
        bridge_pending = pending
        for boundary in range(max_boundary, complete_end, -per_hash):
            loads_bridge = boundary >= bridge_end
            hit, boundary_pending = self._lookup_partial_tail(req_status, boundary, loads_bridge and bridge_pending)
            if hit:
                if loads_bridge:
                    for gc, key in unconfirmed:
                        self._events_tracker.record_lookup(req, gc, bridge_idx, key)
                req_status.partial_tail_boundary = boundary
                return boundary - local
            pending |= boundary_pending
        if pending and complete_hit == 0:
            return None
        return complete_hit

    def _partial_tail_key_tokens(self, group_config: GroupOffloadConfig, boundary: int) -> int:
        """The token whose hash keys a group's partial entry (an EAGLE group's: past the boundary)."""
        return boundary + self._eagle_proof_margins.get(group_config.group_idx, 0)

    def _lookup_partial_tail(self, req_status: RequestOffloadState, boundary: int, bridge_pending: bool) -> tuple[bool, bool]:
        """``(every group's partial entry at boundary is ready, something asked is not ready
        yet)``; ``bridge_pending``: a whole chunk the hit would also load is not ready."""
        req, ctx = req_status.req, req_status.req_context
        pending = bridge_pending
        found: list[tuple[GroupOffloadConfig, int, OffloadKey]] = []
        for gc in self.config.kv_group_configs:
            tokens = self._partial_tail_key_tokens(gc, boundary)
            key = self._make_boundary_key(req, gc.group_idx, tokens, ctx)
            answer = self.manager.lookup(key, ctx)
            if answer is LookupResult.MISS:
                return False, pending
            pending |= answer is not LookupResult.HIT
            found.append((gc, tokens, key))
        if pending:
            return False, True
        for gc, tokens, key in found:
            self._events_tracker.record_partial_lookup(req, gc, tokens, key)
        return True, False

    # -- the hooks --------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        req_context = _create_req_context(request)
        with self._manager_locked():
            offloading_context = self.manager.on_new_request(req_context)
        self._req_status[request.request_id] = RequestOffloadState(
            config=self.config, req=request, req_context=req_context, offloading_context=offloading_context
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        """``(tokens the tiers can load past num_computed_tokens, load asynchronously)``;
        ``(None, False)``: ask again next step (a tier still looking, a chunk still being
        written or loaded, or the request's own jobs still in flight)."""
        self._acquire_step()  # the step's first manager hook; build_connector_meta releases it
        req_status = self._req_status[request.request_id]
        for gs in req_status.group_states:
            gs.block_ids.clear()
            gs.next_stored_chunk_idx = 0  # the request (re)starts at token 0
        if req_status.transfer_jobs:
            logger.debug("Delaying request %s since it still has in-flight transfers", request.request_id)
            return None, False
        req_status.update_offload_keys()
        req_status.num_locally_computed_tokens = num_computed_tokens
        num_hit_tokens: int | None
        if request.skip_reading_prefix_cache:
            num_hit_tokens = 0
        else:
            started = time.monotonic()  # for the metrics only
            num_hit_tokens = self._lookup(req_status, max_num_new_tokens)
            self._connector_stats.observe_histogram(_ConnectorMetricName.LOOKUP_SYNC_DELAY, time.monotonic() - started)
            if num_hit_tokens is None:
                if req_status.deferred_lookup_start_time is None:
                    req_status.deferred_lookup_start_time = started
            else:
                self._maybe_observe_lookup_async_delay(req_status)
        req_status.update_num_hit_chunks(num_computed_tokens + (num_hit_tokens or 0))
        sync = self._reserve_sync_load(req_status, num_computed_tokens, num_hit_tokens)
        return num_hit_tokens, bool(num_hit_tokens) and not sync

    def _reserve_sync_load(self, req_status: RequestOffloadState, num_computed_tokens: int, num_hit_tokens: int | None) -> bool:
        """Take the hit out of this step's sync-load byte budget when it fits: such a load is
        done before the forward pass, so the request runs this step instead of waiting one."""
        req_id = req_status.req.request_id
        self._current_batch_sync_loads.discard(req_id)
        if (
            not self.config.sync_load_budget_bytes
            or not num_hit_tokens
            or num_computed_tokens + num_hit_tokens >= req_status.req.num_tokens  # nothing left to compute
        ):
            return False
        num_bytes = num_hit_tokens * self.config.kv_bytes_per_token  # over-counts window and Mamba groups
        if self._current_batch_sync_load_bytes + num_bytes > self.config.sync_load_budget_bytes:
            return False
        self._current_batch_sync_load_bytes += num_bytes
        self._current_batch_sync_loads.add(req_id)
        return True

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The loaded tokens split by the tier each came from. An attention key covers its own
        tokens, a Mamba state the whole loaded range; where keys overlap the outermost tier
        counts; tokens no loaded key covers (a window's skipped history) are
        ``external_unspecified``."""
        sources: dict[CacheHitSource, int] = {}
        if num_external_tokens == 0:
            return sources
        req_status = self._req_status[request.request_id]
        start = req_status.num_locally_computed_tokens
        end = start + num_external_tokens
        edges: list[tuple[int, int, CacheHitSource]] = [(end, 0, CacheHitSource.EXTERNAL_UNSPECIFIED)]
        for lo, hi, key in req_status.load_key_ranges:
            lo, hi = max(start, lo), min(end, hi)
            if lo < hi:
                source = CacheHitSource(self.manager.get_load_source(key, req_status.req_context))
                edges += [(lo, 1, source), (hi, -1, source)]
        open_ranges: Counter[CacheHitSource] = Counter()
        at = start
        for pos, delta, source in sorted(edges):  # one sweep over the range ends
            if pos > at:
                live = [s for s, n in open_ranges.items() if n > 0]
                tier = CacheHitSource.outermost(live) if live else CacheHitSource.EXTERNAL_UNSPECIFIED
                sources[tier] = sources.get(tier, 0) + pos - at
            open_ranges[source] += delta
            at = pos
        return sources

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the hit into the blocks the scheduler just allocated: one job over
        every group (``GPULoadStoreSpec``: the blocks group after group, with each group's
        count and its first block's index in the request's table)."""
        # Every allocated block is noted, hit or not: a pending store reading a reused block
        # must be flushed (with other connectors beside this one, too).
        for group_blocks in blocks.blocks:
            self._current_batch_allocated_block_ids.update(b.block_id for b in group_blocks if b.block_id != 0)
        if num_external_tokens == 0:
            return
        self._acquire_step()  # prepare_load pins what the lookup of this step saw
        req_status = self._req_status[request.request_id]
        req_status.loaded_from_offload = True
        sync = request.request_id in self._current_batch_sync_loads
        computed = req_status.num_locally_computed_tokens
        cached = computed + num_external_tokens
        tail = req_status.partial_tail_boundary
        assert tail is None or tail == cached
        keys_to_load: list[OffloadKey] = []
        req_status.load_key_ranges.clear()
        dst_block_ids: list[int] = []
        group_sizes: list[int] = []
        block_indices: list[int] = []
        for gc, gs in zip(self.config.kv_group_configs, req_status.group_states):
            group_blocks = blocks.blocks[gc.group_idx]
            per_block = gc.tokens_per_block
            chunk = gc.tokens_per_chunk
            num_gpu_blocks = cdiv(cached, per_block)
            assert len(group_blocks) >= num_gpu_blocks
            assert computed % per_block == 0
            # The load starts at the first fresh block after the GPU hit: skip nulls (a window's
            # or Mamba's unused positions) and, unless the load is synchronous (its blocks are
            # hashed when allocated), blocks that already hold a hash. A sparse group may hold
            # a real unhashed block below the hit, so the search starts at the hit, not at 0.
            load_start = num_gpu_blocks
            for i in range(cdiv(computed, per_block), num_gpu_blocks):
                block = group_blocks[i]
                if not block.is_null and (sync or block.block_hash is None):
                    load_start = i
                    break
            num_pending = num_gpu_blocks - load_start
            if gc.sliding_window_size_in_chunks is not None:
                assert num_pending <= gc.sliding_window_size_in_chunks * self.config.blocks_per_chunk + 1
            num_chunks = cdiv(cached, chunk)
            if num_pending:
                first_chunk = load_start // self.config.blocks_per_chunk
                end_chunk = num_chunks - (tail is not None)  # a partial last block loads its own entry
                assert len(gs.offload_keys) >= end_chunk
                group_keys = gs.offload_keys[first_chunk:end_chunk]
                if tail is not None:
                    group_keys.append(
                        self._make_boundary_key(request, gc.group_idx, self._partial_tail_key_tokens(gc, tail), req_status.req_context)
                    )
                keys_to_load += group_keys
                if isinstance(gc.kv_cache_spec, MambaSpec):
                    req_status.load_key_ranges += [(computed, cached, k) for k in group_keys]
                else:
                    for ci, key in enumerate(group_keys, first_chunk):
                        lo = max(load_start * per_block, ci * chunk)
                        req_status.load_key_ranges.append((lo, min(cached, (ci + 1) * chunk), key))
            dst_block_ids += [b.block_id for b in group_blocks[load_start:num_gpu_blocks]]
            group_sizes.append(num_pending)
            block_indices.append(load_start)
            # Chunk-level policy: the hit's chunks are not stored again. Request-level: every
            # chunk of the request is offered (the index stays where it was).
            if req_status.offloading_context.policy == OffloadPolicy.CHUNK_LEVEL:
                gs.next_stored_chunk_idx = num_chunks

        src_spec = self.manager.prepare_load(keys_to_load, req_status.req_context)
        dst_spec = GPULoadStoreSpec(dst_block_ids, group_sizes=group_sizes, block_indices=block_indices)
        job_id = self._generate_job_id()
        self._current_batch_load_jobs[job_id] = TransferJob(req_id=request.request_id, src_spec=src_spec, dst_spec=dst_spec, sync=sync)
        assert not req_status.transfer_jobs  # a load is issued only with nothing else in flight
        req_status.transfer_jobs.add(job_id)
        self._jobs[job_id] = TransferJobStatus(
            req_id=request.request_id,
            pending_count=self.config.num_workers,
            keys=set(keys_to_load),
            is_store=False,
            is_sync_load=sync,
        )
        if self._chunks_being_loaded is not None and not sync:  # a sync load is done before anyone asks
            self._chunks_being_loaded.update(keys_to_load)
        req_status.partial_tail_boundary = None

    def _update_req_states(self, scheduler_output: SchedulerOutput) -> None:
        """Take the step's block tables; zero window blocks that the pool reused since
        (freed behind the window, handed out again: storing them now would copy someone
        else's K/V)."""
        old_ends: dict[str, tuple[int, ...]] = {}  # window groups' table lengths before this step's blocks
        for req_id, block_id_groups, is_full_table in _yield_req_data(scheduler_output):
            req_status = self._req_status[req_id]
            req_status.update_offload_keys()
            if is_full_table:
                for gs in req_status.group_states:
                    gs.block_ids.clear()
            if block_id_groups:
                if self._sliding_window_groups:
                    old_ends[req_id] = tuple(len(req_status.group_states[g].block_ids) for g in self._sliding_window_groups)
                req_status.update_block_id_groups(block_id_groups)
                for gc in self.config.kv_group_configs:
                    self._current_batch_allocated_block_ids.update(b for b in block_id_groups[gc.group_idx] if b != 0)
        for copy in scheduler_output.kv_cache_block_copies or ():
            self._current_batch_allocated_block_ids.add(copy.dst_block_id)
        if not (self._sliding_window_groups and self._current_batch_allocated_block_ids):
            return
        per_chunk = self.config.blocks_per_chunk
        reused = self._current_batch_allocated_block_ids
        for req_id, req_status in self._req_status.items():
            ends = old_ends.get(req_id)
            for i, g in enumerate(self._sliding_window_groups):
                gs = req_status.group_states[g]
                end = ends[i] if ends is not None else len(gs.block_ids)
                for j in range(gs.next_stored_chunk_idx * per_chunk, end):  # stored before it; fresh after it
                    if gs.block_ids[j] in reused:
                        gs.block_ids[j] = 0

    def _reachable_store_block_mask(
        self,
        group_config: GroupOffloadConfig,
        start_chunk_idx: int,
        end_chunk_idx: int,
        final_segment_end_chunk_idx: int | None,
        reachable_boundaries: tuple[int, ...],
    ) -> list[bool] | None:
        """Which blocks of chunks ``[start, end)`` a later hit could read (None: all), by the
        group manager's own rule."""
        per_chunk = self.config.blocks_per_chunk
        spec = group_config.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec) and spec.extra_retained_tokens:
            # An offload restores every block the window kept, the extra ones included: widen
            # the mask's window, not the model's.
            spec = replace(spec, sliding_window=spec.sliding_window + spec.extra_retained_tokens, extra_retained_tokens=0)
        return group_config.manager_cls.reachable_block_mask(
            start_block=start_chunk_idx * per_chunk,
            end_block=end_chunk_idx * per_chunk,
            alignment_tokens=self.config.alignment_tokens,
            kv_cache_spec=spec,
            use_eagle=group_config.is_eagle_group,
            retention_interval=self.config.retention_interval,
            reachable_boundaries=reachable_boundaries,
            dcp_world_size=self.config.dcp_world_size,
            final_segment_end_block=None if final_segment_end_chunk_idx is None else final_segment_end_chunk_idx * per_chunk,
        )

    def _final_swa_alignment_blocks(self, group_config: GroupOffloadConfig) -> int | None:
        """The alignment in blocks of a non-drafter window group's final tail, when it is whole blocks."""
        align = self.config.alignment_tokens
        if (
            align is None
            or group_config.is_eagle_group
            or not isinstance(group_config.kv_cache_spec, SlidingWindowSpec)
            or align % group_config.tokens_per_block
        ):
            return None
        return align // group_config.tokens_per_block

    def _make_boundary_key(self, request: Request, group_idx: int, boundary_tokens: int, req_context: ReqContext) -> OffloadKey:
        """The key of a state (or partial block) that ends at ``boundary_tokens``: the block
        hash at that token, with the group, its end position recorded."""
        key = make_offload_key(request.block_hashes[boundary_tokens // self.config.tokens_per_hash - 1], group_idx)
        req_context.set_offload_key_position(key, boundary_tokens)
        return key

    def _build_aligned_boundary_store_jobs(self, handoffs: dict[str, list[tuple[int, int, int]]]) -> dict[int, TransferJob]:
        """Store each Mamba "align" state the core handed off that ends on a chunk edge: from
        the exact block the core names (after a copy-on-write the request's own table no
        longer shows it), one job per state, fenced at once (the block may be reused soon)."""
        store_jobs: dict[int, TransferJob] = {}
        num_groups = len(self.config.kv_group_configs)
        config_idx = {c.group_idx: i for i, c in enumerate(self.config.kv_group_configs)}
        for req_id, entries in handoffs.items():
            req_status = self._req_status.get(req_id)
            if req_status is None:
                continue
            req = req_status.req
            max_boundary = self._calc_num_offloadable_tokens(req_status, req.num_tokens)
            for group_idx, block_id, boundary in entries:
                idx = config_idx.get(group_idx)
                if idx is None:
                    continue  # a group this spec does not offload
                gc = self.config.kv_group_configs[idx]
                if block_id == 0 or boundary > max_boundary or boundary % gc.tokens_per_chunk:
                    continue
                key = self._make_boundary_key(req, group_idx, boundary, req_status.req_context)
                store_output = self.manager.prepare_store([key], req_status.req_context)
                if store_output is None:
                    self._connector_stats.increase_counter(_ConnectorMetricName.ALLOCATION_FAILURE)
                    continue
                if not store_output.keys_to_store:
                    continue
                job_id = self._generate_job_id()
                req_status.transfer_jobs.add(job_id)
                self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job_id)
                self._jobs[job_id] = TransferJobStatus(
                    req_id=req_id, pending_count=self.config.num_workers, keys={key}, is_store=True, fenced_block_ids=[block_id]
                )
                group_sizes = [0] * num_groups
                group_sizes[idx] = 1
                block_indices = [0] * num_groups
                block_indices[idx] = boundary // gc.tokens_per_block - 1
                store_jobs[job_id] = TransferJob(
                    req_id=req_id,
                    src_spec=GPULoadStoreSpec([block_id], group_sizes=group_sizes, block_indices=block_indices),
                    dst_spec=store_output.store_spec,
                )
                self._events_tracker.record_store(req, gc, boundary // gc.tokens_per_chunk - 1, key)
        return store_jobs

    def _build_partial_tail_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[int, TransferJob]:
        """The stores of the states the core handed off this step (vLLM 0.33): those on a chunk
        edge alone; with partial tails, those inside a block too -- one job per request storing
        every group's partial entry at that boundary: a Mamba group's from the block the core
        copied the state into, the others' from the request's block that holds the boundary."""
        block_state = scheduler_output.kv_connector_block_state
        handoffs = block_state.boundary_state_offloads if block_state else None
        if not handoffs:
            return {}
        store_jobs = self._build_aligned_boundary_store_jobs(handoffs)
        if not self.config.supports_partial_tail:
            return store_jobs
        block = self._partial_tail_block_size
        configs = self.config.kv_group_configs
        for req_id, all_entries in handoffs.items():
            entries = [e for e in all_entries if e[2] % block]
            if not entries:
                continue
            req_status = self._req_status.get(req_id)
            assert req_status is not None
            if self._max_eagle_proof_margin and not req_status.loaded_from_offload:
                continue  # its EAGLE tail stays in the GPU prefix cache
            (boundary,) = {b for _, _, b in entries}
            req = req_status.req
            states = {gc.group_idx: gs for gc, gs in zip(configs, req_status.group_states)}
            assert 0 < boundary <= min(req.num_prompt_tokens, req_status.max_offload_tokens or req.num_prompt_tokens)
            assert boundary % self.config.tokens_per_hash == 0
            if self._max_eagle_proof_margin:
                # The hand-off comes once, on the step that computes the prompt past the
                # boundary; the store runs after this step's forward pass, so the proof must
                # be computed by then.
                computed_after = min(req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0), req.num_prompt_tokens)
                if boundary + self._max_eagle_proof_margin > computed_after:
                    continue
            cow_blocks = {g: bid for g, bid, _ in entries}
            assert self._cow_source_groups <= cow_blocks.keys()
            block_idx = boundary // block
            if any(gc.group_idx not in self._cow_source_groups and block_idx >= len(states[gc.group_idx].block_ids) for gc in configs):
                continue
            key_tokens = [self._partial_tail_key_tokens(gc, boundary) for gc in configs]
            keys = [self._make_boundary_key(req, gc.group_idx, t, req_status.req_context) for gc, t in zip(configs, key_tokens)]
            block_ids = [
                cow_blocks[gc.group_idx] if gc.group_idx in self._cow_source_groups else states[gc.group_idx].block_ids[block_idx]
                for gc in configs
            ]
            assert 0 not in block_ids
            store_output = self.manager.prepare_store(keys, req_status.req_context)
            if store_output is None:
                self._connector_stats.increase_counter(_ConnectorMetricName.ALLOCATION_FAILURE)
                continue
            if not store_output.keys_to_store:
                continue
            for gc, tokens, key in zip(configs, key_tokens, keys):
                if key in store_output.keys_to_store:
                    self._events_tracker.record_partial_store(req, gc, tokens, key)
            position = {key: i for i, key in enumerate(keys)}
            accepted = [position[key] for key in store_output.keys_to_store]
            group_sizes = [0] * len(configs)
            block_indices = [0] * len(configs)
            for i in accepted:
                group_sizes[i] = 1
                block_indices[i] = block_idx
            sources = [block_ids[i] for i in accepted]
            job_id = self._generate_job_id()
            req_status.transfer_jobs.add(job_id)
            for bid in sources:
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
            self._jobs[job_id] = TransferJobStatus(
                req_id=req_id,
                pending_count=self.config.num_workers,
                keys=set(store_output.keys_to_store),
                is_store=True,
                fenced_block_ids=sources,
            )
            store_jobs[job_id] = TransferJob(
                req_id=req_id,
                src_spec=GPULoadStoreSpec(sources, group_sizes=group_sizes, block_indices=block_indices),
                dst_spec=store_output.store_spec,
            )
        return store_jobs

    def _build_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[int, TransferJob]:
        """One store job per request with chunks that became storable in this step (the
        scheduled requests, and those that finished since the last step)."""
        per_chunk = self.config.blocks_per_chunk
        store_jobs: dict[int, TransferJob] = {}
        for req_id in chain(scheduler_output.num_scheduled_tokens, scheduler_output.finished_req_ids or ()):
            req_status = self._req_status.get(req_id)
            if req_status is None:
                continue
            req = req_status.req
            if req.status is RequestStatus.FINISHED_ABORTED:
                after = req.num_computed_tokens
            elif req.is_finished():
                # The last sampled token's slot is never committed to the prefix cache (under
                # speculative decoding it may hold a rejected draft): a block ending there is not stored.
                after = max(req.num_prompt_tokens, req.num_tokens - 1)
            else:
                after = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
            offloadable = self._calc_num_offloadable_tokens(req_status, after)
            prompt_offloadable = self._calc_num_offloadable_tokens(req_status, req.num_prompt_tokens)
            boundaries: tuple[int, ...] = ()
            if self.config.retention_interval is not None:
                boundaries = (req.num_prompt_tokens - 1,)
                if req.shared_prefix_boundary:
                    boundaries += (req.shared_prefix_boundary,)

            new_keys: list[OffloadKey] = []
            ranges: list[tuple[int, int]] = []  # per group: (first chunk, end chunk) considered
            for gc, gs in zip(self.config.kv_group_configs, req_status.group_states):
                num_chunks = req_status.storable_chunks(gc, gs, offloadable)
                start = gs.next_stored_chunk_idx
                prompt_chunks = prompt_offloadable // gc.tokens_per_chunk
                tail_align = self._final_swa_alignment_blocks(gc)
                # A finished request's last window segment may be reachable now that its end
                # is known: look at it again.
                revisit_tail = (
                    req.is_finished() and num_chunks != prompt_chunks and self.config.retention_interval is None and tail_align is not None
                )
                horizon: int | None
                if self.config.retention_interval is not None or gc.is_eagle_group:
                    horizon = None
                elif req.is_finished():
                    horizon = num_chunks
                elif num_chunks <= prompt_chunks:
                    horizon = prompt_chunks
                else:
                    horizon = None  # a decode frontier is no request boundary
                if revisit_tail:
                    assert tail_align is not None
                    horizon_blocks = num_chunks * per_chunk
                    start = min(start, (horizon_blocks - horizon_blocks % tail_align) // per_chunk)
                ranges.append((start, num_chunks))
                if gc.requires_cow_source or num_chunks <= start:
                    continue
                keys = gs.offload_keys[start:num_chunks]
                # Each chunk is stored from its last block (ids 1 5 6 | 7 2 4 -> 6, 4); a 0 is a
                # block the group skipped or the pool reused.
                last_blocks = gs.block_ids[start * per_chunk + per_chunk - 1 : num_chunks * per_chunk : per_chunk]
                assert len(keys) == len(last_blocks)
                mask = self._reachable_store_block_mask(gc, start, num_chunks, horizon, boundaries)
                prompt_mask = self._reachable_store_block_mask(gc, start, num_chunks, prompt_chunks, boundaries) if revisit_tail else None
                for k, (key, block_id) in enumerate(zip(keys, last_blocks)):
                    if block_id == 0:
                        continue
                    chunk_idx = start + k
                    blocks_of = range(k * per_chunk, (k + 1) * per_chunk)
                    if (
                        revisit_tail
                        and chunk_idx < gs.next_stored_chunk_idx
                        and (prompt_mask is None or any(prompt_mask[b] for b in blocks_of))
                    ):
                        continue  # stored (or skipped for good) already
                    if mask is not None and not any(mask[b] for b in blocks_of):
                        continue  # no later hit reads any of its blocks
                    first_block = chunk_idx * per_chunk
                    if any(gs.block_ids[first_block + b] == 0 and (mask is None or mask[k * per_chunk + b]) for b in range(per_chunk)):
                        continue  # a reachable block is missing: the chunk would be stored half written
                    new_keys.append(key)

            if not new_keys:
                req_status.advance_stored_idx(offloadable)
                continue
            store_output = self.manager.prepare_store(new_keys, req_status.req_context)
            if store_output is None:
                self._connector_stats.increase_counter(_ConnectorMetricName.ALLOCATION_FAILURE)
                logger.warning("Request %s: cannot store chunks", req_id)
                continue
            if not store_output.keys_to_store:
                req_status.advance_stored_idx(offloadable)
                continue
            to_store = set(store_output.keys_to_store)
            group_sizes: list[int] = []
            block_indices: list[int] = []
            src_block_ids: list[int] = []
            fenced: list[int] = []
            deferred: list[int] = []
            for gc, gs, (start, num_chunks) in zip(self.config.kv_group_configs, req_status.group_states, ranges):
                window = gc.sliding_window_size_in_chunks is not None
                count = 0
                first: int | None = None
                for chunk_idx, key in enumerate(gs.offload_keys[start:num_chunks], start):
                    if key not in to_store:
                        continue
                    self._events_tracker.record_store(req, gc, chunk_idx, key)
                    for b in range(chunk_idx * per_chunk, (chunk_idx + 1) * per_chunk):
                        block_id = gs.block_ids[b]
                        if block_id == 0:
                            continue
                        if first is None:
                            first = b
                        src_block_ids.append(block_id)
                        count += 1
                        (fenced if window else deferred).append(block_id)
                group_sizes.append(count)
                block_indices.append(first or 0)
                gs.next_stored_chunk_idx = max(gs.next_stored_chunk_idx, num_chunks)

            job_id = self._generate_job_id()
            if req_status.transfer_jobs:  # a store is issued beside stores or a sync load only
                other = self._jobs[next(iter(req_status.transfer_jobs))]
                assert other.is_store or other.is_sync_load
            req_status.transfer_jobs.add(job_id)
            for bid in fenced:  # window blocks may be freed while the request runs: watch them now
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
            self._jobs[job_id] = TransferJobStatus(
                req_id=req_id,
                pending_count=self.config.num_workers,
                keys=to_store,
                is_store=True,
                deferred_fence_block_ids=deferred,
                fenced_block_ids=fenced or None,
            )
            store_jobs[job_id] = TransferJob(
                req_id=req_id,
                src_spec=GPULoadStoreSpec(src_block_ids, group_sizes=group_sizes, block_indices=block_indices),
                dst_spec=store_output.store_spec,
            )
            logger.debug("Request %s offloading %s chunks upto %d tokens (job %d)", req_id, len(to_store), offloadable, job_id)
            if req.is_finished():
                # Its other blocks are free now too: watch them, and flush at once if the pool
                # already handed one out in this step.
                for bid in deferred:
                    self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
                    if bid in self._current_batch_allocated_block_ids:
                        self._current_batch_jobs_to_flush.add(job_id)
        return store_jobs

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        self._acquire_step()  # a step that scheduled nothing reaches here first
        try:
            return self._build_connector_meta(scheduler_output)
        finally:
            self._release_step()  # the step is over: the manager is free while the model runs

    def _build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        if self._reset_fence and time.monotonic() - self._reset_fence_since > _RESET_FENCE_WARN_S:
            logger.warning_once(
                "KV offloading: workers have not reported %d jobs a cache reset flushed for over %d s",
                len(self._reset_fence),
                _RESET_FENCE_WARN_S,
            )
        self._update_req_states(scheduler_output)
        end_context = ScheduleEndContext(
            new_req_ids=[r.req_id for r in scheduler_output.scheduled_new_reqs],
            preempted_req_ids=scheduler_output.preempted_req_ids or (),
        )
        # A preempted request's jobs finish before its blocks go to anyone else (loads issued
        # in this very step -- a cache reset can preempt and reload at once -- are not sent yet).
        for req_id in scheduler_output.preempted_req_ids or ():
            req_status = self._req_status.get(req_id)
            if req_status is None:
                continue
            flush = req_status.transfer_jobs - self._current_batch_load_jobs.keys()
            if flush:
                job = self._jobs[next(iter(flush))]
                assert job.is_store or job.is_sync_load
                self._current_batch_jobs_to_flush |= flush
        # So do stores reading a block the pool handed out in this step.
        allocated = self._current_batch_allocated_block_ids
        if self._block_id_to_pending_jobs and not self._block_id_to_pending_jobs.keys().isdisjoint(allocated):
            self._current_batch_jobs_to_flush.update(
                jid for bid in allocated if bid in self._block_id_to_pending_jobs for jid in self._block_id_to_pending_jobs[bid]
            )
        boundary_jobs = self._build_partial_tail_store_jobs(scheduler_output)  # first: ids in vLLM's order
        meta = OffloadingConnectorMetadata(
            load_jobs=self._current_batch_load_jobs,
            store_jobs=boundary_jobs | self._build_store_jobs(scheduler_output),
            jobs_to_flush=self._current_batch_jobs_to_flush,
        )
        # Every store of a finished request is issued: tell the manager, and drop the books of
        # those with nothing in flight.
        for req_id in scheduler_output.finished_req_ids or ():
            req_status = self._req_status.get(req_id)
            if req_status is None:
                continue
            req_status.finished_signaled = True
            self.manager.on_request_finished(req_status.req_context)
            if not req_status.transfer_jobs:
                del self._req_status[req_id]
        self._current_batch_load_jobs = {}
        self._current_batch_sync_loads = set()
        self._current_batch_sync_load_bytes = 0
        self._current_batch_jobs_to_flush = set()
        self._current_batch_allocated_block_ids = set()
        self.manager.on_schedule_end(end_context)  # the step's last manager call
        return meta

    def has_pending_push_work(self) -> bool:
        """Whether the engine must keep stepping with nothing scheduled: jobs in flight, a
        cache reset's fence, or work the manager still has. Takes the lock for this call
        only: the engine asks before schedule(), and may not schedule at all."""
        if self._jobs or self._reset_fence:
            return True
        with self._manager_locked():
            return self.manager.has_pending_work()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        with self._manager_locked():
            self._update_connector_output(connector_output)

    def _update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, OffloadingWorkerMetadata):
            if meta is not None:
                raise TypeError(f"kv_connector_worker_meta must be an OffloadingWorkerMetadata or None, got {type(meta).__name__}")
            meta = OffloadingWorkerMetadata()
        self._connector_stats.aggregate(transfer_metrics(meta.transfer_stats))

        for job_id, count in meta.completed_jobs.items():
            assert count > 0
            if job_id < self._stale_job_threshold:  # issued before a cache reset
                if job_id in self._reset_fence:
                    self._reset_fence[job_id] -= count
                    if self._reset_fence[job_id] <= 0:
                        del self._reset_fence[job_id]
                        if not self._reset_fence:
                            self.manager.on_reset_flushed()
                            logger.info("KV offloading: workers reported every job the cache reset flushed")
                continue
            job = self._jobs[job_id]
            job.pending_count -= count
            if job.pending_count > 0:
                continue  # other workers still copy their part
            assert job.pending_count == 0
            req_status = self._req_status[job.req_id]
            if job.is_store:
                self.manager.complete_store(job.keys, req_status.req_context)
            else:
                self.manager.complete_load(job.keys, req_status.req_context)
                if self._chunks_being_loaded:
                    self._chunks_being_loaded.difference_update(job.keys)
            if self._block_id_to_pending_jobs:
                self._remove_pending_job(job_id, job.fenced_block_ids)
                if req_status.req.is_finished():  # the other blocks are watched only after the finish
                    self._remove_pending_job(job_id, job.deferred_fence_block_ids)
            del self._jobs[job_id]
            req_status.transfer_jobs.remove(job_id)
            if req_status.finished_signaled and not req_status.transfer_jobs:
                del self._req_status[job.req_id]

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._manager_locked():
            return collect_stats(self)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The request finished; its blocks are about to be freed. Its last stores are built
        at the next step (its books stay until then); its blocks free at once -- a store still
        reading one is flushed when the pool reuses it."""
        req_status = self._req_status.get(request.request_id)
        if req_status is None:  # never tracked: nothing in flight, nothing deferred
            ctx = _create_req_context(request)
            with self._manager_locked():
                self.manager.on_new_request(ctx)
                self.manager.on_request_finished(ctx)
            return False, None
        self._maybe_observe_lookup_async_delay(req_status)
        req_status.update_offload_keys()  # the final block hash keys the last chunk
        for job_id in req_status.transfer_jobs:
            for bid in self._jobs[job_id].deferred_fence_block_ids or ():
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' changes as KV events. The manager's queue is drained at once, under the
        lock (a lazy drain would hold the lock while the caller iterates)."""
        with self._manager_locked():
            manager_events = list(self.manager.take_events())
        yield from self._events_tracker.take_events(manager_events)

    def reset_cache(self) -> None:
        """Empty the tiers. In-flight jobs are flushed and forgotten; their late reports are
        recognised by id and fence the manager until every worker made them."""
        assert not self._current_batch_load_jobs, "reset_cache in the middle of a step"
        assert not self._current_batch_sync_loads
        assert not self._current_batch_jobs_to_flush
        assert not self._current_batch_allocated_block_ids
        with self._manager_locked():
            self._reset_cache()

    def _reset_cache(self) -> None:
        self._current_batch_jobs_to_flush.update(self._jobs)  # delivered with the next step
        for req_id, status in list(self._req_status.items()):
            if status.req.is_finished():
                if not status.finished_signaled:
                    self.manager.on_request_finished(status.req_context)
                del self._req_status[req_id]
        self.manager.reset_cache()
        for status in self._req_status.values():  # running requests store again from chunk 0
            for gs in status.group_states:
                gs.next_stored_chunk_idx = 0
            status.transfer_jobs.clear()
            status.partial_tail_boundary = None
        self._stale_job_threshold = self._job_counter
        if self._jobs:
            self._reset_fence.update((job_id, job.pending_count) for job_id, job in self._jobs.items())
            self._reset_fence_since = time.monotonic()
            logger.info("KV offloading: waiting for workers to report %d jobs flushed by the cache reset", len(self._reset_fence))
        elif not self._reset_fence:
            self.manager.on_reset_flushed()
        self._jobs.clear()
        self._block_id_to_pending_jobs.clear()
        self._events_tracker.reset()  # the pool is empty: pending payloads are stale
        if self._chunks_being_loaded is not None:
            self._chunks_being_loaded.clear()

    def shutdown(self) -> None:
        self.manager.shutdown()


def _yield_req_data(scheduler_output: SchedulerOutput) -> Iterator[tuple[str, tuple[list[int], ...] | None, bool]]:
    """``(req_id, block id groups, whole table?)`` for every scheduled request: the new and
    resumed ones with their whole table, the running ones with this step's new blocks."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, new_ids, req_id in cached.resumed_req_ids
