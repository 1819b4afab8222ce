"""Checker: block_manager -- the capstone: a whole block manager, plugged into the engine.

The learner writes one class with a small interface (ids and hashes in, ids out)::

    class BlockManager:
        def __init__(self, num_blocks)       # blocks 0 .. num_blocks - 1; block 0 is the null block
        num_free_blocks                      # attribute or property
        def allocate(self, n) -> list[int]   # n blocks off the free-queue head (their old hashes evicted)
        def touch(self, block_ids)           # a prefix hit adopts these blocks
        def free(self, block_ids)            # ids in eviction order (the request's tail first)
        def cache(self, block_id, block_hash)    # a full block gets its hash (duplicates kept)
        def lookup(self, block_hash) -> int | None   # the earliest-cached block holding the hash
        def free_block_ids(self) -> list[int]    # the free queue, head first

How it is plugged in: :class:`ManagerPool` is a ``BlockPool`` subclass (the manager's
``block_pool_cls`` seam) whose allocation, touch, free, cache and lookup go through the
learner's object. The engine then runs the learner's decisions: the block ids it hands out
are the ids in every block table, the kernels' slots, the pictures. Beside it, kvlab's own
pool structures (the queue and the map the superclass keeps) follow the same calls, so
after every call the checker compares -- the free queue head first, the block a lookup
returns, the blocks an allocation evicts -- and the first difference fails the check with
where it happened (scenario, step, call) and the rule it breaks.

Scenarios: vLLM's prefill story (test_prefill: ids ``[1, 2, 3, 4]``, free queue
``[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]``, eviction in that order), a block filled by decoding,
duplicate blocks (both copies survive their requests; evicting one keeps the other
reachable), lookahead slots freed as a group at the queue head, a preemption storm in the real engine (FCFS, chunked prefill, shared prefixes,
dozens of preemptions: the whole event log must equal kvlab's own run), and scale (each
call O(1): the same counted work -- comparisons, hashes, lines of the learner's code -- at 500
and 8,000 blocks; see :mod:`kvlab.exercises.work`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvlab.core.block_pool import BlockPool, group_suffix
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.engine.llm_engine import build_engine
from kvlab.exercises.checks_pool import EXPECTED_STORY, compare_story, run_shared_prefix_story
from kvlab.exercises.registry import call, register
from kvlab.exercises.result import CheckFailed, CheckResult, failed, passed
from kvlab.exercises.work import CountedInt, Work, counting
from kvlab.request import Request
from kvlab.eventlog.events import EventLog

EID = "block_manager"


def _ids(x: Any, what: str) -> list[int]:
    """The learner's returned ids as a list of ints, or a failure naming what came back."""
    if x is None:
        raise CheckFailed(failed(EID, f"{what} returned None", expected="a list of block ids", got="None", idea="a missing return?"))
    try:
        out = list(x)
    except TypeError:
        raise CheckFailed(
            failed(
                EID,
                f"{what} returned {type(x).__name__} {x!r}",
                expected="a list of block ids",
                got=repr(x),
                idea="return the ids as a list of ints",
            )
        ) from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise CheckFailed(
            failed(
                EID,
                f"{what} returned {out!r}",
                expected="a list of int block ids",
                got=repr(out),
                idea="block ids are ints; return ids, not KVCacheBlock objects",
            )
        )
    return out


class ManagerPool(BlockPool):
    """A ``BlockPool`` whose decisions come from the learner's ``BlockManager``."""

    learner_cls: Any = None  # set by pool_class_for
    where: Callable[[], str] = staticmethod(lambda: "")  # the scenario's current stage, for messages

    def __init__(self, num_gpu_blocks: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_gpu_blocks, *args, **kwargs)
        self.learner = call(self.learner_cls, num_gpu_blocks, where=f"constructing BlockManager({num_gpu_blocks})")
        self._compare_queue("a fresh pool", [])

    # -- comparisons --------------------------------------------------------------------------
    def _fail(self, op: str, message: str, expected: str, got: str, idea: str) -> CheckFailed:
        stage = self.where()
        return CheckFailed(failed(EID, message, case=(stage + " · " if stage else "") + op, expected=expected, got=got, idea=idea))

    def _compare_queue(self, op: str, touched: Sequence[int], idea: str = "") -> None:
        want = [b.block_id for b in self.free_block_queue.get_all_free_blocks()]
        got = _ids(call(self.learner.free_block_ids, where="free_block_ids()"), "free_block_ids()")
        n = call(lambda: self.learner.num_free_blocks, where="num_free_blocks")
        if got == want and n == len(want):
            return
        if got == want:
            raise self._fail(
                op,
                f"after {op}, num_free_blocks is {n!r}",
                f"{len(want)}",
                repr(n),
                "num_free_blocks counts the blocks on the free queue (the null block is never there)",
            )
        if not idea:
            idea = _queue_idea(op, want, got)
        raise self._fail(op, f"after {op}, your free queue differs from vLLM's", f"{want} (head first)", f"{got}", idea)

    def _compare_lookup(self, op: str, key: bytes) -> int | None:
        """The learner's lookup of ``key``, checked against the map's answer."""
        blk = self.cached_block_hash_to_block.get_one_block(key)
        want = None if blk is None else blk.block_id
        got = call(self.learner.lookup, key, where="lookup(block_hash)")
        if got == want and (got is None or (isinstance(got, int) and not isinstance(got, bool))):
            return got
        copies = [b.block_id for b in self.cached_block_hash_to_block.blocks_for(key)]
        if want is None:
            idea = (
                f"block {got} was reallocated: its old hash must leave the map when allocate() pops it "
                "(lazy eviction), or a later request 'hits' KV that now belongs to another prompt"
            )
        elif got is None and copies:
            idea = (
                f"the map must still find {copies}: two blocks may carry one hash (duplicates), and dropping one "
                "must keep the other -- remove by (hash, block id), never by hash alone"
            )
        elif isinstance(got, int) and got in copies and op.startswith(f"cache(block {got},"):
            idea = (
                f"blocks {want} (cached first) and {got} now carry one hash: keep both -- duplicates arise when two "
                f"requests compute one prefix at once -- and let lookup return block {want}, the one cached first"
            )
        elif isinstance(got, int) and got in copies:
            idea = "with duplicates, lookup returns the block that was cached first and is still cached"
        else:
            idea = "lookup returns the block cached under exactly this hash, or None"
        raise self._fail(op, f"after {op}, lookup of {key[:4].hex()}… returns {got!r}", repr(want), repr(got), idea)

    # -- the pool's work, through the learner -------------------------------------------------
    def get_new_blocks(self, num_blocks: int, request_id: str | None = None, group: int = 0) -> list[KVCacheBlock]:
        if not 0 <= num_blocks <= self.free_block_queue.num_free_blocks:  # refused before asking the learner
            return super().get_new_blocks(num_blocks, request_id, group)
        want = [b.block_id for b in self.free_block_queue.get_all_free_blocks()[:num_blocks]]
        old = {i: ck for i in want if (ck := self.blocks[i].cache_key) is not None}
        op = f"allocate({num_blocks})" + (f" for {request_id}" if request_id else "")
        got = _ids(call(self.learner.allocate, num_blocks, where=op), op)
        if got != want:
            if 0 in got:
                idea = "block 0 is the null block: it pads block tables and is never handed out"
            elif sorted(got) == sorted(want):
                idea = "pop from the head, in queue order: the free queue IS the eviction order"
            elif len(got) != num_blocks:
                idea = f"allocate(n) returns exactly n blocks ({num_blocks} here)"
            else:
                idea = "allocation pops the head of the free queue (the least recently freed cached block, or a never-cached one)"
            raise self._fail(op, f"{op} returned {got}", repr(want), repr(got), idea)
        blocks = super().get_new_blocks(num_blocks, request_id, group)
        self._compare_queue(op, got)
        for key in dict.fromkeys(old.values()):
            self._compare_lookup(op + f" (which evicts blocks {sorted(old)})", key)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        ids = [b.block_id for b in blocks if not b.is_null]
        if not ids:
            return
        op = f"touch({ids})"
        refs = {i: self.blocks[i].ref_cnt for i in ids}
        call(self.learner.touch, list(ids), where=op)
        super().touch(blocks)
        idea = ""
        if any(r == 0 for r in refs.values()):
            idea = (
                "a block at ref_cnt 0 sits on the free queue; a hit takes it off BEFORE counting it, so it cannot be evicted while in use"
            )
        else:
            idea = "these blocks are held by another request (ref_cnt > 0): they are not on the queue; a hit only counts them"
        self._compare_queue(op, ids, idea if _queue_differs(self) else "")

    def free_blocks(
        self, ordered_blocks: Iterable[KVCacheBlock], request_id: str | None = None, group: int = 0, reason: str = "request"
    ) -> None:
        ordered = list(ordered_blocks)
        ids = [b.block_id for b in ordered if not b.is_null]
        op = f"free({ids})" + (f" of {request_id}" if request_id else "")
        call(self.learner.free, list(ids), where=op)
        super().free_blocks(ordered, request_id, group, reason)
        self._compare_queue(op, ids)

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        before = {b.block_id for b in blocks[num_cached_blocks:num_full_blocks] if b.cache_key is not None}
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)
        for b in blocks[num_cached_blocks:num_full_blocks]:
            if b.is_null or b.cache_key is None or b.block_id in before:
                continue
            op = f"cache(block {b.block_id}, …) for {request.request_id}"
            call(self.learner.cache, b.block_id, b.cache_key, where=op)
            self._compare_lookup(op, b.cache_key)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        out = []
        for gid in kv_cache_group_ids:
            key = block_hash + group_suffix(gid)
            got = self._compare_lookup("a prefix lookup", key)
            if got is None:
                return None
            out.append(self.blocks[got])
        return out

    def reset_prefix_cache(self) -> bool:  # pragma: no cover - no scenario resets
        raise NotImplementedError("the capstone's BlockManager has no reset")


def _queue_differs(pool: ManagerPool) -> bool:
    want = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    try:
        return list(pool.learner.free_block_ids()) != want
    except Exception:  # noqa: BLE001 - _compare_queue reports it
        return True


def _queue_idea(op: str, want: list[int], got: list[int]) -> str:
    if 0 in got:
        return "the null block (0) is never on the free queue"
    if op.startswith("free"):
        if sorted(got) != sorted(want):
            return (
                "a block returns to the queue only when its ref_cnt reaches 0 (another request may still hold it); "
                "every block reaching 0 does return"
            )
        return (
            "freed blocks without a hash go to the HEAD (reused first: they can never hit), in the order given; "
            "cached blocks go to the TAIL, in the order given (the request's tail first)"
        )
    if op.startswith("allocate"):
        return "allocate pops from the head; nothing else on the queue moves"
    return "the free queue holds exactly the blocks with ref_cnt 0, in eviction order"


def pool_class_for(cls: Any, where: Callable[[], str] = lambda: "") -> type[ManagerPool]:
    return type("LearnerManagerPool", (ManagerPool,), {"learner_cls": staticmethod(cls), "where": staticmethod(where)})


# --- scenarios --------------------------------------------------------------------------------
class _Stage:
    def __init__(self) -> None:
        self.text = ""

    def __call__(self) -> str:
        return self.text


def _admit(mgr: KVCacheManager, r: Request) -> list[int] | None:
    hits, n = mgr.get_computed_blocks(r)
    new = mgr.allocate_slots(r, r.num_tokens - n, n, hits)
    if new is None:
        return None
    r.num_computed_tokens = r.num_tokens
    return new.get_block_ids()[0]


def _prefill_story(cls: Any) -> dict[str, Any]:
    stage = _Stage()
    stage.text = "vLLM's prefill story (test_prefill)"
    mgr = KVCacheManager(num_blocks=11, block_size=16, event_log=EventLog(), block_pool_cls=pool_class_for(cls, stage))
    return run_shared_prefix_story(mgr)


def _decode_story(cls: Any) -> None:
    stage = _Stage()
    stage.text = "a block filled by decoding"
    mgr = KVCacheManager(num_blocks=11, block_size=16, block_pool_cls=pool_class_for(cls, stage))
    prompt = list(range(100, 115))
    r = Request("d", prompt)
    _admit(mgr, r)
    for i, tok in enumerate((7, 8)):
        stage.text = f"a block filled by decoding · token {16 + i} appended"
        r.append_output_token_ids(tok)
        mgr.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    stage.text = "a block filled by decoding · a new prompt starting with the decoded block"
    hits, n = mgr.get_computed_blocks(Request("e", prompt + [7, 8]))
    if hits.get_block_ids() != ([1],):
        raise CheckFailed(
            failed(
                EID,
                "a block completed by a sampled token was not found by a later prompt",
                case=stage.text,
                expected="hit [1] (16 tokens)",
                got=f"{hits.get_block_ids()[0]} ({n} tokens)",
                idea="a block gets its hash when its 16th token is computed, prompt or output",
            )
        )


def _duplicates_story(cls: Any) -> None:
    stage = _Stage()
    stage.text = "duplicate blocks"
    mgr = KVCacheManager(num_blocks=11, block_size=16, block_pool_cls=pool_class_for(cls, stage))
    prompt = list(range(32)) + [5]
    a, b = Request("a", prompt), Request("b", prompt)
    stage.text = "duplicate blocks · a and b look up the same prompt before either is computed"
    looked = [(r, *mgr.get_computed_blocks(r)) for r in (a, b)]
    got = []
    for r, h, n in looked:
        new = mgr.allocate_slots(r, r.num_tokens - n, n, h)
        assert new is not None  # 10 usable blocks hold both requests (3 blocks each): never refused
        got.append(new.get_block_ids()[0])
        r.num_computed_tokens = r.num_tokens
    stage.text = "duplicate blocks · both requests finish"
    mgr.free(a)
    mgr.free(b)
    stage.text = "duplicate blocks · a 128-token request evicts a's copies"
    _admit(mgr, Request("c", [77] * 128))
    stage.text = "duplicate blocks · the same prompt again"
    hits, n = mgr.get_computed_blocks(Request("y", prompt))
    if hits.get_block_ids() != ([4, 5],) or got != [[1, 2, 3], [4, 5, 6]]:
        raise CheckFailed(
            failed(
                EID,
                "duplicates: b's copies must still be reachable after a's were evicted",
                case=stage.text,
                expected="a [1, 2, 3], b [4, 5, 6]; then a hit on [4, 5]",
                got=f"a {got[0]}, b {got[1]}; then a hit on {hits.get_block_ids()[0]}",
                idea="both copies survive their requests (neither is 'eliminated when freed'); evicting one keeps the other",
            )
        )


def _lookahead_story(cls: Any) -> None:
    """Speculative decoding's lookahead slots: blocks allocated ahead, never cached. Freed
    together, the hashless ones go to the queue head as one group, in the order given."""
    stage = _Stage()
    stage.text = "lookahead slots (speculative decoding)"
    mgr = KVCacheManager(num_blocks=11, block_size=4, block_pool_cls=pool_class_for(cls, stage))
    r = Request("s", list(range(6)))
    hits, n = mgr.get_computed_blocks(r)
    mgr.allocate_slots(r, 6, n, hits, num_lookahead_tokens=8)  # 14 slots: blocks 1 (full, cached), 2, 3, 4
    r.num_computed_tokens = 6
    stage.text = "lookahead slots (speculative decoding) · the request is aborted"
    mgr.free(r)


STORM: dict[str, Any] = dict(num_blocks=32, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)


def storm_requests() -> list[Request]:
    """24 requests: three system prompts shared by eight each, short questions, long answers
    (on a 31-block pool: 48 preemptions, 254 evictions)."""
    rng = random.Random(15)
    systems = [[1000 * s + i for i in range(12)] for s in range(3)]
    return [
        Request(
            f"r{i:02d}",
            systems[i % 3] + [rng.randrange(50, 500) for _ in range(rng.randrange(2, 9))],
            max_tokens=rng.randrange(20, 40),
            arrival_time=float(i),
        )
        for i in range(24)
    ]


def run_storm(block_pool_cls: type[BlockPool] | None = None) -> Any:
    """The preemption storm on kvlab's pool or on the learner's (the same requests)."""
    mkw = {"block_pool_cls": block_pool_cls} if block_pool_cls else {}
    eng = build_engine(manager_kwargs=mkw, **STORM)
    for r in storm_requests():
        eng.add_request(r)
    eng.run(max_steps=2000)
    return eng


def _storm(cls: Any) -> dict[str, int]:
    ref = run_storm()
    holder: dict[str, Any] = {}
    stage = lambda: f"the preemption storm · engine step {holder['eng'].events.step}" if "eng" in holder else "the preemption storm"  # noqa: E731
    mkw = {"block_pool_cls": pool_class_for(cls, stage)}
    eng = build_engine(manager_kwargs=mkw, **STORM)
    holder["eng"] = eng
    for r in storm_requests():
        eng.add_request(r)
    eng.run(max_steps=2000)
    assert eng.events is not None  # build_engine logs events by default
    a, b = ref.events.to_json(), eng.events.to_json()
    if a != b:  # pragma: no cover - the call-by-call comparison fails first
        raise CheckFailed(
            failed(
                EID,
                "the preemption storm's event log differs from kvlab's run",
                case="the preemption storm",
                idea="compare the Player of result.show() with kvlab.show() of the same run",
            )
        )
    s = ref.scheduler
    return {
        "preemptions": s.num_preemptions,
        "evictions": ref.kv_cache_manager.block_pool.num_evicted_blocks,
        "steps": ref.events.step,
        "log": eng.events,
    }


SCALE_OPS = 100  # blocks touched and freed again per measured manager
_PER_BLOCK = ("block", "blocks touched and freed")
SCALE_FACTOR = 4  # 16x the blocks: O(1) work stays ~1x, a scan grows ~16x


def _scale_work(cls: Any, n: int) -> Work:
    """The counted work of touching 100 cached free blocks and freeing them again, in an
    n-block manager (the same seeded picks every run): the O(n) list trap shows as n
    comparisons or lines per call, on any machine."""
    m = call(cls, n, where=f"BlockManager({n:,}) for the scale check")
    ids = call(m.allocate, n - 1, where=f"allocate({n - 1:,}) for the scale check")
    for i in ids:
        call(m.cache, i, int(i).to_bytes(8, "little"), where="cache(...) for the scale check")
    call(m.free, list(ids), where=f"free({n - 1:,} ids) for the scale check")
    picks = [CountedInt(i) for i in random.Random(0).sample(list(ids), SCALE_OPS)]
    with counting() as work:
        call(m.touch, picks, where=f"touch({SCALE_OPS} cached free blocks) of {n:,}")
        call(m.free, picks, where=f"free({SCALE_OPS} blocks) of {n:,}")
    return work


@register(
    EID,
    "Capstone: a whole block manager",
    "class BlockManager(num_blocks): allocate(n), touch(ids), free(ids), cache(id, hash), lookup(hash), free_block_ids(), num_free_blocks",
    "09_capstone",
    [
        "Three structures: a ref count per block, a free queue in eviction order (head = evicted next), a map hash -> blocks.",
        "The free queue needs O(1) remove from the middle (a hit adopts a free cached block): a dict used as an ordered set, or a doubly linked list.",
        "allocate pops the head; a popped block that still has a hash is evicted: drop exactly its own map entry (another block may carry the same hash) and forget its hash.",
        "free: ref -= 1; at 0 a block rejoins the queue -- without a hash at the head (all such blocks of one call together, in the given order), with a hash at the tail.",
        "The map keeps every block cached under a hash, oldest first; lookup returns the oldest.",
    ],
    notebook="ex_capstone",
)
def check_block_manager(cls: Any) -> CheckResult:
    if not isinstance(cls, type):
        return failed(
            EID,
            f"pass the class itself, got {type(cls).__name__}",
            expected="BlockManager (the class)",
            got=repr(cls),
            idea="check('block_manager', BlockManager) -- no parentheses",
        )
    obs = _prefill_story(cls)
    bad = compare_story(EID, obs, "block manager")
    if bad is not None:  # pragma: no cover - the call-by-call comparison fails first
        return bad
    _decode_story(cls)
    _duplicates_story(cls)
    _lookahead_story(cls)
    storm = _storm(cls)
    small, big = _scale_work(cls, 500), _scale_work(cls, 8_000)
    if big.per(SCALE_OPS) > SCALE_FACTOR * max(small.per(SCALE_OPS), 1.0):
        return failed(
            EID,
            f"touch/free are not O(1): with 500 blocks they did {small.describe(SCALE_OPS, *_PER_BLOCK)}; with 8,000 blocks {big.describe(SCALE_OPS, *_PER_BLOCK)}",
            idea="a list's remove() or index() searches the whole queue; use a dict (ordered) or a linked list",
        )
    return passed(
        EID,
        extra={"log": obs["log"], "storm_log": storm["log"]},
        message=(
            f"vLLM's prefill story ({EXPECTED_STORY['free_order']} freed, evicted in that order), a decoded block, "
            f"duplicates that both survive, lookahead blocks, and a preemption storm ({storm['preemptions']} preemptions, "
            f"{storm['evictions']} evictions, {storm['steps']} steps) with the same event log as kvlab's pool; "
            f"touch + free did {small.per(SCALE_OPS):.1f} and {big.per(SCALE_OPS):.1f} counted steps per block with 500 and 8,000 blocks (a list's search does ~16× more)."
        ),
    )
