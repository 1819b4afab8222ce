"""Checked prefix hits: ``allocate_slots`` adopts a hit only if it is a block of this pool
that still carries the hash it was found under; ``check_invariants`` notices a request
that would read another prompt's K/V.

vLLM looks up and allocates in one scheduler call, so a stale hit cannot happen there; a
learner driving the manager by hand (lesson 03's cells, run out of order) can: look up,
let another request evict and reuse the blocks, then allocate with the old hits.
"""

from __future__ import annotations

import pytest
from state_fingerprint import fingerprint

from kvlab import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec
from kvlab.core.kv_cache_manager import KVCacheBlocks
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.eventlog.events import EventLog


def cached_prefix(num_blocks: int = 6, **kw):
    """A manager whose free queue holds A's two cached blocks (A finished)."""
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=4, event_log=EventLog(), **kw)
    a = Request("a", list(range(9)))
    mgr.allocate_slots(a, 9)
    mgr.free(a)
    return mgr


def test_a_hit_evicted_and_reused_since_the_lookup_is_refused_and_nothing_changes():
    mgr = cached_prefix()
    a2 = Request("a2", list(range(9)))
    hits, n = mgr.get_computed_blocks(a2)
    assert n == 8 and hits.get_block_ids() == ([1, 2],)
    # B takes every free block -- A's cached blocks are evicted and now hold B's tokens.
    b = Request("b", [50 + i for i in range(20)])
    assert mgr.allocate_slots(b, 20) is not None
    assert 1 in mgr.get_block_ids("b")[0]
    mgr.free(b)  # back on the queue, with B's hashes
    before = fingerprint(mgr, [a2, b])
    with pytest.raises(ValueError, match=r"new_computed_blocks\[0\]\[0\]: block 1 no longer carries the hash of block 0"):
        mgr.allocate_slots(a2, 1, n, hits)
    assert fingerprint(mgr, [a2, b]) == before
    mgr.check_invariants()
    # Looked up again: a miss, and the allocation goes through.
    hits, n = mgr.get_computed_blocks(a2)
    assert n == 0 and mgr.allocate_slots(a2, 9, n, hits) is not None
    mgr.check_invariants()


def test_hits_from_another_manager_are_refused_and_both_stay_intact():
    m1, m2 = cached_prefix(), cached_prefix()
    r = Request("r", list(range(9)))
    hits, n = m1.get_computed_blocks(r)
    s1, s2 = fingerprint(m1, [r]), fingerprint(m2, [r])
    with pytest.raises(ValueError, match=r"new_computed_blocks\[0\]\[0\] \(block 1\) is not a block of this manager's pool"):
        m2.allocate_slots(r, 1, n, hits)
    assert fingerprint(m1, [r]) == s1 and fingerprint(m2, [r]) == s2
    m1.check_invariants(), m2.check_invariants()


@pytest.mark.parametrize("forged", ["a fresh block", "a free block without the hash", "not a block"])
def test_a_forged_block_after_a_real_hit_moves_no_ref_count(forged):
    mgr = cached_prefix(num_blocks=8)
    r = Request("r", list(range(13)))
    hits, n = mgr.get_computed_blocks(r)
    assert n == 8
    real = hits.blocks[0][0]
    fake = {"a fresh block": KVCacheBlock(2), "a free block without the hash": mgr.block_pool.blocks[5], "not a block": "block 2"}[forged]
    bad = KVCacheBlocks(([real, fake],))
    before = fingerprint(mgr, [r])
    with pytest.raises((ValueError, TypeError), match=r"new_computed_blocks\[0\]\[1\]"):
        mgr.allocate_slots(r, 5, 8, bad)
    assert real.ref_cnt == 0 and fingerprint(mgr, [r]) == before
    mgr.check_invariants()


def test_a_full_attention_hit_may_not_be_the_null_block_but_a_window_hit_may():
    mgr = cached_prefix()
    r = Request("r", list(range(9)))
    hits, n = mgr.get_computed_blocks(r)
    bad = KVCacheBlocks(([mgr.block_pool.null_block, hits.blocks[0][1]],))
    with pytest.raises(ValueError, match="is the null block; a full-attention group's hits are real blocks"):
        mgr.allocate_slots(r, 1, n, bad)
    # A window group pads the blocks it will not read with the null block: accepted.
    hy = KVCacheManager(num_blocks=20, block_size=4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=4)])
    a = Request("a", list(range(17)))
    hy.allocate_slots(a, 17)
    hy.free(a)
    b = Request("b", list(range(17)))
    hits, n = hy.get_computed_blocks(b)
    assert n == 16 and hits.blocks[1][0].is_null
    assert hy.allocate_slots(b, 1, n, hits) is not None
    hy.check_invariants()


def test_check_invariants_notices_a_request_reading_another_prompts_kv():
    mgr = cached_prefix(num_blocks=10)
    x = Request("x", [90 + i for i in range(9)])
    mgr.allocate_slots(x, 9)  # x's blocks 0 and 1 are cached under x's hashes
    mgr.check_invariants()
    # What adopting a stale hit would have done: x's table points at A's cached block.
    m = mgr.coordinator.single_type_managers[0]
    mine, theirs = m.req_to_blocks["x"][0], mgr.block_pool.blocks[1]
    assert theirs.cache_key is not None and theirs.cache_key != mine.cache_key
    mgr.block_pool.free_block_queue.remove(theirs)
    theirs.ref_cnt, mine.ref_cnt = 1, 0
    mgr.block_pool.free_block_queue.append(mine)
    m.req_to_blocks["x"][0] = theirs
    mgr.block_pool.check_invariants()  # the pool alone is consistent ...
    with pytest.raises(
        AssertionError,
        match=r"'x': block 1 at position 0 of group 0 carries another prefix's hash; the request would read another prompt's K/V",
    ):
        mgr.check_invariants()  # ... the manager sees whose K/V it is
