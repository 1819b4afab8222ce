"""The CPU tier's bytes as one shared memory file (vLLM 0.33: ``SharedOffloadRegion`` in
``vllm/v1/kv_offload/cpu/shared_offload_region.py``).

Why a file: every tensor-parallel worker copies its shard of each block into the same row
of host memory, and the scheduler's secondary tiers read those rows too. A file in
``/dev/shm`` mapped by each process is memory they all see without copying. The first
process to create the file (``O_EXCL``) sizes it; the others open it and wait, bounded, until
it has that size. With a ``barrier`` (every worker calls it once all have mapped the file)
the creator unlinks the path at once, so the kernel frees the memory when the last mapping
goes, however the processes end. A worker that fails before the barrier still arrives at it
(having removed the file if it created it), so its peers are not left waiting.

The layout -- a row is one chunk of ``kv_bytes_per_chunk`` bytes (a multiple of the page
size); worker ``rank`` owns ``cpu_page_size`` bytes at ``rank * cpu_page_size`` in every row::

    row 0:  worker0 | worker1 | ... | worker{M-1}
    row 1:  worker0 | worker1 | ... | worker{M-1}

* ``create_next_worker_view(n)``: the next ``n`` bytes of this worker's slot in every row, as
  an int8 tensor ``(num_chunks, n)`` with stride ``(row_bytes, 1)`` -- one per KV tensor, so a
  slot holds every tensor of the chunk back to back.
* ``create_next_canonical_view(n)``: the next ``n`` bytes from the start of every row, the
  same bytes for every worker (the canonical layout: each worker writes only its own part).
* ``create_kv_memoryview()``: the whole region as ``(num_chunks, row_bytes)`` bytes, what the
  scheduler's secondary tiers read -- numpy, no torch.

Pages are pre-faulted at start (``MADV_POPULATE_WRITE``, else a write to each page), so the
first copies do not pay for page faults: a ranked worker its own slots, ``rank=None`` the
whole file, ``populate_shard=(i, n)`` the i-th of n contiguous shares (for workers that all
map the same bytes). ``num_segments`` splits a large region over several files mapped back
to back -- the kernel fills one shm file's pages one at a time, so one file caps how fast
pages can be pre-faulted; each file is at least ``_MIN_SEGMENT_BYTES``.

Torch is imported only when a worker asks for a tensor view (``importlib``, on first use):
the scheduler side imports this module and reads rows through numpy only, and must not load
torch (an import-linter contract).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import importlib
import logging
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvlab.kv_offload.cpu.host_register import host_unregister
from kvlab.utils.checks import check_int
from kvlab.utils.math_utils import cdiv, round_up

logger = logging.getLogger(__name__)

_WAIT_FOR_SIZE_S = 30.0
#: ``madvise`` advice that faults pages in writable (Linux 5.14+); older kernels say EINVAL.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
#: A file smaller than this is not worth its own segment.
_MIN_SEGMENT_BYTES = 1 << 30
_ALLOCATION_NAME = "CPU KV offload shared region in /dev/shm"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _torch() -> Any:
    return importlib.import_module("torch")


def _wait_for_file_size(fd: int, expected_size: int, timeout: float = _WAIT_FOR_SIZE_S) -> None:
    """Wait (at most ``timeout`` seconds) until the creator has sized the file. A file that
    lost its last name while we wait was removed by a creator that failed: say so at once
    rather than wait out the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        st = os.fstat(fd)
        if st.st_size >= expected_size:
            return
        if st.st_nlink == 0:
            raise RuntimeError("the shared offload region's creator failed during initialization (it removed the file)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared offload file did not reach {expected_size} bytes within {timeout:g} s (its creator died?)")
        time.sleep(0.005)


def check_shm_free_space(required_bytes: int, shm_path: str = "/dev/shm", *, allocation_name: str = "shared-memory allocation") -> None:
    """Refuse, before sizing the file, an allocation ``shm_path`` has no room for: a sparse
    file grows past the free space and the first write beyond it kills the process (SIGBUS)."""
    if not os.path.isdir(shm_path):
        return
    free = shutil.disk_usage(shm_path).free
    if required_bytes > free:
        mib = 1 << 20
        raise RuntimeError(
            f"Insufficient space in {shm_path} for {allocation_name}: {required_bytes / mib:.0f} MiB required, "
            f"{free / mib:.0f} MiB free (enlarge {shm_path}, e.g. docker --shm-size or --ipc=host)"
        )


# --- pre-faulting --------------------------------------------------------------------------------


def _madvise_populate_write(mmap_obj: mmap.mmap, offset: int, length: int) -> None:
    mmap_obj.madvise(_MADV_POPULATE_WRITE, offset, length)


def _fallback_populate_write(mmap_obj: mmap.mmap, offset: int, length: int) -> None:
    """Fault pages in by writing each page's first byte back to itself: another worker may
    already have written KV into this shared memory, so the bytes must not change."""
    pages = np.frombuffer(mmap_obj, dtype=np.uint8, count=length, offset=offset)
    pages[:: mmap.PAGESIZE] |= 0
    del pages


def _get_populate_write_fn(mmap_obj: mmap.mmap) -> Callable[[mmap.mmap, int, int], None]:
    """Try the advice once on the first page; a kernel without it (EINVAL) gets the
    byte-per-page fallback. Any other error is real and propagates."""
    try:
        _madvise_populate_write(mmap_obj, 0, mmap.PAGESIZE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        logger.warning("MADV_POPULATE_WRITE is not supported; pre-faulting the offload region page by page (slower start)")
        return _fallback_populate_write
    return _madvise_populate_write


@functools.cache
def _libc_mmap() -> Callable[..., int | None]:
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fn.restype = ctypes.c_void_p
    return fn


def _plan_segments(path: str, num_rows: int, row_bytes: int, wanted: int) -> list[tuple[str, int, int]]:
    """(file, byte offset, length) of each segment: whole rows, as even as possible, none
    smaller than ``_MIN_SEGMENT_BYTES`` -- so a small region is always one file."""
    count = max(1, min(wanted, num_rows * row_bytes // _MIN_SEGMENT_BYTES))
    rows_each = cdiv(num_rows, count)
    return [
        (path if i == 0 else f"{path}.{i}", first * row_bytes, min(rows_each, num_rows - first) * row_bytes)
        for i, first in enumerate(range(0, num_rows, rows_each))
    ]


class SharedOffloadRegion:
    """``num_chunks`` rows of ``kv_bytes_per_chunk`` bytes in ``/dev/shm/vllm_offload_{engine_id}.mmap``."""

    BLOCK_SIZE_ALIGNMENT: int = mmap.PAGESIZE

    # Defaults for a region built without __init__ (tests describe one without mapping it).
    _base_tensor: Any = None
    _released = False
    rank: int | None = None

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
        populate_shard: tuple[int, int] | None = None,
        num_segments: int = 1,
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
        num_segments = check_int("num_segments", num_segments, 1)
        if populate_shard is not None:
            if not (isinstance(populate_shard, tuple) and len(populate_shard) == 2):
                raise ValueError(f"populate_shard must be a pair (index, count), got {populate_shard!r}")
            count = check_int("populate_shard count", populate_shard[1], 1)
            populate_shard = (check_int("populate_shard index", populate_shard[0], 0, count - 1), count)
        self._row_stride = kv_bytes_per_chunk
        self.total_size_bytes = self.num_chunks * kv_bytes_per_chunk
        self.mmap_path = os.path.join(_shm_dir(), f"vllm_offload_{engine_id}.mmap")
        self._segments = _plan_segments(self.mmap_path, self.num_chunks, self._row_stride, num_segments)
        if self.rank is not None:
            self._worker_offset = self.rank * self.cpu_page_size  # where the next worker view starts
            self._worker_area_end = (self.rank + 1) * self.cpu_page_size
        self._canonical_offset = 0
        self._views: list[Any] = []
        self.is_pinned = False
        self.pinned_addresses: list[int] = []
        self._creator = False
        self.fd: int | None = None
        self.mmap_obj: mmap.mmap | None = None
        barriers_owed = 0 if barrier is None else (2 if populate_shard is not None else 1)
        try:
            try:
                self.fd = os.open(self.mmap_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                self.fd = os.open(self.mmap_path, os.O_RDWR)
                _wait_for_file_size(self.fd, self._segments[0][2])
            else:
                self._create_files(creator_memory_check)
            self._map()
            if barrier is not None:
                barriers_owed -= 1
                barrier()
                if self._creator:
                    self._unlink()  # every worker has mapped it: the name is no longer needed
            if populate_shard is not None:
                self._populate_share(*populate_shard)
                if barrier is not None:
                    barriers_owed -= 1
                    barrier()  # nobody copies into pages another worker is still faulting in
            else:
                populate = _get_populate_write_fn(self.mmap_obj)  # type: ignore[arg-type]
                ranges = self.iter_worker_slot_ranges() if self.rank is not None else iter([(0, self.total_size_bytes)])
                for offset, length in ranges:
                    populate(self.mmap_obj, offset, length)  # type: ignore[arg-type]
        except Exception:
            self._release_after_failure(barrier, barriers_owed)
            raise

    # --- construction ------------------------------------------------------------------------

    def _create_files(self, creator_memory_check: Callable[[int], None] | None) -> None:
        """We won ``O_EXCL``: check the room, size every segment file, the first one last --
        joiners wait on the first file's size, so they see it only once all files exist."""
        self._creator = True
        if creator_memory_check is not None:
            creator_memory_check(self.total_size_bytes)
        check_shm_free_space(self.total_size_bytes, allocation_name=_ALLOCATION_NAME)
        for path, _, length in self._segments[1:]:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, length)
            finally:
                os.close(fd)
        assert self.fd is not None
        os.ftruncate(self.fd, self._segments[0][2])

    def _map(self) -> None:
        """One contiguous mapping. Several segments: reserve the whole range anonymously, then
        map each file over its part (``MAP_FIXED``), so the region is still one address range."""
        assert self.fd is not None
        single = len(self._segments) == 1
        self.mmap_obj = mmap.mmap(
            self.fd if single else -1,
            self.total_size_bytes,
            flags=mmap.MAP_SHARED if single else mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        if single:
            return
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mmap_obj))
        for i, (path, offset, length) in enumerate(self._segments):
            fd = self.fd if i == 0 else os.open(path, os.O_RDWR)
            try:
                got = _libc_mmap()(base + offset, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            finally:
                if fd != self.fd:
                    os.close(fd)
            if got != base + offset:
                raise OSError(ctypes.get_errno(), f"could not map segment {path} at offset {offset}")

    def _populate_share(self, index: int, count: int) -> None:
        """Pre-fault the ``index``-th of ``count`` page-rounded contiguous shares (the last
        ones may be short or empty)."""
        populate = _get_populate_write_fn(self.mmap_obj)  # type: ignore[arg-type]
        share = round_up(cdiv(self.total_size_bytes, count), self.page_size)
        start = min(index * share, self.total_size_bytes)
        if start < self.total_size_bytes:
            populate(self.mmap_obj, start, min(share, self.total_size_bytes - start))  # type: ignore[arg-type]

    def _release_after_failure(self, barrier: Callable[[], None] | None, barriers_owed: int) -> None:
        """Undo a failed start: drop the files first (so a peer released below never finds
        a stale one), then unmap, close, and arrive at the barriers still owed. A barrier
        that fails now is logged: the error that explains the failure is the caller's."""
        if self._creator:
            self._unlink()
        if self.mmap_obj is not None:
            with contextlib.suppress(BufferError):  # a traceback may still hold a view of it
                self.mmap_obj.close()
            self.mmap_obj = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._released = True
        for _ in range(barriers_owed):
            try:
                barrier()  # type: ignore[misc]
            except Exception:
                logger.warning("could not release the peers waiting at the offload region's barrier", exc_info=True)

    def _unlink(self) -> None:
        for path, _, _ in self._segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._creator = False

    # --- the worker's views ---------------------------------------------------------------------

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
        """(offset, length) of this worker's slot in each row, rounded out to whole pages.
        With several segment files each worker starts on a different file, so workers that
        walk their slots at the same time do not queue on one file."""
        if self.rank is None:
            raise ValueError("iter_worker_slot_ranges needs the region's rank; this one was opened with rank=None")
        first = 0
        if len(self._segments) > 1:
            first = self.rank * self.num_chunks // (self._row_stride // self.cpu_page_size)
        own = self.rank * self.cpu_page_size
        for i in range(self.num_chunks):
            start = ((first + i) % self.num_chunks) * self._row_stride + own
            aligned = start - start % self.page_size
            yield aligned, round_up(start + self.cpu_page_size, self.page_size) - aligned

    @property
    def _base(self) -> Any:
        """The whole mapping as a flat int8 tensor, made on first use (see the module doc)."""
        if self._base_tensor is None and not self._released and self.mmap_obj is not None:
            torch = _torch()
            self._base_tensor = torch.frombuffer(memoryview(self.mmap_obj), dtype=torch.int8)
        return self._base_tensor

    @_base.setter
    def _base(self, value: Any) -> None:
        self._base_tensor = value

    @property
    def base_tensor(self) -> Any:
        base = self._base
        if base is None:
            raise RuntimeError("the shared offload region has been released (cleanup() ran)")
        return base

    def _row_view(self, offset: int, nbytes: int) -> Any:
        view = _torch().as_strided(self.base_tensor, size=(self.num_chunks, nbytes), stride=(self._row_stride, 1), storage_offset=offset)
        self._views.append(view)
        return view

    def create_next_worker_view(self, tensor_page_size: int) -> Any:
        """The next ``tensor_page_size`` bytes of this worker's slot in every row: an int8
        tensor ``(num_chunks, tensor_page_size)``, stride ``(row_bytes, 1)`` (int8, so strides
        are bytes). Call once per KV tensor; views that would overrun the slot are refused
        (AssertionError, as vLLM) and the cursor does not move."""
        if self.rank is None:
            raise ValueError("create_next_worker_view needs the region's rank; this one was opened with rank=None")
        tensor_page_size = check_int("tensor_page_size", tensor_page_size, 1)
        end = self._worker_offset + tensor_page_size
        if end > self._worker_area_end:
            raise AssertionError(
                f"Worker offset {end} exceeds worker area end {self._worker_area_end} (overflowed by "
                f"{end - self._worker_area_end} bytes): tensor_page_size={tensor_page_size} but only "
                f"{self._worker_area_end - self._worker_offset} of rank {self.rank}'s {self.cpu_page_size} bytes are left"
            )
        view = self._row_view(self._worker_offset, tensor_page_size)
        self._worker_offset = end
        return view

    def create_next_canonical_view(self, tensor_page_size: int) -> Any:
        """The next ``tensor_page_size`` bytes from the start of every row, the same bytes for
        every worker (the canonical layout): used instead of ``create_next_worker_view``.
        What the canonical pages leave of a row stays unused."""
        tensor_page_size = check_int("tensor_page_size", tensor_page_size, 1)
        end = self._canonical_offset + tensor_page_size
        if end > self._row_stride:
            raise AssertionError(
                f"canonical offset {end} exceeds the row of {self._row_stride} bytes: tensor_page_size={tensor_page_size} "
                f"but only {self._row_stride - self._canonical_offset} bytes of the row are left"
            )
        view = self._row_view(self._canonical_offset, tensor_page_size)
        self._canonical_offset = end
        return view

    def create_kv_memoryview(self) -> memoryview:
        """A zero-copy (num_chunks, kv_bytes_per_chunk) byte view of the whole region."""
        if self.mmap_obj is None or self._released:
            raise ValueError("the region was cleaned up")
        rows = np.frombuffer(self.mmap_obj, dtype=np.uint8).reshape(self.num_chunks, self._row_stride)
        return rows.data

    # --- the end ------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Unpin, drop the tensor views, unmap, close, and (if this process created the file
        and no barrier unlinked it) remove the files. Idempotent.

        A buffer some native user still holds (``BufferError`` on close) keeps the mapping:
        unmapping under it would let a copy engine write into reused addresses. The file
        descriptor and the name still go."""
        if self.is_pinned:
            for address in reversed(self.pinned_addresses):
                host_unregister(address)
            self.pinned_addresses.clear()
            self.is_pinned = False
        self._views.clear()  # the views hold the base tensor, which holds the mapping's buffer
        self._base_tensor = None
        self._released = True
        if self.mmap_obj is not None:
            try:
                self.mmap_obj.close()
            except BufferError:
                logger.warning("keeping %s mapped: a buffer of it is still exported", self.mmap_path)
            else:
                self.mmap_obj = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._creator:
            self._unlink()
