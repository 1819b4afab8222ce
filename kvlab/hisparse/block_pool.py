"""HiSparse's host pool at vLLM 0.33's path (``vllm/v1/hisparse/block_pool.py``)."""

from kvlab.core.hisparse_managers import SharedEventQueueBlockPool

__all__ = ["SharedEventQueueBlockPool"]
