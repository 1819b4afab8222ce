"""Snapshots: the whole KV-cache state at one step, rebuilt from the event log alone.

Views never read live engine objects. ``replay(log)`` walks the events and produces, for
any step, a pure-data ``Snapshot``: every block (state, ref count, hash, owners, position
in the free queue), every request's block table, the hash-chain forest, the queues, the
step's scheduling decisions and the metrics. Because it is rebuilt from events, the same
picture can be tested as data, stepped backwards, saved as JSON and reloaded.

Block states (the colours of lesson 02/04):

* ``null``   -- block 0, the placeholder;
* ``free``   -- on the free queue holding nothing reusable (never used, or a partial block);
* ``cached`` -- on the free queue but still carrying a hash: evictable, yet a prefix hit
  can bring it back;
* ``in_use`` -- held by one block table (ref 1);
* ``shared`` -- held by several tables (ref > 1).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvlab.timeline import events as ev

FREE, CACHED, IN_USE, SHARED, NULL = "free", "cached", "in_use", "shared", "null"
BLOCK_STATES = (FREE, CACHED, IN_USE, SHARED, NULL)


@dataclass(slots=True)
class BlockView:
    block_id: int
    state: str
    ref_cnt: int
    block_hash: str | None  # hex
    owners: list[str]
    free_position: int | None  # 0 = evicted next
    group: int | None  # the group whose table holds it / held it last
    token_ids: list[int] | None  # the tokens of a cached block
    ever_used: bool


@dataclass(slots=True)
class RequestView:
    request_id: str
    status: str  # waiting | running | preempted | finished
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_preemptions: int
    priority: int
    arrival_time: float
    block_table: list[list[int]]  # per group: logical block i -> physical id (0 = null)
    cache_salt: str | None = None
    lora_name: str | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class HashNode:
    block_hash: str  # hex
    parent_hash: str | None
    token_ids: list[int]
    extra_keys: Any
    block_ids: list[int]  # blocks carrying it now (more than one: duplicates)
    group: int


@dataclass(slots=True)
class LookupView:
    request_id: str
    num_tokens: int
    block_hashes: list[str]
    num_hit_blocks: int
    num_hit_tokens: int
    max_hit_tokens: int
    hit_block_ids: list[list[int]]


@dataclass(slots=True)
class Snapshot:
    step: int
    num_events: int
    num_blocks: int
    block_size: int
    groups: list[dict[str, Any]]
    policy: str
    blocks: list[BlockView]
    free_queue: list[int]
    requests: dict[str, RequestView]
    waiting: list[str]
    running: list[str]
    hash_nodes: dict[str, HashNode]
    last_lookup: LookupView | None
    scheduled: dict[str, int]
    scheduled_phase: dict[str, str]
    preempted: list[str]
    finished: list[str]
    metrics: dict[str, float]
    step_events: list[str] = field(default_factory=list)

    # -- convenience --------------------------------------------------------------------------
    def block(self, block_id: int) -> BlockView:
        return self.blocks[block_id]

    def states(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {s: [] for s in BLOCK_STATES}
        for b in self.blocks:
            out[b.state].append(b.block_id)
        return out

    def roots(self) -> list[HashNode]:
        """Chains whose parent is not (or no longer) cached: the forest's roots."""
        return [n for n in self.hash_nodes.values() if n.parent_hash is None or n.parent_hash not in self.hash_nodes]

    def children(self, block_hash: str) -> list[HashNode]:
        return [n for n in self.hash_nodes.values() if n.parent_hash == block_hash]

    def pretty_print(self, decode: Callable[[int], str] | None = None, max_blocks: int = 64) -> str:
        """A terminal picture of the snapshot (also what the tests compare)."""
        sym = {NULL: "∅", FREE: ".", CACHED: "c", IN_USE: "U", SHARED: "S"}
        lines = [f"step {self.step}  ({self.num_events} events)  policy={self.policy}  block_size={self.block_size}"]
        grid = "".join(sym[b.state] for b in self.blocks[:max_blocks])
        lines.append(f"pool  [{grid}{'…' if len(self.blocks) > max_blocks else ''}]   ∅ null . free c cached U in use S shared")
        lines.append(f"free queue (evict next → last): {self.free_queue[:24]}{' …' if len(self.free_queue) > 24 else ''}")
        for rid in self.running + self.waiting:
            r = self.requests[rid]
            tables = " | ".join(str(t) for t in r.block_table)
            lines.append(
                f"  {rid:>8} {r.status:<9} computed {r.num_computed_tokens:>4}/{r.num_tokens:<4} table {tables}"
            )
        if self.scheduled:
            lines.append("scheduled: " + ", ".join(f"{k}:{v} ({self.scheduled_phase[k]})" for k, v in self.scheduled.items()))
        if self.preempted:
            lines.append(f"preempted: {self.preempted}")
        if self.last_lookup is not None:
            lk = self.last_lookup
            lines.append(
                f"last lookup {lk.request_id}: {lk.num_hit_blocks}/{len(lk.block_hashes)} full blocks hit "
                f"= {lk.num_hit_tokens} tokens (cap {lk.max_hit_tokens})"
            )
        if self.metrics:
            m = self.metrics
            lines.append(
                f"usage {m.get('kv_cache_usage', 0.0):.1%}  preemptions {int(m.get('num_preemptions', 0))}  "
                f"prefix hits {int(m.get('prefix_cache_hits', 0))}/{int(m.get('prefix_cache_queries', 0))} tokens"
            )
        return "\n".join(lines)

    # -- JSON --------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Snapshot":
        d = json.loads(text)
        d["blocks"] = [BlockView(**b) for b in d["blocks"]]
        d["requests"] = {k: RequestView(**r) for k, r in d["requests"].items()}
        d["hash_nodes"] = {k: HashNode(**n) for k, n in d["hash_nodes"].items()}
        d["last_lookup"] = LookupView(**d["last_lookup"]) if d["last_lookup"] else None
        return cls(**d)


class _Req:
    __slots__ = ("v", "tokens")

    def __init__(self, v: RequestView, tokens: list[int]) -> None:
        self.v = v
        self.tokens = tokens


class Replayer:
    """Mutable state advanced one event at a time; ``snapshot()`` freezes it."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.block_size = 0
        self.groups: list[dict[str, Any]] = []
        self.policy = "fcfs"
        self.ref: list[int] = []
        self.hash: list[bytes | None] = []
        self.group_of: list[int | None] = []
        self.tokens_of: list[list[int] | None] = []
        self.owners: list[list[str]] = []
        self.ever_used: list[bool] = []
        self.queue: dict[int, None] = {}  # ordered set, head first
        self.nodes: dict[bytes, dict[str, Any]] = {}
        self.reqs: dict[str, _Req] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.last_lookup: LookupView | None = None
        self.scheduled: dict[str, int] = {}
        self.phase: dict[str, str] = {}
        self.preempted: list[str] = []
        self.finished: list[str] = []
        self.metrics: dict[str, float] = {}
        self.step = 0
        self.num_events = 0
        self.step_events: list[str] = []

    # -- helpers ------------------------------------------------------------------------------
    def _table(self, rid: str | None, group: int) -> list[int] | None:
        if rid is None or rid not in self.reqs:
            return None
        t = self.reqs[rid].v.block_table
        while len(t) <= group:
            t.append([])
        return t[group]

    def _uncache(self, bid: int) -> None:
        h = self.hash[bid]
        if h is None:
            return
        node = self.nodes.get(h)
        if node is not None:
            if bid in node["block_ids"]:
                node["block_ids"].remove(bid)
            if not node["block_ids"]:
                del self.nodes[h]
        self.hash[bid] = None
        self.tokens_of[bid] = None

    def _sort_waiting(self) -> None:
        if self.policy == "priority":
            self.waiting.sort(key=lambda r: (self.reqs[r].v.priority, self.reqs[r].v.arrival_time, r))

    # -- the event switch ---------------------------------------------------------------------
    def apply(self, e: ev.Event) -> None:
        self.num_events += 1
        if e.step != self.step:
            self.step = e.step
        k = e.kind
        if k == "pool_created":
            n = self.num_blocks = e.num_blocks
            self.block_size = e.block_size
            self.groups = e.groups
            self.ref = [0] * n
            self.hash = [None] * n
            self.group_of = [None] * n
            self.tokens_of = [None] * n
            self.owners = [[] for _ in range(n)]
            self.ever_used = [False] * n
            self.queue = dict.fromkeys(range(1, n))
        elif k == "scheduler_created":
            self.policy = e.policy
        elif k == "blocks_allocated":
            table = self._table(e.request_id, e.group)
            for bid in e.block_ids:
                assert next(iter(self.queue)) == bid, f"replay: allocated block {bid} is not at the free-queue head"
                del self.queue[bid]
                self.ref[bid] = 1
                self.ever_used[bid] = True
                self.group_of[bid] = e.group
                if e.request_id is not None:
                    self.owners[bid].append(e.request_id)
                if table is not None:
                    table.append(bid)
        elif k == "blocks_touched":
            table = self._table(e.request_id, e.group)
            for bid in e.block_ids:
                if table is not None:
                    table.append(bid)
                if bid == 0:
                    continue
                if self.ref[bid] == 0:
                    del self.queue[bid]
                self.ref[bid] += 1
                if e.request_id is not None:
                    self.owners[bid].append(e.request_id)
        elif k == "block_cached":
            bid = e.block_id
            self.hash[bid] = e.block_hash
            self.tokens_of[bid] = list(e.token_ids)
            self.group_of[bid] = e.group
            node = self.nodes.setdefault(
                e.block_hash,
                {"parent": e.parent_hash, "tokens": list(e.token_ids), "extra": e.extra_keys, "block_ids": [], "group": e.group},
            )
            node["block_ids"].append(bid)
        elif k == "blocks_freed":
            for bid in e.block_ids:
                if bid == 0:
                    continue
                self.ref[bid] -= 1
                if e.request_id is not None and e.request_id in self.owners[bid]:
                    self.owners[bid].remove(e.request_id)
            if e.to_head:
                rest = list(self.queue)
                self.queue = dict.fromkeys(list(e.to_head) + rest)
            for bid in e.to_tail:
                self.queue[bid] = None
            if e.reason == "request":
                table = self._table(e.request_id, e.group)
                if table is not None:
                    table.clear()
        elif k == "blocks_skipped":
            table = self._table(e.request_id, e.group)
            if table is not None:
                for pos in e.positions:
                    table[pos] = 0
        elif k == "block_evicted":
            self._uncache(e.block_id)
        elif k == "cache_reset":
            if e.success:
                for bid in range(self.num_blocks):
                    self.hash[bid] = None
                    self.tokens_of[bid] = None
                self.nodes.clear()
        elif k == "prefix_lookup":
            self.last_lookup = LookupView(
                request_id=e.request_id,
                num_tokens=e.num_tokens,
                block_hashes=[h.hex() for h in e.block_hashes],
                num_hit_blocks=len(e.hit_block_ids[0]) if e.hit_block_ids else 0,
                num_hit_tokens=e.num_hit_tokens,
                max_hit_tokens=e.max_hit_tokens,
                hit_block_ids=[list(g) for g in e.hit_block_ids],
            )
        elif k == "request_added":
            v = RequestView(
                request_id=e.request_id,
                status="waiting",
                num_prompt_tokens=len(e.prompt_token_ids),
                num_tokens=len(e.prompt_token_ids),
                num_computed_tokens=0,
                num_output_tokens=0,
                num_preemptions=0,
                priority=e.priority,
                arrival_time=e.arrival_time,
                block_table=[[] for _ in self.groups],
                cache_salt=e.cache_salt,
                lora_name=e.lora_name,
            )
            self.reqs[e.request_id] = _Req(v, list(e.prompt_token_ids))
            self.waiting.append(e.request_id)
            self._sort_waiting()
        elif k == "step_started":
            self.scheduled, self.phase, self.preempted, self.finished = {}, {}, [], []
            self.step_events = []
        elif k == "request_scheduled":
            r = self.reqs[e.request_id].v
            if e.phase != "running":
                self.waiting.remove(e.request_id)
                self.running.append(e.request_id)
                r.status = "running"
                r.num_computed_tokens = e.num_computed_tokens
            self.scheduled[e.request_id] = e.num_tokens
            self.phase[e.request_id] = e.phase
        elif k == "request_preempted":
            r = self.reqs[e.request_id].v
            self.running.remove(e.request_id)
            self.waiting.insert(0, e.request_id)
            self._sort_waiting()
            r.status = "preempted"
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            self.preempted.append(e.request_id)
        elif k == "tokens_appended":
            q = self.reqs[e.request_id]
            q.tokens.extend(e.token_ids)
            q.v.num_tokens += len(e.token_ids)
            q.v.num_output_tokens += len(e.token_ids)
        elif k == "request_finished":
            r = self.reqs[e.request_id].v
            if e.request_id in self.running:
                self.running.remove(e.request_id)
            if e.request_id in self.waiting:
                self.waiting.remove(e.request_id)
            r.status = "finished"
            r.finish_reason = e.reason
            self.finished.append(e.request_id)
        elif k == "step_finished":
            for rid, n in self.scheduled.items():
                r = self.reqs[rid].v
                if r.status == "running" or (r.status == "finished" and rid in self.finished):
                    r.num_computed_tokens = min(r.num_computed_tokens + n, r.num_tokens)
            self.metrics = {
                "num_running": e.num_running,
                "num_waiting": e.num_waiting,
                "kv_cache_usage": e.kv_cache_usage,
                "num_preemptions": e.num_preemptions,
                "prefix_cache_queries": e.prefix_cache_queries,
                "prefix_cache_hits": e.prefix_cache_hits,
            }
        self.step_events.append(_describe(e))

    def snapshot(self) -> Snapshot:
        pos = {bid: i for i, bid in enumerate(self.queue)}
        blocks = []
        for bid in range(self.num_blocks):
            if bid == 0:
                state = NULL
            elif self.ref[bid] == 0:
                state = CACHED if self.hash[bid] is not None else FREE
            else:
                state = SHARED if self.ref[bid] > 1 else IN_USE
            h = self.hash[bid]
            blocks.append(
                BlockView(
                    block_id=bid,
                    state=state,
                    ref_cnt=self.ref[bid],
                    block_hash=h.hex() if h is not None else None,
                    owners=list(self.owners[bid]),
                    free_position=pos.get(bid),
                    group=self.group_of[bid],
                    token_ids=list(self.tokens_of[bid]) if self.tokens_of[bid] is not None else None,
                    ever_used=self.ever_used[bid],
                )
            )
        nodes = {
            h.hex(): HashNode(
                block_hash=h.hex(),
                parent_hash=n["parent"].hex() if n["parent"] else None,
                token_ids=list(n["tokens"]),
                extra_keys=n["extra"],
                block_ids=list(n["block_ids"]),
                group=n["group"],
            )
            for h, n in self.nodes.items()
        }
        reqs = {}
        for rid, q in self.reqs.items():
            v = q.v
            reqs[rid] = RequestView(**{**asdict(v), "block_table": [list(t) for t in v.block_table]})
        return Snapshot(
            step=self.step,
            num_events=self.num_events,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            groups=list(self.groups),
            policy=self.policy,
            blocks=blocks,
            free_queue=list(self.queue),
            requests=reqs,
            waiting=list(self.waiting),
            running=list(self.running),
            hash_nodes=nodes,
            last_lookup=self.last_lookup,
            scheduled=dict(self.scheduled),
            scheduled_phase=dict(self.phase),
            preempted=list(self.preempted),
            finished=list(self.finished),
            metrics=dict(self.metrics),
            step_events=list(self.step_events),
        )

    def request_tokens(self, rid: str) -> list[int]:
        return list(self.reqs[rid].tokens)


def _describe(e: ev.Event) -> str:
    k = e.kind
    if k == "blocks_allocated":
        return f"allocate {e.block_ids} → {e.request_id} (group {e.group})"
    if k == "blocks_touched":
        return f"hit/touch {e.block_ids} → {e.request_id} (group {e.group})"
    if k == "block_cached":
        return f"cache block {e.block_id} as {e.block_hash.hex()[:8]}"
    if k == "blocks_freed":
        return f"free {e.block_ids} from {e.request_id} (head ← {e.to_head}, tail ← {e.to_tail})"
    if k == "block_evicted":
        return f"evict block {e.block_id} (hash {e.block_hash.hex()[:8]} dropped)"
    if k == "blocks_skipped":
        return f"window: positions {e.positions} of {e.request_id} → null, blocks {e.block_ids}"
    if k == "prefix_lookup":
        return f"lookup {e.request_id}: {e.num_hit_tokens} of {e.num_tokens} tokens cached"
    if k == "request_added":
        return f"add {e.request_id} ({len(e.prompt_token_ids)} prompt tokens)"
    if k == "request_scheduled":
        return f"schedule {e.request_id}: {e.num_tokens} tokens ({e.phase})"
    if k == "request_preempted":
        return f"PREEMPT {e.request_id} ({e.reason}; for {e.for_request_id})"
    if k == "tokens_appended":
        return f"{e.request_id} += {e.token_ids}"
    if k == "request_finished":
        return f"finish {e.request_id} ({e.reason})"
    if k == "step_started":
        return f"— step {e.step} —"
    if k == "step_finished":
        return f"end of step: usage {e.kv_cache_usage:.0%}, running {e.num_running}, waiting {e.num_waiting}"
    return k


class Timeline:
    """Snapshots of a log at every step, built in one replay and cached."""

    def __init__(self, log: ev.EventLog | Iterable[ev.Event]) -> None:
        self.log = log
        self.events = list(log)
        self._snaps: dict[int, Snapshot] = {}
        self._built_upto = -1
        self._replayer = Replayer()
        self._idx = 0
        self.steps = sorted({e.step for e in self.events}) or [0]

    def refresh(self) -> None:
        """Pick up events appended to a live log.

        Cached snapshots from the step of the first new event on are dropped: a new event
        can belong to a step already seen (a request added after step 3 is an event of
        step 3), so those snapshots would be stale.
        """
        if isinstance(self.log, ev.EventLog) and len(self.log) > len(self.events):
            first_new = self.log[len(self.events)].step
            self.events = list(self.log)
            self.steps = sorted({e.step for e in self.events})
            for s in [s for s in self._snaps if s >= first_new]:
                del self._snaps[s]
            self._built_upto = min(self._built_upto, first_new - 1)

    def at(self, step: int) -> Snapshot:
        """The state after every event of ``step`` (step 0: before the first schedule)."""
        if step in self._snaps:
            return self._snaps[step]
        if step <= self._built_upto:
            return self._rebuild(step)
        r = self._replayer
        evs = self.events
        while self._idx < len(evs) and evs[self._idx].step <= step:
            cur = evs[self._idx].step
            r.apply(evs[self._idx])
            self._idx += 1
            if self._idx == len(evs) or evs[self._idx].step != cur:
                self._snaps[cur] = r.snapshot()
                self._built_upto = cur
        if step not in self._snaps:
            snap = r.snapshot()
            snap.step = step
            self._snaps[step] = snap
            self._built_upto = max(self._built_upto, step)
        return self._snaps[step]

    def _rebuild(self, step: int) -> Snapshot:
        prev = [s for s in self._snaps if s <= step]
        return self._snaps[max(prev)] if prev else replay(self.events, step)

    @property
    def last_step(self) -> int:
        return self.steps[-1]

    def __len__(self) -> int:
        return len(self.steps)


def replay(log: Iterable[ev.Event], step: int | None = None) -> Snapshot:
    """The snapshot after all events up to ``step`` (default: the end of the log)."""
    r = Replayer()
    for e in log:
        if step is not None and e.step > step:
            break
        r.apply(e)
    snap = r.snapshot()
    if step is not None:
        snap.step = step
    return snap


def live_snapshot(kv_cache_manager: Any, scheduler: Any = None) -> dict[str, Any]:
    """The same key facts read from live objects (tests check replay against this)."""
    pool = kv_cache_manager.block_pool
    out = {
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref_cnt": [b.ref_cnt if not b.is_null else 0 for b in pool.blocks],
        "hashes": [b.block_hash.hex() if b.block_hash else None for b in pool.blocks],
    }
    if scheduler is not None:
        out["running"] = [r.request_id for r in scheduler.running]
        out["waiting"] = [r.request_id for r in scheduler.waiting]
        out["tables"] = {r.request_id: [list(g) for g in kv_cache_manager.get_block_ids(r.request_id)] for r in scheduler.running}
        out["computed"] = {r.request_id: r.num_computed_tokens for r in scheduler.running}
    return out
