"""LRU with per-request recency (vLLM 0.33: ``vllm/v1/kv_offload/cpu/policies/lru.py``).

Every chunk has a rank, a pair compared as a tuple; eviction takes the unpinned chunks of
lowest rank first (ties -- two groups' keys at one position -- broken by the key bytes).

* A chunk stored for a request whose scheduler recorded the key's end-token position gets
  ``(request rank, -position)``: all chunks of one request share its rank, and among them
  the **tail has the lowest rank, so it leaves first** -- the GPU pool's reverse-order
  freeing (lesson 04b), in the tier.
* A request reading or offering chunks lifts them to its own rank the same way
  (``on_request_access``), and when it finishes its chunks get fresh ranks, **tail first,
  head last** (``on_request_finished``): the head, which every later request with the same
  prefix needs, is the most recently used.
* A chunk stored or touched with no position gets a fresh rank of its own.

The rank is logical: a chunk's recency can change while it is pinned, and it goes back in
line by that rank when it is unpinned -- not by when its transfer completed.

The line is a lazy min-heap of ``(rank, key)`` entries (``_heap``), as vLLM keeps it: a new
rank or an unpinning pushes an entry and leaves the old one in place; ``evict`` skips an
entry that is no longer current (the key pinned, gone, or ranked again). Stale entries pile
up -- a chunk read over and over leaves one per read -- so the heap is rebuilt from the
evictable keys once it holds ``max(64, 2 x evictable)`` entries, and at once when a single
update re-ranks many keys (a long prefix: one ``heapify`` beats that many pushes).

The first offloading releases kept a plain per-block LRU: a store or a read moved the block to
the tail, head before tail, so a request's head left before its tail.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.kv_offload.base import OffloadKey, ReqContext
from kvlab.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, copy_chunks, order_request_keys

Rank = tuple[int, int]
HeapEntry = tuple[Rank, OffloadKey]
#: The heap is never rebuilt below this many entries (vLLM's floor for both rebuilds).
_MIN_REBUILD = 64


@dataclass(slots=True)
class _RequestRank:
    """The rank a request's chunks share, kept in its ReqContext (one per policy -- kvlab's
    two tiers each have one -- and cache generation: a cleared cache hands out ranks afresh)."""

    cache_generation: int
    rank: int


class LRUCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._ranks: dict[OffloadKey, Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[HeapEntry] = []  # lazy: may hold stale entries, see the module doc
        self._next_rank = 0
        self._cache_generation = 0

    def _fresh_rank(self) -> int:
        self._next_rank += 1
        return self._next_rank

    def _request_rank(self, req_context: ReqContext) -> int:
        st = req_context.owned_state(self, _RequestRank)
        if st is None or st.cache_generation != self._cache_generation:
            st = _RequestRank(self._cache_generation, self._fresh_rank())
            req_context.set_owned_state(self, st)
        return st.rank

    def _rerank(self, keys: Iterable[OffloadKey]) -> None:
        """A fresh rank for each present key, in the order given (the last is the newest)."""
        moved = []
        for key in keys:
            if key in self.chunks:
                self._ranks[key] = (self._fresh_rank(), 0)
                if key in self._evictable:
                    moved.append(key)
        self._requeue(moved)

    def _push(self, key: OffloadKey) -> None:
        heapq.heappush(self._heap, (self._ranks[key], key))

    def _rebuild(self) -> None:
        """One current entry per evictable key, nothing stale."""
        ranks = self._ranks
        self._heap = [(ranks[k], k) for k in self._evictable]
        heapq.heapify(self._heap)

    def _compact_if_stale(self) -> None:
        if len(self._heap) >= max(_MIN_REBUILD, 2 * len(self._evictable)):
            self._rebuild()

    def _requeue(self, moved: Sequence[OffloadKey]) -> None:
        """Put evictable keys whose rank just changed back in line: push each, or rebuild when
        they are many (at least 64 and a quarter of the evictable keys)."""
        if not moved:
            return
        if len(moved) >= max(_MIN_REBUILD, len(self._evictable) // 4):
            self._rebuild()
            return
        for key in moved:
            self._push(key)
        self._compact_if_stale()

    def _is_current(self, entry: HeapEntry) -> bool:
        rank, key = entry
        return key in self._evictable and self._ranks.get(key) == rank

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.chunks[key] = chunk
        pos = req_context.get_offload_key_position(key)
        self._ranks[key] = (self._fresh_rank(), 0) if pos is None else (self._request_rank(req_context), -pos)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            self._push(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._rerank(reversed(list(keys)))  # the first key ends up the most recent

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        rank = self._request_rank(req_context)
        moved = []
        for key in keys:
            pos = req_context.get_offload_key_position(key)
            if pos is not None and key in self.chunks and self._ranks[key] < (rank, -pos):
                self._ranks[key] = (rank, -pos)
                if key in self._evictable:
                    moved.append(key)
        self._requeue(moved)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._rerank(reversed(order_request_keys(key_groups, req_context)))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Pop entries lowest rank first, skipping stale ones (and a key met twice: pinned and
        unpinned without a new rank, it has two equal current entries); protected ones are
        set aside and pushed back. Too few: every popped current entry goes back, no change."""
        if n == 0:
            return []
        heap = self._heap
        taken: list[HeapEntry] = []
        kept: list[HeapEntry] = []  # current but protected
        seen: set[OffloadKey] = set()
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            key = entry[1]
            if not self._is_current(entry) or key in seen:
                continue
            seen.add(key)
            (kept if key in protected else taken).append(entry)
        for entry in kept if len(taken) == n else kept + taken:
            heapq.heappush(heap, entry)
        if len(taken) < n:
            return None
        out = []
        for _, key in taken:
            out.append((key, self.chunks.pop(key)))
            del self._ranks[key]
            self._evictable.remove(key)
        self._compact_if_stale()
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0
        self._cache_generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)
        self._compact_if_stale()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)  # its heap entry goes stale, skipped by evict

    def items(self) -> Iterator[tuple[OffloadKey, ChunkStatus]]:
        ranks = self._ranks
        for key in sorted(self.chunks, key=lambda k: (ranks[k], k)):
            yield key, self.chunks[key]

    def __len__(self) -> int:
        return len(self.chunks)

    def __deepcopy__(self, memo: dict[int, Any]) -> LRUCachePolicy:
        """The engine copies the connector's books before every step (an undone step is put
        back, lesson 00): one pass over plain data instead of the generic walk."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.chunks = copy_chunks(self.chunks, memo)
        new._ranks = dict(self._ranks)
        new._evictable = set(self._evictable)
        new._heap = list(self._heap)
        return new

    def check_invariants(self) -> None:
        """Every evictable key has a current entry in the heap, and the heap is a heap."""
        heap = self._heap
        current = {e[1] for e in heap if self._is_current(e)}
        assert current == self._evictable, f"evictable keys without a current heap entry: {self._evictable - current}"
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "the LRU heap is out of order"
