"""The bytes of the CPU tier, and the copies in and out of it (vLLM:
``vllm/v1/kv_offload/cpu/gpu_worker.py``; lesson 12).

The CPU tier is one host tensor ``[num_cpu_blocks, num_layers, 2, block_size, kv_heads,
head_dim]``: slot ``s`` holds one GPU block's keys and values for every layer. A store copies
GPU block ``b`` of every layer's paged cache (``kv_caches[l][b]``) into slot ``s``; a load
copies it back into whatever GPU block the request got this time. On a machine without a
GPU both are host copies, still real tensor copies -- the bytes round-trip exactly, which is
why greedy outputs with offloading equal those without. A slot is also what a storage file
holds: ``slot_bytes`` / ``put_slot_bytes`` are what the connector's worker writes to and
reads from a file.

The simulated executor has no tensors (``kv_caches`` is empty): then a slot is zero bytes,
files carry only their header, and everything else -- slots, files, checks -- is the same.

vLLM 0.33's own worker is below :class:`CPUKVBuffer`: :class:`CPUOffloadingWorker` with one
:class:`SingleDirectionOffloadingHandler` per direction (stores, loads, expedited loads).
Every KV tensor is seen as int8 rows ``(num_blocks, page_bytes)``; a transfer becomes a list
of copy descriptors (source address, destination address, bytes), one per page -- or, in the
canonical layout, one per fragment of a :class:`~kvlab.kv_offload.base.CopyRun`. vLLM hands
that list to a CUDA kernel on a stream; kvlab copies host memory, so it runs the list at once
with ``memmove`` and the job is finished when ``transfer_async`` returns. The order of
completion, the byte counts and the clean-up at ``shutdown`` are vLLM's. CUDA tensors are
refused: kvlab has no device copy kernel. ``pin_mmap_region`` registers the shared region
with CUDA in row-aligned chunks (a no-op without CUDA: the region stays pageable).

torch is imported where a tensor is first needed, not at import: the simulated engine uses
this module without tensors and should not pay for loading torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvlab.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalPageMapping,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from kvlab.kv_offload.cpu.host_register import host_register, host_unregister
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.utils.checks import check_int
from kvlab.utils.math_utils import cdiv

logger = logging.getLogger(__name__)

#: vLLM picks a Triton copy kernel for small loads when Triton is usable; kvlab's worker has
#: no device kernel at all (it copies host memory), so never.
HAS_TRITON = False


class CPUKVBuffer:
    """Host memory for ``num_blocks`` GPU blocks of every layer."""

    def __init__(self, num_blocks: int, kv_caches: Sequence[Any]) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.kv_caches = list(kv_caches)
        self.tensor: Any = None
        self.block_nbytes = 0
        if self.kv_caches:
            import torch

            first = self.kv_caches[0]
            for i, t in enumerate(self.kv_caches):
                if t.shape != first.shape or t.dtype != first.dtype:
                    raise ValueError(
                        f"kv_caches[{i}] has shape {tuple(t.shape)} {t.dtype}; every layer must match {tuple(first.shape)} {first.dtype}"
                    )
            # [slots, layers, 2, block_size, kv_heads, head_dim], pinned would be nicer on CUDA
            self.tensor = torch.zeros((self.num_blocks, len(self.kv_caches), *first.shape[1:]), dtype=first.dtype)
            self.block_nbytes = self.tensor[0].numel() * self.tensor.element_size()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"CPU slot {slot} out of range 0..{self.num_blocks - 1}")

    def store(self, gpu_block: int, slot: int) -> None:
        """GPU block -> CPU slot, every layer."""
        self._check_slot(slot)
        for layer, kv in enumerate(self.kv_caches):
            self.tensor[slot, layer].copy_(kv[gpu_block])

    def load(self, slot: int, gpu_block: int) -> None:
        """CPU slot -> GPU block, every layer."""
        self._check_slot(slot)
        for layer, kv in enumerate(self.kv_caches):
            kv[gpu_block].copy_(self.tensor[slot, layer], non_blocking=False)

    def slot_bytes(self, slot: int) -> bytes:
        self._check_slot(slot)
        if self.tensor is None:
            return b""
        import torch

        return self.tensor[slot].contiguous().view(torch.uint8).numpy().tobytes()

    def put_slot_bytes(self, slot: int, payload: bytes) -> None:
        """Fill a slot from bytes (what a storage file holds)."""
        self._check_slot(slot)
        if len(payload) != self.block_nbytes:
            raise ValueError(f"slot payload has {len(payload)} bytes, a slot holds {self.block_nbytes}")
        if self.tensor is not None:
            import torch

            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.tensor[slot].copy_(raw.view(self.tensor.dtype).view(self.tensor.shape[1:]))


# --- vLLM 0.33's worker: copy descriptors, the canonical layout, pinning -----------------------


class CopyPlan(NamedTuple):
    """One data reference's canonical copy, unrolled: fragment ``i`` copies
    ``frag_sizes[i]`` bytes from ``frag_offsets_src[i]`` to ``frag_offsets_dst[i]``, offsets
    relative to the block's base address on each side. Built once per handler."""

    frag_offsets_src: np.ndarray
    frag_offsets_dst: np.ndarray
    frag_sizes: np.ndarray
    total_bytes: int

    @property
    def num_frags(self) -> int:
        return len(self.frag_sizes)


def _build_copy_plan(ref: CanonicalKVCacheRef, gpu_to_cpu: bool) -> CopyPlan:
    """Unroll ``ref.mapping``'s runs into fragments; a store reads the worker's (local)
    page and writes the canonical one, a load the other way round."""
    if ref.mapping is None:
        raise ValueError(f"tensor {ref.tensor_idx}'s reference has no canonical mapping (mapping=None)")
    local: list[int] = []
    canonical: list[int] = []
    sizes: list[int] = []
    for run in ref.mapping.runs:
        local.extend(run.local_offset + i * run.local_stride for i in range(run.num_fragments))
        canonical.extend(run.canonical_offset + i * run.canonical_stride for i in range(run.num_fragments))
        sizes.extend([run.fragment_size] * run.num_fragments)
    src, dst = (local, canonical) if gpu_to_cpu else (canonical, local)
    return CopyPlan(np.asarray(src, dtype=np.uint64), np.asarray(dst, dtype=np.uint64), np.asarray(sizes, dtype=np.int64), sum(sizes))


def _canonical_page_ids(block_ids: np.ndarray, blocks_per_chunk: int, count: int, skip_count: int) -> np.ndarray:
    """The global ids of the ``count`` canonical pages a transfer touches, skipping the first
    ``skip_count`` of the first chunk: chunk ``c`` holds pages ``c * blocks_per_chunk + j``.
    Every worker numbers them alike, so the ids pick the writer (``is_writer``)."""
    if blocks_per_chunk == 1:
        return block_ids[:count]
    pages = (block_ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return pages[skip_count : skip_count + count]


def _canonical_block_sizes(layer_refs_per_group: list[list[CanonicalKVCacheRef]], num_tensors: int) -> list[int]:
    """Canonical bytes per GPU block of each tensor: the largest canonical page among the
    references to it. Every reference needs a mapping, and every tensor a reference."""
    sizes = [0] * num_tensors
    for refs in layer_refs_per_group:
        for ref in refs:
            if ref.mapping is None:
                raise ValueError(f"the canonical layout needs a mapping on every reference; tensor {ref.tensor_idx}'s has none")
            sizes[ref.tensor_idx] = max(sizes[ref.tensor_idx], ref.mapping.canonical_page_size_bytes)
    missing = [i for i, size in enumerate(sizes) if size <= 0]
    if missing:
        raise ValueError(f"tensors {missing} have no reference with a canonical page (num_tensors={num_tensors})")
    return sizes


def _block_addresses(block_ids: np.ndarray, blocks_per_chunk: int, count: int, tensor: Any, skip_count: int = 0) -> np.ndarray:
    """Base address of each of ``count`` pages, in order: page ``j`` of row ``b`` starts
    ``b * row_stride + j * (row_bytes // blocks_per_chunk)`` into the tensor (a row's stride
    may exceed its bytes -- a worker view of the shared region)."""
    rows = block_ids.astype(np.uint64)[:, None] * np.uint64(tensor.stride(0))
    page = tensor.shape[1] // blocks_per_chunk
    pages = (rows + np.arange(blocks_per_chunk, dtype=np.uint64) * np.uint64(page)).ravel()
    return np.uint64(tensor.data_ptr()) + pages[skip_count : skip_count + count]


#: One registration at most this big (drivers refuse huge ones).
MAX_HOST_REGISTER_CHUNK_BYTES = 64 * 1024**3
#: Register only this worker's slots when that leaves at least this much of each row out;
#: below it, one call per row costs more than registering the whole region.
MIN_HOST_REGISTER_SAVED_BYTES = 3 * 1024**2


def pin_mmap_region(region: SharedOffloadRegion, worker_slot_only: bool = False) -> None:
    """Register the shared region with the device for fast copies: in chunks that end on row
    boundaries (no page and no block straddles two registrations), or -- ``worker_slot_only``,
    when that saves enough per row -- only this worker's slot of each row. All or nothing:
    if one registration fails, those before it are released and the region stays pageable."""
    base = region._base.data_ptr()
    total = region.total_size_bytes
    row = region._row_stride
    chunk = max(MAX_HOST_REGISTER_CHUNK_BYTES // row, 1) * row
    ranges: Iterator[tuple[int, int]] = ((offset, min(chunk, total - offset)) for offset in range(0, total, chunk))
    min_saved = max(region.page_size, MIN_HOST_REGISTER_SAVED_BYTES)
    if worker_slot_only and region.rank is not None and row - region.cpu_page_size >= min_saved:
        ranges = region.iter_worker_slot_ranges()
    else:
        logger.info("registering the whole offload region (rank=%s, row=%d, slot=%d bytes)", region.rank, row, region.cpu_page_size)
    done: list[int] = []
    for offset, size in ranges:
        if host_register(base + offset, size):
            done.append(base + offset)
            continue
        logger.warning("host registration failed at byte %d of %d; the offload region stays pageable", offset, total)
        for address in reversed(done):
            host_unregister(address)
        return
    region.pinned_addresses.extend(done)
    region.is_pinned = True


class _DoneEvent:
    """What a transfer's CUDA event answers, for a copy that already ran: done, and how long
    it took (milliseconds, as ``torch.Event.elapsed_time``)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _DoneEvent) -> float:
        return max(end.t - self.t, 1e-9) * 1e3


@dataclass
class Transfer:
    """A submitted job, until ``get_finished`` reports it (vLLM also keeps its stream and
    descriptor buffers here; kvlab copies at once and keeps neither)."""

    job_id: int
    start_event: Any
    end_event: Any
    num_bytes: int


def _host_tensor_check(name: str, t: Any) -> None:
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != torch.int8 or t.ndim != 2:
        raise ValueError(
            f"{name} must be an int8 tensor (num_blocks, page_bytes), got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
        )
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; kvlab's offloading handler copies host memory only (it has no device kernel)")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride(1) == 1), got strides {t.stride()}")


class SingleDirectionOffloadingHandler:
    """The copies of one direction (GPU -> CPU or CPU -> GPU), finished in submission order.

    ``gpu_tensors[i]`` is ``(num_gpu_blocks, gpu_page_bytes)`` int8; ``cpu_tensors[i]`` is
    ``(num_cpu_chunks, gpu_page_bytes * blocks_per_chunk)`` int8 -- or, with
    ``canonical_layout``, ``canonical_bytes_per_block * blocks_per_chunk`` per row, written
    through the references' :class:`~kvlab.kv_offload.base.CanonicalPageMapping`."""

    def __init__(
        self,
        gpu_tensors: list[Any],
        cpu_tensors: list[Any],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        canonical_layout: bool = False,
        host_memory_is_pinned: bool = True,
    ) -> None:
        blocks_per_chunk = check_int("blocks_per_chunk", blocks_per_chunk, 1)
        if not gpu_tensors or len(gpu_tensors) != len(cpu_tensors):
            raise ValueError(f"need one cpu tensor per gpu tensor, at least one: got {len(gpu_tensors)} gpu, {len(cpu_tensors)} cpu")
        canonical_sizes = _canonical_block_sizes(layer_refs_per_group, len(gpu_tensors)) if canonical_layout else None
        for i, (gpu, cpu) in enumerate(zip(gpu_tensors, cpu_tensors)):
            _host_tensor_check(f"gpu_tensors[{i}]", gpu)
            _host_tensor_check(f"cpu_tensors[{i}]", cpu)
            per_block = gpu.shape[1] if canonical_sizes is None else canonical_sizes[i]
            if cpu.shape[1] != per_block * blocks_per_chunk:
                raise ValueError(
                    f"cpu_tensors[{i}] rows hold {cpu.shape[1]} bytes; {blocks_per_chunk} blocks of {per_block} bytes need {per_block * blocks_per_chunk}"
                )
        for refs in layer_refs_per_group:
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(gpu_tensors):
                    raise ValueError(f"a reference names tensor_idx={ref.tensor_idx}; there are {len(gpu_tensors)} tensors")
                if not canonical_layout and ref.page_size_bytes > gpu_tensors[ref.tensor_idx].shape[1]:
                    raise ValueError(f"page_size_bytes={ref.page_size_bytes} exceeds tensor {ref.tensor_idx}'s page")
        self.src_tensors: list[Any] = list(gpu_tensors if gpu_to_cpu else cpu_tensors)
        self.dst_tensors: list[Any] = list(cpu_tensors if gpu_to_cpu else gpu_tensors)
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self.host_memory_is_pinned = host_memory_is_pinned
        # A chunk spans blocks_per_chunk GPU blocks: the CPU side counts pages within chunks.
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._canonical_copy_plans: list[list[CopyPlan]] | None = (
            [[_build_copy_plan(ref, gpu_to_cpu) for ref in refs] for refs in layer_refs_per_group] if canonical_layout else None
        )
        self._transfer_events: dict[int, Any] = {}
        self._transfers: deque[Transfer] = deque()
        # vLLM's reusable streams, events and descriptor buffers; kvlab's copies need none,
        # the pools stay so shutdown() releases the same things.
        self._stream_pool: list[Any] = []
        self._event_pool: list[Any] = []
        self._buffer_pool: list[tuple[Any, Any, Any]] = []

    # --- building the descriptors -------------------------------------------------------------

    def _group_ops(
        self, g_idx: int, src_ids: np.ndarray, dst_ids: np.ndarray, count: int, src_skip: int, dst_skip: int
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], int]:
        srcs: list[np.ndarray] = []
        dsts: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        num_bytes = 0
        for r_idx, ref in enumerate(self.layer_refs_per_group[g_idx]):
            t = ref.tensor_idx
            src_base = _block_addresses(src_ids, self.src_blocks_per_chunk, count, self.src_tensors[t], src_skip)
            dst_base = _block_addresses(dst_ids, self.dst_blocks_per_chunk, count, self.dst_tensors[t], dst_skip)
            if self._canonical_copy_plans is None:
                srcs.append(src_base)
                dsts.append(dst_base)
                sizes.append(np.full(count, ref.page_size_bytes, dtype=np.int64))
                num_bytes += count * ref.page_size_bytes
                continue
            plan = self._canonical_copy_plans[g_idx][r_idx]
            mapping: CanonicalPageMapping | None = ref.mapping
            if self.gpu_to_cpu and mapping is not None and mapping.num_writers > 1:
                pages = _canonical_page_ids(dst_ids, self.dst_blocks_per_chunk, count, dst_skip)
                mine = pages % mapping.num_writers == mapping.writer_index
                src_base, dst_base = src_base[mine], dst_base[mine]
            srcs.append((src_base[:, None] + plan.frag_offsets_src[None, :]).ravel())
            dsts.append((dst_base[:, None] + plan.frag_offsets_dst[None, :]).ravel())
            sizes.append(np.tile(plan.frag_sizes, len(src_base)))
            num_bytes += len(src_base) * plan.total_bytes
        return srcs, dsts, sizes, num_bytes

    def _plan(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(source addresses, destination addresses, sizes, bytes) of a transfer; every
        block id is checked against its tensors first, so a bad spec copies nothing."""
        if not isinstance(src_spec, BlockIDsLoadStoreSpec) or not isinstance(dst_spec, BlockIDsLoadStoreSpec):
            raise TypeError(
                f"src_spec and dst_spec must name blocks (BlockIDsLoadStoreSpec), got {type(src_spec).__name__}, {type(dst_spec).__name__}"
            )
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            side = "src_spec" if self.gpu_to_cpu else "dst_spec"
            raise TypeError(f"{side} must be a GPULoadStoreSpec (its groups say how blocks map to chunks), got {type(gpu_spec).__name__}")
        groups = len(self.layer_refs_per_group)
        if len(gpu_spec.group_sizes) != groups or len(gpu_spec.block_indices) != groups:
            raise ValueError(f"the GPU spec has {len(gpu_spec.group_sizes)} groups; this handler has {groups}")
        src_blocks, dst_blocks = np.asarray(src_spec.block_ids), np.asarray(dst_spec.block_ids)
        for name, ids, tensors in (("src", src_blocks, self.src_tensors), ("dst", dst_blocks, self.dst_tensors)):
            rows = min(t.shape[0] for t in tensors)
            if len(ids) and not (0 <= ids.min() and ids.max() < rows):
                raise IndexError(f"{name} block ids {ids.tolist()} must be in 0..{rows - 1}")
        srcs: list[np.ndarray] = []
        dsts: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        num_bytes = src_at = dst_at = 0
        for g_idx, (count, first) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            if count == 0:
                continue
            src_skip, dst_skip = first % self.src_blocks_per_chunk, first % self.dst_blocks_per_chunk
            src_n = cdiv(count + src_skip, self.src_blocks_per_chunk)
            dst_n = cdiv(count + dst_skip, self.dst_blocks_per_chunk)
            if src_at + src_n > len(src_blocks) or dst_at + dst_n > len(dst_blocks):
                raise ValueError(f"group {g_idx} needs {src_n} src and {dst_n} dst blocks past the ones before it; the specs are too short")
            s, d, z, b = self._group_ops(
                g_idx, src_blocks[src_at : src_at + src_n], dst_blocks[dst_at : dst_at + dst_n], count, src_skip, dst_skip
            )
            srcs += s
            dsts += d
            sizes += z
            num_bytes += b
            src_at, dst_at = src_at + src_n, dst_at + dst_n
        if src_at != len(src_blocks) or dst_at != len(dst_blocks):
            raise ValueError(
                f"the groups use {src_at} src and {dst_at} dst blocks, but the specs have {len(src_blocks)} and {len(dst_blocks)}"
            )
        empty_u, empty_i = np.empty(0, np.uint64), np.empty(0, np.int64)
        return (
            np.concatenate(srcs) if srcs else empty_u,
            np.concatenate(dsts) if dsts else empty_u,
            np.concatenate(sizes) if sizes else empty_i,
            num_bytes,
        )

    # --- the verbs ------------------------------------------------------------------------------

    def transfer_async(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Submit job ``job_id``. kvlab runs the copies now; ``get_finished`` reports it."""
        if job_id in self._transfer_events:
            raise ValueError(f"job {job_id} is already in flight in this direction")
        src, dst, sizes, num_bytes = self._plan(src_spec, dst_spec)
        start = self._event_pool.pop() if self._event_pool else _DoneEvent()
        end = self._event_pool.pop() if self._event_pool else _DoneEvent()
        start.record()
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)
        end.record()
        self._transfer_events[job_id] = end
        self._transfers.append(Transfer(job_id, start, end, num_bytes))
        return True

    def get_finished(self) -> list[TransferResult]:
        """The jobs finished since the last call, in submission order."""
        results: list[TransferResult] = []
        while self._transfers and self._transfers[0].end_event.query():
            t = self._transfers.popleft()
            seconds = t.start_event.elapsed_time(t.end_event) * 1e-3
            results.append(TransferResult(job_id=t.job_id, success=True, transfer_size=t.num_bytes, transfer_time=seconds))
            self._event_pool += [t.end_event, t.start_event]
            del self._transfer_events[t.job_id]
        return results

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            event = self._transfer_events.get(job_id)
            if event is not None:
                event.synchronize()

    def shutdown(self) -> None:
        """Wait for the jobs in flight, then drop everything this direction holds. A job that
        cannot be waited for ends the wait (the device is gone: the rest cannot finish
        either); its error is raised after the clean-up."""
        error: Exception | None = None
        while self._transfers:
            try:
                self._transfers[0].end_event.synchronize()
            except Exception as e:
                logger.exception("a transfer could not be waited for; dropping it and the %d after it", len(self._transfers) - 1)
                error = e
                self._transfers.clear()
                break
            self._transfers.popleft()
        self._transfer_events.clear()
        self._stream_pool.clear()
        self._event_pool.clear()
        self._buffer_pool.clear()
        self.src_tensors.clear()
        self.dst_tensors.clear()
        if error is not None:
            raise error


class CPUOffloadingWorker(OffloadingWorker):
    """vLLM 0.33's CPU offloading worker: a store handler, a load handler and an expedited-load
    handler (its own queue, so a load the step waits for does not queue behind others) over
    the same tensors. The CPU side is ``mmap_region``'s views (this worker's slots, or the
    shared canonical pages) or, without a region, private host tensors.

    Ownership: the caller owns ``mmap_region`` until the constructor returns; from then on
    the worker does, and ``shutdown`` releases it once no copy can touch it."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
    ) -> None:
        import torch

        blocks_per_chunk = check_int("blocks_per_chunk", blocks_per_chunk, 1)
        num_cpu_chunks = check_int("num_cpu_chunks", num_cpu_chunks, 1)
        if canonical_layout and mmap_region is None:
            raise ValueError("canonical_layout=True needs an mmap_region: canonical pages are shared by every worker")
        pin = bool(torch.cuda.is_available())
        if mmap_region is not None and pin:
            pin_mmap_region(mmap_region, worker_slot_only=not canonical_layout)
        pinned = pin and (mmap_region is None or mmap_region.is_pinned)
        canonical = _canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors)) if canonical_layout else None
        gpu_tensors: list[Any] = []
        cpu_tensors: list[Any] = []
        for i, kv in enumerate(kv_caches.tensors):
            gpu_tensors.append(kv.tensor.view(torch.int8).view(-1, kv.page_size_bytes))
            if canonical is not None:
                assert mmap_region is not None
                cpu_tensors.append(mmap_region.create_next_canonical_view(canonical[i] * blocks_per_chunk))
            elif mmap_region is not None:
                cpu_tensors.append(mmap_region.create_next_worker_view(kv.page_size_bytes * blocks_per_chunk))
            else:
                cpu_tensors.append(torch.zeros((num_cpu_chunks, kv.page_size_bytes * blocks_per_chunk), dtype=torch.int8, pin_memory=pin))
        make = functools.partial(
            SingleDirectionOffloadingHandler,
            gpu_tensors=gpu_tensors,
            cpu_tensors=cpu_tensors,
            blocks_per_chunk=blocks_per_chunk,
            layer_refs_per_group=kv_caches.group_data_refs,
            canonical_layout=canonical_layout,
            host_memory_is_pinned=pinned,
        )
        self._store_handler = make(gpu_to_cpu=True)
        self._load_handler = make(gpu_to_cpu=False)
        self._expedited_load_handler = make(gpu_to_cpu=False)
        self._mmap_region = mmap_region

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """GPU -> CPU."""
        return self._store_handler.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """CPU -> GPU; ``expedited``: on its own queue."""
        handler = self._expedited_load_handler if expedited else self._load_handler
        return handler.transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return self._store_handler.get_finished() + self._load_handler.get_finished() + self._expedited_load_handler.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        for handler in (self._store_handler, self._load_handler, self._expedited_load_handler):
            handler.wait(job_ids)

    def shutdown(self) -> None:
        """Drain the three handlers (stores first), then release the shared region. A handler
        that fails to drain is logged and the others still drain; the device is then
        synchronized before the region goes, so no copy still in flight writes into it."""
        failed = False
        for name, handler in (("store", self._store_handler), ("load", self._load_handler), ("load", self._expedited_load_handler)):
            try:
                handler.shutdown()
            except Exception:
                logger.exception("Failed to shut down %s offloading handler", name)
                failed = True
        if self._mmap_region is None:
            return
        if failed:
            import torch

            try:
                torch.accelerator.synchronize()
            except Exception:
                logger.warning("Device sync before mmap cleanup failed; releasing the region anyway", exc_info=True)
        self._mmap_region.cleanup()
        self._mmap_region = None
