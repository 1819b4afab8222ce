"""How HiSparse lays a model's KV cache out, and how big its two pools are (vLLM 0.33:
``vllm/v1/hisparse/layout.py``).

A sparse-attention MLA model has two caches per layer: the latent K/V that attention reads
(``SparseCacheRole.SPARSE``) and the indexer's keys (``SparseCacheRole.INDEXER``). HiSparse
turns them into these groups, in this order:

1. the **source** group: every sparse layer's K/V, ``host_resident`` -- its blocks come from
   a host pool of their own, sized by ``host_pool_gib``;
2. the **indexer** group: the indexer keys, whole, on the GPU (every decode step scores
   every earlier token);
3. **resident** groups: GPU pages of the newest K/V, until their host copy is complete;
4. **hot** groups: each request's hot buffer, ``device_buffer_size`` rows.

Resident and hot groups are cut from runs of layers that share one indexer (a run starts at
``is_index_group_leader``), packed while a group's page stays within the indexer's page, so
that every GPU group's block fits the one pool's page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab.config.kv_transfer import hisparse_host_pool_gib
from kvlab.hisparse.runtime import ResolvedHiSparseConfig, get_hisparse_host_block_stride, use_shared_hisparse_host_pool
from kvlab.hisparse.types import ACTIVE_TAIL_PAGES
from kvlab.kv_cache_interface import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from kvlab.utils.math_utils import cdiv

HISPARSE_HOT_SUFFIX = ".hisparse_hot"
HISPARSE_RESIDENT_SUFFIX = ".hisparse_resident"


@dataclass(frozen=True)
class HiSparseLayout:
    """The host pool's size, and which groups live where."""

    source_group: KVCacheGroupSpec
    device_groups: list[KVCacheGroupSpec]
    host_num_blocks: int
    host_block_stride: int
    shared_host_pool: bool


def get_hisparse_kv_cache_groups(vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec] | None:
    """HiSparse's groups for these layers (source, indexer, resident, hot), or None when
    HiSparse is off or the model has no MLA layer. Resident and hot specs already among the
    layers (a worker reports them) are laid out again from the MLA layers they belong to.

    kvlab lays out models whose cache layers are all MLA (DeepSeek-V3.2, GLM-5); vLLM also
    groups any other layers after HiSparse's, which kvlab refuses, naming them."""
    attention_config = getattr(vllm_config, "attention_config", None)
    if attention_config is None or attention_config.hisparse_config is None:
        return None
    mla_specs = {name: spec for name, spec in kv_cache_spec.items() if isinstance(spec, MLAAttentionSpec)}
    if not mla_specs:
        return None
    others = [
        name for name, spec in kv_cache_spec.items() if not isinstance(spec, (MLAAttentionSpec, HiSparseResidentSpec, HiSparseHotSpec))
    ]
    if others:
        raise ValueError(f"kvlab lays out HiSparse models whose cache layers are all MLA; these are not: {others}")
    wrapper = UniformTypeKVCacheSpecs.from_specs(dict(mla_specs))
    if wrapper is None:
        raise ValueError("HiSparse requires one resolved GPU block size.")
    return _lay_out_hisparse_groups(vllm_config, [KVCacheGroupSpec(tuple(mla_specs), wrapper)])


def get_hisparse_host_pool_bytes(vllm_config: Any) -> int:
    """The host pool's bytes, from the HiSparse connector's ``host_pool_gib``."""
    gib = hisparse_host_pool_gib(vllm_config.kv_transfer_config)
    if gib is None:
        raise ValueError("HiSparse requires HiSparseConnector with host_pool_gib")
    return int(gib * 2**30)


def _partition_hisparse_specs(groups: list[KVCacheGroupSpec]) -> tuple[dict[str, MLAAttentionSpec], dict[str, MLAAttentionSpec]]:
    """The first group's sparse and indexer layers; anything else there is refused."""
    group_spec = groups[0].kv_cache_spec
    if not isinstance(group_spec, UniformTypeKVCacheSpecs):
        raise ValueError("HiSparse requires uniform sparse-MLA cache specs.")
    specs = group_spec.kv_cache_specs
    if any(isinstance(s, MLAAttentionSpec) and s.model_version == "deepseek_v4" for s in specs.values()):
        raise ValueError("HiSparse does not support DeepSeek V4.")
    if not all(isinstance(s, MLAAttentionSpec) for s in specs.values()):
        raise ValueError("HiSparse requires its first cache group to contain MLA only.")
    mla = {name: s for name, s in specs.items() if isinstance(s, MLAAttentionSpec)}
    source = {name: s for name, s in mla.items() if s.cache_role is SparseCacheRole.SPARSE}
    indexer = {name: s for name, s in mla.items() if s.cache_role is SparseCacheRole.INDEXER}
    if not source or not indexer:
        raise ValueError("HiSparse requires sparse-MLA and indexer cache specs.")
    return source, indexer


def _lay_out_hisparse_groups(vllm_config: Any, groups: list[KVCacheGroupSpec]) -> list[KVCacheGroupSpec]:
    source, indexer = _partition_hisparse_specs(groups)
    block_sizes = {s.block_size for s in (*source.values(), *indexer.values())}
    if len(block_sizes) != 1:
        raise ValueError("HiSparse requires one resolved GPU block size.")
    block_size = block_sizes.pop()
    assert block_size is not None  # from_specs wrapped them: each has its block size
    top_k = max(
        s.topk_buffer_width if s.topk_buffer_width is not None else vllm_config.model_config.hf_config.index_topk for s in source.values()
    )
    config = ResolvedHiSparseConfig.from_vllm_config(vllm_config, top_k, block_size)
    assert config is not None  # the caller checked that HiSparse is on
    indexer_spec = UniformTypeKVCacheSpecs.from_specs(dict(indexer))
    assert indexer_spec is not None  # a subset of a uniform set is uniform
    indexer_group = KVCacheGroupSpec(tuple(indexer), indexer_spec, enable_kv_transfer=True, role=KVCacheGroupRole.HISPARSE_INDEXER)
    indexer_page = sum(s.page_size_bytes for s in indexer.values())
    hot_blocks = cdiv(config.device_buffer_size, block_size)

    # Runs of layers that share one indexer: a run starts at each index-group leader.
    units: list[list[tuple[str, MLAAttentionSpec]]] = []
    for name, spec in source.items():
        if spec.is_index_group_leader or not units:
            units.append([])
        units[-1].append((name + HISPARSE_HOT_SUFFIX, spec))

    resident_groups: list[KVCacheGroupSpec] = []
    hot_groups: list[KVCacheGroupSpec] = []

    def add(layers: list[tuple[str, MLAAttentionSpec]]) -> None:
        pages = {s.page_size_bytes for _, s in layers}
        if len(pages) != 1:
            raise ValueError(f"HiSparse hot-cache groups require one page size, got {sorted(pages)}.")
        page = pages.pop()
        names = tuple(name for name, _ in layers)
        resident = tuple(n[: -len(HISPARSE_HOT_SUFFIX)] + HISPARSE_RESIDENT_SUFFIX for n in names)
        resident_groups.append(
            KVCacheGroupSpec(resident, HiSparseResidentSpec(block_size=block_size, page_size=page), enable_kv_transfer=False)
        )
        hot_groups.append(
            KVCacheGroupSpec(
                names, HiSparseHotSpec(block_size=block_size, page_size=page, blocks_per_request=hot_blocks), enable_kv_transfer=False
            )
        )

    # Pack whole runs while the group's block stays within the indexer's page.
    current: list[tuple[str, MLAAttentionSpec]] = []
    current_page = 0
    for unit in units:
        unit_page = sum(s.page_size_bytes for _, s in unit)
        if current and current_page + unit_page > indexer_page:
            add(current)
            current, current_page = [], 0
        current.extend(unit)
        current_page += unit_page
    if current:
        add(current)

    source_spec = UniformTypeKVCacheSpecs.from_specs(dict(source))
    assert source_spec is not None
    source_group = KVCacheGroupSpec(
        tuple(source), source_spec, host_resident=True, enable_kv_transfer=True, role=KVCacheGroupRole.HISPARSE_SOURCE
    )
    return [source_group, indexer_group, *resident_groups, *hot_groups, *groups[1:]]


def create_hisparse_layout(vllm_config: Any, groups: list[KVCacheGroupSpec], host_budget: int) -> HiSparseLayout:
    """Size the host pool for groups from :func:`get_hisparse_kv_cache_groups`.

    Every computed page of a request has a host block, so the pool must hold one request of
    ``max_model_len`` tokens, plus the pool's null block and a copy-on-write tail; a smaller
    pool is refused (raise ``host_pool_gib``)."""
    sources = [g for g in groups if g.host_resident]
    if len(sources) != 1:
        raise ValueError(f"groups must hold exactly one host-resident (source) group, got {len(sources)}")
    source = sources[0]
    shared = use_shared_hisparse_host_pool(vllm_config)
    stride = get_hisparse_host_block_stride(source.kv_cache_spec.page_size_bytes, use_shared_host_pool=shared)
    host_num_blocks = host_budget // stride
    if host_num_blocks <= 0:
        raise ValueError("HiSparse has no allocatable host blocks.")
    block_size = source.kv_cache_spec.block_size
    assert block_size is not None
    needed = cdiv(vllm_config.model_config.max_model_len, block_size) + 2
    if host_num_blocks < needed:
        raise ValueError(f"HiSparse host pool has {host_num_blocks} blocks but max_model_len needs {needed}; increase host_pool_gib.")
    return HiSparseLayout(
        source_group=source,
        device_groups=[g for g in groups if not g.host_resident],
        host_num_blocks=host_num_blocks,
        host_block_stride=stride,
        shared_host_pool=shared,
    )


def get_hisparse_steady_state_concurrency(vllm_config: Any, kv_cache_config: KVCacheConfig) -> float:
    """How many requests of ``max_model_len`` fit once running ones read from the host.

    A request that reads from the host pins only its last ``ACTIVE_TAIL_PAGES`` resident
    pages, but the one being admitted still takes its whole window of them. So all but one
    request cost their steady-state blocks and one its admission blocks; the host pool,
    which holds every request's K/V whole, is the other limit."""
    admission = steady = host = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        required = cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
        if group.host_resident:
            host += required
            continue
        admission += required
        steady += min(required, ACTIVE_TAIL_PAGES) if isinstance(spec, HiSparseResidentSpec) else required
    host_pool = kv_cache_config.hisparse_host_num_blocks
    if host_pool is None:
        raise ValueError("kv_cache_config.hisparse_host_num_blocks is None: not a HiSparse config")
    num_blocks = kv_cache_config.num_blocks
    gpu = num_blocks / admission if num_blocks < admission else 1 + (num_blocks - admission) / steady
    return min(gpu, host_pool / host)
