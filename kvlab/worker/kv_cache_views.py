"""One byte buffer for the whole KV cache, and each layer's view of it (vLLM 0.33:
``allocate_kv_cache`` in ``vllm/v1/worker/utils.py`` and ``create_kv_cache_views`` in
``vllm/v1/kv_cache_interface.py``).

vLLM 0.33 allocates the KV cache as one flat ``int8`` buffer. Every
:class:`~kvlab.kv_cache_interface.KVCacheTensor` of the config places its layers in it --
layer ``l``'s page of block ``b`` starts at ``offset + l * layer_stride + b * block_stride`` --
and each layer then gets a strided ``[B, H, N, C]`` view in its dtype, ordered in memory as the
:class:`~kvlab.kv_cache_layout.KVCacheLayout` says. Groups overlay one another (their block ids
come from one pool), so two groups' views may address the same bytes; a group whose layers
interleave inside a block (``block_stride`` = the pages of all of them) is *packed*, and an
offload can copy a block of every layer as one run.

kvlab's :class:`~kvlab.worker.model_runner.ModelRunner` keeps its own per-layer tensors (its
Triton kernels read ``[num_blocks, 2, block_size, heads, head_dim]``); this module is what an
offload connector or a lesson uses to lay a config out the way vLLM's worker does.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.kv_cache_interface import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
)


def torch_dtype(dtype: Any) -> torch.dtype:
    """A spec's dtype as torch's: a torch dtype as given, a name (``"bfloat16"``) looked up."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(dtype, dtype), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} names no torch dtype")
    return found


def create_kv_cache_views(
    raw: torch.Tensor,
    spec: KVCacheSpec,
    num_blocks: int,
    layout: KVCacheLayout,
    kv_cache_tensor: KVCacheTensor,
    kernel_block_size: int | None = None,
) -> list[torch.Tensor]:
    """Each of ``kv_cache_tensor``'s layers as a ``[B, H, N, C]`` view of the ``int8`` buffer
    ``raw`` (``C`` in elements of the spec's dtype, when it has one).

    The tensor's ``layer_stride`` and ``block_stride`` fix the two outer strides; the layout
    orders the rest. With kernel blocks smaller than the manager's, a manager block must be one
    dense page (no padding, no other layer's page inside it) to split into equal kernel blocks
    a constant stride apart -- otherwise ValueError, saying what to change."""
    if raw.dtype != torch.int8 or raw.dim() != 1:
        raise ValueError(f"raw must be a flat int8 buffer, got {raw.dtype} of shape {tuple(raw.shape)}")
    shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size)
    block_stride = kv_cache_tensor.block_stride
    ratio = shape[0] // num_blocks
    if ratio > 1:
        _, heads, states, content = compute_layer_kv_cache_shape_bytes(spec, 1)
        dense_page = heads * states * content
        if block_stride != dense_page:
            raise ValueError(
                f"the KVCacheTensor of layers {list(kv_cache_tensor.layers)} does not keep a layer's block as one dense page "
                f"(block_stride {block_stride} bytes, page {dense_page}: its layers share each block, or its pages are padded), "
                f"so a block cannot be split into {ratio} kernel blocks of {kernel_block_size} tokens; give the kernel the "
                f"spec's block size ({spec.block_size}), or lay the layers out one after another (block_stride = the page)"
            )
        block_stride //= ratio
    num_layers = len(kv_cache_tensor.layers)
    strides = compute_layout_strides(
        spec,
        num_blocks,
        num_layers,
        layout,
        kernel_block_size,
        fixed_strides=(kv_cache_tensor.layer_stride, block_stride, None, None, None),
    )
    whole = torch.as_strided(raw, (num_layers, *shape), strides, raw.storage_offset() + kv_cache_tensor.offset)
    dtype = getattr(spec, "dtype", None)
    return [whole[i] if dtype is None else whole[i].view(torch_dtype(dtype)) for i in range(num_layers)]


def allocate_kv_cache(
    kv_cache_config: KVCacheConfig,
    device: torch.device | str,
    layout: KVCacheLayout,
    kernel_block_sizes: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """One zeroed ``int8`` buffer for every tensor of the config, and a view per layer, by name.

    A layer whose spec lays its bytes out itself (``has_layer_views`` False) gets the raw
    buffer; a layer of no tensor (a group whose cache lives elsewhere) gets nothing."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        return {}
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"every KVCacheTensor must describe the same backing allocation; sizes {sorted(sizes)}")
    buf = torch.zeros(sizes.pop(), dtype=torch.int8, device=device)
    caches: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        first = tensor.layers[0]
        group_id = next((i for i, g in enumerate(kv_cache_config.kv_cache_groups) if first in g.layer_names), None)
        if group_id is None:
            raise ValueError(f"layer {first!r} of a KVCacheTensor is in no KV cache group")
        spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[first]
        if not spec.has_layer_views:
            caches.update((name, buf) for name in tensor.layers)
            continue
        kernel = kernel_block_sizes[group_id] if kernel_block_sizes is not None and group_id < len(kernel_block_sizes) else None
        views = create_kv_cache_views(buf, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor, kernel_block_size=kernel)
        caches.update(zip(tensor.layers, views))
    return caches


__all__ = ["allocate_kv_cache", "create_kv_cache_views", "torch_dtype"]
