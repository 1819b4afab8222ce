"""Pinning host memory the CUDA allocator did not hand out (vLLM 0.33:
``vllm/v1/kv_offload/cpu/host_register.py``).

A copy engine reads and writes host memory at full speed only when the pages are locked and
known to the driver ("pinned"). The CPU tier's memory is a shared file every worker maps
(:class:`~kvlab.kv_offload.cpu.shared_offload_region.SharedOffloadRegion`), so it cannot come
from ``torch.empty(..., pin_memory=True)``; it is registered afterwards with
``cudaHostRegister``. Pinning only buys bandwidth: a range that stays unregistered is still
copied correctly, just through a bounce buffer. So every failure here is an answer
(``False``), never an exception, and on a machine without CUDA -- kvlab's usual case --
nothing is registered at all.

Why torch is looked up in ``sys.modules`` rather than imported: the scheduler's tiers import
the region (and so this module) and must not pull torch in (an import-linter contract). A
range can only be registered through torch's CUDA runtime, so a process that never loaded
torch has nothing registered and nothing to release.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)


def _torch() -> Any:
    return sys.modules.get("torch")


class _Platform:
    """The questions vLLM's ``current_platform`` answers for the CPU tier: is there a CUDA
    (or ROCm) device, is it ROCm, is it an Intel XPU? All False while torch is not loaded."""

    def is_cuda_alike(self) -> bool:
        torch = _torch()
        return torch is not None and bool(torch.cuda.is_available())

    def is_rocm(self) -> bool:
        torch = _torch()
        return torch is not None and getattr(torch.version, "hip", None) is not None and self.is_cuda_alike()

    def is_xpu(self) -> bool:
        torch = _torch()
        xpu = getattr(torch, "xpu", None) if torch is not None else None
        return xpu is not None and bool(xpu.is_available())


current_platform = _Platform()


class CudaRTLibrary:
    """The three CUDA runtime calls registration needs, through ``torch.cuda.cudart()``.
    Each returns the runtime's error code (0: success), as the C functions do."""

    def __init__(self) -> None:
        torch = _torch()
        if torch is None or not torch.cuda.is_available():
            raise OSError("the CUDA runtime is not available (torch is not loaded or has no CUDA device)")
        self._rt = torch.cuda.cudart()

    def cudaHostRegister(self, ptr: int, num_bytes: int) -> int:  # noqa: N802 (CUDA's name)
        return int(self._rt.cudaHostRegister(ptr, num_bytes, 0))

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return int(self._rt.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:  # noqa: N802
        get = getattr(self._rt, "cudaGetLastError", None)
        return int(get()) if get is not None else 0


@functools.cache
def _get_cudart() -> CudaRTLibrary:
    """One runtime wrapper per process: registering thousands of slots must not rebuild it."""
    return CudaRTLibrary()


def _load_cudart() -> CudaRTLibrary | None:
    try:
        return _get_cudart()
    except (AssertionError, AttributeError, OSError, RuntimeError):
        logger.warning("no CUDA runtime for host registration; the offload region stays pageable", exc_info=True)
        return None


def host_register(ptr: int, num_bytes: int) -> bool:
    """Pin ``num_bytes`` of host memory from address ``ptr``. True: registered (release it
    with :func:`host_unregister`); False: left pageable (no CUDA, or the driver said no)."""
    if not ptr or num_bytes <= 0:
        return False
    if not current_platform.is_cuda_alike():
        logger.info("host registration needs CUDA; KV offload copies use pageable host memory")
        return False
    cudart = _load_cudart()
    if cudart is None:
        return False
    code = cudart.cudaHostRegister(ptr, num_bytes)
    if code != 0:
        cudart.cudaGetLastError()  # clear it, or the next unrelated CUDA call reports it
        logger.warning("cudaHostRegister failed (code=%d); copies still work, unpinned", code)
        return False
    return True


def host_unregister(ptr: int) -> None:
    """Release a range :func:`host_register` pinned (nothing to do without CUDA)."""
    if not ptr or not current_platform.is_cuda_alike():
        return
    cudart = _load_cudart()
    if cudart is None:
        return
    code = cudart.cudaHostUnregister(ptr)
    if code != 0:
        cudart.cudaGetLastError()
        logger.warning("cudaHostUnregister failed (code=%d)", code)
