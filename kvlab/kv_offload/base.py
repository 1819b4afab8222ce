"""What every offload tier shares (vLLM: ``vllm/v1/kv_offload/base.py``; lesson 12).

An *offloading manager* runs beside the scheduler and keeps the books of one store of KV
blocks outside the GPU pool -- which block hashes it holds, in which slot, which of them are
being read or written right now, which one goes first when room is needed. It never
touches bytes: the worker copies them (``kvlab.kv_offload.cpu.gpu_worker``). Its verbs, as in
vLLM:

* ``lookup(key)`` -- is this block here and readable?
* ``prepare_load(keys)`` -- pin these blocks (no eviction while they are read), return
  where they are; ``complete_load(keys)`` unpins them;
* ``prepare_store(keys)`` -- find room for these blocks (evicting the least recently used
  unpinned ones), return their slots and what was evicted; ``complete_store(keys)`` makes
  them readable (or, on failure, forgets them);
* ``touch(keys)`` -- mark blocks recently used.

A block is named by an *offload key*: its block hash followed by its KV-cache group as 4
big-endian bytes -- byte for byte kvlab's ``KVCacheBlock.cache_key`` (vLLM's
``make_offload_key``), so a tier and the GPU prefix cache speak of the same block.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

OffloadKey = bytes


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """A block hash and its KV-cache group packed into one key (vLLM's layout)."""
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


def get_offload_block_hash(key: OffloadKey) -> bytes:
    return key[:-4]


def get_offload_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


class Medium(str, enum.Enum):
    """Where a tier keeps its blocks (vLLM's ``Medium``; the value is what KV events carry)."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()  # here, but still being written: not readable yet


@dataclass(slots=True)
class PrepareStoreOutput:
    """Which of the offered keys need storing (the others are here already), the slot
    each one gets, and the keys evicted to make room (with the slots they freed)."""

    keys_to_store: list[OffloadKey]
    slots: list[int]
    evicted_keys: list[OffloadKey]
    evicted_slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class OffloadingEvent:
    """A change to a tier's contents: ``removed`` False = stored (readable now), True = gone
    (``reason``: "lru", or why the entry was dropped)."""

    keys: list[OffloadKey]
    medium: str
    removed: bool
    slots: list[int] = field(default_factory=list)
    reason: str = "lru"


class OffloadingManager(ABC):
    """The scheduler-side books of one tier (see the module docstring)."""

    medium: str = Medium.CPU.value

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult: ...

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin ``keys`` (all must be readable) and return their slots."""

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        return

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        return

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey], protected: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        """Room for the keys not here yet (never evicting ``keys`` or ``protected``), or
        None when there is not enough unpinned room -- then nothing changed."""

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        return

    def take_events(self) -> list[OffloadingEvent]:
        return []
