"""Snapshots: the whole KV-cache state at one step, as plain frozen data.

Views never read live engine objects. ``replay(log)`` and ``Timeline(log).at(step)``
(:mod:`kvlab.timeline.timeline`) rebuild, for any step, a pure-data ``Snapshot``: every
block (state, ref count, hash, holders, position in the free queue, who held it last),
every request's block table, the hash-chain forest, the queues, the step's scheduling
decisions and metrics. Because it is rebuilt from events, the same picture can be tested
as data, stepped backwards, saved as JSON and reloaded.

Snapshots of one timeline share the records that did not change between them (a finished
request's ``RequestView``, an untouched ``HashNode``): treat every snapshot as read-only.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, cast

from kvlab.eventlog.schema import HashKeys, check_record, check_version, parse_json

SNAPSHOT_FORMAT_VERSION = 1
"""Version of ``Snapshot.to_json``'s format (written into every file)."""

FREE, CACHED, IN_USE, SHARED, NULL = "free", "cached", "in_use", "shared", "null"
BLOCK_STATES = (FREE, CACHED, IN_USE, SHARED, NULL)


class Holding(NamedTuple):
    """One block table's hold on a block: which request, which group, which logical block."""

    request_id: str
    group: int
    logical_index: int  # position in that request's block table


@dataclass(slots=True)
class BlockView:
    """One physical block at one step."""

    block_id: int
    state: str
    ref_cnt: int
    block_hash: str | None  # hex
    owners: list[str]  # requests whose tables hold it now, in the order they took it
    free_position: int | None  # 0 = evicted next
    group: int | None  # the group whose table holds it / held it last
    token_ids: list[int] | None  # the tokens of a cached block
    ever_used: bool
    # The last table to hold it: while held, the newest holder; once free, the one whose
    # release put it on the free queue (for a shared block: the request that let go last).
    last_holder: Holding | None = None


@dataclass(slots=True)
class RequestView:
    request_id: str
    status: str  # waiting | loading | running | paused | preempted | finished
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
    extra_keys: HashKeys | None  # tuples (JSON lists in a file)
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
class TierView:
    """One offload tier (lesson 12): its capacity in blocks and its entries in LRU order,
    head (evicted next) first, as (block hash hex, slot)."""

    medium: str
    capacity: int
    entries: list[tuple[str, int]]

    @property
    def hashes(self) -> list[str]:
        return [h for h, _ in self.entries]


@dataclass(slots=True)
class TransferView:
    """One KV transfer of the step (a ``KVTransfer`` event as plain data)."""

    direction: str  # "store" | "load"
    request_id: str | None
    media: list[str]  # per block
    block_ids: list[int]
    block_hashes: list[str]  # hex
    chunk_ids: list[int]
    paths: list[str]
    num_tokens: int


@dataclass(slots=True)
class EncoderEntryView:
    mm_hash: str
    num_embeds: int
    requests: list[str]  # requests referencing it now (empty: freeable)


@dataclass(slots=True)
class EncoderCacheView:
    """The encoder cache at one step (lesson 14): entries in insertion order, the
    unreferenced ones oldest first (evicted first), and this step's decisions as
    (request, item hash, computed?)."""

    cache_size: int
    entries: list[EncoderEntryView]
    freeable: list[str]
    scheduled: list[tuple[str, str, bool]]

    @property
    def num_used(self) -> int:
        return sum(e.num_embeds for e in self.entries)


@dataclass(slots=True)
class Snapshot:
    """Everything the pictures show at the end of one step, as plain data (lessons 02-05).

    ``blocks[i]`` is physical block ``i`` (block 0 is the null block); ``free_queue`` lists
    free block ids in eviction order, head (evicted next) first; ``requests`` holds every
    request seen so far (finished ones too) by id, ``running`` and ``waiting`` the queues in
    the scheduler's order; ``hash_nodes`` is the prefix cache as a forest of hash chains;
    ``scheduled`` / ``scheduled_phase`` / ``preempted`` / ``finished`` are this step's
    decisions; ``metrics`` the step's ``StepFinished`` numbers; ``step_events`` the step's
    events in words. Built by ``replay(log, step)`` or ``Timeline(log).at(step)`` -- never
    from live objects -- so it can be compared, saved (``to_json``) and reloaded.
    """

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
    metrics: dict[str, float | None]
    step_events: list[str] = field(default_factory=list)
    # Beyond the pool (lessons 12-14): offload tiers, the step's KV transfers, the encoder cache.
    tiers: dict[str, TierView] = field(default_factory=dict)
    transfers: list[TransferView] = field(default_factory=list)
    encoder_cache: EncoderCacheView | None = None

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
            lines.append(f"  {rid:>8} {r.status:<9} computed {r.num_computed_tokens:>4}/{r.num_tokens:<4} table {tables}")
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
            # The counters are never None (only the per-request times of a step may be).
            preemptions, hits, queries = (
                int(cast(float, m.get(k, 0))) for k in ("num_preemptions", "prefix_cache_hits", "prefix_cache_queries")
            )
            lines.append(f"usage {m.get('kv_cache_usage', 0.0):.1%}  preemptions {preemptions}  prefix hits {hits}/{queries} tokens")
        return "\n".join(lines)

    # -- JSON --------------------------------------------------------------------------------
    def to_json(self, *, redact_salts: bool = False) -> str:
        """The snapshot as versioned JSON (``Snapshot.from_json`` reads it back).
        ``redact_salts``: replace every cache salt -- a tenant's secret (lesson 06) -- by a
        label (``"<salt 1>"``, ...), in the requests and in the hash nodes' extra keys."""
        if not isinstance(redact_salts, bool):
            raise TypeError(f"redact_salts must be True or False, got {redact_salts!r}")
        d = asdict(self)
        if redact_salts:
            labels: dict[str, str] = {}
            for r in d["requests"].values():
                if isinstance(r["cache_salt"], str):
                    r["cache_salt"] = labels.setdefault(r["cache_salt"], f"<salt {len(labels) + 1}>")

            def hide(v: Any) -> Any:  # a salt may sit inside a tagged key: ("cache_salt", salt)
                if isinstance(v, str):
                    return labels.get(v, v)
                return [hide(x) for x in v] if isinstance(v, (list, tuple)) else v

            for n in d["hash_nodes"].values():
                n["extra_keys"] = hide(n["extra_keys"])
        return json.dumps({"version": SNAPSHOT_FORMAT_VERSION, **d})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Snapshot":
        """Read :meth:`to_json`'s text, strictly: this version only, every field present,
        of its type and consistent (block ``i`` is block ``i``, queue and request ids name
        blocks and requests of the snapshot). A ``ValueError`` names the field."""
        data = parse_json(text, "the snapshot")
        check_version(data, SNAPSHOT_FORMAT_VERSION, "the snapshot")
        snap = cls(**check_record(cls, data, "the snapshot", skip=("version",)))
        n = snap.num_blocks
        if len(snap.blocks) != n:
            raise ValueError(f"blocks has {len(snap.blocks)} entries but num_blocks = {n}")
        for i, b in enumerate(snap.blocks):
            if b.block_id != i:
                raise ValueError(f"blocks[{i}].block_id = {b.block_id}: block i must have id i")
            if b.state not in BLOCK_STATES:
                raise ValueError(f"blocks[{i}].state = {b.state!r}; allowed: {list(BLOCK_STATES)}")
        if len(set(snap.free_queue)) != len(snap.free_queue) or any(not 0 < b < n for b in snap.free_queue):
            raise ValueError(f"free_queue must list distinct block ids in 1..{n - 1}, got {snap.free_queue!r:.120}")
        for rid, r in snap.requests.items():
            if r.request_id != rid:
                raise ValueError(f"requests[{rid!r}].request_id = {r.request_id!r}: it must be its key")
        for name in ("running", "waiting"):
            unknown = [rid for rid in getattr(snap, name) if rid not in snap.requests]
            if unknown:
                raise ValueError(f"{name} names unknown requests {unknown!r:.120}")
        return snap


def live_snapshot(kv_cache_manager: Any, scheduler: Any = None) -> dict[str, Any]:
    """The same key facts read from live objects (tests check replay against this)."""
    pool = kv_cache_manager.block_pool
    out: dict[str, Any] = {
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
