"""The Timeline: an event log as snapshots at any step and per-step series -- the views' only input.

``Timeline(log)`` replays the log once. On the way it keeps

* a copy of the replay state every few hundred events (:meth:`ReplayState.clone
  <kvlab.timeline.state.ReplayState.clone>`, cheap: records are shared copy-on-write), so
  ``at(step)`` replays at most that many events from the nearest copy instead of the
  whole log -- the Player's slider jumps anywhere in a long run without a pause;
* every step's ``StepFinished`` record (``series``: the per-step metrics, simulated clock
  included), the runner's ``AttentionBatch`` of each step, and each request's status
  changes (``lifecycles``: the Gantt chart).

A block's history (who took it, released it, cached it, when it was evicted) is indexed on
first use (:meth:`Timeline.block_history`); the snapshot itself says who held a block last
(``BlockView.last_holder``).

A Timeline over a live ``EventLog`` follows it: every accessor first takes in the events
appended since (``refresh()`` does it explicitly).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvlab.eventlog.events import AttentionBatch, BlockCached, BlocksAllocated, BlocksTouched, Event, EventLog, StepFinished
from kvlab.eventlog.schema import MAX_BLOCKS
from kvlab.timeline.snapshot import Holding, Snapshot
from kvlab.timeline.state import ReplayState

CHECKPOINT_EVENTS = 256  # a state copy every this many events: a jump replays at most this many
SNAPSHOT_CACHE = 64  # snapshots kept for steps visited recently
_BUSY = (BlocksAllocated, BlocksTouched, BlockCached)  # events that a replay opens at (first_busy_step)


@dataclass(slots=True)
class StepSeries:
    """Per-step metrics, one entry per finished step, from the ``StepFinished`` events.

    The columns are ``StepFinished.METRICS`` plus ``step``; ``hit_rate`` (this step's
    prefix-cache hits over its queried tokens, None when it looked nothing up) and
    ``preemptions`` (this step's count) are derived from the cumulative counters.
    """

    step: list[int] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    kv_cache_usage: list[float] = field(default_factory=list)
    num_preemptions: list[int] = field(default_factory=list)
    prefix_cache_queries: list[int] = field(default_factory=list)
    prefix_cache_hits: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_prefill_tokens: list[int | None] = field(default_factory=list)
    num_decode_tokens: list[int | None] = field(default_factory=list)
    hit_rate: list[float | None] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, records: Sequence[StepFinished]) -> StepSeries:
        s = cls()
        s.step = [e.step for e in records]
        for name in StepFinished.METRICS:
            setattr(s, name, [getattr(e, name) for e in records])
        prev_q = prev_h = prev_p = 0
        for q, h, p in zip(s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions):
            s.hit_rate.append((h - prev_h) / (q - prev_q) if q > prev_q else None)
            s.preemptions.append(p - prev_p)
            prev_q, prev_h, prev_p = q, h, p
        return s

    def __len__(self) -> int:
        return len(self.step)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per step (the columns above as keys)."""
        names = ("step", *StepFinished.METRICS, "hit_rate", "preemptions")
        cols = [getattr(self, n) for n in names]
        return [dict(zip(names, vals)) for vals in zip(*cols)]


class BlockRecord(NamedTuple):
    """One thing that happened to a block (see :meth:`Timeline.block_history`)."""

    seq: int  # the event's position in the log
    step: int
    action: str  # "take" | "release" | "cache" | "evict"
    holding: Holding | None  # take / release: which table
    block_hash: str | None  # cache / evict: which hash (hex)
    ref_cnt: int  # after the action


class _BlockRecorder(ReplayState):
    """A replay state that writes down every block action (the block-history index)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[int, list[BlockRecord]] = {}

    def _note(self, bid: int, action: str, holding: Holding | None, h: str | None) -> None:
        rec = BlockRecord(self.num_events - 1, self.step, action, holding, h, self.ref[bid])
        self.history.setdefault(bid, []).append(rec)

    def take(self, bid: int, rid: str | None, group: int) -> None:
        super().take(bid, rid, group)
        held = self.holds[bid]
        self._note(bid, "take", held[-1] if rid is not None and held else None, None)

    def release(self, bid: int, rid: str | None, group: int) -> None:
        before = self.holds[bid]
        super().release(bid, rid, group)
        gone = next((h for h in before if h not in self.holds[bid]), None)
        self._note(bid, "release", gone, None)

    def cache(self, bid: int, h: str, parent: str | None, token_ids: list[int], extra_keys: Any, group: int) -> None:
        super().cache(bid, h, parent, token_ids, extra_keys, group)
        self._note(bid, "cache", None, h)

    def uncache(self, bid: int, h: str | None = None) -> None:
        h = self.hash[bid] if h is None else h
        super().uncache(bid, h)
        if h is not None:
            self._note(bid, "evict", None, h)


class Timeline:
    """Snapshots of a log at any step, per-step series and block histories (see the module doc).

    Parameters
    ----------
    log:
        An ``EventLog`` (followed as it grows) or any iterable of events in log order.
    checkpoint_events:
        A copy of the replay state is kept every this many events.
    max_blocks:
        A pool over this many blocks is refused before anything is allocated (see
        :func:`replay`); raise it to view a genuinely larger run.
    """

    def __init__(
        self, log: EventLog | Iterable[Event], *, checkpoint_events: int = CHECKPOINT_EVENTS, max_blocks: int = MAX_BLOCKS
    ) -> None:
        if not isinstance(checkpoint_events, int) or isinstance(checkpoint_events, bool) or checkpoint_events < 1:
            raise ValueError(f"checkpoint_events must be an int >= 1, got {checkpoint_events!r}")
        if isinstance(log, (str, bytes)) or not isinstance(log, Iterable):
            raise TypeError(f"log must be an EventLog or a list of events, got {type(log).__name__} (EventLog.from_json reads saved text)")
        self.log: EventLog | None = log if isinstance(log, EventLog) else None
        self._events: list[Event] = [] if self.log is not None else list(log)
        self._every = checkpoint_events
        self._max_blocks = max_blocks  # a pool over this many blocks is refused (see replay)
        self._head = ReplayState(record=True, max_blocks=max_blocks)  # has applied every event taken in so far
        self._n = 0
        self._steps: list[int] = []
        self._ends: list[int] = []  # _ends[k]: index after the last event of _steps[k]
        self._ckpt_at: list[int] = []  # event counts of the checkpoints, ascending
        self._ckpts: list[ReplayState] = []
        self._cursor: ReplayState | None = None  # the state the last jump left behind
        self._snaps: OrderedDict[int, Snapshot] = OrderedDict()
        self._records: dict[int, StepFinished] = {}
        self._held: dict[int, int] = {}  # blocks held at the end of each step
        self._batches: dict[int, AttentionBatch] = {}
        self._series: StepSeries | None = None
        self._history: _BlockRecorder | None = None
        self._truncations = self.log.truncations if self.log is not None else 0
        self._ingest()

    def _reset(self) -> None:
        """Forget everything taken in (the live log was cut back: an undone step)."""
        self.__init__(self.log, checkpoint_events=self._every, max_blocks=self._max_blocks)  # type: ignore[misc]  # a fresh start on purpose: every field as __init__ sets it

    # -- taking in events ------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        """Every event of the log, in order."""
        return self.log.events if self.log is not None else self._events

    def refresh(self) -> None:
        """Take in events appended to a live log since the last call (accessors do it too).

        Snapshots cached for the step of the first new event and later are dropped: a new
        event can belong to a step already seen (a request added after step 3 is an event
        of step 3). The state copies stay valid: each is the state after its first N events
        -- unless the log was cut back (an undone step): then everything is taken in again.
        """
        self._sync()

    def _ingest(self) -> None:
        events = self.events
        n, i = len(events), self._n
        if n == i:
            return
        prev = self._steps[-1] if self._steps else events[i].step
        for j in range(i, n):  # check first: a bad list changes nothing
            if events[j].step < prev:
                raise ValueError(f"events must be in log order: event {j} is of step {events[j].step}, after step {prev}")
            prev = events[j].step
        head, every = self._head, self._every
        first = events[i].step
        for s in [s for s in self._snaps if s >= first]:
            del self._snaps[s]
        self._series = None
        self._history = None
        steps, ends = self._steps, self._ends
        cur = steps[-1] if steps else None
        since = head.num_events - (self._ckpt_at[-1] if self._ckpt_at else 0)
        for j in range(i, n):
            e = events[j]
            if e.step != cur:
                if cur is not None:
                    ends[-1] = j
                    self._close(cur)
                steps.append(e.step)
                ends.append(j)
                cur = e.step
            head.apply(e)
            since += 1
            if since >= every:
                self._ckpt_at.append(head.num_events)
                self._ckpts.append(head.clone())
                since = 0
        ends[-1] = n
        self._close(cur)  # the last step may still grow: closed again then
        self._n = n

    def _close(self, step: int | None) -> None:
        """Write down what the head state says about ``step``, which it has just finished."""
        if step is None:
            return
        head = self._head
        self._held[step] = head.num_held
        if head.step_finished is not None:
            self._records[step] = head.step_finished
        else:
            self._records.pop(step, None)
        if head.attention_batch is not None:
            self._batches[step] = head.attention_batch
        else:
            self._batches.pop(step, None)

    @property
    def num_events(self) -> int:
        """How many events the timeline has taken in (grows with a live log)."""
        self._sync()
        return self._n

    def _sync(self) -> None:
        if self.log is not None and self.log.truncations != self._truncations:
            self._reset()
        elif len(self.events) != self._n:
            self._ingest()

    # -- steps -------------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """The steps that have events, ascending (``[0]`` for an empty log)."""
        self._sync()
        return list(self._steps) or [0]

    @property
    def first_step(self) -> int:
        self._sync()
        return self._steps[0] if self._steps else 0

    @property
    def last_step(self) -> int:
        self._sync()
        return self._steps[-1] if self._steps else 0

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def in_step(self) -> bool:
        """True between a step's ``StepStarted`` and its ``StepFinished`` (a live engine mid-step)."""
        self._sync()
        return self._head.in_step

    def _end(self, step: int) -> int:
        """How many events happened up to the end of ``step``."""
        k = bisect_right(self._steps, step)
        return self._ends[k - 1] if k else 0

    # -- snapshots ---------------------------------------------------------------------------------
    def at(self, step: int) -> Snapshot:
        """The state after every event of ``step`` (step 0: before the first schedule)."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        self._sync()
        snap = self._snaps.get(step)
        if snap is not None:
            self._snaps.move_to_end(step)
            return snap
        state = self._state_after(self._end(step))
        snap = state.snapshot()
        snap.step = step
        self._snaps[step] = snap
        if len(self._snaps) > SNAPSHOT_CACHE:
            self._snaps.popitem(last=False)
        return snap

    def after_event(self, seq: int) -> Snapshot:
        """The state right after event ``seq`` (not cached): e.g. the block tables the
        manager held when the runner's ``AttentionBatch`` was emitted, before the step's
        finished requests freed theirs."""
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise TypeError(f"seq must be an int, got {type(seq).__name__}")
        self._sync()
        if not 0 <= seq < self._n:
            raise ValueError(f"seq must be an event index in 0..{self._n - 1}, got {seq}")
        snap = self._state_after(seq + 1).snapshot()
        snap.step = self.events[seq].step
        return snap

    def _state_after(self, end: int) -> ReplayState:
        """A replay state that has applied exactly the first ``end`` events."""
        k = bisect_right(self._ckpt_at, end)
        base = self._ckpt_at[k - 1] if k else 0
        cur = self._cursor
        if cur is None or not base <= cur.num_events <= end:
            cur = self._ckpts[k - 1].clone() if k else ReplayState(max_blocks=self._max_blocks)
        cur.apply_all(self.events, cur.num_events, end)
        self._cursor = cur
        return cur

    # -- per-step facts ----------------------------------------------------------------------------
    @property
    def series(self) -> StepSeries:
        """The per-step metrics of every finished step (the ``StepFinished`` records)."""
        self._sync()
        if self._series is None:
            self._series = StepSeries.of([self._records[s] for s in sorted(self._records)])
        return self._series

    @property
    def block_usage(self) -> dict[int, float]:
        """Per step, the share of usable blocks (all but the null block) held at its end.

        Computed from the blocks themselves, so a log without scheduler steps (a manager
        driven directly) has it too; with a scheduler it equals ``series.kv_cache_usage``.
        """
        self._sync()
        usable = max(1, self._head.num_blocks - 1)
        return {s: n / usable for s, n in self._held.items()}

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (0 before the pool exists)."""
        self._sync()
        return self._head.num_blocks

    def step_record(self, step: int) -> StepFinished | None:
        """The ``StepFinished`` record of ``step`` (None for a step that did not finish)."""
        self._sync()
        return self._records.get(step)

    def attention_batch(self, step: int) -> AttentionBatch | None:
        """What the attention kernel was given in ``step`` (None: no runner event that step)."""
        self._sync()
        return self._batches.get(step)

    def events_of(self, step: int) -> list[Event]:
        """The events of ``step``, in order."""
        self._sync()
        k = bisect_right(self._steps, step)
        if not k or self._steps[k - 1] != step:
            return []
        return self.events[self._ends[k - 2] if k > 1 else 0 : self._ends[k - 1]]

    @property
    def first_busy_step(self) -> int:
        """The first step that puts a block in use or in the cache (``first_step`` if none does).

        Why: a replay that opens where nothing has happened yet shows empty pictures -- a
        pool of free blocks, no tables, no chains -- and a learner takes that for a broken
        view. A replay without a ``start`` opens here instead."""
        self._sync()
        for step in self._steps:
            if any(isinstance(e, _BUSY) for e in self.events_of(step)):
                return step
        return self.first_step

    @property
    def request_ids(self) -> list[str]:
        """Every request added to the run, in the order they arrived."""
        self._sync()
        return list(self._head.requests)

    @property
    def lifecycles(self) -> dict[str, list[tuple[int, str]]]:
        """Per request, its status changes as ``(step, status)``: waiting, loading (a
        connector's asynchronous load), running, preempted, finished (each at the step whose
        events made the change)."""
        self._sync()
        return {rid: list(changes) for rid, changes in (self._head.lifecycle or {}).items()}

    def request_status(self, steps: Sequence[int]) -> dict[str, list[str | None]]:
        """Each request's status at the end of each of ``steps`` (ascending): None before
        it arrived and after the step it finished in."""
        self._sync()
        out: dict[str, list[str | None]] = {}
        for rid, changes in (self._head.lifecycle or {}).items():
            row: list[str | None] = []
            k, status = 0, None
            for s in steps:
                while k < len(changes) and changes[k][0] <= s:
                    status, done_at = changes[k][1], changes[k][0]
                    k += 1
                row.append(None if status == "finished" and s > done_at else status)
            out[rid] = row
        return out

    def block_history(self, block_id: int) -> list[BlockRecord]:
        """Everything that happened to ``block_id``, in log order (indexed on first use)."""
        self._sync()
        if self._history is None:
            rec = _BlockRecorder()
            rec.max_blocks = self._max_blocks
            rec.apply_all(self.events, 0, self._n)
            self._history = rec
        if not isinstance(block_id, int) or not 0 <= block_id < max(self._history.num_blocks, 1):
            raise ValueError(f"block_id must be an int in 0..{self._history.num_blocks - 1}, got {block_id!r}")
        return list(self._history.history.get(block_id, []))


def replay(log: Iterable[Event], step: int | None = None, *, max_blocks: int = MAX_BLOCKS) -> Snapshot:
    """The snapshot after all events up to ``step`` (default: the end of the log).

    A log that could not have happened raises a ``ValueError`` naming the first bad event;
    a pool over ``max_blocks`` blocks is refused before anything is allocated."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be None or an int, got {type(step).__name__} {step!r}")
    if isinstance(log, (str, bytes)) or not isinstance(log, Iterable):
        raise TypeError(f"log must be an EventLog or a list of events, got {type(log).__name__} (EventLog.from_json reads saved text)")
    state = ReplayState(max_blocks=max_blocks)
    for i, e in enumerate(log):
        if not isinstance(e, Event):
            raise TypeError(f"log[{i}] must be an Event, got {type(e).__name__}")
        if step is not None and e.step > step:
            break
        state.apply(e)
    snap = state.snapshot()
    if step is not None:
        snap.step = step
    return snap
