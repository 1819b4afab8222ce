"""The CPU tier and the tiers behind it, driven asynchronously (vLLM 0.33:
``TieringOffloadingManager`` in ``vllm/v1/kv_offload/tiering/manager.py``).

The rules (the same as kvlab's in-step variant, :mod:`kvlab.kv_offload.tiering.staged`):

1. **Store to every tier.** A block that lands in the CPU tier is *cascaded* to every
   secondary tier (one store job per tier, unless its back-pressure detector says no).
2. **The CPU tier is the gateway.** A secondary tier cannot reach the GPU. A block found
   only in a secondary tier gets a CPU chunk reserved at once (``lookup`` answers
   HIT_PENDING: the scheduler asks again later), and the step's promotions are submitted
   together at ``on_schedule_end``, one job per tier and request.
3. **Pins protect blocks in flight.** A cascade pins the CPU chunks it reads until its job
   reports; a promoted chunk is not readable until its job reports.

What the asynchrony adds, and why each piece exists:

* Jobs end whenever the tier says so (``get_finished_jobs``). The manager polls at most once
  per step from ``lookup`` (so a finished promotion reads as HIT at once), always before a
  store's eviction choice (``prepare_store``: a finished cascade unpins chunks that may then
  be evicted), and at ``on_schedule_end``.
* A tier that answers a peer (``tolerates_off_thread_polling``) is also served by a
  *tier-poll thread* between steps, so a peer is not kept waiting a whole step. The
  manager's :attr:`lock` is then a real lock; every caller holds it.
* After ``reset_cache`` a worker may still write a freed chunk for a job in flight; until
  ``on_reset_flushed`` no promotion may fill one, so a block missing from the CPU tier is a
  MISS (recompute), not a RETRY (wait).
* A tier that wants a request's whole context (REQUEST_LEVEL) also gets the blocks the CPU
  tier already had; one still being written there is parked and offered again at the end of
  each step until it is readable or gone. A request's tiers are told it finished only once
  no more cascade can be submitted for it.

kvlab's connector and worker do not use this class (they run the in-step variant); it is
driven by tests and by a tier written against vLLM's interface
(:class:`~kvlab.kv_offload.tiering.example.manager.ExampleSecondaryTierManager`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvlab.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvlab.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager, _check_key, _check_keys, _context
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.kv_offload.tiering.base import TIER_LABEL, JobId, JobResult, ParentManager, SecondaryTierManager, TransferJob
from kvlab.kv_offload.tiering.metrics import TieringMetricsTracker
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.utils.checks import check_number

logger = logging.getLogger(__name__)

#: Pause between two rounds of the tier-poll thread (vLLM's default; 0 or less: no thread).
DEFAULT_TIER_POLL_INTERVAL_S = 0.001
_TIER_POLL_LOCK_TIMEOUT_S = 1.0  # a round waits this long for the lock, then tries again
_TIER_POLL_GIVE_UP_AFTER_S = 30.0  # rounds failing this long (time, not a count): stop the thread, serve per step
_TIER_POLL_JOIN_TIMEOUT_S = 5.0  # how long shutdown waits for a round to end
_TIER_POLL_ERROR_LOG_INTERVAL_S = 1.0


@dataclass
class PendingPromotion:
    """The chunks one request waits to have promoted from one tier, this step."""

    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    req_context: ReqContext
    pending_primary_stores: int = 0  # GPU -> CPU stores prepared, not completed
    is_finished: bool = False
    request_level_tiers: set[int] | None = None
    pending_cascade_keys: list[OffloadKey] = field(default_factory=list)


class JobMetadata(NamedTuple):
    transfer_job: TransferJob
    tier_idx: int


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU tier as the gateway: its chunks are rows of a shared memory region the
    secondary tiers read and write. ``prepare_read``/``complete_read`` pin chunks for a
    cascade, ``prepare_write``/``complete_write`` reserve and fill chunks for a promotion --
    the GPU-facing load/store under the names that fit the secondary tier's side."""

    _tracks_slot_writes = False  # vLLM's books: the bytes are the tiers' business

    def __init__(
        self,
        num_chunks: int,
        mmap_region: SharedOffloadRegion,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        info: CPUOffloadingInfo | None = None,
    ) -> None:
        # Any region that hands out the rows will do (vLLM's own tests pass a mock); the view is
        # what the tiers use, so it is what is checked.
        if not callable(getattr(mmap_region, "create_kv_memoryview", None)):
            raise TypeError(f"mmap_region must be a SharedOffloadRegion (or have create_kv_memoryview()), got {type(mmap_region).__name__}")
        view = mmap_region.create_kv_memoryview()
        # A memoryview is checked against the tier; another object (a test's mock) is taken as is.
        if isinstance(view, memoryview):
            if view.ndim != 2 or view.shape is None:
                raise TypeError("mmap_region.create_kv_memoryview() must return a 2-D memoryview (one row per chunk)")
            if view.shape[0] != num_chunks:
                raise ValueError(f"num_chunks={num_chunks} but the region has {view.shape[0]} rows")
        elif not hasattr(view, "strides"):
            raise TypeError(
                f"mmap_region.create_kv_memoryview() must return a 2-D memoryview (one row per chunk), got {type(view).__name__}"
            )
        super().__init__(
            num_chunks=num_chunks,
            cache_policy=cache_policy,
            cache_policy_module_path=cache_policy_module_path,
            enable_events=enable_events,
            info=info,
        )
        self._mmap_region = mmap_region
        self._kv_memoryview = view
        self.complete_read = self.complete_load
        self.prepare_write = self.prepare_store
        self.complete_write = self.complete_store

    def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin chunks for a cascade. Not a read by the request: its recency is not touched."""
        return self._prepare_load(keys, req_context, record_access=False)

    def get_kv_memoryview(self) -> memoryview:
        """(num_chunks, bytes per chunk): a secondary tier reads chunk ``c`` as ``view[c]``."""
        return self._kv_memoryview

    def shutdown(self) -> None:
        super().shutdown()
        self._kv_memoryview.release()
        self._mmap_region.cleanup()


class _SecondaryTierFacingParent(ParentManager):
    """The manager as one tier sees it: every fan-out skips that tier."""

    __slots__ = ("_m", "_origin_idx")

    def __init__(self, manager: TieringOffloadingManager, tier_idx: int) -> None:
        self._m = manager
        self._origin_idx = tier_idx

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._m.on_new_request(req_context, exclude_tier_idx=self._origin_idx)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._m.lookup(key, req_context, exclude_tier_idx=self._origin_idx)

    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob:
        return self._m.create_store_job(keys, req_context, self._origin_idx)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._m.on_request_finished(req_context, exclude_tier_idx=self._origin_idx)


class TieringOffloadingManager(OffloadingManager):
    """A CPU primary tier and any number of secondary tiers (see the module docstring)."""

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager] | None = None,
        tier_poll_interval_s: float = DEFAULT_TIER_POLL_INTERVAL_S,
    ) -> None:
        if not isinstance(primary_tier, CPUPrimaryTierOffloadingManager):
            raise TypeError(f"primary_tier must be a CPUPrimaryTierOffloadingManager, got {type(primary_tier).__name__}")
        tiers = list(secondary_tiers or [])
        for i, tier in enumerate(tiers):
            if not isinstance(tier, SecondaryTierManager):
                raise TypeError(f"secondary_tiers[{i}] must be a SecondaryTierManager, got {type(tier).__name__}")
        if len(set(map(id, tiers))) != len(tiers):
            raise ValueError("secondary_tiers lists one tier twice")
        check_number("tier_poll_interval_s", tier_poll_interval_s)
        self._lock = threading.Lock()
        self.primary_tier = primary_tier
        self.secondary_tiers = tiers
        self._job_id_counter: JobId = 0
        self._jobs: dict[JobId, JobMetadata] = {}  # submitted, not reported
        self._promotions_held = False  # reset_cache() .. on_reset_flushed()
        strides = primary_tier.get_kv_memoryview().strides
        assert strides is not None  # a 2-D view of the region
        self._metrics = TieringMetricsTracker([t.tier_type for t in tiers], primary_tier.num_blocks, strides[0])
        self._pending_load_submissions: dict[int, dict[str, PendingPromotion]] = {}  # tier -> req id -> chunks
        self._processed_jobs_this_step = False
        self._req_state: dict[str, RequestState] = {}
        # A promoted block is read from host memory, but it is reported as the tier it came from.
        self._request_load_sources: dict[str, dict[OffloadKey, CacheHitSource]] = {}
        self._tier_index = {id(t): i for i, t in enumerate(tiers)}
        self._tier_parents = [_SecondaryTierFacingParent(self, i) for i in range(len(tiers))]
        self._polled_tiers = [t for t in tiers if t.tolerates_off_thread_polling]
        self._tier_poll_interval_s = float(tier_poll_interval_s)
        self._tier_poll_stop = threading.Event()
        self._tier_poll_thread: threading.Thread | None = None
        self._start_tier_poll_thread()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- the tier-poll thread -----------------------------------------------------------------------
    def _start_tier_poll_thread(self) -> None:
        """Start the thread (named ``vllm_offload_tier_poll``, as in vLLM) when a tier opted in
        and the interval is positive; otherwise the tiers are served once per step only."""
        if not self._polled_tiers or self._tier_poll_interval_s <= 0:
            return
        self._tier_poll_thread = threading.Thread(target=self._tier_poll_loop, name="vllm_offload_tier_poll", daemon=True)
        self._tier_poll_thread.start()

    def _stop_tier_poll_thread(self) -> None:
        """Ask the thread to stop and wait for it (at most ``_TIER_POLL_JOIN_TIMEOUT_S``). It
        runs the tiers' transports, so it must be gone before any tier is shut down. A thread
        that did not end is kept in ``_tier_poll_thread``: ``shutdown`` then tears the tiers
        down under the lock, so it at least cannot start another round meanwhile."""
        self._tier_poll_stop.set()
        thread = self._tier_poll_thread
        if thread is None:
            return
        thread.join(timeout=_TIER_POLL_JOIN_TIMEOUT_S)
        if thread.is_alive():
            logger.error("KV offload tier-poll thread did not end within %.1f s", _TIER_POLL_JOIN_TIMEOUT_S)
        else:
            self._tier_poll_thread = None

    def _tier_poll_loop(self) -> None:
        failing_since: float | None = None
        last_log = 0.0
        while not self._tier_poll_stop.is_set():
            if not self._lock.acquire(timeout=_TIER_POLL_LOCK_TIMEOUT_S):
                continue
            try:
                self.poll_tiers()
                failing_since = None
            except Exception:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - last_log >= _TIER_POLL_ERROR_LOG_INTERVAL_S:  # one traceback a second, not one a round
                    last_log = now
                    logger.exception("KV offload tier-poll round failed")
            finally:
                self._lock.release()
            if failing_since is not None and time.monotonic() - failing_since >= _TIER_POLL_GIVE_UP_AFTER_S:
                logger.error(
                    "KV offload tier-poll thread stops after %.0f s of failures; tiers are served per step", _TIER_POLL_GIVE_UP_AFTER_S
                )
                return
            # After the release: a lock is not fair, and this pause is the scheduler's turn.
            self._tier_poll_stop.wait(self._tier_poll_interval_s)

    def poll_tiers(self) -> None:
        """One round for the tiers that opted in (caller holds :attr:`lock`): collect their
        finished jobs, let them serve their peers. The step's batched promotions and parked
        cascades wait for ``on_schedule_end``; the per-step poll gate is left as it was."""
        gate = self._processed_jobs_this_step
        self._processed_jobs_this_step = True
        try:
            self._process_finished_jobs(self._polled_tiers)
            for tier in self._polled_tiers:
                tier.serve_external_requests(self._tier_parents[self._tier_index[id(tier)]])
        finally:
            self._processed_jobs_this_step = gate

    # -- jobs ---------------------------------------------------------------------------------------
    @property
    def _transfer_jobs(self) -> dict[JobId, JobMetadata]:
        """vLLM's other name for the submitted, unreported jobs."""
        return self._jobs

    def _next_job_id(self) -> JobId:
        job_id = self._job_id_counter
        self._job_id_counter += 1
        return job_id

    def _register_job(self, job: TransferJob, tier_idx: int) -> None:
        meta = JobMetadata(job, tier_idx)
        self._jobs[job.job_id] = meta
        self._metrics.on_job_registered(meta)

    def _submit(self, job: TransferJob, tier_idx: int, errors: list[Exception]) -> None:
        """Hand ``job`` to its tier. A tier that raises did not start it: the job ends as a
        failure at once (its pins or reserved chunks are given back), and the error is kept
        in ``errors`` for the caller to raise once its own bookkeeping is done -- so a tier
        written in a notebook that raises leaves no chunk pinned or half-written."""
        tier = self.secondary_tiers[tier_idx]
        try:
            (tier.submit_load if job.is_promotion else tier.submit_store)(job)
        except Exception as exc:
            meta = self._jobs.pop(job.job_id)
            failed = JobResult(job.job_id, False)
            self._metrics.on_job_finished(meta, failed)
            if job.is_promotion:
                self._complete_promotion(meta, failed)
            else:
                self.primary_tier.complete_read(job.keys, job.req_context)
            errors.append(exc)

    @staticmethod
    def _raise_first(errors: list[Exception]) -> None:
        if errors:
            raise errors[0]

    def _maybe_process_finished_jobs(self) -> None:
        if not self._processed_jobs_this_step:
            self._processed_jobs_this_step = True
            self._process_finished_jobs()

    def _process_finished_jobs(self, tiers: Sequence[SecondaryTierManager] | None = None) -> None:
        for tier in self.secondary_tiers if tiers is None else tiers:
            i = self._tier_index[id(tier)]
            for result in tier.get_finished_jobs():
                meta = self._jobs.pop(result.job_id, None)
                if meta is None:
                    raise RuntimeError(f"tier #{i} ({tier.tier_type}) reported job {result.job_id}, which is not in flight")
                if meta.tier_idx != i:
                    raise RuntimeError(f"tier #{i} ({tier.tier_type}) reported job {result.job_id} of tier #{meta.tier_idx}")
                self._metrics.on_job_finished(meta, result)
                job = meta.transfer_job
                if job.is_promotion:
                    self._complete_promotion(meta, result)
                else:
                    self.primary_tier.complete_read(job.keys, job.req_context)
                    self._update_backpressure(tier, meta, result)

    def _complete_promotion(self, meta: JobMetadata, result: JobResult) -> None:
        job = meta.transfer_job
        ok: Collection[OffloadKey]
        bad: Collection[OffloadKey]
        if result.success:
            ok, bad = job.keys, ()
        elif result.successful_keys:
            # A set, as vLLM 0.33 builds it: the failed chunks go back to the free list in
            # the set's order, which depends on the process's hash seed (so does vLLM's).
            bad = set(job.keys)
            if not bad.issuperset(result.successful_keys):
                raise RuntimeError(f"promotion job {result.job_id} reported keys it was not given")
            bad.difference_update(result.successful_keys)
            ok = result.successful_keys
        else:
            ok, bad = (), job.keys
        sources = self._request_load_sources.get(job.req_context.req_id)
        if sources is not None:
            origin = self.secondary_tiers[meta.tier_idx].cache_hit_source
            for key in bad:
                if sources.get(key) == origin:
                    del sources[key]
        if ok:
            self.primary_tier.complete_write(ok, job.req_context, True)
        if bad:
            self.primary_tier.complete_write(bad, job.req_context, False)

    @staticmethod
    def _should_store_to_tier(tier: SecondaryTierManager, num_blocks: int) -> bool:
        """A cascade of ``num_blocks`` goes to ``tier`` unless its back-pressure detector
        refuses it (a tier without one takes everything)."""
        return tier.bp_detector is None or tier.bp_detector.should_store(num_blocks)

    def _update_backpressure(self, tier: SecondaryTierManager, meta: JobMetadata, result: JobResult) -> None:
        detector = tier.bp_detector
        if detector is None:
            return
        if result.success:
            job = meta.transfer_job
            nbytes = result.transfer_bytes if result.transfer_bytes is not None else len(job.keys) * tier.block_size_bytes
            detector.update(job.submit_time, nbytes)
        else:
            detector.on_store_failed()

    # -- lookups and loads --------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None, *, exclude_tier_idx: int | None = None) -> LookupResult:
        """HIT: readable in the CPU tier. HIT_PENDING: being written there (a promotion this
        call may have just started). RETRY: a secondary tier is still finding out. MISS:
        nowhere, no CPU chunk to promote into, or promotions held after a reset."""
        _check_key("key", key)
        ctx = _context(req_context)
        self._maybe_process_finished_jobs()  # a promotion that ended reads as HIT now
        start = time.monotonic()  # the durations feed histograms only; nothing decides on them
        primary = self.primary_tier.lookup(key, ctx)
        self._metrics.on_lookup(ctx, key, self._metrics.primary_tier_label, primary, time.monotonic() - start)
        if primary is not LookupResult.MISS:
            return primary
        if self._promotions_held:
            return LookupResult.MISS
        any_retry = False
        for i, tier in enumerate(self.secondary_tiers):
            if i == exclude_tier_idx or not ctx.load_tier_filter.allows(tier.medium, tier.locality):
                continue
            label = self._metrics.tier_label(i)
            start = time.monotonic()
            result = tier.lookup(key, ctx)
            self._metrics.on_lookup(ctx, key, label, result, time.monotonic() - start)
            if result is LookupResult.HIT:
                return LookupResult.HIT_PENDING if self._initiate_promotion(i, key, ctx) else LookupResult.MISS
            any_retry |= result is LookupResult.RETRY
        return LookupResult.RETRY if any_retry else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext | None = None) -> CacheHitSource:
        sources = self._request_load_sources.get(req_context.req_id) if req_context is not None else None
        if sources is not None and key in sources:
            return sources[key]
        return self.primary_tier.get_load_source(key, req_context)

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, ctx: ReqContext) -> bool:
        # The chunk is reserved now, so a second lookup this step sees HIT_PENDING and does
        # not promote twice; the job itself is submitted with the step's others.
        out = self.primary_tier.prepare_write([key], ctx)
        if out is None:
            self._metrics.on_promotion_allocation_failure()
            return False
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        sources = self._request_load_sources.setdefault(ctx.req_id, {})
        for k in out.keys_to_store:
            sources[k] = self.secondary_tiers[tier_idx].cache_hit_source
        entry = self._pending_load_submissions.setdefault(tier_idx, {}).setdefault(ctx.req_id, PendingPromotion(ctx))
        entry.keys.extend(out.keys_to_store)
        entry.chunk_ids.extend(int(c) for c in out.store_spec.chunk_ids)
        return True

    def _flush_pending_promotions(self, errors: list[Exception]) -> None:
        pending, self._pending_load_submissions = self._pending_load_submissions, {}
        for tier_idx, by_req in pending.items():
            for entry in by_req.values():
                job = TransferJob(self._next_job_id(), entry.keys, np.array(entry.chunk_ids, dtype=np.int32), True, entry.req_context)
                self._register_job(job, tier_idx)
                self._submit(job, tier_idx, errors)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        """Pin CPU chunks for a GPU load (the keys were HIT this step)."""
        return self.primary_tier.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.primary_tier.touch(keys, req_context)
        ctx = _context(req_context)
        for tier in self.secondary_tiers:
            tier.touch(keys, ctx)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.primary_tier.complete_load(keys, req_context)

    # -- stores -------------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        """CPU chunks for the keys the CPU tier lacks (cascades follow in ``complete_store``).
        Polls first, always: a cascade that ended unpins chunks this eviction may take."""
        keys = _check_keys("keys", keys)  # before the poll: a refused call changes nothing
        ctx = self._known(req_context, "prepare_store")
        self._processed_jobs_this_step = True
        self._process_finished_jobs()
        out = self.primary_tier.prepare_store(keys, ctx)
        if out is None:
            return None
        state = self._req_state[ctx.req_id]
        if out.keys_to_store:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            new = set(out.keys_to_store)
            present = [k for k in keys if k not in new]
            if present:
                errors: list[Exception] = []
                parked = len(state.pending_cascade_keys)
                self._cascade_existing_chunks_to_request_level_tiers(present, ctx, state.request_level_tiers, errors)
                if errors:  # a tier raised: hand back this call's chunks, so the caller owes no complete_store
                    del state.pending_cascade_keys[parked:]
                    if out.keys_to_store:
                        self.primary_tier.complete_store(out.keys_to_store, ctx, False)
                        state.pending_primary_stores -= 1
                    self._raise_first(errors)
        return out

    def _known(self, req_context: ReqContext | None, call: str) -> ReqContext:
        if req_context is None or req_context.req_id not in self._req_state:
            rid = None if req_context is None else req_context.req_id
            raise KeyError(f"{call}: request {rid!r} is not known; call on_new_request first")
        return req_context

    def _cascade_existing_chunks_to_request_level_tiers(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
        request_level_tiers: set[int],
        errors: list[Exception] | None = None,
    ) -> None:
        """Cascade, to the REQUEST_LEVEL tiers, blocks the CPU tier already holds. One still
        being written is parked for the end of the step (nothing else would offer it again);
        a missing one has nothing to send. The CPU tier knows every key it holds, so RETRY
        from it is a broken invariant -- parking on it might never drain -- and raises
        AssertionError. A tier's refusal goes to ``errors``; without a list it is raised here."""
        state = self._req_state[req_context.req_id]
        ready = []
        for key in keys:
            result = self.primary_tier.lookup(key, req_context)
            if result is LookupResult.HIT:
                ready.append(key)
            elif result is LookupResult.HIT_PENDING:
                state.pending_cascade_keys.append(key)
            elif result is not LookupResult.MISS:
                raise AssertionError(f"the primary tier answered {result.name} for cascade key {key.hex()} (HIT, HIT_PENDING or MISS)")
        if not ready:
            return
        own = [] if errors is None else errors
        for tier_idx in request_level_tiers:
            tier = self.secondary_tiers[tier_idx]
            if self._should_store_to_tier(tier, len(ready)):
                self._submit(self.create_store_job(ready, req_context, tier_idx), tier_idx, own)
        if errors is None:
            self._raise_first(own)

    def _flush_pending_cascades(self, errors: list[Exception]) -> None:
        for req_id, state in list(self._req_state.items()):
            if state.pending_cascade_keys:
                assert state.request_level_tiers
                keys, state.pending_cascade_keys = state.pending_cascade_keys, []
                self._cascade_existing_chunks_to_request_level_tiers(keys, state.req_context, state.request_level_tiers, errors)
                self._maybe_finalize_request(req_id)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True) -> None:
        """The GPU -> CPU copy ended; on success, one cascade job per secondary tier."""
        keys = _check_keys("keys", keys)
        if not isinstance(success, bool):
            raise TypeError(f"success must be True or False, got {success!r}")
        ctx = self._known(req_context, "complete_store")
        state = self._req_state[ctx.req_id]
        if state.pending_primary_stores <= 0:
            raise RuntimeError(f"complete_store: request {ctx.req_id!r} has no store in flight")
        self.primary_tier.complete_store(keys, ctx, success)
        errors: list[Exception] = []
        if success:
            for tier_idx, tier in enumerate(self.secondary_tiers):
                if self._should_store_to_tier(tier, len(keys)):
                    self._submit(self.create_store_job(keys, ctx, tier_idx), tier_idx, errors)
        state.pending_primary_stores -= 1
        self._maybe_finalize_request(ctx.req_id)
        self._raise_first(errors)

    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext, tier_idx: int = 0) -> TransferJob:
        """Pin ``keys``' CPU chunks and register a cascade job to tier ``tier_idx``; the caller
        submits it (or, for a peer, moves the bytes itself)."""
        spec = self.primary_tier.prepare_read(keys, req_context)
        assert isinstance(spec, CPULoadStoreSpec)
        job = TransferJob(self._next_job_id(), keys, spec.chunk_ids, False, req_context)
        self._register_job(job, tier_idx)
        return job

    # -- a request's first and last word ------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext, *, exclude_tier_idx: int | None = None) -> RequestOffloadingContext:
        """REQUEST_LEVEL if any secondary tier wants the request's every block."""
        state = RequestState(req_context)
        self._metrics.on_new_request(req_context)
        for i, tier in enumerate(self.secondary_tiers):
            if i != exclude_tier_idx and tier.on_new_request(req_context).policy is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers = (state.request_level_tiers or set()) | {i}
        self._req_state[req_context.req_id] = state
        return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL if state.request_level_tiers else OffloadPolicy.CHUNK_LEVEL)

    def on_request_finished(self, req_context: ReqContext, *, exclude_tier_idx: int | None = None) -> None:
        ctx = self._known(req_context, "on_request_finished")
        self.primary_tier.on_request_finished(ctx)
        self._req_state[ctx.req_id].is_finished = True
        self._maybe_finalize_request(ctx.req_id, exclude_tier_idx)

    def _maybe_finalize_request(self, req_id: str, exclude_tier_idx: int | None = None) -> None:
        """Tell the tiers a request finished once no cascade can still be submitted for it."""
        state = self._req_state[req_id]
        if not state.is_finished or state.pending_primary_stores or state.pending_cascade_keys:
            return
        for i, tier in enumerate(self.secondary_tiers):
            if i != exclude_tier_idx:
                tier.on_request_finished(state.req_context)
        self._metrics.on_request_finished(state.req_context)
        self._request_load_sources.pop(req_id, None)
        del self._req_state[req_id]

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's last call: collect finished jobs, serve peers, submit the step's
        promotions and parked cascades, and reopen the once-per-step poll."""
        self._maybe_process_finished_jobs()
        for i, tier in enumerate(self.secondary_tiers):
            tier.serve_external_requests(self._tier_parents[i])
        self._processed_jobs_this_step = False  # after serving: its lookups need no extra poll
        errors: list[Exception] = []  # a tier that raises does not cut the step's end short
        self._flush_pending_promotions(errors)
        self._flush_pending_cascades(errors)
        for tier in self.secondary_tiers:
            tier.on_schedule_end(context)
        for req_id in context.new_req_ids:
            state = self._req_state.get(req_id)
            if state is not None:
                self._metrics.on_request_allocated(state.req_context)
        self._raise_first(errors)

    def has_pending_work(self) -> bool:
        return (
            bool(self._jobs)
            or any(s.pending_cascade_keys for s in self._req_state.values())
            or any(t.has_pending_work() for t in self.secondary_tiers)
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        yield from self.primary_tier.take_events()
        for tier in self.secondary_tiers:
            yield from tier.take_events()

    # -- resets, metrics, shutdown ------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Empty the CPU tier once every tier drained its jobs (secondary tiers keep their
        data). Running requests keep their state; finished ones are finalized. Promotions
        are held until ``on_reset_flushed``."""
        for tier in self.secondary_tiers:
            tier.drain_jobs()
        self._process_finished_jobs()
        if self._jobs:
            raise RuntimeError(f"reset_cache: jobs {sorted(self._jobs)} did not report after their tiers drained")
        self._pending_load_submissions.clear()
        self._request_load_sources.clear()
        self._metrics.assert_idle()
        finished = []
        for req_id, state in self._req_state.items():
            state.pending_primary_stores = 0
            state.pending_cascade_keys.clear()
            if state.is_finished:
                for tier in self.secondary_tiers:
                    tier.on_request_finished(state.req_context)
                self._metrics.on_request_finished(state.req_context)
                finished.append(req_id)
        self.primary_tier.reset_cache()
        for req_id in finished:
            del self._req_state[req_id]
        self._processed_jobs_this_step = False
        for tier in self.secondary_tiers:
            if tier.bp_detector is not None:
                tier.bp_detector.reset()
        self._promotions_held = bool(self.secondary_tiers)

    def on_reset_flushed(self) -> None:
        self._promotions_held = False

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self.primary_tier.get_stats()
        if stats is not None and stats.is_empty():
            stats = None
        self._metrics.record_backpressure(self.secondary_tiers)
        for part in (self._metrics.take_stats(), *(t.get_stats() for t in self.secondary_tiers)):
            if part is not None and not part.is_empty():
                stats = part if stats is None else stats.aggregate(part)
        return stats

    def config_info(self) -> list[ConfigInfoMapping]:
        """One series per tier, the CPU tier first, each with its tier label."""
        (primary,) = self.primary_tier.config_info()
        infos: list[ConfigInfoMapping] = [{**primary, TIER_LABEL: self._metrics.primary_tier_label[0]}]
        for i, tier in enumerate(self.secondary_tiers):
            infos.append({**tier.config_info(), TIER_LABEL: self._metrics.tier_label(i)[0]})
        return infos

    def shutdown(self) -> None:
        """Stop the tier-poll thread, then each tier, then the CPU tier (call it without
        holding :attr:`lock`). If a tier fails to shut down, the shared region is kept: the
        tier may still use it."""
        self._stop_tier_poll_thread()
        if self._tier_poll_thread is not None:  # still running: tear down under the lock
            if not self._lock.acquire(timeout=_TIER_POLL_JOIN_TIMEOUT_S):
                raise RuntimeError(
                    "the tier-poll thread is still running and the manager lock is held, so the secondary tiers were not shut "
                    "down; call shutdown() without holding manager.lock"
                )
            try:
                self._shutdown_tiers()
            finally:
                self._lock.release()
            return
        self._shutdown_tiers()

    def _shutdown_tiers(self) -> None:
        error: Exception | None = None
        for i, tier in enumerate(self.secondary_tiers):
            try:
                tier.shutdown()
            except Exception as exc:
                error = exc
                logger.exception("secondary tier #%d (%s) failed to shut down", i, tier.tier_type)
        if error is not None:
            raise error
        self.primary_tier.shutdown()
