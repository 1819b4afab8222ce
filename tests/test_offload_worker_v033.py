"""vLLM 0.33's spec-built worker half (``OffloadingConnectorWorker(spec, vllm_config,
kv_cache_config)``) over kvlab's real CPU backend: a layer's GPU cache described to the spec's
worker as byte pages, stores deferred one step, loads (asynchronous and sync), preemption
flushes, the one-writer rule of a replicated layout, and the completions it reports."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata, TransferJob
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from kvlab.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
)
from kvlab.kv_offload import config as oc
from kvlab.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
from kvlab.kv_offload.cpu.common import CPULoadStoreSpec
from kvlab.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from kvlab.kv_offload.cpu.spec import CPUOffloadingSpec
from kvlab.worker.kv_cache_views import allocate_kv_cache

BS, HEADS, HEAD, NUM_BLOCKS = 4, 2, 8, 4
PAGE = 2 * BS * HEADS * HEAD * 2  # K and V, float16: 256 bytes a block


def _spec(rank: int = 0, world_size: int = 1, replicated: bool = False, layers: tuple[str, ...] = ("l0",)) -> CPUOffloadingSpec:
    par = oc.OffloadingParallelConfig(rank, world_size, world_size, 1, 1, 1, 0, 1, None, False)
    config = oc.OffloadingConfig(
        groups=(oc.OffloadingGroupConfig(BS, layers, 0),),
        worker_kv_bytes_per_block=PAGE * len(layers),
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 1 << 20},
        engine_id=f"kvlab-worker-test-{uuid.uuid4().hex[:12]}",
        model=oc.OffloadingModelConfig("m", "float16"),
        cache=oc.OffloadingCacheConfig(tokens_per_hash=BS, blocks_per_chunk=1),
        parallel=par,
        replicated_layout=replicated,
    )
    return CPUOffloadingSpec(config)


def _engine() -> SimpleNamespace:
    par = SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                          cp_kv_cache_interleave_size=1, world_size=1, rank=0)  # fmt: skip
    return SimpleNamespace(parallel_config=par, model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS))


def _worker(spec: Any = None) -> tuple[OffloadingConnectorWorker, torch.Tensor]:
    layer = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype="float16")
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=(), kv_cache_groups=[KVCacheGroupSpec(("l0",), layer)])
    # FlashAttention's layout: (blocks, K|V, tokens, heads, head size); block b holds b + 1.
    cache = torch.arange(1, NUM_BLOCKS + 1, dtype=torch.float16).view(-1, 1, 1, 1, 1).expand(-1, 2, BS, HEADS, HEAD).contiguous()
    worker = OffloadingConnectorWorker(spec or _spec(), _engine(), config)
    worker.register_kv_caches({"l0": cache})
    return worker, cache


def _gpu(block: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec([block], (1,), (0,))


def _store(job_id: int, gpu_block: int, chunk: int) -> OffloadingConnectorMetadata:
    return OffloadingConnectorMetadata(store_jobs={job_id: TransferJob("a", _gpu(gpu_block), CPULoadStoreSpec([chunk]))})


def _load(job_id: int, chunk: int, gpu_block: int, sync: bool = False) -> OffloadingConnectorMetadata:
    return OffloadingConnectorMetadata(load_jobs={job_id: TransferJob("b", CPULoadStoreSpec([chunk]), _gpu(gpu_block), sync)})


def test_the_layer_cache_reaches_the_spec_worker_as_byte_pages() -> None:
    worker, cache = _worker()
    assert isinstance(worker.worker, CPUOffloadingWorker)
    handler = worker.worker._store_handler
    [tensor] = handler.src_tensors  # the GPU side of a store: the layer's blocks as bytes, not a copy
    assert (tuple(tensor.shape), tensor.dtype, tensor.data_ptr()) == ((NUM_BLOCKS, PAGE), torch.int8, cache.data_ptr())
    [[ref]] = handler.layer_refs_per_group
    assert (ref.tensor_idx, ref.page_size_bytes) == (0, PAGE)


def test_a_packed_allocation_is_offloaded_block_by_block_and_its_scratch_group_skipped() -> None:
    """vLLM's one-buffer allocation with two layers packed in each block (layer l0's page,
    then l1's) and a scratch ring group: the spec's worker sees one tensor of whole blocks
    (2 pages each), and a block stored and loaded back brings both layers' pages."""
    layer = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype="float16")
    scratch = CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    tensor = KVCacheTensor(size=2 * PAGE * NUM_BLOCKS, layers=("l0", "l1"), layer_stride=PAGE, block_stride=2 * PAGE)
    groups = [KVCacheGroupSpec(("l0", "l1"), layer), KVCacheGroupSpec(("scratch",), scratch)]
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=(tensor,), kv_cache_groups=groups)
    caches = allocate_kv_cache(config, "cpu", KVCacheLayout.LBNHC)
    worker = OffloadingConnectorWorker(_spec(layers=("l0", "l1")), _engine(), config)
    worker.register_kv_caches(caches)
    handler = worker.worker._store_handler
    [whole] = handler.src_tensors
    assert (tuple(whole.shape), whole.data_ptr()) == ((NUM_BLOCKS, 2 * PAGE), caches["l0"].data_ptr())
    assert [[(r.tensor_idx, r.page_size_bytes) for r in refs] for refs in handler.layer_refs_per_group] == [[(0, 2 * PAGE)]]
    caches["l0"][2].fill_(3.0)
    caches["l1"][2].fill_(5.0)
    worker.prepare_store_kv(_store(1, gpu_block=2, chunk=0))
    worker.start_kv_transfers(_load(2, chunk=0, gpu_block=0))
    worker.get_finished(set())
    assert caches["l0"][0].eq(3.0).all() and caches["l1"][0].eq(5.0).all()
    assert caches["l0"][1].eq(0).all() and caches["l1"][1].eq(0).all()


def test_a_store_waits_one_step_then_a_load_brings_the_block_back() -> None:
    worker, cache = _worker()
    worker.prepare_store_kv(_store(1, gpu_block=2, chunk=5))
    assert worker._unsubmitted_store_jobs and worker.build_connector_worker_meta() is None  # nothing copied yet
    worker.start_kv_transfers(_load(2, chunk=5, gpu_block=0))  # last step's store first, then this load
    assert worker.get_finished(set()) == (set(), {"b"})  # the load names its request; a store never does
    assert torch.equal(cache[0], cache[2]) and cache[0].max().item() == 3.0
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.completed_jobs == {1: 1, 2: 1}
    assert (meta.transfer_stats.store.bytes, meta.transfer_stats.load.bytes) == (PAGE, PAGE)
    assert worker.build_connector_worker_meta() is None  # each completion is reported once


def test_a_sync_load_is_waited_for_and_its_request_is_not_received_later() -> None:
    worker, cache = _worker()
    worker.prepare_store_kv(_store(1, gpu_block=3, chunk=0))
    worker.start_kv_transfers(OffloadingConnectorMetadata())
    worker.start_kv_transfers(_load(2, chunk=0, gpu_block=1, sync=True))
    assert cache[1].max().item() == 4.0  # landed before the forward pass
    assert worker.get_finished(set()) == (set(), set())


def test_a_preempted_requests_store_is_flushed_before_its_blocks_are_reused() -> None:
    worker, cache = _worker()
    meta = _store(7, gpu_block=1, chunk=2)
    meta.jobs_to_flush = {7}
    worker.handle_preemptions(meta)
    assert meta.store_jobs == {} and worker._unsubmitted_store_jobs == []  # taken out and submitted now
    cache[1].zero_()  # the block goes to another request
    worker.start_kv_transfers(_load(8, chunk=2, gpu_block=1))
    worker.get_finished(set())
    assert cache[1].max().item() == 2.0


class _Recorder(OffloadingWorker):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.calls.append(("store", job_id))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        self.calls.append(("load!" if expedited else "load", job_id))
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(j, True, 64, 0.5) for kind, j in self.calls if kind != "wait"]

    def wait(self, job_ids: set[int]) -> None:
        self.calls.append(("wait", min(job_ids)))


@pytest.mark.parametrize(("rank", "writes"), [(0, True), (1, False)])
def test_with_a_replicated_layout_only_rank_0_writes_but_every_rank_reports(rank: int, writes: bool) -> None:
    spec = SimpleNamespace(replicated_layout=True, config=SimpleNamespace(canonical_layout=False, parallel=SimpleNamespace(rank=rank)))
    worker = OffloadingConnectorWorker(spec, _engine(), KVCacheConfig(num_blocks=0, kv_cache_tensors=(), kv_cache_groups=[]))  # type: ignore[arg-type]
    worker.worker = rec = _Recorder()
    worker.prepare_store_kv(_store(3, gpu_block=0, chunk=0))
    worker.start_kv_transfers(_load(4, chunk=1, gpu_block=1, sync=True))
    assert rec.calls == ([("store", 3)] if writes else []) + [("load!", 4), ("wait", 4)]  # every rank loads its own copy
    assert worker.get_finished(set()) == (set(), set())
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.completed_jobs == {3: 1, 4: 1}
    assert (meta.transfer_stats.store.bytes, meta.transfer_stats.load.bytes) == (64 if writes else 0, 64)  # each job once


def test_transfers_before_the_caches_are_registered_are_refused() -> None:
    spec = _spec()
    worker = OffloadingConnectorWorker(spec, _engine(), KVCacheConfig(num_blocks=0, kv_cache_tensors=(), kv_cache_groups=[]))
    with pytest.raises(RuntimeError, match="calls register_kv_caches first"):
        worker.start_kv_transfers(OffloadingConnectorMetadata())
    bad = OffloadingConnectorMetadata(store_jobs={1: TransferJob("a", CPULoadStoreSpec([0]), CPULoadStoreSpec([1]))})
    with pytest.raises(TypeError, match="must copy from GPU blocks"):
        worker.prepare_store_kv(bad)
    assert worker._unsubmitted_store_jobs == []
