"""What an offloading backend is told about the engine (vLLM 0.33: ``vllm/v1/kv_offload/config.py``).

Plain frozen records, filled once by the connector: the KV-cache groups (tokens per block,
their layers), the model (name, KV dtype), the cache (tokens per block hash, blocks per
offload chunk) and the parallel layout (rank, sizes of every parallel dimension). A tier
reads what it needs -- the file tier's :class:`~kvlab.kv_offload.file_mapper.FileMapper`
turns model, cache and parallel fields into the folder its files live in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OffloadingGroupConfig:
    tokens_per_block: int  # the token span of one block, across every worker
    layer_names: tuple[str, ...]
    group_id: int  # the group's index in the KVCacheConfig
    sliding_window_size_in_chunks: int | None = None  # chunks a request keeps; None: a full layer


@dataclass(frozen=True)
class OffloadingModelConfig:
    name: str  # e.g. a Hugging Face id
    dtype: str  # the KV cache's dtype, e.g. "float16"
    max_model_len: int = 0  # the longest request, in tokens (0: not known)


@dataclass(frozen=True)
class OffloadingCacheConfig:
    tokens_per_hash: int  # tokens per block hash
    blocks_per_chunk: int  # blocks coalesced into one offload chunk


@dataclass(frozen=True)
class OffloadingParallelConfig:
    rank: int  # this worker, in [0, world_size); 0 on the scheduler side
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int  # prefill context parallel
    dcp_size: int  # decode context parallel
    data_parallel_index: int
    data_parallel_size: int
    data_parallel_rank_local: int | None
    # True when a block's stored bytes are the same under any parallel layout (concatenated
    # across workers in rank order): then engines with other splits may share the files.
    is_parallelism_agnostic: bool


@dataclass(frozen=True)
class OffloadingConfig:
    groups: tuple[OffloadingGroupConfig, ...]
    worker_kv_bytes_per_block: int  # KV bytes one worker stores per block
    enable_kv_cache_events: bool  # the scheduler publishes KV events: tiers publish theirs too
    extra_config: Mapping[str, Any]  # kv_connector_extra_config
    engine_id: str  # one per data-parallel rank
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    replicated_layout: bool = False  # every worker stores the same bytes per block (pure MLA, TP only)
    canonical_layout: bool = False  # the per-layer canonical host layout was asked for
    kv_cache_layout: str | None = None
