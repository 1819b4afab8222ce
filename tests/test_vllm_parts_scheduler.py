"""vLLM 0.33 scheduler parts kvlab grew for vLLM's own tests (issue 22).

* ``_free_cow_retained_blocks`` and the fence behind it (``defer_block_free``,
  ``sched_step_seq``, ``processed_step_seq``, ``deferred_frees``): the two blocks of a
  copy-on-write copy go back to the pool once the step that runs the copy is processed.
"""

from __future__ import annotations

from collections import deque

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request
from kvlab.core.sched.scheduler import Scheduler

HYBRID = [FullAttentionSpec(block_size=8), MambaSpec(block_size=8)]


def _cow_scheduler(defer: bool) -> tuple[KVCacheManager, Scheduler]:
    """A Mamba hybrid with partial hits: request a (14 tokens) is prefilled 8 + 4 + 2, and the
    third chunk hands its state saved inside block 4 to a copy, block 5
    (``test_partial_hits``)."""
    m = KVCacheManager(num_blocks=16, kv_cache_groups=HYBRID, max_model_len=64, prefix_match_unit=4)
    sched = Scheduler(m, max_num_batched_tokens=64, max_num_seqs=4)
    sched.defer_block_free = defer
    sched.add_request(Request("a", list(range(14)), max_tokens=2))
    return m, sched


def _refs(m: KVCacheManager) -> tuple[int, int]:
    return m.block_pool.blocks[4].ref_cnt, m.block_pool.blocks[5].ref_cnt


def _free_queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_kvlab_gives_a_copys_blocks_back_in_the_step_that_hands_it_over():
    m, sched = _cow_scheduler(defer=False)
    for n in (8, 4):
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"a": n}
        sched.update_from_output(out, {})
    out = sched.schedule()
    assert out.kv_cache_block_copies is not None and [(c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies] == [(4, 5)]
    assert _refs(m) == (1, 0) and not sched.deferred_frees
    assert (sched.sched_step_seq, sched.processed_step_seq) == (0, 0)  # the fence is not kept
    sched.update_from_output(out, {"a": [7]})
    assert _free_queue(m) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 5]
    sched.check_invariants()


def test_deferring_keeps_a_copys_blocks_until_the_copy_step_is_processed():
    m, sched = _cow_scheduler(defer=True)
    seqs = []
    for n in (8, 4):
        out = sched.schedule()
        seqs.append((sched.sched_step_seq, sched.processed_step_seq))
        sched.update_from_output(out, {})
        seqs.append((sched.sched_step_seq, sched.processed_step_seq))
    assert seqs == [(1, 0), (1, 1), (2, 1), (2, 2)]
    out = sched.schedule()
    # the copy runs in non-empty step 3: its two blocks keep their extra reference till then,
    # stored reversed as vLLM stores them
    assert [(f, [b.block_id for b in blocks]) for f, blocks in sched.deferred_frees] == [(3, [5, 4])]
    assert _refs(m) == (2, 1)
    sched.check_invariants()  # the deferred blocks are counted as held
    with pytest.raises(AssertionError, match="block 4: ref_cnt 2"):
        m.check_invariants()  # the manager alone does not know who holds them
    sched.update_from_output(out, {"a": [7]})
    assert (sched.sched_step_seq, sched.processed_step_seq) == (3, 3)
    assert _refs(m) == (1, 0) and not sched.deferred_frees
    assert _free_queue(m) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 5]  # as without deferring
    sched.check_invariants()


def test_free_cow_retained_blocks_frees_now_or_waits_for_its_fence():
    """vLLM 0.33's rule, on a real scheduler: freed at once unless deferring and the fence
    step is not processed yet; the drain frees up to the first fence still pending."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(m)
    blocks = m.block_pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    sched._free_cow_retained_blocks(blocks[:2], fence_seq=5)  # not deferring: now
    assert [b.ref_cnt for b in blocks] == [0, 0, 1, 1]
    sched.defer_block_free = True
    sched.processed_step_seq = 2
    sched._free_cow_retained_blocks([blocks[2]], fence_seq=3)
    sched._free_cow_retained_blocks([blocks[3]], fence_seq=4)
    assert sched.deferred_frees == deque([(3, [blocks[2]]), (4, [blocks[3]])])
    sched.processed_step_seq = 3
    sched._drain_deferred_frees()
    assert [b.ref_cnt for b in blocks] == [0, 0, 0, 1] and sched.deferred_frees == deque([(4, [blocks[3]])])
    sched.processed_step_seq = 4
    sched._drain_deferred_frees()
    assert blocks[3].ref_cnt == 0 and not sched.deferred_frees
    (late,) = m.block_pool.get_new_blocks(1)
    sched._free_cow_retained_blocks([late], fence_seq=4)  # its fence is processed: now
    assert late.ref_cnt == 0 and not sched.deferred_frees
    m.block_pool.check_invariants()
