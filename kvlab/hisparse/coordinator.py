"""HiSparse's coordinator at vLLM 0.33's path (``vllm/v1/hisparse/coordinator.py``); it lives
in the core (:mod:`kvlab.core.hisparse_coordinator`), since a ``KVCacheManager`` built with a
host pool starts it."""

from kvlab.core.hisparse_coordinator import HiSparseCoordinator, get_hisparse_coordinator

__all__ = ["HiSparseCoordinator", "get_hisparse_coordinator"]
