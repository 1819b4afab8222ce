"""The block pool: every KV block that will ever exist, its ref count, the free queue and the
prefix-cache map (lessons 02 and 04).

vLLM: ``vllm/v1/core/block_pool.py`` and ``KVCacheBlock`` / ``FreeKVCacheBlockQueue`` in
``vllm/v1/core/kv_cache_utils.py``.

The rules this file enforces:

* Block 0 is the *null block*: a placeholder that pads block tables (sliding window) and
  is never allocated, freed, cached or evicted.
* ``ref_cnt`` = number of block tables holding the block. A block is on the free queue
  exactly when ``ref_cnt == 0``.
* The free queue is the eviction order. Freed blocks *keep their hash*: a later request
  with the same prefix can still hit them (``touch`` pulls them back out). Only when the
  head of the queue is reallocated does its cache entry disappear -- lazy eviction. So
  the cache is the pool: there is no separate cache memory.
* Freed blocks that never got a hash go to the *head* (reused first: they can never
  produce a hit, and reusing recently touched memory is good for locality); cached blocks
  go to the *tail* (kept as long as possible, least-recently-used first out). That is
  vLLM 0.24 and later; vLLM 0.22 and older appended every freed block to the tail (0.23
  already prepended the uncached blocks that left a sliding window or local-attention chunk, and
  those a sliding-window group freed). ``prepend_uncached_blocks=False``
  brings the old rule back; lesson 04 compares the two.
* A key is normally the hash of a *full* block. vLLM 0.33 adds partial entries: where a
  group's blocks are larger than the hash block, the prompt's last hash boundary inside a
  block becomes one more key of it (``cache_partial_block``). A block without a key takes
  it as its own -- it is then freed to the tail like any cached block; a fuller key
  replaces it; eviction drops every key the block has, one ``BlockRemoved`` each.
* Every change is reported once, to the pool's observers (``kvlab.core.pool_observers``):
  kvlab's event log (the pictures), vLLM's KV cache events -- with
  ``enable_kv_cache_events``, queued at the moments vLLM's pool queues them (``BlockStored``
  when ``cache_full_blocks`` hashes a run of blocks, ``BlockRemoved`` for each hash dropped
  when a cached block is reallocated, ``AllBlocksCleared`` on a successful
  ``reset_prefix_cache``) and handed over by ``take_events()`` -- and a
  ``KVCacheMetricsCollector`` (every allocation, prefix hit and eviction, lesson 08).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvlab.core.kv_cache_utils import (
    check_lookahead_tokens,
    BlockHashListWithBlockSize,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from kvlab.core.pool_observers import BlockPoolObserver, EventLogObserver, KVEventsObserver, MetricsCollectorObserver
from kvlab.utils.kv_events import MEDIUM_GPU, KVEvent
from kvlab.eventlog.events import EventLog
from kvlab.utils.checks import AssertedValueError, check_int
from kvlab.utils.hashing import BlockHash

if TYPE_CHECKING:
    from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector


class BlockHashToBlockMap:
    """cache key -> the block(s) carrying it.

    Usually one block per key, stored bare; a dict ``{block_id: block}`` once duplicates
    exist (two requests computed the same prefix at the same time, or the append-only
    table case of lesson 04). Duplicates are allowed because replacing a block already in
    a request's table would break the append-only tables the kernels read. A key that
    became a dict stays one while any block carries it -- down to a single block, as in
    vLLM: ``pop`` only puts back what is left, and the key leaves with its last block.
    """

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        v = self._cache.get(key)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))  # type: ignore[union-attr]  # a dict here: `type(v) is` above rules the lone block out (mypy narrows isinstance only)

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        v = self._cache.setdefault(key, block)  # the common case, a new key: one dict operation
        if v is block:
            return
        if type(v) is KVCacheBlock:
            self._cache[key] = {v.block_id: v, block.block_id: block}
        else:
            v[block.block_id] = block  # type: ignore[index]  # a dict here, as above

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id``'s entry under ``key``; other blocks under it stay."""
        cache = self._cache
        v = cache.pop(key, None)  # one dict operation in the common case (a lone block)
        if v is None:
            return None
        if type(v) is KVCacheBlock:
            if v.block_id == block_id:
                return v
            cache[key] = v  # another block carries the key: put it back
            return None
        blk = v.pop(block_id, None)  # type: ignore[union-attr]  # a dict here, as above
        if v:  # blocks are left: the key keeps its dict, even for one
            cache[key] = v
        return blk

    def blocks_for(self, key: bytes) -> list[KVCacheBlock]:
        v = self._cache.get(key)
        if v is None:
            return []
        return [v] if type(v) is KVCacheBlock else list(v.values())  # type: ignore[union-attr]  # a dict when not a lone block, as above

    def items(self) -> Iterable[tuple[bytes, list[KVCacheBlock]]]:
        for k in self._cache:
            yield k, self.blocks_for(k)

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: bytes) -> bool:
        return key in self._cache


class _Refused(Exception):
    def __init__(self, block: KVCacheBlock) -> None:
        self.block = block


def group_suffix(group_id: int) -> bytes:
    """The 4 bytes a group id adds to a block hash to make its map key (hot loops compute
    it once, then concatenate: ``make_block_hash_with_group_id`` without the call)."""
    return make_block_hash_with_group_id(b"", group_id)


def _freed_too_often(block: KVCacheBlock) -> ValueError:
    return ValueError(
        f"ordered_blocks: block {block.block_id} freed more often than it was allocated (it is held by "
        f"{block.ref_cnt} table(s) here); only a table that holds a block may free it"
    )


class BlockPool:
    """All KV blocks of all cache groups, allocated from one free queue.

    The methods with vLLM's names (``touch``, ``_maybe_evict_cached_block``) do exactly
    what vLLM's do; kvlab's events are recorded around them, so a subclass can swap one of
    them (the exercises run a learner's ``touch`` or eviction inside a real pool that way)
    and the recorded run still replays.
    """

    #: The free queue's class, called with every block in id order (head first). A seam:
    #: the free_queue exercise runs a learner's queue inside a real pool by setting it.
    free_queue_cls: Callable[[list[KVCacheBlock]], FreeKVCacheBlockQueue] = FreeKVCacheBlockQueue
    #: How a group with blocks larger than the hash block size reads a request's hashes (one
    #: per block: the last small hash inside it). A seam: the group_block_hash exercise runs a
    #: learner's view inside a real pool by setting it.
    block_hash_view_cls: Callable[[Sequence[BlockHash], int, int], Sequence[BlockHash]] = BlockHashListWithBlockSize

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        event_log: EventLog | None = None,
        *,
        enable_kv_cache_events: bool = False,
        kv_events_use_int_block_hashes: bool = True,
        metrics_collector: KVCacheMetricsCollector | None = None,
        prepend_uncached_blocks: bool = True,
        hash_block_size: int | None = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        # The pool is the door for the block count (KVCacheManager's num_blocks lands here).
        num_gpu_blocks = check_int("num_blocks", num_gpu_blocks, 2, why=" (block 0 is the null block)")
        for name, flag in (
            ("enable_kv_cache_events", enable_kv_cache_events),
            ("kv_events_use_int_block_hashes", kv_events_use_int_block_hashes),
            ("prepend_uncached_blocks", prepend_uncached_blocks),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        # Requests' hashes are computed every `hash_block_size` tokens (the GCD of the
        # groups' block sizes); a group with larger blocks reads the hash at each block end.
        # None (a bare pool): hashes are per block, whatever the block size.
        self.hash_block_size = hash_block_size
        # Tokens after each block that its hash covers (vLLM 0.33, multi-module MTP): the
        # pool only needs it to describe them in each BlockStored (``lookahead_token_ids``).
        self.num_hash_lookahead_tokens = check_lookahead_tokens(num_hash_lookahead_tokens)
        self.events = event_log
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = self.free_queue_cls(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # A block's keys beyond its own ``cache_key`` (vLLM 0.33's name; a set there, a list
        # here so that the order of its BlockRemoved events does not depend on the string
        # hash seed). Only partial prefix entries add them (``cache_partial_block``).
        self.cached_block_hashes_by_block: dict[int, list[bytes]] = {}
        # Whether a partial entry was made since the last reset: until then, every block has
        # at most one key, and the hot paths skip the look for more (kvlab's shortcut).
        self.has_partial_entries = False
        # The null block leaves the queue for good. Its ref count is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.num_evicted_blocks = 0
        # vLLM's KV cache events (kvlab.distributed.kv_events), drained by take_events().
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_events_use_int_block_hashes = kv_events_use_int_block_hashes
        self.medium = MEDIUM_GPU
        self.kv_event_queue: list[KVEvent] = []
        self.metrics_collector = metrics_collector
        self.prepend_uncached_blocks = prepend_uncached_blocks
        # Blocks released with ``unpin_blocks`` that their owner goes on reading until the pool
        # hands them out again (vLLM 0.33, HiSparse): block id -> whom to tell when it does.
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
        # Pools whose blocks a list freed here may hold too (vLLM 0.33 routes each block to its
        # own pool: HiSparse's host pool beside the GPU pool, in one request's blocks).
        self.sibling_pools: list[BlockPool] = []
        # kvlab's addition: every change is reported once, to each observer (kvlab.core.pool_observers).
        self.observers: list[BlockPoolObserver] = []
        if event_log is not None:
            self.observers.append(EventLogObserver(event_log))
        if enable_kv_cache_events:
            self.observers.append(KVEventsObserver())
        if metrics_collector is not None:
            self.observers.append(MetricsCollectorObserver(metrics_collector))

    # -- prefix cache -------------------------------------------------------------------------
    def resolve_block_hashes(self, block_hashes: Sequence[BlockHash], block_size: int) -> Sequence[BlockHash]:
        """A request's hashes seen at ``block_size`` (vLLM's ``resolve_block_hashes``): the list
        itself when hashes come once per block, else a :attr:`block_hash_view_cls` view."""
        hash_block_size = self.hash_block_size or block_size
        if block_size == hash_block_size or isinstance(block_hashes, BlockHashListWithBlockSize):
            return block_hashes
        return self.block_hash_view_cls(block_hashes, hash_block_size, block_size)

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        out = []
        get = self.cached_block_hash_to_block.get_one_block
        for gid in kv_cache_group_ids:
            blk = get(block_hash + group_suffix(gid))
            if blk is None:
                return None
            out.append(blk)
        return out

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Give blocks ``[num_cached_blocks, num_full_blocks)`` of a request their hashes.

        The hashes were already computed on the request (``request.block_hashes``, every
        ``hash_block_size`` tokens) as its tokens arrived; here they become map entries, so
        other requests can hit them. A block of a larger group takes the hash at its end.
        Null blocks, and blocks whose ``block_mask`` entry is False (a window block that can
        never serve a hit), are left out.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = self.resolve_block_hashes(request.block_hashes, block_size)
        if len(hashes) < num_full_blocks:
            raise RuntimeError(f"request {request.request_id!r} has {len(hashes)} block hashes, needs {num_full_blocks}")
        if num_cached_blocks < 0 or num_full_blocks > len(blocks):
            raise ValueError(f"cannot cache blocks [{num_cached_blocks}, {num_full_blocks}) of a table of {len(blocks)} blocks")
        suffix = group_suffix(kv_cache_group_id)
        insert = self.cached_block_hash_to_block.insert
        todo: Iterable[int] = range(num_cached_blocks, num_full_blocks)
        if block_mask is not None:  # a block that can never serve a hit is not cached
            if len(block_mask) != num_full_blocks - num_cached_blocks:
                raise ValueError(f"block_mask has {len(block_mask)} entries for {num_full_blocks - num_cached_blocks} blocks")
            todo = [i for i, keep in zip(todo, block_mask) if keep]
        for i in todo:  # all checked before the first change
            blk = blocks[i]
            if not blk.is_null and blk.cache_key is not None:
                n = blk.block_hash_num_tokens  # a partial entry (fewer tokens) is replaced below
                if n is None or n >= (i + 1) * block_size:
                    raise RuntimeError(f"block {blk.block_id} is already cached")
        dropped: list[tuple[KVCacheBlock, bytes]] = []
        has_partial = self.has_partial_entries
        for i in todo:
            blk = blocks[i]
            if blk.is_null:
                continue  # left the window / a state that is never read
            if has_partial and blk.cache_key is not None:  # a partial entry; the full block's key replaces it (vLLM 0.33)
                dropped += [(blk, k) for k in self._remove_cached_block_hashes(blk)]
            key = hashes[i] + suffix
            insert(key, blk)  # a duplicate key keeps both blocks
            blk.cache_key = key
            blk._hash_num_tokens = (i + 1) * block_size
        for o in self.observers:
            if dropped:
                o.on_cache_entries_dropped(self, dropped)
            o.on_blocks_cached(self, request, blocks, hashes, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> bytes | None:
        """Make ``block`` findable from a prefix boundary *inside* it (vLLM 0.33): the key is
        the request's hash at ``num_tokens`` (a multiple of the hash block size) plus the
        group id. Nothing is allocated or copied: the entry is one more name for a block the
        request already holds.

        Why: when a group's blocks are larger than the hash block (a hybrid model whose
        groups have different block sizes), a prompt usually ends inside a block, and
        without such an entry the tokens of that last, partly filled block could never be
        found again. A block without a key takes this one as its own ``cache_key`` -- so
        when it is freed it joins the free queue's *tail*, as cached blocks do; a block that
        has one keeps it and lists this one in ``cached_block_hashes_by_block``. Evicting
        the block drops every key it has (one ``BlockRemoved`` each); a fuller key (the
        whole block, once it fills, or a later boundary) replaces a partial one.

        ``replace_existing_hashes``: the block's contents were replaced, so its other keys
        go first. Returns the key (hash + group id), or None for the null block. Sends one
        ``BlockStored`` of one hash block (its tokens, its parent) unless the block already
        had this key."""
        if block.is_null:
            return None
        hash_block_size = self.hash_block_size or block_size
        if type(block_size) is not int or block_size <= 0 or block_size % hash_block_size:
            raise ValueError(f"block_size must be a positive multiple of the hash block size {hash_block_size}, got {block_size!r}")
        n = len(request.block_hashes)
        if type(num_tokens) is not int or num_tokens <= 0 or num_tokens % hash_block_size or num_tokens // hash_block_size > n:
            raise AssertedValueError(
                f"num_tokens must be a positive multiple of the hash block size {hash_block_size}, at most the "
                f"{n * hash_block_size} tokens request {request.request_id!r} has hashes for, got {num_tokens!r}"
            )
        kv_cache_group_id = check_int("kv_cache_group_id", kv_cache_group_id, 0)
        self._check_blocks("block", [block])
        num_hash_blocks = num_tokens // hash_block_size
        key = request.block_hashes[num_hash_blocks - 1] + group_suffix(kv_cache_group_id)
        bid = block.block_id
        extra = self.cached_block_hashes_by_block
        already_cached = block.cache_key == key or key in extra.get(bid, ())
        dropped: list[tuple[KVCacheBlock, bytes]] = []
        # New contents, or a later boundary than the block's partial key: its keys go first.
        held = block.block_hash_num_tokens
        if replace_existing_hashes or (not already_cached and held is not None and held < num_tokens):
            dropped = [(block, k) for k in self._remove_cached_block_hashes(block)]
            already_cached = False
        if not already_cached:
            self.has_partial_entries = True
            self.cached_block_hash_to_block.insert(key, block)
            if block.cache_key is None:
                block.cache_key = key
                block._hash_num_tokens = num_tokens
            else:
                extra.setdefault(bid, []).append(key)
        for o in self.observers:
            if dropped:
                o.on_cache_entries_dropped(self, dropped)
            if not already_cached:
                o.on_partial_block_cached(self, request, block, num_hash_blocks, hash_block_size, kv_cache_group_id)
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Give every key of ``src_block`` to ``dst_block`` instead (vLLM 0.33). Used when the
        request that saved a Mamba state inside ``src_block`` goes on writing into it: the
        cache keeps the copy (``dst_block``, filled by this step's block copy) under the same
        keys. The entries stay findable throughout, so no KV event is sent."""
        if dst_block.cache_key is not None or dst_block.block_id in self.cached_block_hashes_by_block:
            raise ValueError(f"move_block_hashes: block {dst_block.block_id} already has a cache key")
        num_tokens = src_block.block_hash_num_tokens
        extra = self.cached_block_hashes_by_block
        for key in self._remove_cached_block_hashes(src_block):
            self.cached_block_hash_to_block.insert(key, dst_block)
            if dst_block.cache_key is None:
                dst_block.cache_key = key
                dst_block._hash_num_tokens = num_tokens  # the length of the block's own key
            else:
                extra.setdefault(dst_block.block_id, []).append(key)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[bytes]:
        """Drop every key ``block`` carries (its own, then its partial entries) from the map
        and the block; returns those the map held (vLLM's ``_remove_cached_block_hashes``)."""
        keys = [] if block.cache_key is None else [block.cache_key]
        keys += self.cached_block_hashes_by_block.pop(block.block_id, ())
        pop = self.cached_block_hash_to_block.pop
        removed = [k for k in keys if pop(k, block.block_id) is not None]
        block.reset_hash()
        return removed

    # -- allocation ---------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int, request_id: str | None = None, group: int = 0) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the free-queue head; evict their old cache entries."""
        if type(num_blocks) is not int:
            num_blocks = check_int("num_blocks", num_blocks, 0)
        if not 0 <= num_blocks <= self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get num_blocks = {num_blocks} free blocks from the pool ({self.get_num_free_blocks()} free)")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(ret)
        dropped: list[tuple[KVCacheBlock, bytes]] = []
        if self.enable_caching:
            evict = self._maybe_evict_cached_block
            if not self.has_partial_entries:  # one key per block at most
                for b in ret:
                    key = b.cache_key
                    if key is not None and evict(b):  # lazy eviction: the old hash goes now
                        dropped.append((b, key))
                    b.ref_cnt += 1
                self.num_evicted_blocks += len(dropped)
            else:
                extra = self.cached_block_hashes_by_block
                for b in ret:
                    key = b.cache_key
                    if key is not None:
                        more = extra.get(b.block_id, ())
                        if evict(b):
                            self.num_evicted_blocks += 1
                            dropped += [(b, k) for k in (key, *more)]  # and its partial entries (vLLM 0.33)
                    b.ref_cnt += 1
        else:
            for b in ret:
                b.ref_cnt += 1
        for o in self.observers:
            o.on_blocks_allocated(self, ret, dropped, request_id, group)
        return ret

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Tell each watched block's owner that its contents are about to be overwritten."""
        for b in blocks:
            watcher = self._reuse_watchers.pop(b.block_id, None)
            if watcher is not None:
                watcher(b)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """Drop one reference to each block while its owner goes on reading it (vLLM 0.33,
        HiSparse). Why: a page whose host copy is complete need not hold GPU memory, but
        while nobody needs the memory it is cheaper to read it where it is. A block reaching
        ref 0 joins the free queue's *tail* -- the last to be handed out, cached or not --
        and counts as free; ``on_reuse(block)`` runs when ``get_new_blocks`` hands it out
        (or the cache is reset), so the owner stops reading it just in time."""
        blocks = list(blocks)
        self._check_blocks("blocks", blocks)
        for i, b in enumerate(blocks):
            if b.is_null or b.ref_cnt - sum(x is b for x in blocks[:i]) <= 0:
                raise ValueError(f"blocks[{i}] (block {b.block_id}) is not held: only a held block can be unpinned")
        released: list[KVCacheBlock] = []
        for b in blocks:
            b.ref_cnt -= 1
            self._reuse_watchers[b.block_id] = on_reuse
            if b.ref_cnt == 0:
                released.append(b)
        self.free_block_queue.append_n(released)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """A cached block is being reallocated: drop exactly its own map entry (duplicates
        under the same key stay) and its hash -- lazy eviction (lesson 04). Returns whether
        it was cached. (The stale_hash exercise swaps this method.)"""
        key = block.cache_key
        if key is None:
            return False
        if self.has_partial_entries:
            return bool(self._remove_cached_block_hashes(block))  # it may have more than one key
        self.cached_block_hash_to_block.pop(key, block.block_id)
        block.cache_key = None  # block.reset_hash(), without the call (hot path)
        return True

    def evict_blocks(self, block_ids: set[int] | Sequence[int]) -> list[int]:
        """Drop these blocks' prefix-cache entries, held or free (vLLM's ``evict_blocks``):
        a KV connector reported that their contents did not load, so no request may hit
        them (lesson 13). Returns the ids that were cached, in the order given."""
        n = len(self.blocks)
        ids = list(block_ids)
        for bid in ids:
            if not isinstance(bid, int) or not 0 <= bid < n:
                raise ValueError(f"evict_blocks: block id {bid!r} is not a block of this pool (0..{n - 1})")
        if self.observers:
            named = [self.blocks[bid] for bid in ids]
            for o in self.observers:
                o.on_evict_requested(self, named)
        dropped: list[tuple[KVCacheBlock, bytes]] = []
        extra = self.cached_block_hashes_by_block
        for bid in ids:
            b = self.blocks[bid]
            key = b.cache_key
            more = extra.get(bid, ())
            if key is not None and self._maybe_evict_cached_block(b):
                dropped += [(b, k) for k in (key, *more)]
        for o in self.observers:
            o.on_cache_entries_dropped(self, dropped)
        return list(dict.fromkeys(b.block_id for b, _ in dropped))

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit adopts ``blocks`` (one group's, vLLM's flat list): ref += 1, and a
        ref-0 block leaves the free queue *first*, so it cannot be evicted while the request
        is adopting it (lesson 04). The null block is skipped: its ref count is not kept.
        (The caller records the ``BlocksTouched`` event; the touch exercise swaps this.)"""
        self._check_blocks("blocks", blocks)
        remove = self.free_block_queue.remove
        for b in blocks:
            if b.ref_cnt == 0:
                if b.is_null:  # its ref count is not kept (it stays 0)
                    continue
                remove(b)
            b.ref_cnt += 1
        for o in self.observers:
            o.on_blocks_touched(self, blocks)

    def free_blocks(
        self, ordered_blocks: Iterable[KVCacheBlock], request_id: str | None = None, group: int = 0, reason: str = "request"
    ) -> None:
        """ref -= 1; blocks reaching 0 return to the queue. ``ordered_blocks`` is in
        eviction priority: a finished request passes its blocks tail first."""
        foreign: Sequence[tuple[BlockPool, list[KVCacheBlock]]] = ()
        if self.sibling_pools:  # this pool's blocks here, the others' after (each to its pool)
            ordered_blocks, foreign = self._split_foreign(ordered_blocks)
            for pool, blocks in foreign:  # all or nothing: a refusal there must come before any free here
                pool._check_can_free(blocks)
        with_hash: list[KVCacheBlock] = []
        without_hash: list[KVCacheBlock] = []
        caching = self.enable_caching
        # vLLM <= 0.22 (prepend_uncached_blocks=False): every freed block joins the tail.
        to_head_ok = self.prepend_uncached_blocks
        ordered = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        it = iter(ordered)
        try:
            for b in it:
                if b.is_null:
                    continue
                if b.ref_cnt <= 0:
                    raise _Refused(b)
                b.ref_cnt -= 1
                if b.ref_cnt == 0:
                    if to_head_ok and (b.cache_key is None or not caching):
                        without_hash.append(b)
                    else:
                        with_hash.append(b)
        except (_Refused, AttributeError) as e:
            # All or nothing at no cost to the common path: the blocks before the refused one
            # get their ref counts back (nothing else has changed yet).
            for done in ordered[: len(ordered) - len(list(it)) - 1]:
                if not done.is_null:
                    done.ref_cnt += 1
            if isinstance(e, _Refused):
                self._check_blocks("ordered_blocks", ordered)  # another pool's block: say so
                raise _freed_too_often(e.block) from None
            self._check_blocks("ordered_blocks", ordered)  # names the item that is not a block
            raise
        self.free_block_queue.prepend_n(without_hash)
        self.free_block_queue.append_n(with_hash)
        for o in self.observers:
            o.on_blocks_freed(self, ordered, without_hash, with_hash, request_id, group, reason)
        for pool, blocks in foreign:
            pool.free_blocks(blocks, request_id, group, reason)

    def _check_can_free(self, blocks: list[KVCacheBlock]) -> None:
        """Refuse, changing nothing, a list that frees a block more often than tables hold
        it (what ``free_blocks`` would refuse half way)."""
        times: dict[int, int] = {}
        for b in blocks:
            if not b.is_null:
                times[b.block_id] = times.get(b.block_id, 0) + 1
        for b in blocks:
            if not b.is_null and times[b.block_id] > b.ref_cnt:
                raise _freed_too_often(b)

    def _split_foreign(self, blocks: Iterable[KVCacheBlock]) -> tuple[list[KVCacheBlock], list[tuple[BlockPool, list[KVCacheBlock]]]]:
        """This pool's blocks, and the sibling pools' ones by pool (each list in the order
        given); a block of no known pool stays in the first list, for the check to name."""
        own = self.blocks
        mine: list[KVCacheBlock] = []
        foreign: dict[int, tuple[BlockPool, list[KVCacheBlock]]] = {}
        for b in blocks:
            bid = getattr(b, "block_id", None)
            if type(bid) is int and 0 <= bid < len(own) and own[bid] is b:
                mine.append(b)
                continue
            for pool in self.sibling_pools:
                if type(bid) is int and 0 <= bid < len(pool.blocks) and pool.blocks[bid] is b:
                    foreign.setdefault(id(pool), (pool, []))[1].append(b)
                    break
            else:
                mine.append(b)
        return mine, list(foreign.values())

    def _check_blocks(self, name: str, blocks: Any) -> None:
        """Every item is a block of THIS pool (not a copy, not another pool's). The common
        case -- a list of this pool's blocks -- is one comprehension; anything else is walked
        item by item, to name the first bad one."""
        own = self.blocks
        if type(blocks) is list:
            try:
                if not [b for b in blocks if own[b.block_id] is not b]:
                    return
            except (AttributeError, IndexError, TypeError):
                pass  # not a block, or an id that is not one of ours: the walk below says which
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
            raise TypeError(f"{name} must be a list of KVCacheBlock, got {type(blocks).__name__}")
        for i, b in enumerate(blocks):
            if type(b) is not KVCacheBlock and not isinstance(b, KVCacheBlock):
                raise TypeError(f"{name}[{i}] must be a KVCacheBlock, got {type(b).__name__} {b!r}")
            bid = b.block_id
            if not (type(bid) is int and 0 <= bid < len(own) and own[bid] is b):
                raise ValueError(f"{name}[{i}] (block {bid!r}) is not a block of this pool")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix -- allowed only when no request holds a block."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:  # only the null block may be "in use"
            for o in self.observers:
                o.on_cache_reset(self, False)
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        self.has_partial_entries = False
        if self._reuse_watchers:  # what an owner still read is forgotten with the rest
            self._notify_reuse([self.blocks[bid] for bid in list(self._reuse_watchers)])
        for b in self.blocks:
            b.reset_hash()
        for o in self.observers:
            o.on_cache_reset(self, True)
        return True

    def emit_cached_block_events(self, request: Any, num_cached_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
        """Tell the KV-event stream about a prefix hit: one ``BlockStored`` for the request's
        first ``num_cached_blocks`` blocks of ``block_size`` tokens in group
        ``kv_cache_group_id``, as if they had just been cached. Changes no block (they are
        cached already). vLLM 0.33 sends it for a request that asks for the full report
        (``kv_cache_report_mode="full"``), so that a router that missed -- or dropped -- the
        original ``BlockStored`` learns where that prefix lives."""
        num_cached_blocks = check_int("num_cached_blocks", num_cached_blocks, 0)
        block_size = check_int("block_size", block_size, 1)
        kv_cache_group_id = check_int("kv_cache_group_id", kv_cache_group_id, 0)
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        hashes = self.resolve_block_hashes(request.block_hashes, block_size)
        if num_cached_blocks > len(hashes):
            raise ValueError(
                f"num_cached_blocks = {num_cached_blocks}, but request {request.request_id!r} has only {len(hashes)} "
                f"full blocks of {block_size} tokens"
            )
        hit = [hashes[i] for i in range(num_cached_blocks)]
        for o in self.observers:
            o.on_cached_blocks_reported(self, request, hit, block_size, kv_cache_group_id)

    def take_events(self) -> list[KVEvent]:
        """Every queued KV cache event, oldest first; the queue starts empty again."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use, null block excluded. Counts *blocks*, not tokens:
        a 17-token prompt at block size 16 uses 2 blocks (lesson 08)."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    # -- debugging ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Walk every structure and raise AssertionError on the first inconsistency."""
        q = self.free_block_queue
        seen: set[int] = set()
        own_queue = isinstance(q, FreeKVCacheBlockQueue)
        if own_queue:  # walk the links themselves
            prev = q.fake_free_list_head
            cur = prev.next_free_block
            free: list[KVCacheBlock] = []
            while cur is not q.fake_free_list_tail:
                assert cur is not None, "free queue is broken: a link is None before the tail"
                assert cur.prev_free_block is prev, f"free queue: block {cur.block_id} has a wrong prev link"
                assert cur.block_id not in seen, f"free queue: block {cur.block_id} appears twice"
                free.append(cur)
                seen.add(cur.block_id)
                prev, cur = cur, cur.next_free_block
            assert q.fake_free_list_tail.prev_free_block is prev, "free queue: tail sentinel has a wrong prev link"
        else:  # another class (a learner's queue): what it lists
            free = list(q.get_all_free_blocks())
        for cur in free:
            assert cur is self.blocks[cur.block_id], f"free queue: block {cur.block_id} is not a block of this pool"
            assert not cur.is_null, "the null block is in the free queue"
            assert cur.ref_cnt == 0, f"block {cur.block_id} is free but has ref_cnt {cur.ref_cnt}"
            seen.add(cur.block_id)
        assert len(seen) == len(free), "free queue: a block appears twice"
        assert len(seen) == q.num_free_blocks, f"free queue holds {len(seen)} blocks but counts {q.num_free_blocks}"
        for b in self.blocks:
            if b.is_null:
                assert b.block_id == 0 and b.cache_key is None
                continue
            if b.block_id not in seen:
                assert b.ref_cnt > 0, f"block {b.block_id} is neither free nor referenced (ref_cnt {b.ref_cnt})"
                assert not own_queue or (b.prev_free_block is None and b.next_free_block is None), (
                    f"used block {b.block_id} has queue links"
                )
            if b.cache_key is not None:
                assert self.enable_caching, f"block {b.block_id} is cached but caching is off"
                assert b in self.cached_block_hash_to_block.blocks_for(b.cache_key), f"cached block {b.block_id} is missing from the map"
            for k in self.cached_block_hashes_by_block.get(b.block_id, ()):
                assert b.cache_key is not None, f"block {b.block_id} has partial entries but no key of its own"
                assert b in self.cached_block_hash_to_block.blocks_for(k), f"partial entry of block {b.block_id} is missing from the map"
        assert self.has_partial_entries or not self.cached_block_hashes_by_block, "partial entries exist but has_partial_entries is False"
        n_entries = 0
        for key, blks in self.cached_block_hash_to_block.items():
            assert blks, f"empty map entry for {key.hex()[:8]}"
            for blk in blks:
                n_entries += 1
                assert blk.cache_key == key or key in self.cached_block_hashes_by_block.get(blk.block_id, ()), (
                    f"map entry {key.hex()[:8]} points to block {blk.block_id} with another hash"
                )
        num_keys = sum(b.cache_key is not None for b in self.blocks) + sum(map(len, self.cached_block_hashes_by_block.values()))
        assert n_entries == num_keys, "map and block hashes disagree"
        used = sum(1 for b in self.blocks if not b.is_null and b.block_id not in seen)
        assert used + q.num_free_blocks + 1 == self.num_gpu_blocks, "free + used + null != total"
