"""BlockPool, its free queue (the eviction order) and its hash -> block map."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlab import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, Request
from kvlab.core.block_pool import BlockHashToBlockMap, group_suffix
from kvlab.core.pool_observers import BlockPoolObserver
from kvlab.eventlog.events import EventLog
from kvlab.core.transaction import checkpoint_pool, release_pool, restore_pool


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_ids(q: FreeKVCacheBlockQueue):
    return ids(q.get_all_free_blocks())


def check_links(q: FreeKVCacheBlockQueue):
    """Walk both directions: the forward order reversed must equal the backward order."""
    fwd, cur = [], q.fake_free_list_head.next_free_block
    while cur is not q.fake_free_list_tail:
        fwd.append(cur.block_id)
        cur = cur.next_free_block
    back, cur = [], q.fake_free_list_tail.prev_free_block
    while cur is not q.fake_free_list_head:
        back.append(cur.block_id)
        cur = cur.prev_free_block
    assert fwd == back[::-1] and len(fwd) == q.num_free_blocks
    return fwd


# --- FreeKVCacheBlockQueue ---------------------------------------------------------------------
def make_queue(n=6):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_queue_starts_in_block_order_with_sentinels():
    blocks, q = make_queue()
    assert check_links(q) == [0, 1, 2, 3, 4, 5]
    assert q.fake_free_list_head.block_id == q.fake_free_list_tail.block_id == -1
    assert q.fake_free_list_head.prev_free_block is None and q.fake_free_list_tail.next_free_block is None


def test_popleft_and_popleft_n():
    blocks, q = make_queue()
    b = q.popleft()
    assert b is blocks[0] and b.prev_free_block is None and b.next_free_block is None
    assert q.popleft_n(0) == [] and check_links(q) == [1, 2, 3, 4, 5]
    got = q.popleft_n(3)
    assert ids(got) == [1, 2, 3] and all(x.prev_free_block is None and x.next_free_block is None for x in got)
    assert check_links(q) == [4, 5] and q.num_free_blocks == 2
    with pytest.raises(ValueError, match="only 2"):
        q.popleft_n(3)
    assert check_links(q) == [4, 5]
    assert ids(q.popleft_n(2)) == [4, 5]
    assert check_links(q) == [] and q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    with pytest.raises(ValueError, match="^No free blocks available$"):
        q.popleft()
    assert q.num_free_blocks == 0


# vLLM 0.33's error paths of the queue, its words and its exception types (each checked against
# vLLM 0.33.0's FreeKVCacheBlockQueue); the queue is left as it was.
def test_popleft_on_a_queue_whose_count_disagrees_with_its_links_is_an_assertion():
    _, q = make_queue(2)
    q.popleft_n(2)
    q.num_free_blocks = 3  # corrupted by hand
    with pytest.raises(AssertionError, match=r"^num_free_blocks \(3\) is out of sync with the free list\.$"):
        q.popleft()
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail


@pytest.mark.parametrize("journaled", [False, True])
def test_popleft_of_a_block_linked_in_without_a_successor_is_a_runtime_error(journaled):
    blocks, q = make_queue(3)
    if journaled:  # inside a transaction the refused call journals nothing either
        from kvlab.core.transaction import JournaledFreeKVCacheBlockQueue

        q.__class__, q.journal = JournaledFreeKVCacheBlockQueue, []
    stray = KVCacheBlock(9)
    q.fake_free_list_head.next_free_block = stray  # a bug in the caller: a block with no next link
    with pytest.raises(RuntimeError, match=r"^Invalid block found in popleft\(\) which doesn't have a valid next_free_block$"):
        q.popleft()
    assert q.fake_free_list_head.next_free_block is stray and q.num_free_blocks == 3
    assert not journaled or q.journal == []


@pytest.mark.parametrize("journaled", [False, True])
def test_append_n_on_a_broken_tail_is_an_assertion_and_changes_nothing(journaled):
    blocks, q = make_queue(3)
    pool_free = q.popleft_n(1)
    if journaled:  # inside a transaction the refused call journals nothing either
        from kvlab.core.transaction import JournaledFreeKVCacheBlockQueue

        q.__class__, q.journal = JournaledFreeKVCacheBlockQueue, []
    q.fake_free_list_tail.prev_free_block = None  # broken by hand
    with pytest.raises(AssertionError, match="^prev_free_block of fake_free_list_tail should always exist$"):
        q.append_n(pool_free)
    assert pool_free[0].prev_free_block is None and pool_free[0].next_free_block is None and q.num_free_blocks == 2
    assert not journaled or q.journal == []


def test_remove_from_the_middle_and_the_ends():
    blocks, q = make_queue()
    q.remove(blocks[3])
    q.remove(blocks[0])
    q.remove(blocks[5])
    assert check_links(q) == [1, 2, 4]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    with pytest.raises(RuntimeError, match="block 3"):
        q.remove(blocks[3])  # not in the queue any more
    assert check_links(q) == [1, 2, 4]


def test_append_append_n_prepend_n():
    blocks, q = make_queue()
    taken = q.popleft_n(6)
    q.append(taken[2])
    q.append_n([taken[4], taken[0]])
    q.prepend_n([taken[5], taken[1]])  # blocks[0] of the argument is popped first
    assert check_links(q) == [5, 1, 2, 4, 0]
    q.append_n([])
    q.prepend_n([])
    assert check_links(q) == [5, 1, 2, 4, 0]
    q.prepend_n([taken[3]])
    assert check_links(q) == [3, 5, 1, 2, 4, 0] and q.popleft() is taken[3]


def test_prepend_and_append_into_an_empty_queue():
    blocks, q = make_queue(3)
    taken = q.popleft_n(3)
    q.prepend_n([taken[1], taken[2]])
    assert check_links(q) == [1, 2]
    q.popleft_n(2)
    q.append_n([taken[2], taken[0]])
    assert check_links(q) == [2, 0]


# --- BlockHashToBlockMap -----------------------------------------------------------------------
def test_hash_map_keeps_duplicates_and_pops_by_block_id():
    m = BlockHashToBlockMap()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    assert m.get_one_block(b"k") is None and m.pop(b"k", 1) is None
    m.insert(b"k", a)
    assert m.get_one_block(b"k") is a and len(m) == 1 and b"k" in m
    assert m.pop(b"k", 2) is None and m.get_one_block(b"k") is a  # wrong id: untouched
    m.insert(b"k", b)
    m.insert(b"k", c)
    assert len(m) == 1 and ids(m.blocks_for(b"k")) == [1, 2, 3]
    assert m.get_one_block(b"k") is a  # the first one inserted
    assert m.pop(b"k", 1) is a and m.get_one_block(b"k") is b
    assert m.pop(b"k", 9) is None and ids(m.blocks_for(b"k")) == [2, 3]
    assert m.pop(b"k", 3) is c and m.blocks_for(b"k") == [b]
    assert m.pop(b"k", 2) is b and len(m) == 0 and b"k" not in m and m.get_one_block(b"k") is None


def test_a_key_that_became_a_dict_stays_one_until_its_last_block_leaves():
    """vLLM 0.33's map (``test_maybe_evict_cached_block``): a key's second block turns its
    entry into ``{block_id: block}``; blocks leaving it do not turn it back into a bare block,
    the key goes with its last one. A key that only ever had one block stays bare."""
    m = BlockHashToBlockMap()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    m.insert(b"k", a)
    m.insert(b"j", c)
    assert m._cache == {b"k": a, b"j": c}
    m.insert(b"k", b)
    assert m._cache == {b"k": {1: a, 2: b}, b"j": c}
    assert m.pop(b"k", 1) is a
    assert m._cache == {b"k": {2: b}, b"j": c}
    assert m.pop(b"k", 7) is None and m._cache == {b"k": {2: b}, b"j": c}  # not there: unchanged
    assert m.get_one_block(b"k") is b and m.blocks_for(b"k") == [b]
    m.insert(b"k", a)  # into the one-block dict: appended, oldest first
    assert m._cache == {b"k": {2: b, 1: a}, b"j": c}
    assert m.pop(b"k", 2) is b and m.pop(b"k", 1) is a
    assert m._cache == {b"j": c}
    assert m.pop(b"j", 3) is c and m._cache == {}


# --- BlockPool ---------------------------------------------------------------------------------
class _Req:
    """The two attributes cache_full_blocks reads, for hashes chosen by the test."""

    def __init__(self, rid, hashes, tokens):
        self.request_id, self.block_hashes, self.all_token_ids = rid, hashes, tokens
        self.lora_name, self.mm_features, self.cache_salt = None, [], None


def test_fresh_pool_null_block_and_first_ids():
    pool = BlockPool(11)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert [b.is_null for b in pool.blocks].count(True) == 1
    assert pool.get_num_free_blocks() == 10 and pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3] and [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_usage() == pytest.approx(0.3)
    pool.check_invariants()


def test_usage_excludes_the_null_block():
    pool = BlockPool(11)
    pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.1)
    pool.get_new_blocks(9)
    assert pool.get_usage() == 1.0
    assert BlockPool(2).get_usage() == 0.0


def test_get_new_blocks_beyond_the_free_count_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="3 free"):
        pool.get_new_blocks(4)
    assert queue_ids(pool.free_block_queue) == [1, 2, 3] and all(b.ref_cnt == 0 for b in pool.blocks)


def test_cache_free_evict_cycle():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    hashes = [b"h0" * 16, b"h1" * 16, b"h2" * 16]
    req = _Req("r", hashes, list(range(48)))
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 0)  # only the first two are full
    assert [b.block_hash for b in blocks] == [hashes[0], hashes[1], None]
    assert blocks[0].cache_key == hashes[0] + group_suffix(0) == hashes[0] + b"\x00\x00\x00\x00"
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]] and pool.get_cached_block(hashes[1], [1]) is None
    pool.cache_full_blocks(req, blocks, 2, 2, 16, 0)  # nothing new: no-op
    with pytest.raises(RuntimeError, match="already cached"):
        pool.cache_full_blocks(req, blocks, 1, 2, 16, 0)
    with pytest.raises(RuntimeError, match="has 3 block hashes, needs 4"):
        pool.cache_full_blocks(req, blocks + pool.get_new_blocks(1), 3, 4, 16, 0)

    # free tail first: uncached ones go to the head, cached ones to the tail (kept longest)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool.free_block_queue) == [3, 5, 2, 1]
    assert blocks[0].block_hash == hashes[0]  # freed blocks keep their hash (lazy eviction)
    pool.check_invariants()

    # a hit pulls a free block back out of the middle of the queue
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and queue_ids(pool.free_block_queue) == [3, 5, 1]

    # allocation pops the head; only a cached block costs a map entry
    got = pool.get_new_blocks(3)
    assert ids(got) == [3, 5, 1] and pool.num_evicted_blocks == 1
    assert blocks[0].block_hash is None and pool.get_cached_block(hashes[0], [0]) is None
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]]  # the touched one survives
    pool.check_invariants()


def test_block_mask_leaves_out_blocks_that_can_never_serve_a_hit():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    hashes = [b"h0" * 16, b"h1" * 16, b"h2" * 16]
    req = _Req("r", hashes, list(range(48)))
    with pytest.raises(ValueError, match="block_mask has 2 entries for 3 blocks"):
        pool.cache_full_blocks(req, blocks, 0, 3, 16, 0, block_mask=[True, False])
    assert [b.block_hash for b in blocks] == [None, None, None] and len(pool.cached_block_hash_to_block) == 0
    pool.cache_full_blocks(req, blocks, 0, 3, 16, 0, block_mask=[False, True, True])
    assert [b.block_hash for b in blocks] == [None, hashes[1], hashes[2]]
    assert pool.get_cached_block(hashes[0], [0]) is None and pool.get_cached_block(hashes[2], [0]) == [blocks[2]]
    pool.check_invariants()


def test_touch_shared_block_and_free_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    pool.touch(a)  # second owner
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [1, 1] and queue_ids(pool.free_block_queue) == [3, 4]
    pool.free_blocks(reversed(a))
    assert queue_ids(pool.free_block_queue) == [2, 1, 3, 4]  # uncached: prepended, tail block first
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a[0]])
    # All or nothing: a list that frees one block too often frees none of them.
    b = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match=f"block {b[0].block_id} freed more often"):
        pool.free_blocks([b[0], b[0]])
    assert b[0].ref_cnt == 1 and queue_ids(pool.free_block_queue) == [1, 3, 4]
    pool.check_invariants()


def test_null_block_is_never_queued_or_counted():
    pool = BlockPool(4)
    b = pool.get_new_blocks(1)
    pool.touch([pool.null_block, b[0]])
    assert pool.null_block.ref_cnt == 0 and b[0].ref_cnt == 2
    pool.free_blocks([pool.null_block, b[0], b[0]])
    assert queue_ids(pool.free_block_queue) == [1, 2, 3] and pool.null_block.ref_cnt == 0
    pool.check_invariants()


def test_caching_disabled_all_freed_blocks_reused_first():
    pool = BlockPool(6, enable_caching=False)
    got = pool.get_new_blocks(3)
    pool.free_blocks(reversed(got))
    assert queue_ids(pool.free_block_queue) == [3, 2, 1, 4, 5]


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(_Req("r", [b"x" * 32, b"y" * 32], list(range(8))), blocks, 0, 2, 4, 0)
    assert pool.reset_prefix_cache() is False
    assert blocks[0].block_hash == b"x" * 32 and len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0 and all(b.block_hash is None for b in pool.blocks)
    assert queue_ids(pool.free_block_queue) == [3, 4, 2, 1]  # the queue itself is untouched
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(5)
    got = pool.get_new_blocks(2)
    got[0].ref_cnt = 0  # "used" but unreferenced
    with pytest.raises(AssertionError, match="block 1"):
        pool.check_invariants()
    got[0].ref_cnt = 1
    pool.check_invariants()
    got[1].cache_key = b"z" * 36  # a hash without a map entry
    with pytest.raises(AssertionError, match="block 2"):
        pool.check_invariants()
    got[1].cache_key = None
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="counts"):
        pool.check_invariants()


def test_pool_caches_a_real_requests_hashes_with_events_off():
    req = Request("r", list(range(40)))
    from kvlab import KVCacheManager

    mgr = KVCacheManager(num_blocks=5, block_size=16)
    mgr.get_computed_blocks(req)
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 16, 3)
    assert pool.get_cached_block(req.block_hashes[0], [3]) == [blocks[0]]
    assert blocks[1].cache_key == req.block_hashes[1] + (3).to_bytes(4, "big")


def test_bench_core_runs_and_reports_ratios(capsys):
    from kvlab.bench import core

    assert core.main(["--repeats", "1", "--pool-blocks", "300"]) == 0
    out = capsys.readouterr().out
    for label in ("floor:", "cycle:", "hash: sha256 ", "raw sha256", "pickle+sha256", "get_new_blocks(64)"):
        assert label in out
    assert out.count("floor units") >= 10 and "target <= 25" in out and "target <= 1.5x" in out
    with pytest.raises(SystemExit):
        core.main(["--pool-blocks", "10"])


class _CacheReq:
    """What cache_full_blocks reads of a request."""

    def __init__(self, rid: str, hashes: list[bytes]) -> None:
        self.request_id, self.block_hashes, self.all_token_ids = rid, hashes, list(range(4 * len(hashes)))


class _LearnersMap(BlockHashToBlockMap):
    """A learner's map: it stores the way kvlab's does but journals nothing."""

    __slots__ = ()

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        self._cache[key] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        return self._cache.pop(key, None)


class _LearnersEviction(BlockPool):
    """A learner's eviction: it writes straight into the map's storage (no journal)."""

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.cache_key
        if key is None:
            return False
        self.cached_block_hash_to_block._cache.pop(key, None)
        block.cache_key = None
        return True


def _entries(pool: BlockPool) -> dict[bytes, list[int]]:
    """Each key's blocks in the map's order (it matters: a lookup returns the first)."""
    return {k: [b.block_id for b in blks] for k, blks in pool.cached_block_hash_to_block.items()}


@pytest.mark.parametrize(
    ("pool_cls", "map_cls"),
    [(BlockPool, BlockHashToBlockMap), (BlockPool, _LearnersMap), (_LearnersEviction, BlockHashToBlockMap)],
    ids=["kvlab's map", "a learner's map", "a learner's eviction"],
)
def test_restore_brings_back_the_map_whoever_wrote_it(pool_cls: type, map_cls: type) -> None:
    """A pool checkpoint undoes caching and eviction: kvlab's map journals its own changes; a
    map of another class, or a map that another class's eviction changes, is saved by value
    (a learner's code may change the entries any way it likes)."""
    pool = pool_cls(6)
    pool.cached_block_hash_to_block = map_cls()
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(_CacheReq("a", [b"h0", b"h1"]), a, 0, 2, 4, 0)
    pool.free_blocks(reversed(a))
    before, free_before = _entries(pool), [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    cp = checkpoint_pool(pool)
    b = pool.get_new_blocks(5)  # every free block: the two cached ones are evicted
    pool.cache_full_blocks(_CacheReq("b", [b"x0", b"x1", b"x2"]), b, 0, 3, 4, 0)
    assert _entries(pool) != before
    restore_pool(pool, cp, tables=[])
    release_pool(pool, cp)
    assert _entries(pool) == before == {b"h0" + group_suffix(0): [a[0].block_id], b"h1" + group_suffix(0): [a[1].block_id]}
    assert [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()] == free_before
    pool.check_invariants()


def _pool_state(pool: BlockPool) -> tuple:
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        pool.free_block_queue.num_free_blocks,
        _entries(pool),
        [(b.ref_cnt, b.cache_key, b.block_hash_num_tokens) for b in pool.blocks],
        pool.num_evicted_blocks,
        {bid: list(keys) for bid, keys in pool.cached_block_hashes_by_block.items()},
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("get touch free cache partial reset".split()), st.integers(0, 7)), max_size=25))
def test_a_checkpoint_undoes_any_mix_of_pool_operations(ops: list[tuple[str, int]]) -> None:
    """Whatever the pool did since a checkpoint (pops, touches of free cached blocks, frees to
    either end, caching, partial entries and their replacement by a full key, evictions, a
    reset), restoring it gives back the very same queue order, map, ref counts, hashes and
    partial entries; and kvlab's taught classes run again afterwards (the journaled
    subclasses exist only while the checkpoint is open)."""
    pool = BlockPool(8, hash_block_size=4)
    warm = pool.get_new_blocks(4)
    pool.cache_full_blocks(_CacheReq("w", [b"w0", b"w1", b"w2"]), warm, 0, 3, 4, 0)
    pool.free_blocks(list(reversed(warm)))
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(_CacheReq("h", [b"h0", b"h1"]), held, 0, 1, 8, 0)  # a key of its own, and one partial entry
    pool.cache_partial_block(_CacheReq("h", [b"h0", b"h1"]), held[0], 4, 0, 8)
    assert pool.cached_block_hashes_by_block == {held[0].block_id: [b"h0" + group_suffix(0)]}
    tables = [list(held)]
    before = _pool_state(pool)
    cp = checkpoint_pool(pool)
    assert type(pool.free_block_queue).__name__ == "JournaledFreeKVCacheBlockQueue"
    mine: list[KVCacheBlock] = []
    for op, n in ops:
        free = pool.get_num_free_blocks()
        if op == "get" and free:
            mine += pool.get_new_blocks(1 + n % free)
        elif op == "touch":
            cached = [b for b in pool.free_block_queue.get_all_free_blocks() if b.cache_key is not None][:1]
            pool.touch(cached)
            mine += cached
        elif op == "free" and mine:
            k = 1 + n % len(mine)
            pool.free_blocks(mine[-k:])
            del mine[-k:]
        elif op == "cache" and mine and (mine[-1].block_hash_num_tokens or 0) < 8:
            pool.cache_full_blocks(_CacheReq(f"c{n}", [bytes([n]), bytes([n + 50])]), mine[-1:], 0, 1, 8, 0)
        elif op == "partial" and mine:  # a boundary inside a block of 8: its own key, or one more
            pool.cache_partial_block(_CacheReq(f"p{n}", [bytes([100 + n % 3]), bytes([110 + n % 3])]), mine[-1], 4 * (1 + n % 2), 0, 8)
        elif op == "reset" and not mine:
            pool.free_blocks(held)
            pool.reset_prefix_cache()
            held = pool.get_new_blocks(1)
            mine.clear()
    restore_pool(pool, cp, tables)
    release_pool(pool, cp)
    assert _pool_state(pool) == before
    assert type(pool.free_block_queue) is FreeKVCacheBlockQueue
    assert type(pool.cached_block_hash_to_block) is BlockHashToBlockMap
    assert not hasattr(pool.free_block_queue, "journal") and not hasattr(pool.cached_block_hash_to_block, "journal")
    pool.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["insert", "pop", "pop"]), st.sampled_from([0, 0, 1, 2]), st.integers(1, 9)), max_size=24),
    st.integers(1, 30),
    st.booleans(),
)
@example([("pop", 0, 1), ("pop", 0, 3)], 30, False)  # two leave; the older sat before the newer's place
@example([("pop", 1, 6), ("pop", 1, 7), ("pop", 2, 9), ("insert", 2, 8)], 30, False)  # keys emptied, one refilled
def test_a_checkpoint_puts_duplicated_keys_back_in_order_even_when_its_restore_is_interrupted(
    ops: list[tuple[str, int, int]], stop_at: int, after: bool
) -> None:
    """A key several blocks carry keeps them in a dict whose order decides which block a
    lookup returns. Inside a checkpoint, blocks join and leave such keys (journaled as the
    id that came, or the block that went and its place: no copy of the dict); a restore
    gives back every key with its blocks in the same order -- also when an interrupt stops
    the restore at its ``stop_at``-th undo step (before or ``after`` it is applied) and the
    restore is called again (or, when it was not stopped, called a second time)."""
    pool = BlockPool(12)
    m = pool.cached_block_hash_to_block
    keys = [bytes([k]) * 4 for k in range(3)]
    for bid in (1, 2, 3, 4, 5, 6, 7):  # key 0 held by five blocks, key 1 by two
        m.insert(keys[0] if bid <= 5 else keys[1], pool.blocks[bid])
    m.insert(keys[2], pool.blocks[8])
    m.insert(keys[2], pool.blocks[9])
    m.pop(keys[2], 8)  # key 2: a dict of one block (9)
    before = _stored(m)
    cp = checkpoint_pool(pool)
    for op, k, bid in ops:
        if op == "insert":
            if all(b.block_id != bid for key in keys for b in m.blocks_for(key)):
                m.insert(keys[k], pool.blocks[bid])
        else:
            m.pop(keys[k], bid)
    copies = [e[3] for e in cp.journal if len(e) > 3 and type(e[3]) is dict]
    assert all(len(c) <= 2 for c in copies), "a key of three or more blocks is journaled without a copy of its dict"
    seen = {"n": 0}

    def stoppable(fn):
        def step(*args):
            seen["n"] += 1
            if seen["n"] == stop_at and not after:
                raise KeyboardInterrupt
            fn(*args)
            if seen["n"] == stop_at and after:
                raise KeyboardInterrupt

        return step

    cp.journal[:] = [(stoppable(e[0]), *e[1:]) for e in cp.journal]
    try:
        restore_pool(pool, cp, [])
    except KeyboardInterrupt:
        pass
    restore_pool(pool, cp, [])
    release_pool(pool, cp)
    assert _stored(m) == before


def _stored(m: BlockHashToBlockMap) -> dict[bytes, Any]:
    """The map's storage as it is: a bare block's id, or a dict's ids in order (a key that
    became a dict stays one, so the form is part of what a restore must give back)."""
    return {k: list(v) if type(v) is dict else v.block_id for k, v in m._cache.items()}


class _EventReq(_CacheReq):
    """A request with what the events read besides hashes and tokens (no adapter, image, salt)."""

    mm_features: list = []
    lora_name = lora_path = cache_salt = prompt_embeds = None


class _Recorder(BlockPoolObserver):
    """Writes down every report, in the pool's words."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_blocks_allocated(self, pool, blocks, dropped, request_id, group):
        self.calls.append(("allocated", ids(blocks), [(b.block_id, key[:2]) for b, key in dropped], request_id))

    def on_cache_entries_dropped(self, pool, dropped):
        self.calls.append(("dropped", [(b.block_id, key[:2]) for b, key in dropped]))

    def on_blocks_cached(self, pool, request, blocks, hashes, num_cached_blocks, num_full_blocks, block_size, group, block_mask):
        self.calls.append(("cached", request.request_id, num_cached_blocks, num_full_blocks))

    def on_blocks_touched(self, pool, blocks):
        self.calls.append(("touched", ids(blocks)))

    def on_blocks_freed(self, pool, blocks, to_head, to_tail, request_id, group, reason):
        self.calls.append(("freed", ids(blocks), ids(to_head), ids(to_tail), reason))

    def on_cache_reset(self, pool, success):
        self.calls.append(("reset", success))


def test_the_pool_reports_each_change_once_to_every_observer() -> None:
    """One protocol: the event log, vLLM's KV events and the metrics collector are observers
    of it, and so is any other -- each change reported once, after it is complete."""
    log = EventLog()
    pool = BlockPool(5, event_log=log, enable_kv_cache_events=True)
    assert [type(o).__name__ for o in pool.observers] == ["EventLogObserver", "KVEventsObserver"]
    rec = _Recorder()
    pool.observers.append(rec)
    a = pool.get_new_blocks(2, request_id="a")
    pool.cache_full_blocks(_EventReq("a", [b"h0", b"h1"]), a, 0, 2, 4, 0)
    pool.free_blocks(list(reversed(a)), request_id="a")
    pool.touch([a[0]])
    b = pool.get_new_blocks(3, request_id="b")  # blocks 3 and 4 (never cached), then block 2 (cached: evicted)
    assert pool.reset_prefix_cache() is False
    assert pool.evict_blocks([a[0].block_id, 4]) == [a[0].block_id]
    assert rec.calls == [
        ("allocated", [1, 2], [], "a"),
        ("cached", "a", 0, 2),
        ("freed", [2, 1], [], [2, 1], "request"),
        ("touched", [1]),
        ("allocated", [3, 4, 2], [(2, b"h1")], "b"),
        ("reset", False),
        ("dropped", [(1, b"h0")]),
    ]
    assert ids(b) == [3, 4, 2]
    kinds = [type(e).__name__ for e in log.events]
    assert kinds == [
        "BlocksAllocated",
        "BlockCached",
        "BlockCached",
        "BlocksFreed",
        "BlockEvicted",
        "BlocksAllocated",
        "CacheReset",
        "BlockEvicted",
    ]
    assert [type(e).__name__ for e in pool.take_events()] == ["BlockStored", "BlockRemoved", "BlockRemoved"]
