"""What a CPU tier's cache policy is (vLLM: ``vllm/v1/kv_offload/cpu/policies/base.py``).

A policy owns two things that cannot be pulled apart: how the tier's chunks are organised
(one ordered list for LRU; two lists and two ghost lists for ARC) and which chunk leaves
when room is needed. The manager (``cpu/manager.py``) owns everything else -- the chunk
pool, reference counts, events -- and tells the policy what happened: a chunk stored, read,
pinned, unpinned, a request finished. Policies are picked by name through
:class:`~kvlab.kv_offload.cpu.policies.factory.CachePolicyFactory`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvlab.kv_offload.base import OffloadKey, ReqContext


def order_request_keys(key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext) -> list[OffloadKey]:
    """A request's keys of every group in one head-to-tail list: by the end-token position
    the scheduler recorded for each key, when it recorded one for all of them; otherwise
    group after group, as given."""
    keys = [key for group in key_groups for key in group]
    positions = {k: p for k in keys if (p := req_context.get_offload_key_position(k)) is not None}
    if len(positions) == len(keys):
        keys.sort(key=positions.__getitem__)
    return keys


class ChunkStatus:
    """One chunk of a CPU tier: ``chunk_id`` (its slot in host memory) and ``ref_cnt`` -- how
    many loads read it now; -1 while it is still being written (not readable yet)."""

    __slots__ = ("ref_cnt", "chunk_id")

    def __init__(self, chunk_id: int) -> None:
        self.ref_cnt = -1
        self.chunk_id = chunk_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


def copy_chunks(chunks: Any, memo: dict[int, Any]) -> Any:
    """A copy of a ``key -> ChunkStatus`` mapping (dict or OrderedDict) for ``__deepcopy__``:
    keys are bytes, a status two ints, so one pass does it. A status already copied (a job
    holds it too) stays shared through ``memo``."""
    new = type(chunks)()
    get = memo.get
    for key, st in chunks.items():
        cp = get(id(st))
        if cp is None:
            cp = memo[id(st)] = ChunkStatus.__new__(ChunkStatus)
            cp.ref_cnt, cp.chunk_id = st.ref_cnt, st.chunk_id
        new[key] = cp
    return new


class CachePolicy(ABC):
    """The interface the manager drives. ``evict`` is all or nothing: ``n`` chunks, or None
    and no change."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk of ``key``, or None."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        """A chunk just allocated for ``key`` by the request of ``req_context``."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (a store that failed)."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys a request offered that the tier lacks, before they are inserted. By default a
        touch; ARC learns from its ghost lists here instead."""
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys a request met for the first time (read or offered); they may not be here."""
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """A request's accesses, committed once it finished: ``key_groups`` head to tail per
        group; ``insertion_only_keys`` it only stored, ``reused_keys`` it read ready chunks of.
        By default one touch per group."""
        del insertion_only_keys, reused_keys
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Remove and return ``n`` unpinned chunks not in ``protected`` -- or None, unchanged."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every chunk (pinned or not) and any adaptive state."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref_cnt just became 0."""
        return

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref_cnt just left 0."""
        return

    # -- kvlab: for views, checks and the manager's bookkeeping -------------------------------
    def items(self) -> Iterator[tuple[OffloadKey, ChunkStatus]]:
        """Every chunk, in the order the policy would evict them if all were unpinned."""
        raise NotImplementedError(f"{type(self).__name__} does not list its chunks")

    def __len__(self) -> int:
        """How many chunks the policy holds (pinned or not). Built-in policies count without
        ordering them; a policy of your own is counted through :meth:`items`."""
        return sum(1 for _ in self.items())

    def check_invariants(self) -> None:
        """Assert the policy's own structure is sound (the tier's ``check_invariants`` calls
        it); a policy with no inner structure to check has nothing to assert."""
        return
