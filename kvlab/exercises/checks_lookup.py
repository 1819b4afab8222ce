"""Checkers: longest_hit, sliding_window_hit, allocate_capacity (lessons 03, 05b, 07)."""

from __future__ import annotations

from typing import Any

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.single_type_kv_cache_manager import FullAttentionManager
from kvlab.exercises.registry import call, register, returns, same, wrong_kind
from kvlab.exercises.result import CheckResult, failed, passed
from kvlab.kv_cache_interface import FullAttentionSpec
from kvlab.request import Request
from kvlab.utils.math_utils import cdiv


def _h(i: int) -> bytes:
    return bytes([i]) * 4


@register(
    "longest_hit",
    "The longest cache hit",
    "find_longest_cache_hit(block_hashes, num_tokens, block_size, cached: dict) -> int",
    "03_prefix_caching",
    [
        "Walk the request's block hashes from the first one; stop at the first hash not in `cached`.",
        "The last prompt token must be computed (its logits pick the next token): at most (num_tokens - 1) // block_size blocks can hit.",
        "Count whole blocks only; a partial block has no hash at all.",
    ],
    notebook="ex_prefix_cache",
)
def check_longest_hit(fn: Any) -> CheckResult:
    eid = "longest_hit"
    H = [_h(i) for i in range(6)]
    cases = [
        ("nothing cached", H[:3], 50, 16, {}, 0, "no hit: everything is computed"),
        ("two of three blocks cached", H[:3], 50, 16, {H[0]: 1, H[1]: 2}, 2, "hits are the cached blocks before the first miss"),
        (
            "a hole in the middle",
            H[:4],
            70,
            16,
            {H[0]: 1, H[2]: 3, H[3]: 4},
            1,
            "stop at the first miss: block 2's hash names a prefix that includes block 1, which was not found",
        ),
        ("the 25-token question", H[:1], 25, 16, {H[0]: 1}, 1, "16 of the 25 tokens come from the cache; the last 9 are a partial block"),
        (
            "a fully cached 32-token prompt",
            H[:2],
            32,
            16,
            {H[0]: 1, H[1]: 2},
            1,
            "the hit never covers the last token: at most num_tokens - 1 tokens, whole blocks only",
        ),
        ("a 16-token prompt", H[:1], 16, 16, {H[0]: 1}, 0, "a prompt of exactly one block gets no hit: its last token must be computed"),
        ("block size 4", H[:5], 21, 4, {h: i for i, h in enumerate(H[:5])}, 5, "5 full blocks of 4 = 20 tokens ≤ 21 - 1"),
    ]
    for name, hashes, n, bs, cached, want, idea in cases:
        got = call(fn, list(hashes), n, bs, dict(cached), where=f"the case '{name}'")
        bad = wrong_kind(eid, got, want, name, "the number of hit blocks")
        if bad is not None:
            return bad
        if not same(got, want):
            return failed(
                eid,
                f"wrong number of hit blocks: {name}",
                case=name,
                inputs=f"{len(hashes)} block hashes, num_tokens={n}, block_size={bs}, cached={[hashes.index(h) for h in cached]} (by block index)",
                expected=str(want),
                got=str(got),
                idea=idea,
            )
    return passed(eid, "whole blocks, first miss stops the walk, and the last token is never a hit (25 tokens → 16 cached).")


def reference_sliding_window_hit(block_hashes: list[bytes], max_length: int, block_size: int, sliding_window: int, cached: set) -> int:
    return _with_need(block_hashes, max_length, block_size, cached, cdiv(sliding_window - 1, block_size))


def _with_need(block_hashes: list[bytes], max_length: int, block_size: int, cached: set, need: int) -> int:
    """The rightmost run of ``need`` cached blocks (or a shorter run from block 0)."""
    n = max_length // block_size
    run = 0
    for i in range(n - 1, -1, -1):
        if block_hashes[i] in cached:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run


@register(
    "sliding_window_hit",
    "Prefix hits for a sliding-window group",
    "sliding_window_hit(block_hashes, max_length, block_size, sliding_window, cached: set) -> int",
    "07a_sliding_window_groups",
    [
        "The next token at position p reads only keys p - W + 1 … p: blocks before that may be missing (null).",
        "So a hit of length L blocks needs only the last cdiv(W - 1, block_size) blocks before L to be cached, contiguously.",
        "Search from the right (the longest candidate first); a run that starts at block 0 is a hit even if shorter.",
    ],
    notebook="ex_prefix_cache",
)
def check_sliding_window_hit(fn: Any) -> CheckResult:
    eid = "sliding_window_hit"
    H = [_h(i) for i in range(8)]
    cases = [
        ("all cached, W=32, bs=16", 8 * 16 - 1, 16, 32, set(H), "the rightmost run of 2 contiguous blocks decides"),
        ("first blocks evicted, W=32", 8 * 16, 16, 32, set(H[3:]), "evicted blocks left of the window do not matter"),
        ("a hole near the end", 8 * 16, 16, 32, set(H[:5]) | {H[6]}, "the run [6] is too short (needs 2): fall back to blocks 3-4"),
        ("window inside one block, W=8", 8 * 16, 16, 8, {H[2], H[5]}, "cdiv(7, 16) = 1 block is enough"),
        (
            "W = block_size + 1",
            8 * 16,
            16,
            17,
            {H[0], H[1], H[2], H[6]},
            "the query itself is in the window: cdiv(W - 1, bs) = cdiv(16, 16) = 1 cached block before it suffices",
        ),
        (
            "W = 24, not a multiple of the block size",
            8 * 16,
            16,
            24,
            {H[0], H[1], H[2], H[5]},
            "the window reaches back W - 1 = 23 tokens: that spans cdiv(23, 16) = 2 blocks, so the lone block 5 is not enough",
        ),
        ("only block 0 cached", 8 * 16, 16, 64, {H[0]}, "a run starting at block 0 is a hit even if shorter than needed"),
        ("nothing cached", 8 * 16, 16, 32, set(), "no hit"),
    ]
    for name, max_len, bs, w, cached, idea in cases:
        want = reference_sliding_window_hit(H, max_len, bs, w, cached)
        got = call(fn, list(H), max_len, bs, w, set(cached), where=f"the case '{name}'")
        bad = wrong_kind(eid, got, want, name, "the hit length")
        if bad is not None:
            return bad
        if not same(got, want):
            if same(got, _full_rule(H, max_len, bs, cached)):
                idea = "that is the full-attention rule (a contiguous prefix from block 0); a window layer only needs the blocks its window reads"
            elif w % bs and got == _with_need(H, max_len, bs, cached, w // bs):
                idea = (
                    f"W // block_size = {w // bs} rounds down: a window of {w} tokens reaches {w - 1} tokens back, "
                    f"into cdiv(W - 1, block_size) = {cdiv(w - 1, bs)} blocks"
                )
            return failed(
                eid,
                f"wrong hit length: {name}",
                case=name,
                inputs=f"max_length={max_len}, block_size={bs}, sliding_window={w}, cached blocks={sorted(H.index(h) for h in cached)}",
                expected=f"{want} blocks",
                got=f"{got} blocks",
                idea=idea,
            )
    return passed(eid, "hits need only the window's blocks; null padding on the left is fine.")


def _full_rule(H: list[bytes], max_len: int, bs: int, cached: set) -> int:
    n = 0
    for h in H[: max_len // bs]:
        if h not in cached:
            break
        n += 1
    return n


@register(
    "allocate_capacity",
    "Does it fit? Counting evictable hits",
    "blocks_needed(num_tokens, block_size, num_held_blocks, hit_ref_cnts) -> int",
    "05b_recompute_and_admission",
    [
        "New blocks: cdiv(num_tokens, block_size) minus the blocks the request already holds minus its hit blocks.",
        "A hit block with ref_cnt 0 is on the free queue: adopting it takes one block out of the free supply too.",
        "Never negative.",
    ],
    notebook="ex_prefix_cache",
)
def check_allocate_capacity(fn: Any) -> CheckResult:
    eid = "allocate_capacity"
    cases = [
        ("fresh prompt of 55 tokens", 55, 16, 0, [], 4, "cdiv(55, 16) = 4 new blocks"),
        ("hit on 3 blocks still in use", 53, 16, 0, [1, 1, 1], 1, "hits held by others cost nothing: 4 - 3 = 1"),
        ("hit on 3 evictable blocks", 53, 16, 0, [0, 0, 0], 4, "1 new + 3 evictable hits that leave the free queue"),
        ("decode, room left in the last block", 18, 16, 2, [], 0, "the request already holds 2 blocks for 18 tokens"),
        ("decode crossing a block boundary", 33, 16, 2, [], 1, "token 33 needs a third block"),
        # e.g. lookahead slots of a speculative step that were not all used
        (
            "the request already holds more blocks than it needs",
            20,
            16,
            3,
            [],
            0,
            "cdiv(20, 16) = 2 blocks needed, 3 held: nothing to allocate",
        ),
    ]
    for name, n, bs, held, refs, want, idea in cases:
        got = call(fn, n, bs, held, list(refs), where=f"the case '{name}'")
        bad = wrong_kind(eid, got, want, name, "the block count")
        if bad is not None:
            return bad
        if not same(got, want):
            if got < 0:
                idea = (
                    f"a number of blocks to allocate is never negative: {idea} -- clamp the new blocks at 0, then add the "
                    "evictable hits (vLLM: max(num_new_blocks, 0) + the evictable hit blocks)"
                )
            return failed(
                eid,
                f"wrong count: {name}",
                case=name,
                inputs=f"num_tokens={n}, block_size={bs}, held={held}, hit ref counts={refs}",
                expected=str(want),
                got=str(got),
                idea=idea,
            )

    # In the engine: a pool whose only free blocks are the request's own evictable hits.
    # The learner's count is the full-attention manager's get_num_blocks_to_allocate.
    def get_num_blocks_to_allocate(self: Any, request_id: str, num_tokens: int, new_computed_blocks: Any, *rest: Any, **kw: Any) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        refs = [b.ref_cnt for b in new_computed_blocks if not b.is_null]
        n = returns(call(fn, num_tokens, self.block_size, held, refs, where="counting blocks inside allocate_slots"), int, "blocks_needed")
        return int(n)

    manager = type("LearnerFullAttentionManager", (FullAttentionManager,), {"get_num_blocks_to_allocate": get_num_blocks_to_allocate})
    mgr = KVCacheManager(num_blocks=4, block_size=4, manager_classes={FullAttentionSpec: manager})
    a = Request("a", list(range(9)))
    h, k = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 9 - k, k, h)
    mgr.free(a)  # blocks 1, 2 cached & evictable; 3 free
    b = Request("b", list(range(8)) + [77, 78, 79, 80, 81])  # 13 tokens: hit 2 blocks, needs 2 more
    h, k = mgr.get_computed_blocks(b)
    try:
        res = mgr.allocate_slots(b, 13 - k, k, h)
    except ValueError as e:
        return failed(
            eid,
            "in the engine your count let an allocation through that the pool cannot serve",
            got=f"crash: {e}",
            idea="the request's own hit blocks are counted as needed: they are part of the free supply you were about to use",
        )
    if res is not None:
        return failed(
            eid,
            "in the engine: a request whose hits are the only free blocks was admitted",
            expected="None (does not fit: 2 hits + 2 new > 3 free)",
            got=repr(res.get_block_ids()),
        )
    return passed(eid, "evictable hits are counted: an allocation that cannot be served is refused before anything changes.")
