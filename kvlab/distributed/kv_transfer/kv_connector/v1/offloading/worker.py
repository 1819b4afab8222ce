"""The offloading connector's worker half (vLLM: ``OffloadingConnectorWorker`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py``; lesson 12), in two
forms.

:class:`OffloadingConnectorWorker` is vLLM 0.33's: built from an offloading spec, it turns
the GPU's KV caches into the spec's canonical view (``register_kv_caches``) and hands the
scheduler's transfer jobs to the spec's :class:`~kvlab.kv_offload.base.OffloadingWorker`:
loads at the start of a step, stores one step late (so the copies of finished blocks never
delay the tokens being sampled), and the stores of preempted requests flushed before their
blocks are reused. With a replicated layout only one rank writes; the others report the job
done without copying.

:class:`StagedOffloadingConnectorWorker` serves kvlab's in-step tiers (CPU, then files):

``start_load_kv``: for each load job, block by block -- a storage block is read from its file
into its CPU slot (checked: :class:`~kvlab.kv_offload.tiering.fs.io.TierFileError` if the
file is missing or corrupt), then the CPU slot is copied into the GPU block. A block that
fails ends its job: it and the job's later blocks are reported as invalid (the scheduler
recomputes from there) and the failing block leaves its tier.

``wait_for_save``: after the forward pass, each store job copies its GPU blocks into their
CPU slots, then the cascade writes those slots to files and the files of evicted storage
blocks are deleted. A store that fails only costs a future miss.

``before_block_copy`` is a seam for tests and lessons: called as ``(direction, key,
gpu_block)`` before each block moves; whatever it raises is a transfer failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    LoadResult,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
from kvlab.kv_cache_interface import AttentionSpec, KVCacheConfig, MambaSpec, UniformTypeKVCacheSpecs
from kvlab.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
)
from kvlab.kv_offload.cpu.gpu_worker import CPUKVBuffer
from kvlab.kv_offload.tiering.fs.io import delete_block_file, read_block_file, write_block_file


class StagedOffloadingConnectorWorker:
    def __init__(self, num_cpu_blocks: int, block_size: int) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.buffer: CPUKVBuffer | None = None
        self.before_block_copy: Callable[[str, OffloadKey, int], None] | None = None
        self._invalid: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._report = OffloadingWorkerMetadata()

    def register_kv_caches(self, kv_caches: Sequence[Any]) -> None:
        self.buffer = CPUKVBuffer(self.num_cpu_blocks, kv_caches)

    def _buf(self) -> CPUKVBuffer:
        if self.buffer is None:
            raise RuntimeError("the offloading worker has no KV caches: the executor calls register_kv_caches first")
        return self.buffer

    def start_load_kv(self, meta: OffloadingConnectorMetadata) -> None:
        buf = self._buf()
        self._invalid, self._failed_reqs = set(), set()
        self._report = OffloadingWorkerMetadata(block_nbytes=buf.block_nbytes)
        loaded = self._report.num_loaded_tokens
        for job in meta.loads:
            start = time.perf_counter()  # observed for the metrics only; nothing decides on it
            res = LoadResult(0)
            for gpu_block, item in zip(job.gpu_block_ids, job.items):
                try:
                    if self.before_block_copy is not None:
                        self.before_block_copy("load", item.key, gpu_block)
                    if item.path:  # a storage block: file -> its CPU slot first (checked)
                        t0 = time.perf_counter()
                        try:
                            buf.put_slot_bytes(item.cpu_slot, read_block_file(item.path, item.key, buf.block_nbytes))
                        finally:
                            res.read_time = (res.read_time or 0.0) + time.perf_counter() - t0
                    buf.load(item.cpu_slot, gpu_block)
                except Exception as e:  # noqa: BLE001 - any failure of a transfer is reported, not raised
                    res.failed_key = item.key
                    res.reason = f"{type(e).__name__}: {e}"
                    break
                res.num_loaded += 1
                loaded[item.medium] = loaded.get(item.medium, 0) + meta.block_size
            if res.failed_key is not None:
                self._invalid.update(job.gpu_block_ids[res.num_loaded :])
                self._failed_reqs.add(job.req_id)
                self._report.errors[job.req_id] = res.reason
            self._report.loads[job.job_id] = res
            self._report.mark_completed(job.job_id)
            if res.num_loaded:
                self._report.transfer_stats.load.record(res.num_loaded * buf.block_nbytes, time.perf_counter() - start)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._invalid)

    def wait_for_save(self, meta: OffloadingConnectorMetadata, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        buf = self._buf()
        stored = self._report.num_stored_tokens
        for job in meta.stores:
            if job.req_id in self._failed_reqs or job.req_id in skip_req_ids:
                self._report.stores[job.job_id] = (False, False, "its request did not compute this step")
                self._report.mark_completed(job.job_id)
                continue
            plan = job.plan
            start = time.perf_counter()
            try:
                for gpu_block, slot, key in zip(job.gpu_block_ids, plan.cpu_slots, plan.keys):
                    if self.before_block_copy is not None:
                        self.before_block_copy("store", key, gpu_block)
                    buf.store(gpu_block, slot)
            except Exception as e:  # noqa: BLE001
                self._report.stores[job.job_id] = (False, False, f"{type(e).__name__}: {e}")
                self._report.mark_completed(job.job_id)
                continue
            stored["CPU"] = stored.get("CPU", 0) + len(plan.keys) * meta.block_size
            self._report.transfer_stats.store.record(len(plan.keys) * buf.block_nbytes, time.perf_counter() - start)
            slot_of = dict(zip(plan.keys, plan.cpu_slots))
            cascaded, err = True, ""
            written: list[str] = []
            num_bytes = 0
            t0 = time.perf_counter()
            try:
                for key, path in zip(plan.cascade_keys, plan.cascade_paths):
                    if self.before_block_copy is not None:
                        self.before_block_copy("cascade", key, -1)
                    payload = buf.slot_bytes(slot_of[key])
                    write_block_file(path, key, payload)
                    written.append(path)
                    num_bytes += len(payload)
                for path in plan.delete_paths:
                    delete_block_file(path)
            except Exception as e:  # noqa: BLE001
                cascaded, err = False, f"{type(e).__name__}: {e}"
                for path in written:  # the tier forgets the whole cascade: leave no orphan files
                    delete_block_file(path)
            if cascaded and plan.cascade_keys:
                stored["STORAGE"] = stored.get("STORAGE", 0) + len(plan.cascade_keys) * meta.block_size
                self._report.cascade_bytes[job.job_id] = num_bytes
                self._report.cascade_time[job.job_id] = time.perf_counter() - t0
            self._report.stores[job.job_id] = (True, cascaded, err)
            self._report.mark_completed(job.job_id)

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata:
        report, self._report = self._report, OffloadingWorkerMetadata()
        return report


def _manager_blocks(cache: Any, num_blocks: int) -> Any:
    """``cache`` with one manager block per row: a kernel that splits each block into
    smaller kernel blocks keeps them evenly strided, so regrouping is a view."""
    if cache.shape[0] == num_blocks:
        return cache
    if cache.shape[0] % num_blocks:
        raise ValueError(f"a layer cache of {cache.shape[0]} kernel blocks does not split into {num_blocks} blocks")
    return cache.unflatten(0, (num_blocks, -1))


class OffloadingConnectorWorker:
    """vLLM 0.33's worker half over an offloading spec's worker."""

    def __init__(self, spec: OffloadingSpec, vllm_config: Any, kv_cache_config: KVCacheConfig) -> None:
        self.spec = spec
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.worker: OffloadingWorker | None = None
        # A replicated layout (pure MLA under TP: every rank holds the same bytes) needs one
        # writer; the other ranks still report each store done, since the scheduler counts a
        # job finished only when every worker has.
        self._is_store_writer = not spec.replicated_layout or spec.config.canonical_layout or spec.config.parallel.rank == 0
        self._load_jobs: dict[int, str | None] = {}  # job id -> request (None: a sync load)
        self._unsubmitted_store_jobs: list[tuple[int, GPULoadStoreSpec, LoadStoreSpec]] = []
        self._connector_worker_meta = OffloadingWorkerMetadata()

    def _init_worker(self, kv_caches: CanonicalKVCaches) -> None:
        self.worker = self.spec.get_worker(kv_caches)

    def _require_worker(self) -> OffloadingWorker:
        if self.worker is None:
            raise RuntimeError("the offloading worker has no KV caches: the model runner calls register_kv_caches first")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the offloaded groups' layers to the spec's worker as byte pages: one
        ``(num_blocks, page)`` view per distinct tensor (layers whose caches overlay the same
        bytes share one), and per group, per layer, its page size and canonical mapping."""
        import torch

        config = self.kv_cache_config
        groups = [config.kv_cache_groups[g] for g in get_offloading_group_ids(config)]
        mappings = derive_canonical_mappings(self.vllm_config, config, kv_caches)
        views: dict[str, Any] = {}  # layer -> (num_blocks, page bytes) int8 view of its cache
        unpadded: dict[str, int] = {}
        for group in groups:
            if group.host_resident:
                raise ValueError(f"group {group.layer_names} lives in host memory: it is not offloaded from the GPU")
            specs = group.kv_cache_spec.kv_cache_specs if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) else {}
            for layer in group.layer_names:
                spec = specs.get(layer, group.kv_cache_spec)
                ref = _manager_blocks(kv_caches[layer], config.num_blocks)
                size = ref.element_size()
                # A packed layout interleaves layers inside a block: the block stride is then
                # larger than one layer's page.
                stride = ref.stride(0) * size if isinstance(spec, AttentionSpec) else spec.page_size_bytes
                views[layer] = torch.tensor([], dtype=torch.int8, device=ref.device).set_(
                    ref.untyped_storage(), ref.storage_offset() * size, (config.num_blocks, spec.page_size_bytes), (stride, 1)
                )
                if isinstance(spec, AttentionSpec):
                    unpadded[layer] = spec.unpadded_page_size_bytes
                elif isinstance(spec, MambaSpec):
                    unpadded[layer] = replace(spec, page_size_padded=None).page_size_bytes
                else:
                    raise NotImplementedError(f"offloading a {type(spec).__name__} layer ({layer})")
        packed = next((n for n, v in views.items() if v.stride(0) != v.shape[1]), None)
        if packed is not None and config.hisparse_host_num_blocks is None:
            # Offload each packed block whole, as one region, for every group.
            view = views[packed]
            whole = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1), storage_offset=0)
            refs = [[CanonicalKVCacheRef(0, view.stride(0))] for _ in groups]
            self._init_worker(CanonicalKVCaches([CanonicalKVCacheTensor(whole, view.stride(0))], refs))
            return
        tensors: list[CanonicalKVCacheTensor] = []
        layer_refs: dict[str, CanonicalKVCacheRef] = {}
        aliases: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for layer, view in views.items():
            aliases.setdefault((view.data_ptr(), tuple(view.stride())), []).append(layer)
        for layers in aliases.values():
            first = views[layers[0]]
            tensors.append(CanonicalKVCacheTensor(first, first.shape[1]))
            for layer in layers:
                mapping = mappings.get(layer)
                if mapping is not None and mapping.local_page_size_bytes != unpadded[layer]:
                    raise AssertionError(
                        f"{layer}: its canonical mapping covers {mapping.local_page_size_bytes} bytes, its page {unpadded[layer]}"
                    )
                layer_refs[layer] = CanonicalKVCacheRef(len(tensors) - 1, unpadded[layer], mapping)
        refs = [[layer_refs[layer] for layer in group.layer_names] for group in groups]
        self._init_worker(CanonicalKVCaches(tensors, refs))

    def _submit_stores(self) -> None:
        worker = self._require_worker()
        for job_id, src, dst in self._unsubmitted_store_jobs:
            if not worker.submit_store(job_id, src, dst):
                raise RuntimeError(f"the offloading worker refused store job {job_id}")
        self._unsubmitted_store_jobs.clear()

    def _queue_store(self, job_id: int, job: TransferJob) -> None:
        if not self._is_store_writer:
            self._connector_worker_meta.mark_completed(job_id)
            return
        if not isinstance(job.src_spec, GPULoadStoreSpec):
            raise TypeError(f"store job {job_id} must copy from GPU blocks (a GPULoadStoreSpec), got {type(job.src_spec).__name__}")
        self._unsubmitted_store_jobs.append((job_id, job.src_spec, job.dst_spec))

    def handle_preemptions(self, metadata: OffloadingConnectorMetadata) -> None:
        """Before a preempted request's blocks are handed to others: submit its pending
        stores (``jobs_to_flush``, taken out of this step's store jobs) with last step's
        deferred ones, and wait for them."""
        flush = metadata.jobs_to_flush or set()
        for job_id in flush:
            job = metadata.store_jobs.pop(job_id, None)
            if job is not None:
                self._queue_store(job_id, job)
        self._submit_stores()
        if flush:
            self._require_worker().wait(flush)

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        """Submit last step's stores, then this step's loads; wait for the sync loads."""
        worker = self._require_worker()
        self._submit_stores()
        sync: set[int] = set()
        for job_id, job in metadata.load_jobs.items():
            if not isinstance(job.dst_spec, GPULoadStoreSpec):
                raise TypeError(f"load job {job_id} must copy into GPU blocks (a GPULoadStoreSpec), got {type(job.dst_spec).__name__}")
            self._load_jobs[job_id] = None if job.sync else job.req_id
            if job.sync:
                sync.add(job_id)
            if not worker.submit_load(job_id, job.src_spec, job.dst_spec, expedited=job.sync):
                raise RuntimeError(f"the offloading worker refused load job {job_id}")
        if sync:
            worker.wait(sync)

    def prepare_store_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        """Queue this step's stores for the start of the next step: by then the tokens of
        this step are sampled, and the copies cannot delay them."""
        for job_id, job in metadata.store_jobs.items():
            self._queue_store(job_id, job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving). Stores report through the worker
        metadata's completed jobs, never here; an asynchronous load names its request once
        done, so the scheduler can run it (a sync load's request is already running)."""
        received: set[str] = set()
        for result in self._require_worker().get_finished():
            if not result.success:
                raise RuntimeError(f"offload transfer job {result.job_id} failed (vLLM 0.33 supports no failed jobs here)")
            is_load = result.job_id in self._load_jobs
            if result.transfer_time is not None and result.transfer_size is not None:
                stats = self._connector_worker_meta.transfer_stats
                (stats.load if is_load else stats.store).record(result.transfer_size, result.transfer_time)
            self._connector_worker_meta.mark_completed(result.job_id)
            req_id = self._load_jobs.pop(result.job_id, None)
            if req_id is not None:
                received.add(req_id)
        return set(), received

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        """The jobs completed since the last call (None when none)."""
        if not self._connector_worker_meta.completed_jobs:
            return None
        meta, self._connector_worker_meta = self._connector_worker_meta, OffloadingWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        self._unsubmitted_store_jobs.clear()
        self._load_jobs.clear()
        self._connector_worker_meta = OffloadingWorkerMetadata()
        if self.worker is not None:
            self.worker.shutdown()
