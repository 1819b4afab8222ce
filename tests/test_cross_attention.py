"""Encoder-decoder models (vLLM 0.33): a cross-attention group gets room for the encoder's
tokens, once; the encoder cache only counts embeddings in flight.

The expected values were given by vLLM 0.33.0's own ``KVCacheManager`` and
``EncoderDecoderCacheManager`` (the unpacked wheel) running the same calls beside kvlab's."""

from __future__ import annotations

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, Request
from kvlab.core.encoder_cache_manager import EncoderDecoderCacheManager
from kvlab.core.single_type_kv_cache_manager import CrossAttentionManager
from kvlab.kv_cache_interface import CrossAttentionSpec, get_kv_cache_spec_kind
from kvlab.request import MultiModalFeature

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
