"""Lesson 07b's picture of the physical KV memory: kvlab specs planned the way vLLM 0.33 lays out
a hybrid model (``vllm/v1/core/kv_cache_planning.py``: ``_get_kv_cache_groups_uniform_page_size``
and ``get_kv_cache_config_from_groups``, default layer-outer layout)."""

from __future__ import annotations

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec
from kvlab.lessons.hybrid_layout import KVCacheTensor, layout_figure, plan_kv_cache_layout

FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)  # 4,096 bytes per token
WINDOW = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=48)  # 2,048


def lesson_plan():
    return plan_kv_cache_layout([FULL, WINDOW, WINDOW, FULL, WINDOW, WINDOW], num_blocks=10)


def test_the_lessons_six_layer_model():
    plan = lesson_plan()
    assert plan.group_layers == (("layers.0", "layers.3"), ("layers.1", "layers.4"), ("layers.2", "layers.5"))
    assert [s.block_size for s in plan.group_specs] == [16, 32, 32]
    assert plan.page_size_bytes == 65_536 and all(s.page_size_bytes == 65_536 for s in plan.group_specs)
    assert plan.bytes_per_block == 131_072  # two layers' pages per block id
    assert plan.size == 1_310_720
    assert len(plan.kv_cache_tensors) == 3  # one per group
    for t, layers in zip(plan.kv_cache_tensors, plan.group_layers):
        assert t == KVCacheTensor(size=1_310_720, layers=layers, layer_stride=655_360, block_stride=65_536, offset=0)
    assert plan.regions() == [
        (0, 655_360, ("layers.0", "layers.1", "layers.2")),
        (655_360, 1_310_720, ("layers.3", "layers.4", "layers.5")),
    ]


def test_a_block_id_is_the_same_bytes_for_every_layer_that_shares_them():
    plan = lesson_plan()
    for b in range(10):
        assert {plan.page_offset(f"layers.{i}", b) for i in (0, 1, 2)} == {b * 65_536}
        assert {plan.page_offset(f"layers.{i}", b) for i in (3, 4, 5)} == {655_360 + b * 65_536}
    assert plan.page_offset("layers.4", 5) == 983_040
    with pytest.raises(ValueError):
        plan.page_offset("layers.0", 10)


def test_the_groups_feed_kvlabs_manager_and_its_block_ids_land_in_the_buffer():
    plan = lesson_plan()
    mgr = KVCacheManager(num_blocks=plan.num_blocks, block_size=16, kv_cache_groups=list(plan.group_specs))
    r = Request("A", list(range(64)))
    hits, n = mgr.get_computed_blocks(r)
    tables = mgr.allocate_slots(r, 64, n, hits).get_block_ids()
    assert tables == ([1, 2, 3, 4], [5, 6], [7, 8])
    # the pages of different groups never overlap: each id is held by one group
    pages = {plan.page_offset(layers[0], b) for layers, t in zip(plan.group_layers, tables) for b in t}
    assert len(pages) == 8


def test_uneven_kinds_pad_the_last_group():
    # 2 full + 3 window layers: 3 >= 1.5 x 2, so groups of 2; the window kind needs 2 groups, one with a single layer
    plan = plan_kv_cache_layout({"f0": FULL, "w0": WINDOW, "w1": WINDOW, "f1": FULL, "w2": WINDOW}, num_blocks=4)
    assert plan.group_layers == (("f0", "f1"), ("w0", "w2"), ("w1",))
    assert plan.bytes_per_block == 2 * 65_536 and plan.size == 524_288
    assert plan.regions() == [(0, 262_144, ("f0", "w0", "w1")), (262_144, 524_288, ("f1", "w2"))]
    # counts within 1.5x of each other: the largest count is the group size (vLLM's gpt-oss case)
    close = plan_kv_cache_layout([FULL, WINDOW] * 3 + [FULL], num_blocks=4)  # 4 full, 3 window: 4 < 1.5 x 3
    assert close.group_layers == (("layers.0", "layers.2", "layers.4", "layers.6"), ("layers.1", "layers.3", "layers.5"))
    assert close.bytes_per_block == 4 * 65_536
    assert len(close.regions()) == 4 and close.regions()[3] == (786_432, 1_048_576, ("layers.6",))


def test_a_mamba_page_is_padded_to_the_attention_page():
    mamba = MambaSpec(block_size=16)  # one state of 34,816 bytes, whatever the block size
    plan = plan_kv_cache_layout([FULL, mamba, mamba, mamba], num_blocks=3)
    assert plan.page_size_bytes == 65_536
    assert plan.group_specs[1].page_size_padded == 65_536 and plan.group_specs[1].state_size_bytes == 34_816
    assert plan.group_layers == (("layers.0",), ("layers.1",), ("layers.2",), ("layers.3",))
    assert plan.regions() == [(0, 196_608, ("layers.0", "layers.1", "layers.2", "layers.3"))]


def test_bad_input():
    with pytest.raises(ValueError):
        plan_kv_cache_layout([], num_blocks=4)
    with pytest.raises(ValueError):
        plan_kv_cache_layout([FULL], num_blocks=1)
    with pytest.raises(ValueError):
        plan_kv_cache_layout([FullAttentionSpec()], num_blocks=4)  # no block size


def test_the_figure_fits_the_lesson_and_labels_every_page():
    plan = lesson_plan()
    fig = layout_figure(plan, ([1, 2, 3, 4], [5, 6], [7, 8]), block=5, title="t")
    assert fig.layout.width <= 848
    texts = [a.text for a in fig.layout.annotations]
    assert texts.count("5<br>G1") == 2 and texts.count("∅") == 2 and texts.count("9") == 2
    assert "byte 327,680" in texts and "byte 983,040" in texts
