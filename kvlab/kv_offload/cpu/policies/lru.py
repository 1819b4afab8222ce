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
        for key in keys:
            if key in self.chunks:
                self._ranks[key] = (self._fresh_rank(), 0)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.chunks[key] = chunk
        pos = req_context.get_offload_key_position(key)
        self._ranks[key] = (self._fresh_rank(), 0) if pos is None else (self._request_rank(req_context), -pos)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._rerank(reversed(list(keys)))  # the first key ends up the most recent

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        rank = self._request_rank(req_context)
        for key in keys:
            pos = req_context.get_offload_key_position(key)
            if pos is not None and key in self.chunks and self._ranks[key] < (rank, -pos):
                self._ranks[key] = (rank, -pos)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._rerank(reversed(order_request_keys(key_groups, req_context)))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        ranks = self._ranks
        victims = heapq.nsmallest(n, ((ranks[k], k) for k in self._evictable if k not in protected))
        if len(victims) < n:
            return None
        out = []
        for _, key in victims:
            out.append((key, self.chunks.pop(key)))
            del ranks[key]
            self._evictable.remove(key)
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._next_rank = 0
        self._cache_generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)

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
        return new
