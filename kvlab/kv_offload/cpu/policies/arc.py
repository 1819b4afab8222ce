"""ARC, Adaptive Replacement Cache (vLLM 0.33: ``vllm/v1/kv_offload/cpu/policies/arc.py``).

Two lists of resident chunks -- **T1**, seen once (stored), and **T2**, reused -- and two
*ghost* lists of keys recently evicted from each, **B1** and **B2** (keys only, no data).
A target size for T1 moves with what the ghosts say:

* a request offers a key found in B1 (evicted from T1, wanted again): recency was
  under-served, the target grows by ``max(1, |B2|/|B1|)``;
* found in B2: frequency was under-served, the target shrinks by ``max(1, |B1|/|B2|)``.

Eviction takes T1's least recent unpinned chunk while T1 is at least its target, else T2's
(falling back to the other list), and remembers the victim in the matching ghost list;
each ghost list keeps at most ``cache_capacity`` keys. A chunk enters T1 when stored, and
moves to T2 when a request that did not store it read it -- committed when that request
finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvlab.kv_offload.base import OffloadKey, ReqContext
from kvlab.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, copy_chunks, order_request_keys


class ARCCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _ghost_hit(self, key: OffloadKey) -> None:
        """Move the target toward the list whose ghost remembered ``key``."""
        b1, b2 = self.b1, self.b2
        if key in b1:
            self.target_t1_size = min(self.target_t1_size + max(1, len(b2) / len(b1)), self.cache_capacity)
            b1.move_to_end(key)
        elif key in b2:
            self.target_t1_size = max(self.target_t1_size - max(1, len(b1) / len(b2)), 0)
            b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            self._ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                chunk = self.t1.pop(key)
                # A chunk still being written was stored, not used twice: it stays in T1.
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:  # stored, not reused: recency only
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused_keys:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        t1_left = (kv for kv in self.t1.items() if kv[1].ref_cnt == 0 and kv[0] not in protected)
        t2_left = (kv for kv in self.t2.items() if kv[1].ref_cnt == 0 and kv[0] not in protected)
        t1_size = len(self.t1)  # as it will be after the victims chosen so far leave
        picked: list[tuple[OffloadKey, ChunkStatus, bool]] = []
        for _ in range(n):
            kv = next(t1_left, None) if t1_size >= int(self.target_t1_size) else None
            from_t1 = kv is not None
            if kv is None:
                kv = next(t2_left, None)
            if kv is None:
                kv, from_t1 = next(t1_left, None), True
                if kv is None:
                    return None
            if from_t1:
                t1_size -= 1
            picked.append((kv[0], kv[1], from_t1))
        out = []
        for key, chunk, from_t1 in picked:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            out.append((key, chunk))
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.cache_capacity:
                ghost.popitem(last=False)
        return out

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1_size = 0.0

    def items(self) -> Iterator[tuple[OffloadKey, ChunkStatus]]:
        """T1's chunks (least recent first), then T2's."""
        yield from self.t1.items()
        yield from self.t2.items()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __deepcopy__(self, memo: dict[int, Any]) -> ARCCachePolicy:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.t1, new.t2 = copy_chunks(self.t1, memo), copy_chunks(self.t2, memo)
        new.b1, new.b2 = OrderedDict(self.b1), OrderedDict(self.b2)
        return new
