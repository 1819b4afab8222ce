"""Typed events: every state change of the engine, in order -- the pictures' only source.

The core never draws anything and the views never read live objects: the block pool, the
KV-cache managers, the scheduler and the model runner append events to an
:class:`EventLog`; :mod:`kvlab.timeline` rebuilds the whole state at any step from the
events alone. So a picture can be tested as data, stepped backwards and forwards, saved to
JSON and reloaded.

**Each event kind is defined once, here**, as one class that knows three things:

* how it changes the replay state -- ``apply(state)``, written with the small vocabulary of
  :class:`~kvlab.timeline.state.ReplayState` (take a block off the free queue, release it,
  cache it, admit a request, ...);
* how it reads in words -- ``describe()`` (the Player's event list) and ``tone`` (how that
  line is styled);
* how it serialises -- its dataclass fields, through ``to_dict`` / :func:`event_from_dict`,
  the one place where events meet JSON (``EventLog.to_json`` adds a format ``version``).

A new event kind is one new class in this file; nothing else switches on event kinds.

Where vLLM has a name for the same fact
---------------------------------------
vLLM publishes *KV cache events* for external routers (``vllm/distributed/kv_events.py``,
emitted by ``BlockPool`` when ``enable_kv_cache_events`` is on). They are a small subset of
this log, keyed by block *hash* (a router never sees block ids):

=====================================  ======================================================
kvlab event                            vLLM KV cache event
=====================================  ======================================================
``BlockCached`` (block_cached)         ``BlockStored`` -- vLLM batches the blocks a request
                                       caches in one call: ``block_hashes``,
                                       ``parent_block_hash``, ``token_ids``, ``block_size``,
                                       LoRA, ``medium``, extra keys, group, spec kind (all
                                       fields: ``kvlab.kv_events.BlockStored``)
``BlockEvicted`` (block_evicted)       ``BlockRemoved`` (``block_hashes``, ``medium``, group): the
                                       hash leaves the prefix cache when its free block is
                                       reused -- *not* when the block is freed
``CacheReset`` with ``success=True``   ``AllBlocksCleared`` (``reset_prefix_cache``)
=====================================  ======================================================

Everything else (allocations, touches, frees, lookups, scheduling, the runner's attention
batch) is kvlab's own: the pictures need it, routers do not. vLLM's wire format itself
(msgspec structs, ZMQ publisher) is modelled separately in ``kvlab.kv_events``.

Emitting is optional (``event_log=None`` costs one ``is None`` test per operation).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from kvlab.eventlog.schema import MAX_BLOCKS, HashKeys, check_num_blocks, check_record, check_version, parse_json

if TYPE_CHECKING:  # the state is only a parameter type here: no import cycle at run time
    from kvlab.timeline.state import ReplayState

FORMAT_VERSION = 1
"""Version of ``EventLog.to_json``'s format (written into every file)."""


@dataclass(slots=True)
class Event:
    """Base of every event: its position in the log and the scheduler step it belongs to.

    ``step`` is the scheduler step *during or after which* the event happened: events
    between two steps (a request added from a notebook cell) belong to the step before.
    """

    kind: ClassVar[str] = "event"
    tone: ClassVar[str] = ""  # "" | "step" | "hit" | "evict" | "alert": how the event list styles it
    seq: int = field(default=-1, init=False)  # position in the log
    step: int = field(default=0, init=False)  # scheduler step during which it happened

    def apply(self, state: ReplayState) -> None:
        """Change the replay state as this event changed the engine's (default: nothing)."""

    def describe(self) -> str:
        """One line for a person reading the step's events."""
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            d[f.name] = _jsonable(getattr(self, f.name))
        return d

    def check_claims(self, where: str, max_blocks: int) -> None:
        """Refuse what a file claims that a reader would size memory by (read from JSON)."""


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"hex": v.hex()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


EVENT_CLASSES: dict[str, type[Event]] = {}
"""Every event kind by its ``kind`` name (what the JSON's ``"kind"`` field holds)."""


def _register(cls: type[Event]) -> type[Event]:
    if cls.kind in EVENT_CLASSES:
        raise RuntimeError(f"two event classes named {cls.kind!r}")
    EVENT_CLASSES[cls.kind] = cls
    return cls


def event_from_dict(d: dict[str, Any], *, where: str = "event", max_blocks: int = MAX_BLOCKS) -> Event:
    """The inverse of ``Event.to_dict``: the one place where JSON becomes events.

    Strict (see :mod:`kvlab.eventlog.schema`): a known ``kind``, exactly the kind's fields,
    each of its type and range, ``seq``/``step`` ints >= 0 when present; a ``ValueError``
    names the field (``where`` prefixes it, e.g. ``events[12]``)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object, got {type(d).__name__}")
    kind = d.get("kind")
    cls = EVENT_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{where}: unknown event kind {kind!r}; known kinds: {sorted(EVENT_CLASSES)}")
    here = f"{where} ({kind})"
    fields = check_record(cls, d, here, skip=("kind", "seq", "step"))
    pos = {}
    for name, default in (("seq", -1), ("step", 0)):
        v = d.get(name, default)
        if type(v) is not int or v < (-1 if name == "seq" else 0):
            raise ValueError(f"{here}.{name} must be an int >= 0, got {v!r:.80}")
        pos[name] = v
    e = cls(**fields)
    e.seq, e.step = pos["seq"], pos["step"]
    e.check_claims(here, max_blocks)
    return e


def _ids(ids: list[int]) -> str:
    return str(list(ids))


# --- block pool / KV-cache manager ----------------------------------------------------------
@_register
@dataclass(slots=True)
class PoolCreated(Event):
    """The pool exists: ``num_blocks`` blocks (block 0 is the null block), all free."""

    kind: ClassVar[str] = "pool_created"
    num_blocks: int = 0
    block_size: int = 0
    groups: list[dict[str, Any]] = field(default_factory=list)  # [{"type": "full"|"sliding_window", ...}]
    enable_caching: bool = True
    hash_algo: str = "sha256"

    def apply(self, state: ReplayState) -> None:
        state.init_pool(self.num_blocks, self.block_size, self.groups)

    def describe(self) -> str:
        return f"pool of {self.num_blocks} blocks × {self.block_size} tokens ({len(self.groups)} group(s))"

    def check_claims(self, where: str, max_blocks: int) -> None:
        check_num_blocks(self.num_blocks, f"{where}.num_blocks", max_blocks)


@_register
@dataclass(slots=True)
class BlocksAllocated(Event):
    """Fresh blocks popped from the free-queue head (ref 0 -> 1), appended to a table."""

    kind: ClassVar[str] = "blocks_allocated"
    request_id: str | None = None
    group: int = 0
    block_ids: list[int] = field(default_factory=list)

    def apply(self, state: ReplayState) -> None:
        for bid in self.block_ids:
            state.pop_free_head(bid)
            state.mark_allocated(bid, self.group)
            state.take(bid, self.request_id, self.group)

    def describe(self) -> str:
        return f"allocate {_ids(self.block_ids)} → {self.request_id} (group {self.group})"


@_register
@dataclass(slots=True)
class BlocksTouched(Event):
    """Prefix-cache hits adopted by a request: ref += 1; a ref-0 block leaves the free queue."""

    kind: ClassVar[str] = "blocks_touched"
    tone: ClassVar[str] = "hit"
    request_id: str | None = None
    group: int = 0
    block_ids: list[int] = field(default_factory=list)  # null blocks (id 0) included, as in the table

    def apply(self, state: ReplayState) -> None:
        for bid in self.block_ids:
            if bid == 0:
                state.append_null(self.request_id, self.group)
                continue
            if state.ref[bid] == 0:
                state.remove_free(bid)
            state.take(bid, self.request_id, self.group)

    def describe(self) -> str:
        return f"hit/touch {_ids(self.block_ids)} → {self.request_id} (group {self.group})"


@_register
@dataclass(slots=True)
class BlockCached(Event):
    """A full block received its hash and entered the prefix-cache map (vLLM: ``BlockStored``)."""

    kind: ClassVar[str] = "block_cached"
    request_id: str | None = None
    group: int = 0
    block_id: int = 0
    block_hash: bytes = b""
    parent_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)
    extra_keys: HashKeys | None = None  # tuples (JSON lists in a file)

    def apply(self, state: ReplayState) -> None:
        parent = self.parent_hash.hex() if self.parent_hash else None
        state.cache(self.block_id, self.block_hash.hex(), parent, self.token_ids, self.extra_keys, self.group)

    def describe(self) -> str:
        return f"cache block {self.block_id} as {self.block_hash.hex()[:8]}"


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
    reason: str = "request"  # "request": the whole table goes (none without request_id: a copy-on-write's retained blocks, as vLLM's scheduler frees them); "window": blocks left the window; "copied": a copy-on-write ran (older logs)

    def apply(self, state: ReplayState) -> None:
        for bid in self.block_ids:
            if bid != 0:
                state.release(bid, self.request_id, self.group)
        for bid in reversed(self.to_head):  # the first of to_head becomes the new head
            state.push_free_head(bid)
        for bid in self.to_tail:
            state.push_free_tail(bid)
        if self.reason == "request":
            state.clear_table(self.request_id, self.group)

    def describe(self) -> str:
        return f"free {_ids(self.block_ids)} from {self.request_id} (head ← {_ids(self.to_head)}, tail ← {_ids(self.to_tail)})"


@_register
@dataclass(slots=True)
class BlockEvicted(Event):
    """A cached free block was reallocated: its map entry and hash are dropped (lazy eviction;
    vLLM: ``BlockRemoved``)."""

    kind: ClassVar[str] = "block_evicted"
    tone: ClassVar[str] = "evict"
    block_id: int = 0
    block_hash: bytes = b""
    group: int = 0

    def apply(self, state: ReplayState) -> None:
        state.uncache(self.block_id, self.block_hash.hex() if self.block_hash else None)

    def describe(self) -> str:
        return f"evict block {self.block_id} (hash {self.block_hash.hex()[:8]} dropped)"


@_register
@dataclass(slots=True)
class BlockCopied(Event):
    """Copy-on-write (vLLM 0.33): a hit that ended inside block ``src_block_id`` continues in
    its private copy ``dst_block_id``, which takes position ``position`` of the request's
    table; the runner copies the page before the forward pass. ``moved_hashes``: instead,
    the request keeps writing into the source (a Mamba state it saved there), and the
    cache's keys move to the copy. Until the copy has run, both blocks are held once more."""

    kind: ClassVar[str] = "block_copied"
    request_id: str | None = None
    group: int = 0
    position: int = 0
    src_block_id: int = 0
    dst_block_id: int = 0
    moved_hashes: bool = False

    def apply(self, state: ReplayState) -> None:
        if self.moved_hashes:
            state.move_hashes(self.src_block_id, self.dst_block_id)
        else:
            state.copy_on_write(self.request_id, self.group, self.position, self.src_block_id, self.dst_block_id)

    def describe(self) -> str:
        if self.moved_hashes:
            return (
                f"copy block {self.src_block_id} → {self.dst_block_id}: its cache keys move to the copy ({self.request_id} keeps writing)"
            )
        return f"copy block {self.src_block_id} → {self.dst_block_id} for {self.request_id} (position {self.position}, group {self.group})"


@_register
@dataclass(slots=True)
class BlockRelocated(Event):
    """A Mamba group's speculative scratch block (``MambaSpec.num_speculative_blocks``)
    moves from ``position`` of the request's table to its end: the request crossed a block
    boundary, and the scratch blocks always follow the running state (vLLM 0.33:
    ``MambaManager._relocate_speculative_block``). The old position becomes null; the block
    keeps its one reference -- no free, no allocation."""

    kind: ClassVar[str] = "block_relocated"
    request_id: str | None = None
    group: int = 0
    position: int = 0
    block_id: int = 0

    def apply(self, state: ReplayState) -> None:
        state.relocate(self.request_id, self.group, self.position, self.block_id)

    def describe(self) -> str:
        return f"move scratch block {self.block_id} of {self.request_id} from position {self.position} to the end (group {self.group})"


@_register
@dataclass(slots=True)
class BlocksSkipped(Event):
    """Sliding window: blocks that left the window are replaced by the null block in a table."""

    kind: ClassVar[str] = "blocks_skipped"
    request_id: str | None = None
    group: int = 0
    positions: list[int] = field(default_factory=list)  # logical block indices now null
    block_ids: list[int] = field(default_factory=list)

    def apply(self, state: ReplayState) -> None:
        state.null_out(self.request_id, self.group, self.positions)

    def describe(self) -> str:
        return f"window: positions {_ids(self.positions)} of {self.request_id} → null, blocks {_ids(self.block_ids)}"


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

    def apply(self, state: ReplayState) -> None:
        state.record_lookup(self)

    def describe(self) -> str:
        return f"lookup {self.request_id}: {self.num_hit_tokens} of {self.num_tokens} tokens cached"


@_register
@dataclass(slots=True)
class CacheReset(Event):
    """``reset_prefix_cache``: every hash forgotten (vLLM: ``AllBlocksCleared``) -- or refused,
    when a request still holds a block."""

    kind: ClassVar[str] = "cache_reset"
    success: bool = True

    def apply(self, state: ReplayState) -> None:
        if self.success:
            state.clear_cache()

    def describe(self) -> str:
        return "reset the prefix cache" if self.success else "prefix-cache reset refused: blocks are in use"


# --- scheduler --------------------------------------------------------------------------------
@_register
@dataclass(slots=True)
class SchedulerCreated(Event):
    kind: ClassVar[str] = "scheduler_created"
    policy: str = "fcfs"
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    enable_chunked_prefill: bool = True

    def apply(self, state: ReplayState) -> None:
        state.policy = self.policy

    def describe(self) -> str:
        return f"scheduler: {self.policy}, {self.max_num_batched_tokens} tokens and {self.max_num_seqs} requests per step"


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

    def apply(self, state: ReplayState) -> None:
        state.add_request(self.request_id, len(self.prompt_token_ids), self.priority, self.arrival_time, self.cache_salt, self.lora_name)

    def describe(self) -> str:
        return f"add {self.request_id} ({len(self.prompt_token_ids)} prompt tokens)"


@_register
@dataclass(slots=True)
class StepStarted(Event):
    kind: ClassVar[str] = "step_started"
    tone: ClassVar[str] = "step"
    token_budget: int = 0

    def apply(self, state: ReplayState) -> None:
        state.begin_step()

    def describe(self) -> str:
        return f"— step {self.step} —"


@_register
@dataclass(slots=True)
class RequestScheduled(Event):
    kind: ClassVar[str] = "request_scheduled"
    request_id: str = ""
    num_tokens: int = 0
    num_computed_tokens: int = 0  # before this step
    phase: str = "running"  # "new" | "resumed" | "running"
    num_cached_tokens: int = 0  # prefix hit, for new/resumed (local + external)
    num_external_tokens: int = 0  # of which a KV connector supplies (lessons 12-13)

    def apply(self, state: ReplayState) -> None:
        if self.phase != "running":
            state.admit(self.request_id, self.num_computed_tokens)
        state.schedule(self.request_id, self.num_tokens, self.phase)

    def describe(self) -> str:
        ext = f", {self.num_external_tokens} tokens from a connector" if self.num_external_tokens else ""
        return f"schedule {self.request_id}: {self.num_tokens} tokens ({self.phase}{ext})"


@_register
@dataclass(slots=True)
class RequestLoading(Event):
    """A KV connector loads part of the request's prompt asynchronously: the request holds
    its blocks and waits, computing nothing, until the worker reports the KV received --
    then it is scheduled (vLLM: status ``WAITING_FOR_REMOTE_KVS``)."""

    kind: ClassVar[str] = "request_loading"
    request_id: str = ""
    num_computed_tokens: int = 0  # the local hit plus the tokens on their way
    num_external_tokens: int = 0  # of which the connector loads

    def apply(self, state: ReplayState) -> None:
        state.start_loading(self.request_id, self.num_computed_tokens)

    def describe(self) -> str:
        return f"load {self.request_id}: {self.num_external_tokens} tokens of KV on their way; it waits holding its blocks"


@_register
@dataclass(slots=True)
class RequestPreempted(Event):
    kind: ClassVar[str] = "request_preempted"
    tone: ClassVar[str] = "alert"
    request_id: str = ""
    reason: str = ""
    for_request_id: str = ""  # the running request that could not get a block
    num_computed_tokens_lost: int = 0

    def apply(self, state: ReplayState) -> None:
        state.preempt(self.request_id)

    def describe(self) -> str:
        if not self.for_request_id:
            return f"PREEMPT {self.request_id} ({self.reason})"
        return f"PREEMPT {self.request_id} ({self.reason}; for {self.for_request_id})"


@_register
@dataclass(slots=True)
class TokensAppended(Event):
    kind: ClassVar[str] = "tokens_appended"
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)

    def apply(self, state: ReplayState) -> None:
        state.append_tokens(self.request_id, len(self.token_ids))

    def describe(self) -> str:
        return f"{self.request_id} += {_ids(self.token_ids)}"


@_register
@dataclass(slots=True)
class RequestPaused(Event):
    """A streaming-input session's turn ended (``reason``: "stop" or "length", as a finish
    would say): the request keeps its blocks and computed tokens and waits for its next
    chunk of input (vLLM 0.33: status ``WAITING_FOR_STREAMING_REQ``)."""

    kind: ClassVar[str] = "request_paused"
    request_id: str = ""
    reason: str = ""
    num_output_tokens: int = 0

    def apply(self, state: ReplayState) -> None:
        state.pause(self.request_id)

    def describe(self) -> str:
        return f"pause {self.request_id} ({self.reason}): it keeps its blocks, waiting for input"


@_register
@dataclass(slots=True)
class RequestResumed(Event):
    """The next chunk of a session arrived: its output so far but the last sampled token
    (never computed) became prompt, then ``prompt_token_ids`` were appended; the request is
    queued again with ``num_computed_tokens`` already in its blocks, so only the rest is
    prefilled."""

    kind: ClassVar[str] = "request_resumed"
    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)  # the chunk
    num_prompt_tokens: int = 0  # the session's prompt now
    num_computed_tokens: int = 0
    max_tokens: int = 0

    def apply(self, state: ReplayState) -> None:
        state.resume(self.request_id, self.num_prompt_tokens, self.num_computed_tokens)

    def describe(self) -> str:
        return f"{self.request_id} resumes with {_ids(self.prompt_token_ids)} ({self.num_computed_tokens} tokens kept)"


@_register
@dataclass(slots=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "request_finished"
    request_id: str = ""
    reason: str = ""  # "stop" (eos) | "length" (max_tokens) | "abort"
    num_output_tokens: int = 0

    def apply(self, state: ReplayState) -> None:
        state.finish(self.request_id, self.reason)

    def describe(self) -> str:
        return f"finish {self.request_id} ({self.reason})"


@_register
@dataclass(slots=True)
class StepFinished(Event):
    """The end of a step, with every per-step metric: THE per-step metrics channel.

    The scheduler's counters (vLLM's ``SchedulerStats``: ``/metrics`` gauges and counters)
    and the engine's facts about the same step (the simulated clock, prefill and decode
    tokens; vLLM keeps those in its ``IterationStats``) travel in this one record, so a
    lesson, a view and a saved log all read the same numbers. ``time``,
    ``num_prefill_tokens`` and ``num_decode_tokens`` come from the engine: a scheduler
    stepped without one leaves them 0.0 / None.
    """

    kind: ClassVar[str] = "step_finished"
    METRICS: ClassVar[tuple[str, ...]] = (
        "time",
        "num_running",
        "num_waiting",
        "kv_cache_usage",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_scheduled_tokens",
        "num_prefill_tokens",
        "num_decode_tokens",
    )
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0  # cumulative, tokens
    time: float = 0.0  # simulated clock after the step (seconds)
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int | None = None
    num_decode_tokens: int | None = None

    def metrics(self) -> dict[str, Any]:
        """This step's numbers by name (``METRICS``), plus ``step``."""
        return {"step": self.step, **{k: getattr(self, k) for k in self.METRICS}}

    def apply(self, state: ReplayState) -> None:
        state.end_step(self)

    def describe(self) -> str:
        return f"end of step: usage {self.kv_cache_usage:.0%}, running {self.num_running}, waiting {self.num_waiting}"


# --- model runner ------------------------------------------------------------------------------
@_register
@dataclass(slots=True)
class AttentionBatch(Event):
    """What the attention kernel was given in one step, and what it was seen to read.

    The inputs (tables, slot mappings, lengths) are what the model runner passed. The
    ``kernel_reads`` are *observed*: under the Triton interpreter the runner traces the
    kernel's real loads (``kvlab.kernels.trace``) for one layer of each KV-cache group
    (``read_layers``); ``kernel_reads[g][s]`` lists the slots (``block * block_size +
    offset``) sequence ``s`` loaded from that layer's K or V cache. None: not observed (the
    reference backend, a GPU, or a log without a model). The kernel view draws these
    against what the manager's block table says should be read (lesson 02).
    """

    kind: ClassVar[str] = "attention_batch"
    req_ids: list[str] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)  # [group][seq][block]
    slot_mappings: list[list[int]] = field(default_factory=list)  # [group][token]
    block_size: int = 16
    sliding_windows: list[int | None] = field(default_factory=list)  # per group
    kernel_reads: list[list[list[int]]] | None = None  # [group][seq][slot], observed loads
    read_layers: list[int] = field(default_factory=list)  # per group: the layer whose loads were traced

    def apply(self, state: ReplayState) -> None:
        state.attention_batch = self

    def describe(self) -> str:
        traced = ""
        if self.kernel_reads is not None:
            n = sum(len(r) for g in self.kernel_reads for r in g)
            traced = f"; traced loads: {n} slots"
        return f"attention kernel: {len(self.req_ids)} requests, {sum(self.query_lens)} query tokens{traced}"


# --- KV offload tiers and connectors (lessons 12, 13) ---------------------------------------
@_register
@dataclass(slots=True)
class OffloadTiersCreated(Event):
    """An offloading connector put tiers behind the GPU pool: ``tiers`` = [{"medium": "CPU",
    "num_blocks": n}, {"medium": "STORAGE", ...}] (vLLM's medium names; STORAGE is the disk
    tier), each an LRU of block hashes."""

    kind: ClassVar[str] = "offload_tiers_created"
    tiers: list[dict[str, Any]] = field(default_factory=list)

    def apply(self, state: ReplayState) -> None:
        state.init_tiers(self.tiers)

    def describe(self) -> str:
        return "offload tiers: " + ", ".join(f"{t['medium']} ({t['num_blocks']} blocks)" for t in self.tiers)


@_register
@dataclass(slots=True)
class KVTransfer(Event):
    """KV moved between the paged cache and somewhere else, block by block.

    ``direction`` "store": GPU blocks ``block_ids`` copied out to ``media[i]`` (a tier's slot
    ``chunk_ids[i]``, or a file in ``paths``); a "STORAGE" store copies a CPU slot to a file
    (the cascade). "load": back into GPU blocks ``block_ids`` from ``media[i]`` -- a
    "STORAGE" block goes through the CPU tier (it lands in CPU slot ``chunk_ids[i]`` first:
    vLLM's staged promotion). The tiers' order after it comes in ``OffloadTierOrder``.
    ``medium`` "FILE" is a connector's own files (disaggregated prefill)."""

    kind: ClassVar[str] = "kv_transfer"
    tone: ClassVar[str] = "hit"
    direction: str = "store"  # "store" | "load"
    request_id: str | None = None
    media: list[str] = field(default_factory=list)  # per block
    block_ids: list[int] = field(default_factory=list)  # GPU blocks (empty for a CPU -> DISK copy)
    block_hashes: list[bytes] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)  # tier slots (CPU slots for loads)
    paths: list[str] = field(default_factory=list)
    num_tokens: int = 0

    def apply(self, state: ReplayState) -> None:
        state.transfer(self)

    def describe(self) -> str:
        where = "/".join(dict.fromkeys(self.media)) or "?"
        ids = _ids(self.block_ids) if self.block_ids else f"slots {_ids(self.chunk_ids)}"
        if self.direction == "load":
            return f"load {len(self.media)} block(s) {where} → GPU {ids} for {self.request_id} ({self.num_tokens} tokens)"
        return f"store {ids} → {where} ({len(self.media)} block(s), {self.request_id})"


@_register
@dataclass(slots=True)
class OffloadEvicted(Event):
    """Blocks left a tier: its LRU needed the slot ("lru"), or the entry went bad (a file
    missing or corrupt, a failed copy) -- ``reason`` says which."""

    kind: ClassVar[str] = "offload_evicted"
    tone: ClassVar[str] = "evict"
    medium: str = "CPU"
    block_hashes: list[bytes] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)
    reason: str = "lru"

    def apply(self, state: ReplayState) -> None:
        state.tier_remove(self.medium, [h.hex() for h in self.block_hashes])

    def describe(self) -> str:
        return f"{self.medium}: drop {len(self.block_hashes)} block(s) ({self.reason})"


@_register
@dataclass(slots=True)
class OffloadTierOrder(Event):
    """A tier's blocks in the order its cache policy would evict them, the next to go first,
    each with its slot -- recorded whenever that order changed. vLLM 0.33's policies order by
    request (a request's blocks are re-ranked when it finishes, its tail before its head),
    which no single transfer says; this event does."""

    kind: ClassVar[str] = "offload_tier_order"
    medium: str = "CPU"
    block_hashes: list[bytes] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)

    def apply(self, state: ReplayState) -> None:
        state.tier_order(self.medium, [h.hex() for h in self.block_hashes], list(self.chunk_ids))

    def describe(self) -> str:
        return f"{self.medium}: {len(self.block_hashes)} block(s), next to go first"


@_register
@dataclass(slots=True)
class KVLoadFailed(Event):
    """Loading a request's external KV failed at ``block_ids`` (none listed: the worker
    reported the whole load failed). Policy "recompute" (``recompute``; vLLM's
    ``kv_load_failure_policy="recompute"``): the request's computed tokens are cut back to
    ``num_computed_tokens`` (its first failed block); a running one computes the rest into
    the same blocks, one waiting for an asynchronous load does once the load is reported.
    Policy "fail": a running request's failed blocks leave the prefix cache, and the request
    finishes with an error."""

    kind: ClassVar[str] = "kv_load_failed"
    tone: ClassVar[str] = "alert"
    request_id: str = ""
    block_ids: list[int] = field(default_factory=list)
    reason: str = ""
    recompute: bool = True
    num_computed_tokens: int = 0

    def apply(self, state: ReplayState) -> None:
        if self.recompute:  # (policy "fail": the RequestFinished that follows finishes it)
            state.cut_computed(self.request_id, self.num_computed_tokens)

    def describe(self) -> str:
        then = f"recompute from token {self.num_computed_tokens}" if self.recompute else "fail the request"
        return f"LOAD FAILED {self.request_id} at blocks {_ids(self.block_ids)} ({self.reason}) → {then}"


# --- the encoder cache (lesson 14) --------------------------------------------------------------
@_register
@dataclass(slots=True)
class EncoderCacheCreated(Event):
    """The encoder cache exists: room for ``cache_size`` encoder embeddings."""

    kind: ClassVar[str] = "encoder_cache_created"
    cache_size: int = 0

    def apply(self, state: ReplayState) -> None:
        state.init_encoder_cache(self.cache_size)

    def describe(self) -> str:
        return f"encoder cache: {self.cache_size} embeddings"


@_register
@dataclass(slots=True)
class EncoderInputScheduled(Event):
    """Item ``input_id`` of a request is needed this step: ``computed`` -- the encoder runs
    and its ``num_embeds`` outputs take cache room; otherwise they were cached already (the
    same item hash) and the request just references them."""

    kind: ClassVar[str] = "encoder_input_scheduled"
    request_id: str = ""
    input_id: int = 0
    mm_hash: str = ""
    num_embeds: int = 0
    computed: bool = True

    def apply(self, state: ReplayState) -> None:
        state.encoder_reference(self.request_id, self.mm_hash, self.num_embeds, self.computed)

    def describe(self) -> str:
        how = "encode" if self.computed else "reuse cached"
        return f"{how} {self.mm_hash} ({self.num_embeds} embeddings) for {self.request_id}"


@_register
@dataclass(slots=True)
class EncoderInputFreed(Event):
    """A request no longer needs an item (its computed tokens passed it, or it finished);
    ``unreferenced``: no request needs it now -- evictable, still cached."""

    kind: ClassVar[str] = "encoder_input_freed"
    request_id: str = ""
    mm_hash: str = ""
    unreferenced: bool = False

    def apply(self, state: ReplayState) -> None:
        state.encoder_release(self.request_id, self.mm_hash)

    def describe(self) -> str:
        return f"{self.request_id} done with {self.mm_hash}" + (" (now unreferenced)" if self.unreferenced else "")


@_register
@dataclass(slots=True)
class EncoderCacheEvicted(Event):
    """Unreferenced encoder outputs evicted, oldest first, to make room."""

    kind: ClassVar[str] = "encoder_cache_evicted"
    tone: ClassVar[str] = "evict"
    mm_hashes: list[str] = field(default_factory=list)

    def apply(self, state: ReplayState) -> None:
        state.encoder_evict(self.mm_hashes)

    def describe(self) -> str:
        return f"encoder cache: evict {self.mm_hashes}"


_E = TypeVar("_E", bound=Event)


class EventLog:
    """An append-only list of events plus the current step number."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.step = 0
        self._subscribers: list[Callable[[Event], None]] = []
        # How many times events were taken back (``truncate``): a reader that has seen the
        # log before compares this to know its copy of the history may be stale.
        self.truncations = 0

    def emit(self, event: Event) -> None:
        event.seq = len(self.events)
        event.step = self.step
        self.events.append(event)
        for fn in self._subscribers:
            fn(event)

    def record(self, kind: str, **fields: Any) -> Event:
        """Build the event registered as ``kind`` from ``fields`` and emit it.

        For emitters that may not import this module's classes: the KV connectors live in
        ``kvlab.distributed``, which the data layer itself imports (the wire format), so
        they name their events (``log.record("kv_transfer", ...)``) instead."""
        try:
            cls = EVENT_CLASSES[kind]
        except KeyError:
            raise ValueError(f"unknown event kind {kind!r}; known kinds: {sorted(EVENT_CLASSES)}") from None
        event = cls(**fields)
        self.emit(event)
        return event

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn(event)`` on every new event (a live Player follows a log this way)."""
        self._subscribers.append(fn)

    def unsubscribe(self, fn: Callable[[Event], None]) -> None:
        """Stop calling ``fn`` (no error if it was not subscribed)."""
        if fn in self._subscribers:
            self._subscribers.remove(fn)

    def truncate(self, n: int) -> None:
        """Forget every event from position ``n`` on. The engine does this when it undoes an
        interrupted step: the log is the story of what *happened*, and that step did not."""
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n < len(self.events):
            del self.events[n:]
            self.truncations += 1

    def __len__(self) -> int:
        return len(self.events)

    def __bool__(self) -> bool:
        return True  # an empty log is still a log (``event_log or None`` must keep it)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __getitem__(self, i: int) -> Event:
        return self.events[i]

    @overload
    def of_type(self, cls: type[_E], /) -> list[_E]: ...
    @overload
    def of_type(self, *classes: type[Event]) -> list[Event]: ...
    def of_type(self, *classes: type[Event]) -> list[Any]:
        """The events that are instances of ``classes``, in order (one class: typed as that class)."""
        return [e for e in self.events if isinstance(e, classes)]

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self, *, redact_salts: bool = False) -> str:
        """The log as versioned JSON (``EventLog.from_json`` reads it back).

        ``redact_salts``: a ``cache_salt`` is a tenant's secret (lesson 06) -- whoever holds
        it can share that tenant's cache and time its prompts. With True every salt is
        replaced, here and inside the blocks' extra keys, by ``"<salt 1>"``, ``"<salt 2>"``, ...
        (the same salt, the same label: the picture still shows who shares a prefix)."""
        if not isinstance(redact_salts, bool):
            raise TypeError(f"redact_salts must be True or False, got {redact_salts!r}")
        dicts = [e.to_dict() for e in self.events]
        if redact_salts:
            labels: dict[str, str] = {}
            for d in dicts:
                salt = d.get("cache_salt")
                if isinstance(salt, str):
                    d["cache_salt"] = labels.setdefault(salt, f"<salt {len(labels) + 1}>")

            def hide(v: Any) -> Any:  # a salt may sit inside a tagged key: ("cache_salt", salt)
                if isinstance(v, str):
                    return labels.get(v, v)
                return [hide(x) for x in v] if isinstance(v, list) else v

            for d in dicts:
                if isinstance(d.get("extra_keys"), list):
                    d["extra_keys"] = hide(d["extra_keys"])
        return json.dumps({"version": FORMAT_VERSION, "step": self.step, "events": dicts})

    @classmethod
    def from_json(cls, text: str | bytes, *, max_blocks: int = MAX_BLOCKS) -> EventLog:
        """Read a log written by :meth:`to_json`, strictly: the version must be this one's,
        every event must be well formed and in order (``seq`` = its position, steps never
        going back), and a pool over ``max_blocks`` blocks is refused before anything is
        allocated. Any problem is a ``ValueError`` naming the field."""
        max_blocks = _check_max_blocks(max_blocks)
        data = parse_json(text, "the event log")
        check_version(data, FORMAT_VERSION, "the event log")
        unknown = sorted(set(data) - {"version", "step", "events"})
        if unknown:
            raise ValueError(f"the event log has unknown field(s) {unknown}; allowed: ['version', 'step', 'events']")
        for name in ("step", "events"):
            if name not in data:
                raise ValueError(f"the event log is missing the field {name!r}")
        step, raw = data["step"], data["events"]
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r:.80}")
        if not isinstance(raw, list):
            raise ValueError(f"events must be a list, got {type(raw).__name__}")
        events: list[Event] = []
        prev = 0
        for i, d in enumerate(raw):
            where = f"events[{i}]"
            if isinstance(d, dict):
                for name in ("seq", "step"):
                    if name not in d:
                        raise ValueError(f"{where} is missing the field {name!r}")
            e = event_from_dict(d, where=where, max_blocks=max_blocks)
            if e.seq != i:
                raise ValueError(f"{where}.seq = {e.seq}, but it is event {i}: events must be complete and in order")
            if not prev <= e.step <= step:
                raise ValueError(f"{where}.step = {e.step} must be in {prev}..{step} (steps never go back; the log is at step {step})")
            prev = e.step
            events.append(e)
        log = cls()
        log.events = events
        log.step = step
        return log

    def save(self, path: str, *, redact_salts: bool = False) -> None:
        """Write :meth:`to_json` to ``path`` (``redact_salts``: see there)."""
        text = self.to_json(redact_salts=redact_salts)
        with open(path, "w") as f:
            f.write(text)

    @classmethod
    def load(cls, path: str, *, max_blocks: int = MAX_BLOCKS) -> EventLog:
        """Read a file written by :meth:`save` (strictly: see :meth:`from_json`)."""
        with open(path, "rb") as f:
            return cls.from_json(f.read(), max_blocks=max_blocks)


def _check_max_blocks(max_blocks: Any) -> int:
    if type(max_blocks) is not int or max_blocks < 2:
        raise TypeError(f"max_blocks must be an int >= 2, got {max_blocks!r}")
    return max_blocks
