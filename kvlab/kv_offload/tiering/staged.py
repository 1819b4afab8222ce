"""A CPU tier with a storage tier behind it, run in step with the worker (lesson 12). vLLM's
asynchronous shape of the same rules is
:class:`~kvlab.kv_offload.tiering.manager.TieringOffloadingManager`.

vLLM's rules, which both follow:

1. **Store to every tier.** A block offloaded from the GPU goes to the CPU tier and is
   *cascaded* to the storage tier (a file), so it survives its eviction from host memory.
2. **The CPU tier is the gateway.** Storage cannot reach GPU memory: a block found only on
   disk is first read into a CPU slot (*staged promotion*, it becomes a CPU entry again),
   then copied to the GPU.
3. **Pins protect blocks in flight.** A block being read is pinned in its tier until the
   load completes; a block being written is not readable until the store completes.

Why a second shape: vLLM promotes asynchronously (a lookup answers "retry later" while the
file is read, and the request waits for a later step). kvlab's worker reads the file in the
same step, before the GPU copy, so a lesson's run is the same on every machine, step for
step. Each promotion and each cascade is still a job
(:class:`~kvlab.kv_offload.tiering.base.TransferJob`), and the manager counts lookups and
jobs under vLLM 0.33's metric names (:mod:`kvlab.kv_offload.tiering.metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvlab.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager, _check_keys, _context
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.kv_offload.tiering.base import TIER_LABEL, JobId, JobResult, TieringOffloadingMetrics, TransferJob
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.metrics import PRIMARY_TIER_LABEL, TieringMetricsTracker
from kvlab.utils.checks import check_int

CPU, STORAGE = Medium.CPU.value, Medium.STORAGE.value

__all__ = ["TIER_LABEL", "PRIMARY_TIER_LABEL", "LoadItem", "StorePlan", "StagedTieringManager", "TieringOffloadingMetrics"]


class JobMetadata(NamedTuple):
    transfer_job: TransferJob
    tier_idx: int


@dataclass(slots=True)
class LoadItem:
    """One block to load: from ``medium``, through CPU slot ``cpu_slot`` (a STORAGE block is
    read from ``path`` into that slot first)."""

    key: OffloadKey
    medium: str
    cpu_slot: int
    path: str | None = None
    #: The promotion job a STORAGE block belongs to (one per ``prepare_load`` call).
    job_id: JobId | None = None


@dataclass(slots=True)
class StorePlan:
    """GPU -> CPU for ``keys`` (slots ``cpu_slots``), then CPU -> file for ``cascade_keys``;
    ``delete_paths``: files of blocks the storage tier evicted."""

    keys: list[OffloadKey]
    cpu_slots: list[int]
    cascade_keys: list[OffloadKey] = field(default_factory=list)
    cascade_slots: list[int] = field(default_factory=list)
    cascade_paths: list[str] = field(default_factory=list)
    delete_paths: list[str] = field(default_factory=list)
    #: When the cascade was handed out, on the storage tier's back-pressure clock.
    cascade_submit_time: float | None = None
    #: Blocks the storage tier's back-pressure kept off disk (they stay in the CPU tier).
    cascade_dropped: int = 0


class StagedTieringManager:
    """The books of all tiers together, as kvlab's offloading connector sees them."""

    def __init__(self, primary: CPUOffloadingManager, secondary: StagedFileSystemTier | None = None, *, chunk_size_bytes: int = 0) -> None:
        if not isinstance(primary, CPUOffloadingManager):
            raise TypeError(f"primary must be a CPUOffloadingManager, got {type(primary).__name__}")
        if secondary is not None and not isinstance(secondary, StagedFileSystemTier):
            raise TypeError(f"secondary must be None or a StagedFileSystemTier, got {type(secondary).__name__}")
        self.primary = primary
        self.secondary = secondary
        self._metrics = TieringMetricsTracker(
            [secondary.tier_type] if secondary is not None else [], primary.num_blocks, check_int("chunk_size_bytes", chunk_size_bytes, 0)
        )
        self._next_job_id: JobId = 0
        self._promotions: dict[JobId, JobMetadata] = {}  # registered, not finished

    @property
    def chunk_size_bytes(self) -> int:
        """Bytes of one CPU chunk, which the read and write byte counts are made of (0 until
        known: kvlab's connector sets it from the worker's first report)."""
        return self._metrics.primary_chunk_size

    @chunk_size_bytes.setter
    def chunk_size_bytes(self, value: int) -> None:
        self._metrics.primary_chunk_size = check_int("chunk_size_bytes", value, 0)

    def _new_job(
        self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], is_promotion: bool, req_context: ReqContext | None
    ) -> JobMetadata:
        self._next_job_id += 1
        job = TransferJob(self._next_job_id, list(keys), np.array(chunk_ids, dtype=np.int64), is_promotion, _context(req_context))
        meta = JobMetadata(job, 0)
        self._metrics.on_job_registered(meta)
        return meta

    @property
    def tiers(self) -> list[CPUOffloadingManager | StagedFileSystemTier]:
        return [self.primary] + ([self.secondary] if self.secondary is not None else [])

    # -- lookups ----------------------------------------------------------------------------------
    def where(self, key: OffloadKey, req_context: ReqContext | None = None) -> str | None:
        """The tier a load of ``key`` would be served from now (CPU first), or None. Each
        tier asked counts a chunk query in the metrics (once per request and key). The
        storage tier is asked only if the request's ``load_tier_filter`` lets it serve
        (vLLM 0.33: the filter gates the secondary tiers; the CPU tier always answers)."""
        ctx = _context(req_context)
        for i, (tier, label) in enumerate(((self.primary, PRIMARY_TIER_LABEL), (self.secondary, None))):
            if tier is None:
                break
            if i > 0 and not ctx.load_tier_filter.allows(tier.medium, getattr(tier, "locality", None)):
                continue
            start = time.monotonic()  # observed for the metrics only; nothing decides on it
            result = tier.lookup(key, req_context)
            self._metrics.on_lookup(ctx, key, label or self._metrics.tier_label(i - 1), result, time.monotonic() - start)
            if result is LookupResult.HIT:
                return CPU if i == 0 else STORAGE
        return None

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        """vLLM's one-key question: HIT when some tier can serve ``key`` now, else MISS.
        These tiers move data in step with the scheduler, so they never answer
        ``HIT_PENDING`` or ``RETRY`` (vLLM's asynchronous tiering manager does)."""
        return LookupResult.MISS if self.where(key, req_context) is None else LookupResult.HIT

    def lookup_chain(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> list[str]:
        """The tiers that can serve the longest run of ``keys`` from the first one on: one
        medium per block, stopping at the first miss -- and at the first storage block that
        could not get a CPU slot to be promoted through."""
        media: list[str] = []
        for key in keys:
            m = self.where(key, req_context)
            if m is None:
                break
            media.append(m)
        return self.cap_promotions(keys, media)

    def cap_promotions(self, keys: Sequence[OffloadKey], media: Sequence[str]) -> list[str]:
        """Cut ``media`` before the first storage block that could not get a CPU slot to
        pass through (every block of the run is protected from that eviction)."""
        media = list(media)
        if STORAGE in media:
            room = self.primary.num_storable(protected=keys[: len(media)])
            seen = 0
            for i, m in enumerate(media):
                if m == STORAGE:
                    seen += 1
                    if seen > room:
                        self._metrics.on_promotion_allocation_failure()
                        return media[:i]
        return media

    # -- loads ------------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[OffloadKey], media: Sequence[str], req_context: ReqContext | None = None) -> list[LoadItem]:
        """Pin every block where it is (touching it in its LRU); a storage block also gets
        a CPU slot to be read into (it becomes a pending CPU entry). In key order."""
        keys = _check_keys("keys", keys)
        if isinstance(media, str) or not isinstance(media, Sequence):
            raise TypeError(f"media must be a list of 'CPU'/'STORAGE' (lookup_chain's answer), got {type(media).__name__}")
        if len(keys) != len(media):
            raise ValueError(f"prepare_load: {len(keys)} keys but {len(media)} media")
        # All or nothing: every block is checked before the first one is pinned.
        tiers = [CPU] + ([STORAGE] if self.secondary is not None else [])
        promote = 0
        for i, (key, m) in enumerate(zip(keys, media)):
            if m not in tiers:
                raise ValueError(f"prepare_load: media[{i}] = {m!r} is not one of this manager's tiers {tiers}")
            tier = self.primary if m == CPU else self.secondary
            assert tier is not None
            status = tier._policy.get(key)  # not lookup(): checking must not drop entries
            if status is None or not status.is_ready or (m == CPU and self.primary.overwritten(key)):
                raise ValueError(f"prepare_load: keys[{i}] (block {key.hex()[:16]}…) is not readable in the {m} tier")
            if m == STORAGE:
                if key in self.primary:
                    raise ValueError(f"prepare_load: keys[{i}] is in the CPU tier too; load it from 'CPU'")
                promote += 1
        if promote > self.primary.num_storable(protected=keys):
            raise ValueError(
                f"prepare_load: {promote} storage blocks need a CPU slot to pass through, but only "
                f"{self.primary.num_storable(protected=keys)} can be found (lookup_chain caps this)"
            )
        items = []
        protected = set(keys)
        promotion: list[LoadItem] = []
        for key, m in zip(keys, media):
            if m == CPU:
                (slot,) = self.primary.prepare_load([key], req_context).block_ids.tolist()
                items.append(LoadItem(key, CPU, slot))
            elif m == STORAGE and self.secondary is not None:
                self.secondary.prepare_load([key], req_context)
                out = self.primary.prepare_store([key], req_context, protected=protected)
                if out is None or not out.slots:
                    raise RuntimeError("prepare_load: no CPU slot to promote a storage block through (lookup_chain caps this)")
                items.append(LoadItem(key, STORAGE, out.slots[0], self.secondary.path_of(key)))
                promotion.append(items[-1])
            else:
                raise ValueError(f"prepare_load: medium {m!r} is not one of this manager's tiers")
        if promotion:  # one promotion job for the call's storage blocks (vLLM: one per request and step)
            meta = self._new_job([it.key for it in promotion], [it.cpu_slot for it in promotion], True, req_context)
            self._promotions[meta.transfer_job.job_id] = meta
            for it in promotion:
                it.job_id = meta.transfer_job.job_id
        return items

    def complete_load(
        self,
        items: Iterable[LoadItem],
        failed: Iterable[OffloadKey] = (),
        reason: str = "load failed",
        req_context: ReqContext | None = None,
        loaded: Iterable[OffloadKey] | None = None,
        transfer_time: float | None = None,
    ) -> None:
        """Unpin; a promoted block becomes a readable CPU entry. ``failed`` blocks did not
        load: they leave the tier that served them (and the CPU slot reserved for them).

        ``loaded``: the blocks whose transfer finished (None: every block not in
        ``failed``). A block in neither was never tried -- the job stopped at an earlier
        failure, or its step never ran: it stays where it was, and a storage block's CPU
        slot is given back unwritten. (Marking that slot readable would serve whatever
        bytes it held before to the next load from the CPU tier.) ``transfer_time``: the
        seconds the promotion's file reads took (metrics only)."""
        items = list(items)
        bad = set(failed)
        done = {it.key for it in items} - bad if loaded is None else set(loaded) - bad
        for job_id in dict.fromkeys(it.job_id for it in items if it.medium == STORAGE and it.job_id is not None):
            meta = self._promotions.pop(job_id, None)
            if meta is None:
                continue
            ok = [k for k in meta.transfer_job.keys if k in done]
            success = len(ok) == len(meta.transfer_job.keys)
            self._metrics.on_job_finished(meta, JobResult(job_id, success, None if success else ok, transfer_time))
        for it in items:
            if it.medium == CPU:
                self.primary.complete_load([it.key], req_context)
                if it.key in bad:
                    self.primary.remove([it.key], reason)
            else:
                assert self.secondary is not None
                self.secondary.complete_load([it.key], req_context)
                why = reason if it.key in bad else "promotion not run: its load job stopped before this block"
                self.primary.complete_store([it.key], req_context, success=it.key in done, reason=why)
                if it.key in bad:
                    self.secondary.remove([it.key], reason)

    # -- stores -----------------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> StorePlan | None:
        """Room in the CPU tier for the keys it lacks, and on disk for those of them the
        storage tier lacks (cascade). None when the CPU tier has no unpinned room."""
        keys = _check_keys("keys", keys)
        out = self.primary.prepare_store(keys, req_context)
        if out is None:
            return None
        plan = StorePlan(out.keys_to_store, out.slots)
        sec = self.secondary
        if sec is not None and out.keys_to_store:
            detector = sec.bp_detector
            # vLLM 0.33 asks the tier's detector once per store, for all its blocks (the
            # tier itself then skips the ones it has); a refusal drops the whole cascade.
            if detector is not None and not detector.should_store(len(out.keys_to_store)):
                plan.cascade_dropped = len(out.keys_to_store)
                return plan
            new = [k for k in out.keys_to_store if k not in sec]
            cascade = sec.prepare_store(new, req_context) if new else None
            if cascade is not None:
                plan.cascade_keys = cascade.keys_to_store
                plan.cascade_slots = cascade.slots
                plan.cascade_paths = [sec.path_of(k) for k in cascade.keys_to_store]
                plan.delete_paths = [sec.path_of(k) for k in cascade.evicted_keys]
                if detector is not None:
                    plan.cascade_submit_time = detector.now()
        return plan

    def complete_store(
        self,
        plan: StorePlan,
        success: bool = True,
        cascade_success: bool = True,
        req_context: ReqContext | None = None,
        cascade_bytes: int | None = None,
        cascade_time: float | None = None,
    ) -> None:
        """The worker ran ``plan``: ``success`` for the GPU -> CPU copy, ``cascade_success``
        for the files, which held ``cascade_bytes`` bytes. A cascade that ran feeds the
        storage tier's back-pressure detector (its time since submission, or a failure); one
        that never ran (the copy before it failed, or its step was undone) tells it nothing."""
        self.primary.complete_store(plan.keys, req_context, success)
        if self.secondary is not None and success and plan.keys and not plan.cascade_dropped:
            # vLLM's cascade job covers every key the CPU tier just stored (the tier skips
            # those it has), and it exists only once the GPU -> CPU copy landed.
            meta = self._new_job(plan.keys, plan.cpu_slots, False, req_context)
            result = JobResult(meta.transfer_job.job_id, cascade_success, transfer_time=cascade_time, transfer_bytes=cascade_bytes)
            self._metrics.on_job_finished(meta, result)
        if self.secondary is not None and plan.cascade_keys:
            self.secondary.complete_store(plan.cascade_keys, req_context, success and cascade_success)
            detector = self.secondary.bp_detector
            if detector is not None and success and plan.cascade_submit_time is not None:
                if cascade_success:
                    detector.update(plan.cascade_submit_time, cascade_bytes or 0)
                else:
                    detector.on_store_failed()

    def reset_cache(self) -> None:
        """Empty the CPU tier; the storage tier keeps its files (they outlive a reset in
        vLLM too) but its back-pressure detector starts over."""
        self.primary.reset_cache()
        if self.secondary is not None and self.secondary.bp_detector is not None:
            self.secondary.bp_detector.reset()

    # -- a request's first and last word ------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> None:
        for t in self.tiers:
            t.on_new_request(req_context)
        self._metrics.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Every tier commits what the request read and stored (its recency, vLLM 0.33)."""
        for t in self.tiers:
            t.on_request_finished(req_context)
        self._metrics.on_request_finished(req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's last word: requests allocated in it stop counting lookups (a request
        looked up again while it waits counts each block once, vLLM 0.33)."""
        for req_id in context.new_req_ids:
            self._metrics.on_request_allocated(ReqContext(req_id))  # keyed by id; an unknown one is ignored

    def take_events(self) -> list[OffloadingEvent]:
        return [e for t in self.tiers for e in t.take_events()]

    def tier_label(self, tier_idx: int) -> tuple[str]:
        """A secondary tier's label value: its position after the primary and its type."""
        return self._metrics.tier_label(tier_idx)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The metrics since the last call (vLLM 0.33's ``get_stats``; None when there is
        nothing to say): the CPU tier's own, then the tiering metrics -- each secondary
        tier's job gauges, back-pressure, lookups and finished jobs, labelled by tier."""
        stats = self.primary.get_stats()
        if stats is not None and stats.is_empty():
            stats = None
        tiers = [self.secondary] if self.secondary is not None else []
        self._metrics.record_backpressure(tiers)
        tiering = self._metrics.take_stats()
        if tiering is not None:
            stats = tiering if stats is None else stats.aggregate(tiering)
        return stats

    def config_info(self) -> list[ConfigInfoMapping]:
        """One series per tier, the CPU tier first, each with its tier label."""
        (primary,) = self.primary.config_info()
        infos: list[ConfigInfoMapping] = [{**primary, TIER_LABEL: PRIMARY_TIER_LABEL[0]}]
        if self.secondary is not None:
            (info,) = self.secondary.config_info()
            infos.append({**info, TIER_LABEL: self.tier_label(0)[0]})
        return infos

    def check_invariants(self) -> None:
        for t in self.tiers:
            t.check_invariants()
