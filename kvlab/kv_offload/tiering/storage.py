"""What kvlab's two storage tiers share -- the file system's and the object store's (vLLM 0.33
writes it out in each: ``tiering/fs/manager.py`` and ``tiering/obj/manager.py``).

Both answer lookups from a lookup thread (:class:`~kvlab.kv_offload.tiering.async_lookup.AsyncLookupManager`:
RETRY first, the step's keys probed together at its end), both publish one BlockStored-like
event per store that landed (when the tier and the engine both have events on), and both
turn a failed load's keys into misses for the requests that asked, so the scheduler does
not promote the same bad copy step after step. Only how bytes move differs.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from kvlab.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvlab.kv_offload.tiering.async_lookup import AsyncLookupManager
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.kv_offload.tiering.base import JobId, SecondaryTierManager, TransferJob


class StorageTierManager(SecondaryTierManager):
    """A storage tier with asynchronous lookups and store events. A subclass sets
    ``_lookup_manager``, moves the bytes, and calls :meth:`_job_ended` once per job."""

    medium: ClassVar[Medium] = Medium.STORAGE
    _lookup_manager: AsyncLookupManager

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None,
        *,
        enable_kv_events: bool,
        locality: str | None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logging.getLogger(type(self).__module__).warning(
                    "enable_kv_events is set on tier %r but KV cache events are off for the engine; it emits none", tier_type
                )
        self._store_job_keys: dict[JobId, list[OffloadKey]] = {}  # only with events on
        self._load_job_keys: dict[JobId, list[OffloadKey]] = {}

    def _store_submitted(self, job: TransferJob) -> list[OffloadKey]:
        keys = list(job.keys)
        if self.events is not None:
            self._store_job_keys[job.job_id] = keys
        return keys

    def _load_submitted(self, job: TransferJob) -> list[OffloadKey]:
        keys = self._load_job_keys[job.job_id] = list(job.keys)
        return keys

    def _job_ended(self, job_id: JobId, success: bool, missed: Collection[OffloadKey] | None = None) -> None:
        """Publish a landed store; make a failed load's ``missed`` keys (default: all its
        keys) a miss."""
        stored = self._store_job_keys.pop(job_id, None)
        if self.events is not None and success and stored:
            self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False, locality=self.locality))
        loaded = self._load_job_keys.pop(job_id, None)
        if loaded is not None and not success:
            self._lookup_manager.mark_miss(loaded if missed is None else missed)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            out, self.events = self.events, []
            yield from out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookup_manager.lookup(key, req_context)
        return LookupResult.RETRY if found is None else LookupResult.HIT if found else LookupResult.MISS

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup_manager.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup_manager.flush()
