"""Checkers: free_queue, free_order, touch, stale_hash (lessons 04a, 04b and 04c).

Each plugs the learner's code into a real ``KVCacheManager`` and replays vLLM's documented
scenario: on a fresh 11-block pool, two requests sharing 3 full blocks, freed, then a
long request that evicts everything -- the block ids must come out in vLLM's order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any, cast

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.single_type_kv_cache_manager import FullAttentionManager
from kvlab.exercises.registry import call, register, returns
from kvlab.exercises.result import LearnerError
from kvlab.exercises.result import CheckFailed, CheckResult, failed, passed
from kvlab.exercises.work import Work, counted_blocks, counting
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.request import Request
from kvlab.eventlog.events import EventLog

COMMON = [i for i in range(3) for _ in range(16)]
EXPECTED_FREE_ORDER = [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def run_shared_prefix_story(mgr: KVCacheManager) -> dict[str, Any]:
    """vLLM's test_prefill story. Returns the observables at each stage."""
    obs: dict[str, Any] = {}
    log = mgr.events

    def stage() -> None:  # one player step per stage of the story
        if log is not None:
            log.step += 1

    def admit(rid: str, tokens: list[int]) -> Any:
        stage()
        r = Request(rid, tokens)
        hits, n = mgr.get_computed_blocks(r)
        new = mgr.allocate_slots(r, len(tokens) - n, n, hits)
        obs[f"{rid}.hit"] = hits.get_block_ids()[0]
        obs[f"{rid}.new"] = None if new is None else new.get_block_ids()[0]
        return r

    r0 = admit("req0", COMMON + [3] * 7)
    r1 = admit("req1", COMMON + [3] * 5)
    obs["refs_after_req1"] = [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)]
    stage()
    mgr.free(r0)
    mgr.free(r1)
    obs["free_order"] = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    r2 = admit("req2", COMMON + [3] * 6)
    stage()
    mgr.free(r2)
    admit("req3", [99] * 160)
    obs["num_free_end"] = mgr.block_pool.get_num_free_blocks()
    obs["log"] = log
    return obs


def story_manager(**seams: Any) -> KVCacheManager:
    """A fresh 11-block pool that records its events, so a passing check can be replayed.
    ``seams``: ``block_pool_cls`` / ``manager_classes``, the learner's code plugged in."""
    return KVCacheManager(num_blocks=11, block_size=16, event_log=EventLog(), **seams)


def pool_with(**methods: Any) -> type[BlockPool]:
    """A BlockPool subclass with some attributes swapped (the learner's code)."""
    return type("LearnerBlockPool", (BlockPool,), methods)


EXPECTED_STORY = {
    "req0.hit": [],
    "req0.new": [1, 2, 3, 4],
    "req1.hit": [1, 2, 3],
    "req1.new": [5],
    "refs_after_req1": [2, 2, 2],
    "free_order": EXPECTED_FREE_ORDER,
    "req2.hit": [1, 2, 3],
    "req2.new": [5],
    "req3.hit": [],
    "req3.new": EXPECTED_FREE_ORDER,
    "num_free_end": 0,
}
STORY_IDEAS = {
    "free_order": "a finished request frees its blocks tail first; uncached tails go to the head, cached blocks to the tail",
    "req3.new": "allocation pops the queue head: the eviction order IS the free-queue order",
    "req1.hit": "a prefix hit walks the chain and stops at the first miss",
    "refs_after_req1": "a hit touches the block: ref_cnt counts the tables holding it",
}


def compare_story(eid: str, obs: dict[str, Any], what: str) -> CheckResult | None:
    for k, want in EXPECTED_STORY.items():
        if obs.get(k) != want:
            return failed(
                eid,
                f"with your {what} plugged into the block pool, vLLM's shared-prefix story diverges at `{k}`",
                case="fresh 11-block pool; req0 = 48+7 tokens, req1 = same 48+5, free both, req2 = 48+6, free, req3 = 160 new tokens",
                expected=repr(want),
                got=repr(obs.get(k)),
                idea=STORY_IDEAS.get(
                    k.split(".")[-1] if k.startswith("free") else k,
                    STORY_IDEAS.get(k, "follow the block through allocate → cache → free → evict"),
                ),
            )
    return None


# --- free_queue -------------------------------------------------------------------------------
class _Adapter:
    """Gives the pool the batch methods it uses, built from the learner's four."""

    learner_cls: Any = None  # set by queue_class_for

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.q = call(self.learner_cls, list(blocks), where="constructing FreeQueue(pool blocks)")

    @property
    def num_free_blocks(self) -> int:
        return self.q.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        # the pool uses what comes back: a forgotten ``return`` is named here, not deep in the pool
        return returns(self.q.popleft(), KVCacheBlock, "FreeQueue.popleft()")

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, b: KVCacheBlock) -> None:
        self.q.remove(b)

    def append(self, b: KVCacheBlock) -> None:
        self.q.append(b)

    def append_n(self, bs: list[KVCacheBlock]) -> None:
        for b in bs:
            self.q.append(b)

    def prepend_n(self, bs: list[KVCacheBlock]) -> None:
        if not bs:
            return
        rest = [self.q.popleft() for _ in range(self.q.num_free_blocks)]
        for b in list(bs) + rest:
            self.q.append(b)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self.q.get_all_free_blocks())


def queue_class_for(cls: Any) -> type[_Adapter]:
    """The pool's free-queue class around the learner's queue class."""
    return type("LearnerFreeQueue", (_Adapter,), {"learner_cls": staticmethod(cls)})


def _fresh_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


REMOVES = 100  # removes measured per queue size
SCAN_FACTOR = 4  # 16x the blocks: O(1) work stays ~1x, a scan grows ~16x


def _remove_work(cls: Any, n: int) -> Work:
    """The counted work of 100 removes (the same seeded victims every run) from an n-block queue."""
    blocks = counted_blocks(n)
    q = call(cls, blocks, where=f"constructing FreeQueue(blocks) of {n:,} blocks")
    victims = random.Random(0).sample(blocks, REMOVES)
    with counting() as work:
        for b in victims:
            call(q.remove, b, where=f"remove(block {b.block_id}) from a {n:,}-block queue")
    return work


@register(
    "free_queue",
    "The free queue: O(1) popleft / remove / append",
    "class FreeQueue(blocks): popleft(), remove(block), append(block), get_all_free_blocks(), num_free_blocks",
    "04b_eviction_and_lru",
    [
        "A prefix hit must pull a block out of the MIDDLE of the queue, so remove(block) must not search.",
        "Keep a doubly linked list through the blocks: block.prev_free_block / block.next_free_block.",
        "Two sentinel nodes (a fake head and a fake tail) remove every empty-list special case.",
    ],
    notebook="ex_block_pool",
)
def check_free_queue(cls: Any) -> CheckResult:
    eid = "free_queue"
    blocks = _fresh_blocks(6)
    q = call(cls, blocks, where="constructing FreeQueue(blocks)")

    def ids() -> list[int]:
        got = returns(call(q.get_all_free_blocks, where="get_all_free_blocks()"), (list, tuple), "get_all_free_blocks()")
        for b in got:
            returns(b, KVCacheBlock, "get_all_free_blocks() (each item)")
        return [b.block_id for b in got]

    steps: list[tuple[str, Callable[[], Any], list[int], int]] = [
        ("new queue of blocks 0..5", lambda: None, [0, 1, 2, 3, 4, 5], 6),
        ("popleft() → block 0", lambda: call(q.popleft, where="popleft()"), [1, 2, 3, 4, 5], 5),
        ("remove(block 3) from the middle", lambda: call(q.remove, blocks[3], where="remove(block 3)"), [1, 2, 4, 5], 4),
        ("append(block 0)", lambda: call(q.append, blocks[0], where="append(block 0)"), [1, 2, 4, 5, 0], 5),
        ("remove(block 1), the head", lambda: call(q.remove, blocks[1], where="remove(block 1)"), [2, 4, 5, 0], 4),
        ("remove(block 0), the tail", lambda: call(q.remove, blocks[0], where="remove(block 0)"), [2, 4, 5], 3),
        ("append(block 3)", lambda: call(q.append, blocks[3], where="append(block 3)"), [2, 4, 5, 3], 4),
    ]
    for name, op, want, n in steps:
        ret = op()
        if name.startswith("popleft") and getattr(ret, "block_id", None) != 0:
            missing = " — got None: a missing return?" if ret is None else ""
            return failed(
                eid,
                f"popleft() must return the head block{missing}",
                case=name,
                expected="block 0",
                got=repr(ret),
                idea="head = evicted next",
            )
        got = ids()
        count = returns(q.num_free_blocks, int, "num_free_blocks")
        if got != want or count != n:
            return failed(
                eid,
                f"queue wrong after {name}",
                case=name,
                expected=f"{want} (num_free_blocks={n})",
                got=f"{got} (num_free_blocks={q.num_free_blocks})",
                idea="the queue is the eviction order; every operation keeps it exact",
            )
    # Plug it into the real pool (its free-queue class) and replay vLLM's story.
    mgr = story_manager(block_pool_cls=pool_with(free_queue_cls=queue_class_for(cls)))
    obs = run_shared_prefix_story(mgr)
    bad = compare_story(eid, obs, "free queue")
    if bad is not None:
        return bad
    # O(1): a remove from an 8,000-block queue must do the work of one from a 500-block queue.
    # Work is counted, not timed (kvlab.exercises.work): the same verdict on any machine.
    small, big = _remove_work(cls, 500), _remove_work(cls, 8_000)
    if big.per(REMOVES) > SCAN_FACTOR * max(small.per(REMOVES), 1.0):
        return failed(
            eid,
            f"remove() is not O(1): with 500 blocks it did {small.describe(REMOVES)}; with 8,000 blocks {big.describe(REMOVES)}",
            idea="a list's remove() compares block after block; a prefix hit on a big server would scan the whole pool. Link the blocks (or key a dict by them) instead.",
        )
    return passed(
        eid,
        extra={"log": obs["log"]},
        message=f"exact queue order in vLLM's story, and remove() does the same work at 500 and 8,000 blocks ({small.per(REMOVES):.1f} and {big.per(REMOVES):.1f} counted steps per call).",
    )


# --- free_order -------------------------------------------------------------------------------
@register(
    "free_order",
    "Which block goes back first",
    "blocks_to_free(request_blocks) -> list",
    "04c_tail_first_and_cache_pressure",
    [
        "The free queue is the eviction order: what you free first is evicted first.",
        "Which part of a finished request is least likely to be reused by the next request: its beginning or its end?",
    ],
    notebook="ex_block_pool",
)
def check_free_order(fn: Any) -> CheckResult:
    eid = "free_order"
    sample = [KVCacheBlock(i) for i in (7, 3, 9, 4)]
    got = call(fn, list(sample), where="ordering blocks [7, 3, 9, 4]")
    if got is None:
        return failed(
            eid, "got None — a missing return?", expected="[4, 9, 3, 7]", idea="return the blocks in the order they go back to the pool"
        )
    got = list(returns(got, Iterable, "blocks_to_free"))
    for b in got:
        returns(b, KVCacheBlock, "blocks_to_free (each item)")
    got_ids = [b.block_id for b in got]
    if got_ids != [4, 9, 3, 7]:
        idea = "free the tail first: a long prefix is more useful to the next request than the last few tokens of one answer"
        if got_ids == [7, 3, 9, 4]:
            idea = "forward order puts the request's FIRST block at the eviction end: the shared beginning would be evicted first"
        return failed(eid, "wrong free order for a table [7, 3, 9, 4]", expected="[4, 9, 3, 7]", got=repr(got_ids), idea=idea)

    # In the engine: the learner's order is the full-attention manager's free order.
    def free_order(blocks: list[KVCacheBlock]) -> Any:
        return returns(call(fn, list(blocks), where="freeing a request"), Iterable, "blocks_to_free")

    manager = type("LearnerFullAttentionManager", (FullAttentionManager,), {"free_order": staticmethod(free_order)})
    mgr = story_manager(manager_classes={FullAttentionSpec: manager})
    obs = run_shared_prefix_story(mgr)
    bad = compare_story(eid, obs, "free order")
    if bad is not None:
        return bad
    return passed(
        eid,
        extra={"log": obs["log"]},
        message="tail first: in vLLM's story the shared prefix 3, 2, 1 sits at the far end of the eviction order.",
    )


# --- touch ------------------------------------------------------------------------------------
@register(
    "touch",
    "Touch: adopt a cached block safely",
    "touch(pool, blocks) -> None",
    "04a_refcounts_and_sharing",
    [
        "A hit block with ref_cnt 0 is still on the free queue: an eviction candidate.",
        "Take it off the queue (pool.free_block_queue.remove) BEFORE incrementing, then ref_cnt += 1.",
        "The null block (block.is_null) is never on the queue; leave it alone.",
    ],
    notebook="ex_block_pool",
)
def check_touch(fn: Any) -> CheckResult:
    eid = "touch"

    case = [""]  # the story running now (the window stories name theirs)

    def touch(pool: BlockPool, blocks: Any) -> None:
        blocks = list(blocks)
        before = {b.block_id: b.ref_cnt for b in blocks if not b.is_null}
        try:
            call(fn, pool, blocks, where="touching hit blocks")
        except LearnerError as e:
            nulls = [b for b in blocks if b.is_null]
            if nulls and f"block {nulls[0].block_id}," in str(e) and "not in the free queue" in str(e):
                raise CheckFailed(
                    failed(
                        eid,
                        f"your touch took the null block (block {nulls[0].block_id}) off the free queue, but the null block is never on it",
                        case=case[0],
                        got=str(e),
                        idea="a sliding-window hit pads the blocks that fell out of the window with the null block (block.is_null): it is in "
                        "no free queue and no request frees it -- skip it, as vLLM's touch does (ref_cnt == 0 and not block.is_null)",
                    )
                ) from None
            held = [bid for bid, r in before.items() if r > 0]
            if held and "not in the free queue" in str(e):
                raise CheckFailed(
                    failed(
                        eid,
                        f"your touch took block {held[0]} off the free queue, but it was not there: ref_cnt {before[held[0]]}, another request holds it",
                        case=case[0],
                        got=str(e),
                        idea="only a block at ref_cnt 0 sits on the free queue; a shared block (ref_cnt > 0) just gets ref_cnt += 1",
                    )
                ) from None
            raise
        on_queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        for i, b in enumerate(blocks):
            if b.is_null:
                continue
            if b.ref_cnt != before[b.block_id] + 1:
                idea = "ref_cnt counts the block tables holding the block: a hit adds one"
                if b.ref_cnt == before[b.block_id] and any(x.is_null for x in blocks[:i]):
                    idea = (
                        "the null blocks pad a sliding-window hit on the LEFT and the real hit blocks come after them: "
                        "skip a null block (continue), do not stop at it (break)"
                    )
                raise CheckFailed(
                    failed(
                        eid,
                        f"after your touch, block {b.block_id} has ref_cnt {b.ref_cnt}",
                        case=case[0],
                        expected=f"ref_cnt {before[b.block_id] + 1} (it was {before[b.block_id]}; one more block table holds it now)",
                        got=f"ref_cnt {b.ref_cnt}",
                        idea=idea,
                    )
                )
            if b.block_id in on_queue:
                raise CheckFailed(
                    failed(
                        eid,
                        f"after your touch, block {b.block_id} is held (ref_cnt {b.ref_cnt}) but still on the free queue",
                        case=case[0],
                        expected=f"block {b.block_id} off the queue",
                        got=f"free queue {on_queue} (head first)",
                        idea=f"the next allocation could pop block {b.block_id} and overwrite KV that a running request reads: "
                        "remove a ref-0 block from the queue before counting it",
                    )
                )

    learner_pool = pool_with(touch=touch)
    mgr = story_manager(block_pool_cls=learner_pool)
    pool = mgr.block_pool
    obs = run_shared_prefix_story(mgr)
    try:
        pool.check_invariants()
    except AssertionError as e:
        return failed(
            eid,
            "after your touch the pool is inconsistent",
            got=str(e),
            idea="a touched block with ref_cnt 0 must leave the free queue, or it can be evicted while in use",
        )
    bad = compare_story(eid, obs, "touch")
    if bad is not None:
        return bad
    # The classic bug: a referenced block left on the queue gets evicted under its owner.
    mgr = KVCacheManager(num_blocks=5, block_size=4, block_pool_cls=learner_pool)
    pool = mgr.block_pool
    a = Request("a", list(range(9)))
    h, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 9 - n, n, h)
    mgr.free(a)
    b = Request("b", list(range(9)))
    h, n = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 9 - n, n, h)
    held = mgr.get_block_ids("b")[0]
    queue = [x.block_id for x in pool.free_block_queue.get_all_free_blocks()]
    if any(bid in queue for bid in held):
        return failed(
            eid,
            "a block held by request b is still on the free queue",
            expected=f"queue without {held}",
            got=f"queue {queue}",
            idea="evicting a referenced block would overwrite KV that b is reading",
        )
    # Sliding-window hits: the blocks that fell out of the window are the null block, and
    # they reach touch with the real hit blocks (the full-attention stories never pass one).
    for name, story in WINDOW_STORIES:
        want = story(BlockPool)
        case[0] = name
        got = story(learner_pool)
        for k, v in want.items():
            if got.get(k) != v:
                return failed(
                    eid,
                    f"with your touch, a sliding-window hit diverges from vLLM's at `{k}`",
                    case=name,
                    expected=repr(v),
                    got=repr(got.get(k)),
                    idea="touch skips the null block (it pads the window's hit on the left) and adopts every real hit block",
                )
    return passed(
        eid,
        extra={"log": obs["log"]},
        message="hit blocks leave the free queue before their ref count rises; nothing referenced "
        "can be evicted; a sliding window's null padding is left alone.",
    )


def _free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def _refs(mgr: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in mgr.block_pool.blocks if not b.is_null and b.ref_cnt}


def _window_alone(block_pool_cls: type[BlockPool]) -> dict[str, Any]:
    """A 32-token window (16-token blocks): an 81-token prompt computed and freed, then the
    same prompt + 1 token hits its last two blocks, padded with three null blocks."""
    mgr = KVCacheManager(
        num_blocks=12, block_size=16, kv_cache_groups=[SlidingWindowSpec(sliding_window=32)], block_pool_cls=block_pool_cls
    )
    obs: dict[str, Any] = {}
    a = Request("a", list(range(81)))
    h, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 81 - n, n, h)
    mgr.free(a)
    b = Request("b", list(range(81)) + [5])
    h, n = mgr.get_computed_blocks(b)
    obs["b.hit"] = h.get_block_ids()
    mgr.allocate_slots(b, 82 - n, n, h)
    obs["b.table"], obs["ref_cnts"], obs["free_queue"] = mgr.get_block_ids("b"), _refs(mgr), _free_ids(mgr)
    mgr.free(b)
    obs["free_queue_after_free"] = _free_ids(mgr)
    mgr.block_pool.check_invariants()
    return obs


def _window_beside_full(block_pool_cls: type[BlockPool]) -> dict[str, Any]:
    """Full attention beside a 32-token window: a runs, c shares its first 3 blocks; the
    window's hit is [null, 6, 7] -- the null block and two blocks a still holds."""
    mgr = KVCacheManager(
        num_blocks=20,
        block_size=16,
        kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=32)],
        block_pool_cls=block_pool_cls,
    )
    obs: dict[str, Any] = {}
    a = Request("a", list(range(55)))
    h, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 55 - n, n, h)
    c = Request("c", list(range(53)))
    h, n = mgr.get_computed_blocks(c)
    obs["c.hit"] = h.get_block_ids()
    mgr.allocate_slots(c, 53 - n, n, h)
    obs["c.table"], obs["ref_cnts"], obs["free_queue"] = mgr.get_block_ids("c"), _refs(mgr), _free_ids(mgr)
    mgr.free(a)
    mgr.free(c)
    obs["free_queue_after_free"] = _free_ids(mgr)
    mgr.block_pool.check_invariants()
    return obs


WINDOW_STORIES: list[tuple[str, Callable[[type[BlockPool]], dict[str, Any]]]] = [
    (
        "a sliding window of 32 tokens alone: an 81-token prompt freed, then the same prompt + 1 hits [0, 0, 0, 4, 5] "
        "(null, null, null, then its last two blocks)",
        _window_alone,
    ),
    ("full attention beside a 32-token window while request a runs: c (53 tokens) hits [1, 2, 3] and [0, 6, 7]", _window_beside_full),
]


# --- stale_hash -----------------------------------------------------------------------------
@register(
    "stale_hash",
    "The stale hash entry after reuse",
    "evict_cached_block(pool, block) -> bool",
    "04b_eviction_and_lru",
    [
        "When a cached free block is reallocated, its old content is about to be overwritten.",
        "Remove exactly this block's entry from pool.cached_block_hash_to_block (key = block.cache_key, and the block id), then block.reset_hash().",
        "Other blocks with the same hash (duplicates) must stay in the map. Return whether anything was evicted.",
    ],
    notebook="ex_block_pool",
)
def check_stale_hash(fn: Any) -> CheckResult:
    eid = "stale_hash"

    def evict(pool: BlockPool, block: KVCacheBlock) -> bool:
        key = block.cache_key
        ret = returns(call(fn, pool, block, where="evicting a reallocated block"), bool, "evict_cached_block")
        removed = key is not None and block not in pool.cached_block_hash_to_block.blocks_for(key)
        if removed and block.cache_key is not None:
            raise CheckFailed(
                failed(
                    eid,
                    f"block {block.block_id} left the map but still carries its hash",
                    expected=f"block {block.block_id}.cache_key is None after eviction",
                    got=f"block {block.block_id}.cache_key = {block.cache_key.hex()[:16]}…",
                    idea="call block.reset_hash() too: the block is about to hold new tokens, and when they fill it the pool "
                    "gives it their hash -- a block that still has the old one looks 'already cached'",
                )
            )
        if removed and ret is False:
            raise CheckFailed(
                failed(
                    eid,
                    f"your eviction removed block {block.block_id}'s hash from the map but returned False",
                    case="reallocating a cached block",
                    expected="True (a hash was removed)",
                    got="False",
                    idea="the pool counts an eviction and publishes a BlockRemoved KV event only when you return True: with False, "
                    "a router listening to the events still believes the hash is cached here (vLLM returns True exactly when it removed a hash)",
                )
            )
        return ret

    learner_pool = pool_with(_maybe_evict_cached_block=evict)

    # The consequence of a stale entry: a lookup "hits" a block that now holds other tokens.
    mgr = KVCacheManager(num_blocks=4, block_size=4, block_pool_cls=learner_pool)
    a = Request("a", list(range(9)))
    h, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 9 - n, n, h)
    mgr.free(a)
    b = Request("b", [50 + i for i in range(9)])
    h, n = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 9 - n, n, h)  # takes every block, evicting a's
    a2 = Request("a2", list(range(9)))
    h, n = mgr.get_computed_blocks(a2)
    if n:
        return failed(
            eid,
            f"after its blocks were reused by b, a's prompt still 'hits' {n} tokens",
            expected="0 tokens",
            got=f"{n} tokens, blocks {h.get_block_ids()[0]}",
            idea="a stale map entry returns another prompt's KV: the model would answer from the wrong context",
        )
    mgr = story_manager(block_pool_cls=learner_pool)
    obs = run_shared_prefix_story(mgr)
    try:
        mgr.block_pool.check_invariants()
    except AssertionError as e:
        return failed(
            eid,
            "after reallocating cached blocks the pool is inconsistent",
            got=str(e),
            idea="a reallocated block must lose both its map entry and its hash",
        )
    bad = compare_story(eid, obs, "eviction")
    if bad is not None:
        return bad
    # Duplicates: evicting one copy keeps the other reachable.
    mgr = KVCacheManager(num_blocks=8, block_size=4, block_pool_cls=learner_pool)
    x, y = Request("x", list(range(5))), Request("y", list(range(5)))
    looked = [(r, *mgr.get_computed_blocks(r)) for r in (x, y)]  # both look up before either computes
    for r, h, n in looked:
        mgr.allocate_slots(r, 5 - n, n, h)
    hx, hy = mgr.get_block_ids("x")[0][0], mgr.get_block_ids("y")[0][0]
    pool = mgr.block_pool
    # None only from a learner's pool that did not cache the block: then nothing is found, and the check below says so
    key = cast(bytes, pool.blocks[hx].cache_key)
    mgr.free(x)
    mgr.free(y)
    while pool.free_block_queue.get_all_free_blocks()[0].block_id not in (hx, hy):
        pool.get_new_blocks(1)
    first = pool.free_block_queue.get_all_free_blocks()[0].block_id
    pool.get_new_blocks(1)
    left = [blk.block_id for blk in pool.cached_block_hash_to_block.blocks_for(key)]
    other = hy if first == hx else hx
    if left != [other]:
        return failed(
            eid,
            "two blocks carried one hash (duplicates); evicting one must keep the other",
            expected=f"map keeps [{other}]",
            got=f"map keeps {left}",
            idea="pop by (hash, block id), not by hash alone",
        )
    # vLLM calls the eviction on every block it reallocates, cached or not: a block without
    # a hash has nothing to remove, and the answer must say so.
    pool = KVCacheManager(num_blocks=4, block_size=4).block_pool
    plain = pool.blocks[1]
    ret = returns(call(fn, pool, plain, where="evicting a block that has no hash"), bool, "evict_cached_block")
    if ret is not False or len(pool.cached_block_hash_to_block) or plain.cache_key is not None:
        return failed(
            eid,
            f"your eviction returned {ret} for block {plain.block_id}, which has no hash: nothing was removed",
            case="reallocating a block that was never cached",
            expected="False (no hash, nothing removed)",
            got=repr(ret),
            idea="True means 'a hash was removed': the pool would count an eviction and publish a BlockRemoved KV event "
            "for a hash that was never stored (vLLM returns False when block.block_hash is None)",
        )
    return passed(
        eid, extra={"log": obs["log"]}, message="reallocated blocks drop exactly their own entry; no stale hit, duplicates survive."
    )
