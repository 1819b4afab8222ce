"""What the CPU tier hands the worker (vLLM: ``vllm/v1/kv_offload/cpu/common.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.kv_offload.base import BlockIDsLoadStoreSpec, ConfigInfo
from kvlab.kv_offload.config import OffloadingConfig
from kvlab.utils.math_utils import cdiv


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """The CPU chunks (slots of host memory) a load reads or a store writes; ``block_ids``
    are chunk ids here, not GPU block ids (``chunk_ids`` is the same array)."""

    @property
    def chunk_ids(self) -> np.ndarray:
        return self.block_ids


class CPUOffloadingMetrics:
    """The CPU tier's metric names (vLLM 0.33)."""

    STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
    CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
    CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
    CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
    CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"


@dataclass(frozen=True)
class CPUOffloadingInfo(ConfigInfo):
    """Static facts about the CPU tier (the labels of its ``vllm:kv_offload_config_info``)."""

    cpu_num_chunks: int  # chunk slots (chunks, not GPU blocks)
    cpu_blocks_per_chunk: int  # GPU blocks per chunk
    cpu_kv_cache_size_bytes: int  # the tier's size, chunk padding included
    cpu_kv_cache_size_tokens: int | None  # KV tokens it holds for requests of max_model_len (None: unknown)

    @classmethod
    def from_config(cls, config: OffloadingConfig, num_chunks: int, kv_bytes_per_chunk: int) -> CPUOffloadingInfo:
        return cls(
            cpu_num_chunks=num_chunks,
            cpu_blocks_per_chunk=config.cache.blocks_per_chunk,
            cpu_kv_cache_size_bytes=num_chunks * kv_bytes_per_chunk,
            cpu_kv_cache_size_tokens=_kv_cache_size_tokens(config, num_chunks),
        )


def _kv_cache_size_tokens(config: OffloadingConfig, num_chunks: int) -> int | None:
    """Tokens the tier holds at ``max_model_len``: its chunks divided by the chunks one such
    request takes over every group (a window group only its window's), times the length --
    the same count vLLM reports for the GPU pool (``kv_cache_size_tokens``)."""
    max_model_len = config.model.max_model_len
    if max_model_len <= 0 or not config.groups:
        return None
    chunks_per_request = 0
    for group in config.groups:
        per_chunk = group.tokens_per_block * config.cache.blocks_per_chunk
        chunks = cdiv(max_model_len, per_chunk)
        if group.sliding_window_size_in_chunks is not None:
            chunks = min(chunks, group.sliding_window_size_in_chunks)
        chunks_per_request += chunks
    return num_chunks * max_model_len // chunks_per_request
