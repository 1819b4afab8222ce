"""The replay state: what the events act on, and what a :class:`Snapshot` is frozen from.

Every event's ``apply(state)`` (in :mod:`kvlab.eventlog.events`) is written with the small
vocabulary below -- take a block off the free queue, hold it for a request, release it,
cache or uncache a hash, admit, preempt, finish -- so this class holds *data structures*
and the events hold the *story*.

Two requirements shape it:

* **replay == live.** The free queue is a doubly linked list over block ids, like vLLM's
  ``FreeKVCacheBlockQueue`` (O(1) pops from the head, removals from the middle, appends to
  either end); a freed request's tail goes to the head in the order the pool put it there.
* **jumping to any step is cheap.** A :class:`~kvlab.timeline.timeline.Timeline` keeps
  copies (:meth:`clone`) of the state every few hundred events and replays forward from
  the nearest one. Copies share the per-request and per-hash records with the original
  (copy-on-write: a record is copied the first time either side changes it after the
  split), and everything per block lives in flat lists of immutable values, so a copy costs
  a handful of list copies, not a walk over every request. :meth:`snapshot` shares records
  the same way, so freezing a snapshot costs little even with a thousand requests.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlab.eventlog.schema import MAX_BLOCKS, check_num_blocks
from kvlab.timeline.snapshot import (
    CACHED,
    FREE,
    IN_USE,
    NULL,
    SHARED,
    BlockView,
    EncoderCacheView,
    EncoderEntryView,
    HashNode,
    Holding,
    LookupView,
    RequestView,
    Snapshot,
    TierView,
    TransferView,
)

if TYPE_CHECKING:
    from kvlab.eventlog.events import AttentionBatch, Event, KVTransfer, PrefixLookup, StepFinished

_NONE: tuple[Holding, ...] = ()


def _says(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return f"unknown {e.args[0]!r}" if e.args else "unknown key"
    return str(e) or type(e).__name__


class ReplayState:
    """The mutable state of a replay; ``apply(event)`` advances it, ``snapshot()`` freezes it.

    ``record=True`` (the Timeline's own pass) also keeps each request's status changes as
    ``lifecycle[request_id] = [(step, status), ...]`` -- the Gantt chart's data.
    """

    def __init__(self, record: bool = False, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks  # a PoolCreated over this many blocks is refused
        self.num_blocks = 0
        self.block_size = 0
        self.groups: list[dict[str, Any]] = []
        self.policy = "fcfs"
        # Per block: flat lists of immutable values (a clone copies the lists, not the values).
        self.ref: list[int] = []
        self.num_held = 0  # blocks with ref > 0 (what KV-cache usage counts)
        self.hash: list[str | None] = []  # hex
        self.group_of: list[int | None] = []
        self.tokens_of: list[list[int] | None] = []  # never mutated in place
        self.holds: list[tuple[Holding, ...]] = []  # the tables holding the block, in the order they took it
        self.released_by: list[Holding | None] = []  # whose release last put it on the free queue
        self.ever_used: list[bool] = []
        # The free queue: a doubly linked list; HEAD and TAIL are sentinels at n and n + 1.
        self._next: list[int] = []
        self._prev: list[int] = []
        self.num_free = 0
        # Copy-on-write records: ``_own_*`` names those this state may change in place.
        self.nodes: dict[str, HashNode] = {}  # cached hash (hex) -> node
        self.requests: dict[str, RequestView] = {}
        self.implicit: frozenset[str] = frozenset()  # requests known only from their blocks
        self._own_nodes: set[str] = set()
        self._own_reqs: set[str] = set()
        self._table_len: dict[tuple[str, int], int] = {}  # (request, group) -> logical blocks taken
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.last_lookup: LookupView | None = None
        # This step.
        self.scheduled: dict[str, int] = {}
        self.phase: dict[str, str] = {}
        self.preempted: list[str] = []
        self.finished: list[str] = []
        self.metrics: dict[str, Any] = {}
        self.step_events: list[Event] = []
        self.attention_batch: AttentionBatch | None = None
        self.step_finished: StepFinished | None = None
        self.in_step = False
        self.step = 0
        self.num_events = 0
        self.lifecycle: dict[str, list[tuple[int, str]]] | None = {} if record else None
        # Offload tiers (lesson 12): medium -> {hash hex: slot}, in LRU order (head first).
        self.tier_capacity: dict[str, int] = {}
        self.tiers: dict[str, dict[str, int]] = {}
        self.transfers: list[TransferView] = []  # this step's
        # The encoder cache (lesson 14): item hash -> (embeddings, referencing requests).
        self.encoder_cache_size: int | None = None
        self.encoder_entries: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.encoder_freeable: list[str] = []
        self.encoder_step: list[tuple[str, str, bool]] = []

    # -- driving -------------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        """Apply one event. A log that cannot have happened (a block freed that nobody
        holds, a request that was never added, an id outside the pool) raises a
        ``ValueError`` that names the event -- it is never drawn as if it made sense."""
        self.num_events += 1
        self.step = event.step
        try:
            event.apply(self)
        except (AssertionError, KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"event {event.seq} ({type(event).__name__}, step {event.step}) cannot be replayed: {_says(e)}") from None
        self.step_events.append(event)

    def apply_all(self, events: Sequence[Event], start: int, stop: int) -> None:
        for i in range(start, stop):
            self.apply(events[i])

    # -- the pool ------------------------------------------------------------------------------
    def init_pool(self, num_blocks: int, block_size: int, groups: list[dict[str, Any]]) -> None:
        check_num_blocks(num_blocks, "num_blocks", self.max_blocks)  # before anything is sized by it
        if type(num_blocks) is not int or num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks!r}: a pool has at least 2 blocks (block 0 is the null block)")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size = {block_size!r}: it must be an int >= 1")
        for i, g in enumerate(groups):
            if not isinstance(g, dict) or not isinstance(g.get("type"), str):
                raise ValueError(f"groups[{i}] must be a group spec (an object with a 'type'), got {g!r:.80}")
        n = self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = groups
        self.ref = [0] * n
        self.num_held = 0
        self.hash = [None] * n
        self.group_of = [None] * n
        self.tokens_of = [None] * n
        self.holds = [_NONE] * n
        self.released_by = [None] * n
        self.ever_used = [False] * n
        head, tail = n, n + 1
        self._next = nxt = [-1] * (n + 2)
        self._prev = prv = [-1] * (n + 2)
        last = head
        for b in range(1, n):  # blocks 1 .. n-1 in id order; block 0 (the null block) is never free
            nxt[last], prv[b] = b, last
            last = b
        nxt[last], prv[tail] = tail, last
        self.num_free = max(0, n - 1)

    def _block(self, bid: int) -> int:
        """``bid`` if it names a block of the pool (a negative id would silently index from
        the end of every per-block list)."""
        if type(bid) is not int or not 0 <= bid < self.num_blocks:
            raise ValueError(f"block id {bid!r} is not a block of the pool (0..{self.num_blocks - 1})")
        return bid

    def _unlink(self, bid: int) -> None:
        nxt, prv = self._next, self._prev
        p, q = prv[self._block(bid)], nxt[bid]
        if p < 0:
            raise ValueError(f"block {bid} is not on the free queue")
        nxt[p], prv[q] = q, p
        nxt[bid] = prv[bid] = -1
        self.num_free -= 1

    def pop_free_head(self, bid: int) -> None:
        """The pool hands out the free-queue head; the log must agree on which block that is."""
        if self._next[self.num_blocks] != self._block(bid):
            raise ValueError(f"allocated block {bid!r} is not at the free-queue head")
        self._unlink(bid)

    def remove_free(self, bid: int) -> None:
        self._unlink(bid)

    def _check_freeable(self, bid: int) -> None:
        if self._block(bid) == 0:
            raise ValueError("the null block (0) never goes on the free queue")
        if self._prev[bid] >= 0:
            raise ValueError(f"block {bid} is put on the free queue twice")
        if self.ref[bid]:
            raise ValueError(f"block {bid} goes on the free queue while {self.ref[bid]} table(s) hold it")

    def push_free_head(self, bid: int) -> None:
        self._check_freeable(bid)
        head = self.num_blocks
        first = self._next[head]
        self._next[bid], self._prev[bid] = first, head
        self._next[head] = self._prev[first] = bid
        self.num_free += 1

    def push_free_tail(self, bid: int) -> None:
        self._check_freeable(bid)
        tail = self.num_blocks + 1
        last = self._prev[tail]
        self._next[bid], self._prev[bid] = tail, last
        self._next[last] = self._prev[tail] = bid
        self.num_free += 1

    def free_queue(self) -> list[int]:
        """Block ids from the head (evicted next) to the tail."""
        out: list[int] = []
        nxt, tail = self._next, self.num_blocks + 1
        b = nxt[self.num_blocks] if self.num_blocks else tail
        while b != tail:
            out.append(b)
            b = nxt[b]
        return out

    def mark_allocated(self, bid: int, group: int) -> None:
        self.ever_used[self._block(bid)] = True
        self.group_of[bid] = group

    # -- block tables --------------------------------------------------------------------------
    def _table(self, rid: str | None, group: int) -> list[int] | None:
        if rid is None or rid not in self.requests:
            return None
        t = self.request(rid).block_table
        while len(t) <= group:
            t.append([])
        return t[group]

    def _append(self, rid: str | None, group: int, bid: int) -> int:
        """Append ``bid`` to the request's table; its logical index there (-1: no request)."""
        if rid is None:
            return -1
        if rid not in self.requests:
            self._implicit_request(rid)
        key = (rid, group)
        i = self._table_len.get(key, 0)
        self._table_len[key] = i + 1
        table = self._table(rid, group)
        if table is not None:
            table.append(bid)
        return i

    def take(self, bid: int, rid: str | None, group: int) -> None:
        """A table takes the block (ref + 1): a fresh allocation or a prefix hit."""
        if self.ref[self._block(bid)] == 0:
            self.num_held += 1
        self.ref[bid] += 1
        i = self._append(rid, group, bid)
        if rid is not None:
            self.holds[bid] = self.holds[bid] + (Holding(rid, group, i),)

    def append_null(self, rid: str | None, group: int) -> None:
        """Sliding window: a hit pads the blocks it does not need with the null block."""
        self._append(rid, group, 0)

    def release(self, bid: int, rid: str | None, group: int) -> None:
        """The table of ``rid`` lets go of the block (ref - 1)."""
        if self.ref[self._block(bid)] <= 0:
            raise ValueError(f"block {bid} is freed but no table holds it (ref_cnt 0)")
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            self.num_held -= 1
        mine = self._drop_hold(bid, rid, group)
        if self.ref[bid] == 0:
            self.released_by[bid] = mine

    def _drop_hold(self, bid: int, rid: str | None, group: int) -> Holding | None:
        """Remove (and return) the hold of ``rid``'s table in ``group`` on the block."""
        holds = self.holds[bid]
        for k, h in enumerate(holds):
            if h.request_id == rid and h.group == group:
                self.holds[bid] = holds[:k] + holds[k + 1 :]
                return h
        return None

    def clear_table(self, rid: str | None, group: int) -> None:
        if rid is None:
            return
        self._table_len.pop((rid, group), None)
        table = self._table(rid, group)
        if table is not None:
            table.clear()
        if rid in self.implicit and rid in self.running and not any(self.requests[rid].block_table):
            self.finish(rid, "freed")

    def _implicit_request(self, rid: str) -> None:
        """A request the log never added: a KV-cache manager driven without a scheduler (the
        exercise checkers, vLLM's manager tests). It is known from its blocks: it runs from
        its first block and finishes when its table is freed, so its replay still has block
        tables and a Gantt row."""
        v = RequestView(rid, "running", 0, 0, 0, 0, 0, 0, 0.0, [[] for _ in self.groups])
        self.requests[rid] = v
        self._own_reqs.add(rid)
        self.implicit = self.implicit | {rid}
        self.running.append(rid)
        self._status(v, "running")

    def null_out(self, rid: str | None, group: int, positions: Sequence[int]) -> None:
        table = self._table(rid, group)
        if table is not None:
            for pos in positions:
                if type(pos) is not int or not 0 <= pos < len(table):
                    raise ValueError(f"position {pos!r} is outside {rid!r}'s table of {len(table)} blocks")
                table[pos] = 0

    def relocate(self, rid: str | None, group: int, pos: int, bid: int) -> None:
        """Block ``bid`` moves from ``pos`` of the request's table to its end; ``pos`` turns
        null. Its reference (and who holds it) stays; only the position changes."""
        table = self._table(rid, group)
        if table is None or type(pos) is not int or not 0 <= pos < len(table) or table[pos] != bid:
            raise ValueError(f"block {bid} is not at position {pos!r} of {rid!r}'s table (group {group})")
        table[pos] = 0
        i = self._append(rid, group, bid)
        self.holds[bid] = tuple(
            Holding(h.request_id, h.group, i) if (h.request_id, h.group, h.logical_index) == (rid, group, pos) else h
            for h in self.holds[bid]
        )

    def copy_on_write(self, rid: str | None, group: int, pos: int, src: int, dst: int) -> None:
        """The request's table takes ``dst`` (allocated just before, to no table) at ``pos``
        instead of ``src``; ``src`` keeps its reference and ``dst`` gets one more, both
        until the copy has run."""
        table = self._table(rid, group)
        if table is None or type(pos) is not int or not 0 <= pos < len(table) or table[pos] != src:
            raise ValueError(f"block {src} is not at position {pos!r} of {rid!r}'s table (group {group})")
        table[pos] = dst
        self._drop_hold(self._block(src), rid, group)
        if self.ref[self._block(dst)] == 0:
            self.num_held += 1
        self.ref[dst] += 1
        self.holds[dst] = self.holds[dst] + (Holding(rid, group, pos),)  # type: ignore[arg-type]  # a table exists, so rid is a request id

    def move_hashes(self, src: int, dst: int) -> None:
        """Every cache key of ``src`` now names ``dst``; ``src`` is held once more until the
        copy has run."""
        self.ref[self._block(src)] += 1
        self._block(dst)
        for h, node in list(self.nodes.items()):
            if src in node.block_ids:
                node = self._node(h)
                node.block_ids[node.block_ids.index(src)] = dst
        self.hash[dst], self.tokens_of[dst] = self.hash[src], self.tokens_of[src]
        self.group_of[dst] = self.group_of[src]
        self.hash[src] = self.tokens_of[src] = None

    # -- the prefix cache ----------------------------------------------------------------------
    def _node(self, h: str) -> HashNode:
        node = self.nodes[h]
        if h not in self._own_nodes:
            node = HashNode(node.block_hash, node.parent_hash, node.token_ids, node.extra_keys, list(node.block_ids), node.group)
            self.nodes[h] = node
            self._own_nodes.add(h)
        return node

    def cache(self, bid: int, h: str, parent: str | None, token_ids: list[int], extra_keys: Any, group: int) -> None:
        if self.hash[self._block(bid)] is None:
            self.hash[bid] = h
            self.tokens_of[bid] = list(token_ids)
            self.group_of[bid] = group
        # else: a partial entry (vLLM 0.33) of a block that has a key: the node lists the
        # block, which keeps its own key
        if h in self.nodes:
            self._node(h).block_ids.append(bid)  # a duplicate: one hash, several blocks
        else:
            self.nodes[h] = HashNode(h, parent, list(token_ids), extra_keys, [bid], group)
            self._own_nodes.add(h)

    def uncache(self, bid: int, h: str | None = None) -> None:
        """Drop the block's key ``h`` (default: its own key). A block with partial entries
        loses each in its own event; its own key goes first."""
        own = self.hash[self._block(bid)]
        h = own if h is None else h
        if h is None:
            return
        if h in self.nodes and bid in self.nodes[h].block_ids:
            node = self._node(h)
            node.block_ids.remove(bid)
            if not node.block_ids:
                del self.nodes[h]
        if h == own:
            self.hash[bid] = None
            self.tokens_of[bid] = None

    def clear_cache(self) -> None:
        self.hash = [None] * self.num_blocks
        self.tokens_of = [None] * self.num_blocks
        self.nodes = {}
        self._own_nodes = set()

    def record_lookup(self, e: PrefixLookup) -> None:
        self.last_lookup = LookupView(
            request_id=e.request_id,
            num_tokens=e.num_tokens,
            block_hashes=[h.hex() for h in e.block_hashes],
            num_hit_blocks=len(e.hit_block_ids[0]) if e.hit_block_ids else 0,
            num_hit_tokens=e.num_hit_tokens,
            max_hit_tokens=e.max_hit_tokens,
            hit_block_ids=[list(g) for g in e.hit_block_ids],
        )

    # -- requests ------------------------------------------------------------------------------
    def request(self, rid: str) -> RequestView:
        """The request's record, safe to change (copied first if a clone or snapshot shares it)."""
        v = self.requests[rid]
        if rid not in self._own_reqs:
            v = RequestView(
                v.request_id,
                v.status,
                v.num_prompt_tokens,
                v.num_tokens,
                v.num_computed_tokens,
                v.num_output_tokens,
                v.num_preemptions,
                v.priority,
                v.arrival_time,
                [list(t) for t in v.block_table],
                v.cache_salt,
                v.lora_name,
                v.finish_reason,
            )
            self.requests[rid] = v
            self._own_reqs.add(rid)
        return v

    def _status(self, v: RequestView, status: str) -> None:
        v.status = status
        if self.lifecycle is not None:
            self.lifecycle.setdefault(v.request_id, []).append((self.step, status))

    def _queue_waiting(self, rid: str, front: bool) -> None:
        if self.policy == "priority":
            reqs = self.requests
            insort(self.waiting, rid, key=lambda r: (reqs[r].priority, reqs[r].arrival_time, r))
        elif front:
            self.waiting.insert(0, rid)
        else:
            self.waiting.append(rid)

    def add_request(
        self, rid: str, num_prompt_tokens: int, priority: int, arrival_time: float, cache_salt: str | None, lora_name: str | None
    ) -> None:
        if rid in self.waiting or rid in self.running:
            raise ValueError(f"request {rid!r} is added twice while it is queued")
        v = RequestView(
            rid,
            "waiting",
            num_prompt_tokens,
            num_prompt_tokens,
            0,
            0,
            0,
            priority,
            arrival_time,
            [[] for _ in self.groups],
            cache_salt,
            lora_name,
        )
        self.requests[rid] = v
        self._own_reqs.add(rid)
        self._status(v, "waiting")
        self._queue_waiting(rid, front=False)

    def admit(self, rid: str, num_computed_tokens: int) -> None:
        """A waiting (or preempted) request starts running with its prefix hit computed."""
        if rid not in self.waiting:
            raise ValueError(f"request {rid!r} is admitted but it is not waiting")
        self.waiting.remove(rid)
        self.running.append(rid)
        v = self.request(rid)
        self._status(v, "running")
        v.num_computed_tokens = num_computed_tokens

    def start_loading(self, rid: str, num_computed_tokens: int) -> None:
        """A waiting request whose KV a connector loads asynchronously: it stays queued,
        holding its blocks, as "loading" until it is admitted."""
        if rid not in self.waiting:
            raise ValueError(f"request {rid!r} starts loading but it is not waiting")
        v = self.request(rid)
        self._status(v, "loading")
        v.num_computed_tokens = num_computed_tokens

    def schedule(self, rid: str, num_tokens: int, phase: str) -> None:
        if rid not in self.running:
            raise ValueError(f"request {rid!r} is scheduled but it is not running")
        self.scheduled[rid] = num_tokens
        self.phase[rid] = phase

    def preempt(self, rid: str) -> None:
        if rid not in self.running:
            raise ValueError(f"request {rid!r} is preempted but it is not running")
        self.running.remove(rid)
        v = self.request(rid)
        self._queue_waiting(rid, front=True)
        self._status(v, "preempted")
        v.num_computed_tokens = 0
        v.num_preemptions += 1
        self.preempted.append(rid)

    def append_tokens(self, rid: str, n: int) -> None:
        v = self.request(rid)
        v.num_tokens += n
        v.num_output_tokens += n

    def pause(self, rid: str) -> None:
        """A session's turn ended: out of the running list, holding its blocks, "paused"
        until its next chunk arrives."""
        if rid not in self.running:
            raise ValueError(f"request {rid!r} pauses but it is not running")
        self.running.remove(rid)
        self._status(self.request(rid), "paused")

    def resume(self, rid: str, num_prompt_tokens: int, num_computed_tokens: int) -> None:
        """A session's next chunk arrived: queued again (ahead of requests holding nothing,
        as the scheduler tries it first), its prompt grown, its output so far now prompt."""
        v = self.request(rid)
        if v.status not in ("paused", "running"):
            raise ValueError(f"request {rid!r} resumes but it is {v.status}")
        if rid in self.running:  # a chunk queued while it ran: it resumes as its turn ends
            self.running.remove(rid)
        v.num_prompt_tokens = v.num_tokens = num_prompt_tokens
        v.num_output_tokens = 0
        v.num_computed_tokens = num_computed_tokens
        self._status(v, "waiting")
        self._queue_waiting(rid, front=True)

    def finish(self, rid: str, reason: str) -> None:
        if rid not in self.requests:
            raise ValueError(f"request {rid!r} finishes but it was never added")
        if rid in self.running:
            self.running.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        v = self.request(rid)
        self._status(v, "finished")
        v.finish_reason = reason
        self.finished.append(rid)

    def cut_computed(self, rid: str, num_computed_tokens: int) -> None:
        """A running request whose external KV failed to load keeps running, its computed
        tokens cut back to its first failed block (it recomputes the rest in place)."""
        self.request(rid).num_computed_tokens = num_computed_tokens

    # -- offload tiers (lesson 12) -----------------------------------------------------------------
    def init_tiers(self, tiers: list[dict[str, Any]]) -> None:
        self.tier_capacity = {t["medium"]: int(t["num_blocks"]) for t in tiers}
        self.tiers = {t["medium"]: {} for t in tiers}

    def transfer(self, e: KVTransfer) -> None:
        """Apply a KV transfer to the tiers' contents: a store puts each hash at its tier's
        tail, a STORAGE block loaded is promoted into the CPU tier at the slot it was read
        into. Where each block stands in line is the policy's call: an ``OffloadTierOrder`` is
        recorded after every hook that changed it."""
        tiers = self.tiers
        hexes = [h.hex() for h in e.block_hashes]
        for i, (h, medium) in enumerate(zip(hexes, e.media)):
            slot = e.chunk_ids[i] if i < len(e.chunk_ids) else -1
            if e.direction == "store":
                tier = tiers.get(medium)
                if tier is not None:
                    tier.pop(h, None)
                    tier[h] = slot
            elif medium != "CPU" and "CPU" in tiers:  # a storage block is promoted through the CPU tier
                cpu = tiers["CPU"]
                cpu.pop(h, None)
                cpu[h] = slot
            # (a read moves nothing by itself: any change of order comes as OffloadTierOrder)
        self.transfers.append(
            TransferView(e.direction, e.request_id, list(e.media), list(e.block_ids), hexes, list(e.chunk_ids), list(e.paths), e.num_tokens)
        )

    def tier_order(self, medium: str, hexes: Sequence[str], slots: Sequence[int]) -> None:
        """The tier's whole contents, in eviction order (the policy's word, not a guess)."""
        if medium in self.tiers:
            self.tiers[medium] = dict(zip(hexes, slots))

    def tier_remove(self, medium: str, hexes: Sequence[str]) -> None:
        tier = self.tiers.get(medium)
        if tier is not None:
            for h in hexes:
                tier.pop(h, None)

    # -- the encoder cache (lesson 14) -------------------------------------------------------------
    def init_encoder_cache(self, cache_size: int) -> None:
        self.encoder_cache_size = cache_size
        self.encoder_entries, self.encoder_freeable = {}, []

    def encoder_reference(self, rid: str, mm_hash: str, num_embeds: int, computed: bool) -> None:
        n, refs = self.encoder_entries.get(mm_hash, (num_embeds, ()))
        if mm_hash in self.encoder_freeable:
            self.encoder_freeable.remove(mm_hash)
        if rid not in refs:
            refs = (*refs, rid)
        self.encoder_entries[mm_hash] = (n, refs)
        self.encoder_step.append((rid, mm_hash, computed))

    def encoder_release(self, rid: str, mm_hash: str) -> None:
        entry = self.encoder_entries.get(mm_hash)
        if entry is None:
            return
        n, refs = entry
        refs = tuple(r for r in refs if r != rid)
        self.encoder_entries[mm_hash] = (n, refs)
        if not refs and mm_hash not in self.encoder_freeable:
            self.encoder_freeable.append(mm_hash)

    def encoder_evict(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            self.encoder_entries.pop(h, None)
            if h in self.encoder_freeable:
                self.encoder_freeable.remove(h)

    # -- steps ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.scheduled, self.phase, self.preempted, self.finished = {}, {}, [], []
        self.transfers, self.encoder_step = [], []
        self.step_events = []
        self.attention_batch = None
        self.step_finished = None
        self.in_step = True

    def end_step(self, e: StepFinished) -> None:
        """The scheduled tokens are computed now; the step's metrics are the event's."""
        for rid, n in self.scheduled.items():
            v = self.requests[rid]
            if v.status == "running" or (v.status == "finished" and rid in self.finished):
                v = self.request(rid)
                v.num_computed_tokens = min(v.num_computed_tokens + n, v.num_tokens)
        self.metrics = {k: getattr(e, k) for k in e.METRICS}
        self.step_finished = e
        self.in_step = False

    # -- freezing ------------------------------------------------------------------------------
    def _share(self) -> None:
        """From now on every record is shared: change nothing in place."""
        self._own_nodes = set()
        self._own_reqs = set()

    def clone(self) -> ReplayState:
        """An independent copy (records shared copy-on-write); it records no lifecycle."""
        self._share()
        c = ReplayState.__new__(ReplayState)
        for k, v in self.__dict__.items():
            setattr(c, k, v)
        for k in (
            "ref",
            "hash",
            "group_of",
            "tokens_of",
            "holds",
            "released_by",
            "ever_used",
            "_next",
            "_prev",
            "waiting",
            "running",
            "preempted",
            "finished",
            "step_events",
            "transfers",
            "encoder_freeable",
            "encoder_step",
        ):
            setattr(c, k, list(getattr(self, k)))
        for k in ("nodes", "requests", "_table_len", "scheduled", "phase", "metrics", "tier_capacity", "encoder_entries"):
            setattr(c, k, dict(getattr(self, k)))
        c.tiers = {m: dict(t) for m, t in self.tiers.items()}
        c._own_nodes, c._own_reqs = set(), set()
        c.lifecycle = None
        return c

    def snapshot(self) -> Snapshot:
        self._share()
        queue = self.free_queue()
        pos = {bid: i for i, bid in enumerate(queue)}
        blocks = []
        ref, hashes, tokens, holds = self.ref, self.hash, self.tokens_of, self.holds
        for bid in range(self.num_blocks):
            r, h, held = ref[bid], hashes[bid], holds[bid]
            if bid == 0:
                state = NULL
            elif r == 0:
                state = CACHED if h is not None else FREE
            else:
                state = SHARED if r > 1 else IN_USE
            t = tokens[bid]
            blocks.append(
                BlockView(
                    bid,
                    state,
                    r,
                    h,
                    [x.request_id for x in held],
                    pos.get(bid),
                    self.group_of[bid],
                    list(t) if t is not None else None,
                    self.ever_used[bid],
                    held[-1] if held else self.released_by[bid],
                )
            )
        return Snapshot(
            step=self.step,
            num_events=self.num_events,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            groups=list(self.groups),
            policy=self.policy,
            blocks=blocks,
            free_queue=queue,
            requests=dict(self.requests),
            waiting=list(self.waiting),
            running=list(self.running),
            hash_nodes=dict(self.nodes),
            last_lookup=self.last_lookup,
            scheduled=dict(self.scheduled),
            scheduled_phase=dict(self.phase),
            preempted=list(self.preempted),
            finished=list(self.finished),
            metrics=dict(self.metrics),
            step_events=[e.describe() for e in self.step_events],
            tiers={m: TierView(m, self.tier_capacity[m], list(t.items())) for m, t in self.tiers.items()},
            transfers=list(self.transfers),
            encoder_cache=None
            if self.encoder_cache_size is None
            else EncoderCacheView(
                self.encoder_cache_size,
                [EncoderEntryView(h, n, list(refs)) for h, (n, refs) in self.encoder_entries.items()],
                list(self.encoder_freeable),
                list(self.encoder_step),
            ),
        )
