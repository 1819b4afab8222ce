"""Lesson 02, section 9: how many blocks the pool gets, and the plan the workers allocate.

kvlab's engine takes ``num_blocks`` as an argument, so a lesson can pick 11. vLLM never asks
for a count: at start-up it measures memory and derives one. This module does the same
arithmetic as vLLM 0.33, step by step, so a lesson can print every intermediate number:

1. :func:`requested_memory` -- the share of the GPU this engine may use,
   ``ceil(total x gpu_memory_utilization)`` (vLLM: ``request_memory`` in
   ``vllm/v1/worker/utils.py``);
2. :func:`kv_cache_budget` -- that share minus what is not KV cache: the weights, the peak
   of the profiling forward pass above what stays allocated, memory outside torch (CUDA
   context, NCCL, ...), and the CUDA-graph estimate (vLLM:
   ``Worker.determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``, with
   ``memory_profiling`` in ``vllm/utils/mem_utils.py``);
3. :func:`get_kv_cache_config` -- the budget divided by the bytes one block costs in *every*
   layer gives ``num_blocks``, and the plan for one allocation holding all layers (vLLM:
   ``get_kv_cache_configs`` and ``get_kv_cache_config_from_groups`` in
   ``vllm/v1/core/kv_cache_planning.py``).

Why a separate little model of this instead of vLLM's classes: vLLM's version needs a
``VllmConfig``, a profiled GPU and the attention backends; here the inputs are plain numbers,
so the same function sizes the lesson's CPU pool and a Llama-3-8B server on paper. Only one
KV-cache group with one spec for every layer (a plain full-attention model) and vLLM's
default layer-outermost layout are covered; hybrid models (several groups sharing one page
size) are lesson 07's subject.
"""

from __future__ import annotations

import math
from typing import Sequence

from kvlab.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvlab.utils.checks import check_int

__all__ = ["GiB", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor", "get_kv_cache_config", "kv_cache_budget", "requested_memory"]

GiB = 1 << 30


def requested_memory(total_bytes: int, gpu_memory_utilization: float) -> int:
    """The bytes this engine may use: ``ceil(total_bytes * gpu_memory_utilization)``, computed
    in floating point exactly as vLLM 0.33 does (its default utilization is 0.92)."""
    total_bytes = check_int("total_bytes", total_bytes, 1)
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
        raise TypeError(f"gpu_memory_utilization must be a number, got {type(gpu_memory_utilization).__name__}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    return math.ceil(total_bytes * gpu_memory_utilization)


def kv_cache_budget(
    total_bytes: int, gpu_memory_utilization: float, *, weights: int, peak_activations: int, non_torch: int, cuda_graphs: int = 0
) -> int:
    """Bytes left for the KV cache: the requested share minus everything that is not KV cache.

    ``weights``: the model's parameters; ``peak_activations``: how far the profiling forward
    pass rose above what stayed allocated after it; ``non_torch``: memory the engine took
    outside torch's allocator; ``cuda_graphs``: the estimate for captured CUDA graphs (vLLM
    0.33 subtracts it unless ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``). A budget of zero
    or less is refused, as vLLM refuses to start with "no available memory for the cache
    blocks"."""
    parts = {"weights": weights, "peak_activations": peak_activations, "non_torch": non_torch, "cuda_graphs": cuda_graphs}
    for name, value in parts.items():
        check_int(name, value, 0)
    budget = requested_memory(total_bytes, gpu_memory_utilization) - sum(parts.values())
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {gpu_memory_utilization} x {total_bytes:,} bytes "
            f"is used up by {', '.join(f'{k}={v:,}' for k, v in parts.items())}; raise "
            f"gpu_memory_utilization or use a GPU with more memory"
        )
    return budget


def get_kv_cache_config(layer_names: Sequence[str], spec: AttentionSpec, available_memory: int) -> KVCacheConfig:
    """Turn a KV budget into a :class:`KVCacheConfig` for one group of identical attention
    layers, as vLLM 0.33 does with its default layout (each layer one contiguous region,
    blocks in order inside it):

    * bytes per block = the spec's page (``2 x block_size x num_kv_heads x head_size x
      dtype bytes`` for full attention) times the number of layers;
    * ``num_blocks = available_memory // bytes_per_block`` (block 0 among them: the null block);
    * one backing allocation of ``num_blocks x bytes_per_block`` bytes, in which layer ``l``
      starts at ``l x page x num_blocks`` and block ``b`` of it ``b x page`` further on.
    """
    layers = tuple(layer_names)
    if not layers or not all(isinstance(n, str) for n in layers):
        raise ValueError(f"layer_names must be a non-empty sequence of str, got {layer_names!r}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layer_names has duplicates: {layer_names!r}")
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an attention spec (kvlab.kv_cache_interface), got {type(spec).__name__}")
    available_memory = check_int("available_memory", available_memory, 0)
    page = spec.page_size_bytes  # raises if spec.block_size is None
    bytes_per_block = page * len(layers)
    num_blocks = available_memory // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"{available_memory:,} bytes hold {num_blocks} block(s) of {bytes_per_block:,} bytes; "
            "a pool needs at least 2 (block 0 is the null block)"
        )
    tensor = KVCacheTensor(size=num_blocks * bytes_per_block, layers=layers, layer_stride=page * num_blocks, block_stride=page)
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=(tensor,), kv_cache_groups=(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec),)
    )
