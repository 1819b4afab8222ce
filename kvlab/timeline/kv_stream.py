"""A KV-event stream as data: what an engine caches, after any batch (lesson 10).

``kvlab.timeline.Timeline`` replays kvlab's own rich event log; a real vLLM server tells the
outside world much less -- only its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
batches. :class:`KVStream` turns those batches (live from a ``Subscriber``, or read back
from a recording) into :class:`StreamSnapshot` s: every cached block the stream revealed,
with its parent (``BlockStored.parent_block_hash`` and the order of ``block_hashes`` chain
them), its tokens and how many copies the engine holds. The views draw snapshots; they
never see a socket, and a recorded stream replays into them exactly as a live one did.

What a stream cannot say, and the snapshot therefore does not pretend to know: whether a
cached block is in use or sits evictable on the free queue (the engine only reports a
block when it gets its hash and when it is evicted), and anything from before the
subscriber joined (a block whose parent the stream never showed is an *orphan*: its chain
started earlier, or its parent was evicted first).

Jumps to any batch are cheap: the state is copied every ``checkpoint_every`` batches, and
``at(i)`` replays at most that many batches from the nearest copy.

A publisher that restarts begins again at seq 0 with an empty cache (a new engine process).
A stream -- live from a ``Subscriber``, or a recording made across the restart -- takes that
seq 0 as the start of a new *run*: the cache is emptied before the batch (the old engine's
blocks are gone, no ``BlockRemoved`` says so), ``series.restarts`` / ``StreamSnapshot.restarted``
mark the batch, and ``runs`` lists where each run starts. Seqs increase within a run, so
``index_of(seq, run=...)`` looks a seq up in one run (the last by default).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlab.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVEventBatch,
    NodeKey,
    decode_batch,
    encode_batch,
    fold_events,
    validate_batch,
)
from kvlab.utils.checks import check_int
from kvlab.distributed.kv_recording import Recorder, Recording, read_recording


@dataclass(frozen=True, slots=True)
class PrefixNode:
    """One cached block the stream revealed (immutable: snapshots share them)."""

    block_hash: ExternalBlockHash
    parent_hash: ExternalBlockHash | None  # None: the first block of a prompt
    token_ids: tuple[int, ...]  # empty when the event's tokens could not be split per block
    block_size: int
    medium: str | None
    group_idx: int | None
    copies: int  # vLLM keeps duplicate blocks: each copy is removed separately
    stored_seq: int  # the batch that first stored it
    stored_ts: float
    lora_name: str | None = None
    extra_keys: Any = None

    @property
    def key(self) -> NodeKey:
        return (self.medium, self.group_idx, self.block_hash)

    @property
    def parent_key(self) -> NodeKey | None:
        return None if self.parent_hash is None else (self.medium, self.group_idx, self.parent_hash)


@dataclass(frozen=True, slots=True)
class StreamSnapshot:
    """The engine's cache as the stream shows it after batch ``index`` (seq ``seq``).

    ``nodes``: every cached block by :data:`NodeKey`; ``stored``: keys this batch stored (or
    added a copy of); ``removed``: the last record of each block this batch removed for good;
    ``cleared``: the batch held an ``AllBlocksCleared``; ``missing``: how many seqs before
    this batch never arrived (gaps the replay socket could not fill).
    """

    index: int  # -1: before the first batch
    seq: int | None
    ts: float | None
    nodes: Mapping[NodeKey, PrefixNode]
    stored: tuple[NodeKey, ...] = ()
    removed: tuple[PrefixNode, ...] = ()
    cleared: bool = False
    missing: int = 0
    num_events: int = 0  # in this batch
    name: str = ""
    restarted: bool = False  # this batch began a new run: the publisher restarted (seq 0)

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)

    def cached_hashes(self, group_idx: int | None = 0, medium: str | None = "GPU") -> set[ExternalBlockHash]:
        return {k[2] for k in self.nodes if k[0] == medium and k[1] == group_idx}

    def hit_blocks(self, block_hashes: Iterable[ExternalBlockHash], group_idx: int | None = 0, medium: str | None = "GPU") -> int:
        """How many leading blocks of a prompt with these hashes the stream says are cached:
        the walk a KV-aware router makes (it stops at the first miss)."""
        n = 0
        for h in block_hashes:
            if (medium, group_idx, h) not in self.nodes:
                break
            n += 1
        return n

    def is_orphan(self, key: NodeKey) -> bool:
        """A block whose parent the stream does not (or no longer) show."""
        p = self.nodes[key].parent_key
        return p is not None and p not in self.nodes


def _recount(node: PrefixNode, delta: int) -> PrefixNode | None:
    copies = node.copies + delta
    return dataclasses.replace(node, copies=copies) if copies else None


def _apply(
    nodes: dict[NodeKey, PrefixNode], seq: int, batch: EventBatch, collect: bool
) -> tuple[list[NodeKey], list[PrefixNode], bool, int]:
    """Fold one batch into ``nodes`` (``fold_events``' rules); with ``collect`` also return
    what it stored/removed."""
    ts = batch.ts

    def new(ev: BlockStored, i: int) -> PrefixNode:
        # A block's parent is the hash before it in the event, or the event's parent for the
        # first; its tokens are its slice of the event's, when they split evenly per block.
        hashes, bs, toks, extra = ev.block_hashes, ev.block_size, ev.token_ids, ev.extra_keys
        parent = hashes[i - 1] if i else ev.parent_block_hash
        mine = tuple(toks[i * bs : (i + 1) * bs]) if bs > 0 and len(toks) == len(hashes) * bs else ()
        extra_i = extra[i] if extra is not None and i < len(extra) else None
        return PrefixNode(hashes[i], parent, mine, bs, ev.medium, ev.group_idx, 1, seq, ts, ev.lora_name, extra_i)

    return fold_events(nodes, batch.events, new, _recount, collect)


@dataclass
class StreamSeries:
    """One entry per batch: ``seq``, ``ts``, ``cached_blocks`` (after the batch),
    ``stored_blocks`` / ``removed_blocks`` (block hashes in its events), ``events``,
    ``cleared``, ``missing`` (seqs lost before it) and ``restarts`` (the batch began a new
    run: seq 0 after earlier batches)."""

    seq: list[int] = field(default_factory=list)
    ts: list[float] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)
    stored_blocks: list[int] = field(default_factory=list)
    removed_blocks: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    cleared: list[bool] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    restarts: list[bool] = field(default_factory=list)


class KVStream:
    """Batches of one engine's KV-event stream, with any batch's :class:`StreamSnapshot`.

    Feed it ``(seq, batch)`` pairs -- ``KVStream(sub.receive(...))``, ``stream.extend(...)``
    while a server runs, ``KVStream.load("run.kvev")`` for a recording. A batch may be a
    decoded ``KVEventBatch`` or its msgpack payload. Seqs must increase; a jump is recorded
    as missing batches (the subscriber already asked the replay socket for them). A seq 0
    after earlier batches is a publisher restart: a new run, from an empty cache (see the
    module doc).
    """

    def __init__(self, batches: Iterable[tuple[int, KVEventBatch | bytes]] = (), *, name: str = "", checkpoint_every: int = 64) -> None:
        checkpoint_every = check_int("checkpoint_every", checkpoint_every, 1)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        self.name = name
        self.checkpoint_every = checkpoint_every
        self._batches: list[KVEventBatch] = []
        self._payloads: list[bytes | None] = []
        self._head: dict[NodeKey, PrefixNode] = {}
        self._checkpoints: list[dict[NodeKey, PrefixNode]] = [{}]  # state before batch k * checkpoint_every
        self._cursor: tuple[int, dict[NodeKey, PrefixNode]] | None = None  # last state computed by at()
        self._run_starts: list[int] = []  # index of each run's first batch
        self.series = StreamSeries()
        self.num_unknown_removals = 0
        self.extend(batches)

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def load(cls, source: str | os.PathLike | Recording, *, strict: bool = True, name: str | None = None) -> "KVStream":
        """A stream from a recording (a path or a ``Recording``); see ``read_recording``."""
        if not isinstance(source, (str, os.PathLike, Recording)):
            raise TypeError(f"source must be a recording's path or a Recording, got {type(source).__name__} {source!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be None or a str, got {type(name).__name__}")
        rec = source if isinstance(source, Recording) else read_recording(source, strict=strict)
        stream = cls(name=name if name is not None else os.path.basename(rec.path))
        for r in rec.records:
            stream.append(r.seq, r.payload)
        return stream

    def append(self, seq: int, batch: KVEventBatch | bytes | bytearray | memoryview) -> None:
        """Add the next batch (all-or-nothing: a bad seq or payload changes nothing)."""
        seq = check_int("seq", seq, 0)
        last = self.series.seq[-1] if self.series.seq else None
        restart = last is not None and seq == 0
        if last is not None and seq <= last and not restart:
            raise ValueError(
                f"seq {seq} does not follow the last batch's seq {last}; a stream's seqs increase "
                "(seq 0 alone starts a new run: the publisher restarted)"
            )
        payload: bytes | None = None
        if isinstance(batch, (bytes, bytearray, memoryview)):
            payload = bytes(batch)
            batch = decode_batch(payload)
        elif not isinstance(batch, EventBatch):
            raise TypeError(f"batch must be a KVEventBatch or its msgpack payload, got {type(batch).__name__}")
        else:
            validate_batch(batch)  # every field, before the stream changes (a payload was checked by decoding)
        k = len(self._batches)
        if k and k % self.checkpoint_every == 0:
            self._checkpoints.append(dict(self._head))
        if restart:
            self._head.clear()  # a new engine process: the old one's blocks are gone
        if restart or not k:
            self._run_starts.append(k)
        _, _, cleared, unknown = _apply(self._head, seq, batch, collect=False)
        self.num_unknown_removals += unknown
        self._batches.append(batch)
        self._payloads.append(payload)
        s = self.series
        s.missing.append((s.missing[-1] if s.missing else 0) + (seq - last - 1 if last is not None and not restart else 0))
        s.restarts.append(restart)
        s.seq.append(seq)
        s.ts.append(batch.ts)
        s.cached_blocks.append(len(self._head))
        s.stored_blocks.append(sum(len(e.block_hashes) for e in batch.events if type(e) is BlockStored))
        s.removed_blocks.append(sum(len(e.block_hashes) for e in batch.events if type(e) is BlockRemoved))
        s.events.append(len(batch.events))
        s.cleared.append(cleared)

    def extend(self, batches: Iterable[tuple[int, KVEventBatch | bytes]]) -> int:
        """Append every ``(seq, batch)``; returns how many were added."""
        n = 0
        for seq, batch in batches:
            self.append(seq, batch)
            n += 1
        return n

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._batches)

    def __repr__(self) -> str:
        last = self.series.seq[-1] if self.series.seq else None
        return f"KVStream({self.name!r}, {len(self)} batches, last seq {last}, {len(self._head)} cached blocks)"

    @property
    def last_index(self) -> int:
        return len(self._batches) - 1

    @property
    def batches(self) -> list[KVEventBatch]:
        return list(self._batches)

    @property
    def runs(self) -> list[int]:
        """The index of each run's first batch (one run per publisher start; [] when empty)."""
        return list(self._run_starts)

    def index_of(self, seq: int, *, run: int = -1) -> int:
        """The batch index holding ``seq`` in run ``run`` (an index into :attr:`runs`;
        default the last) -- ValueError when it never arrived."""
        import bisect

        runs = self._run_starts
        if isinstance(run, bool) or not hasattr(run, "__index__"):
            raise TypeError(f"run must be an int (an index into runs), got {type(run).__name__}")
        run = operator.index(run)
        if runs and not -len(runs) <= run < len(runs):
            raise ValueError(f"run={run} is out of range; this stream has runs 0..{len(runs) - 1} (-1 = the last)")
        lo = runs[run] if runs else 0
        hi = runs[run % len(runs) + 1] if runs and run % len(runs) + 1 < len(runs) else len(self.series.seq)
        seqs = self.series.seq
        i = bisect.bisect_left(seqs, seq, lo, hi)
        if i == hi or seqs[i] != seq:
            raise ValueError(
                f"seq {seq} is not in this stream (seqs {seqs[lo : lo + 1]}..{seqs[hi - 1 : hi]}, missing {self.series.missing[-1:] or [0]})"
            )
        return i

    def at(self, index: int | None = None) -> StreamSnapshot:
        """The cache after batch ``index`` (default: the last; -1 before the first batch;
        negative indexes below -1 are not allowed)."""
        n = len(self._batches)
        if index is None:
            index = n - 1
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        index = operator.index(index)
        if not -1 <= index < n:
            raise ValueError(f"index={index} is out of range; this stream has batches 0..{n - 1} (-1 = before the first)")
        if index == -1:
            return StreamSnapshot(-1, None, None, {}, name=self.name)
        # state before batch `index`, from the nearest checkpoint or the cursor
        cur = self._cursor
        if cur is not None and cur[0] <= index and index - cur[0] < self.checkpoint_every:
            start, state = cur[0], dict(cur[1])
        else:
            c = index // self.checkpoint_every
            start, state = c * self.checkpoint_every, dict(self._checkpoints[c])
        seqs, restarts = self.series.seq, self.series.restarts
        for k in range(start, index):
            if restarts[k]:
                state.clear()
            _apply(state, seqs[k], self._batches[k], collect=False)
        if restarts[index]:
            state.clear()
        stored, removed, cleared, _ = _apply(state, seqs[index], self._batches[index], collect=True)
        self._cursor = (index + 1, dict(state))  # a copy: the snapshot keeps `state`
        return StreamSnapshot(
            index,
            seqs[index],
            self._batches[index].ts,
            state,
            tuple(dict.fromkeys(stored)),
            tuple(removed),
            cleared,
            self.series.missing[index],
            len(self._batches[index].events),
            self.name,
            restarted=restarts[index],
        )

    def snapshots(self) -> Iterator[StreamSnapshot]:
        for i in range(len(self)):
            yield self.at(i)

    # -- saving -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, *, topic: str = "") -> None:
        """Write the stream as a recording (payload bytes as received, or re-encoded)."""
        with Recorder(path, topic=topic) as rec:
            for seq, batch, payload in zip(self.series.seq, self._batches, self._payloads):
                rec.append(seq, topic, payload if payload is not None else encode_batch(batch), batch.ts)


__all__ = ["KVStream", "NodeKey", "PrefixNode", "StreamSeries", "StreamSnapshot"]
