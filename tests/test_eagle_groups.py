"""EAGLE draft groups (vLLM 0.33): only the KV-cache groups of the drafter's layers
(``KVCacheGroupSpec.is_eagle_group``) give back the last block of a hit, which the drafter
recomputes; with EAGLE on and no group flagged, every group does (vLLM's fallback).

The expected values were first produced by vLLM 0.33.0's ``KVCacheManager`` with the same
calls (and a differential run over four families, flags and EAGLE on and off, agrees).
"""

from __future__ import annotations

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec
from kvlab.kv_cache_interface import KVCacheGroupSpec

SPECS = [SlidingWindowSpec(block_size=4, sliding_window=8), FullAttentionSpec(block_size=4)]


def manager(flags: list[bool] | None, use_eagle: bool = True) -> KVCacheManager:
    groups = [KVCacheGroupSpec((), s, is_eagle_group=f) for s, f in zip(SPECS, flags)] if flags else SPECS
    return KVCacheManager(num_blocks=12, kv_cache_groups=groups, use_eagle=use_eagle, max_model_len=128)


def hit_after_pressure(m: KVCacheManager) -> tuple[int, list[list[int]]]:
    """A (8 tokens) is cached and freed; C (16 unrelated tokens) evicts some of it; B repeats A + 1."""
    a = Request("a", list(range(8)), max_tokens=2)
    m.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    m.free(a)
    c = Request("c", list(range(500, 516)), max_tokens=2)
    assert m.allocate_slots(c, 16) is not None
    m.free(c)
    blocks, n = m.get_computed_blocks(Request("b", list(range(8)) + [7], max_tokens=2))
    return n, [[b.block_id for b in g] for g in blocks.blocks]


def test_only_the_drafters_group_drops_a_block() -> None:
    flagged = manager([False, True])
    assert (flagged.coordinator.eagle_group_ids, flagged.coordinator.drop_eagle_group_ids) == ({1}, {1})
    assert [m.use_eagle for m in flagged.coordinator.single_type_managers] == [False, True]
    # The window group need not keep a block more for the drafter: B still hits one block.
    assert hit_after_pressure(flagged) == (4, [[1], [3]])
    assert [b.block_id for b in flagged.block_pool.free_block_queue.get_all_free_blocks()] == [1, 4, 3, 8, 7, 6, 5, 2, 11, 10, 9]
    # No group flagged: every group drops, and the window group's hit is gone.
    fallback = manager(None)
    assert fallback.coordinator.drop_eagle_group_ids == {0, 1}
    assert hit_after_pressure(fallback) == (0, [[], []])


def test_the_flags_mean_nothing_without_eagle_and_survive_in_the_config() -> None:
    m = manager([False, True], use_eagle=False)
    assert (m.coordinator.eagle_group_ids, m.coordinator.drop_eagle_group_ids) == ({1}, set())
    assert [g.is_eagle_group for g in m.kv_cache_config.kv_cache_groups] == [False, True]
    assert [g.is_eagle_group for g in manager(None).kv_cache_config.kv_cache_groups] == [False, False]


def test_equal_specs_are_looked_up_together_and_drop_if_either_is_flagged() -> None:
    spec = FullAttentionSpec(block_size=4)
    m = KVCacheManager(num_blocks=12, kv_cache_groups=[spec, KVCacheGroupSpec((), spec, is_eagle_group=True)], use_eagle=True)
    assert [m.use_eagle for m in m.coordinator.single_type_managers] == [True, True]


def test_a_bad_flag_is_refused() -> None:
    with pytest.raises(TypeError, match=r"kv_cache_groups\[1\]\.is_eagle_group must be a bool, got 1"):
        KVCacheManager(num_blocks=12, kv_cache_groups=[SPECS[0], KVCacheGroupSpec((), SPECS[1], is_eagle_group=1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_cache_groups\[0\] must be one of .* \(or a KVCacheGroupSpec holding one\); got str"):
        KVCacheManager(num_blocks=12, kv_cache_groups=[KVCacheGroupSpec((), "full")])  # type: ignore[arg-type]
