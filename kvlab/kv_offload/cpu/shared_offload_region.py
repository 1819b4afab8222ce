"""The CPU tier's bytes as one shared memory file (vLLM 0.33: ``SharedOffloadRegion`` in
``vllm/v1/kv_offload/cpu/shared_offload_region.py``).

Why a file: every tensor-parallel worker copies its shard of each block into the same row
of host memory, and the scheduler's secondary tiers read those rows too. A file in
``/dev/shm`` mapped by each process is memory they all see without copying. The first
process to create the file (``O_EXCL``) sizes it; the others open it and wait, bounded, until
it has that size. With a ``barrier`` (every worker calls it once all have mapped the file)
the creator unlinks the path at once, so the kernel frees the memory when the last mapping
goes, however the processes end.

A row is one chunk: ``kv_bytes_per_chunk`` bytes, a multiple of the page size, worker
``rank``'s bytes at ``rank * cpu_page_size`` within it. Secondary tiers address chunk ``c``
as ``create_kv_memoryview()[c]``.

kvlab keeps the part the scheduler side sees -- the file, the mapping, the row view, the
clean-up. It does not build vLLM's per-worker tensor views, pin the pages for DMA, split the
file into segments or pre-fault pages: kvlab's worker copies with torch from its own host
tensor.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

from kvlab.utils.checks import check_int

_WAIT_FOR_SIZE_S = 30.0


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _wait_for_file_size(fd: int, expected: int, timeout_s: float = _WAIT_FOR_SIZE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while os.fstat(fd).st_size < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared offload file did not reach {expected} bytes within {timeout_s:.0f} s (its creator died?)")
        time.sleep(0.01)


class SharedOffloadRegion:
    """``num_chunks`` rows of ``kv_bytes_per_chunk`` bytes in ``/dev/shm/vllm_offload_{engine_id}.mmap``."""

    BLOCK_SIZE_ALIGNMENT: int = mmap.PAGESIZE

    def __init__(
        self,
        engine_id: str,
        num_chunks: int,
        rank: int | None,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        barrier: Callable[[], None] | None = None,
        *,
        creator_memory_check: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(engine_id, str) or not engine_id or "/" in engine_id:
            raise ValueError(f"engine_id must be a non-empty name without '/', got {engine_id!r}")
        self.page_size = mmap.PAGESIZE
        self.num_chunks = check_int("num_chunks", num_chunks, 1)
        kv_bytes_per_chunk = check_int("kv_bytes_per_chunk", kv_bytes_per_chunk, self.page_size)
        if kv_bytes_per_chunk % self.page_size:
            raise ValueError(f"kv_bytes_per_chunk={kv_bytes_per_chunk} must be a multiple of the page size ({self.page_size})")
        self.cpu_page_size = check_int("cpu_page_size", cpu_page_size, 1)
        self.rank = None if rank is None else check_int("rank", rank, 0)
        if self.rank is not None and (self.rank + 1) * self.cpu_page_size > kv_bytes_per_chunk:
            raise ValueError(
                f"rank {self.rank}'s bytes ({self.cpu_page_size} from {self.rank * self.cpu_page_size}) do not fit a row of {kv_bytes_per_chunk}"
            )
        self._row_stride = kv_bytes_per_chunk
        self.total_size_bytes = self.num_chunks * kv_bytes_per_chunk
        self.mmap_path = os.path.join(_shm_dir(), f"vllm_offload_{engine_id}.mmap")
        self._creator = False
        self.fd: int | None = None
        self.mmap_obj: mmap.mmap | None = None
        try:
            try:
                self.fd = os.open(self.mmap_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                self.fd = os.open(self.mmap_path, os.O_RDWR)
                _wait_for_file_size(self.fd, self.total_size_bytes)
            else:
                self._creator = True
                if creator_memory_check is not None:
                    creator_memory_check(self.total_size_bytes)
                os.ftruncate(self.fd, self.total_size_bytes)
            self.mmap_obj = mmap.mmap(self.fd, self.total_size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if barrier is not None:
                barrier()
                if self._creator:
                    self._unlink()
        except BaseException:
            self.cleanup()
            raise

    def iter_worker_slot_ranges(self):
        """(offset, length) of this worker's bytes in each row (``rank`` given)."""
        if self.rank is None:
            raise ValueError("iter_worker_slot_ranges needs the region's rank; this one was opened with rank=None")
        start = self.rank * self.cpu_page_size
        for row in range(self.num_chunks):
            yield row * self._row_stride + start, self.cpu_page_size

    def create_kv_memoryview(self) -> memoryview:
        """A zero-copy (num_chunks, kv_bytes_per_chunk) byte view of the whole region."""
        if self.mmap_obj is None:
            raise ValueError("the region was cleaned up")
        rows = np.frombuffer(self.mmap_obj, dtype=np.uint8).reshape(self.num_chunks, self._row_stride)
        return rows.data

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.mmap_path)
        self._creator = False

    def cleanup(self) -> None:
        """Unmap, close and (if this process created it and no barrier unlinked it) remove the
        file. Idempotent. A view still exported keeps the mapping alive (BufferError is not
        raised: the memory is released with the last view)."""
        if self.mmap_obj is not None:
            with contextlib.suppress(BufferError):
                self.mmap_obj.close()
            self.mmap_obj = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._creator:
            self._unlink()
