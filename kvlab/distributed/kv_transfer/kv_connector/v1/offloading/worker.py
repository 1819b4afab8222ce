"""The offloading connector's worker half (vLLM: ``OffloadingConnectorWorker`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py``; lesson 12).

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
from typing import Any

from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    LoadResult,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from kvlab.kv_offload.base import OffloadKey
from kvlab.kv_offload.cpu.gpu_worker import CPUKVBuffer
from kvlab.kv_offload.tiering.fs.io import delete_block_file, read_block_file, write_block_file


class OffloadingConnectorWorker:
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
