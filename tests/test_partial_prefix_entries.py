"""Partial prefix entries (vLLM 0.33): when a full-attention group's blocks are larger than
the hash block, the prompt's last hash boundary inside a block becomes a prefix-cache key of
that block (``BlockPool.cache_partial_block``, ``FullAttentionManager._cache_partial_tail_block``).

The manager scenarios below were run on vLLM 0.33.0's own ``KVCacheManager`` (the unpacked
wheel, sha256_cbor hashes) beside kvlab's; the expected events, block ids and free-queue
orders are what both gave."""

from __future__ import annotations

import pytest

from kvlab import BlockPool, FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec
from kvlab.core.block_pool import group_suffix
from kvlab.core.kv_cache_utils import maybe_convert_block_hash
from kvlab.distributed.kv_events import BlockRemoved, BlockStored
from kvlab.eventlog.events import EventLog
from kvlab.timeline import Timeline


def _Req(rid: str, num_hash_blocks: int) -> Request:
    """A request whose hashes (one per hash block of 4) are readable names: rid + index."""
    r = Request(rid, list(range(100, 100 + 4 * num_hash_blocks + 3)))
    r.block_hashes[:] = [f"{rid}{i}".encode() for i in range(num_hash_blocks)]
    return r


def _pool(**kw: object) -> BlockPool:
    return BlockPool(8, hash_block_size=4, enable_kv_cache_events=True, kv_events_use_int_block_hashes=False, **kw)  # type: ignore[arg-type]


def _free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_a_partial_entry_on_a_block_without_a_key_becomes_its_key_so_the_block_is_freed_to_the_tail() -> None:
    pool = _pool()
    req = _Req("a", 3)
    blocks = pool.get_new_blocks(2)  # blocks 1 and 2, 8 tokens each: the prompt's boundary at 12 is inside block 2
    key = pool.cache_partial_block(req, blocks[1], 12, 0, 8)
    assert key == b"a2" + group_suffix(0)
    assert blocks[1].cache_key == key and blocks[1].block_hash_num_tokens == 12 and pool.cached_block_hashes_by_block == {}
    assert pool.cached_block_hash_to_block.get_one_block(key) is blocks[1]
    # One BlockStored of one hash block: tokens 8..11, parent = the hash before, block_size 4.
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.group_idx) == (
        [b"a2"],
        b"a1",
        [108, 109, 110, 111],
        4,
        0,
    )
    pool.free_blocks(list(reversed(blocks)))
    assert _free_ids(pool) == [1, 3, 4, 5, 6, 7, 2]  # block 1 (no key) to the head, block 2 (a key) to the tail
    pool.check_invariants()


def test_a_partial_entry_on_a_cached_block_is_one_more_key_and_eviction_drops_both() -> None:
    pool = _pool()
    req = _Req("a", 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 8, 0)  # keys a1, a3 (the hash at each block's end)
    pool.take_events()
    pool.cache_partial_block(req, blocks[1], 12, 0, 8)
    assert blocks[1].cache_key == b"a3" + group_suffix(0)  # its own key stays
    assert pool.cached_block_hashes_by_block == {2: [b"a2" + group_suffix(0)]} and blocks[1].block_hash_num_tokens == 16
    assert [e.block_hashes for e in pool.take_events()] == [[b"a2"]]
    # The same entry again: nothing changes, no event.
    assert pool.cache_partial_block(req, blocks[1], 12, 0, 8) == b"a2" + group_suffix(0)
    assert pool.take_events() == [] and pool.cached_block_hashes_by_block == {2: [b"a2" + group_suffix(0)]}
    pool.free_blocks(list(reversed(blocks)))
    pool.check_invariants()
    taken = pool.get_new_blocks(7)  # the whole queue: blocks 1 and 2 are reused last
    assert [b.block_id for b in taken] == [3, 4, 5, 6, 7, 2, 1]
    # Reusing block 2 drops its own key first, then its partial entry: one BlockRemoved each.
    assert [(type(e).__name__, e.block_hashes) for e in pool.take_events()] == [
        ("BlockRemoved", [b"a3"]),
        ("BlockRemoved", [b"a2"]),
        ("BlockRemoved", [b"a1"]),
    ]
    assert pool.num_evicted_blocks == 2 and len(pool.cached_block_hash_to_block) == 0 and pool.cached_block_hashes_by_block == {}
    pool.check_invariants()


def test_the_full_key_replaces_a_partial_one_when_the_block_fills() -> None:
    pool = _pool()
    req = _Req("a", 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_partial_block(req, blocks[1], 12, 0, 8)
    pool.cache_full_blocks(req, blocks, 0, 2, 8, 0)
    events = pool.take_events()
    # vLLM 0.33's order: the partial key is removed, then one BlockStored for the run.
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert events[1].block_hashes == [b"a2"] and events[2].block_hashes == [b"a1", b"a3"]
    assert blocks[1].cache_key == b"a3" + group_suffix(0) and blocks[1].block_hash_num_tokens == 16
    assert pool.cached_block_hash_to_block.get_one_block(b"a2" + group_suffix(0)) is None
    pool.check_invariants()


def test_a_later_boundary_replaces_an_earlier_partial_key_and_replace_existing_hashes_replaces_any() -> None:
    pool = _pool()
    blocks = pool.get_new_blocks(1)
    short, longer = _Req("s", 1), _Req("s", 2)
    pool.cache_partial_block(short, blocks[0], 4, 0, 8)
    pool.take_events()
    pool.cache_partial_block(longer, blocks[0], 8, 0, 16)  # boundary 8 > 4 in a block of 16
    assert [(type(e).__name__, e.block_hashes) for e in pool.take_events()] == [("BlockRemoved", [b"s0"]), ("BlockStored", [b"s1"])]
    assert blocks[0].block_hash_num_tokens == 8
    pool.cache_partial_block(short, blocks[0], 4, 0, 16)  # an earlier boundary: one more key
    assert pool.cached_block_hashes_by_block == {1: [b"s0" + group_suffix(0)]}
    pool.take_events()
    other = _Req("o", 1)
    pool.cache_partial_block(other, blocks[0], 4, 1, 16, replace_existing_hashes=True)
    assert [(type(e).__name__, e.block_hashes) for e in pool.take_events()] == [
        ("BlockRemoved", [b"s1"]),
        ("BlockRemoved", [b"s0"]),
        ("BlockStored", [b"o0"]),
    ]
    assert blocks[0].cache_key == b"o0" + group_suffix(1) and pool.cached_block_hashes_by_block == {}
    pool.check_invariants()
    assert pool.cache_partial_block(other, pool.null_block, 4, 0, 8) is None


@pytest.mark.parametrize(
    ("args", "word"),
    [
        ((6, 0, 8), "num_tokens must be a positive multiple of the hash block size 4"),
        ((0, 0, 8), "num_tokens"),
        ((16, 0, 8), "at most the 12 tokens"),
        ((4, 0, 6), "block_size must be a positive multiple of the hash block size 4"),
        ((4, -1, 8), "kv_cache_group_id"),
    ],
)
def test_cache_partial_block_refuses_bad_arguments_and_changes_nothing(args: tuple[int, int, int], word: str) -> None:
    pool = _pool()
    blocks = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match=word) as e:
        pool.cache_partial_block(_Req("a", 3), blocks[0], *args)
    # vLLM asserts the token count (its tests expect AssertionError); the other arguments are kvlab's checks
    assert isinstance(e.value, AssertionError) == word.startswith(("num_tokens", "at most"))
    assert blocks[0].cache_key is None and len(pool.cached_block_hash_to_block) == 0 and pool.take_events() == []
    with pytest.raises(ValueError, match="not a block of this pool"):
        pool.cache_partial_block(_Req("a", 3), _pool().blocks[1], 4, 0, 8)


def test_reset_and_evict_blocks_forget_partial_entries() -> None:
    pool = _pool()
    req = _Req("a", 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 8, 0)
    pool.cache_partial_block(req, blocks[1], 12, 0, 8)
    pool.take_events()
    assert pool.evict_blocks([2, 2]) == [2]  # each id once, though it lost two keys
    assert [e.block_hashes for e in pool.take_events()] == [[b"a3"], [b"a2"]]
    pool.cache_partial_block(req, blocks[1], 12, 0, 8)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert (
        {b.block_hash_num_tokens for b in pool.blocks} == {None}
        and pool.cached_block_hashes_by_block == {}
        and len(pool.cached_block_hash_to_block) == 0
    )
    pool.check_invariants()


# -- the manager, against vLLM 0.33 ----------------------------------------------------------
def _manager(use_eagle: bool, event_log: EventLog | None = None) -> KVCacheManager:
    groups = [FullAttentionSpec(block_size=8), SlidingWindowSpec(block_size=4, sliding_window=8)]
    return KVCacheManager(
        num_blocks=16,
        kv_cache_groups=groups,
        enable_kv_cache_events=True,
        hash_algo="sha256_cbor",
        use_eagle=use_eagle,
        max_model_len=64,
        event_log=event_log,
    )


def _events(m: KVCacheManager, r: Request) -> list[tuple]:
    """(kind, hash positions in the request's own hashes, parent position, tokens, block_size, group)."""
    where = {maybe_convert_block_hash(h): i for i, h in enumerate(r.block_hashes)}
    out = []
    for e in m.take_events():
        if isinstance(e, BlockStored):
            parent = None if e.parent_block_hash is None else where[e.parent_block_hash]
            out.append(("stored", [where[h] for h in e.block_hashes], parent, e.token_ids, e.block_size, e.group_idx))
        else:
            assert isinstance(e, BlockRemoved)
            out.append(("removed", [where.get(h) for h in e.block_hashes], e.group_idx))
    return out


def _free(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def _prefill_14(m: KVCacheManager) -> Request:
    a = Request("a", list(range(14)), max_tokens=8)
    blocks, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 14 - n, n, blocks)
    a.num_computed_tokens = 14
    assert [[b.block_id for b in g] for g in m.get_blocks("a").blocks] == [[1, 2], [3, 4, 5, 6]]
    return a


def test_without_eagle_the_tail_entry_is_added_once_the_block_is_full_as_vllm_does() -> None:
    """Full attention in blocks of 8 beside a sliding window in blocks of 4: hashes every 4
    tokens, hits in multiples of 8. A 14-token prompt's boundary is 12 (a repeat matches at
    most 13), inside block 2; the group caches only whole multiples of 8, so the entry comes
    when block 2 fills, as one more key of it."""
    m = _manager(use_eagle=False)
    a = _prefill_14(m)
    assert _events(m, a) == [
        ("stored", [1], None, list(range(8)), 8, 0),
        ("stored", [0, 1], None, list(range(8)), 4, 1),
    ]
    a.append_output_token_ids([100, 101])
    m.allocate_slots(a, 2)
    a.num_computed_tokens = 16
    full_block = [8, 9, 10, 11, 12, 13, 100, 101]
    assert _events(m, a) == [
        ("stored", [3], 1, full_block, 8, 0),
        ("stored", [2], 1, [8, 9, 10, 11], 4, 0),  # the partial entry: one hash block, its tokens
        ("stored", [2, 3], 1, full_block, 4, 1),
    ]
    assert m.block_pool.cached_block_hashes_by_block == {2: [a.block_hashes[2] + group_suffix(0)]}
    assert _free(m) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 3]
    m.free(a)
    assert _free(m) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1, 6, 5, 4]
    c = Request("c", list(range(14)), max_tokens=8)
    blocks, n = m.get_computed_blocks(c)
    assert (n, [[b.block_id for b in g] for g in blocks.blocks]) == (8, [[1], [3, 4]])
    m.block_pool.check_invariants()


def test_with_eagle_the_tail_entry_lands_on_a_partly_filled_block_and_moves_it_to_the_tail() -> None:
    """With EAGLE the group caches up to one block past the aligned length, so the boundary
    at 12 is reached during prefill: block 2, half filled and without a key, takes the
    partial key as its own. Freed, it joins the tail, not the head; when it fills, the full
    key replaces the partial one and the entry comes back as one more key."""
    log = EventLog()
    m = _manager(use_eagle=True, event_log=log)
    a = _prefill_14(m)
    assert _events(m, a) == [
        ("stored", [1], None, list(range(8)), 8, 0),
        ("stored", [2], 1, [8, 9, 10, 11], 4, 0),
        ("stored", [0, 1, 2], None, list(range(12)), 4, 1),
    ]
    assert m.block_pool.blocks[2].block_hash_num_tokens == 12
    a.append_output_token_ids([100, 101])
    m.allocate_slots(a, 2)
    a.num_computed_tokens = 16
    assert _events(m, a) == [
        ("removed", [2], 0),
        ("stored", [3], 1, [8, 9, 10, 11, 12, 13, 100, 101], 8, 0),
        ("stored", [2], 1, [8, 9, 10, 11], 4, 0),
        ("stored", [3], 2, [12, 13, 100, 101], 4, 1),
    ]
    assert m.block_pool.blocks[2].block_hash_num_tokens == 16
    m.free(a)
    assert _free(m) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1, 6, 5, 4]
    m.block_pool.check_invariants()
    # The pictures replay it: block 2 shows its full key; the partial entry's node lists it too.
    snap = Timeline(log).after_event(len(log) - 1)
    full_hex, partial_hex = a.block_hashes[3].hex(), a.block_hashes[2].hex()
    assert snap.blocks[2].block_hash == full_hex
    assert 2 in snap.hash_nodes[partial_hex].block_ids and 2 in snap.hash_nodes[full_hex].block_ids


def test_with_eagle_a_request_freed_after_prefill_leaves_its_tail_block_cached() -> None:
    m = _manager(use_eagle=True)
    a = _prefill_14(m)
    m.free(a)
    # Block 2 carries the partial key: it goes to the tail with the cached blocks.
    assert _free(m) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1, 5, 4, 3]
    m.take_events()
    x = Request("x", [7] * 30, max_tokens=1)
    blocks, _ = m.get_computed_blocks(x)
    m.allocate_slots(x, 30, 0, blocks)
    assert [[b.block_id for b in g] for g in m.get_blocks("x").blocks] == [[6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 2, 1]]
    kinds = [e[0] for e in _events(m, x)]
    assert kinds == ["removed", "removed", "stored", "stored", "stored"]
    m.block_pool.check_invariants()


def test_every_key_carries_the_prefix_length_it_stands_for() -> None:
    """vLLM 0.33's block_hash_num_tokens: (i + 1) x block size for a full block at index i, the
    boundary for a partial entry, None once the key is gone; set_block_hash refuses a block
    that has a key (its old map entry would dangle)."""
    pool = _pool()
    req = _Req("a", 5)
    blocks = pool.get_new_blocks(3)
    pool.cache_partial_block(req, blocks[2], 20, 0, 8)
    assert [b.block_hash_num_tokens for b in blocks] == [None, None, 20]
    pool.cache_full_blocks(req, blocks, 0, 2, 8, 0)
    assert [b.block_hash_num_tokens for b in blocks] == [8, 16, 20]
    with pytest.raises(ValueError, match=r"block 1 already has a cache key; reset_hash\(\) it \(and drop its map entry\) first"):
        blocks[0].set_block_hash(b"x" + group_suffix(0), 8)
    assert pool.evict_blocks([blocks[1].block_id]) == [blocks[1].block_id]
    assert [b.block_hash_num_tokens for b in blocks] == [8, None, 20]
    blocks[1].set_block_hash(b"y" + group_suffix(0), 16)
    assert (blocks[1].cache_key, blocks[1].block_hash_num_tokens) == (b"y" + group_suffix(0), 16)
    blocks[1].reset_hash()
    assert (blocks[1].cache_key, blocks[1].block_hash_num_tokens) == (None, None)
