"""All or nothing: how kvlab undoes a call that an exception or Jupyter's interrupt stopped.

vLLM has no such module: its engine core runs in its own process, and an exception there
ends the process. A learner's notebook is different -- a cell is interrupted, a learner's
``touch`` raises half way through a step, and the engine must be exactly as it was before
the call. Everything that makes that true lives here, so that the classes the lessons
teach (``FreeKVCacheBlockQueue``, ``BlockHashToBlockMap``, ``BlockPool``) read like vLLM's
and hold no undo code (an import-linter contract keeps them from importing this module).

How a call is undone, for the pool:

* **The free queue and the prefix-cache map journal their changes.** While a checkpoint
  is open, kvlab's own queue and map run as their journaled subclasses below (the object
  stays the same; only its class changes, in O(1), and changes back on release). Each
  operation first appends how to undo itself -- the links or the entry it is about to
  change, as they are -- so the journal costs O(1) per operation and copies nothing.
  Undoing the entries newest first puts everything back, even after an operation that
  was itself stopped half way: each undo writes absolute values (or, for a key several
  blocks carry, puts one block back at its place), and an entry leaves the journal once
  applied -- so a restore that an interrupt stopped goes on from there when called again.
* **Ref counts and hashes are derived, not journaled**: after the queue and the map are
  back, each block's ``cache_key`` comes from the map and its ``ref_cnt`` from the block
  tables as they were (the manager keeps those). The prefix length a key stands for
  (``block_hash_num_tokens``) cannot be derived, so it is journaled where a block can take a
  new key: the queue records it for each block it hands out, the map for each block whose
  key it drops (a held block's partial key replaced by a fuller one). A reset only drops
  keys and leaves the lengths with the blocks (a block read without a key has none).
* **A learner's queue or map is saved by value.** A queue of another class (the
  free_queue exercise), a map of another class, or a pool whose eviction is a learner's
  (the stale_hash exercise may write into the map any way it likes) cannot be trusted to
  journal, so their order and entries are copied at the checkpoint: O(blocks), only then.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvlab.core.block_pool import BlockHashToBlockMap, BlockPool
from kvlab.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from kvlab.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager
from kvlab.metrics.stats import PrefixCacheStats
from kvlab.request import Request
from kvlab.utils.state import copy_attrs, copy_named, get_fields, put_attrs, restore_into, set_fields

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "JournaledBlockHashToBlockMap",
    "JournaledFreeKVCacheBlockQueue",
    "ManagerCheckpoint",
    "PoolCheckpoint",
    "SchedulerCheckpoint",
    "EngineCheckpoint",
    "Unguarded",
    "adds_request",
    "engine_call",
    "unguarded",
    "rollback_engine",
    "checkpoint_scheduler",
    "release_scheduler",
    "restore_scheduler",
    "scheduler_call",
    "checkpoint_manager",
    "checkpoint_pool",
    "manager_call",
    "manager_lookup",
    "release_manager",
    "release_pool",
    "restore_manager",
    "restore_pool",
]


# --- the free queue, journaled --------------------------------------------------------------
class JournaledFreeKVCacheBlockQueue(FreeKVCacheBlockQueue):
    """kvlab's free queue while a checkpoint is open: each operation that will change the
    queue first appends ``(undo_fn, *args)`` to ``journal``, then runs the taught code."""

    journal: list

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is not None and first is not self.fake_free_list_tail and first.next_free_block is not None:
            self.journal.append((_undo_pop, self, (first,), first.next_free_block, self.num_free_blocks, (first._hash_num_tokens,)))
        return super().popleft()  # (what it refuses, it leaves as it is: nothing to journal)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if type(n) is not int or not 0 < n <= self.num_free_blocks:
            return super().popleft_n(n)  # refused, or nothing to pop: nothing changes
        # One walk finds the blocks (the undo needs them all, and the one after them) and
        # unlinks them: the taught method's algorithm, with the journal entry in between.
        head = self.fake_free_list_head
        out: list[KVCacheBlock] = []
        lengths: list[int | None] = []  # each block's key length (see _undo_pop)
        cur = head.next_free_block
        for _ in range(n):
            out.append(cur)  # type: ignore[arg-type]  # n <= num_free: the walk never reaches the tail's None link
            lengths.append(cur._hash_num_tokens)  # type: ignore[union-attr]  # as above
            cur = cur.next_free_block  # type: ignore[union-attr]  # n <= num_free: never past the tail
        self.journal.append((_undo_pop, self, tuple(out), cur, self.num_free_blocks, lengths))
        for b in out:
            b.prev_free_block = b.next_free_block = None
        head.next_free_block = cur
        cur.prev_free_block = head  # type: ignore[union-attr]  # as above
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            return super().remove(block)  # not queued: the taught method says so
        # A prefix hit removes one block per hit from the middle of the queue: the taught
        # unlinking, inline after the journal entry (one call per block instead of two).
        self.journal.append((_undo_remove, self, block, prev, nxt, self.num_free_blocks))
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        last = self.fake_free_list_tail.prev_free_block
        if blocks and last is not None:  # (a broken tail is refused before any change)
            self.journal.append((_undo_append, self, tuple(blocks), last, self.num_free_blocks))
        super().append_n(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if blocks:
            self.journal.append((_undo_prepend, self, tuple(blocks), self.fake_free_list_head.next_free_block, self.num_free_blocks))
        super().prepend_n(blocks)


# How to undo each queue operation. Each writes every link its operation could have changed,
# with the value it had before.
def _undo_pop(
    q: FreeKVCacheBlockQueue, popped: tuple[KVCacheBlock, ...], after: KVCacheBlock, num_free: int, num_tokens: Sequence[int | None]
) -> None:
    head = q.fake_free_list_head
    head.next_free_block = after  # the links as the pop left them, then the blocks back in front
    after.prev_free_block = head
    FreeKVCacheBlockQueue.prepend_n(q, popped)  # the taught method itself: it journals nothing
    q.num_free_blocks = num_free
    for b, n in zip(popped, num_tokens):  # a popped block may take a key no journal sees (after a reset)
        b._hash_num_tokens = n


def _undo_remove(q: FreeKVCacheBlockQueue, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock, num_free: int) -> None:
    prev.next_free_block = block
    block.prev_free_block = prev
    block.next_free_block = nxt
    nxt.prev_free_block = block
    q.num_free_blocks = num_free


def _undo_append(q: FreeKVCacheBlockQueue, blocks: tuple[KVCacheBlock, ...], last: KVCacheBlock, num_free: int) -> None:
    for b in blocks:
        b.prev_free_block = b.next_free_block = None
    last.next_free_block = q.fake_free_list_tail
    q.fake_free_list_tail.prev_free_block = last
    q.num_free_blocks = num_free


def _undo_prepend(q: FreeKVCacheBlockQueue, blocks: tuple[KVCacheBlock, ...], first: KVCacheBlock, num_free: int) -> None:
    for b in blocks:
        b.prev_free_block = b.next_free_block = None
    q.fake_free_list_head.next_free_block = first
    first.prev_free_block = q.fake_free_list_head
    q.num_free_blocks = num_free


# --- the prefix-cache map, journaled --------------------------------------------------------
class JournaledBlockHashToBlockMap(BlockHashToBlockMap):
    """kvlab's map while a checkpoint is open: each change first journals the entry it
    changes, as it is (a lone block, or absent). A key that several blocks carry (or once
    carried: it stays a dict, see the map) holds a ``{block_id: block}`` dict whose order matters (a lookup returns the first); a block
    joining it journals its id, a block leaving it journals itself and its place -- O(1)
    for the usual case, the oldest leaving first -- so a hot duplicated key (the same
    prompt's last block, cached again and again) costs no copy of the dict."""

    journal: list

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        cache = self._cache
        v = cache.get(key, _MISSING)
        if v is _MISSING:  # the common case, a new key: the taught insert's first branch, inline
            self.journal.append((_undo_entry, self, key, v))
            cache[key] = block
            return
        if type(v) is dict and block.block_id not in v:
            self.journal.append((_undo_dup_insert, self, key, block.block_id))
        else:  # a lone block (the key's second: it becomes a dict), or an id already there (a copy)
            self.journal.append((_undo_entry, self, key, dict(v) if type(v) is dict else v))
        _map_insert(self, key, block)

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        cache = self._cache
        v = cache.get(key, _MISSING)
        if v is _MISSING:
            return None  # nothing changes
        if type(v) is KVCacheBlock:
            if v.block_id != block_id:
                return None  # another block carries the key: nothing changes
            # the common case, a lone block: inline (with its key's length: the block loses the key next)
            self.journal.append((_undo_lone_pop, self, key, v, v._hash_num_tokens))
            del cache[key]
            return v
        blk = v.get(block_id)
        if blk is not None:  # (an id the key does not hold changes no entry: nothing to undo)
            self.journal.append((_undo_num_tokens, blk, blk._hash_num_tokens))
            if len(v) == 1:  # its last block: the key leaves the map
                self.journal.append((_undo_entry, self, key, dict(v)))
            else:
                place = 0 if next(iter(v)) == block_id else list(v).index(block_id)
                self.journal.append((_undo_dup_pop, self, key, block_id, blk, place))
        return _map_pop(self, key, block_id)


_map_insert = BlockHashToBlockMap.insert  # the taught methods, called without super()'s lookup (hot path)
_map_pop = BlockHashToBlockMap.pop
_MISSING: Any = object()


def _undo_entry(cache_map: BlockHashToBlockMap, key: bytes, old: Any) -> None:
    if old is _MISSING:
        cache_map._cache.pop(key, None)
    else:
        cache_map._cache[key] = dict(old) if type(old) is dict else old


def _undo_num_tokens(block: KVCacheBlock, num_tokens: int | None) -> None:
    block._hash_num_tokens = num_tokens


def _undo_lone_pop(cache_map: BlockHashToBlockMap, key: bytes, block: KVCacheBlock, num_tokens: int | None) -> None:
    cache_map._cache[key] = block
    block._hash_num_tokens = num_tokens


def _undo_dup_insert(cache_map: BlockHashToBlockMap, key: bytes, block_id: int) -> None:
    v = cache_map._cache.get(key)
    if type(v) is dict:  # (the insert left two or more: one or more stay, still a dict)
        v.pop(block_id, None)


def _undo_dup_pop(cache_map: BlockHashToBlockMap, key: bytes, block_id: int, block: KVCacheBlock, place: int) -> None:
    """Put ``block`` back at its ``place`` in the key's dict (rebuilt: O(blocks under the key),
    only when a call is undone). Applied twice, the same result."""
    v = cache_map._cache[key]
    items = [(i, b) for i, b in v.items() if i != block_id]  # type: ignore[union-attr]  # a dict: the pop left one or more
    items.insert(place, (block_id, block))
    v.clear()  # type: ignore[union-attr]  # as above
    v.update(items)  # type: ignore[union-attr]  # as above


# --- the pool ---------------------------------------------------------------------------------
@dataclass(slots=True)
class PoolCheckpoint:
    """What :func:`restore_pool` needs: the journal and the few things it does not hold."""

    journal: list
    queue: Any
    free_order: list[KVCacheBlock] | None  # a queue of another class (a learner's): its order, by value
    cache_map: BlockHashToBlockMap
    map_entries: dict | None  # a map of another class, or changed by a learner's eviction: its entries, by value
    num_evicted_blocks: int
    kv_event_queue: list  # the KV-event queue object and its length: events only get appended
    num_kv_events: int
    collector: tuple | None  # the metrics collector's state (see _collector_state)
    # Partial prefix entries (vLLM 0.33, only where a group's blocks are larger than the hash
    # block): a block's extra keys by value -- O(blocks that have one), an empty dict
    # otherwise -- and whether any partial entry existed.
    partial_entries: tuple[dict[int, list[bytes]], bool]
    # With a queue or a map that does not journal: each block's block_hash_num_tokens, by value.
    num_tokens: dict[int, int] | None
    reused: list[KVCacheBlock] = field(default_factory=list)  # blocks the undone calls took from the queue (kept for a second restore)


def checkpoint_pool(pool: BlockPool) -> PoolCheckpoint:
    """Start recording how to undo every change to ``pool``; follow with :func:`release_pool`
    (keep the changes) or :func:`restore_pool` (undo them). O(1) with kvlab's own queue and
    map; a learner's queue or map is copied (see the module docstring)."""
    q = pool.free_block_queue
    m = pool.cached_block_hash_to_block
    own_queue = type(q) is FreeKVCacheBlockQueue
    # Only kvlab's own map, changed only by kvlab's own eviction, journals every change.
    own_map = type(m) is BlockHashToBlockMap and type(pool)._maybe_evict_cached_block is BlockPool._maybe_evict_cached_block
    entries = getattr(m, "_cache", None)  # kvlab's storage, which a map of another class may not keep
    cp = PoolCheckpoint(
        journal=[],
        queue=q,
        free_order=None if own_queue else list(q.get_all_free_blocks()),
        cache_map=m,
        map_entries=_copy_entries(entries) if not own_map and type(entries) is dict else None,
        num_evicted_blocks=pool.num_evicted_blocks,
        kv_event_queue=pool.kv_event_queue,
        num_kv_events=len(pool.kv_event_queue),
        collector=None if pool.metrics_collector is None else _collector_state(pool.metrics_collector),
        partial_entries=_partial_entries(pool),
        num_tokens=None
        if own_map and own_queue
        else {b.block_id: b._hash_num_tokens for b in pool.blocks if b._hash_num_tokens is not None},
    )
    # Journaling starts last: an interrupt before these lines leaves nothing journaling.
    if own_queue:
        q.journal = cp.journal  # type: ignore[attr-defined]  # the journaled subclass's attribute, set just before it runs
        _retype(q, JournaledFreeKVCacheBlockQueue)
    if own_map:
        m.journal = cp.journal  # type: ignore[attr-defined]  # as above
        _retype(m, JournaledBlockHashToBlockMap)
    return cp


def release_pool(pool: BlockPool, cp: PoolCheckpoint) -> None:
    """Keep every change since ``cp``: kvlab's queue and map stop journaling (the pool's
    current ones and those it held at ``cp``: a ``reset_prefix_cache`` replaces the map)."""
    for q in (pool.free_block_queue, cp.queue):
        if type(q) is JournaledFreeKVCacheBlockQueue:
            del q.journal
            _retype(q, FreeKVCacheBlockQueue)
    for m in (pool.cached_block_hash_to_block, cp.cache_map):
        if type(m) is JournaledBlockHashToBlockMap:
            del m.journal
            _retype(m, BlockHashToBlockMap)


def _retype(obj: Any, cls: type) -> None:
    """Run ``obj`` as ``cls`` from now on (a journaled subclass and its taught class share
    one layout: only the methods change)."""
    obj.__class__ = cls


def restore_pool(
    pool: BlockPool, cp: PoolCheckpoint, tables: Iterable[Iterable[KVCacheBlock]], *, drop_reused: bool = False
) -> list[KVCacheBlock]:
    """Undo every change to ``pool`` since ``cp``; ``tables`` are the block tables as they
    were then (the ref counts are recounted from them). Safe to call again after it was
    itself interrupted: the journal is undone newest first, each entry leaving it once
    applied (applying one twice gives the same result). Journaling goes on until
    :func:`release_pool`.

    ``drop_reused``: blocks that sat cached on the free queue at ``cp`` and were handed out
    since lose their hash now (returned, and logged as evictions): an executor may have
    written new K/V into them, so their old cache entry would serve wrong values.
    """
    pool.free_block_queue = cp.queue
    pool.cached_block_hash_to_block = cp.cache_map
    journal = cp.journal
    # Read before the journal is used up (a second restore finds only what is left).
    cp.reused.extend(b for entry in journal if entry[0] is _undo_pop for b in entry[2])
    while journal:  # newest first; an entry leaves once applied, so a second restore goes on from there
        fn, *args = journal[-1]
        fn(*args)
        journal.pop()
    if cp.map_entries is not None:  # a map that did not journal: its entries as they were
        cp.cache_map._cache = _copy_entries(cp.map_entries)
    blocks = pool.blocks
    if cp.free_order is not None:  # a foreign queue class: rebuilt from the listed order
        for b in blocks:
            b.prev_free_block = b.next_free_block = None
        pool.free_block_queue = pool.free_queue_cls(list(cp.free_order))
    extra, had_partial = cp.partial_entries
    pool.cached_block_hashes_by_block = {bid: list(keys) for bid, keys in extra.items()}
    pool.has_partial_entries = pool.has_partial_entries or had_partial  # never False while any exists
    for b in blocks:
        b.cache_key = None
        b.ref_cnt = 0
    for key, blks in pool.cached_block_hash_to_block.items():
        for b in blks:
            if not extra or key not in extra.get(b.block_id, ()):  # a block's own key, not one of its partial entries
                b.cache_key = key
    if cp.num_tokens is not None:  # a map that did not journal: each key's length as saved
        for b in blocks:
            b._hash_num_tokens = cp.num_tokens.get(b.block_id)
    for table in tables:
        for b in table:
            if not b.is_null:
                b.ref_cnt += 1
    pool.num_evicted_blocks = cp.num_evicted_blocks
    del cp.kv_event_queue[cp.num_kv_events :]  # take_events() may have swapped the queue: the old one comes back
    pool.kv_event_queue = cp.kv_event_queue
    if cp.collector is not None and pool.metrics_collector is not None:
        _set_collector_state(pool.metrics_collector, cp.collector)
    dropped: list[tuple[KVCacheBlock, bytes]] = []
    if drop_reused:
        reused = {id(b): b for b in cp.reused}
        num_blocks = 0
        for b in reused.values():
            if b.cache_key is not None and b.ref_cnt == 0 and not b.is_null:
                dropped += [(b, k) for k in BlockPool._remove_cached_block_hashes(pool, b)]
                num_blocks += 1
        pool.num_evicted_blocks += num_blocks
        for o in pool.observers:
            o.on_cache_entries_dropped(pool, dropped)
    return list({id(b): b for b, _ in dropped}.values())


_NO_PARTIAL_ENTRIES: tuple[dict[int, list[bytes]], bool] = ({}, False)  # never changed: restore copies


def _partial_entries(pool: BlockPool) -> tuple[dict[int, list[bytes]], bool]:
    if not pool.has_partial_entries:
        return _NO_PARTIAL_ENTRIES
    extra = pool.cached_block_hashes_by_block
    return {bid: list(keys) for bid, keys in extra.items()}, True


# --- the KV-cache manager ---------------------------------------------------------------------
_TABLES = frozenset({"req_to_blocks"})  # the attribute a growing-table class keeps by length
#: kvlab's own full-attention manager in full: what a call may change besides its tables, and
#: what is fixed once it is built. Its state is saved by these names, without reading the
#: manager's ``__dict__``: in CPython 3.11 that turns an object's compact attribute storage
#: into a dict, and every later attribute read of it gets ~2.5x slower -- this manager is
#: read for every request in every step. A test compares the names with a real manager's
#: attributes, so one added later cannot be missed. (Other classes, a learner's subclass
#: among them, are saved generically.)
_FULL_ATTENTION_STATE = ("num_cached_block", "new_block_ids")
#: Copy-on-write bookkeeping (vLLM 0.33): empty except inside the call that fills it and until
#: the scheduler drains it, so a checkpoint copies it only when it is not empty.
_FULL_ATTENTION_RARE = ("_partial_hit_reqs", "_pending_cow_copies")
_FULL_ATTENTION_FIXED = frozenset(
    {
        "kv_cache_spec",
        "block_size",
        "block_pool",
        "kv_cache_group_id",
        "enable_caching",
        "scheduler_block_size",
        "cache_hit_alignment_tokens",
        "max_admission_blocks_per_request",
        "use_eagle",
        "_null_block",
        "_record_new_block_ids",
        "_caches_partial_tail",
        "retention_interval",
        "replay_use_eagle",
        "_replay_boundaries",  # set for one cache_blocks call only, restored by it even when interrupted
        "dcp_world_size",
        "pcp_world_size",
    }
)
#: Group managers whose block tables, within a call, only grow at the end (``extend``) or
#: leave whole (``pop``): never changed in place. A checkpoint keeps such a table as (the list,
#: its length) -- O(requests), not O(blocks held) -- so a decode step costs the same at 16
#: blocks held as at 2,048. Exact classes only: a subclass (a learner's) may change a table
#: in place, and a window's table does (blocks it no longer reads become the null block), so
#: theirs are copied. Each class maps to the rest of its state, saved by name.
_GROWING_TABLES: dict[type, tuple[str, ...]] = {FullAttentionManager: _FULL_ATTENTION_STATE}


@dataclass(slots=True)
class _GroupSave:
    """One group manager's attributes as they were: ``attrs`` copied two levels deep, or --
    for a class in ``_GROWING_TABLES`` -- its state but ``req_to_blocks``, whose tables are
    kept as the map (a shallow copy: the same lists) and their lengths."""

    attrs: dict[str, Any]
    tables: dict[str, list[KVCacheBlock]] | None
    lengths: list[int] | None


def _save_group(m: SingleTypeKVCacheManager) -> _GroupSave:
    state = _GROWING_TABLES.get(type(m))
    if state is not None:
        tables = m.req_to_blocks
        attrs = copy_named(m, state)
        if m._partial_hit_reqs or m._pending_cow_copies:
            attrs.update(copy_named(m, _FULL_ATTENTION_RARE))
        return _GroupSave(attrs, tables.copy(), list(map(len, tables.values())))
    return _GroupSave(copy_attrs(m), None, None)


def _restore_group(m: SingleTypeKVCacheManager, saved: _GroupSave) -> None:
    put_attrs(m, saved.attrs)
    if saved.tables is not None:
        if "_partial_hit_reqs" not in saved.attrs:  # they were empty (see _save_group)
            m._partial_hit_reqs, m._pending_cow_copies = {}, []
        for table, n in zip(saved.tables.values(), saved.lengths):  # type: ignore[arg-type]  # set with tables
            del table[n:]
        m.req_to_blocks = saved.tables.copy()


@dataclass(slots=True)
class ManagerCheckpoint:
    """What :func:`restore_manager` needs: every group manager's attributes (copied two
    levels deep, the block tables of full attention by their lengths), the manager's request
    map and stats, the pool's checkpoint, and each request a call touched, saved before its
    first change (shared with the scheduler's checkpoint)."""

    managers: list[_GroupSave]
    requests: dict[str, Request]
    prefix_cache_stats: PrefixCacheStats | None
    pool: PoolCheckpoint
    saved_requests: dict[int, tuple[Request, tuple]] = field(default_factory=dict)  # id(request) -> (request, its state)
    hisparse: _HiSparseSave | None = None


@dataclass(slots=True)
class _HiSparseSave:
    """HiSparse's books, by value (O(blocks), only for a manager with a host pool): the
    coordinator's attributes and those of each record it holds (restored into the same
    objects, which transfers in flight share), the host pool's checkpoint, and both pools'
    ref counts and reuse watchers -- an unpinned page is read without a reference and a
    transfer holds one more at each end, so the tables alone cannot give the counts back."""

    coordinator: dict[str, Any]
    records: list[tuple[Any, dict[str, Any]]]
    host: PoolCheckpoint
    refs: list[tuple[BlockPool, list[int], dict[int, Any]]]


def _save_hisparse(coord: Any, gpu_pool: BlockPool) -> _HiSparseSave:
    records: dict[int, Any] = {}
    for state in (*coord.request_states.values(), *(p.request_state for p in coord.pending_spills.values())):
        records[id(state)] = state
        if state.publication is not None:
            records[id(state.publication)] = state.publication
    for p in coord.pending_spills.values():
        records[id(p)] = p
    host_pool = coord.host_manager.block_pool
    return _HiSparseSave(
        coordinator=copy_attrs(coord),
        records=[(r, copy_attrs(r)) for r in records.values()],
        host=checkpoint_pool(host_pool),
        refs=[(pool, [b.ref_cnt for b in pool.blocks], pool._reuse_watchers.copy()) for pool in (gpu_pool, host_pool)],
    )


def _restore_hisparse(coord: Any, saved: _HiSparseSave) -> None:
    for obj, attrs in saved.records:
        put_attrs(obj, attrs)
    put_attrs(coord, saved.coordinator)
    restore_pool(coord.host_manager.block_pool, saved.host, [])
    for pool, refs, watchers in saved.refs:
        for b, n in zip(pool.blocks, refs):
            b.ref_cnt = n
        pool._reuse_watchers = watchers.copy()


def save_first(saved: dict[int, tuple[Request, tuple]] | None, request: Any) -> None:
    """Keep ``request``'s state as it is now in ``saved`` (a checkpoint's ``saved_requests``;
    None inside :func:`unguarded`: nothing is kept). The first save wins; what is not a
    Request (a learner's bad argument, refused by the call itself) is not saved."""
    if saved is not None and id(request) not in saved and isinstance(request, Request):
        saved[id(request)] = (request, request_state(request))


def request_state(r: Request) -> tuple:
    """Everything a call may change in a request, in O(1) for the token lists: every attribute
    as it is (read generically, so a field added later -- or one a connector sets, like
    ``kv_transfer_params`` -- cannot be forgotten), and the lists that only ever grow
    (tokens, packed tokens, block hashes) by their lengths, to be cut back."""
    return (get_fields(r), len(r._output_token_ids), len(r._all_token_ids), len(r.block_hashes))


def set_request_state(r: Request, state: tuple) -> None:
    fields, num_out, num_tokens, num_hashes = state
    set_fields(r, fields)
    del r._output_token_ids[num_out:], r._all_token_ids[num_tokens:], r._token_bytes[4 * num_tokens :]
    del r.block_hashes[num_hashes:]


def checkpoint_manager(mgr: KVCacheManager, saved_requests: dict[int, tuple[Request, tuple]] | None = None) -> ManagerCheckpoint:
    """Start recording how to undo every change to ``mgr`` and its pool. O(requests holding
    blocks): a full-attention table is kept by its length (others are copied), the pool only
    journals, and a request's state is saved when a call first touches it
    (:func:`manager_call`). Follow with :func:`release_manager` (keep) or
    :func:`restore_manager` (undo)."""
    cp = ManagerCheckpoint(
        # Every attribute of every group's manager (a manager subclass with bookkeeping of
        # its own is covered too); the coordinator holds no state of its own.
        managers=[_save_group(m) for m in mgr.coordinator.single_type_managers],
        requests=mgr._requests.copy(),
        prefix_cache_stats=None if mgr.prefix_cache_stats is None else mgr.prefix_cache_stats.copy(),
        saved_requests={} if saved_requests is None else saved_requests,
        pool=None,  # type: ignore[arg-type]  # set next: the pool's journal starts last
    )
    if mgr.hisparse is not None:
        cp.hisparse = _save_hisparse(mgr.hisparse, mgr.block_pool)
    cp.pool = checkpoint_pool(mgr.block_pool)
    mgr._txn = cp
    return cp


def release_manager(mgr: KVCacheManager, cp: ManagerCheckpoint) -> None:
    """Keep every change since ``cp``."""
    mgr._txn = None
    release_pool(mgr.block_pool, cp.pool)
    if cp.hisparse is not None:
        release_pool(mgr.hisparse.host_manager.block_pool, cp.hisparse.host)  # type: ignore[union-attr]  # set with cp.hisparse


def restore_manager(mgr: KVCacheManager, cp: ManagerCheckpoint, *, drop_reused: bool = False) -> list[KVCacheBlock]:
    """Undo every change since ``cp`` (requests included) and stop recording. Returns the
    blocks whose cache entry ``drop_reused`` dropped (see :func:`restore_pool`)."""
    for m, saved in zip(mgr.coordinator.single_type_managers, cp.managers):
        _restore_group(m, saved)
    mgr._requests = cp.requests.copy()
    mgr.prefix_cache_stats = None if cp.prefix_cache_stats is None else cp.prefix_cache_stats.copy()
    for r, state in cp.saved_requests.values():
        set_request_state(r, state)
    tables: list[Sequence[KVCacheBlock]] = [t for m in mgr.coordinator.single_type_managers for t in m.req_to_blocks.values()]
    # A copy waiting for the runner holds both its blocks once more (take_kv_cache_block_copies).
    tables += [pair for m in mgr.coordinator.single_type_managers for pair in m._pending_cow_copies]
    dropped = restore_pool(mgr.block_pool, cp.pool, tables, drop_reused=drop_reused)
    if cp.hisparse is not None:
        _restore_hisparse(mgr.hisparse, cp.hisparse)
    release_manager(mgr, cp)
    return dropped


def manager_call(fn: F) -> F:
    """A manager entry point that changes state, all or nothing: inside a scheduler's or an
    engine's transaction it only saves the request it is given (before the call's first
    change to it); a manager used on its own opens a checkpoint for the call and undoes it
    if anything raises -- a learner's swapped method, a bad argument, an interrupt."""

    @functools.wraps(fn)
    def call(self: KVCacheManager, request: Any, *args: Any, **kwargs: Any) -> Any:
        cp = self._txn
        if cp is not None:
            save_first(cp.saved_requests, request)
            return fn(self, request, *args, **kwargs)
        cp = checkpoint_manager(self)
        try:
            save_first(cp.saved_requests, request)
            out = fn(self, request, *args, **kwargs)
        except BaseException:
            restore_manager(self, cp)
            raise
        release_manager(self, cp)
        return out

    return call  # type: ignore[return-value]  # the wrapper has fn's signature (functools.wraps)


def manager_lookup(fn: F) -> F:
    """A manager entry point that only reads the cache but may extend the request (its block
    hashes): inside a transaction the request is saved first; on its own, nothing to undo."""

    @functools.wraps(fn)
    def call(self: KVCacheManager, request: Any, *args: Any, **kwargs: Any) -> Any:
        cp = self._txn
        if cp is not None:
            save_first(cp.saved_requests, request)
        return fn(self, request, *args, **kwargs)

    return call  # type: ignore[return-value]  # as above


# --- the scheduler ---------------------------------------------------------------------------
@dataclass(slots=True)
class SchedulerCheckpoint:
    """What :func:`restore_scheduler` needs: the scheduler's own attributes, its request map,
    waiting queue and encoder cache (containers copied), where the event log was, the KV
    connector's books, and the manager's checkpoint (with it the pool's journal and the saved
    requests)."""

    manager: ManagerCheckpoint
    state: dict[str, Any]
    requests: dict[str, Request]
    waiting: dict[str, Any]
    kv_holding_waiting: dict[str, Any]
    encoder_cache: dict[str, Any]
    log_len: int | None
    log_step: int
    connector: dict[str, Any] | None  # the KV connector's scheduler-side books (a deep copy)
    publisher: Any  # the KV-event publisher the transaction holds batches back from (None: none)
    publish: list = field(default_factory=list)  # KV-event batches to publish once the calls are kept

    @property
    def saved_requests(self) -> dict[int, tuple[Request, tuple]]:
        return self.manager.saved_requests


#: Scheduler attributes a checkpoint does not copy: objects with owners of their own (the
#: manager, the log, the connector, the publisher) and the containers copied apart.
_NOT_COPIED = frozenset(
    {
        "kv_cache_manager",
        "events",
        "connector",
        "kv_event_publisher",
        "requests",
        "waiting",
        "kv_holding_waiting",
        "encoder_cache_manager",
        "_txn",
    }
)
#: Stats records changed in place: copied with their own ``copy()``.
_STATS = ("caching_metrics", "connector_prefix_cache_stats")


class _HeldBackPublisher:
    """Stands in for the KV-event publisher while a transaction is open: a step that is
    undone must not have told the routers about blocks it never cached, so its batches go
    out only when it is kept."""

    __slots__ = ("held",)

    def __init__(self, held: list) -> None:
        self.held = held

    def publish(self, batch: Any) -> None:
        self.held.append(batch)


def checkpoint_scheduler(sched: Scheduler) -> SchedulerCheckpoint:
    """Start recording how to undo every change to the scheduler, its requests, the KV-cache
    manager, the pool and the event log. Cheap enough for every step: the queues, counters
    and request map are copied (C-speed container copies; every attribute, so what a later
    version adds is covered too), a request's state is saved when a call first touches it,
    and the pool only journals. Follow with :func:`release_scheduler` (keep the changes) or
    :func:`restore_scheduler` (undo them). The KV connector's books are deep-copied; the
    executor is outside: it hears of an undone step through the next one."""
    log = sched.events
    state = copy_attrs(sched, skip=_NOT_COPIED)
    for name in _STATS:
        v = state.get(name)
        if v is not None:
            state[name] = v.copy()
    cp = SchedulerCheckpoint(
        manager=None,  # type: ignore[arg-type]  # set below, last: it starts the pool's journal
        state=state,
        requests=sched.requests.copy(),
        waiting=copy_attrs(sched.waiting),
        kv_holding_waiting=copy_attrs(sched.kv_holding_waiting),
        encoder_cache=copy_attrs(sched.encoder_cache_manager, skip=frozenset({"events"})),
        log_len=None if log is None else len(log),
        log_step=0 if log is None else log.step,
        connector=None if sched.connector is None else copy.deepcopy(vars(sched.connector), _shared_memo(sched)),
        publisher=sched.kv_event_publisher,
    )
    cp.manager = checkpoint_manager(sched.kv_cache_manager)
    if cp.publisher is not None:
        sched.kv_event_publisher = _HeldBackPublisher(cp.publish)
    sched._txn = cp
    return cp


def release_scheduler(sched: Scheduler, cp: SchedulerCheckpoint) -> None:
    """Keep every change since ``cp``, and publish the KV-event batches it held back."""
    sched._txn = None
    release_manager(sched.kv_cache_manager, cp.manager)
    if cp.publisher is not None:
        sched.kv_event_publisher = cp.publisher
        batches, cp.publish[:] = list(cp.publish), []
        for batch in batches:
            cp.publisher.publish(batch)


def restore_scheduler(sched: Scheduler, cp: SchedulerCheckpoint, *, drop_reused: bool = False, resync_executor: bool = False) -> list:
    """Undo every change since ``cp``: the event log is cut back to where it was; the queues,
    counters, requests, block tables and pool are as they were. Safe to call again if it was
    itself interrupted. ``resync_executor``: the executor may have seen the undone step, so
    every running request is sent to it in full next time. ``drop_reused``: see
    :func:`restore_pool` (for executors that write K/V). Returns the blocks whose cache
    entries were dropped."""
    if sched.events is not None and cp.log_len is not None:
        sched.events.truncate(cp.log_len)
        sched.events.step = cp.log_step
    put_attrs(sched, cp.state)
    for name in _STATS:
        v = cp.state.get(name)
        if v is not None:
            setattr(sched, name, v.copy())
    put_attrs(sched.waiting, cp.waiting)
    put_attrs(sched.kv_holding_waiting, cp.kv_holding_waiting)
    put_attrs(sched.encoder_cache_manager, cp.encoder_cache)
    added = [r for r in sched.requests.values() if cp.requests.get(r.request_id) is not r]
    sched.requests.clear()  # in place: whoever holds the map sees it restored
    sched.requests.update(cp.requests)
    if resync_executor:
        sched._num_sent_blocks = {}
    if cp.connector is not None and sched.connector is not None:
        restore_into(sched.connector, cp.connector, _shared_memo(sched))
    if cp.publisher is not None:
        sched.kv_event_publisher = cp.publisher
        cp.publish.clear()
    dropped = restore_manager(sched.kv_cache_manager, cp.manager, drop_reused=drop_reused)
    for r in added:  # added by the undone calls: free to be added again
        r._owner = None
    sched._txn = None
    return dropped


def _shared_memo(sched: Scheduler) -> dict[int, Any]:
    """What a deep copy of the connector's books must share, not copy: the manager, its pool
    and log, the live requests (its per-request records point at them), and what the
    connector was built from or bound to -- configs are settings, not books."""
    mgr = sched.kv_cache_manager
    conn = vars(sched.connector) if sched.connector is not None else {}
    given = [conn.get(k) for k in ("_kv_cache_manager", "_vllm_config", "_kv_transfer_config", "_kv_cache_config")]
    # A connector may name more objects that are not its books (``undo_shared_objects``):
    # vLLM's spec-built offloading half keeps a finished request until its stores land,
    # after the scheduler forgot it -- a Request is never the connector's to copy.
    more = getattr(sched.connector, "undo_shared_objects", None)
    shared = [mgr, mgr.block_pool, mgr.events, sched.events, *sched.requests.values(), *given, *(more() if callable(more) else ())]
    return {id(o): o for o in shared if o is not None}


def scheduler_call(touches: Callable[..., Iterable[str]] | None = None) -> Callable[[F], F]:
    """A scheduler entry point, all or nothing: inside an engine's transaction it runs as it
    is; called on its own it opens a checkpoint and undoes the call if anything raises.
    ``touches(sched, *args)`` names the requests the call changes before any manager call
    saves them: they are saved first."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
            cp = self._txn
            own = cp is None
            if own:
                cp = checkpoint_scheduler(self)
            try:
                if touches is not None and cp.saved_requests is not None:
                    saved, get = cp.saved_requests, self.requests.get
                    for rid in touches(self, *args, **kwargs):
                        save_first(saved, get(rid))
                out = fn(self, *args, **kwargs)
            except BaseException:
                if own:
                    restore_scheduler(self, cp)
                raise
            if own:
                release_scheduler(self, cp)
            return out

        return call  # type: ignore[return-value]  # as above

    return wrap


def adds_request(fn: F) -> F:
    """``Scheduler.add_request``, all or nothing at O(1): a request the call could not add
    completely (an interrupt, a failing event subscriber) leaves no trace. Inside a
    transaction, the transaction's restore does this."""

    @functools.wraps(fn)
    def call(self: Scheduler, request: Any) -> None:
        if self._txn is not None:
            return fn(self, request)
        log_len = len(self.events) if self.events is not None else 0
        had = self.requests.get(getattr(request, "request_id", None))  # type: ignore[arg-type]  # a None id finds nothing, as intended for what is not a Request
        try:
            return fn(self, request)
        except BaseException:
            if had is None and isinstance(request, Request) and self.requests.get(request.request_id) is request:
                del self.requests[request.request_id]
                if any(r is request for r in self.waiting):
                    self.waiting.remove_request(request)
                request._owner = None
            if self.events is not None:
                self.events.truncate(log_len)
            raise

    return call  # type: ignore[return-value]  # the wrapper has fn's signature (functools.wraps)


# --- the engine ------------------------------------------------------------------------------
# The engine sits above the core; it is reached here through its attributes only (``clock``,
# ``metrics``, ``finished``, ``scheduler``, ...), never imported.


@dataclass(slots=True)
class EngineCheckpoint:
    """One engine call's way back: the scheduler's checkpoint plus the engine's own state --
    the clock, the adapter ids, and the per-request metrics and finished entries the call
    changes (each saved before its first change, every field of it)."""

    what: str
    step: int
    clock: float
    ids: int
    num_eviction_events: int
    num_lora_ids: int  # adapters are only ever added to engine.lora_ids, so its length says what to drop
    sched: SchedulerCheckpoint | None = None
    metrics: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # rid -> (object or _MISSING, its fields)
    finished: dict[str, Any] = field(default_factory=dict)  # rid -> the finished entry, or _MISSING
    executor_called: bool = False

    def save_metrics(self, metrics: dict[str, Any], rid: str) -> None:
        """Keep ``metrics[rid]`` as it is now (the first save wins)."""
        self.save_metrics_of(metrics, (rid,))

    def save_metrics_of(self, metrics: dict[str, Any], rids: Iterable[str]) -> None:
        """:meth:`save_metrics` for each of ``rids`` (a step's scheduled requests), in one call."""
        saved = self.metrics
        for rid in rids:
            if rid not in saved:
                m = metrics.get(rid, _MISSING)
                saved[rid] = (m, None if m is _MISSING else get_fields(m))

    def save_finished(self, finished: dict[str, Any], rid: str) -> None:
        if rid not in self.finished:
            self.finished[rid] = finished.get(rid, _MISSING)


def begin_engine(engine: Any, what: str) -> EngineCheckpoint:
    """Open the transaction of one engine call (``what``: "step", "generate", ...)."""
    engine._check_usable()
    cp = EngineCheckpoint(
        what, engine.scheduler.step_count, engine.clock, engine._ids, len(engine.kv_cache_eviction_events), len(engine.lora_ids)
    )
    engine._pending = cp  # from here on, an interrupt leaves the engine marked
    cp.sched = checkpoint_scheduler(engine.scheduler)
    return cp


def commit_engine(engine: Any, cp: EngineCheckpoint) -> None:
    engine._pending = None
    release_scheduler(engine.scheduler, cp.sched)  # type: ignore[arg-type]  # begin_engine sets it before anything can commit


def rollback_engine(engine: Any, cp: EngineCheckpoint) -> None:
    """Undo the engine call ``cp`` opened (safe to call again if it was itself interrupted)."""
    if isinstance(cp, Unguarded):
        raise RuntimeError(
            "the engine ran without undo points (kvlab.core.transaction.unguarded) and a call failed: "
            "there is no state to go back to; build a new engine"
        )
    if cp.sched is not None:
        # An executor that writes K/V may have overwritten blocks that are cached again
        # after the undo: their cache entries go (the blocks stay free).
        writes_kv = bool(getattr(engine.executor, "writes_kv_cache", True))
        restore_scheduler(engine.scheduler, cp.sched, drop_reused=cp.executor_called and writes_kv, resync_executor=cp.executor_called)
    engine.clock, engine._ids = cp.clock, cp.ids
    del engine.kv_cache_eviction_events[cp.num_eviction_events :]
    for name in list(engine.lora_ids)[cp.num_lora_ids :]:
        del engine.lora_ids[name]
    for rid, (m, fields) in cp.metrics.items():
        if m is _MISSING:
            engine.metrics.pop(rid, None)
        else:
            set_fields(m, fields)
            engine.metrics[rid] = m
    for rid, r in cp.finished.items():
        if r is _MISSING:
            engine.finished.pop(rid, None)
        else:
            engine.finished[rid] = r


def _fault_text(exc: BaseException) -> str:
    """What stopped a call, for ``engine.fault`` and the messages that quote it."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@contextlib.contextmanager
def engine_call(engine: Any, what: str) -> Iterator[EngineCheckpoint]:
    """``with engine_call(engine, "step") as cp:`` -- the body is all or nothing. On an
    exception the call is undone and the exception goes on with a note saying so; if an
    interrupt stops the undo itself, the engine stays marked until ``engine.restore()``."""
    if engine._unguarded is not None:  # inside `unguarded(engine)`: no undo point
        yield engine._unguarded
        return
    cp = begin_engine(engine, what)
    try:
        yield cp
    except BaseException as exc:
        engine.fault = _fault_text(exc)
        rollback_engine(engine, cp)
        engine._pending = None
        exc.add_note(
            f"kvlab: {cp.what} did not finish, so the engine went back to the end of step {cp.step}: "
            "no request and no block was lost. Fix the cause and call it again."
        )
        raise
    commit_engine(engine, cp)


class Unguarded:
    """Stands in for every checkpoint of an engine inside :func:`unguarded`: saves nothing."""

    executor_called = False
    saved_requests = None  # nothing is saved

    def __init__(self) -> None:
        self.what, self.step = "an unguarded run", 0

    def save_metrics(self, metrics: Any, rid: str) -> None:
        pass

    def save_metrics_of(self, metrics: Any, rids: Any) -> None:
        pass

    def save_finished(self, finished: Any, rid: str) -> None:
        pass


@contextlib.contextmanager
def unguarded(engine: Any) -> Iterator[Unguarded]:
    """``with unguarded(engine): ...`` -- the engine's calls in the block take no undo point.

    For an engine that nobody else holds until the block ends: one a helper builds, runs
    and hands back (lesson 12's offload runs, a benchmark's). With nothing outside it to keep
    consistent, the helper is all or nothing as a whole -- if it stops, its engine is thrown
    away -- and each step costs what it would cost without kvlab's undo (as in vLLM). If the
    block raises, the engine is marked unusable (its state is wherever the failed call
    stopped, and there is nothing to go back to): build a new one."""
    engine._check_usable()
    sched, mgr = engine.scheduler, engine.kv_cache_manager
    if engine._unguarded is not None or sched._txn is not None or mgr._txn is not None:
        raise RuntimeError("unguarded(engine): the engine is inside a call or an unguarded block already")
    nocp = Unguarded()
    engine._unguarded = sched._txn = mgr._txn = nocp  # the scheduler's and the manager's calls open none either
    try:
        yield nocp
    except BaseException as exc:
        nocp.step = sched.step_count
        engine.fault = _fault_text(exc)
        engine._pending = nocp  # refused from now on (LLMEngine._check_usable)
        raise
    finally:
        engine._unguarded = sched._txn = mgr._txn = None


def _copy_entries(entries: dict) -> dict:
    """A copy of a map's storage (key -> a block, or {block_id: block}) that later changes to
    the map cannot reach."""
    return {k: dict(v) if type(v) is dict else v for k, v in entries.items()}


def _collector_state(c: Any) -> tuple:
    """A block-residency collector's state: its random generator, its sampled blocks with
    their mutable fields, its pending evictions."""
    return (
        c._rng.getstate(),
        {bid: (m, m.last_access_ns, tuple(m.access_history)) for bid, m in c.block_metrics.items()},
        list(c._eviction_events),
    )


def _set_collector_state(c: Any, state: tuple) -> None:
    rng, metrics, evictions = state
    c._rng.setstate(rng)
    c.block_metrics = {}
    for bid, (m, last, history) in metrics.items():
        m.last_access_ns = last
        m.access_history.clear()
        m.access_history.extend(history)
        c.block_metrics[bid] = m
    c._eviction_events = list(evictions)
