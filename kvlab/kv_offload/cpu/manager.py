"""The CPU tier's books (vLLM 0.33: ``CPUOffloadingManager`` in ``vllm/v1/kv_offload/cpu/manager.py``).

``num_chunks`` chunks of host memory, each holding one GPU block's KV for every layer.
Chunks are handed out fresh in order (0, 1, 2, ...) until the tier is full, then reused
from the freed ones, last freed first -- vLLM's chunk pool. The manager keeps the shared
rules -- reference counts (a chunk being written is not readable, a chunk being read is
pinned), the chunk pool, events, admission -- and leaves the rest to a **cache policy**
picked by name (``cache_policy="lru"`` or ``"arc"``, :mod:`kvlab.kv_offload.cpu.policies`):
how chunks are ordered and which leaves when room is needed.

What a request did is gathered per request (in its :class:`ReqContext`) and handed to the
policy once it finishes (``on_request_finished``): which keys it met, head to tail, which it
only stored and which ready chunks it reused -- ARC's frequency counts reuse, not storage.

``store_threshold`` >= 2 admits a block only once it was offered that many times (a
bounded tracker of ``max_tracker_size`` keys counts the offers): one-off prompts then never
displace the tier's reused blocks.

kvlab adds what the lessons and the engine's undo need: ``remove`` (drop entries that went
bad, with a reason), ``num_storable``, ``entries``/``pinned``/``check_invariants``, and
:class:`SlotWrites` (below).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvlab.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from kvlab.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo, CPUOffloadingMetrics
from kvlab.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
from kvlab.kv_offload.cpu.policies.factory import CachePolicyFactory
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.utils.checks import check_int
from kvlab.metrics.cache_hit_source import CacheHitSource


def _check_key(name: str, key: object) -> None:
    if not isinstance(key, bytes) or len(key) <= 4:
        raise TypeError(
            f"{name} must be an offload key (bytes: a block hash + its 4-byte group, make_offload_key), "
            f"got {type(key).__name__} {key!r:.60}"
        )


def _check_keys(name: str, keys: object) -> list[OffloadKey]:
    """``keys`` as a list, every one an offload key -- checked before a tier changes."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Iterable):
        raise TypeError(
            f"{name} must be a list of offload keys, got {type(keys).__name__} {keys!r:.60}"
            + (" (wrap a single key in a list)" if isinstance(keys, bytes) else "")
        )
    keys = list(keys)
    for i, k in enumerate(keys):
        _check_key(f"{name}[{i}]", k)
    return keys


def _context(req_context: ReqContext | None) -> ReqContext:
    """A call for no request (kvlab allows it) acts for an anonymous one."""
    if req_context is None:
        return ReqContext(req_id="")
    if not isinstance(req_context, ReqContext):
        raise TypeError(f"req_context must be a ReqContext or None, got {type(req_context).__name__}")
    return req_context


@dataclass(slots=True)
class _RequestCacheAccess:
    """The keys one request met in this tier, per group in the order met, and how: stored
    by it, ready chunks it reused, offers the tier lacked. Kept in the request's context."""

    cache_generation: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen_keys: set[OffloadKey] = field(default_factory=set)
    inserted_keys: set[OffloadKey] = field(default_factory=set)
    reused_keys: set[OffloadKey] = field(default_factory=set)
    store_miss_keys: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class SlotWrites:
    """Which block each CPU slot was last handed out to be written with.

    The worker's copies into a slot cannot be taken back, so neither can this record: an
    undone step restores the tier's books (``kvlab.core.transaction.restore_scheduler``) but not the slots' bytes,
    and a restored entry whose slot the undone step gave to another block reads that
    block's KV -- a wrong answer, not a miss. This record is what stays true after the
    undo; a copy of the books shares it (``__deepcopy__``), so ``restore`` keeps it."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: dict[int, OffloadKey] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> SlotWrites:
        return self


class CPUOffloadingManager(OffloadingManager):
    """A tier of ``num_chunks`` chunks with a pluggable cache policy: the CPU tier, and (with
    files behind its chunks) kvlab's storage tier.

    Its chunks are bytes the worker writes, so it also remembers which block each chunk was
    last given to (:class:`SlotWrites`): an entry whose chunk was given to another block
    since -- by a step that was then undone -- is dropped at lookup (a miss) or when the
    block is offered again (it is stored afresh)."""

    medium: Medium | str = Medium.CPU.value
    _tracks_slot_writes = True

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
    ) -> None:
        self._num_chunks = check_int("num_chunks", num_chunks, 0)  # 0: a tier sized to nothing (every store refused)
        self._config_info: ConfigInfoMapping = {}
        self.set_info(info)
        if not isinstance(cache_policy, str):
            raise TypeError(f"cache_policy must be a policy name (str), got {type(cache_policy).__name__}")
        self.store_threshold = check_int("store_threshold", store_threshold, 0)
        self.max_tracker_size = check_int("max_tracker_size", max_tracker_size, 1)
        policy_cls = CachePolicyFactory.get_cache_policy_cls(cache_policy, cache_policy_module_path)
        self._policy: CachePolicy = policy_cls(cache_capacity=self._num_chunks)
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._num_allocated_chunks = 0
        self._free_list: list[int] = []
        self._num_evictable_cache_chunks = 0  # ref_cnt == 0
        self._num_write_pending_chunks = 0  # ref_cnt == -1
        self._cache_generation = 0
        self.stores_skipped_in_current_batch = 0
        self.allocation_sizes_in_current_batch: list[int] = []
        # Offers per key, least recently offered first (admission with store_threshold >= 2).
        self.counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        self.slot_writes = SlotWrites()

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """The facts of the one cache this manager holds (empty when built without ``info``)."""
        return [self._config_info]

    def set_info(self, info: CPUOffloadingInfo | None) -> None:
        """The facts ``config_info`` publishes. vLLM passes them at construction, from the
        offloading spec; kvlab's connector builds this tier before any tensor exists and
        sets them once the worker's first report says how many bytes a block takes."""
        if info is not None and not isinstance(info, CPUOffloadingInfo):
            raise TypeError(f"info must be None or a CPUOffloadingInfo, got {type(info).__name__}")
        self._config_info = info.as_config_info() if info is not None else {}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """This tier's metrics since the last call (vLLM 0.33's names): how full it is (chunks
        in use, not evictable, over all chunks), the part of that being written and the part
        readable, the size of each store's allocation, and -- with ``store_threshold`` >= 2 --
        the stores turned away for lack of offers. Gauges are snapshots; the allocation sizes
        and the skipped count start again from zero."""
        stats = OffloadingConnectorStats()
        n = self._num_chunks
        used = self._num_allocated_chunks - len(self._free_list) - self._num_evictable_cache_chunks
        usage = used / n if n > 0 else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in self.allocation_sizes_in_current_batch:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self.allocation_sizes_in_current_batch.clear()
        write_usage = self._num_write_pending_chunks / n if n > 0 else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write_usage, 0.0))
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, self.stores_skipped_in_current_batch)
            self.stores_skipped_in_current_batch = 0
        return stats

    @property
    def num_blocks(self) -> int:
        """The tier's size in chunks (one GPU block each)."""
        return self._num_chunks

    # -- the chunk pool ---------------------------------------------------------------------------
    def _get_num_free_chunks(self) -> int:
        return len(self._free_list) + self._num_chunks - self._num_allocated_chunks

    def _allocate_chunks(self, n: int) -> list[ChunkStatus]:
        fresh = min(n, self._num_chunks - self._num_allocated_chunks)
        chunks = [ChunkStatus(self._num_allocated_chunks + i) for i in range(fresh)]
        self._num_allocated_chunks += fresh
        chunks += [ChunkStatus(self._free_list.pop()) for _ in range(n - fresh)]
        return chunks

    def _emit(self, keys: list[OffloadKey], removed: bool, slots: list[int], **kw: object) -> None:
        if self.events is not None and keys:
            self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed, slots=slots, **kw))  # type: ignore[arg-type]

    # -- what a request did -----------------------------------------------------------------------
    def _access(self, req_context: ReqContext) -> _RequestCacheAccess:
        st = req_context.owned_state(self, _RequestCacheAccess)
        if st is None or st.cache_generation != self._cache_generation:
            st = _RequestCacheAccess(self._cache_generation)
            req_context.set_owned_state(self, st)
        return st

    def _record_request_cache_access(
        self, keys: Iterable[OffloadKey], req_context: ReqContext, reused_keys: Iterable[OffloadKey] = ()
    ) -> None:
        st = self._access(req_context)
        new = []
        for key in keys:
            if key not in st.seen_keys:
                if st.finished:
                    raise RuntimeError(f"request {req_context.req_id!r} met a new key after it finished")
                st.key_groups.setdefault(get_offload_group_idx(key), []).append(key)
                st.seen_keys.add(key)
                new.append(key)
        if new:
            self._policy.on_request_access(new, req_context)
        # Reading back a chunk this request stored (a cascade) is not a second use.
        st.reused_keys.update(k for k in reused_keys if k not in st.inserted_keys)

    def _count_offers(self, keys: list[OffloadKey]) -> None:
        """Count one offer of each key; a full tracker forgets its least recently offered key
        -- never one offered in this same call."""
        counts = self.counts
        assert counts is not None
        seen = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                seen.add(key)
        forgettable = len(counts) - len(seen)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if forgettable == 0:
                    continue
                counts.popitem(last=False)
                forgettable -= 1
            counts[key] = 1

    # -- the OffloadingManager verbs --------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access(_context(req_context))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        _check_key("key", key)
        self._drop_overwritten([key])
        chunk = self._policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def slot_of(self, key: OffloadKey) -> int | None:
        chunk = self._policy.get(key)
        return None if chunk is None else chunk.chunk_id

    def get_load_source(self, key: OffloadKey, req_context: ReqContext | None = None) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> CPULoadStoreSpec:
        """Pin each key (ref_cnt + 1) and record the read for the request; the chunks."""
        return self._prepare_load(keys, req_context, record_access=True)

    def _prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None, *, record_access: bool) -> CPULoadStoreSpec:
        keys = _check_keys("keys", keys)
        ctx = _context(req_context)
        chunks = []
        for i, key in enumerate(keys):
            chunk = self._policy.get(key)
            if chunk is None or not chunk.is_ready:
                raise ValueError(
                    f"prepare_load: keys[{i}] (block {key.hex()[:16]}…) is not readable in the {self.medium} tier "
                    f"({'still being written' if chunk is not None else 'not stored'}); lookup() says what is"
                )
            chunks.append(chunk)
        for key, chunk in zip(keys, chunks):
            if chunk.ref_cnt == 0:
                self._policy.mark_non_evictable(key)
                self._num_evictable_cache_chunks -= 1
            chunk.ref_cnt += 1
        if record_access:
            self._record_request_cache_access(keys, ctx, reused_keys=keys)
        return CPULoadStoreSpec(c.chunk_id for c in chunks)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._policy.touch(_check_keys("keys", keys), _context(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        """Unpin (a key no longer here, or not pinned, is skipped: kvlab unpins the loads of
        an undone step this way)."""
        for key in _check_keys("keys", keys):
            chunk = self._policy.get(key)
            if chunk is not None and chunk.ref_cnt > 0:
                chunk.ref_cnt -= 1
                if chunk.ref_cnt == 0:
                    self._num_evictable_cache_chunks += 1
                    self._policy.mark_evictable(key)

    def num_storable(self, protected: Iterable[OffloadKey] = ()) -> int:
        """How many new blocks could be stored now (free chunks + unpinned, unprotected ones)."""
        policy = self._policy
        # Every unpinned chunk counts (a kept tally), less the protected ones among them.
        held_back = 0
        for k in set(_check_keys("protected", protected)):
            chunk = policy.get(k)
            held_back += chunk is not None and chunk.ref_cnt == 0
        return self._get_num_free_chunks() + self._num_evictable_cache_chunks - held_back

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, *, protected: Iterable[OffloadKey] = ()
    ) -> PrepareStoreOutput | None:
        """Room for the keys not stored yet: free chunks first, then the policy's victims
        (never one of ``keys`` -- nor, in kvlab, of ``protected``). The new keys are given to
        the policy, not readable until ``complete_store``. None = not enough unpinned room:
        nothing was evicted or allocated."""
        keys = list(dict.fromkeys(_check_keys("keys", keys)))
        ctx = _context(req_context)
        protected = _check_keys("protected", protected)
        self._drop_overwritten(keys)
        if self.counts is not None:
            self._count_offers(keys)
        to_store: list[OffloadKey] = []
        ready: list[OffloadKey] = []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None:
                to_store.append(key)
            elif chunk.is_ready:
                ready.append(key)
        if self.counts is not None:
            before = len(to_store)
            to_store = [k for k in to_store if self.counts.get(k, 0) >= self.store_threshold]
            self.stores_skipped_in_current_batch += before - len(to_store)
        st = self._access(ctx)
        misses = [k for k in to_store if k not in st.store_miss_keys]
        if misses:  # before insert() forgets them from ARC's ghost lists
            self._policy.on_store_miss(misses, ctx)
            st.store_miss_keys.update(misses)
        met = set(to_store) | set(ready)
        self._record_request_cache_access([k for k in keys if k in met], ctx, reused_keys=ready)
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        self.allocation_sizes_in_current_batch.append(len(to_store))
        need = len(to_store) - self._get_num_free_chunks()
        evicted: list[tuple[OffloadKey, ChunkStatus]] = []
        if need > 0:
            if need > self._num_evictable_cache_chunks:
                return None
            victims = self._policy.evict(need, set(keys) | set(protected))
            if victims is None:
                return None
            evicted = victims
            self._num_evictable_cache_chunks -= len(victims)
            self._free_list.extend(c.chunk_id for _, c in victims)
            self._emit([k for k, _ in victims], True, [c.chunk_id for _, c in victims])
        chunks = self._allocate_chunks(len(to_store))
        for key, chunk in zip(to_store, chunks):
            self._policy.insert(key, chunk, ctx)
        self._num_write_pending_chunks += len(to_store)
        st.inserted_keys.update(to_store)
        if self._tracks_slot_writes:
            self.slot_writes.keys.update((c.chunk_id, k) for k, c in zip(to_store, chunks))
        return PrepareStoreOutput(
            to_store, CPULoadStoreSpec(c.chunk_id for c in chunks), [k for k, _ in evicted], [c.chunk_id for _, c in evicted]
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True, reason: str = "store failed"
    ) -> None:
        """Stored keys become readable; a failed store forgets them (the chunk is free again)."""
        keys = _check_keys("keys", keys)
        if not isinstance(success, bool):
            raise TypeError(f"success must be True or False, got {success!r}")
        done, dropped, dropped_slots = [], [], []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self._num_write_pending_chunks -= 1
            if success:
                chunk.ref_cnt = 0
                self._num_evictable_cache_chunks += 1
                self._policy.mark_evictable(key)
                done.append(key)
            else:
                self._policy.remove(key)
                self._free_list.append(chunk.chunk_id)
                dropped.append(key)
                dropped_slots.append(chunk.chunk_id)
        self._emit(dropped, True, dropped_slots, metadata_only=True, reason=reason)
        self._emit(done, False, [])

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Hand the request's accesses to the policy, head to tail per group (once)."""
        st = _context(req_context).owned_state(self, _RequestCacheAccess)
        if st is None or st.cache_generation != self._cache_generation or st.finished:
            return
        st.finished = True
        groups = [tuple(order_request_keys([st.key_groups[g]], req_context)) for g in sorted(st.key_groups)]
        self._policy.on_request_finished(tuple(groups), st.inserted_keys - st.reused_keys, st.reused_keys, req_context)

    def reset_cache(self) -> None:
        """Forget every chunk (no events: the tier starts empty)."""
        self._policy.clear()
        self._cache_generation += 1
        self._num_evictable_cache_chunks = self._num_write_pending_chunks = 0
        self._free_list.clear()
        self._num_allocated_chunks = 0

    def remove(self, keys: Iterable[OffloadKey], reason: str) -> list[OffloadKey]:
        """kvlab: forget blocks that went bad (their file is missing or corrupt, a copy
        failed, an undone step overwrote their chunk); a pinned block is unpinned first.
        Returns the keys that were here."""
        keys = _check_keys("keys", keys)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        gone, slots = [], []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None:
                continue
            if chunk.ref_cnt == 0:
                self._num_evictable_cache_chunks -= 1
            elif chunk.ref_cnt < 0:
                self._num_write_pending_chunks -= 1
            self._policy.remove(key)
            self._free_list.append(chunk.chunk_id)
            gone.append(key)
            slots.append(chunk.chunk_id)
        self._emit(gone, True, slots, reason=reason)
        return gone

    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call (a list: vLLM yields them, and a drain left half
        read would lose the rest). A failed store's release is left out for the keys a later
        store already took again."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        out = []
        for ev in events:
            if ev.metadata_only:
                keep = [i for i, k in enumerate(ev.keys) if self._policy.get(k) is None]
                if not keep:
                    continue
                if len(keep) < len(ev.keys):
                    ev = replace(ev, keys=[ev.keys[i] for i in keep], slots=[ev.slots[i] for i in keep] if ev.slots else [])
            out.append(ev)
        return out

    # -- undone steps (kvlab) -----------------------------------------------------------------------
    def overwritten(self, key: OffloadKey) -> bool:
        """True when ``key``'s chunk was handed to another block after ``key`` was stored."""
        _check_key("key", key)
        if not self._tracks_slot_writes:
            return False
        chunk = self._policy.get(key)
        return chunk is not None and self.slot_writes.keys.get(chunk.chunk_id) != key

    def _drop_overwritten(self, keys: Iterable[OffloadKey]) -> None:
        if self._tracks_slot_writes:
            stale = [k for k in keys if self.overwritten(k)]
            if stale:
                self.remove(stale, reason=OVERWRITTEN)

    # -- for views and tests ------------------------------------------------------------------------
    def entries(self) -> list[tuple[OffloadKey, int]]:
        """(key, chunk) in the policy's eviction order, the next to go first."""
        return [(k, c.chunk_id) for k, c in self._policy.items()]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._policy.get(key) is not None

    def __len__(self) -> int:
        return len(self._policy)

    def pinned(self) -> dict[OffloadKey, int]:
        return {k: c.ref_cnt for k, c in self._policy.items() if c.ref_cnt != 0}

    def check_invariants(self) -> None:
        chunks = list(self._policy.items())
        used = {c.chunk_id for _, c in chunks}
        assert len(used) == len(chunks), f"{self.medium}: two blocks share a chunk"
        free = set(self._free_list)
        assert len(free) == len(self._free_list), f"{self.medium}: a chunk is free twice"
        assert not used & free, f"{self.medium}: chunks {sorted(used & free)} are both used and free"
        assert used | free == set(range(self._num_allocated_chunks)), f"{self.medium}: chunks leaked"
        assert len(chunks) <= self._num_chunks
        n_idle = sum(1 for _, c in chunks if c.ref_cnt == 0)
        n_writing = sum(1 for _, c in chunks if c.ref_cnt < 0)
        assert self._num_evictable_cache_chunks == n_idle, (
            f"{self.medium}: {self._num_evictable_cache_chunks} counted evictable, {n_idle} are"
        )
        assert len(self._policy) == len(chunks), f"{self.medium}: the policy counts {len(self._policy)} chunks, lists {len(chunks)}"
        assert self._num_write_pending_chunks == n_writing, (
            f"{self.medium}: {self._num_write_pending_chunks} counted pending, {n_writing} are"
        )
        self._policy.check_invariants()


#: Why a CPU entry left: its chunk holds another block (see :class:`SlotWrites`).
OVERWRITTEN = "slot overwritten by a step that was undone"
