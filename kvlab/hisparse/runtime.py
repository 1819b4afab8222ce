"""HiSparse's resolved options and the facts of the machine it needs (vLLM 0.33: the
scheduler-side part of ``vllm/v1/hisparse/runtime.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.utils.math_utils import round_up

logger = logging.getLogger(__name__)

#: The hot buffer's slots are indexed with int16 on the GPU: at most 2**15 rows.
MAX_DEVICE_BUFFER_SIZE = 1 << 15


class _Platform:
    """What HiSparse asks of the machine (vLLM: ``vllm.platforms.current_platform``)."""

    def is_cuda_alike(self) -> bool:
        """Whether a CUDA or ROCm GPU is here (torch's answer; False without torch)."""
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())


current_platform = _Platform()


def max_decode_query_len(vllm_config: Any) -> int:
    """The widest query a decode step runs per request (vLLM 0.33): one token, or the token
    and its ``num_speculative_tokens`` drafts to verify -- twice the drafts with model
    runner V1's parallel drafting, which appends a mask slot per draft."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.num_speculative_tokens is None:
        return 1
    n = spec.num_speculative_tokens
    width = 1 + n
    if getattr(spec, "parallel_drafting", False) and not getattr(vllm_config, "use_v2_model_runner", True):
        width += n
    return width


@dataclass(frozen=True)
class ResolvedHiSparseConfig:
    """The options with their defaults worked out for one model and machine."""

    top_k: int
    device_buffer_size: int
    #: The most host rows one request's decode step can pick: every query row's top-k.
    max_union_rows: int
    eager_host_mirror: bool = True

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_top_k: int, block_size: int | None = None) -> ResolvedHiSparseConfig | None:
        """None when HiSparse is off (``attention_config.hisparse_config`` is None).

        The hot buffer must hold every row one decode step reads -- a top-k for each query
        row -- and by default holds one top-k more, so rows read one step are still there
        the next. A buffer too small, or past the int16 slot index, is refused."""
        config = vllm_config.attention_config.hisparse_config
        if config is None:
            return None
        max_query_len = max_decode_query_len(vllm_config)
        minimum = max_query_len * model_top_k
        configured = config.device_buffer_size
        size = (max_query_len + 1) * model_top_k if configured is None else configured
        if size < minimum:
            raise ValueError(
                "HiSparse device_buffer_size must cover every decode query's index_topk rows. Got "
                f"device_buffer_size={size}, max_decode_query_len={max_query_len}, index_topk={model_top_k}; "
                f"expected at least {minimum}."
            )
        if size > MAX_DEVICE_BUFFER_SIZE:
            raise ValueError(
                f"HiSparse device_buffer_size exceeds the int16 slot-index limit: got {size}, maximum is {MAX_DEVICE_BUFFER_SIZE}."
            )
        if configured is not None and block_size is not None and -size % block_size:
            padding = -size % block_size
            logger.warning(
                "HiSparse device_buffer_size=%d is not aligned to the %d-token block size and allocates %d unused rows per hot "
                "group; %d uses them all.",
                size,
                block_size,
                padding,
                size + padding,
            )
        return cls(top_k=model_top_k, device_buffer_size=size, max_union_rows=minimum, eager_host_mirror=config.eager_host_mirror)


def use_shared_hisparse_host_pool(vllm_config: Any) -> bool:
    """Whether the tensor-parallel ranks of one node share one host pool (vLLM 0.33). MLA's
    latent K/V is the same on every rank (it is not split by head), so one mapped copy can
    serve them all -- on a CUDA-like GPU, with TP > 1 and no other parallelism, every rank
    a local process."""
    p = vllm_config.parallel_config
    return (
        current_platform.is_cuda_alike()
        and p.tensor_parallel_size > 1
        and p.pipeline_parallel_size == 1
        and p.prefill_context_parallel_size == 1
        and p.decode_context_parallel_size == 1
        and p.world_size == p.tensor_parallel_size
        and p.distributed_executor_backend == "mp"
        and p.nnodes_within_dp == 1
    )


def get_hisparse_host_block_stride(page_size_bytes: int, *, use_shared_host_pool: bool) -> int:
    """Bytes between two host blocks: the page, rounded up to whole OS pages when the pool
    is a shared mapping (as the CPU offload tier's shared region is)."""
    if use_shared_host_pool:
        align = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
        return round_up(page_size_bytes, align)
    return page_size_bytes
