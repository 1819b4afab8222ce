"""kvlab.lessons.pool_sizing: vLLM 0.33's memory -> block-count arithmetic, with exact values."""

from __future__ import annotations

import pytest

from kvlab.kv_cache_interface import FullAttentionSpec
from kvlab.lessons.pool_sizing import (
    LLAMA_3_8B,
    QWEN2_5_0_5B,
    GiB,
    ModelShape,
    get_kv_cache_config,
    kv_cache_budget,
    plan_pool,
    requested_memory,
)

LLAMA3_8B = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
LLAMA3_8B_WEIGHTS = 8_030_261_248 * 2  # parameters x bf16


def test_requested_memory_rounds_up_like_vllm():
    # 80 GiB x 0.92 = 79,027,398,246.4 in floating point: vLLM takes the ceiling
    assert requested_memory(80 * GiB, 0.92) == 79_027_398_247
    assert requested_memory(80 * GiB, 1.0) == 80 * GiB
    assert requested_memory(1000, 0.5) == 500


def test_budget_subtracts_every_non_kv_part():
    budget = kv_cache_budget(
        80 * GiB, 0.92, weights=LLAMA3_8B_WEIGHTS, peak_activations=3 * GiB // 2, non_torch=GiB // 2, cuda_graphs=GiB // 2
    )
    assert budget == 79_027_398_247 - 16_060_522_496 - 2_684_354_560 == 60_282_521_191
    assert kv_cache_budget(1000, 0.5, weights=100, peak_activations=50, non_torch=25) == 325


def test_llama3_8b_on_80_gib():
    assert LLAMA3_8B.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65_536
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(32)]
    cfg = get_kv_cache_config(layers, LLAMA3_8B, 60_282_521_191)
    assert cfg.bytes_per_block == 32 * 65_536 == 2 * 2**20
    assert cfg.num_blocks == 60_282_521_191 // 2_097_152 == 28_744
    (t,) = cfg.kv_cache_tensors
    assert t.size == 28_744 * 2_097_152 == 60_280_537_088
    assert t.layers == tuple(layers) and t.offset == 0
    assert t.layer_stride == 65_536 * 28_744 and t.block_stride == 65_536
    assert t.layer_stride * 32 == t.size  # the layers tile the allocation exactly
    (g,) = cfg.kv_cache_groups
    assert g.layer_names == tuple(layers) and g.kv_cache_spec == LLAMA3_8B
    assert cfg.layer_view_shape() == (28_744, 8, 16, 256)


def test_tiny_model_pool_of_the_lesson():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=32, dtype="float32")
    cfg = get_kv_cache_config(["layers.0", "layers.1"], spec, 45_056)
    assert (spec.page_size_bytes, cfg.bytes_per_block, cfg.num_blocks) == (2_048, 4_096, 11)
    assert cfg.kv_cache_tensors[0].size == 45_056
    # a budget one byte short loses a whole block
    assert get_kv_cache_config(["layers.0", "layers.1"], spec, 45_055).num_blocks == 10


def test_refusals():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=32, dtype="float32")
    with pytest.raises(ValueError, match="no memory left"):
        kv_cache_budget(GiB, 0.5, weights=GiB // 2, peak_activations=0, non_torch=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        requested_memory(GiB, 1.5)
    with pytest.raises(TypeError):
        requested_memory(GiB, True)
    with pytest.raises(ValueError, match="null block"):
        get_kv_cache_config(["a"], spec, 2_048 * 2 - 1)
    with pytest.raises(ValueError, match="duplicates"):
        get_kv_cache_config(["a", "a"], spec, 10**6)
    with pytest.raises(ValueError, match="block_size is None"):
        get_kv_cache_config(["a"], FullAttentionSpec(num_kv_heads=2, head_size=32), 10**6)
    with pytest.raises(TypeError):
        get_kv_cache_config(["a"], "full", 10**6)


# --- a server on paper: model shape x GPU x KV dtype x tensor parallelism ------------------------
ASSUMED = dict(peak_activations=3 * GiB // 2, non_torch=GiB // 2, cuda_graphs=GiB // 2)


def test_the_model_shapes_count_the_published_parameters():
    # Llama-3-8B: 8,030,261,248; Qwen2.5-0.5B (tied embeddings, q/k/v biases): 494,032,768.
    assert LLAMA_3_8B.num_params == 8_030_261_248
    assert QWEN2_5_0_5B.num_params == 494_032_768
    # Tensor parallelism splits all but the norms; KV heads split, at least one a rank.
    assert LLAMA_3_8B.params_per_rank(2) == (8_030_261_248 - 65 * 4096) // 2 + 65 * 4096
    assert [QWEN2_5_0_5B.kv_heads_per_rank(tp) for tp in (1, 2, 4)] == [2, 1, 1]


@pytest.mark.parametrize(
    ("model", "gib", "kv", "tp", "num_blocks", "bytes_per_block"),
    [
        (LLAMA_3_8B, 80, "bfloat16", 1, 28_744, 2_097_152),  # the lesson's first figure, by the other road
        (LLAMA_3_8B, 80, "fp8", 1, 57_489, 1_048_576),
        (LLAMA_3_8B, 80, "bfloat16", 2, 65_147, 1_048_576),
        (LLAMA_3_8B, 16, "float16", 2, 4_854, 1_048_576),
        (QWEN2_5_0_5B, 80, "bfloat16", 1, 383_275, 196_608),
        (QWEN2_5_0_5B, 16, "fp8", 2, 256_897, 49_152),
    ],
)
def test_plan_pool_sizes_a_server_per_gpu(model, gib, kv, tp, num_blocks, bytes_per_block):
    p = plan_pool(model, gib * GiB, kv_dtype=kv, tensor_parallel_size=tp, **ASSUMED)
    assert (p.num_blocks, p.bytes_per_block, p.num_tokens) == (num_blocks, bytes_per_block, 16 * num_blocks)
    assert p.budget == p.share - p.weights - sum(ASSUMED.values()) and p.num_blocks == p.budget // p.bytes_per_block


def test_a_server_whose_weights_fill_the_share_does_not_start():
    p = plan_pool(LLAMA_3_8B, 16 * GiB, kv_dtype="float16", **ASSUMED)
    assert not p.fits and p.num_blocks == 0 and p.num_tokens == 0
    assert p.weights == 16_060_522_496 > p.share == requested_memory(16 * GiB, 0.92) and p.budget < 0


def test_plan_pool_refuses_bad_arguments_by_name():
    with pytest.raises(TypeError, match="model must be a ModelShape, got str"):
        plan_pool("llama", 80 * GiB, **ASSUMED)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan_pool(LLAMA_3_8B, 80 * GiB, tensor_parallel_size=0, **ASSUMED)
    with pytest.raises(ValueError, match="dtype must be one of"):
        plan_pool(LLAMA_3_8B, 80 * GiB, kv_dtype="fp4", **ASSUMED)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_pool(LLAMA_3_8B, 80 * GiB, gpu_memory_utilization=1.5, **ASSUMED)
    # Refused even where it would have made the weights fit (it once did: 2,438 blocks on a T4).
    with pytest.raises(ValueError, match="peak_activations"):
        plan_pool(LLAMA_3_8B, 16 * GiB, peak_activations=-5 * GiB, non_torch=0)
    small = ModelShape("toy", 2, 64, 4, 4, 16, 128, 1000)
    assert small.num_params == 1000 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128) + 5 * 64
