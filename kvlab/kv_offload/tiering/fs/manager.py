"""A disk tier behind the CPU tier, asynchronous (vLLM 0.33: ``FileSystemTierManager`` in
``vllm/v1/kv_offload/tiering/fs/manager.py``).

One file per block, named by its hash (:class:`~kvlab.kv_offload.file_mapper.FileMapper`,
``<root>/<model>_<config hash>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``), holding exactly the
chunk's bytes -- the same folder vLLM's tier writes and reads, so either can serve the other.

* **Lookups** do not touch the disk on the scheduler's thread: a key's first lookup answers
  RETRY, and the step's keys are checked together by a worker thread
  (:class:`~kvlab.kv_offload.tiering.async_lookup.AsyncLookupManager`) while the model runs.
* **Stores and loads** are jobs for a pool of I/O threads (read-priority threads serve
  promotions first, :mod:`~kvlab.kv_offload.tiering.fs.thread_pool`): a store writes the CPU
  chunks ``chunk_ids`` to files (a temporary file renamed into place), a load reads files
  into CPU chunks. ``get_finished_jobs`` reports them. A load that stops at a bad block keeps
  the blocks before it (``successful_keys``) and marks the rest a miss, so the scheduler
  does not promote the same bad file again and again.
* The tier never evicts: files stay until someone removes them (vLLM's tier grows until the
  disk is full). kvlab's engine uses an in-step disk tier with a capacity instead
  (:mod:`kvlab.kv_offload.tiering.fs.staged`), so its lessons can watch a disk evict.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from kvlab.kv_offload.base import OffloadKey, ReqContext
from kvlab.kv_offload.config import OffloadingConfig
from kvlab.kv_offload.file_mapper import FileMapper, check_disk_root
from kvlab.kv_offload.tiering.async_lookup import AsyncLookupManager
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.kv_offload.tiering.base import JobId, JobResult, TransferJob
from kvlab.kv_offload.tiering.fs.io import BatchLoadError, batch_load_block, batch_store_block, probe_o_direct
from kvlab.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
from kvlab.kv_offload.tiering.storage import StorageTierManager

logger = logging.getLogger(__name__)

# vLLM checks a batch of paths in C (``vllm.fs_io_C.batch_lookup``, the GIL released) when the
# extension is built. kvlab has the Python path only: False, the true answer to "which path runs".
_HAS_BATCH_LOOKUP_C = False


class FsAsyncLookupManager(AsyncLookupManager):
    """Existence checks for the file tier: does the block's file exist?"""

    def __init__(self, tier: FileSystemTierManager, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return [os.path.exists(self._tier.file_mapper.get_file_name(k)) for k in keys]


class FileSystemTierManager(StorageTierManager):
    """Files under ``root_dir``, moved by ``n_read_threads`` + ``n_write_threads`` threads.

    ``offloading_spec``: what the folder is named after -- any object with ``config`` (an
    :class:`~kvlab.kv_offload.config.OffloadingConfig`), ``blocks_per_chunk`` and
    ``kv_events_config.enable_kv_cache_events`` (vLLM's ``OffloadingSpec`` has all three).
    ``enable_kv_events``: publish a BlockStored-like event per landed store (only if events
    are on for the engine)."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        if not isinstance(getattr(offloading_spec, "config", None), OffloadingConfig) or not hasattr(offloading_spec, "kv_events_config"):
            raise TypeError(
                "offloading_spec must have config (an OffloadingConfig), blocks_per_chunk and kv_events_config, "
                f"got {type(offloading_spec).__name__}"
            )
        root_dir = check_disk_root(root_dir)
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector, enable_kv_events=enable_kv_events, locality=locality
        )
        self._job_block_counts: dict[JobId, int] = {}
        # Written by an I/O thread before its job is reported finished, read after: safe.
        self._load_progress: dict[JobId, int] = {}
        self._block_size = self.block_size_bytes
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=root_dir,
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        config_path = self.file_mapper.get_config_file_path()
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        if not os.path.exists(config_path):
            with open(config_path, "w") as f:
                json.dump(self.file_mapper.get_run_config(), f, indent=2, sort_keys=True)
        self._use_o_direct = probe_o_direct(os.path.dirname(config_path))
        self._pool = DualQueueThreadPool(n_read_threads, n_write_threads, thread_name_prefix="kvlab_kv_py_fs")
        self._lookup_manager = FsAsyncLookupManager(self, tier_type)

    def _offsets(self, job: TransferJob) -> list[int]:
        return [int(c) * self._block_size for c in job.chunk_ids]

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = self._store_submitted(job_metadata)
        paths = [self.file_mapper.get_file_name(k) for k in keys]
        task = functools.partial(
            batch_store_block, paths, self._primary_kv_view, self._offsets(job_metadata), self._block_size, self._use_o_direct
        )
        self._job_block_counts[job_metadata.job_id] = len(keys)
        self._pool.enqueue_store(job_metadata.job_id, 1, [task])

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = self._load_submitted(job_metadata)
        self._job_block_counts[job_id] = len(keys)
        paths = [self.file_mapper.get_file_name(k) for k in keys]
        offsets = self._offsets(job_metadata)

        def load() -> None:
            try:
                batch_load_block(paths, self._primary_kv_view, offsets, self._block_size, self._use_o_direct)
            except OSError as exc:
                self._load_progress[job_id] = exc.num_succeeded if isinstance(exc, BatchLoadError) else 0
                raise

        self._pool.enqueue_load(job_id, 1, [load])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, success, seconds in self._pool.get_finished():
            count = self._job_block_counts.pop(job_id, 0)
            nbytes = count * self._block_size if count else None
            arrived = self._load_progress.pop(job_id, 0)
            loaded = self._load_job_keys.get(job_id)
            ok = None
            missed = None
            if loaded is not None and not success:
                # A failed load keeps the blocks read before the bad one; it and those after it are a miss.
                ok, missed = tuple(loaded[:arrived]) or None, loaded[arrived:]
            self._job_ended(job_id, success, missed)
            results.append(JobResult(job_id, success, successful_keys=ok, transfer_time=seconds, transfer_bytes=nbytes))
        return results

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def shutdown(self) -> None:
        self._lookup_manager.shutdown()
        self._pool.shutdown(wait=True)
