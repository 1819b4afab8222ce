"""Triton paged-attention kernels and their torch references (installed as ``kvlab.kernels``).

``_env`` is imported first on purpose: it decides between compiled Triton (CUDA) and the
Triton interpreter (CPU) and must do so before anything imports ``triton``. Nothing here
imports the rest of kvlab; the engine's core stays pure Python.
"""

from __future__ import annotations

from ._env import DEVICE, INTERPRET  # noqa: I001  (must come first: sets TRITON_INTERPRET)
from .reference import reshape_and_cache_ref, unified_attention_ref
from .cache_ops import reshape_and_cache
from .attention import unified_attention

__all__ = [
    "DEVICE",
    "INTERPRET",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "unified_attention",
    "unified_attention_ref",
]
