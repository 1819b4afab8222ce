"""Sliding-window groups, alone and next to full attention (vLLM's hybrid coordinator)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec
from kvlab.core.single_type_kv_cache_manager import SlidingWindowManager


def free_ids(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


@contextmanager
def evicted(mgr, req, *where):
    """Drop map entries for (block index, group id) pairs, as an eviction would; restore after."""
    cache = mgr.block_pool.cached_block_hash_to_block._cache
    saved = {}
    for idx, gid in where:
        key = req.block_hashes[idx] + gid.to_bytes(4, "big")
        saved[key] = cache.pop(key)
    try:
        yield
    finally:
        cache.update(saved)
        mgr.check_invariants()


def hybrid3():
    return KVCacheManager(
        num_blocks=21,
        block_size=16,
        kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=32), SlidingWindowSpec(sliding_window=32)],
    )


# --- the hybrid scenario -------------------------------------------------------------------------
def test_hybrid_prefill_hits_and_partial_eviction(common_prefix):
    mgr = hybrid3()
    req0 = Request("0", common_prefix + [3] * 7)
    hits, n = mgr.get_computed_blocks(req0)
    assert hits.get_block_ids() == ([], [], []) and n == 0
    assert mgr.allocate_slots(req0, 55, n, hits).get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    for gid, bids in enumerate(([1, 2, 3], [5, 6, 7], [9, 10, 11])):
        for i, bid in enumerate(bids):
            blk = mgr.block_pool.blocks[bid]
            assert blk.block_hash == req0.block_hashes[i] and blk.cache_key == req0.block_hashes[i] + gid.to_bytes(4, "big")
    assert len(mgr.block_pool.cached_block_hash_to_block) == 9  # one key per (hash, group)

    req1 = Request("1", common_prefix + [4] * 5)
    hits, n = mgr.get_computed_blocks(req1)
    assert hits.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11]) and n == 48
    assert mgr.allocate_slots(req1, 5, n, hits).get_block_ids() == ([13], [14], [15])
    assert mgr.get_block_ids("1") == ([1, 2, 3, 13], [0, 6, 7, 14], [0, 10, 11, 15])
    refs = {b.block_id: b.ref_cnt for b in mgr.block_pool.blocks[1:16]}
    assert [refs[i] for i in (1, 2, 3, 5, 6, 7, 9, 10, 11, 13)] == [2, 2, 2, 1, 2, 2, 1, 2, 2, 1]
    assert mgr.block_pool.null_block.ref_cnt == 0 and mgr.block_pool.get_num_free_blocks() == 5
    mgr.check_invariants()

    mgr.free(req0)
    mgr.free(req1)
    # group by group, each tail first: uncached partial blocks to the head, cached to the tail
    assert free_ids(mgr) == [15, 14, 13, 12, 8, 4, 16, 17, 18, 19, 20, 5, 9, 3, 2, 1, 7, 6, 11, 10]
    mgr.check_invariants()

    probe = Request("2", common_prefix + [5] * 6)

    def hit():
        h, num = mgr.get_computed_blocks(probe)
        return h.get_block_ids(), num

    assert hit() == (([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48)
    with evicted(mgr, req0, (0, 1), (0, 2)):  # SW needs only the last 2 blocks
        assert hit() == (([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48)
    with evicted(mgr, req0, (0, 0)):  # full attention needs every block from the start
        assert hit() == (([], [], []), 0)
    with evicted(mgr, req0, (2, 0), (2, 1), (2, 2)):
        assert hit() == (([1, 2], [5, 6], [9, 10]), 32)
    with evicted(mgr, req0, (2, 0)):
        assert hit() == (([1, 2], [5, 6], [9, 10]), 32)
    with evicted(mgr, req0, (2, 1)):  # one SW group misses: both SW groups and full are cut to 2
        assert hit() == (([1, 2], [5, 6], [9, 10]), 32)
    with evicted(mgr, req0, (2, 0), (0, 1), (0, 2)):
        assert hit() == (([], [], []), 0)
    assert hit() == (([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48)  # everything restored


def test_hybrid_decode_drops_blocks_outside_the_window(common_prefix):
    mgr = hybrid3()
    req0 = Request("0", common_prefix + [3] * 7)
    hits, n = mgr.get_computed_blocks(req0)
    mgr.allocate_slots(req0, 55, n, hits)
    req0.num_computed_tokens = 55
    req0.append_output_token_ids(1)
    # 55 computed -> 24 tokens skipped -> block 0 of each SW group is never read again
    assert mgr.allocate_slots(req0, 1).get_block_ids() == ([], [], [])
    assert mgr.get_block_ids("0") == ([1, 2, 3, 4], [0, 6, 7, 8], [0, 10, 11, 12])
    assert free_ids(mgr)[-2:] == [5, 9] and mgr.block_pool.blocks[5].block_hash == req0.block_hashes[0]
    mgr.check_invariants()


def test_hybrid_own_hits_count_in_every_group(common_prefix):
    mgr = KVCacheManager(num_blocks=9, block_size=16, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=32)])
    a = Request("a", common_prefix + [1])
    hits, n = mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 49, n, hits).get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    mgr.free(a)
    b = Request("b", common_prefix + [2] * 17)  # 65 tokens: 5 blocks per group
    hits, n = mgr.get_computed_blocks(b)
    assert hits.get_block_ids() == ([1, 2, 3], [0, 6, 7]) and n == 48
    # need: full 2 new + 3 adopted, SW 2 new + 2 adopted (the null pad costs nothing) = 9 > 8
    before = free_ids(mgr)
    assert mgr.allocate_slots(b, 17, n, hits) is None
    assert free_ids(mgr) == before and all(x.ref_cnt == 0 for x in mgr.block_pool.blocks)
    assert mgr.allocate_slots(b, 1, n, hits).get_block_ids() == ([8], [4])  # 49 tokens: 4 + 3 = 7 <= 8
    mgr.check_invariants()


# --- sliding window alone --------------------------------------------------------------------------
def sw(window=32, num_blocks=11, **kw):
    return KVCacheManager(num_blocks=num_blocks, block_size=16, kv_cache_groups=[SlidingWindowSpec(sliding_window=window)], **kw)


def test_skipped_blocks_are_nulled_and_freed_to_the_tail():
    mgr = sw()
    req = Request("r", list(range(50)))
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 50, n, hits).get_block_ids() == ([1, 2, 3, 4],)
    req.num_computed_tokens = 50
    req.append_output_token_ids(7)
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([],)  # 50 - 32 + 1 = 19 skipped: 1 block
    assert mgr.get_block_ids("r") == ([0, 2, 3, 4],)
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 10, 1]  # cached: kept at the tail
    assert mgr.block_pool.blocks[1].ref_cnt == 0 and mgr.block_pool.blocks[1].block_hash == req.block_hashes[0]
    req.num_computed_tokens = 51
    req.append_output_token_ids([7] * 13)  # 64 tokens
    assert mgr.allocate_slots(req, 13).get_block_ids() == ([],)  # 51 computed: still 1 block skipped
    req.num_computed_tokens = 64
    req.append_output_token_ids(8)
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([5],)  # 33 skipped: 2 blocks
    assert mgr.get_block_ids("r") == ([0, 0, 3, 4, 5],)
    assert free_ids(mgr) == [6, 7, 8, 9, 10, 1, 2]
    mgr.free(req)
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 10, 1, 2, 4, 3]  # null entries are not freed
    mgr.check_invariants()


def test_skipped_uncached_blocks_go_to_the_head():
    mgr = sw(enable_caching=False)
    req = Request("r", list(range(50)))
    mgr.allocate_slots(req, 50)
    req.num_computed_tokens = 50
    req.append_output_token_ids(7)
    mgr.allocate_slots(req, 1)
    assert mgr.get_block_ids("r") == ([0, 2, 3, 4],) and free_ids(mgr) == [1, 5, 6, 7, 8, 9, 10]


def test_skipped_blocks_are_freed_even_if_the_allocation_fails():
    mgr = sw(num_blocks=5)  # 4 usable
    req = Request("r", list(range(64)))
    mgr.allocate_slots(req, 64)
    req.num_computed_tokens = 64
    req.append_output_token_ids(list(range(48)))  # 112 tokens
    # 64 computed: 33 skipped -> blocks 0, 1 freed; 64 more tokens need 4 more blocks, 2 free
    assert mgr.allocate_slots(req, 48) is None
    assert mgr.get_block_ids("r") == ([0, 0, 3, 4],) and free_ids(mgr) == [2, 1]
    mgr.check_invariants()


def _sw_cached(window):
    """A 5-block (81-token) prompt computed and freed: its 5 full blocks are cached."""
    mgr = sw(window=window, num_blocks=12)
    a = Request("a", list(range(81)))
    assert mgr.allocate_slots(a, 81).get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    mgr.free(a)
    return mgr, a


def test_sliding_window_lookup_pads_with_null_on_the_left():
    mgr, a = _sw_cached(32)  # needs cdiv(31, 16) = 2 contiguous blocks
    probe = Request("b", list(range(81)))

    def hit():
        h, n = mgr.get_computed_blocks(probe)
        return h.get_block_ids(), n

    assert hit() == (([0, 0, 0, 4, 5],), 80)
    with evicted(mgr, a, (4, 0)):
        assert hit() == (([0, 0, 3, 4],), 64)
    with evicted(mgr, a, (3, 0)):  # a run of 1 at the end is not enough; search goes on left
        assert hit() == (([0, 2, 3],), 48)
    with evicted(mgr, a, (1, 0), (3, 0)):  # only runs of 1 block; the one at block 0 still counts:
        assert hit() == (([1],), 16)  # no window before block 0 ever reached further left
    with evicted(mgr, a, (0, 0), (2, 0), (4, 0)):
        assert hit() == (([],), 0)

    hits, n = mgr.get_computed_blocks(probe)
    assert free_ids(mgr) == [6, 7, 8, 9, 10, 11, 5, 4, 3, 2, 1]
    assert mgr.allocate_slots(probe, 1, n, hits).get_block_ids() == ([6],)
    assert mgr.get_block_ids("b") == ([0, 0, 0, 4, 5, 6],)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in range(1, 8)] == [0, 0, 0, 1, 1, 1, 0]
    assert free_ids(mgr) == [7, 8, 9, 10, 11, 3, 2, 1]
    mgr.check_invariants()


def test_short_run_from_block_zero_is_a_hit():
    mgr, a = _sw_cached(48)  # needs cdiv(47, 16) = 3 contiguous blocks
    probe = Request("b", list(range(81)))
    assert mgr.get_computed_blocks(probe)[0].get_block_ids() == ([0, 0, 3, 4, 5],)
    with evicted(mgr, a, (2, 0)):  # runs: [0, 1] from the start (2 < 3) and [3, 4] (2 < 3)
        hits, n = mgr.get_computed_blocks(probe)
        assert hits.get_block_ids() == ([1, 2],) and n == 32
    with evicted(mgr, a, (0, 0), (2, 0)):
        assert mgr.get_computed_blocks(probe)[1] == 0


@pytest.mark.parametrize("window, needed", [(2, 1), (16, 1), (17, 1), (18, 2), (33, 2), (34, 3), (65, 4)])
def test_contiguous_blocks_needed_is_cdiv_window_minus_1(window, needed):
    """The next query (position 80) reads tokens 80 - W + 1 ... 80: cdiv(W - 1, 16) full blocks."""
    mgr, a = _sw_cached(window)
    hits, n = mgr.get_computed_blocks(Request("b", list(range(81))))
    assert n == 80 and hits.get_block_ids() == ([0] * (5 - needed) + list(range(6 - needed, 6)),)
    with evicted(mgr, a, (5 - needed, 0)):  # one block of that run missing: the hit gets shorter
        assert mgr.get_computed_blocks(Request("c", list(range(81))))[1] < 80


def test_sliding_window_manager_skip_count():
    spec = SlidingWindowSpec(sliding_window=32, block_size=16)
    assert [spec.num_skipped_tokens(n) for n in (0, 31, 32, 33, 50)] == [0, 0, 1, 2, 19]
    m = SlidingWindowManager(spec, KVCacheManager(num_blocks=3).block_pool, 0)
    assert m.get_num_skipped_tokens(50) == 19


def diverging_mamba_hybrid(**kw) -> tuple[KVCacheManager, Request, Request]:
    """Full attention + Mamba, blocks of 4: a (17 tokens, prefilled 8 + 9) leaves full-attention
    blocks for 12 of b's tokens but a Mamba state only at 8 (the chunk boundary). ``kw`` goes
    to the manager."""
    m = KVCacheManager(
        num_blocks=40, block_size=4, kv_cache_groups=[FullAttentionSpec(), MambaSpec(shapes=((2, 3),), dtypes=("float32",))], **kw
    )
    a = Request("a", list(range(17)))
    hits, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 8, n, hits)
    a.num_computed_tokens = 8
    m.allocate_slots(a, 9)
    a.num_computed_tokens = 17
    return m, a, Request("b", list(range(12)) + [99] * 9)


def test_per_group_lookup_shows_how_far_each_group_hits_alone():
    """vLLM 0.33's find_longest_cache_hit_per_group: full attention alone would hit 12 tokens,
    the Mamba group only has the state at 8 (the chunk boundary), so the agreed hit is 8."""
    m, _, b = diverging_mamba_hybrid()
    assert m.get_computed_blocks(b)[1] == 8
    coord = m.coordinator
    blocks, lens = coord.find_longest_cache_hit_per_group(b.block_hashes, b.num_tokens - 1)
    assert coord.full_attention_group_id == 0 and lens == (12, 8)
    assert [[x.block_id for x in g] for g in blocks] == [[1, 2, 4], [0, 3]]  # a Mamba hit is nulls up to its state
    assert coord.find_longest_cache_hit_per_group(b.block_hashes, 7)[1] == (4, 0)  # no state at 4
