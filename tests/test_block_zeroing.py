"""Block zeroing (vLLM 0.33): with Mamba layers, or attention groups of more than one dtype, in
one pool, the attention blocks handed out each step are named for the runner to zero.

The expected ids were given by vLLM 0.33.0's own ``KVCacheManager`` (the unpacked wheel,
sha256_cbor hashes) running the same calls beside kvlab's."""

from __future__ import annotations

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.transaction import checkpoint_manager, restore_manager

MAMBA = [FullAttentionSpec(block_size=4), MambaSpec(block_size=4, shapes=((4, 256),), dtypes=("bfloat16",))]
MIXED = [FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, dtype="fp8_e4m3", sliding_window=8)]
PLAIN = [FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=8)]


def _run(groups: list) -> list[tuple]:
    m = KVCacheManager(num_blocks=30, kv_cache_groups=groups, hash_algo="sha256_cbor", max_model_len=64)
    log: list[tuple] = [("need", m.needs_kv_cache_zeroing)]
    a = Request("a", list(range(10)), max_tokens=8)
    blocks, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 10 - n, n, blocks)
    a.num_computed_tokens = 10
    log.append(("a", m.take_new_block_ids()))
    a.append_output_token_ids([50, 51])
    m.allocate_slots(a, 2)
    a.num_computed_tokens = 12
    log.append(("a decodes", m.take_new_block_ids()))
    c = Request("c", [*range(10), 7, 7, 7, 7], max_tokens=8)
    blocks, n = m.get_computed_blocks(c)
    # 4 tokens arrive from a connector; group 0's are loaded asynchronously, so not zeroed.
    m.allocate_slots(c, 14 - n - 4, n, blocks, num_external_computed_tokens=4, skip_zeroing_group_ids=(0,))
    log.append(("c", n, m.take_new_block_ids()))
    m.record_blocks_for_zeroing("c", 8)  # the load failed: c's blocks from token 8 on, again
    log.append(("c again", m.take_new_block_ids()))
    m.free(a)
    m.free(c)
    d = Request("d", [9] * 20, max_tokens=8)
    blocks, _ = m.get_computed_blocks(d)
    m.allocate_slots(d, 20, 0, blocks)
    log.append(("d", m.take_new_block_ids(), m.take_new_block_ids()))
    return log


def test_a_mamba_hybrid_zeroes_its_attention_blocks_only() -> None:
    assert _run(MAMBA) == [
        ("need", True),
        ("a", [1, 2, 3]),  # the attention group's blocks; the Mamba group's are not named
        ("a decodes", []),
        ("c", 0, [7, 8, 9]),
        ("c again", [8, 9]),
        ("d", [10, 9, 11, 12, 13], []),
    ]


def test_groups_of_two_dtypes_zero_every_attention_block_but_an_asynchronous_load() -> None:
    assert _run(MIXED) == [
        ("need", True),
        ("a", [1, 2, 3, 4, 5, 6]),
        ("a decodes", []),
        ("c", 8, [9, 8, 10]),  # group 0's external block is left to the load
        ("c again", [7, 9, 8, 10]),
        ("d", [10, 9, 11, 12, 13, 14, 15, 16, 17, 18], []),
    ]


def test_one_kind_in_one_dtype_names_no_block() -> None:
    assert _run(PLAIN) == [("need", False), ("a", []), ("a decodes", []), ("c", 8, []), ("c again", []), ("d", [], [])]
    m = KVCacheManager(num_blocks=30, kv_cache_groups=PLAIN)
    assert m.kv_cache_config.needs_kv_cache_zeroing is False
    assert KVCacheManager(num_blocks=30, kv_cache_groups=MIXED).kv_cache_config.has_mixed_precision_kv_cache is True
    assert KVCacheManager(num_blocks=30, kv_cache_groups=MAMBA).kv_cache_config.has_mamba_layers is True


def test_the_scheduler_hands_the_ids_to_the_runner_every_step() -> None:
    m = KVCacheManager(num_blocks=30, kv_cache_groups=MAMBA, max_model_len=64)
    sched = Scheduler(m, max_num_batched_tokens=64, max_num_seqs=4)
    sched.add_request(Request("a", list(range(10)), max_tokens=4))
    out = sched.schedule()
    # A Mamba hybrid's first chunk ends on a block boundary: 8 of the 10 tokens, 2 blocks.
    assert (out.num_scheduled_tokens, out.new_block_ids_to_zero) == ({"a": 8}, [1, 2])
    assert sched.schedule().new_block_ids_to_zero is None  # nothing new
    plain = Scheduler(KVCacheManager(num_blocks=30, kv_cache_groups=PLAIN, max_model_len=64), max_num_batched_tokens=64)
    plain.add_request(Request("a", list(range(10)), max_tokens=4))
    assert plain.schedule().new_block_ids_to_zero is None


def test_bad_arguments_are_refused_and_change_nothing() -> None:
    m = KVCacheManager(num_blocks=30, kv_cache_groups=MIXED, max_model_len=64)
    a = Request("a", list(range(10)), max_tokens=8)
    with pytest.raises(ValueError, match=r"skip_zeroing_group_ids: 2 is not a group id \(0..1\)"):
        m.allocate_slots(a, 10, skip_zeroing_group_ids=(2,))
    with pytest.raises(TypeError, match="skip_zeroing_group_ids must be a tuple"):
        m.allocate_slots(a, 10, skip_zeroing_group_ids=[0])  # type: ignore[arg-type]
    assert m.block_pool.get_num_free_blocks() == 29 and m.take_new_block_ids() == []
    m.allocate_slots(a, 10)
    m.take_new_block_ids()
    with pytest.raises(ValueError, match="start_token = 6 is not a multiple of group 0's block size 4"):
        m.record_blocks_for_zeroing("a", 6)
    with pytest.raises(ValueError, match="start_token"):
        m.record_blocks_for_zeroing("a", -4)
    assert m.take_new_block_ids() == []


def test_an_undone_call_takes_its_recorded_ids_back() -> None:
    m = KVCacheManager(num_blocks=30, kv_cache_groups=MIXED, max_model_len=64)
    a = Request("a", list(range(10)), max_tokens=8)
    m.allocate_slots(a, 10)
    cp = checkpoint_manager(m)
    b = Request("b", [5] * 8, max_tokens=8)
    m.allocate_slots(b, 8)
    restore_manager(m, cp)
    assert m.take_new_block_ids() == [1, 2, 3, 4, 5, 6]  # a's, and none of b's
