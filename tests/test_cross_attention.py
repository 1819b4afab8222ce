"""Encoder-decoder models (vLLM 0.33): a cross-attention group gets room for the encoder's
tokens, once; the encoder cache only counts embeddings in flight.

The expected values were given by vLLM 0.33.0's own ``KVCacheManager`` and
``EncoderDecoderCacheManager`` (the unpacked wheel) running the same calls beside kvlab's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import FullAttentionSpec, KVCacheManager, Request
from kvlab.core.encoder_cache_manager import EncoderDecoderCacheManager
from kvlab.core.single_type_kv_cache_manager import CrossAttentionManager
from kvlab.kv_cache_interface import CrossAttentionSpec, get_kv_cache_spec_kind
from kvlab.request import MultiModalFeature
from replay_check import run_replaying

GROUPS = [FullAttentionSpec(block_size=4), CrossAttentionSpec(block_size=4)]


def _ids(blocks) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


def test_the_cross_attention_group_gets_the_encoders_tokens_once() -> None:
    m = KVCacheManager(num_blocks=24, kv_cache_groups=GROUPS, enable_caching=False, max_model_len=64)
    assert isinstance(m.coordinator.single_type_managers[1], CrossAttentionManager)
    a = Request("a", [1] * 6, max_tokens=30)
    # 6 decoder tokens: 2 blocks; 15 encoder tokens: 4 blocks, all at the first step.
    assert _ids(m.allocate_slots(a, 6, num_encoder_tokens=15)) == [[1, 2], [3, 4, 5, 6]]
    a.num_computed_tokens = 6
    grown = []
    for _ in range(4):
        a.append_output_token_ids(7)
        grown.append(_ids(m.allocate_slots(a, 1)))
        a.num_computed_tokens += 1
    assert grown == [[[], []], [[], []], [[7], []], [[], []]]  # only the decoder's table grows
    b = Request("b", [2] * 9, max_tokens=30)
    # 80 encoder tokens need 20 blocks: the whole sequence does not fit in the 16 free.
    assert m.allocate_slots(b, 9, num_encoder_tokens=80, full_sequence_must_fit=True) is None
    assert m.block_pool.get_num_free_blocks() == 16
    assert _ids(m.allocate_slots(b, 9, num_encoder_tokens=20)) == [[8, 9, 10], [11, 12, 13, 14, 15]]
    m.free(a)
    assert [x.block_id for x in m.block_pool.free_block_queue.get_all_free_blocks()] == [
        6, 5, 4, 3, 7, 2, 1, 16, 17, 18, 19, 20, 21, 22, 23,
    ]  # fmt: skip
    m.block_pool.check_invariants()


def test_bad_configurations_and_arguments_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"kv_cache_groups\[1\] is a CrossAttentionSpec: an encoder-decoder model runs with enable_caching=False"
    ):
        KVCacheManager(num_blocks=24, kv_cache_groups=GROUPS)
    m = KVCacheManager(num_blocks=24, kv_cache_groups=[FullAttentionSpec(block_size=4)])
    with pytest.raises(ValueError, match="num_encoder_tokens = 8, but this manager has no CrossAttentionSpec group"):
        m.allocate_slots(Request("a", [1] * 6), 6, num_encoder_tokens=8)
    m = KVCacheManager(num_blocks=24, kv_cache_groups=GROUPS, enable_caching=False)
    with pytest.raises(ValueError, match="num_encoder_tokens"):
        m.allocate_slots(Request("a", [1] * 6), 6, num_encoder_tokens=-1)
    assert m.block_pool.get_num_free_blocks() == 23
    assert get_kv_cache_spec_kind(GROUPS[1]) == "cross_attention"
    with pytest.raises(ValueError, match="never cached"):
        m.coordinator.single_type_managers[1].cache_blocks(Request("a", [1] * 6), 4)


def test_the_encoder_decoder_cache_keeps_nothing_and_frees_one_step_late() -> None:
    e = EncoderDecoderCacheManager(cache_size=20)
    feats = [MultiModalFeature(identifier="h1", offset=0, length=8), MultiModalFeature(identifier="h2", offset=15, length=6)]
    r1 = Request("r1", [0] * 40, mm_features=feats)
    r2 = Request("r2", [0] * 40, mm_features=feats[:1])
    assert e.check_and_update_cache(r1, 0) is False  # never shared, even with the same hash
    assert e.can_allocate(r1, 0, 100, 0)
    e.allocate(r1, 0)
    assert not e.can_allocate(r1, 1, 100, 8)  # 6 + 8 promised > 12 free
    e.allocate(r1, 1)
    assert (e.can_allocate(r2, 0, 100, 0), e.can_allocate(r2, 0, 5, 0), e.num_free_slots) == (False, False, 6)
    # Dropped by the worker one step after allocation: the step that used them runs first.
    assert (e.get_freed_mm_hashes(), e.get_freed_mm_hashes()) == ([], ["h1", "h2"])
    e.free(r1)
    assert (e.num_free_slots, e.get_cached_input_ids(r1)) == (20, {0, 1})
    with pytest.raises(ValueError, match="needs 8 embeddings but only 0 slots are free"):
        full = EncoderDecoderCacheManager(cache_size=0)
        full.allocate(r2, 0)


def test_giving_back_slots_a_request_does_not_hold_changes_nothing() -> None:
    """kvlab's one difference from vLLM 0.33 here: vLLM gives the slots back on every call,
    so its scheduler's per-step frees push the count past the cache size."""
    e = EncoderDecoderCacheManager(cache_size=20)
    r1 = Request("r1", [0] * 4, mm_features=[MultiModalFeature(identifier="au", offset=0, length=8)])
    r2 = Request("r2", [0] * 4, mm_features=[MultiModalFeature(identifier="au2", offset=0, length=8)])
    e.allocate(r1, 0)
    e.free(r2)  # never allocated
    e.free_encoder_input(r1, 0)
    e.free(r1)  # given back already
    assert (e.num_free_slots, e.held) == (20, {})
    e.check_invariants()


def whisper_like(max_tokens: int = 3):
    from kvlab.engine.llm_engine import build_engine

    eng = build_engine(
        num_blocks=40,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_encoder_input_tokens=24,
        encoder_cache_size=24,
        manager_kwargs=dict(kv_cache_groups=GROUPS, enable_caching=False),
    )
    for rid in "AB":  # a 3-token decoder prompt each, and 20 tokens of audio for the encoder
        eng.add_request(
            Request(rid, [7, 8, 9], max_tokens=max_tokens, mm_features=[MultiModalFeature(f"audio-{rid}", 0, 20, modality="audio")])
        )
    return eng


def test_an_encoder_decoder_run_encodes_each_input_once_and_gives_cross_attention_its_blocks() -> None:
    """Checked against vLLM 0.33: its ``_try_schedule_encoder_inputs`` with its
    ``EncoderDecoderCacheManager`` agreed with kvlab's on 576 stand-in cases (computed tokens,
    chunk, budget, free slots, input length, drafter shift), and the manager's allocation is
    vLLM's (above)."""
    eng = whisper_like()
    s, seen = eng.scheduler, []
    while eng.has_unfinished_requests():
        out = s.schedule()
        tables = {r: _ids(eng.kv_cache_manager.get_blocks(r)) for r in out.num_scheduled_tokens}
        seen.append((out.num_scheduled_tokens, out.scheduled_encoder_inputs, out.free_encoder_mm_hashes, tables))
        s.update_from_output(out, eng.executor.execute_model(out))
        s.check_invariants()
    assert seen == [
        # A's audio is encoded with its first chunk: 20 of the 24 embeddings this step, so B waits
        ({"A": 3}, {"A": [0]}, [], {"A": [[1], [2, 3, 4, 5, 6]]}),
        # the worker drops A's encoder output one step later; B's audio now fits
        ({"A": 1, "B": 3}, {"B": [0]}, ["audio-A"], {"A": [[1], [2, 3, 4, 5, 6]], "B": [[7], [8, 9, 10, 11, 12]]}),
        ({"A": 1, "B": 1}, {}, ["audio-B"], {"A": [[1, 13], [2, 3, 4, 5, 6]], "B": [[7], [8, 9, 10, 11, 12]]}),
        ({"B": 1}, {}, [], {"B": [[7, 6], [8, 9, 10, 11, 12]]}),
    ]
    assert (eng.kv_cache_manager.block_pool.get_num_free_blocks(), s.encoder_cache_manager.num_free_slots) == (39, 24)


def test_the_engine_runs_an_encoder_decoder_model_to_the_end() -> None:
    eng = whisper_like(max_tokens=5)
    eng.run()
    assert sorted(len(r.output_token_ids) for r in eng.finished.values()) == [5, 5]
    assert eng.executor.num_encoder_tokens_computed == 40  # each audio once


def test_where_an_encoder_input_may_sit_is_checked_per_model() -> None:
    from kvlab.core.sched.scheduler import Scheduler

    audio = [MultiModalFeature("au", 0, 20, modality="audio")]
    decoder_only = Scheduler(KVCacheManager(num_blocks=40, block_size=4), max_num_encoder_input_tokens=24, encoder_cache_size=24)
    with pytest.raises(ValueError, match=r"covers tokens \[0, 20\) but the prompt has 3; an encoder input longer than the prompt"):
        decoder_only.add_request(Request("A", [7, 8, 9], mm_features=audio))
    enc_dec = Scheduler(KVCacheManager(num_blocks=40, kv_cache_groups=GROUPS, enable_caching=False), max_num_encoder_input_tokens=24)
    with pytest.raises(ValueError, match="starts at token 2; an encoder-decoder model's encoder input starts at 0"):
        enc_dec.add_request(Request("B", [7] * 12, mm_features=[MultiModalFeature("im", 2, 4)]))
    with pytest.raises(ValueError, match=r"3 prompt \+ 4 max tokens \+ 80 encoder tokens need 22 blocks"):
        small = Scheduler(KVCacheManager(num_blocks=20, kv_cache_groups=GROUPS, enable_caching=False), max_num_encoder_input_tokens=80)
        small.add_request(Request("C", [7, 8, 9], max_tokens=4, mm_features=[MultiModalFeature("au", 0, 80, modality="audio")]))
    with pytest.raises(ValueError, match="only an encoder-decoder model's encoder input, at offset 0, may be longer"):
        Request("D", [7, 8, 9], mm_features=[MultiModalFeature("au", 1, 20)])


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=6),
    num_blocks=st.integers(24, 60),
    budget=st.sampled_from([4, 8, 16]),
    encoder_budget=st.sampled_from([40, 60, 100]),
)
def test_random_encoder_decoder_runs_keep_every_invariant_and_replay_exactly(requests, num_blocks, budget, encoder_budget) -> None:
    from kvlab.engine.llm_engine import build_engine

    eng = build_engine(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=encoder_budget,
        manager_kwargs=dict(kv_cache_groups=GROUPS, enable_caching=False),
    )
    for i, (prompt, audio, max_tokens) in enumerate(requests):
        r = Request(
            f"r{i}", list(range(prompt)), max_tokens=max_tokens, mm_features=[MultiModalFeature(f"au{i}", 0, audio, modality="audio")]
        )
        try:
            eng.scheduler.check_request(r)
        except ValueError:
            continue  # could never fit this pool
        eng.add_request(r)
    run_replaying(eng, max_steps=400, tables=True)
    assert eng.scheduler.encoder_cache_manager.num_free_slots == encoder_budget


def test_a_kv_connector_is_refused_for_an_encoder_decoder_model_as_vllm_does() -> None:
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    with pytest.raises(ValueError, match="Encoder-decoder models are not currently supported with KV connectors"):
        Scheduler(
            KVCacheManager(num_blocks=20, kv_cache_groups=GROUPS, enable_caching=False),
            connector=OffloadingConnector(KVConnectorRole.SCHEDULER, 4),
        )
