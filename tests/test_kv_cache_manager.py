"""KVCacheManager with one full-attention group: vLLM's documented scenarios, exact ids."""

from __future__ import annotations

import pytest

from kvlab import (
    CachingMetrics,
    FullAttentionSpec,
    KVCacheManager,
    MultiModalFeature,
    PrefixCacheStats,
    Request,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    hash_block_tokens,
)


def free_ids(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def state(mgr):
    """Everything an allocation could change: refs, hashes, queue order, map, tables."""
    pool = mgr.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_ids(mgr),
        pool.get_num_free_blocks(),
        sorted((k, tuple(b.block_id for b in v)) for k, v in pool.cached_block_hash_to_block.items()),
        [{r: [b.block_id for b in t] for r, t in m.req_to_blocks.items()} for m in mgr.coordinator.single_type_managers],
        [dict(m.num_cached_block) for m in mgr.coordinator.single_type_managers],
    )


def run(mgr, req, num_new_tokens=None):
    """Lookup + allocate the whole prompt (or ``num_new_tokens``) as the scheduler would,
    recording the lookup in the stats when the request is admitted."""
    hits, n = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, num_new_tokens or req.num_tokens - n, n, hits)
    if new is not None:
        mgr.record_prefix_cache_stats(req, n)
        req.num_computed_tokens = n + (num_new_tokens or req.num_tokens - n)
    return hits, n, new


# --- vLLM's prefill scenario -----------------------------------------------------------------
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_prefill_hits_free_order_and_eviction(algo, common_prefix):
    fn = get_hash_fn_by_name(algo)
    mgr = KVCacheManager(num_blocks=11, block_size=16, hash_algo=algo)
    pool = mgr.block_pool

    req0 = Request("0", common_prefix + [3] * 7)
    hits, n = mgr.get_computed_blocks(req0)
    assert hits.get_block_ids() == ([],) and n == 0 and not hits
    new = mgr.allocate_slots(req0, 55, n, hits)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    parent = None
    for i, bid in enumerate([1, 2, 3]):
        parent = hash_block_tokens(fn, parent, [i] * 16)
        blk = pool.blocks[bid]
        assert blk.block_hash == parent and blk.ref_cnt == 1
        assert req0.block_hashes[i] == parent
    assert pool.blocks[4].block_hash is None and pool.blocks[4].ref_cnt == 1
    assert len(req0.block_hashes) == 3

    req1 = Request("1", common_prefix + [4] * 5)
    hits, n = mgr.get_computed_blocks(req1)
    assert hits.get_block_ids() == ([1, 2, 3],) and n == 48
    assert mgr.allocate_slots(req1, 5, n, hits).get_block_ids() == ([5],)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert pool.get_num_free_blocks() == 5 and free_ids(mgr) == [6, 7, 8, 9, 10]
    assert mgr.get_block_ids("0") == ([1, 2, 3, 4],) and mgr.get_block_ids("1") == ([1, 2, 3, 5],)

    mgr.free(req0)
    assert free_ids(mgr) == [4, 6, 7, 8, 9, 10]
    mgr.free(req1)
    assert free_ids(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert pool.get_num_free_blocks() == 10 and mgr.get_block_ids("0") == ([],)
    mgr.check_invariants()

    req2 = Request("2", common_prefix + [5] * 6)
    hits, n = mgr.get_computed_blocks(req2)
    assert hits.get_block_ids() == ([1, 2, 3],) and n == 48
    assert mgr.allocate_slots(req2, 6, n, hits).get_block_ids() == ([5],)
    assert pool.get_num_free_blocks() == 6 and free_ids(mgr) == [4, 6, 7, 8, 9, 10]
    mgr.free(req2)

    req3 = Request("3", [99] * 160)
    hits, n = mgr.get_computed_blocks(req3)
    assert n == 0
    assert mgr.allocate_slots(req3, 160, n, hits).get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    q = pool.free_block_queue
    assert q.num_free_blocks == 0 and free_ids(mgr) == []
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    # the common prefix is gone from the map, replaced by req3's ten blocks
    assert mgr.get_computed_blocks(Request("4", common_prefix + [1]))[1] == 0
    assert len(pool.cached_block_hash_to_block) == 10 and pool.num_evicted_blocks == 3
    mgr.check_invariants()


# --- the num_tokens - 1 cap ----------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, expected_hit", [(25, 16), (32, 16), (16, 0), (33, 32), (17, 16), (1, 0)])
def test_hit_never_covers_the_last_token(num_tokens, expected_hit):
    mgr = KVCacheManager(num_blocks=11, block_size=16)
    prompt = [(7 * i) % 11 for i in range(num_tokens)]
    first = Request("a", prompt)
    run(mgr, first)
    assert mgr.block_pool.cached_block_hash_to_block.__len__() == num_tokens // 16  # all full blocks cached
    hits, n = mgr.get_computed_blocks(Request("b", prompt))
    assert n == expected_hit and len(hits.blocks[0]) == expected_hit // 16
    assert hits.get_block_ids()[0] == mgr.get_block_ids("a")[0][: expected_hit // 16]


# --- decode: a block filled by sampled tokens gets cached ------------------------------------
def test_decode_fills_and_caches_a_block():
    fn = get_hash_fn_by_name("sha256")
    mgr = KVCacheManager(num_blocks=11, block_size=16)
    prompt = list(range(100, 115))  # 15 tokens
    req = Request("d", prompt)
    _, n, new = run(mgr, req)
    assert new.get_block_ids() == ([1],) and req.block_hashes == []
    assert mgr.block_pool.blocks[1].block_hash is None and len(mgr.block_pool.cached_block_hash_to_block) == 0

    req.append_output_token_ids(7)  # the 16th token: block 0 is now full
    want = hash_block_tokens(fn, None, prompt + [7])
    assert req.block_hashes == [want]
    new = mgr.allocate_slots(req, 1)  # room for the new token: still one block
    assert new is not None and new.get_block_ids() == ([],)
    req.num_computed_tokens += 1
    blk = mgr.block_pool.blocks[1]
    assert blk.block_hash == want and mgr.block_pool.get_cached_block(want, [0]) == [blk]

    req.append_output_token_ids(8)
    assert req.block_hashes == [want]  # 17 tokens: the second block is not full
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([2],)
    req.num_computed_tokens += 1
    assert mgr.block_pool.blocks[2].block_hash is None
    # a new request with the decoded block in its prompt hits it
    hits, n = mgr.get_computed_blocks(Request("e", prompt + [7, 8]))
    assert hits.get_block_ids() == ([1],) and n == 16
    mgr.check_invariants()


def test_lookahead_slots_are_allocated_but_never_cached():
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    req = Request("r", list(range(6)))
    hits, n = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, 6, n, hits, num_lookahead_tokens=5)  # 11 slots -> 3 blocks
    assert new.get_block_ids() == ([1, 2, 3],)
    assert [mgr.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, False, False]


def test_chunked_prefill_caches_as_it_goes():
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    req = Request("r", list(range(10)))
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 3, n, hits).get_block_ids() == ([1],)
    req.num_computed_tokens = 3
    assert "r" not in mgr.coordinator.single_type_managers[0].num_cached_block  # nothing full yet (vLLM: no entry)
    assert mgr.allocate_slots(req, 6).get_block_ids() == ([2, 3],)  # 9 tokens -> 3 blocks
    req.num_computed_tokens = 9
    assert mgr.coordinator.single_type_managers[0].num_cached_block["r"] == 2
    assert [mgr.block_pool.blocks[i].block_hash == req.block_hashes[i - 1] for i in (1, 2)] == [True, True]
    assert mgr.block_pool.blocks[3].block_hash is None


# --- a request never evicts its own hits --------------------------------------------------------
def test_own_evictable_hits_count_as_needed():
    mgr = KVCacheManager(num_blocks=5, block_size=16)  # 4 usable blocks
    prompt = list(range(64))
    a = Request("a", prompt)
    run(mgr, a)
    mgr.free(a)
    assert free_ids(mgr) == [4, 3, 2, 1]  # all cached, tail first
    b = Request("b", prompt + [7] * 16)  # 80 tokens: hit 4 blocks, needs a 5th
    hits, n = mgr.get_computed_blocks(b)
    assert hits.get_block_ids() == ([1, 2, 3, 4],) and n == 64
    before = state(mgr)
    # 4 free blocks in the queue, but all four are b's own hits: 1 new + 4 adopted > 4
    assert mgr.allocate_slots(b, 16, n, hits) is None
    assert state(mgr) == before
    mgr.check_invariants()


def test_own_hits_are_adopted_before_new_blocks_are_popped():
    mgr = KVCacheManager(num_blocks=6, block_size=16)  # 5 usable
    pa = list(range(32)) + [500]
    a = Request("a", pa)
    assert run(mgr, a)[2].get_block_ids() == ([1, 2, 3],)
    c = Request("c", list(range(1000, 1032)))
    assert run(mgr, c)[2].get_block_ids() == ([4, 5],)
    mgr.free(a)
    mgr.free(c)
    assert free_ids(mgr) == [3, 2, 1, 5, 4]  # a's partial block first, then a's and c's cached ones
    b = Request("b", list(range(32)) + [600] * 20)  # hits a's blocks 1, 2 which sit near the head
    hits, n = mgr.get_computed_blocks(b)
    assert hits.get_block_ids() == ([1, 2],) and n == 32
    new = mgr.allocate_slots(b, 20, n, hits)
    assert new.get_block_ids() == ([3, 5],)  # not [3, 2]: block 2 is b's own hit
    assert mgr.get_block_ids("b") == ([1, 2, 3, 5],)
    assert free_ids(mgr) == [4] and mgr.block_pool.blocks[5].block_hash is None  # c's block 5 evicted
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 5)] == [1, 1, 1, 1]
    mgr.check_invariants()


def test_failed_allocation_changes_nothing_for_a_running_request():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", list(range(8)))
    run(mgr, a)
    other = Request("o", [50, 51, 52, 53, 54])
    run(mgr, other, 4)  # the last free block
    a.append_output_token_ids(1)
    before = state(mgr)
    assert mgr.allocate_slots(a, 1) is None
    assert state(mgr) == before
    mgr.free(other)
    assert mgr.allocate_slots(a, 1).get_block_ids() == ([3],)


def test_failed_allocation_with_shared_hits_changes_nothing():
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    a = Request("a", list(range(9)))
    run(mgr, a)  # 3 blocks, 2 cached; 1 free left
    b = Request("b", list(range(8)) + [70] * 9)  # hit 2 blocks, needs 3 more
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    before = state(mgr)
    assert mgr.allocate_slots(b, 9, n, hits) is None
    assert state(mgr) == before
    assert mgr.allocate_slots(b, 1, n, hits).get_block_ids() == ([4],)  # a smaller chunk fits
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]


# --- identity: salt, LoRA, multimodal -----------------------------------------------------------
def test_cache_salt_isolates_tenants():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(40))
    run(mgr, Request("a", prompt, cache_salt="tenant-a"))
    assert mgr.get_computed_blocks(Request("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert mgr.get_computed_blocks(Request("c", prompt))[1] == 0
    hits, n = mgr.get_computed_blocks(Request("d", prompt, cache_salt="tenant-a"))
    assert n == 32 and hits.get_block_ids() == ([1, 2],)


def test_lora_name_is_part_of_every_block():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(40))
    run(mgr, Request("a", prompt, lora_name="sql"))
    assert mgr.get_computed_blocks(Request("b", prompt))[1] == 0
    assert mgr.get_computed_blocks(Request("c", prompt, lora_name="chat"))[1] == 0
    assert mgr.get_computed_blocks(Request("d", prompt, lora_name="sql"))[1] == 32


def test_images_with_identical_placeholders_do_not_share_blocks():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(16)) + [9] * 32 + [1]  # placeholders at [20, 30): block 1 only
    run(mgr, Request("a", prompt, mm_features=[MultiModalFeature("img-a", 20, 10)]))
    hits, n = mgr.get_computed_blocks(Request("b", prompt, mm_features=[MultiModalFeature("img-b", 20, 10)]))
    assert n == 16 and hits.get_block_ids() == ([1],)  # the text before the image is shared
    hits, n = mgr.get_computed_blocks(Request("c", prompt, mm_features=[MultiModalFeature("img-a", 20, 10)]))
    assert n == 48 and hits.get_block_ids() == ([1, 2, 3],)
    # same image, other position inside otherwise identical blocks: no hit from block 1 on
    assert mgr.get_computed_blocks(Request("d", prompt, mm_features=[MultiModalFeature("img-a", 21, 9)]))[1] == 16


# --- duplicates ---------------------------------------------------------------------------------
def test_duplicate_blocks_with_one_hash_coexist():
    mgr = KVCacheManager(num_blocks=11, block_size=16)
    pool = mgr.block_pool
    prompt = list(range(32)) + [5]
    a, b = Request("a", prompt), Request("b", prompt)
    ha, na = mgr.get_computed_blocks(a)
    hb, nb = mgr.get_computed_blocks(b)  # both look up before either is computed
    assert na == nb == 0
    assert mgr.allocate_slots(a, 33, na, ha).get_block_ids() == ([1, 2, 3],)
    assert mgr.allocate_slots(b, 33, nb, hb).get_block_ids() == ([4, 5, 6],)
    key0 = a.block_hashes[0] + b"\x00\x00\x00\x00"
    assert [x.block_id for x in pool.cached_block_hash_to_block.blocks_for(key0)] == [1, 4]
    assert len(pool.cached_block_hash_to_block) == 2  # two keys, four blocks
    assert pool.blocks[4].block_hash == pool.blocks[1].block_hash == a.block_hashes[0]
    assert mgr.get_computed_blocks(Request("x", prompt))[0].get_block_ids() == ([1, 2],)
    mgr.check_invariants()

    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr) == [6, 3, 7, 8, 9, 10, 2, 1, 5, 4]
    c = Request("c", [77] * 128)
    assert run(mgr, c)[2].get_block_ids() == ([6, 3, 7, 8, 9, 10, 2, 1],)  # evicts a's copies
    assert [x.block_id for x in pool.cached_block_hash_to_block.blocks_for(key0)] == [4]
    hits, n = mgr.get_computed_blocks(Request("y", prompt))
    assert hits.get_block_ids() == ([4, 5],) and n == 32  # b's copies are still reachable
    mgr.check_invariants()


# --- reset -----------------------------------------------------------------------------------
def test_reset_prefix_cache():
    mgr = KVCacheManager(num_blocks=11, block_size=16)
    prompt = list(range(40))
    a = Request("a", prompt)
    run(mgr, a)
    mgr.make_prefix_cache_stats()
    before = state(mgr)
    assert mgr.reset_prefix_cache() is False
    assert state(mgr) == before and mgr.make_prefix_cache_stats().reset is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert run(mgr, Request("b", prompt))[1] == 0
    stats = mgr.make_prefix_cache_stats()
    assert stats.reset is True and stats.queries == 40 and stats.hits == 0
    assert mgr.make_prefix_cache_stats().reset is False
    mgr.check_invariants()


# --- stats and usage -------------------------------------------------------------------------
def test_usage():
    mgr = KVCacheManager(num_blocks=11, block_size=16)
    assert mgr.usage == 0.0
    run(mgr, Request("a", [1] * 16))
    assert mgr.usage == pytest.approx(0.1)
    run(mgr, Request("b", [2] * 17))  # 17 tokens = 2 blocks: usage counts blocks
    assert mgr.usage == pytest.approx(0.3)


def test_prefix_cache_stats_count_tokens_and_split_preempted():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(40))
    a = Request("a", prompt)
    run(mgr, a)  # 40 queried, 0 hit
    b = Request("b", prompt)
    mgr.get_computed_blocks(b)  # a lookup alone records nothing (vLLM: only at admission)
    assert mgr.prefix_cache_stats.requests == 1
    mgr.record_prefix_cache_stats(b, mgr.get_computed_blocks(b)[1])  # 40 queried, 32 hit
    p = Request("p", prompt + [1] * 8)
    p.num_preemptions = 1
    mgr.record_prefix_cache_stats(p, mgr.get_computed_blocks(p)[1])  # preempted: 48 queried, 32 hit
    s = mgr.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (2, 80, 32)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 48, 32)
    assert s.hit_rate == pytest.approx(0.4) and s.reset is False
    s2 = mgr.make_prefix_cache_stats()  # counting starts afresh
    assert (s2.requests, s2.queries, s2.hits, s2.preempted_requests) == (0, 0, 0, 0) and s2.hit_rate == 0.0
    assert KVCacheManager(num_blocks=4, log_stats=False).make_prefix_cache_stats() is None


def test_caching_metrics_rolling_window():
    m = CachingMetrics(max_recent_requests=5)
    assert m.hit_rate == 0.0 and m.empty
    m.observe(PrefixCacheStats(requests=1, queries=20, hits=9))
    assert m.hit_rate == pytest.approx(0.45)
    m.observe(PrefixCacheStats(requests=4, queries=80, hits=16))
    assert m.hit_rate == pytest.approx(0.25) and m.aggregated_requests == 5
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=2))  # 6 > 5: the oldest observation goes
    assert (m.aggregated_requests, m.aggregated_query_total, m.aggregated_query_hit) == (5, 90, 18)
    assert m.hit_rate == pytest.approx(0.2)
    m.observe(PrefixCacheStats())  # no requests: not recorded (would push useful data out)
    assert len(m.query_queue) == 2
    m.observe(PrefixCacheStats(requests=4, queries=40, hits=40))  # 9 > 5: drop until <= 5
    assert (m.aggregated_requests, m.aggregated_query_total, m.aggregated_query_hit) == (5, 50, 42)
    m.observe(PrefixCacheStats(requests=9, queries=90, hits=0))  # the newest is kept even if > max
    assert list(m.query_queue) == [(9, 90, 0)] and m.aggregated_requests == 9
    m.observe(PrefixCacheStats(reset=True, requests=1, queries=10, hits=5))  # reset first, then add
    assert list(m.query_queue) == [(1, 10, 5)] and m.hit_rate == 0.5
    m.reset()
    assert m.empty and not m.query_queue and m.hit_rate == 0.0
    assert (m.aggregated_query_total, m.aggregated_query_hit) == (0, 0)


def test_caching_metrics_window_never_exceeds_max_when_it_can_shrink():
    m = CachingMetrics(max_recent_requests=5)
    m.observe(PrefixCacheStats(requests=3, queries=30, hits=3))
    m.observe(PrefixCacheStats(requests=3, queries=30, hits=30))
    assert m.aggregated_requests == 3 and m.hit_rate == 1.0


# --- misc API ------------------------------------------------------------------------------------
def test_caching_disabled_never_hits():
    mgr = KVCacheManager(num_blocks=11, block_size=16, enable_caching=False)
    prompt = list(range(40))
    a = Request("a", prompt)
    run(mgr, a)
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert mgr.get_computed_blocks(Request("b", prompt))[1] == 0
    mgr.free(a)
    assert free_ids(mgr) == [3, 2, 1, 4, 5, 6, 7, 8, 9, 10]


def test_free_twice_and_unknown_is_harmless():
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    a = Request("a", [1, 2, 3])
    run(mgr, a)
    mgr.free(a)
    mgr.free(a)
    mgr.free(Request("never", [1]))
    assert mgr.block_pool.get_num_free_blocks() == 4
    mgr.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_num_common_prefix_blocks_is_zero_as_in_vllm(caching):
    # vLLM 0.33 removed cascade attention: every group reports 0, full attention included,
    # although a and b share two blocks here.
    groups = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=4)]
    mgr = KVCacheManager(num_blocks=20, block_size=4, kv_cache_groups=groups, enable_caching=caching)
    a, b = Request("a", list(range(10))), Request("b", list(range(8)) + [9, 9, 9])
    run(mgr, a)
    run(mgr, b)
    if caching:
        assert mgr.get_block_ids("b")[0][:2] == mgr.get_block_ids("a")[0][:2]
    assert mgr.get_num_common_prefix_blocks("a") == [0, 0]
    assert mgr.get_num_common_prefix_blocks("a", 2) == [0, 0]


def test_preempt_and_resume_hits_own_blocks():
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    r = Request("r", list(range(10)))
    run(mgr, r)
    r.append_output_token_ids([3, 4])  # 12 tokens: block 2 full, hash known
    mgr.allocate_slots(r, 1)
    r.num_computed_tokens = 11
    mgr.free(r)  # preempted: recompute from scratch
    r.num_computed_tokens, r.num_preemptions = 0, 1
    hits, n = mgr.get_computed_blocks(r)
    assert hits.get_block_ids() == ([1, 2],) and n == 8  # block 3 was only 3/4 computed
    mgr.record_prefix_cache_stats(r, n)
    assert mgr.make_prefix_cache_stats().preempted_hits == 8


def test_the_one_group_coordinators_direct_calls_equal_the_general_loops(monkeypatch) -> None:
    """UnitaryKVCacheCoordinator answers each question straight from its one manager (a fast
    path: the general class loops over groups). The same run through both -- prefix hits,
    chunked prefill, preemption -- must log the very same events, block ids included."""
    from kvlab.core.kv_cache_coordinator import KVCacheCoordinator, UnitaryKVCacheCoordinator
    from kvlab.engine.llm_engine import build_engine

    def run() -> list[dict]:
        eng = build_engine(num_blocks=12, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)
        assert type(eng.kv_cache_manager.coordinator) is UnitaryKVCacheCoordinator
        shared = list(range(100, 112))
        eng.generate([shared + [i, i + 1, i + 2] for i in range(6)] + [list(range(40, 60))], max_tokens=12)
        return [{k: v for k, v in e.to_dict().items() if k != "arrival_time"} for e in eng.events]  # (the wall clock's)

    fast = run()
    # Every method the one-group class overrides (its own hit search and set-up aside, which
    # the base class does not have in general form) goes back to the base class's loop.
    fast_paths = sorted(
        n
        for n, f in vars(UnitaryKVCacheCoordinator).items()
        if callable(f) and n in vars(KVCacheCoordinator) and n not in ("__init__", "find_longest_cache_hit")
    )
    assert fast_paths == [
        "allocate_new_blocks",
        "allocate_new_computed_blocks",
        "cache_blocks",
        "get_blocks",
        "get_num_blocks_to_allocate",
        "remove_skipped_blocks",
    ]
    for name in fast_paths:
        monkeypatch.setattr(UnitaryKVCacheCoordinator, name, getattr(KVCacheCoordinator, name))
    general = run()
    kinds = {e["kind"] for e in fast}
    assert {"prefix_lookup", "blocks_touched", "request_preempted", "block_evicted"} <= kinds, sorted(kinds)
    assert sum(e["kind"] == "request_preempted" for e in fast) == 4
    assert fast == general


def test_a_request_that_wants_its_prompt_logprobs_reads_nothing_from_the_cache():
    """vLLM 0.33: ``prompt_logprobs`` set makes ``skip_reading_prefix_cache`` default to True --
    no hit, no counted query -- yet the request's blocks are cached for the others. Checked
    against vLLM 0.33.0's KVCacheManager (blocks of 4, 13-token prompts): hits 0, 0, 12, 12;
    3 counted requests; the same block ids and KV events."""
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.request import Request

    mgr = KVCacheManager(num_blocks=16, block_size=4, enable_kv_cache_events=True, log_stats=True)
    hits = []
    for rid, kw in (("a", {}), ("b", {"prompt_logprobs": 1}), ("c", {"prompt_logprobs": 0, "skip_reading_prefix_cache": False}), ("d", {})):
        r = Request(rid, list(range(13)), **kw)
        assert r.skip_reading_prefix_cache is (rid == "b") and mgr.prefix_cache_lookup_enabled(r) is (rid != "b")
        blocks, n = mgr.get_computed_blocks(r)
        mgr.record_prefix_cache_stats(r, n)
        mgr.allocate_slots(r, 13 - n, n, blocks)
        hits.append((n, mgr.get_block_ids(rid)[0]))
    assert hits == [(0, [1, 2, 3, 4]), (0, [5, 6, 7, 8]), (12, [1, 2, 3, 9]), (12, [1, 2, 3, 10])]
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (3, 39, 24)
    with pytest.raises(TypeError, match="skip_reading_prefix_cache must be None, True or False, got 1"):
        Request("x", [1, 2], skip_reading_prefix_cache=1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        Request("x", [1, 2], prompt_logprobs=-2)
