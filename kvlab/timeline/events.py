"""Typed events: every state change of the engine, in order (the visualisation's only input).

The core never draws anything and the views never read live objects: the block pool, the
KV-cache manager and the scheduler append events here; ``kvlab.timeline.snapshot`` rebuilds the
whole state at any step from the events alone. So a picture can be tested as data,
replayed backwards and forwards, saved to JSON and reloaded.

Emitting is optional (``event_log=None`` costs one ``is None`` test per operation).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class Event:
    kind: ClassVar[str] = "event"
    seq: int = field(default=-1, init=False)  # position in the log
    step: int = field(default=0, init=False)  # scheduler step during which it happened

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind}
        for f in dataclasses.fields(self):
            d[f.name] = _jsonable(getattr(self, f.name))
        return d


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"hex": v.hex()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _unjson(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"hex"}:
            return bytes.fromhex(v["hex"])
        return {k: _unjson(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


_REGISTRY: dict[str, type[Event]] = {}


def _register(cls: type[Event]) -> type[Event]:
    _REGISTRY[cls.kind] = cls
    return cls


# --- block pool / KV-cache manager ----------------------------------------------------------
@_register
@dataclass(slots=True)
class PoolCreated(Event):
    kind: ClassVar[str] = "pool_created"
    num_blocks: int = 0
    block_size: int = 0
    groups: list[dict[str, Any]] = field(default_factory=list)  # [{"type": "full"|"sliding_window", ...}]
    enable_caching: bool = True
    hash_algo: str = "sha256"


@_register
@dataclass(slots=True)
class BlocksAllocated(Event):
    """Fresh blocks popped from the free-queue head (ref 0 -> 1), appended to a table."""

    kind: ClassVar[str] = "blocks_allocated"
    request_id: str | None = None
    group: int = 0
    block_ids: list[int] = field(default_factory=list)


@_register
@dataclass(slots=True)
class BlocksTouched(Event):
    """Prefix-cache hits adopted by a request: ref += 1; a ref-0 block leaves the free queue."""

    kind: ClassVar[str] = "blocks_touched"
    request_id: str | None = None
    group: int = 0
    block_ids: list[int] = field(default_factory=list)  # null blocks (id 0) included, as in the table


@_register
@dataclass(slots=True)
class BlockCached(Event):
    """A full block received its hash and entered the prefix-cache map."""

    kind: ClassVar[str] = "block_cached"
    request_id: str | None = None
    group: int = 0
    block_id: int = 0
    block_hash: bytes = b""
    parent_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)
    extra_keys: Any = None


@_register
@dataclass(slots=True)
class BlocksFreed(Event):
    """ref -= 1 for ``block_ids`` (in the order given: a request frees tail first).

    Blocks reaching ref 0 re-enter the free queue: uncached ones at the head (``to_head``,
    reused first), cached ones at the tail (``to_tail``, evicted last, keeping their hash).
    """

    kind: ClassVar[str] = "blocks_freed"
    request_id: str | None = None
    group: int = 0
    block_ids: list[int] = field(default_factory=list)
    to_head: list[int] = field(default_factory=list)
    to_tail: list[int] = field(default_factory=list)
    reason: str = "request"  # "request": the whole table goes; "window": blocks left the window


@_register
@dataclass(slots=True)
class BlockEvicted(Event):
    """A cached free block was reallocated: its map entry and hash are dropped (lazy eviction)."""

    kind: ClassVar[str] = "block_evicted"
    block_id: int = 0
    block_hash: bytes = b""
    group: int = 0


@_register
@dataclass(slots=True)
class BlocksSkipped(Event):
    """Sliding window: blocks that left the window are replaced by the null block in a table."""

    kind: ClassVar[str] = "blocks_skipped"
    request_id: str | None = None
    group: int = 0
    positions: list[int] = field(default_factory=list)  # logical block indices now null
    block_ids: list[int] = field(default_factory=list)


@_register
@dataclass(slots=True)
class PrefixLookup(Event):
    """``get_computed_blocks``: the hit walk over a request's chain of block hashes."""

    kind: ClassVar[str] = "prefix_lookup"
    request_id: str = ""
    num_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    hit_block_ids: list[list[int]] = field(default_factory=list)  # per group
    num_hit_tokens: int = 0
    max_hit_tokens: int = 0  # num_tokens - 1: the last token is always recomputed
    preempted: bool = False


@_register
@dataclass(slots=True)
class CacheReset(Event):
    kind: ClassVar[str] = "cache_reset"
    success: bool = True


# --- scheduler --------------------------------------------------------------------------------
@_register
@dataclass(slots=True)
class SchedulerCreated(Event):
    kind: ClassVar[str] = "scheduler_created"
    policy: str = "fcfs"
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    enable_chunked_prefill: bool = True


@_register
@dataclass(slots=True)
class RequestAdded(Event):
    kind: ClassVar[str] = "request_added"
    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 0
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None
    lora_name: str | None = None


@_register
@dataclass(slots=True)
class StepStarted(Event):
    kind: ClassVar[str] = "step_started"
    token_budget: int = 0


@_register
@dataclass(slots=True)
class RequestScheduled(Event):
    kind: ClassVar[str] = "request_scheduled"
    request_id: str = ""
    num_tokens: int = 0
    num_computed_tokens: int = 0  # before this step
    phase: str = "running"  # "new" | "resumed" | "running"
    num_cached_tokens: int = 0  # prefix hit, for new/resumed


@_register
@dataclass(slots=True)
class RequestPreempted(Event):
    kind: ClassVar[str] = "request_preempted"
    request_id: str = ""
    reason: str = ""
    for_request_id: str = ""  # the running request that could not get a block
    num_computed_tokens_lost: int = 0


@_register
@dataclass(slots=True)
class TokensAppended(Event):
    kind: ClassVar[str] = "tokens_appended"
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)


@_register
@dataclass(slots=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "request_finished"
    request_id: str = ""
    reason: str = ""  # "stop" (eos) | "length" (max_tokens) | "abort"
    num_output_tokens: int = 0


@_register
@dataclass(slots=True)
class StepFinished(Event):
    kind: ClassVar[str] = "step_finished"
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    time: float = 0.0  # simulated clock after the step (seconds)


# --- model runner ------------------------------------------------------------------------------
@_register
@dataclass(slots=True)
class AttentionBatch(Event):
    """What the attention kernel was given in one step (the kernel view reads this)."""

    kind: ClassVar[str] = "attention_batch"
    req_ids: list[str] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)  # [group][seq][block]
    slot_mappings: list[list[int]] = field(default_factory=list)  # [group][token]
    block_size: int = 16
    sliding_windows: list[int | None] = field(default_factory=list)  # per group


class EventLog:
    """An append-only list of events plus the current step number."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.step = 0
        self._subscribers: list[Callable[[Event], None]] = []

    def emit(self, event: Event) -> None:
        event.seq = len(self.events)
        event.step = self.step
        self.events.append(event)
        for fn in self._subscribers:
            fn(event)

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn(event)`` on every new event (the live player uses this)."""
        self._subscribers.append(fn)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __getitem__(self, i: int) -> Event:
        return self.events[i]

    def of_type(self, *classes: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, classes)]

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"version": 1, "step": self.step, "events": [e.to_dict() for e in self.events]})

    @classmethod
    def from_json(cls, text: str) -> "EventLog":
        data = json.loads(text)
        log = cls()
        for d in data["events"]:
            kind = d.pop("kind")
            try:
                ev_cls = _REGISTRY[kind]
            except KeyError:
                raise ValueError(f"unknown event kind {kind!r} in JSON") from None
            seq, step = d.pop("seq"), d.pop("step")
            ev = ev_cls(**{k: _unjson(v) for k, v in d.items()})
            ev.seq, ev.step = seq, step
            log.events.append(ev)
        log.step = data.get("step", 0)
        return log

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "EventLog":
        with open(path) as f:
            return cls.from_json(f.read())
