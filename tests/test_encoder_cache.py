"""The encoder cache and the per-step encoder budget (lesson 14).

Four requests with images on a roomy KV pool, 12 tokens per step, an encoder budget of 8
embeddings per step and an encoder cache of 16: r0 encodes img-a, r1 (img-a again, at
another offset) reuses it, r2 encodes img-b and fills the cache, r3's img-c evicts the
oldest unreferenced entry (img-a). Each decision below was checked against vLLM 0.33's
``EncoderCacheManager`` and ``_try_schedule_encoder_inputs`` rules by hand.
"""

from __future__ import annotations

import pytest

from kvlab import MultiModalFeature as MM
from kvlab import Request
from kvlab.core.encoder_cache_manager import EncoderCacheManager, compute_encoder_budget
from kvlab.engine.llm_engine import build_engine
from kvlab.timeline import Timeline
from kvlab.eventlog.events import EncoderCacheEvicted, EncoderInputFreed, EncoderInputScheduled


def _story(**kw):
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=12, max_num_encoder_input_tokens=8, encoder_cache_size=16, **kw)
    eng.add_request(Request("r0", list(range(100, 120)), max_tokens=2, mm_features=[MM("img-a", offset=4, length=8)]))
    eng.add_request(Request("r1", list(range(200, 214)), max_tokens=2, mm_features=[MM("img-a", offset=2, length=8)]))
    eng.add_request(Request("r2", list(range(300, 316)), max_tokens=2, mm_features=[MM("img-b", offset=2, length=8)]))
    eng.add_request(Request("r3", list(range(400, 420)), max_tokens=2, mm_features=[MM("img-c", offset=6, length=8)]))
    rows = []
    while eng.has_unfinished_requests():
        so = eng.step().scheduler_output
        ecm = eng.scheduler.encoder_cache_manager
        ecm.check_invariants()
        rows.append(
            (
                so.step,
                dict(so.num_scheduled_tokens),
                dict(so.scheduled_encoder_inputs),
                list(so.free_encoder_mm_hashes),
                {h: sorted(r) for h, r in ecm.cached.items()},
                list(ecm.freeable),
            )
        )
    return eng, rows


def test_items_are_encoded_once_shared_by_hash_and_evicted_oldest_first() -> None:
    eng, rows = _story()
    assert rows == [
        (1, {"r0": 12}, {"r0": [0]}, [], {"img-a": []}, ["img-a"]),  # tokens 0-11 cover img-a: encoded, then passed
        (2, {"r0": 8, "r1": 4}, {}, [], {"img-a": ["r1"]}, []),  # r1's window reaches img-a: cached, referenced again
        (3, {"r0": 1, "r1": 10, "r2": 1}, {}, [], {"img-a": []}, ["img-a"]),
        (4, {"r1": 1, "r2": 11}, {"r2": [0]}, [], {"img-a": [], "img-b": []}, ["img-a", "img-b"]),
        (5, {"r2": 4, "r3": 8}, {"r3": [0]}, ["img-a"], {"img-b": [], "img-c": ["r3"]}, ["img-b"]),  # full: oldest goes
        (6, {"r2": 1, "r3": 11}, {}, [], {"img-b": [], "img-c": []}, ["img-b", "img-c"]),
        (7, {"r3": 1}, {}, [], {"img-b": [], "img-c": []}, ["img-b", "img-c"]),
        (8, {"r3": 1}, {}, [], {"img-b": [], "img-c": []}, ["img-b", "img-c"]),
    ]
    assert eng.executor.num_encoder_tokens_computed == 24  # three images, not four
    assert eng.executor.encoder_cache == {"img-b": 8, "img-c": 8}  # the worker dropped img-a when told
    words = [(e.step, e.describe()) for e in eng.events if isinstance(e, (EncoderInputScheduled, EncoderInputFreed, EncoderCacheEvicted))]
    assert words == [
        (1, "encode img-a (8 embeddings) for r0"),
        (1, "r0 done with img-a (now unreferenced)"),
        (2, "reuse cached img-a (8 embeddings) for r1"),
        (3, "r1 done with img-a (now unreferenced)"),
        (4, "encode img-b (8 embeddings) for r2"),
        (4, "r2 done with img-b (now unreferenced)"),
        (5, "encoder cache: evict ['img-a']"),
        (5, "encode img-c (8 embeddings) for r3"),
        (6, "r3 done with img-c (now unreferenced)"),
    ]


def test_the_replayed_encoder_cache_equals_the_live_one() -> None:
    eng, rows = _story()
    tl = Timeline(eng.events)
    for step, *_, cached, freeable in rows:
        ec = tl.at(step).encoder_cache
        assert {e.mm_hash: sorted(e.requests) for e in ec.entries} == cached and ec.freeable == freeable
        assert ec.cache_size == 16 and ec.num_used == 8 * len(cached)
    assert tl.at(5).encoder_cache.scheduled == [("r3", "img-c", True)]
    assert tl.at(2).encoder_cache.scheduled == [("r1", "img-a", False)]


def test_the_encoder_budget_cuts_a_chunk_before_an_item() -> None:
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=32, max_num_encoder_input_tokens=8, encoder_cache_size=32)
    eng.add_request(Request("a", list(range(16)), max_tokens=1, mm_features=[MM("x", offset=0, length=8)]))
    eng.add_request(Request("b", list(range(100, 116)), max_tokens=1, mm_features=[MM("y", offset=6, length=8)]))
    so = eng.step().scheduler_output
    # a's image takes the whole budget: b runs up to its image and waits for the next step
    assert so.num_scheduled_tokens == {"a": 16, "b": 6} and so.scheduled_encoder_inputs == {"a": [0]}
    so = eng.step().scheduler_output
    assert so.num_scheduled_tokens == {"b": 10} and so.scheduled_encoder_inputs == {"b": [0]}


def test_a_prefix_hit_past_an_item_needs_no_encoder() -> None:
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    img = [MM("img", offset=0, length=8)]
    eng.add_request(Request("a", list(range(20)), max_tokens=1, mm_features=img))
    eng.run()
    eng.add_request(Request("b", list(range(20)) + [7], max_tokens=1, mm_features=img))
    so = eng.step().scheduler_output
    # b hits 20 tokens (5 blocks): the image lies inside the hit, so its encoder output is not needed
    assert eng.metrics["b"].num_cached_tokens == 20 and so.scheduled_encoder_inputs == {}
    assert eng.executor.num_encoder_tokens_computed == 8


def test_a_repeated_image_in_one_request_is_encoded_once() -> None:
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    eng.add_request(
        Request("a", list(range(30)), max_tokens=1, mm_features=[MM("img", offset=2, length=6), MM("img", offset=12, length=6)])
    )
    so = eng.step().scheduler_output
    assert so.scheduled_encoder_inputs == {"a": [0]} and eng.executor.num_encoder_tokens_computed == 6
    eng.run()
    assert eng.scheduler.encoder_cache_manager.freeable == {"img": 6}


def test_preemption_and_finish_drop_every_reference() -> None:
    eng = build_engine(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        eng.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + 10)), max_tokens=8, mm_features=[MM(f"img{i}", offset=1, length=4)]))
    eng.run()
    assert eng.scheduler.num_preemptions > 0
    ecm = eng.scheduler.encoder_cache_manager
    assert all(not refs for refs in ecm.cached.values()) and not ecm.request_cached_ids
    ecm.check_invariants()


def test_the_executor_refuses_to_run_a_token_whose_image_was_never_encoded() -> None:
    from kvlab.core.sched import scheduler as sched_mod

    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    eng.add_request(Request("a", list(range(16)), max_tokens=1, mm_features=[MM("x", offset=4, length=8)]))
    orig = sched_mod.Scheduler._try_schedule_encoder_inputs
    sched_mod.Scheduler._try_schedule_encoder_inputs = lambda self, r, nc, n, b: ([], [], n, b)  # a scheduler that forgets
    try:
        with pytest.raises(RuntimeError, match="not in the encoder cache"):
            eng.step()
    finally:
        sched_mod.Scheduler._try_schedule_encoder_inputs = orig


def test_manager_unit_and_bad_input() -> None:
    ecm = EncoderCacheManager(10)
    r = Request("r", list(range(12)), mm_features=[MM("a", offset=0, length=6), MM("b", offset=6, length=6)])
    assert ecm.can_allocate(r, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    assert not ecm.can_allocate(r, 1, encoder_compute_budget=10, num_embeds_to_schedule=6)  # 12 > 10 slots
    assert not ecm.can_allocate(r, 1, encoder_compute_budget=5, num_embeds_to_schedule=0)  # budget
    ecm.allocate(r, 0)
    assert ecm.num_free_slots == 4 and ecm.get_cached_input_ids(r) == {0}
    ecm.free(r)
    assert ecm.freeable == {"a": 6} and ecm.num_freeable_slots == 10
    assert ecm.can_allocate(r, 1, 10, 0) and ecm.get_freed_mm_hashes() == ["a"]
    assert compute_encoder_budget(64, None, None) == (64, 64)
    assert compute_encoder_budget(64, 8, 16, max_tokens_per_item=20) == (20, 20)
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="item 'big' has 20 embeddings, more than the encoder budget"):
        eng.add_request(Request("x", list(range(30)), mm_features=[MM("big", offset=0, length=20)]))
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens=0 is out of range"):
        build_engine(num_blocks=8, block_size=4, max_num_encoder_input_tokens=0)


# -- is_embed: placeholder positions without an embedding (vLLM 0.33's PlaceholderRange.is_embed) ---
MASK = [False, True, True, False, True, True]  # 6 placeholder positions, 4 embeddings


def test_only_embedding_positions_take_cache_room_and_budget_as_in_vllm() -> None:
    """The values vLLM 0.33.0's own EncoderCacheManager and PlaceholderRange give for the same calls."""
    ecm = EncoderCacheManager(cache_size=10)
    r = Request("a", list(range(12)), max_tokens=2, mm_features=[MM("img", offset=2, length=6, is_embed=MASK)])
    assert r.get_num_encoder_embeds(0) == 4
    assert [ecm.can_allocate(r, 0, 3, 0), ecm.can_allocate(r, 0, 4, 0), ecm.can_allocate(r, 0, 4, 7)] == [False, True, False]
    ecm.allocate(r, 0)
    assert ecm.num_free_slots == 6
    r2 = Request("b", list(range(12)), max_tokens=2, mm_features=[MM("img", offset=2, length=6, is_embed=MASK)])
    assert ecm.check_and_update_cache(r2, 0) and ecm.num_free_slots == 6
    f = r.mm_features[0]
    spans = [(0, 1), (0, 3), (1, 4), (3, 6), (0, 6)]
    assert [f.get_embeds_indices_in_range(a, b) for a, b in spans] == [(0, 0), (0, 2), (0, 2), (2, 4), (0, 4)]
    assert MM("img", offset=0, length=3).get_embeds_indices_in_range(1, 3) == (1, 3)  # no mask: every position


def test_the_scheduler_counts_embeddings_not_placeholder_tokens() -> None:
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=32, max_num_encoder_input_tokens=8, encoder_cache_size=32)
    half = [False, True] * 4  # 8 positions, 4 embeddings
    eng.add_request(Request("a", list(range(16)), max_tokens=1, mm_features=[MM("x", offset=0, length=8, is_embed=half)]))
    eng.add_request(Request("b", list(range(100, 116)), max_tokens=1, mm_features=[MM("y", offset=6, length=8, is_embed=half)]))
    so = eng.step().scheduler_output
    # Both items fit the budget of 8 (4 embeddings each); without the masks b would wait (see above).
    assert so.num_scheduled_tokens == {"a": 16, "b": 16} and so.scheduled_encoder_inputs == {"a": [0], "b": [0]}
    assert eng.executor.num_encoder_tokens_computed == 8
    # An item of 10 positions and 8 embeddings is within a budget of 8.
    eng.add_request(
        Request(
            "c",
            list(range(200, 216)),
            max_tokens=1,
            mm_features=[MM("z", offset=0, length=10, is_embed=[False, True] + [True] * 7 + [False])],
        )
    )
    with pytest.raises(ValueError, match="item 'w' has 9 embeddings, more than the encoder budget"):
        eng.add_request(
            Request("d", list(range(300, 316)), max_tokens=1, mm_features=[MM("w", offset=0, length=10, is_embed=[True] * 9 + [False])])
        )


def test_a_chunk_without_an_embedding_of_the_item_encodes_nothing_yet() -> None:
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=4, max_num_encoder_input_tokens=8, encoder_cache_size=32)
    late = [False] * 4 + [True] * 4  # the item's embeddings sit on its last 4 positions
    eng.add_request(Request("a", list(range(12)), max_tokens=1, mm_features=[MM("x", offset=0, length=8, is_embed=late)]))
    first, second = (eng.step().scheduler_output for _ in range(2))
    assert (first.num_scheduled_tokens, first.scheduled_encoder_inputs) == ({"a": 4}, {})
    assert (second.num_scheduled_tokens, second.scheduled_encoder_inputs) == ({"a": 4}, {"a": [0]})


@pytest.mark.parametrize(
    "mask, exc, match",
    [
        ([True, False], ValueError, r"is_embed has 2 entries; it needs one per placeholder position \(3\)"),
        ([1, 0, 1], TypeError, "is_embed must be None or a sequence of bools"),
        ("yes", TypeError, "is_embed must be None or a sequence of bools"),
    ],
)
def test_a_bad_is_embed_is_refused(mask, exc, match) -> None:
    with pytest.raises(exc, match=match):
        MM("img", offset=0, length=3, is_embed=mask)
