"""vLLM's KV cache events and their wire format (lesson 08): the code behind
:mod:`kvlab.distributed.kv_events`, vLLM's ``vllm/distributed/kv_events.py`` (v0.33.0), kept
below the core, which builds the events.

When vLLM runs with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` its block pool records what
happens to the prefix cache -- a run of full blocks got hashes (``BlockStored``), a cached
block was evicted (``BlockRemoved``), the whole cache was dropped (``AllBlocksCleared``) --
and the engine publishes the events in batches over ZeroMQ as msgpack. KV-aware routers
(llm-d, Dynamo, ...) subscribe and keep an index of which engine holds which prefix, so they
can send a request where its prefix is already cached. kvlab's ``KVCacheManager(...,
enable_kv_cache_events=True)`` produces the same events at the same moments, and this
module writes and reads the same bytes.

The wire format, as vLLM 0.33 encodes it with msgspec:

* a batch is a positional array ``[ts, events, data_parallel_rank]`` (``EventBatch`` is
  ``array_like``; msgspec writes every field of an array-like struct, so a rank that was
  never set is ``nil`` -- vLLM's publisher fills in its rank, 0 for a single engine);
* each event is a **map** tagged with its class name, ``{"type": "BlockStored",
  "block_hashes": [...], ...}``, fields in declaration order, and every field whose value
  equals its default (``None``) is left out. Required fields (``parent_block_hash``,
  ``lora_id``, ``medium``, ``lora_name``) are always present, even when ``None``. (A detail
  for hand-written decoders: ``BlockStored`` has 15 fields + the tag, so msgspec always
  writes its header as a map16, ``de 00 nn``, never a fixmap);
* block hashes are ints -- the low 64 bits of the big-endian SHA-256 digest -- unless vLLM
  runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, then the 32-byte digests themselves
  (``ExternalBlockHash = bytes | int``).

vLLM 0.23 and older encoded each event as a positional array ``["BlockStored", f1, f2,
...]`` (msgspec ``array_like``: every field present, ``None`` included); vLLM PR #42892
switched to maps in 0.24 because every new field broke subscribers that counted positions.
``encode_batch(batch, array_like=True)`` writes that older form and ``decode_batch`` reads
both, like a consumer that must serve a fleet in the middle of an upgrade.

A consumer must count per hash: vLLM does not deduplicate blocks, so the same hash can be
stored twice (two requests computed one prefix at the same time, or a fully cached prompt
recomputes its last block) and each copy is removed by its own ``BlockRemoved``.
``CacheIndex`` does exactly that.

The ZeroMQ side of vLLM's module lives in ``kvlab/distributed``, so that the core -- which builds
these events -- never imports a socket library (an import-linter contract):
``kv_publisher.py`` (vLLM's ``ZmqEventPublisher``: the PUB socket, the replay socket, the
bind-or-connect rule), ``kv_subscriber.py`` (``Subscriber``: reads kvlab's or a real vLLM
server's stream, refills gaps from the replay socket) and ``kv_recording.py`` (streams on
disk). ``kvlab.kv_events`` re-exports all four modules (lesson 10).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import msgspec


ExternalBlockHash = bytes | int
"""A block hash as published: the 32-byte digest, or its low 64 bits as an int."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]``: one engine step's events."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; the msgpack tag (key ``"type"``) is the class name."""


class BlockStored(KVCacheEvent):
    """A run of consecutive full blocks of one request, one group, got their hashes.

    ``block_hashes`` are the new blocks' hashes in table order (null blocks of a sliding
    window are skipped), ``parent_block_hash`` the hash of the block before the first one
    (None for a prompt's first block), ``token_ids`` every token of the covered range and
    ``extra_keys`` one entry per hash (None for a plain block). With them an outside
    consumer can recompute each hash -- given the same hash function and NONE_HASH.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (vLLM's pool sends one event per evicted hash)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """``reset_prefix_cache()`` succeeded: every hash is gone (no BlockRemoved follow)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""One event of a :class:`KVEventBatch`: the three concrete kinds (the batch's field type)."""


# --- vLLM <= 0.23: events as tagged positional arrays ------------------------------------------
# The field set of vLLM 0.22/0.23; the fields added later (locality, ownership, session_id,
# lookahead_token_ids) did not exist while events were arrays.


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayKVEventBatch(EventBatch):
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]


_ArrayKVEvent = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared
_ARRAY_OF: dict[type, type[_ArrayKVEvent]] = {
    BlockStored: _ArrayBlockStored,
    BlockRemoved: _ArrayBlockRemoved,
    AllBlocksCleared: _ArrayAllBlocksCleared,
}
_CURRENT_OF: dict[type, type[KVEvent]] = {
    _ArrayBlockStored: BlockStored,
    _ArrayBlockRemoved: BlockRemoved,
    _ArrayAllBlocksCleared: AllBlocksCleared,
}
_LATER_FIELDS = ("locality", "ownership", "session_id", "lookahead_token_ids")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_ArrayKVEventBatch)

MAX_EXTRA_KEYS_DEPTH = 16
"""How deep one ``extra_keys`` entry may nest. vLLM's entries are tuples of a LoRA name, a
multimodal ``(identifier, offset)`` pair and a cache salt -- depth 2. The field is typed
``Any`` on the wire, so a payload could nest it 100,000 deep; msgspec then raises
``RecursionError`` (Python's limit, about 1,000 levels, less however deep the caller's stack
is). A fixed bound makes "too deep" one documented answer -- the malformed-payload
``ValueError`` -- wherever the caller stands."""

_TOO_DEEP = (
    "it nests deeper than Python's recursion limit; a KV event batch nests a few levels "
    f"(extra_keys entries at most {MAX_EXTRA_KEYS_DEPTH})"
)


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers more than ``limit`` levels (iterative: a deep
    value must not blow the stack of the very check that refuses it)."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            if d >= limit:
                return True
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            stack.extend((c, d + 1) for c in items)
    return False


def _check_depth(events: list[Any]) -> None:
    """Refuse an ``extra_keys`` entry nested deeper than :data:`MAX_EXTRA_KEYS_DEPTH`."""
    for i, ev in enumerate(events):
        keys = getattr(ev, "extra_keys", None)
        if not isinstance(keys, (list, tuple)):
            continue  # None, or a wrong type the schema check names
        for j, entry in enumerate(keys):
            if _too_deep(entry, MAX_EXTRA_KEYS_DEPTH):
                raise ValueError(
                    f"batch.events[{i}].extra_keys[{j}] nests deeper than {MAX_EXTRA_KEYS_DEPTH} levels; "
                    "vLLM's entries are tuples of names, ints and (identifier, offset) pairs"
                )


def _to_array_event(ev: KVCacheEvent) -> _ArrayKVEvent:
    cls = _ARRAY_OF.get(type(ev))
    if cls is None:
        raise TypeError(f"batch.events holds a {type(ev).__name__}; expected BlockStored, BlockRemoved or AllBlocksCleared")
    for name in _LATER_FIELDS:
        if getattr(ev, name, None) is not None:
            raise ValueError(f"{type(ev).__name__}.{name} did not exist while events were arrays (vLLM <= 0.23); it must be None")
    return cls(**{f: getattr(ev, f) for f in cls.__struct_fields__})


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, EventBatch):
        raise TypeError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
    if isinstance(batch.ts, bool) or not isinstance(batch.ts, (int, float)):
        raise TypeError(f"batch.ts must be a number (the step's unix time), got {type(batch.ts).__name__} {batch.ts!r}")
    if not isinstance(batch.events, list):
        raise TypeError(f"batch.events must be a list of BlockStored, BlockRemoved or AllBlocksCleared, got {type(batch.events).__name__}")
    for i, ev in enumerate(batch.events):
        if type(ev) not in _ARRAY_OF:
            raise TypeError(f"batch.events[{i}] is a {type(ev).__name__}; expected BlockStored, BlockRemoved or AllBlocksCleared")


_PATH = re.compile(r"`\$\[(\d)\](?:\[(\d+)\])?")
_TOP = ("batch.ts", "batch.events", "batch.data_parallel_rank")


def validate_batch(batch: Any, *, array_like: bool = False) -> bytes:
    """Refuse, before anything changes, a batch whose events a subscriber could not read;
    return its payload (:func:`encode_batch`'s bytes), so a caller that sends it need not
    encode it again.

    A ``KVEventBatch`` built in Python is not type-checked by msgspec (a struct takes any
    value), so a ``block_hashes=None`` would be sent, and fail on the other side -- or fail
    half-way through a consumer's update. The check is the subscriber's own: encode, then
    decode with the wire schema. TypeError/ValueError name the field (``batch.events[1]...``).
    """
    _check_batch(batch)
    if isinstance(batch.events, list):
        _check_depth(batch.events)  # before encoding: msgspec would recurse into it
    try:
        payload = encode_batch(batch, array_like=array_like)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"batch cannot be encoded: {e}") from None
    except RecursionError:
        raise ValueError(f"batch cannot be encoded: {_TOO_DEEP}") from None
    try:
        (_array_decoder if array_like else _decoder).decode(payload)
    except msgspec.ValidationError as e:
        msg = _PATH.sub(
            lambda m: "`"
            + (_TOP[int(m.group(1))] if m.group(1) in "012" else "batch")
            + (f"[{m.group(2)}]" if m.group(2) is not None else ""),
            str(e),
        )
        raise ValueError(f"batch is not a valid KV event batch: {msg}") from None
    return payload


def encode_batch(batch: KVEventBatch, *, array_like: bool = False) -> bytes:
    """The msgpack payload vLLM's publisher sends for ``batch`` (byte for byte).

    ``array_like=True`` writes the events as vLLM 0.23 and older did (tagged positional
    arrays); the batch itself is an array either way.
    """
    _check_batch(batch)
    if not isinstance(array_like, bool):
        raise TypeError(f"array_like must be True or False, got {array_like!r}")
    if not array_like:
        return _encoder.encode(batch)
    return _encoder.encode(
        _ArrayKVEventBatch(ts=batch.ts, events=[_to_array_event(e) for e in batch.events], data_parallel_rank=batch.data_parallel_rank)
    )


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Read one payload of either encoding (maps: vLLM >= 0.24; arrays: vLLM <= 0.23).

    As with vLLM's own structs, tuples nested inside ``extra_keys`` entries (a multimodal
    ``(identifier, offset)``) come back as lists: msgpack has one array type.

    Every reader of the wire -- ``CacheIndex.apply``, ``Subscriber``, ``KVStream``,
    recordings -- decodes here, so a bad payload is one ``ValueError`` for all of them:
    invalid msgpack, the wrong schema, or nesting deeper than :data:`MAX_EXTRA_KEYS_DEPTH`
    (msgspec's ``RecursionError`` included).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        batch = _decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as e:
        raise ValueError(f"payload is not a KV event batch: it is not valid msgpack ({e})") from None
    except RecursionError:
        raise ValueError(f"payload is not a KV event batch: {_TOO_DEEP}") from None
    else:
        _check_payload_depth(batch.events)
        return batch
    try:
        old = _array_decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise ValueError(f"payload is not a KV event batch of vLLM's wire format: {e}") from None
    except RecursionError:
        raise ValueError(f"payload is not a KV event batch: {_TOO_DEEP}") from None
    _check_payload_depth(old.events)
    return KVEventBatch(
        ts=old.ts,
        events=[_CURRENT_OF[type(e)](**{f: getattr(e, f) for f in type(e).__struct_fields__}) for e in old.events],
        data_parallel_rank=old.data_parallel_rank,
    )


def _check_payload_depth(events: list[Any]) -> None:
    try:
        _check_depth(events)
    except ValueError as e:
        raise ValueError(f"payload is not a KV event batch: {str(e).replace('batch.', '', 1)}") from None


NodeKey = tuple[str | None, int | None, ExternalBlockHash]
"""``(medium, group_idx, block_hash)``: one cached block as a stream names it."""

_V = TypeVar("_V")


def fold_events(
    table: dict[NodeKey, _V],
    events: Iterable[KVCacheEvent],
    new: Callable[[BlockStored, int], _V],
    recount: Callable[[_V, int], _V | None],
    collect: bool = False,
) -> tuple[list[NodeKey], list[_V], bool, int]:
    """Fold vLLM's KV events into ``table``, one entry per cached block; the one fold that
    every consumer here uses (``CacheIndex``'s copy counts, ``KVStream``'s prefix nodes).

    The rules a subscriber must follow: vLLM does not deduplicate blocks, so a hash stored
    twice has two *copies* and stays cached until a ``BlockRemoved`` came for each; a
    removal of a hash never seen stored is not an error (the subscriber joined late, or a
    gap was lost) but counted; ``AllBlocksCleared`` empties the table. What an entry holds
    is the caller's: ``new(event, i)`` makes the entry for the event's ``i``-th hash the
    first time it is stored, ``recount(entry, +1 or -1)`` adds or drops a copy and returns
    ``None`` when none is left (the entry is then deleted).

    Returns ``(stored, removed, cleared, unknown)``: with ``collect``, the keys stored (or
    given a copy) and the last entries of the blocks removed for good, both since the
    batch's last ``AllBlocksCleared``; whether one came; removals of unknown hashes.

    One case these rules count wrong, as any copy-counting subscriber of vLLM 0.33 would: a
    request with ``kv_cache_report_mode="full"`` has its prefix hit sent as a ``BlockStored``
    although no block was copied, and no ``BlockRemoved`` will ever match it -- so such a hash
    keeps one copy too many.
    """
    stored: list[NodeKey] = []
    removed: list[_V] = []
    cleared = False
    unknown = 0
    for ev in events:
        if type(ev) is BlockStored:
            medium, group = ev.medium, ev.group_idx
            for i, h in enumerate(ev.block_hashes):
                key = (medium, group, h)
                old = table.get(key)
                more = new(ev, i) if old is None else recount(old, 1)
                assert more is not None, "recount(entry, +1) returned None"
                table[key] = more
                if collect:
                    stored.append(key)
        elif type(ev) is BlockRemoved:
            medium, group = ev.medium, ev.group_idx
            for h in ev.block_hashes:
                key = (medium, group, h)
                old = table.get(key)
                if old is None:
                    unknown += 1
                    continue
                left = recount(old, -1)
                if left is None:
                    del table[key]
                    if collect:
                        removed.append(old)
                else:
                    table[key] = left
        else:  # AllBlocksCleared
            table.clear()
            cleared = True
            stored.clear()
            removed.clear()
    return stored, removed, cleared, unknown


def _one_copy(ev: BlockStored, i: int) -> int:  # noqa: ARG001 - fold_events' signature
    return 1


def _recount(copies: int, delta: int) -> int | None:
    return copies + delta or None


class CacheIndex:
    """A consumer's view of one engine's prefix cache, rebuilt from its event stream.

    This is what a KV-aware router keeps per engine. It counts *copies*: a hash stored
    twice (vLLM keeps duplicate blocks) stays cached until both copies are removed.
    Counts are kept per ``(medium, group_idx, hash)``; ``cached_hashes`` is every hash with
    at least one copy in any group.
    """

    def __init__(self) -> None:
        self._copies: dict[NodeKey, int] = {}
        self.num_events = 0
        self.num_unknown_removals = 0  # removals of hashes never seen stored (joined late)

    def apply(self, batch: KVEventBatch | bytes | Iterable[KVCacheEvent]) -> "CacheIndex":
        """Fold one batch (or a payload, or a list of events) into the index."""
        # All or nothing: the whole batch is checked before the index changes.
        if isinstance(batch, (bytes, bytearray, memoryview)):
            batch = decode_batch(batch)  # the wire schema checked every field
        elif isinstance(batch, EventBatch):
            validate_batch(batch)
        elif isinstance(batch, Iterable) and not isinstance(batch, (str, dict)):
            given = list(batch)
            for i, ev in enumerate(given):
                if type(ev) not in _ARRAY_OF:
                    raise TypeError(f"events[{i}] is a {type(ev).__name__}; expected BlockStored, BlockRemoved or AllBlocksCleared")
            batch = KVEventBatch(ts=0.0, events=cast("list[KVEvent]", given))  # each one checked just above
            validate_batch(batch)
        else:
            raise TypeError(f"batch must be a KVEventBatch, its msgpack payload or a list of events, got {type(batch).__name__}")
        events = batch.events
        self.num_events += len(events)
        self.num_unknown_removals += fold_events(self._copies, events, _one_copy, _recount)[3]
        return self

    @property
    def cached_hashes(self) -> set[ExternalBlockHash]:
        return {h for (_, _, h) in self._copies}

    def num_copies(self, block_hash: ExternalBlockHash, group_idx: int | None = 0, medium: str | None = MEDIUM_GPU) -> int:
        return self._copies.get((medium, group_idx, block_hash), 0)

    def __contains__(self, block_hash: object) -> bool:
        return any(h == block_hash for (_, _, h) in self._copies)

    def __len__(self) -> int:
        return len(self.cached_hashes)


__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheIndex",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "MAX_EXTRA_KEYS_DEPTH",
    "NodeKey",
    "decode_batch",
    "encode_batch",
    "fold_events",
    "validate_batch",
]
