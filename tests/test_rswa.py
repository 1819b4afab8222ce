"""R-SWA (vLLM 0.33's reference sliding window attention): the prompt stays, the generated
tokens older than the window go, so the gap between them is freed while decoding.

The tables and free queues below are what vLLM 0.33.0's own ``KVCacheManager`` (the unpacked
wheel, sha256_cbor hashes) gave for the same calls, alone and beside a full-attention group."""

from __future__ import annotations

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, Request, RSWASpec
from kvlab.core.single_type_kv_cache_manager import RSWAManager
from kvlab.kv_cache_interface import get_kv_cache_spec_kind


def _decode(groups: list) -> tuple[KVCacheManager, Request, dict[int, list[list[int]]]]:
    """A 10-token prompt in blocks of 4, then 24 tokens decoded one by one; the tables after
    each step, by the number of computed tokens."""
    m = KVCacheManager(num_blocks=30, kv_cache_groups=groups, hash_algo="sha256_cbor", max_model_len=64, enable_kv_cache_events=True)
    a = Request("a", list(range(10)), max_tokens=30)
    m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    tables = {}
    for t in range(24):
        a.append_output_token_ids(100 + t)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        tables[a.num_computed_tokens] = [[b.block_id for b in g] for g in m.get_blocks("a").blocks]
    return m, a, tables


def test_the_gap_between_the_prompt_and_the_window_is_freed_block_by_block() -> None:
    m, a, tables = _decode([RSWASpec(block_size=4, rswa_window=6)])
    assert isinstance(m.coordinator.single_type_managers[0], RSWAManager)
    # Blocks 1-3 hold the prompt (the third shares it with the first decoded tokens) and stay.
    assert tables[22] == [[1, 2, 3, 4, 5, 6]]
    assert tables[23] == [[1, 2, 3, 0, 5, 6]]  # 22 computed: the window starts at 16, block 4 (tokens 12-15) goes
    assert tables[27] == [[1, 2, 3, 0, 0, 6, 7]]
    assert tables[31] == [[1, 2, 3, 0, 0, 0, 7, 8]]
    assert tables[34] == [[1, 2, 3, 0, 0, 0, 7, 8, 9]]
    free = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert free[:6] == [10, 11, 12, 13, 14, 15] and free[-3:] == [4, 5, 6]  # the gap, cached, at the tail
    # Hits are full attention's: the prompt's whole blocks.
    c = Request("c", [*range(10), 1, 2, 3], max_tokens=4)
    assert m.get_computed_blocks(c)[1] == 8
    m.free(a)
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == [
        9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 4, 5, 6, 8, 7, 3, 2, 1,
    ]  # fmt: skip
    assert {e.kv_cache_spec_kind for e in m.take_events() if hasattr(e, "kv_cache_spec_kind")} == {"full_attention"}
    m.block_pool.check_invariants()


def test_beside_full_attention_only_the_rswa_group_frees_its_gap() -> None:
    m, _, tables = _decode([FullAttentionSpec(block_size=4), RSWASpec(block_size=4, rswa_window=6)])
    assert tables[34] == [[1, 2, 3, 7, 9, 11, 13, 15, 17], [4, 5, 6, 0, 0, 0, 14, 16, 18]]
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()][:6] == [19, 20, 21, 22, 23, 24]


def test_the_spec_checks_its_window_and_is_named_as_full_attention() -> None:
    with pytest.raises(ValueError, match="rswa_window"):
        RSWASpec(block_size=4)
    spec = RSWASpec(block_size=4, rswa_window=6)
    assert (spec.type_name, get_kv_cache_spec_kind(spec), spec.to_dict()) == (
        "rswa",
        "full_attention",
        {"type": "rswa", "block_size": 4, "rswa_window": 6},
    )


def test_the_pictures_replay_the_freed_gap() -> None:
    from kvlab import EventLog, Timeline

    log = EventLog()
    m = KVCacheManager(num_blocks=30, kv_cache_groups=[RSWASpec(block_size=4, rswa_window=6)], max_model_len=64, event_log=log)
    a = Request("a", list(range(10)), max_tokens=30)
    m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    for t in range(14):
        a.append_output_token_ids(100 + t)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    snap = Timeline(log).after_event(len(log) - 1)
    assert [b.block_id for b in m.get_blocks("a").blocks[0]] == [1, 2, 3, 0, 5, 6]
    assert (snap.blocks[4].state, snap.blocks[4].ref_cnt, snap.blocks[5].state) == ("cached", 0, "in_use")
