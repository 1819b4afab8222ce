"""Who hears what the block pool does: one protocol, three observers.

The pool reports each change once, to every observer it was built with, in the words of
the pool (blocks allocated, entries dropped, blocks cached, touched, freed, the cache
reset). Each observer turns that into its own vocabulary:

* :class:`EventLogObserver` -- kvlab's :class:`~kvlab.eventlog.events.EventLog`, which the
  pictures replay (``BlocksAllocated``, ``BlockEvicted``, ``BlockCached``, ``BlocksFreed``,
  ``CacheReset``);
* :class:`KVEventsObserver` -- vLLM's KV cache events, queued on the pool for
  ``take_events()`` at the moments vLLM's pool queues them (``BlockStored`` once per run of
  newly hashed blocks, ``BlockRemoved`` per hash dropped, ``AllBlocksCleared``);
* :class:`MetricsCollectorObserver` -- vLLM's ``KVCacheMetricsCollector`` (sampled block
  residency, lesson 08): a reused block's residency ends and a new one may start, a hit
  is an access, a reset forgets everything.

vLLM calls its KV-event queue and its metrics collector inline in ``BlockPool``; kvlab
has a third listener (the event log), so the three share one door instead of three sets of
``if ... is not None`` in the code the lessons read. Observers see a change after it is
complete; the transaction (``kvlab.core.transaction``) undoes what they recorded when a
call is undone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from kvlab.core.kv_cache_utils import (
    KVCacheBlock,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from kvlab.utils.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.eventlog.events import BlockCached, BlockEvicted, BlocksAllocated, BlocksFreed, CacheReset, EventLog
from kvlab.eventlog.schema import HashKeys
from kvlab.utils.hashing import BlockHash

if TYPE_CHECKING:
    from kvlab.core.block_pool import BlockPool
    from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector

__all__ = ["BlockPoolObserver", "EventLogObserver", "KVEventsObserver", "MetricsCollectorObserver"]

#: (block, the cache key it lost), in the order the pool dropped them.
Dropped = Sequence[tuple[KVCacheBlock, bytes]]


class BlockPoolObserver:
    """What a :class:`~kvlab.core.block_pool.BlockPool` reports; every method does nothing
    unless an observer overrides it. ``pool`` is the reporting pool, as it is after the change."""

    def on_blocks_allocated(
        self, pool: BlockPool, blocks: Sequence[KVCacheBlock], dropped: Dropped, request_id: str | None, group: int
    ) -> None:
        """``blocks`` left the free-queue head (ref count now 1); reusing them dropped the
        cache entries in ``dropped`` (lazy eviction)."""

    def on_cache_entries_dropped(self, pool: BlockPool, dropped: Dropped) -> None:
        """Cache entries dropped without a reuse: ``evict_blocks`` (a failed KV load), or an
        undone step whose executor may have overwritten the blocks."""

    def on_evict_requested(self, pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
        """``evict_blocks`` was asked to drop these blocks' entries (each one, cached or not,
        before any is dropped)."""

    def on_blocks_cached(
        self,
        pool: BlockPool,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """Blocks ``[num_cached_blocks, num_full_blocks)`` of a request's table got their
        hashes (null blocks and those ``block_mask`` leaves out excepted)."""

    def on_partial_block_cached(
        self, pool: BlockPool, request: Any, block: KVCacheBlock, num_hash_blocks: int, hash_block_size: int, group: int
    ) -> None:
        """``block`` got a partial prefix entry: the request's hash after ``num_hash_blocks``
        hash blocks, a boundary inside the block (``cache_partial_block``)."""

    def on_blocks_touched(self, pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit adopted ``blocks`` (null blocks included, as the table holds them)."""

    def on_blocks_freed(
        self,
        pool: BlockPool,
        blocks: Sequence[KVCacheBlock],
        to_head: Sequence[KVCacheBlock],
        to_tail: Sequence[KVCacheBlock],
        request_id: str | None,
        group: int,
        reason: str,
    ) -> None:
        """A table gave ``blocks`` back; those whose ref count reached 0 joined the queue's
        head (never cached) or tail (cached), in that order."""

    def on_cache_reset(self, pool: BlockPool, success: bool) -> None:
        """``reset_prefix_cache`` ran (it succeeds only when no request holds a block)."""

    def on_cached_blocks_reported(self, pool: BlockPool, request: Any, hashes: Sequence[BlockHash], block_size: int, group: int) -> None:
        """Nothing changed: a request's prefix hit of ``len(hashes)`` blocks (its first ones,
        ``hashes`` at ``block_size``) is told again, for a request that asked for the full
        report (``kv_cache_report_mode="full"``)."""


def cached_positions(blocks: Sequence[KVCacheBlock], num_cached: int, num_full: int, block_mask: Sequence[bool] | None) -> list[int]:
    """The table positions a ``cache_full_blocks`` call gave a hash: not null, not masked out."""
    todo = range(num_cached, num_full)
    if block_mask is not None:
        return [i for i, keep in zip(todo, block_mask) if keep and not blocks[i].is_null]
    return [i for i in todo if not blocks[i].is_null]


class EventLogObserver(BlockPoolObserver):
    """kvlab's event log: the pictures' record of every pool change."""

    __slots__ = ("log",)

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def on_blocks_allocated(
        self, pool: BlockPool, blocks: Sequence[KVCacheBlock], dropped: Dropped, request_id: str | None, group: int
    ) -> None:
        self.on_cache_entries_dropped(pool, dropped)
        self.log.emit(BlocksAllocated(request_id=request_id, group=group, block_ids=[b.block_id for b in blocks]))

    def on_cache_entries_dropped(self, pool: BlockPool, dropped: Dropped) -> None:
        emit = self.log.emit
        for b, key in dropped:
            emit(BlockEvicted(block_id=b.block_id, block_hash=get_block_hash(key), group=get_group_id(key)))

    def on_blocks_cached(
        self,
        pool: BlockPool,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        emit = self.log.emit
        tokens = request.all_token_ids
        for i in cached_positions(blocks, num_cached_blocks, num_full_blocks, block_mask):
            emit(
                BlockCached(
                    request_id=request.request_id,
                    group=group,
                    block_id=blocks[i].block_id,
                    block_hash=hashes[i],
                    parent_hash=hashes[i - 1] if i else None,
                    token_ids=list(tokens[i * block_size : (i + 1) * block_size]),
                    extra_keys=cast("HashKeys | None", generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size)),
                )
            )

    def on_partial_block_cached(
        self, pool: BlockPool, request: Any, block: KVCacheBlock, num_hash_blocks: int, hash_block_size: int, group: int
    ) -> None:
        hashes = request.block_hashes
        start, end = (num_hash_blocks - 1) * hash_block_size, num_hash_blocks * hash_block_size
        self.log.emit(
            BlockCached(
                request_id=request.request_id,
                group=group,
                block_id=block.block_id,
                block_hash=hashes[num_hash_blocks - 1],
                parent_hash=hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None,
                token_ids=list(request.all_token_ids[start:end]),
                extra_keys=cast("HashKeys | None", generate_block_hash_extra_keys(request, start, end)),
            )
        )

    def on_blocks_freed(
        self,
        pool: BlockPool,
        blocks: Sequence[KVCacheBlock],
        to_head: Sequence[KVCacheBlock],
        to_tail: Sequence[KVCacheBlock],
        request_id: str | None,
        group: int,
        reason: str,
    ) -> None:
        self.log.emit(
            BlocksFreed(
                request_id=request_id,
                group=group,
                block_ids=[b.block_id for b in blocks],
                to_head=[b.block_id for b in to_head],
                to_tail=[b.block_id for b in to_tail],
                reason=reason,
            )
        )

    def on_cache_reset(self, pool: BlockPool, success: bool) -> None:
        self.log.emit(CacheReset(success=success))


class KVEventsObserver(BlockPoolObserver):
    """vLLM's KV cache events, appended to ``pool.kv_event_queue`` (medium and hash format
    from the pool: ``pool.medium``, ``pool.kv_events_use_int_block_hashes``)."""

    __slots__ = ()

    def on_blocks_allocated(
        self, pool: BlockPool, blocks: Sequence[KVCacheBlock], dropped: Dropped, request_id: str | None, group: int
    ) -> None:
        self.on_cache_entries_dropped(pool, dropped)

    def on_cache_entries_dropped(self, pool: BlockPool, dropped: Dropped) -> None:
        """One ``BlockRemoved`` per dropped hash, as vLLM sends them (key = hash + 4-byte group id)."""
        use_int = pool.kv_events_use_int_block_hashes
        for _, key in dropped:
            pool.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(get_block_hash(key), use_int)], medium=pool.medium, group_idx=get_group_id(key)
                )
            )

    def on_blocks_cached(
        self,
        pool: BlockPool,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """One ``BlockStored`` for the whole run, as vLLM's ``cache_full_blocks`` sends it:
        hashes and extra keys of the non-null blocks only (a sliding window's dropped blocks
        are skipped -- if all were dropped the event still goes out, with no hashes), but
        ``token_ids`` of the whole range ``[num_cached, num_full)``."""
        positions = cached_positions(blocks, num_cached_blocks, num_full_blocks, block_mask)
        parent = hashes[num_cached_blocks - 1] if num_cached_blocks else None
        pool.kv_event_queue.append(
            _block_stored(pool, request, hashes, positions, parent, num_cached_blocks, num_full_blocks, block_size, group)
        )

    def on_partial_block_cached(
        self, pool: BlockPool, request: Any, block: KVCacheBlock, num_hash_blocks: int, hash_block_size: int, group: int
    ) -> None:
        """One ``BlockStored`` of one hash block, as vLLM 0.33's ``cache_partial_block`` sends
        it: the hash at the boundary, its parent, the ``hash_block_size`` tokens before the
        boundary (``block_size`` is that count, not the group's)."""
        hashes = request.block_hashes
        i = num_hash_blocks - 1
        parent = hashes[i - 1] if i else None
        pool.kv_event_queue.append(_block_stored(pool, request, hashes, (i,), parent, i, i + 1, hash_block_size, group))

    def on_cache_reset(self, pool: BlockPool, success: bool) -> None:
        if success:
            pool.kv_event_queue.append(AllBlocksCleared())

    def on_cached_blocks_reported(self, pool: BlockPool, request: Any, hashes: Sequence[BlockHash], block_size: int, group: int) -> None:
        """One ``BlockStored`` for the whole hit, shaped like a caching one (vLLM 0.33's
        ``emit_cached_block_events``): every position's hash, null blocks' too, no parent (a
        hit starts at block 0), the tokens of all its blocks."""
        n = len(hashes)
        pool.kv_event_queue.append(_block_stored(pool, request, hashes, range(n), None, 0, n, block_size, group))


def _block_stored(
    pool: BlockPool,
    request: Any,
    hashes: Sequence[BlockHash],
    positions: Iterable[int],
    parent: BlockHash | None,
    first_block: int,
    end_block: int,
    block_size: int,
    group: int,
) -> BlockStored:
    """The one ``BlockStored`` shape (vLLM's ``_build_block_stored_event``, shared by newly
    cached blocks and a reported hit): the hashes and extra keys of the blocks at
    ``positions``, the tokens of blocks ``[first_block, end_block)``, the request's adapter
    (vLLM: ``lora_request.adapter_id`` and its name)."""
    use_int = pool.kv_events_use_int_block_hashes
    positions = list(positions)
    # With lookahead hashes (vLLM 0.33) each block's extra keys cover its lookahead tokens
    # too, and the event lists those tokens, so a consumer can recompute every hash.
    la = pool.num_hash_lookahead_tokens
    ids = request.all_token_ids
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(hashes[i], use_int) for i in positions],
        parent_block_hash=None if parent is None else maybe_convert_block_hash(parent, use_int),
        token_ids=list(ids[first_block * block_size : end_block * block_size]),
        block_size=block_size,
        lora_id=getattr(request, "lora_int_id", None),
        medium=pool.medium,
        lora_name=getattr(request, "lora_name", None),
        extra_keys=to_event_extra_keys(
            [generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size + la) for i in positions]
        ),
        group_idx=group,
        session_id=getattr(request, "session_id", None),
        lookahead_token_ids=[list(ids[(i + 1) * block_size : (i + 1) * block_size + la]) for i in positions] if la else None,
    )


class MetricsCollectorObserver(BlockPoolObserver):
    """vLLM's ``KVCacheMetricsCollector``, told of the three moments it samples. vLLM ends a
    residency inside ``_maybe_evict_cached_block``, which runs for every reused block when
    caching is on (cached or not) -- so with caching off a reuse ends nothing -- and for every
    block ``evict_blocks`` names."""

    __slots__ = ("collector",)

    def __init__(self, collector: KVCacheMetricsCollector) -> None:
        self.collector = collector

    def on_blocks_allocated(
        self, pool: BlockPool, blocks: Sequence[KVCacheBlock], dropped: Dropped, request_id: str | None, group: int
    ) -> None:
        c = self.collector
        if pool.enable_caching:
            for b in blocks:  # vLLM's order per block: the old residency ends, a new one may start
                c.on_block_evicted(b)
                c.on_block_allocated(b)
        else:
            for b in blocks:
                c.on_block_allocated(b)

    def on_blocks_touched(self, pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
        c = self.collector
        for b in blocks:
            if not b.is_null:
                c.on_block_accessed(b)

    def on_evict_requested(self, pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
        # vLLM ends the residency of every block evict_blocks names, held or free, cached or not.
        for b in blocks:
            self.collector.on_block_evicted(b)

    def on_cache_reset(self, pool: BlockPool, success: bool) -> None:
        if success:
            self.collector.reset()
