"""What the CPU tier hands the worker (vLLM: ``vllm/v1/kv_offload/cpu/common.py``)."""

from __future__ import annotations

import numpy as np

from kvlab.kv_offload.base import BlockIDsLoadStoreSpec


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """The CPU chunks (slots of host memory) a load reads or a store writes; ``block_ids``
    are chunk ids here, not GPU block ids (``chunk_ids`` is the same array)."""

    @property
    def chunk_ids(self) -> np.ndarray:
        return self.block_ids
