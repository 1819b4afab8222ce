"""Lesson 07b, section 4: a real hybrid's block size, as vLLM 0.33 works it out at start-up.

The expected numbers were computed with vLLM 0.33.0's own classes: ``MambaStateShapeCalculator.
gated_delta_net_state_shape`` for Qwen3-Next's state, ``MambaSpec``/``FullAttentionSpec``
``page_size_bytes``, and ``Platform._align_hybrid_block_size``'s rule with FlashAttention's
kernel blocks (multiples of 16). vLLM logs "Setting attention block size to 544 tokens" and
"Padding mamba page size by 1.49%" for this model."""

from __future__ import annotations

import pytest

from kvlab.lessons.hybrid_geometry import QWEN3_NEXT_80B_A3B, align_hybrid_block_size, hybrid_geometry


@pytest.mark.parametrize(
    "tp, attn, state, block_size, conv, recurrent",
    [
        (1, 2048, 1_097_728, 544, (3, 8192), (32, 128, 128)),
        (2, 1024, 548_864, 544, (3, 4096), (16, 128, 128)),
        (4, 1024, 274_432, 272, (3, 2048), (8, 128, 128)),  # one KV head per rank at least
    ],
)
def test_qwen3_next_geometry_per_rank(tp, attn, state, block_size, conv, recurrent) -> None:
    g = hybrid_geometry(QWEN3_NEXT_80B_A3B, tensor_parallel_size=tp)
    assert (g.attn_bytes_per_token, g.state_bytes, g.block_size) == (attn, state, block_size)
    assert QWEN3_NEXT_80B_A3B.state_shapes(tp) == (conv, recurrent)
    full, mamba = g.specs
    assert full.block_size == mamba.block_size == block_size
    assert full.page_size_bytes == mamba.page_size_bytes == g.page_size == block_size * attn
    assert round(g.padding_pct, 2) == 1.49
    assert QWEN3_NEXT_80B_A3B.num_full_attention_layers == 12


def test_the_alignment_rule() -> None:
    assert align_hybrid_block_size(2048, 1_097_728) == 544  # 16 x cdiv(1,097,728, 16 x 2,048)
    assert align_hybrid_block_size(2048, 32_768) == 16  # a state of exactly one 16-token page
    assert align_hybrid_block_size(2048, 32_769) == 32
    assert align_hybrid_block_size(2048, 1_000, block_size=64) == 64  # a larger configured block stays
    assert align_hybrid_block_size(2048, 1_097_728, kernel_block_alignment=64) == 576


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: align_hybrid_block_size(0, 10), "attn_page_size_1_token"),
        (lambda: align_hybrid_block_size(10, 10, block_size=0), "block_size"),
        (lambda: hybrid_geometry(QWEN3_NEXT_80B_A3B, tensor_parallel_size=3), "tensor_parallel_size = 3 does not divide"),
        (lambda: hybrid_geometry(QWEN3_NEXT_80B_A3B, tensor_parallel_size=0), "tensor_parallel_size"),
    ],
)
def test_bad_arguments_are_named(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()
