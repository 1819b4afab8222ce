"""What the offloading connector tells its backend about the engine (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``).

:func:`build_offloading_config` reads the engine's config and the KV-cache layout once and
hands the backend plain records (:class:`~kvlab.kv_offload.config.OffloadingConfig`):

* **which groups** (:func:`get_offloading_group_ids`): every prefix-cacheable group -- a
  scratch ring is left out -- or under HiSparse the indexer groups alone: the source
  group's K/V already lives whole in the host pool, so a second copy would only duplicate
  it, while the indexer keys stay on the GPU and are lost with it;
* **the chunk**: the unit a tier stores, ``blocks_per_chunk`` GPU blocks (from
  ``kv_connector_extra_config``: ``blocks_per_chunk``, or ``block_size`` in tokens);
* **a window group's reach** in chunks (:func:`get_sliding_window_size_in_chunks`): a load
  needs only the chunks the window still reads;
* **bytes per block** on one worker (what a tier reserves per block);
* **the parallel layout**: whether a block's bytes are the same under any split of the
  heads (then engines of other tensor-parallel sizes may share files), and whether every
  rank holds the same bytes (pure MLA: one copy serves all ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlab.core.kv_cache_utils import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes
from kvlab.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from kvlab.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:
    from kvlab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


def get_offloading_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """The ids of the groups the offloading connector stores and loads, in group order."""
    if kv_cache_config.hisparse_host_num_blocks is None:
        return kv_cache_config.prefix_cacheable_group_ids
    return tuple(i for i, group in enumerate(kv_cache_config.kv_cache_groups) if group.role is KVCacheGroupRole.HISPARSE_INDEXER)


def _group_kv_bytes_per_block(group: KVCacheGroupSpec) -> int:
    """The bytes one block of ``group`` takes on a worker, the same whether the group keeps
    its per-layer wrapper (a worker's config) or one representative spec (the scheduler's)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.page_size_bytes
    return spec.page_size_bytes * len(group.layer_names)


def get_sliding_window_size_in_chunks(kv_cache_spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    """How many chunks a request's attention can still read in a group of ``kv_cache_spec``
    (None: all of them -- full attention). A window of ``w`` tokens reads the ``w - 1``
    before the current one (plus any it is told to keep); chunked local attention reads back
    to its chunk's start; Mamba reads its one state."""
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        window = kv_cache_spec.sliding_window
        if window <= 0:
            raise ValueError(f"sliding_window must be positive, got {window}")
        reach = window - 1 + kv_cache_spec.extra_retained_tokens
        return max(cdiv(window, tokens_per_chunk), cdiv(reach, tokens_per_chunk))
    if isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
        if kv_cache_spec.attention_chunk_size <= 0:
            raise ValueError(f"attention_chunk_size must be positive, got {kv_cache_spec.attention_chunk_size}")
        return cdiv(kv_cache_spec.attention_chunk_size, tokens_per_chunk)
    if isinstance(kv_cache_spec, MambaSpec):
        return 1
    if not isinstance(kv_cache_spec, FullAttentionSpec):
        raise TypeError(f"no offload window rule for {type(kv_cache_spec).__name__}")
    return None


def resolve_blocks_per_chunk(extra_config: Any, group_tokens_per_block: tuple[int, ...]) -> int:
    """The chunk a tier stores, in GPU blocks: ``blocks_per_chunk`` as given, or
    ``block_size`` (tokens) over the groups' one block size; 1 when neither is set."""
    blocks = extra_config.get("blocks_per_chunk")
    tokens = extra_config.get("block_size")
    if blocks is not None and tokens is not None:
        raise ValueError("Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config.")
    if blocks is not None:
        if int(blocks) <= 0:
            raise ValueError("'blocks_per_chunk' must be greater than 0.")
        return int(blocks)
    if tokens is None:
        return 1
    tokens = int(tokens)
    sizes = set(group_tokens_per_block)
    if len(sizes) != 1:
        raise AssertionError(
            "If 'block_size' is specified in kv_connector_extra_config, there must be at least one KV cache group, "
            "and all groups must have the same block size."
        )
    (per_block,) = sizes
    if tokens % per_block:
        raise ValueError(
            f"'block_size'={tokens} in kv_connector_extra_config must be a multiple of the GPU KV cache block size "
            f"({per_block} tokens). Use {cdiv(tokens, per_block) * per_block} instead, or set 'blocks_per_chunk' to "
            "express the chunk size in blocks."
        )
    return tokens // per_block


def _canonical_certifiable(spec: KVCacheSpec, tp_size: int, total_kv_heads: int) -> bool:
    """Whether a layer's pages can be rewritten in the topology-free canonical layout (a
    static mirror of what the worker checks per layer): plain MLA with one latent row per
    token, or full/window attention whose heads split evenly, with no per-head scales."""
    if not isinstance(spec, AttentionSpec) or spec.kv_quant_mode.is_per_token_head:
        return False
    if type(spec) is MLAAttentionSpec:
        return spec.tokens_per_state == 1 and spec.real_page_size_bytes % spec.block_size == 0  # type: ignore[operator]  # a built spec has its block size
    if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)) or not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return False
    even = total_kv_heads % tp_size == 0 or tp_size % total_kv_heads == 0
    return even and spec.num_kv_heads == max(1, total_kv_heads // tp_size)


def build_offloading_config(vllm_config: Any, kv_cache_config: KVCacheConfig) -> OffloadingConfig:
    """The facts an offloading backend reads, from the engine's config and KV-cache layout."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        raise ValueError("build_offloading_config needs vllm_config.kv_transfer_config (the connector's config)")
    if transfer.engine_id is None:
        raise ValueError("kv_transfer_config.engine_id is not set")
    extra = transfer.kv_connector_extra_config
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    tp, dcp, pcp = parallel.tensor_parallel_size, parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size

    selected = [(gid, kv_cache_config.kv_cache_groups[gid]) for gid in get_offloading_group_ids(kv_cache_config)]
    if not selected:
        raise ValueError("KV offloading found no eligible cache groups.")
    tokens_per_block = tuple(resolve_dcp_kv_block_size(group.kv_cache_spec, dcp) for _, group in selected)
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    for size in tokens_per_block:
        if size % tokens_per_hash:
            raise AssertionError(
                f"tokens_per_block={size} not divisible by tokens_per_hash={tokens_per_hash}. Hybrid models "
                "(e.g. Mamba+Attention) need --enable-prefix-caching to align block sizes."
            )
    blocks_per_chunk = resolve_blocks_per_chunk(extra, tokens_per_block)
    groups = tuple(
        OffloadingGroupConfig(
            group_id=gid,
            tokens_per_block=size,
            layer_names=tuple(group.layer_names),
            sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(
                iter_layer_specs(group.kv_cache_spec)[0], size * blocks_per_chunk
            ),
        )
        for (gid, group), size in zip(selected, tokens_per_block)
    )

    # Bytes per block on one worker. The backing allocation is one buffer however many
    # tensors describe it, so its size over the block count keeps the worker's stride --
    # scratch groups the offload skips included (they share the stride). Under HiSparse, or
    # with no tensors described, the offloaded groups' own pages.
    bytes_per_block = 0
    if kv_cache_config.num_blocks > 0:
        if kv_cache_config.hisparse_host_num_blocks is None and kv_cache_config.kv_cache_tensors:
            bytes_per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        else:
            bytes_per_block = sum(_group_kv_bytes_per_block(group) for _, group in selected)

    only_tp = pcp == 1 and dcp == 1
    replicated = bool(
        model.use_mla
        and tp > 1
        and kv_cache_config.kv_tp_replicas == tp
        and bytes_per_block > 0
        and parallel.pipeline_parallel_size == 1
        and only_tp
        and parallel.world_size == tp
        and parallel.distributed_executor_backend == "mp"  # a shared host mapping: one node, processes
        and parallel.nnodes_within_dp == 1
    )
    canonical = bool(extra.get("canonical_layout", False))
    # A block's bytes are the same under any tensor-parallel split only for one plain
    # full-attention group whose heads are really split (no copies), without per-head scales
    # or context parallelism, on the model runner whose layout is known.
    groups_all = kv_cache_config.kv_cache_groups
    single = groups_all[0].kv_cache_spec if len(groups_all) == 1 else None
    agnostic = bool(
        not vllm_config.use_v2_model_runner
        and isinstance(single, FullAttentionSpec)
        and not isinstance(single, MLAAttentionSpec)
        and single.num_kv_heads * tp == model.get_total_num_kv_heads()
        and not single.kv_quant_mode.is_per_token_head
        and only_tp
    )
    if canonical and not agnostic:
        # The canonical page layout is topology-free: every layer that can be rewritten into
        # it (checked again per layer when the worker registers its caches) qualifies.
        layers = [spec for group in groups_all for spec in iter_layer_specs(group.kv_cache_spec)]
        total_heads = model.get_total_num_kv_heads()
        agnostic = (
            bool(layers) and all(_canonical_certifiable(s, tp, total_heads) for s in layers) and only_tp and parallel.world_size == tp
        )
    if canonical:
        replicated = bool(
            agnostic
            and all(type(s) is MLAAttentionSpec for _, group in selected for s in iter_layer_specs(group.kv_cache_spec))
            and parallel.nnodes_within_dp == 1
            and (parallel.world_size == 1 or parallel.distributed_executor_backend == "mp")
        )

    events = vllm_config.kv_events_config
    cache_dtype = model.dtype if vllm_config.cache_config.cache_dtype == "auto" else vllm_config.cache_config.cache_dtype
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events is not None and bool(events.enable_kv_cache_events),
        extra_config=extra,
        engine_id=transfer.engine_id,
        model=OffloadingModelConfig(name=model.model, dtype=str(cache_dtype).removeprefix("torch."), max_model_len=model.max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=parallel.rank,
            world_size=parallel.world_size,
            tp_size=tp,
            pp_size=parallel.pipeline_parallel_size,
            pcp_size=pcp,
            dcp_size=dcp,
            data_parallel_index=parallel.data_parallel_index,
            data_parallel_size=parallel.data_parallel_size,
            data_parallel_rank_local=parallel.data_parallel_rank_local,
            is_parallelism_agnostic=agnostic,
        ),
        replicated_layout=replicated,
        canonical_layout=canonical,
        kv_cache_layout=vllm_config.cache_config.kv_cache_layout,
    )
