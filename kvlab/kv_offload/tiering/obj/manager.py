"""An S3-compatible object store behind the CPU tier (vLLM 0.33: ``ObjectStoreSecondaryTierManager``
in ``vllm/v1/kv_offload/tiering/obj/manager.py``).

The tier moves bytes between the CPU tier's chunks and objects in a bucket through NIXL
(:mod:`kvlab.kv_offload.nixl_api`): its agent registers the CPU tier's DRAM and, through the
OBJ plugin, S3 objects, and runs READ and WRITE transfers between them. It never touches the GPU.

* **Names.** One object per chunk, named like the file tier's files
  (:class:`~kvlab.kv_offload.file_mapper.FileMapper` with root ``"<prefix>/"``, or ``""``
  without a prefix: vLLM's keys, which then begin with ``/``), so the
  bucket is shared by every engine of the same model and layout -- tensor-parallel ranks of
  a replicated layout included -- and by vLLM's own tier.
* **Lookups** never wait on the network on the scheduler's thread: a key's first lookup
  answers RETRY, and the step's keys are probed in one ``query_memory`` call by the lookup
  thread (:class:`ObjAsyncLookupManager`).
* **Stores and loads** are NIXL transfers: the chunks' DRAM descriptors (prepared once, at
  start) against one OBJ descriptor per object, each with its own device id (the plugin
  maps a device id to an object key; id 0 is kept for probes). ``get_finished_jobs`` polls
  them; a finished transfer reports its duration from NIXL's telemetry.
* **Nothing is reported before NIXL lets go.** A transfer handle that cannot be released
  may still be reading or writing the CPU chunks, so its job is kept and polled again next
  time: reporting it would let the CPU tier reuse those chunks under a running copy.
  Failures to free the other handles afterwards only leak metadata and do not hold the job.
* A failed load marks its keys a miss for the requests that asked (the file tier does the
  same), so the scheduler does not promote the same missing object step after step.

NIXL has CUDA wheels only; on a machine without it the tier refuses to start and says so.
kvlab's tests, like vLLM's, drive it through a NIXL-shaped agent that keeps objects in memory.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kvlab.kv_offload.base import Locality, OffloadKey, ReqContext
from kvlab.kv_offload.config import OffloadingConfig
from kvlab.kv_offload.file_mapper import FileMapper
from kvlab.kv_offload.nixl_api import nixl_agent, nixl_agent_config
from kvlab.kv_offload.tiering.async_lookup import AsyncLookupManager
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.kv_offload.tiering.base import JobId, JobResult, TransferJob
from kvlab.kv_offload.tiering.obj.config import ObjStoreConfig
from kvlab.kv_offload.tiering.storage import StorageTierManager

logger = logging.getLogger(__name__)

NIXL_WRITE = "WRITE"
NIXL_READ = "READ"
NIXL_PROC = "PROC"
NIXL_DONE = "DONE"
NIXL_DEV_ID = 0  # DRAM is one device
# A probe names an object and reads nothing: address and length are placeholders.
_PROBE_ADDR, _PROBE_LEN, _PROBE_DEV_ID = 0, 1, 0
_CONNECTIVITY_KEY = "__nixl_probe__/connectivity_test"


class TransferEntry(NamedTuple):
    """What a running transfer holds in NIXL, released when it ends."""

    xfer_handle: Any
    files_desc: Any
    obj_handle: Any


class ObjAsyncLookupManager(AsyncLookupManager):
    """Existence probes for the object tier: one ``query_memory`` round trip per batch."""

    def __init__(self, tier: ObjectStoreSecondaryTierManager, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        names = [self._tier._file_mapper.get_file_name(k) for k in keys]
        return [found is not None for found in self._tier._query(names)]


class ObjectStoreSecondaryTierManager(StorageTierManager):
    """Objects in ``store_config``'s bucket, moved by NIXL with ``io_threads`` threads.

    ``offloading_spec``: any object with ``config`` (an
    :class:`~kvlab.kv_offload.config.OffloadingConfig`) and ``blocks_per_chunk``, plus
    ``kv_events_config`` when ``enable_kv_events`` (vLLM's ``OffloadingSpec`` has all three).
    ``store_config``: :class:`~kvlab.kv_offload.tiering.obj.config.ObjStoreConfig`'s fields.
    ``prefix``: prepended to every object key. ``locality``: ``"LOCAL"`` or ``"REMOTE"``,
    published with the tier's events.
    """

    #: ``drain_jobs`` gives up after this long (a stuck transfer would otherwise hang the engine).
    drain_timeout_s: ClassVar[float] = 120.0  # the file tier's I/O pool waits as long

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        store_config: Mapping[str, Any],
        prefix: str = "",
        io_threads: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        if locality is not None:
            Locality(locality)  # ValueError for anything but LOCAL / REMOTE, before anything starts
        if not isinstance(getattr(offloading_spec, "config", None), OffloadingConfig) or not hasattr(offloading_spec, "blocks_per_chunk"):
            raise TypeError(
                f"offloading_spec must have config (an OffloadingConfig) and blocks_per_chunk, got {type(offloading_spec).__name__}"
            )
        if not isinstance(store_config, Mapping) or not {"bucket", "endpoint_override"} <= store_config.keys():
            raise TypeError(f"store_config must be a mapping with 'bucket' and 'endpoint_override', got {store_config!r}")
        unknown = sorted(set(store_config) - set(ObjStoreConfig.field_names()))
        if unknown:
            raise TypeError(f"store_config has unknown keys {unknown}; allowed: {list(ObjStoreConfig.field_names())}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 0:
            raise ValueError(f"io_threads must be an int >= 0 (0: NIXL's default), got {io_threads!r}")
        if nixl_agent is None or nixl_agent_config is None:
            raise RuntimeError(
                "the object-store tier moves bytes with NIXL's OBJ plugin, and NIXL is not installed "
                "(its wheels need CUDA: pip install nixl); kvlab's engine can use the 'fs' tier instead"
            )
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector, enable_kv_events=enable_kv_events, locality=locality
        )
        self._transfers: dict[JobId, TransferEntry] = {}
        # Jobs that ended (or failed to start) since the last get_finished_jobs.
        self._pending_results: list[JobResult] = []
        self._primary_reg: Any = None
        self._dram_prepped_handle: Any = None
        self._next_obj_dev_id = 1  # 0 is the probes'
        self._file_mapper = FileMapper.from_offloading_spec(
            f"{prefix}/" if prefix else "",
            offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )

        self._agent = nixl_agent("ObjAgent", nixl_agent_config(backends=[], capture_telemetry=True))
        self._agent.create_backend("OBJ", {**ObjStoreConfig(**store_config).to_nixl_params(), "num_threads": str(io_threads)})
        try:
            self._query([_CONNECTIVITY_KEY])
        except Exception as e:
            raise RuntimeError(
                f"the object store did not answer a probe ({e}); check bucket, endpoint_override and scheme, and "
                "access_key/secret_key if given (else the AWS SDK's own credentials: IAM role, environment, file)"
            ) from e

        # The whole CPU tier is registered once; a transfer picks its chunks by index.
        base = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        stride = self.block_size_bytes
        self._primary_reg = self._agent.register_memory([(base, primary_kv_view.nbytes, NIXL_DEV_ID, "")], "DRAM")
        chunks = [(base + i * stride, stride, NIXL_DEV_ID) for i in range(len(primary_kv_view))]
        self._dram_prepped_handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", chunks, "DRAM")
        self._lookup_manager = ObjAsyncLookupManager(self, tier_type)

    def _query(self, names: list[str]) -> list[Any]:
        """One answer per object key: None where the object does not exist."""
        return list(self._agent.query_memory([(_PROBE_ADDR, _PROBE_LEN, _PROBE_DEV_ID, n) for n in names], "OBJ", "OBJ"))

    # -- jobs -------------------------------------------------------------------------------

    def _fail(self, job_id: JobId, step: str, *release: tuple[str, Any]) -> None:
        logger.warning("%s failed for job %d on tier %s", step, job_id, self.tier_type)
        self._release_quietly(job_id, *release)
        self._pending_results.append(JobResult(job_id=job_id, success=False))

    def _submit(self, keys: list[OffloadKey], job: TransferJob, op: str) -> None:
        chunk_ids = np.asarray(job.chunk_ids, dtype=np.int32)  # NIXL's index type
        names = [self._file_mapper.get_file_name(k) for k in keys]
        # Each object its own device id: the plugin keys objects by id, so a shared id
        # would make later objects overwrite earlier ones.
        first = self._next_obj_dev_id
        self._next_obj_dev_id += len(names)
        objects = [(0, self.block_size_bytes, dev_id, name) for dev_id, name in enumerate(names, first)]
        job_id = job.job_id
        files_desc = self._agent.register_memory(objects, "OBJ")
        if files_desc is None:
            return self._fail(job_id, "register_memory (OBJ)")
        obj_handle = self._agent.prep_xfer_dlist("ObjAgent", files_desc.trim())
        if not obj_handle:
            return self._fail(job_id, "prep_xfer_dlist (OBJ)", ("deregister_memory", files_desc))
        xfer = self._agent.make_prepped_xfer(op, self._dram_prepped_handle, chunk_ids, obj_handle, np.arange(len(names), dtype=np.int32))
        if not xfer:
            return self._fail(job_id, "make_prepped_xfer", ("release_dlist_handle", obj_handle), ("deregister_memory", files_desc))
        if self._agent.transfer(xfer) == "ERR":
            return self._fail(
                job_id,
                "transfer",
                ("release_dlist_handle", obj_handle),
                ("deregister_memory", files_desc),
                ("release_xfer_handle", xfer),
            )
        self._transfers[job_id] = TransferEntry(xfer, files_desc, obj_handle)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store_submitted(job_metadata), job_metadata, NIXL_WRITE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load_submitted(job_metadata), job_metadata, NIXL_READ)

    def _poll(self) -> None:
        """Poll every running transfer once; move each that ended to ``_pending_results``."""
        for job_id, entry in list(self._transfers.items()):
            try:
                state = self._agent.check_xfer_state(entry.xfer_handle)
            except Exception as exc:
                logger.warning("check_xfer_state raised for job %d: %s", job_id, exc)
                state = "ERR"
            if state == NIXL_PROC:
                continue
            success = state == NIXL_DONE
            if not success:
                logger.warning("transfer of job %d ended in state %s", job_id, state)
            seconds = None
            if success:
                try:
                    seconds = self._agent.get_xfer_telemetry(entry.xfer_handle).xferDuration / 1e6  # microseconds
                except Exception as exc:  # a missing timing must not lose the job
                    logger.warning("no telemetry for job %d: %s", job_id, exc)
            try:
                self._agent.release_xfer_handle(entry.xfer_handle)
            except Exception as exc:
                # The copy may still touch the CPU chunks: keep the job, try again next poll.
                logger.warning("release_xfer_handle failed for job %d (kept, retried next poll): %s", job_id, exc)
                continue
            self._release_quietly(job_id, ("release_dlist_handle", entry.obj_handle), ("deregister_memory", entry.files_desc))
            del self._transfers[job_id]
            self._pending_results.append(JobResult(job_id=job_id, success=success, transfer_time=seconds))

    def _release_quietly(self, job_id: JobId | None, *release: tuple[str, Any]) -> None:
        for method, handle in release:
            try:
                getattr(self._agent, method)(handle)
            except Exception as exc:
                logger.warning("%s failed (job %s): %s", method, job_id, exc)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._poll()
        results, self._pending_results = self._pending_results, []
        for result in results:  # NIXL reports a job whole: a failed load's keys all become misses
            self._job_ended(result.job_id, result.success)
        return results

    def drain_jobs(self) -> None:
        """Poll until every transfer ended (results wait for the next ``get_finished_jobs``).
        NIXL can only be polled; after ``drain_timeout_s`` this raises TimeoutError with the
        jobs still running (they stay tracked). vLLM 0.33 waits forever here; kvlab bounds
        every wait, so a stuck store surfaces as this error (from ``reset_cache`` too) rather
        than a hung engine."""
        start = time.monotonic()
        warned = False
        while True:
            self._poll()
            if not self._transfers:
                return
            waited = time.monotonic() - start
            if waited > self.drain_timeout_s:
                raise TimeoutError(f"tier {self.tier_type}: jobs {sorted(self._transfers)} still running after {waited:.0f} s")
            if not warned and waited > 5.0:
                logger.warning("tier %s: %d transfers still running after 5 s", self.tier_type, len(self._transfers))
                warned = True
            time.sleep(0.001)

    def shutdown(self) -> None:
        """Stop the lookup thread and free everything held in NIXL (twice is harmless)."""
        self._lookup_manager.shutdown()
        for job_id, entry in self._transfers.items():
            self._release_quietly(
                job_id,
                ("release_xfer_handle", entry.xfer_handle),
                ("release_dlist_handle", entry.obj_handle),
                ("deregister_memory", entry.files_desc),
            )
        self._transfers.clear()
        if self._dram_prepped_handle is not None:
            self._release_quietly(None, ("release_dlist_handle", self._dram_prepped_handle))
            self._dram_prepped_handle = None
        if self._primary_reg is not None:
            self._release_quietly(None, ("deregister_memory", self._primary_reg))
            self._primary_reg = None
