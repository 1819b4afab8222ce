"""HiSparse's options (vLLM: ``HiSparseConfig`` in ``vllm/config/attention.py``).

HiSparse runs a sparse-attention MLA model (DeepSeek-V3.2, GLM-5) with its K/V in host
memory: each decode step's indexer picks the ``index_topk`` earlier tokens attention reads,
and a GPU *hot buffer* per request keeps the rows recent steps picked, so most reads hit the
GPU and the rest are fetched from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.utils.checks import check_optional_int


@dataclass(frozen=True)
class HiSparseConfig:
    #: Rows of a request's hot buffer, the newest token's included. None: one top-k per
    #: decode query plus one more of slack, so the rows the last step read stay resident.
    device_buffer_size: int | None = None
    #: Copy each decode-written row to the host during the forward pass, so a page that
    #: leaves the GPU needs no copy then (False: copied when it leaves).
    eager_host_mirror: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_buffer_size", check_optional_int("device_buffer_size", self.device_buffer_size, 1))
        if not isinstance(self.eager_host_mirror, bool):
            raise TypeError(f"eager_host_mirror must be True or False, got {self.eager_host_mirror!r}")
