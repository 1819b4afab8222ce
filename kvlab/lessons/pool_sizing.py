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
   ``vllm/v1/core/kv_cache_planning.py``);
4. :func:`plan_pool` -- the three for one GPU of a whole server, from a model's shape
   (:class:`ModelShape`), the KV cache's dtype and the tensor-parallel size: each rank holds
   its slice of the weights and of the KV heads (vLLM's ``ModelConfig.get_num_kv_heads``).

Why a separate little model of this instead of vLLM's classes: vLLM's version needs a
``VllmConfig``, a profiled GPU and the attention backends; here the inputs are plain numbers,
so the same function sizes the lesson's CPU pool and a Llama-3-8B server on paper. Only one
KV-cache group with one spec for every layer (a plain full-attention model) and vLLM's
default layer-outermost layout are covered; hybrid models (several groups sharing one page
size) are lesson 07's subject.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvlab.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvlab.utils.checks import check_int

__all__ = [
    "GiB",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "LLAMA_3_8B",
    "ModelShape",
    "PoolPlan",
    "QWEN2_5_0_5B",
    "get_kv_cache_config",
    "kv_cache_budget",
    "plan_pool",
    "requested_memory",
]

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
    budget, parts = _budget_left(total_bytes, gpu_memory_utilization, weights, peak_activations, non_torch, cuda_graphs)
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {gpu_memory_utilization} x {total_bytes:,} bytes "
            f"is used up by {', '.join(f'{k}={v:,}' for k, v in parts.items())}; raise "
            f"gpu_memory_utilization or use a GPU with more memory"
        )
    return budget


def _budget_left(
    total_bytes: int, gpu_memory_utilization: float, weights: int, peak_activations: int, non_torch: int, cuda_graphs: int
) -> tuple[int, dict[str, int]]:
    """:func:`kv_cache_budget`'s arithmetic, every argument checked, without its refusal: the
    budget (zero or less when nothing is left) and the parts subtracted."""
    parts = {"weights": weights, "peak_activations": peak_activations, "non_torch": non_torch, "cuda_graphs": cuda_graphs}
    for name, value in parts.items():
        check_int(name, value, 0)
    return requested_memory(total_bytes, gpu_memory_utilization) - sum(parts.values()), parts


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


# --- the same arithmetic for a whole server: a model's shape, a GPU, a KV dtype, TP ranks ---------
@dataclass(frozen=True)
class ModelShape:
    """What a dense decoder's weights and KV pages depend on (the fields of its ``config.json``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False  # one matrix for the input embedding and the LM head
    qkv_bias: bool = False

    @property
    def num_replicated_params(self) -> int:
        """The RMSNorm weights: two per layer and a final one. Every TP rank keeps a copy."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp) + self.num_replicated_params

    def params_per_rank(self, tensor_parallel_size: int) -> int:
        """The parameters one of ``tensor_parallel_size`` GPUs holds: vLLM splits the attention
        and MLP matrices and the vocabulary across the ranks and copies the norms (the rare
        copies of K/V heads when there are fewer heads than ranks are left out)."""
        rep = self.num_replicated_params
        return math.ceil((self.num_params - rep) / tensor_parallel_size) + rep

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """vLLM's ``ModelConfig.get_num_kv_heads``: the KV heads split across the ranks, at
        least one each (a rank with more ranks than heads keeps a copy of one)."""
        return max(1, self.num_kv_heads // tensor_parallel_size)


#: Llama-3-8B and Qwen2.5-0.5B, from their ``config.json`` (8,030,261,248 and 494,032,768 parameters).
LLAMA_3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14_336, 128_256)
QWEN2_5_0_5B = ModelShape("Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4_864, 151_936, tied_embeddings=True, qkv_bias=True)


@dataclass(frozen=True)
class PoolPlan:
    """One GPU's share of a server, as :func:`plan_pool` works it out. Every rank of a
    tensor-parallel server gets the same plan, so ``num_blocks`` is the engine's pool."""

    model: str
    gpu_bytes: int
    kv_dtype: str
    tensor_parallel_size: int
    weights: int  # bytes of weights on one GPU
    share: int  # ceil(gpu_bytes x gpu_memory_utilization)
    budget: int  # what is left for the KV cache (<= 0: the server does not start)
    bytes_per_block: int  # one block in every layer, on one GPU
    num_blocks: int  # 0 when it does not start
    block_size: int

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_pool(
    model: ModelShape,
    gpu_bytes: int,
    *,
    kv_dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    weight_bytes: int = 2,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.92,
    peak_activations: int,
    non_torch: int,
    cuda_graphs: int = 0,
) -> PoolPlan:
    """How many blocks a server of ``model`` gets on GPUs of ``gpu_bytes`` each: the three
    steps above on one tensor-parallel rank -- its share, minus its part of the weights
    (``weight_bytes`` a parameter: 2 for bf16/fp16 checkpoints) and the profiled amounts,
    divided by one block of its KV heads in ``kv_dtype`` (vLLM's ``--kv-cache-dtype``: "fp8"
    halves a page) in every layer. A plan that leaves no budget has ``num_blocks == 0``: vLLM
    refuses to start there."""
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a ModelShape, got {type(model).__name__}")
    tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    weight_bytes = check_int("weight_bytes", weight_bytes, 1)
    spec = AttentionSpec(block_size=block_size, num_kv_heads=model.kv_heads_per_rank(tp), head_size=model.head_dim, dtype=kv_dtype)
    weights = model.params_per_rank(tp) * weight_bytes
    share = requested_memory(gpu_bytes, gpu_memory_utilization)
    bytes_per_block = spec.page_size_bytes * model.num_layers
    budget = _budget_left(gpu_bytes, gpu_memory_utilization, weights, peak_activations, non_torch, cuda_graphs)[0]
    num_blocks = 0
    if budget > 0:  # else the server does not start
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
        num_blocks = get_kv_cache_config(layers, spec, budget).num_blocks
    return PoolPlan(model.name, gpu_bytes, kv_dtype, tp, weights, share, budget, bytes_per_block, num_blocks, block_size)
