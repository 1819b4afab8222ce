"""HiSparse's records between the scheduler and the worker (vLLM 0.33: ``vllm/v1/hisparse/types.py``).

They live beside the coordinator that makes them (:mod:`kvlab.core.hisparse_coordinator`);
this module gives them vLLM's path."""

from kvlab.core.hisparse_coordinator import (
    ACTIVE_TAIL_PAGES,
    SparseKVOffloadCommand,
    SparseKVPageTransfer,
    SparseKVResidencyUpdate,
    SparseKVRowMirror,
)

__all__ = ["ACTIVE_TAIL_PAGES", "SparseKVOffloadCommand", "SparseKVPageTransfer", "SparseKVResidencyUpdate", "SparseKVRowMirror"]
