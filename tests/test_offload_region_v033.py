"""vLLM 0.33's shared offload region and CPU offloading worker, on kvlab: the call shapes
(``populate_shard``, ``num_segments``, worker and canonical views, ``pin_mmap_region``,
``CPUOffloadingWorker``), their refusals, and where the bytes land."""

from __future__ import annotations

import errno
import mmap
import os
import uuid
from unittest.mock import MagicMock, call

import numpy as np
import pytest
import torch

from kvlab.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from kvlab.kv_offload.cpu import gpu_worker
from kvlab.kv_offload.cpu import shared_offload_region as region_module
from kvlab.kv_offload.cpu.common import CPULoadStoreSpec
from kvlab.kv_offload.cpu.gpu_worker import (
    CPUOffloadingWorker,
    SingleDirectionOffloadingHandler,
    _build_copy_plan,
    _canonical_block_sizes,
    _canonical_page_ids,
    pin_mmap_region,
)
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion, _wait_for_file_size

P = mmap.PAGESIZE


@pytest.fixture
def name():
    n = f"kvlab_v033_{uuid.uuid4().hex[:12]}"
    yield n
    for i in range(4):
        base = os.path.join(region_module._shm_dir(), f"vllm_offload_{n}.mmap")
        path = base if i == 0 else f"{base}.{i}"
        if os.path.exists(path):
            os.unlink(path)


def rows(region: SharedOffloadRegion) -> np.ndarray:
    return np.asarray(region.create_kv_memoryview())


# --- worker views ----------------------------------------------------------------------------------


def test_worker_views_put_each_rank_at_its_slot_in_every_row(name):
    r0 = SharedOffloadRegion(name, 3, 0, 2 * 2 * P, 2 * P)
    r1 = SharedOffloadRegion(name, 3, 1, 2 * 2 * P, 2 * P)
    try:
        a, b = r1.create_next_worker_view(P), r1.create_next_worker_view(P)
        assert (a.shape, a.stride(), b.stride()) == ((3, P), (4 * P, 1), (4 * P, 1))
        assert a.data_ptr() - r1._base.data_ptr() == 2 * P and b.data_ptr() - r1._base.data_ptr() == 3 * P
        assert r1._worker_offset == r1._worker_area_end == 4 * P
        a.fill_(5)
        b.fill_(9)
        seen = rows(r0)  # rank 1's writes, read through rank 0's mapping
        assert [sorted(set(seen[row, s * P : (s + 1) * P].tolist())) for row in range(3) for s in range(4)] == [[0], [0], [5], [9]] * 3
        assert list(r1.iter_worker_slot_ranges()) == [(2 * P, 2 * P), (6 * P, 2 * P), (10 * P, 2 * P)]
        del a, b, seen
    finally:
        r1.cleanup()
        r0.cleanup()
    assert not os.path.exists(r0.mmap_path)


def test_worker_view_refusals_leave_the_cursor(name):
    r = SharedOffloadRegion(name, 2, 0, 2 * P, 2 * P)
    unranked = SharedOffloadRegion(name, 2, None, 2 * P, 2 * P)
    try:
        r.create_next_worker_view(P)
        with pytest.raises(
            AssertionError, match=rf"exceeds worker area end.*tensor_page_size={P + 1} but only {P} of rank 0's {2 * P} bytes"
        ):
            r.create_next_worker_view(P + 1)
        assert r._worker_offset == P and len(r._views) == 1
        with pytest.raises(ValueError, match="tensor_page_size=0 is out of range"):
            r.create_next_worker_view(0)
        with pytest.raises(ValueError, match="create_next_worker_view needs the region's rank"):
            unranked.create_next_worker_view(P)
        c = unranked.create_next_canonical_view(2 * P)
        with pytest.raises(AssertionError, match=f"canonical offset {2 * P + 1} exceeds the row of {2 * P} bytes"):
            unranked.create_next_canonical_view(1)
        assert unranked._canonical_offset == 2 * P and c.shape == (2, 2 * P)
        del c
    finally:
        unranked.cleanup()
        r.cleanup()
    with pytest.raises(RuntimeError, match=r"released \(cleanup\(\) ran\)"):
        r.base_tensor


def test_canonical_views_are_the_same_bytes_for_every_worker(name):
    r0 = SharedOffloadRegion(name, 2, 0, 2 * P, P)
    r1 = SharedOffloadRegion(name, 2, 1, 2 * P, P)
    try:
        v0 = r0.create_next_canonical_view(P)
        v1 = r1.create_next_canonical_view(P)
        v0[1, 10] = 7
        assert int(v1[1, 10]) == 7 and v1.data_ptr() - r1._base.data_ptr() == 0
        del v0, v1
    finally:
        r1.cleanup()
        r0.cleanup()


def test_constructor_refusals_name_the_argument(name):
    with pytest.raises(ValueError, match=r"populate_shard index=2 is out of range; populate_shard index must be an int in 0\.\.1"):
        SharedOffloadRegion(name, 1, 0, P, P, populate_shard=(2, 2))
    with pytest.raises(ValueError, match="populate_shard must be a pair"):
        SharedOffloadRegion(name, 1, 0, P, P, populate_shard=[0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_segments=0 is out of range"):
        SharedOffloadRegion(name, 1, 0, P, P, num_segments=0)
    assert not os.path.exists(os.path.join(region_module._shm_dir(), f"vllm_offload_{name}.mmap"))  # refused before any file


# --- segments, pre-faulting, barriers ----------------------------------------------------------------


def test_segments_split_rows_over_files_and_each_rank_starts_on_its_own(name, monkeypatch):
    monkeypatch.setattr(region_module, "_MIN_SEGMENT_BYTES", P)
    regions = [SharedOffloadRegion(name, 5, rank, 2 * P, P, num_segments=3) for rank in range(2)]
    paths = [p for p, _, _ in regions[0]._segments]
    try:
        assert [(off // P, n // P) for _, off, n in regions[0]._segments] == [(0, 4), (4, 4), (8, 2)]
        assert [os.path.getsize(p) // P for p in paths] == [4, 4, 2]
        assert [off // P for off, _ in regions[1].iter_worker_slot_ranges()] == [5, 7, 9, 1, 3]  # rows 2,3,4,0,1
        for rank, r in enumerate(regions):
            v = r.create_next_worker_view(P)
            v[:, :] = torch.arange(5, dtype=torch.int8)[:, None] * 10 + rank  # row*10 + rank
            del v
        # which file holds which (row, rank): read the files themselves
        found = []
        for path in paths:
            with open(path, "rb") as f:
                data = f.read()
            found.append([data[i * P] for i in range(len(data) // P)])
        assert found == [[0, 1, 10, 11], [20, 21, 30, 31], [40, 41]]
    finally:
        for r in regions:
            r.cleanup()
    assert [os.path.exists(p) for p in paths] == [False, False, False]


def test_small_regions_stay_one_file(name):
    r = SharedOffloadRegion(name, 4, 0, P, P, num_segments=8)  # far below _MIN_SEGMENT_BYTES
    try:
        assert len(r._segments) == 1 and os.path.getsize(r.mmap_path) == 4 * P
    finally:
        r.cleanup()


def test_prefault_covers_own_slots_the_whole_region_or_one_share(name, monkeypatch):
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(region_module, "_madvise_populate_write", lambda mm, off, n: seen.append((off // P, n // P)))
    SharedOffloadRegion(name, 3, 1, 2 * P, P).cleanup()
    assert seen == [(0, 1), (1, 1), (3, 1), (5, 1)]  # the probe, then rank 1's slot of each row
    seen.clear()
    SharedOffloadRegion(name, 3, None, 2 * P, P).cleanup()
    assert seen == [(0, 1), (0, 6)]
    seen.clear()
    SharedOffloadRegion(name, 3, 0, 2 * P, 2 * P, populate_shard=(1, 4)).cleanup()
    assert seen == [(0, 1), (2, 2)]  # 6 pages in 4 shares of 2 pages: share 1 is pages 2..3
    seen.clear()
    SharedOffloadRegion(name, 3, 0, 2 * P, 2 * P, populate_shard=(3, 4)).cleanup()
    assert seen == [(0, 1)]  # share 3 starts past the end: nothing


def test_fallback_keeps_bytes_and_only_einval_selects_it(name, monkeypatch):
    def einval(mm, off, n):
        raise OSError(errno.EINVAL, "no such advice")

    monkeypatch.setattr(region_module, "_madvise_populate_write", einval)
    r = SharedOffloadRegion(name, 2, None, P, P)
    try:
        r.mmap_obj[P] = 42  # type: ignore[index]  # the byte the fallback rewrites on page 1
        region_module._fallback_populate_write(r.mmap_obj, 0, 2 * P)  # type: ignore[arg-type]
        assert (r.mmap_obj[0], r.mmap_obj[P]) == (0, 42)  # type: ignore[index]
    finally:
        r.cleanup()

    def eio(mm, off, n):
        raise OSError(errno.EIO, "disk on fire")

    monkeypatch.setattr(region_module, "_madvise_populate_write", eio)
    with pytest.raises(OSError) as info:
        SharedOffloadRegion(name, 2, None, P, P)
    assert info.value.errno == errno.EIO
    assert not os.path.exists(os.path.join(region_module._shm_dir(), f"vllm_offload_{name}.mmap"))  # cleaned up


@pytest.mark.parametrize("shard, expected_calls", [(None, 1), ((0, 1), 2)])
def test_a_failed_start_removes_the_file_then_releases_every_barrier(name, shard, expected_calls):
    path = os.path.join(region_module._shm_dir(), f"vllm_offload_{name}.mmap")
    at_barrier: list[bool] = []
    barrier = MagicMock(side_effect=lambda: at_barrier.append(os.path.exists(path)))
    check = MagicMock(side_effect=RuntimeError("no memory for you"))
    with pytest.raises(RuntimeError, match="no memory for you"):
        SharedOffloadRegion(name, 1, 0, P, P, barrier, creator_memory_check=check, populate_shard=shard)
    assert check.call_args_list == [call(P)]
    assert at_barrier == [False] * expected_calls


def test_a_successful_start_unlinks_at_the_barrier(name):
    path = os.path.join(region_module._shm_dir(), f"vllm_offload_{name}.mmap")
    at_barrier: list[bool] = []
    r = SharedOffloadRegion(name, 1, 0, P, P, lambda: at_barrier.append(os.path.exists(path)), populate_shard=(0, 1))
    try:
        assert at_barrier == [True, False] and not r._creator  # named at the rendezvous, gone at the second
    finally:
        r.cleanup()


def test_wait_for_file_size_bounds_and_a_dead_creator(tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        with pytest.raises(TimeoutError, match=f"did not reach {P} bytes within 0.05 s"):
            _wait_for_file_size(fd, P, timeout=0.05)
        os.ftruncate(fd, P)
        _wait_for_file_size(fd, P, timeout=0.05)
        os.ftruncate(fd, 0)
        os.unlink(tmp_path / "f")
        with pytest.raises(RuntimeError, match="creator failed"):
            _wait_for_file_size(fd, P, timeout=5.0)
    finally:
        os.close(fd)


def test_cleanup_keeps_a_mapping_that_is_still_exported(name):
    r = SharedOffloadRegion(name, 1, 0, P, P)
    view = memoryview(r.mmap_obj)  # type: ignore[arg-type]
    r.cleanup()
    assert r.mmap_obj is not None and not r.mmap_obj.closed and r.fd is None
    assert not os.path.exists(r.mmap_path)
    view.release()
    r.cleanup()
    assert r.mmap_obj is None


# --- pinning -------------------------------------------------------------------------------------


def test_pin_without_cuda_leaves_the_region_pageable(name):
    r = SharedOffloadRegion(name, 2, 0, P, P)
    try:
        pin_mmap_region(r)
        cuda = torch.cuda.is_available()  # with CUDA: one registration of the whole region
        assert (r.is_pinned, r.pinned_addresses) == (cuda, [r._base.data_ptr()] if cuda else [])
    finally:
        r.cleanup()


@pytest.mark.parametrize("fail_at, registered", [(None, 3), (2, 0)])
def test_pin_registers_row_aligned_chunks_all_or_nothing(name, monkeypatch, fail_at, registered):
    answers = [True, True, True] if fail_at is None else [True, True, False]
    register = MagicMock(side_effect=answers)
    unregister = MagicMock()
    monkeypatch.setattr(gpu_worker, "MAX_HOST_REGISTER_CHUNK_BYTES", 5 * P)  # rows of 2 pages: 2 rows a chunk
    monkeypatch.setattr(gpu_worker, "host_register", register)
    monkeypatch.setattr(gpu_worker, "host_unregister", unregister)
    monkeypatch.setattr(region_module, "host_unregister", unregister)
    r = SharedOffloadRegion(name, 5, 0, 2 * P, 2 * P)
    base = r._base.data_ptr()
    pin_mmap_region(r)
    assert [(a - base) // P for a, _ in (c.args for c in register.call_args_list)] == [0, 4, 8]
    assert [n // P for _, n in (c.args for c in register.call_args_list)] == [4, 4, 2]
    assert (r.is_pinned, len(r.pinned_addresses)) == (registered == 3, registered)
    r.cleanup()
    released = [(c.args[0] - base) // P for c in unregister.call_args_list]
    assert released == [8, 4, 0] if fail_at is None else released == [4, 0]  # newest first; a failure rolls back


def test_pin_own_slots_only_when_it_saves_enough(name, monkeypatch):
    register = MagicMock(return_value=True)
    monkeypatch.setattr(gpu_worker, "host_register", register)
    monkeypatch.setattr(gpu_worker, "MIN_HOST_REGISTER_SAVED_BYTES", P)
    monkeypatch.setattr(region_module, "host_unregister", MagicMock())
    r = SharedOffloadRegion(name, 3, 1, 4 * P, P)
    base = r._base.data_ptr()
    pin_mmap_region(r, worker_slot_only=True)
    assert [((a - base) // P, n // P) for a, n in (c.args for c in register.call_args_list)] == [(1, 1), (5, 1), (9, 1)]
    r.cleanup()


# --- canonical layout helpers ------------------------------------------------------------------------


def test_copy_plans_page_ids_and_block_sizes():
    runs = (CopyRun(0, 64, 32, 3, 32, 128), CopyRun(96, 512, 16, 2, 16, 16))
    m = CanonicalPageMapping(1024, 128, runs, 3, 2, False)
    store = _build_copy_plan(CanonicalKVCacheRef(0, 128, m), gpu_to_cpu=True)
    assert store.frag_offsets_src.tolist() == [0, 32, 64, 96, 112]
    assert store.frag_offsets_dst.tolist() == [64, 192, 320, 512, 528]
    assert (store.frag_sizes.tolist(), store.num_frags, store.total_bytes) == ([32, 32, 32, 16, 16], 5, 128)
    load = _build_copy_plan(CanonicalKVCacheRef(0, 128, m), gpu_to_cpu=False)
    assert load.frag_offsets_src.tolist() == store.frag_offsets_dst.tolist()
    assert [m.is_writer(b) for b in range(6)] == [False, False, True, False, False, True]
    assert _canonical_page_ids(np.array([2, 5]), 3, 4, 1).tolist() == [7, 8, 15, 16]
    assert _canonical_page_ids(np.array([4, 1, 9]), 1, 2, 0).tolist() == [4, 1]
    small = CanonicalPageMapping(256, 128, (CopyRun(0, 0, 128, 1, 128, 128),), 1, 0, True)
    refs = [[CanonicalKVCacheRef(0, 128, small), CanonicalKVCacheRef(1, 128, m)], [CanonicalKVCacheRef(0, 128, m)]]
    assert _canonical_block_sizes(refs, 2) == [1024, 1024]
    with pytest.raises(ValueError, match="tensor 0's has none"):
        _canonical_block_sizes([[CanonicalKVCacheRef(0, 128)]], 1)
    with pytest.raises(ValueError, match=r"tensors \[1\] have no reference"):
        _canonical_block_sizes([[CanonicalKVCacheRef(0, 128, small)]], 2)
    with pytest.raises(ValueError, match="no canonical mapping"):
        _build_copy_plan(CanonicalKVCacheRef(3, 128), gpu_to_cpu=True)


def test_gpu_spec_refusals():
    with pytest.raises(ValueError, match=r"group_sizes \(2, 2\) add up to 4, but there are 3 block_ids"):
        GPULoadStoreSpec([1, 2, 3], group_sizes=(2, 2), block_indices=(0, 0))
    with pytest.raises(ValueError, match=r"block_indices has 1 entries; it needs one per group \(2\)"):
        GPULoadStoreSpec([1, 2, 3], group_sizes=(2, 1), block_indices=(0,))


# --- the worker ----------------------------------------------------------------------------------


def _caches(num_blocks: int = 8, page: int = 256, num_tensors: int = 2) -> CanonicalKVCaches:
    g = torch.Generator().manual_seed(0)
    tensors = [
        CanonicalKVCacheTensor(torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=g), page)
        for _ in range(num_tensors)
    ]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, page) for i in range(num_tensors)]])


def test_worker_round_trips_blocks_through_its_slots_of_the_region(name):
    caches = _caches()
    region = SharedOffloadRegion(name, 4, 1, 2 * P, P)  # 2 workers' slots of P bytes; this is rank 1
    worker = CPUOffloadingWorker(caches, blocks_per_chunk=2, num_cpu_chunks=4, mmap_region=region)
    gpu = [t.tensor for t in caches.tensors]
    # blocks 3, 5, 6 of a request starting at block index 1: the first chunk's page 0 is skipped
    assert worker.submit_store(7, GPULoadStoreSpec([3, 5, 6], group_sizes=(3,), block_indices=(1,)), CPULoadStoreSpec([1, 2]))
    (done,) = worker.get_finished()
    assert (done.job_id, done.success, done.transfer_size) == (7, True, 3 * 256 * 2)
    assert done.transfer_time is not None and done.transfer_time > 0
    raw = rows(region)  # rank 1's slot starts at byte P of each row: tensor 0's 2 pages, then tensor 1's
    pages = raw[:, P : P + 1024].reshape(4, 2, 2, 256)  # [chunk, tensor, page, byte]
    for t in range(2):
        assert np.array_equal(pages[1, t, 1], gpu[t][3].numpy().view(np.uint8))
        assert np.array_equal(pages[2, t, 0], gpu[t][5].numpy().view(np.uint8))
        assert np.array_equal(pages[2, t, 1], gpu[t][6].numpy().view(np.uint8))
        assert not pages[1, t, 0].any() and not raw[:, :P].any()  # the skipped page and rank 0's slots untouched
    del raw, pages
    expected = [g[[3, 5, 6]].clone() for g in gpu]
    assert worker.submit_load(
        8, CPULoadStoreSpec([1, 2]), GPULoadStoreSpec([0, 1, 2], group_sizes=(3,), block_indices=(1,)), expedited=True
    )
    assert [(r.job_id, r.transfer_size) for r in worker.get_finished()] == [(8, 3 * 256 * 2)]
    assert all(torch.equal(g[:3], e) for g, e in zip(gpu, expected))
    worker.shutdown()
    assert worker._mmap_region is None and region.mmap_obj is None and worker._store_handler.src_tensors == []


def test_canonical_stores_write_only_this_writers_pages(name):
    m = CanonicalPageMapping(256, 256, (CopyRun(0, 0, 256, 1, 256, 256),), 2, 1, True)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(torch.full((4, 256), 3, dtype=torch.int8), 256)], [[CanonicalKVCacheRef(0, 256, m)]])
    region = SharedOffloadRegion(name, 4, 0, P, P)
    worker = CPUOffloadingWorker(caches, 1, 4, mmap_region=region, canonical_layout=True)
    worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], (4,), (0,)), CPULoadStoreSpec([0, 1, 2, 3]))
    assert [r.transfer_size for r in worker.get_finished()] == [2 * 256]  # pages 1 and 3 only
    raw = rows(region)
    assert [int(raw[c, :256].astype(bool).sum()) for c in range(4)] == [0, 256, 0, 256]
    del raw
    worker.shutdown()


def test_handler_refuses_bad_specs_and_copies_nothing():
    gpu, cpu = torch.zeros((4, 64), dtype=torch.int8), torch.ones((2, 64), dtype=torch.int8)
    h = SingleDirectionOffloadingHandler([gpu], [cpu], 1, [[CanonicalKVCacheRef(0, 64)]], gpu_to_cpu=False)
    with pytest.raises(IndexError, match=r"dst block ids \[0, 9\] must be in 0\.\.3"):
        h.transfer_async(1, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0, 9], (2,), (0,)))
    with pytest.raises(TypeError, match="dst_spec must be a GPULoadStoreSpec"):
        h.transfer_async(1, CPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    with pytest.raises(ValueError, match="the groups use 1 src and 1 dst blocks, but the specs have 2 and 1"):
        h.transfer_async(1, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0], (1,), (0,)))
    assert not gpu.any() and not h._transfers
    h.transfer_async(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([2], (1,), (0,)))
    with pytest.raises(ValueError, match="job 1 is already in flight"):
        h.transfer_async(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([3], (1,), (0,)))
    assert int(gpu.sum()) == 64 and gpu[2].all()
    with pytest.raises(ValueError, match=r"cpu_tensors\[0\] rows hold 64 bytes; 2 blocks of 64 bytes need 128"):
        SingleDirectionOffloadingHandler([gpu], [cpu], 2, [[CanonicalKVCacheRef(0, 64)]], gpu_to_cpu=True)
    with pytest.raises(ValueError, match="must be an int8 tensor"):
        SingleDirectionOffloadingHandler([gpu.float()], [cpu], 1, [[CanonicalKVCacheRef(0, 64)]], gpu_to_cpu=True)
    with pytest.raises(ValueError, match="canonical_layout=True needs an mmap_region"):
        CPUOffloadingWorker(_caches(), 1, 4, canonical_layout=True)


def test_shutdown_drains_every_handler_then_syncs_and_releases_the_region(monkeypatch):
    worker = CPUOffloadingWorker(_caches(), 1, 4)
    order: list[str] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: order.append("sync"))
    worker._store_handler.shutdown = MagicMock(side_effect=RuntimeError("device lost"))  # type: ignore[method-assign]
    for label in ("load", "expedited"):
        handler = getattr(worker, "_load_handler" if label == "load" else "_expedited_load_handler")
        handler.shutdown = MagicMock(side_effect=lambda label=label: order.append(label))
    region = MagicMock()
    region.cleanup.side_effect = lambda: order.append("region")
    worker._mmap_region = region
    worker.shutdown()
    assert order == ["load", "expedited", "sync", "region"] and worker._mmap_region is None
