"""Two KV-cache group kinds of vLLM 0.33: the per-request ring (``CircularBufferSpec``, a
KV compressor's scratch rows) and full attention with static sinks (``SinkFullAttentionSpec``).

The exact values were produced first by vLLM 0.33.0's own ``KVCacheManager`` on the same
calls. A differential run (the same random workloads through both managers: full, window and
Mamba groups beside a ring of 4 to 16 rows, sink groups alone and beside a window or a ring,
EAGLE on and off, LoRA, salts, images, KV events on) found no difference in hashes, hits,
block ids, tables, ref counts, the free queue or any KV event over 600 runs. vLLM 0.33 cannot
build a sink group itself -- its ``SinkFullAttentionManager.__init__`` lacks the
``needs_kv_cache_zeroing`` keyword its coordinator always passes, a ``TypeError`` -- so its
side of the sink runs used the same constructor with that keyword passed on.
"""

from __future__ import annotations

import pytest

from kvlab import EventLog, FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec, replay
from kvlab.core.kv_cache_manager import KVCacheBlocks
from kvlab.engine.llm_engine import build_engine
from kvlab.kv_cache_interface import CircularBufferSpec, SinkFullAttentionSpec, get_kv_cache_spec_kind
from kvlab.timeline.snapshot import live_snapshot


def ids(blocks):
    return [[b.block_id for b in g] for g in blocks.blocks]


def free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_a_ring_takes_one_block_per_request_and_is_never_a_hit():
    """Full attention in blocks of 4 beside a 6-row ring: the scheduler block size is the LCM
    (12), hashes stay every 4 tokens (the ring does not hash), so hits come in steps of 12.
    A's ring block (5) is taken once and kept while A decodes; B's 12-token hit has nothing
    in the ring's slot and B gets a ring block of its own."""
    log = EventLog()
    m = KVCacheManager(
        num_blocks=16,
        kv_cache_groups=[FullAttentionSpec(block_size=4), CircularBufferSpec(block_size=6)],
        enable_kv_cache_events=True,
        event_log=log,
    )
    assert (m.coordinator.scheduler_block_size, m.coordinator.hash_block_size) == (12, 4)
    a = Request("A", list(range(14)), max_tokens=64)
    hits, n = m.get_computed_blocks(a)
    assert n == 0
    assert ids(m.allocate_slots(a, 14, n, hits)) == [[1, 2, 3, 4], [5]]
    a.num_computed_tokens = 14
    decoded = []
    for t in (90, 91, 92):
        a.append_output_token_ids(t)
        decoded.append(ids(m.allocate_slots(a, 1)))
        a.num_computed_tokens += 1
    assert decoded == [[[], []], [[], []], [[6], []]]  # the ring never grows
    b = Request("B", list(range(13)) + [77, 78, 79, 80, 81, 82, 83], max_tokens=64)
    hits, n = m.get_computed_blocks(b)
    assert (n, ids(hits)) == (12, [[1, 2, 3], []])
    assert ids(m.allocate_slots(b, 20 - n, n, hits)) == [[7, 8], [9]]
    assert (ids(m.get_blocks("A")), ids(m.get_blocks("B"))) == ([[1, 2, 3, 4, 6], [5]], [[1, 2, 3, 7, 8], [9]])
    stored = [(type(e).__name__, len(e.block_hashes), e.group_idx) for e in m.take_events()]
    assert stored == [("BlockStored", 3, 0)]  # the ring caches nothing
    m.free(a)
    m.free(b)
    assert free_ids(m) == [9, 8, 7, 5, 6, 4, 10, 11, 12, 13, 14, 15, 3, 2, 1]
    snap, live = replay(log), live_snapshot(m)
    assert snap.free_queue == live["free_queue"] and [blk.ref_cnt for blk in snap.blocks] == live["ref_cnt"]


def test_a_ring_is_refused_as_a_hit_and_needs_only_its_one_block():
    m = KVCacheManager(num_blocks=16, kv_cache_groups=[FullAttentionSpec(block_size=4), CircularBufferSpec(block_size=8)])
    a = Request("A", list(range(9)), max_tokens=4)
    m.allocate_slots(a, 9)
    ring = m.get_blocks("A").blocks[1]
    b = Request("B", list(range(9)), max_tokens=4)
    full = m.get_blocks("A").blocks[0][:2]
    free_before = m.block_pool.get_num_free_blocks()
    with pytest.raises(ValueError, match="1 blocks for a CircularBufferSpec group, which is never a hit"):
        m.allocate_slots(b, 1, 8, KVCacheBlocks((list(full), list(ring))))
    assert m.block_pool.get_num_free_blocks() == free_before and "B" not in m._requests  # nothing changed
    # 9 prompt tokens, 3 blocks of 4 and one ring block; a decode step needs nothing new
    assert m.coordinator.get_num_blocks_to_allocate("C", 9, ([], []), 0, 0, 9) == 4
    assert m.coordinator.single_type_managers[1].get_num_blocks_to_allocate("A", 10, [], 9, 0, 10) == 0


def test_sinks_must_fill_whole_blocks_and_otherwise_act_as_full_attention():
    with pytest.raises(ValueError, match="sink_len must be a positive multiple of the block size 4"):
        KVCacheManager(num_blocks=8, kv_cache_groups=[SinkFullAttentionSpec(block_size=4, sink_len=6)])
    with pytest.raises(ValueError, match="sink_len must be a positive multiple"):
        KVCacheManager(num_blocks=8, kv_cache_groups=[SinkFullAttentionSpec(block_size=4)])
    with pytest.raises(ValueError, match="sink_len must be None or an int >= 1"):
        SinkFullAttentionSpec(block_size=4, sink_len=0)
    tables = []
    for spec in (SinkFullAttentionSpec(block_size=4, sink_len=8), FullAttentionSpec(block_size=4)):
        eng = build_engine(num_blocks=12, block_size=4, max_num_batched_tokens=16, manager_kwargs=dict(kv_cache_groups=[spec]))
        for i, p in enumerate([list(range(30)), list(range(30)) + [99, 98], list(range(12))]):
            eng.add_request(Request(f"r{i}", p, max_tokens=5))
        eng.run()
        tables.append(([(e.step, type(e).__name__) for e in eng.events], {r: eng.metrics[r].num_cached_tokens for r in eng.finished}))
    assert tables[0] == tables[1]
    assert tables[0][1] == {"r0": 0, "r1": 28, "r2": 8}


def test_the_event_kinds_of_the_two_specs_are_vllms():
    assert get_kv_cache_spec_kind(SinkFullAttentionSpec(block_size=4, sink_len=4)) == "sink_full_attention"
    assert get_kv_cache_spec_kind(CircularBufferSpec(block_size=8)) == "unknown"  # vLLM 0.33 has no kind for a ring


def test_an_engine_with_a_ring_holds_exactly_one_ring_block_per_running_request():
    """A sink group, a window and a 6-row ring under the scheduler: at every step each
    running request holds one ring block, and the replayed pool equals the live one."""
    groups = [
        SinkFullAttentionSpec(block_size=4, sink_len=4),
        SlidingWindowSpec(block_size=4, sliding_window=8),
        CircularBufferSpec(block_size=6),
    ]
    eng = build_engine(num_blocks=24, block_size=4, max_num_batched_tokens=16, manager_kwargs=dict(kv_cache_groups=groups))
    for i, p in enumerate([list(range(30)), list(range(30)) + [99, 98], list(range(12))]):
        eng.add_request(Request(f"r{i}", p, max_tokens=5))
    rings = []
    while eng.has_unfinished_requests():
        eng.step()
        m = eng.kv_cache_manager
        rings.append({r.request_id: len(m.get_blocks(r.request_id).blocks[2]) for r in eng.scheduler.running})
        eng.scheduler.check_invariants()
    assert all(n == 1 for step in rings for n in step.values()) and any(rings)
    assert {r: eng.metrics[r].num_cached_tokens for r in eng.finished} == {"r0": 0, "r1": 24, "r2": 0}
    snap, live = replay(eng.events), live_snapshot(eng.kv_cache_manager)
    assert snap.free_queue == live["free_queue"]


def test_a_ring_counts_one_block_when_the_scheduler_asks_if_a_request_can_ever_fit():
    """8 blocks (7 usable), blocks of 4 and an 8-row ring: a 24-token prompt needs 6 blocks
    of full attention and 1 ring block, so it fits -- counting the ring per token (3 more
    blocks) would refuse it."""
    groups = [FullAttentionSpec(block_size=4), CircularBufferSpec(block_size=8)]
    eng = build_engine(num_blocks=8, block_size=4, max_num_batched_tokens=32, manager_kwargs=dict(kv_cache_groups=groups))
    eng.add_request(Request("A", list(range(24)), max_tokens=1))
    eng.run()
    assert eng.finished["A"].finish_reason == "length"
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 7
