"""Where each worker's KV bytes go in a parallelism-free page (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py``).

With tensor parallelism each rank keeps only its shard of a block: its own KV heads (or a
copy of heads it shares with other ranks), and with context parallelism only some of the
block's tokens. Offloaded as they are, those pages can be read back only by an engine split
the same way. The *canonical* page of a layer is the block as one unsplit engine would hold
it -- every KV head, every token, in the worker's own page encoding -- so an engine with TP 4
can store a prefix that an engine with TP 2 (or 1) loads.

This module works out, for one layer at one rank, which byte runs of the local page land
where in the canonical page (:class:`~kvlab.kv_offload.base.CanonicalPageMapping`): heads
split across ranks become strided runs; ranks holding the same heads take turns writing a
block (``num_writers``, ``writer_index``), so each canonical page is written once; context
parallel ranks interleave their tokens. It reads the cache tensor's strides to tell the
physical layouts apart (K and V split or packed, tokens before heads or heads before
tokens) and refuses what it does not recognise: such a layer falls back to an *opaque*
mapping (each rank's page whole, at a rank-owned offset), correct but not shareable across
parallel configurations. Every mapping set is checked to tile the canonical page exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kvlab.kv_cache_interface import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs
from kvlab.kv_offload.base import CanonicalPageMapping, CopyRun


@dataclass(frozen=True)
class _RankContext:
    """One worker's place in the grid of ranks that share an offloaded block."""

    tp_size: int
    dcp_size: int
    pcp_size: int
    interleave: int  # tokens in a row kept by one context-parallel rank
    total_kv_heads: int
    rank: int  # pcp_rank * tp_size + tp_rank

    @property
    def cp_size(self) -> int:
        return self.dcp_size * self.pcp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def total_cp_rank(self) -> int:
        """This rank's place among all context-parallel ranks (prefill, then decode)."""
        return self.rank // self.tp_size * self.dcp_size + self.tp_rank % self.dcp_size


@dataclass(frozen=True)
class ByteRegion:
    """Bytes that repeat once per token: ``bytes_per_token`` of them at ``local_offset`` in
    the local page (tokens back to back) and at ``canonical_offset`` in the canonical page,
    a token every ``canonical_token_stride`` bytes."""

    local_offset: int
    canonical_offset: int
    bytes_per_token: int
    canonical_token_stride: int


def _block_size(spec: KVCacheSpec) -> int:
    if spec.block_size is None:
        raise ValueError(f"{type(spec).__name__} has no block_size (a worker's spec always has one)")
    return spec.block_size


def _whole(local: int, canonical: int, size: int) -> CopyRun:
    return CopyRun(local, canonical, size, 1, size, size)


def _coalesce_runs(runs: list[CopyRun]) -> tuple[CopyRun, ...]:
    """The same copies in as few runs as possible: a run whose fragments touch on both sides
    becomes one fragment, and consecutive one-fragment runs that touch merge."""
    out: list[CopyRun] = []
    for run in runs:
        if run.num_fragments > 1 and run.local_stride == run.fragment_size == run.canonical_stride:
            run = _whole(run.local_offset, run.canonical_offset, run.fragment_size * run.num_fragments)
        last = out[-1] if out else None
        if (
            last is not None
            and last.num_fragments == run.num_fragments == 1
            and last.local_offset + last.fragment_size == run.local_offset
            and last.canonical_offset + last.fragment_size == run.canonical_offset
        ):
            out[-1] = _whole(last.local_offset, last.canonical_offset, last.fragment_size + run.fragment_size)
        else:
            out.append(run)
    return tuple(out)


def _local_to_canonical_token(local_idx: int, ctx: _RankContext) -> int:
    """The canonical position of this rank's local token ``local_idx``: the ranks take
    ``interleave`` tokens each, in turn."""
    chunk, offset = divmod(local_idx, ctx.interleave)
    return (chunk * ctx.cp_size + ctx.total_cp_rank) * ctx.interleave + offset


def _interleave_cp_tokens(regions: list[ByteRegion], num_tokens: int, ctx: _RankContext) -> tuple[CopyRun, ...]:
    """Each region's ``num_tokens`` rows at their canonical token positions: one strided run
    per region without context parallelism, else one per chunk of interleaved tokens."""
    runs: list[CopyRun] = []
    for r in regions:
        if ctx.cp_size == 1:
            runs.append(
                CopyRun(r.local_offset, r.canonical_offset, r.bytes_per_token, num_tokens, r.bytes_per_token, r.canonical_token_stride)
            )
            continue
        for first in range(0, num_tokens, ctx.interleave):
            token = _local_to_canonical_token(first, ctx)
            runs.append(
                CopyRun(
                    r.local_offset + first * r.bytes_per_token,
                    r.canonical_offset + token * r.canonical_token_stride,
                    r.bytes_per_token,
                    ctx.interleave,
                    r.bytes_per_token,
                    r.canonical_token_stride,
                )
            )
    return _coalesce_runs(runs)


def _packed_kv_regions(
    kv_cache: torch.Tensor, spec: AttentionSpec, head_shard: int, num_head_shards: int, cp_size: int
) -> list[ByteRegion] | None:
    """A page of (token, head) cells, K and V side by side in each cell: tokens before
    heads (NHD) or heads before tokens (HND), told apart by the strides."""
    bs, heads = _block_size(spec), spec.num_kv_heads
    cell = 2 * spec.head_size  # K then V, in elements
    elem = kv_cache.element_size()
    if heads * bs * cell * elem != spec.real_page_size_bytes:
        return None
    _, head_stride, token_stride, inner_stride = kv_cache.stride()
    if inner_stride != 1:
        return None
    cell_bytes = cell * elem
    row = heads * cell_bytes  # one token, this rank's heads
    if head_stride == cell and token_stride == heads * cell:  # NHD: a token's row holds every head
        return [ByteRegion(0, head_shard * row, row, num_head_shards * row)]
    if head_stride == bs * cell and token_stride == cell:  # HND: a head's tokens back to back
        span = bs * cp_size  # canonical tokens per block
        return [ByteRegion(h * bs * cell_bytes, (head_shard * heads + h) * span * cell_bytes, cell_bytes, cell_bytes) for h in range(heads)]
    return None


def _split_kv_regions(
    kv_cache: torch.Tensor, spec: AttentionSpec, head_shard: int, num_head_shards: int, cp_size: int
) -> list[ByteRegion] | None:
    """A page in two halves, all K then all V, each NHD or HND."""
    bs, heads, size = _block_size(spec), spec.num_kv_heads, spec.head_size
    elem = kv_cache.element_size()
    if 2 * bs * heads * size * elem != spec.real_page_size_bytes:
        return None
    _, half_stride, token_stride, head_stride, inner_stride = kv_cache.stride()
    if inner_stride != 1 or half_stride != bs * heads * size:
        return None
    head_bytes = size * elem
    row = heads * head_bytes
    span = bs * cp_size
    if token_stride == heads * size and head_stride == size:  # NHD
        half_bytes = span * num_head_shards * row  # one canonical half
        return [ByteRegion(k * bs * row, k * half_bytes + head_shard * row, row, num_head_shards * row) for k in range(2)]
    if head_stride == bs * size and token_stride == size:  # HND
        all_heads = num_head_shards * heads
        return [
            ByteRegion(
                k * bs * row + h * bs * head_bytes, (k * all_heads + head_shard * heads + h) * span * head_bytes, head_bytes, head_bytes
            )
            for k in range(2)
            for h in range(heads)
        ]
    return None


def _attention_byte_regions(
    kv_cache: torch.Tensor, spec: AttentionSpec, num_blocks: int, head_shard: int, num_head_shards: int, cp_size: int
) -> list[ByteRegion] | None:
    """The byte regions of an attention page for this rank's head shard; None for a
    layout this module does not recognise."""
    bs, heads, size = _block_size(spec), spec.num_kv_heads, spec.head_size
    shape = tuple(kv_cache.shape)
    if shape == (num_blocks, heads, bs, 2 * size):
        return _packed_kv_regions(kv_cache, spec, head_shard, num_head_shards, cp_size)
    if shape == (num_blocks, 2, bs, heads, size):
        return _split_kv_regions(kv_cache, spec, head_shard, num_head_shards, cp_size)
    return None


def _layer_mapping(spec: KVCacheSpec, kv_cache: Any, num_blocks: int, ctx: _RankContext) -> CanonicalPageMapping | None:
    """The mapping of one layer at one rank, or None when it cannot be certified."""
    if not isinstance(spec, AttentionSpec):
        return None
    bs, page = _block_size(spec), spec.real_page_size_bytes
    if ctx.cp_size > 1 and (ctx.interleave > bs or bs % ctx.interleave):
        return None
    if isinstance(spec, MLAAttentionSpec):
        # One latent row per token, the same on every TP rank; context parallelism splits tokens.
        if spec.tokens_per_state != 1 or page % bs or ctx.tp_size % ctx.dcp_size or spec.kv_quant_mode.is_per_token_head:
            return None
        row = page // bs
        return CanonicalPageMapping(
            canonical_page_size_bytes=ctx.cp_size * page,
            local_page_size_bytes=page,
            runs=_interleave_cp_tokens([ByteRegion(0, 0, row, row)], bs, ctx),
            num_writers=ctx.tp_size // ctx.dcp_size,
            writer_index=ctx.tp_rank // ctx.dcp_size,
            parallelism_agnostic=ctx.cp_size == 1,
        )
    if spec.kv_quant_mode.is_per_token_head or not isinstance(kv_cache, torch.Tensor):
        return None  # per-head scales are packed with the data
    total, tp = ctx.total_kv_heads, ctx.tp_size
    if spec.num_kv_heads != max(1, total // tp):
        return None
    if total >= tp:  # heads split: every rank its own
        if total % tp:
            return None
        shards, replicas = tp, 1
    else:  # fewer heads than ranks: each head copied on tp // total ranks
        if tp % total:
            return None
        shards, replicas = total, tp // total
    if replicas % ctx.dcp_size:  # DCP may only split tokens among ranks that hold the same heads
        return None
    regions = _attention_byte_regions(kv_cache, spec, num_blocks, ctx.tp_rank // replicas, shards, ctx.cp_size)
    if regions is None:
        return None
    return CanonicalPageMapping(
        canonical_page_size_bytes=ctx.cp_size * shards * page,
        local_page_size_bytes=page,
        runs=_interleave_cp_tokens(regions, bs, ctx),
        num_writers=replicas // ctx.dcp_size,
        writer_index=ctx.tp_rank % replicas // ctx.dcp_size,
        parallelism_agnostic=ctx.cp_size == 1,
    )


def _opaque_fallback_mapping(page_size_bytes: int, num_ranks: int, rank: int) -> CanonicalPageMapping:
    """The page whole, at this rank's own slot of a page ``num_ranks`` times as large."""
    return CanonicalPageMapping(
        canonical_page_size_bytes=num_ranks * page_size_bytes,
        local_page_size_bytes=page_size_bytes,
        runs=(_whole(0, rank * page_size_bytes, page_size_bytes),),
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=False,
    )


def _run_intervals(runs: tuple[CopyRun, ...], canonical: bool) -> list[tuple[int, int]]:
    out = []
    for run in runs:
        base, stride = (run.canonical_offset, run.canonical_stride) if canonical else (run.local_offset, run.local_stride)
        out += [(base + i * stride, base + i * stride + run.fragment_size) for i in range(run.num_fragments)]
    return sorted(out)


def _is_exact_partition(intervals: list[tuple[int, int]], size: int) -> bool:
    """Whether ``intervals`` (sorted) cover ``[0, size)`` with no gap and no overlap."""
    return (
        bool(intervals)
        and intervals[0][0] == 0
        and intervals[-1][1] == size
        and all(a[1] == b[0] for a, b in zip(intervals, intervals[1:]))
    )


def _verify_tiling(layer_name: str, per_rank: list[CanonicalPageMapping]) -> None:
    """Each rank's runs cover its local page exactly, and for every block the ranks it
    elects as writers cover the canonical page exactly once."""
    size, writers = per_rank[0].canonical_page_size_bytes, per_rank[0].num_writers
    for m in per_rank:
        if (m.canonical_page_size_bytes, m.num_writers) != (size, writers):
            raise AssertionError(f"the ranks of layer {layer_name} disagree on the canonical page or its writers")
        if not _is_exact_partition(_run_intervals(m.runs, canonical=False), m.local_page_size_bytes):
            raise AssertionError(f"runs do not cover the local page of layer {layer_name}")
    for block_id in range(writers):
        stored = sorted(iv for m in per_rank if m.is_writer(block_id) for iv in _run_intervals(m.runs, canonical=True))
        if not _is_exact_partition(stored, size):
            raise AssertionError(f"writers of block {block_id} do not tile the canonical page of layer {layer_name}")


def _unpadded_page_size(spec: KVCacheSpec) -> int | None:
    if isinstance(spec, AttentionSpec):
        return spec.unpadded_page_size_bytes
    if isinstance(spec, MambaSpec):
        return replace(spec, page_size_padded=None).page_size_bytes
    return None


def derive_canonical_mappings(vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, Any]) -> dict[str, CanonicalPageMapping]:
    """This worker's mapping for every layer that has a canonical form (certified, or the
    opaque fallback); empty when the workers are not exactly the TP x PCP grid (pipeline
    stages hold other layers, so no page of theirs is shared)."""
    par = vllm_config.parallel_config
    tp, pcp = par.tensor_parallel_size, par.prefill_context_parallel_size
    grid = tp * pcp
    if par.world_size != grid:
        return {}
    total_heads = vllm_config.model_config.get_total_num_kv_heads()
    contexts = [
        _RankContext(tp, par.decode_context_parallel_size, pcp, par.cp_kv_cache_interleave_size, total_heads, r) for r in range(grid)
    ]
    mappings: dict[str, CanonicalPageMapping] = {}
    for group in kv_cache_config.kv_cache_groups:
        group_spec = group.kv_cache_spec
        per_layer = group_spec.kv_cache_specs if isinstance(group_spec, UniformTypeKVCacheSpecs) else {}
        for name in group.layer_names:
            spec = per_layer.get(name, group_spec)
            per_rank = [_layer_mapping(spec, kv_caches.get(name), kv_cache_config.num_blocks, c) for c in contexts]
            if any(m is None for m in per_rank):
                page = _unpadded_page_size(spec)
                if page is None:
                    continue
                per_rank = [_opaque_fallback_mapping(page, grid, r) for r in range(grid)]
            certified = [m for m in per_rank if m is not None]
            _verify_tiling(name, certified)
            mappings[name] = certified[par.rank]
    return mappings
