"""The CPU tier's books (vLLM: ``CPUOffloadingManager`` in ``vllm/v1/kv_offload/cpu/manager.py``).

``num_blocks`` slots of host memory, each holding one GPU block's KV for every layer.
Slots are handed out fresh in order (0, 1, 2, ...) until the tier is full, then reused
from the freed ones, last freed first -- vLLM's chunk pool. Which block leaves when room is
needed is the LRU policy's call (``policies/lru.py``). The manager also queues
:class:`OffloadingEvent` records (stored / removed) for the connector, which turns them
into kvlab timeline events and vLLM KV events (medium "CPU").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvlab.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)
from kvlab.kv_offload.cpu.policies.lru import BlockStatus, LRUCachePolicy
from kvlab.utils.checks import check_int


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


class LRUOffloadingManager(OffloadingManager):
    """A tier of ``num_blocks`` slots with an LRU: the CPU tier, and (with files behind its
    slots) the storage tier."""

    medium = Medium.CPU.value

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self._num_allocated = 0
        self._free_slots: list[int] = []
        self._policy = LRUCachePolicy(self.num_blocks)
        self.events: list[OffloadingEvent] = []

    # -- slots ------------------------------------------------------------------------------------
    def _num_free_slots(self) -> int:
        return len(self._free_slots) + self.num_blocks - self._num_allocated

    def _allocate_slots(self, n: int) -> list[int]:
        fresh = min(n, self.num_blocks - self._num_allocated)
        slots = list(range(self._num_allocated, self._num_allocated + fresh))
        self._num_allocated += fresh
        slots += [self._free_slots.pop() for _ in range(n - fresh)]
        return slots

    # -- the OffloadingManager verbs --------------------------------------------------------------
    def lookup(self, key: OffloadKey) -> LookupResult:
        _check_key("key", key)
        status = self._policy.get(key)
        if status is None:
            return LookupResult.MISS
        return LookupResult.HIT if status.is_ready else LookupResult.HIT_PENDING

    def slot_of(self, key: OffloadKey) -> int | None:
        status = self._policy.get(key)
        return None if status is None else status.slot

    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin each key (ref + 1) and move it to the LRU tail; return the slots."""
        keys = _check_keys("keys", keys)
        slots = []
        for i, key in enumerate(keys):
            status = self._policy.get(key)
            if status is None or not status.is_ready:
                raise ValueError(
                    f"prepare_load: keys[{i}] (block {key.hex()[:16]}…) is not readable in the {self.medium} tier "
                    f"({'still being written' if status is not None else 'not stored'}); lookup() says what is"
                )
        for key in keys:
            status = self._policy.get(key)
            assert status is not None
            status.ref_cnt += 1
            slots.append(status.slot)
        self._policy.touch(keys)
        return slots

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._policy.touch(_check_keys("keys", keys))

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        for key in _check_keys("keys", keys):
            status = self._policy.get(key)
            if status is not None and status.ref_cnt > 0:
                status.ref_cnt -= 1

    def num_storable(self, protected: Iterable[OffloadKey] = ()) -> int:
        """How many new blocks could be stored now (free slots + evictable blocks)."""
        return self._num_free_slots() + self._policy.num_evictable(set(_check_keys("protected", protected)))

    def prepare_store(self, keys: Sequence[OffloadKey], protected: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        """Room for the keys not stored yet: free slots first, then the LRU's victims
        (never one of ``keys`` or ``protected``). The new keys are inserted at the LRU
        tail, not readable until ``complete_store``. None = not enough unpinned room, and
        nothing changed."""
        keys = _check_keys("keys", keys)
        protected = _check_keys("protected", protected)
        to_store = list(dict.fromkeys(k for k in keys if self._policy.get(k) is None))
        if not to_store:
            return PrepareStoreOutput([], [], [])
        need = len(to_store) - self._num_free_slots()
        evicted: list[tuple[OffloadKey, BlockStatus]] = []
        if need > 0:
            victims = self._policy.evict(need, set(keys) | set(protected))
            if victims is None:
                return None
            evicted = victims
            for _, status in victims:
                self._free_slots.append(status.slot)
            self.events.append(OffloadingEvent([k for k, _ in victims], self.medium, True, [s.slot for _, s in victims]))
        slots = self._allocate_slots(len(to_store))
        for key, slot in zip(to_store, slots):
            self._policy.insert(key, BlockStatus(slot))
        return PrepareStoreOutput(to_store, slots, [k for k, _ in evicted], [s.slot for _, s in evicted])

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True, reason: str = "store failed") -> None:
        """Stored keys become readable; a failed store forgets them (the slot is free again)."""
        keys = _check_keys("keys", keys)
        if not isinstance(success, bool):
            raise TypeError(f"success must be True or False, got {success!r}")
        done, dropped, dropped_slots = [], [], []
        for key in keys:
            status = self._policy.get(key)
            if status is None or status.is_ready:
                continue
            if success:
                status.ref_cnt = 0
                done.append(key)
            else:
                self._policy.remove(key)
                self._free_slots.append(status.slot)
                dropped.append(key)
                dropped_slots.append(status.slot)
        if dropped:
            self.events.append(OffloadingEvent(dropped, self.medium, True, dropped_slots, reason=reason))
        if done:
            self.events.append(OffloadingEvent(done, self.medium, False))

    def remove(self, keys: Iterable[OffloadKey], reason: str) -> list[OffloadKey]:
        """Forget blocks that went bad (their file is missing or corrupt, a copy failed);
        a pinned block is unpinned first. Returns the keys that were here."""
        keys = _check_keys("keys", keys)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        gone, slots = [], []
        for key in keys:
            status = self._policy.get(key)
            if status is None:
                continue
            self._policy.remove(key)
            self._free_slots.append(status.slot)
            gone.append(key)
            slots.append(status.slot)
        if gone:
            self.events.append(OffloadingEvent(gone, self.medium, True, slots, reason=reason))
        return gone

    def take_events(self) -> list[OffloadingEvent]:
        events, self.events = self.events, []
        return events

    # -- for views and tests ------------------------------------------------------------------------
    def entries(self) -> list[tuple[OffloadKey, int]]:
        """(key, slot) in LRU order, head (evicted next) first."""
        return [(k, s.slot) for k, s in self._policy.blocks.items()]

    def __contains__(self, key: object) -> bool:
        return key in self._policy.blocks

    def __len__(self) -> int:
        return len(self._policy.blocks)

    def pinned(self) -> dict[OffloadKey, int]:
        return {k: s.ref_cnt for k, s in self._policy.blocks.items() if s.ref_cnt != 0}

    def check_invariants(self) -> None:
        used = {s.slot for s in self._policy.blocks.values()}
        assert len(used) == len(self._policy.blocks), f"{self.medium}: two blocks share a slot"
        free = set(self._free_slots)
        assert len(free) == len(self._free_slots), f"{self.medium}: a slot is free twice"
        assert not used & free, f"{self.medium}: slots {sorted(used & free)} are both used and free"
        assert used | free == set(range(self._num_allocated)), f"{self.medium}: slots leaked"
        assert len(self._policy.blocks) <= self.num_blocks


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


class CPUOffloadingManager(LRUOffloadingManager):
    """The CPU tier: host memory right behind the GPU pool (vLLM's primary tier).

    Its slots are bytes the worker writes, so it also remembers which block each slot was
    last given to (:class:`SlotWrites`): an entry whose slot was given to another block
    since -- by a step that was then undone -- is dropped at lookup (a miss) or when the
    block is offered again (it is stored afresh)."""

    medium = Medium.CPU.value

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.slot_writes = SlotWrites()

    def overwritten(self, key: OffloadKey) -> bool:
        """True when ``key``'s slot was handed to another block after ``key`` was stored."""
        _check_key("key", key)
        status = self._policy.get(key)
        return status is not None and self.slot_writes.keys.get(status.slot) != key

    def _drop_overwritten(self, keys: Iterable[OffloadKey]) -> None:
        stale = [k for k in keys if self.overwritten(k)]
        if stale:
            self.remove(stale, reason=OVERWRITTEN)

    def lookup(self, key: OffloadKey) -> LookupResult:
        self._drop_overwritten([key])
        return super().lookup(key)

    def prepare_store(self, keys: Sequence[OffloadKey], protected: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        """As the LRU tier's; an entry whose slot was overwritten is not "here already": it
        is dropped and stored afresh."""
        keys = _check_keys("keys", keys)
        self._drop_overwritten(keys)
        out = super().prepare_store(keys, protected)
        if out is not None:
            self.slot_writes.keys.update(zip(out.slots, out.keys_to_store))
        return out


#: Why a CPU entry left: its slot holds another block (see :class:`SlotWrites`).
OVERWRITTEN = "slot overwritten by a step that was undone"
