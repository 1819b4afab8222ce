"""Answering "is this block in the tier?" without blocking the scheduler (vLLM 0.33:
``AsyncLookupManager`` in ``vllm/v1/kv_offload/tiering/async_lookup.py``).

A tier whose existence check is slow (a file system, a network store) answers the first
lookup of a key with None ("not yet": the tiering manager says RETRY). The keys asked in a
step are sent as one batch to a worker thread at the step's end (``flush``); the answers are
applied at the next lookup, so the request asking again a step later gets True or False.

A key's probe moves PENDING (asked, not sent) -> IN_FLIGHT (sent) -> RESOLVED (answered). A
resolved answer is kept while a request that asked for it is alive; ``mark_miss`` turns it
to False after a failed load, so the scheduler does not promote the same bad file forever.
The state is touched only by whoever holds the tiering manager's lock; the two queues to and
from the worker are thread-safe.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvlab.kv_offload.base import OffloadKey, ReqContext

logger = logging.getLogger(__name__)

_Probe = tuple[OffloadKey, ReqContext, int]


class LookupPhase(enum.Enum):
    PENDING = enum.auto()
    IN_FLIGHT = enum.auto()
    RESOLVED = enum.auto()


@dataclass(slots=True)
class LookupState:
    generation: int  # tells a stale answer (the key was dropped and asked again) from the current one
    phase: LookupPhase = LookupPhase.PENDING
    result: bool | None = None
    request_ids: set[str] = field(default_factory=set)


class AsyncLookupManager(ABC):
    def __init__(self, tier_type: str) -> None:
        self._tier_type = tier_type
        self._lookup_state: dict[OffloadKey, LookupState] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._next_generation = 0
        self._lookup_batch: list[_Probe] = []
        self._lookup_queue: queue.SimpleQueue[list[_Probe] | None] = queue.SimpleQueue()
        self._pending_results: queue.SimpleQueue[list[tuple[OffloadKey, int, bool]]] = queue.SimpleQueue()
        self._need_to_drain = False
        self._thread = threading.Thread(target=self._worker, name=f"kvlab_offloading_lookup_{tier_type}", daemon=True)
        self._thread.start()

    @abstractmethod
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """One answer per key (runs on the worker thread: touch no scheduler state)."""

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True / False once answered; None until then (the key is queued on first ask)."""
        if self._need_to_drain:
            self.drain_results()
            self._need_to_drain = False
        state = self._lookup_state.get(key)
        if state is None:
            state = self._lookup_state[key] = LookupState(self._next_generation)
            self._next_generation += 1
            self._lookup_batch.append((key, req_context, state.generation))
        state.request_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        return state.result

    def flush(self) -> None:
        """The step's end: apply finished answers, send the step's new keys as one batch."""
        self.drain_results()
        self._need_to_drain = True
        batch, self._lookup_batch = self._lookup_batch, []
        sent = []
        for key, ctx, generation in batch:
            state = self._lookup_state.get(key)
            if state is None or state.generation != generation:
                continue  # dropped (its requests finished) before it was sent
            state.phase = LookupPhase.IN_FLIGHT
            sent.append((key, ctx, generation))
        if sent:
            self._lookup_queue.put(sent)

    def drain_results(self) -> None:
        while True:
            try:
                answers = self._pending_results.get_nowait()
            except queue.Empty:
                return
            for key, generation, result in answers:
                state = self._lookup_state.get(key)
                if state is None or state.generation != generation:
                    continue
                if not state.request_ids:  # nobody waits for it any more
                    del self._lookup_state[key]
                    continue
                # A generation is sent once, so it is answered once: a second answer would
                # overwrite a ``mark_miss`` verdict and bring the failed load back.
                assert state.phase is LookupPhase.IN_FLIGHT and state.result is None, (
                    f"{self._tier_type}: a second lookup answer for generation {generation} of a key "
                    f"({state.phase.name}); each probe is sent once"
                )
                state.result = result
                state.phase = LookupPhase.RESOLVED

    def mark_miss(self, keys: Collection[OffloadKey]) -> None:
        """A load of these keys failed: their resolved answers become False (a newer probe
        still on its way is left to land)."""
        for key in keys:
            state = self._lookup_state.get(key)
            if state is not None and state.phase is LookupPhase.RESOLVED:
                state.result = False

    def cleanup(self, req_id: str) -> None:
        """The request finished: forget its keys, except probes still in flight."""
        for key in self._req_keys.pop(req_id, ()):
            state = self._lookup_state[key]
            state.request_ids.discard(req_id)
            if not state.request_ids and state.phase is not LookupPhase.IN_FLIGHT:
                del self._lookup_state[key]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._lookup_queue.put(None)
        self._thread.join(timeout=timeout_s)
        self.drain_results()

    def _worker(self) -> None:
        while (batch := self._lookup_queue.get()) is not None:
            by_request: dict[str, tuple[ReqContext, list[tuple[OffloadKey, int]]]] = {}
            for key, ctx, generation in batch:
                by_request.setdefault(ctx.req_id, (ctx, []))[1].append((key, generation))
            answers: list[tuple[OffloadKey, int, bool]] = []
            for ctx, entries in by_request.values():
                keys = [k for k, _ in entries]
                try:
                    hits = list(self.batch_lookup(keys, ctx))
                except Exception as exc:  # an unreadable store is a miss, not a dead thread
                    logger.warning("batch_lookup failed on tier %s for %d keys: %s", self._tier_type, len(keys), exc)
                    hits = [False] * len(keys)
                answers.extend((k, g, bool(h)) for (k, g), h in zip(entries, hits))
            self._pending_results.put(answers)
