"""The server half of a P2P session: writing one peer the blocks it asks for (vLLM 0.33:
``ServerRole`` in ``vllm/v1/kv_offload/tiering/p2p/session/server.py``).

The session owns the connection; this role keeps the books and emits through ``send``. Per
request id it meets **supply** against **demand**, one *round* at a time (``round_seq``):

* supply: blocks pinned locally -- a disaggregated-prefill store job (``add_stored_blocks``)
  or, in symmetric P2P, the hits of the peer's own ``lookup`` (pinned under that round);
* demand: the peer's ``fetch``, naming the block each key must land in.

A key present on both sides goes out in one ``write_blocks``; when every demanded block is
written the round ends with ``transfer_done`` and its store jobs end (their pins drop).

Three rules keep a peer from reading a slot this engine has reused:

* a store job's pin is held until **every** write carrying it is terminal -- a failed,
  timed-out or aborted round fails its jobs, but those still being written wait for the
  transport (NIXL cannot stop a WRITE in flight);
* ``abort_ack`` goes out only once none of the round's writes can still land;
* a peer lookup that the parent tier cannot answer yet (HIT_PENDING / RETRY) is parked and
  re-asked each step, but for at most ``_LOOKUP_PENDING_TIMEOUT_S``, then answered MISS.

A duplicate fetch is the peer's protocol violation: ``ValueError``, and the session
disconnects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvlab.kv_offload.base import LookupResult, OffloadKey, ReqContext
from kvlab.kv_offload.tiering.p2p.session.protocol import AbortAckMsg, LookupRespMsg, TransferDoneMsg

if TYPE_CHECKING:
    from kvlab.kv_offload.tiering.base import JobId, ParentManager
    from kvlab.kv_offload.tiering.p2p.data.base import DataTransport

logger = logging.getLogger(__name__)

_STORE_TIMEOUT_S = 30.0  # a store job no fetch consumed in this long fails (its pin drops)
_CANCEL_DRAIN_TIMEOUT_S = 10.0  # an abort still draining after this long is logged (never forced)
_CANCEL_RETRY_INTERVAL_S = 0.1  # a wait-mode cancel calls into NIXL: at most this often per round
_LOOKUP_PENDING_TIMEOUT_S = 5.0  # a parked lookup key turns MISS after this long


class StoreResult(NamedTuple):
    job_id: int
    success: bool


@dataclass
class _MatchResult:
    """Pairs ready to write (my block -> the peer's) and the store jobs that pinned them."""

    local_idxs: list[int] = field(default_factory=list)
    remote_idxs: list[int] = field(default_factory=list)
    job_ids: set[int] = field(default_factory=set)

    def add(self, local_idx: int, remote_idx: int, job_id: int) -> None:
        self.local_idxs.append(local_idx)
        self.remote_idxs.append(remote_idx)
        self.job_ids.add(job_id)


@dataclass
class _OutboundRequestState:
    """One fetch round: the supply parked for it, the demand waiting for supply, and how
    far the writes got. A round is cancelled (failed transfer, timed-out job, peer abort)
    while writes may still run; it is finalized only when they are terminal."""

    lookup_supplied: bool = False  # supplied by lookup pins: no later supply can come
    demand_received: bool = False
    available: dict[OffloadKey, tuple[int, int]] = field(default_factory=dict)  # key -> (job, my block)
    demanded: dict[OffloadKey, int] = field(default_factory=dict)  # key -> the peer's block
    remaining: int = 0  # demanded blocks not yet written
    finishing: bool = False  # no more supply will come (the request finished locally)
    inflight: int = 0  # writes submitted and not yet terminal
    cancelled: bool = False
    last_cancel_at: float | None = None  # last wait-mode cancel (rate limit)
    pending_job_ids: set[int] = field(default_factory=set)  # jobs that supplied and owe a result

    def add_stored_blocks(self, keys: Sequence[OffloadKey], block_ids: Sequence[int], job_id: int) -> _MatchResult:
        self.pending_job_ids.add(job_id)
        match = _MatchResult()
        for key, local_idx in zip(keys, block_ids):
            remote_idx = self.demanded.pop(key, None)
            if remote_idx is None:
                self.available[key] = (job_id, local_idx)
            else:
                match.add(local_idx, remote_idx, job_id)
        return match

    def add_fetch_demand(self, keys: Sequence[OffloadKey], block_indexes: Sequence[int]) -> _MatchResult:
        self.demand_received = True
        self.remaining = len(keys)
        match = _MatchResult()
        for key, remote_idx in zip(keys, block_indexes):
            supply = self.available.pop(key, None)
            if supply is None:
                self.demanded[key] = remote_idx
            else:
                match.add(supply[1], remote_idx, supply[0])
        return match


@dataclass
class _InflightXfer:
    """One submitted write, by transport id."""

    kv_request_id: str
    block_count: int
    job_ids: set[int]
    # Defaults for entries made without a round (vLLM's tests seed the in-flight table so).
    round: _OutboundRequestState = field(default_factory=_OutboundRequestState)
    round_key: int = 0  # its round's ``round_seq``


@dataclass
class _ActiveLookup:
    """One peer ``lookup`` being answered: exactly one ``lookup_resp`` goes back, with every
    key in the peer's order, once no key is pending (or the deadline made them MISS)."""

    lookup_id: int
    kv_request_id: str
    ctx: ReqContext  # the synthetic request the parent tier knows this lookup as
    round_seq: int = 0
    keys: list[OffloadKey] = field(default_factory=list)
    resolved: dict[OffloadKey, bool] = field(default_factory=dict)  # key -> hit
    pending: set[OffloadKey] = field(default_factory=set)  # HIT_PENDING / RETRY so far
    deadline: float = 0.0


class _PendingLookup(NamedTuple):
    """A ``lookup`` received during dispatch, waiting for the next serve (the only time the
    parent tier may be asked)."""

    keys: list[OffloadKey]
    enqueued_at: float
    round_seq: int = 0


@dataclass
class _ServerRequestState:
    """All the server's state for one request id; dropped once idle (``_maybe_prune``)."""

    outbound: dict[int, _OutboundRequestState] = field(default_factory=dict)  # by round_seq
    pending_lookups: list[_PendingLookup] = field(default_factory=list)
    lookups: dict[int, _ActiveLookup] = field(default_factory=dict)  # parked, by lookup_id
    inflight_tids: set[int] = field(default_factory=set)  # its entries in ServerRole._inflight


class ServerRole:
    """The books of what one session writes to its peer."""

    def __init__(self, peer_id: str, transport: DataTransport, send: Callable[[dict], None]) -> None:
        self._peer_id = peer_id
        self._transport = transport
        self._send = send
        self._requests: dict[str, _ServerRequestState] = {}
        self._serve_pending: set[str] = set()  # requests with lookups for the next serve
        self._inflight: dict[int, _InflightXfer] = {}  # change only via _inflight_add/_inflight_pop
        self._store_jobs: dict[int, float] = {}  # job -> when it supplied (for the timeout)
        self._pending_store_results: list[StoreResult] = []  # ended outside collect_results
        self._finished_lookup_ctxs: list[ReqContext] = []  # owe parent.on_request_finished
        self._lookup_id_counter = 0
        self._pending_aborts: dict[tuple[str, int], float] = {}  # (request, round) -> since
        self._slow_aborts: set[tuple[str, int]] = set()  # already warned about
        self.peer_fault: str | None = None  # the transport's verdict on the peer; no new writes

    # -- state ------------------------------------------------------------------------------------

    def _get_or_create_request(self, kv_request_id: str) -> _ServerRequestState:
        return self._requests.setdefault(kv_request_id, _ServerRequestState())

    def _round(self, kv_request_id: str, round_seq: int) -> _OutboundRequestState:
        return self._get_or_create_request(kv_request_id).outbound.setdefault(round_seq, _OutboundRequestState())

    def _registered(self, kv_request_id: str, round_key: int, rnd: _OutboundRequestState) -> bool:
        """Is ``rnd`` still the live round ``round_key``? (A finalized round's late writes
        only settle their jobs.)"""
        st = self._requests.get(kv_request_id)
        return st is not None and st.outbound.get(round_key) is rnd

    def _maybe_prune(self, kv_request_id: str) -> None:
        st = self._requests.get(kv_request_id)
        if st is None or st.outbound or st.inflight_tids or st.lookups or st.pending_lookups:
            return
        if any(kv == kv_request_id for kv, _ in self._pending_aborts):
            return
        del self._requests[kv_request_id]

    def _has_inflight_for(self, kv_request_id: str) -> bool:
        st = self._requests.get(kv_request_id)
        return st is not None and bool(st.inflight_tids)

    def _inflight_add(self, tid: int, xfer: _InflightXfer) -> None:
        self._inflight[tid] = xfer
        self._get_or_create_request(xfer.kv_request_id).inflight_tids.add(tid)

    def _inflight_pop(self, tid: int) -> _InflightXfer | None:
        xfer = self._inflight.pop(tid, None)
        if xfer is None:
            return None
        xfer.round.inflight -= 1
        assert xfer.round.inflight >= 0
        st = self._requests.get(xfer.kv_request_id)
        if st is not None:
            st.inflight_tids.discard(tid)
        return xfer

    @property
    def has_inflight_transfers(self) -> bool:
        return bool(self._inflight)

    # -- supply and demand ------------------------------------------------------------------------

    def add_stored_blocks(
        self,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        block_ids: Sequence[int],
        job_id: JobId,
        round_seq: int = 0,
        *,
        from_lookup: bool = False,
    ) -> None:
        """Supply for one round (a disaggregated-prefill store is always round 0; a lookup
        pin, its lookup's round). Written at once if the peer already asked."""
        self._store_jobs[job_id] = time.monotonic()
        rnd = self._round(kv_request_id, round_seq)
        if rnd.cancelled:  # nobody will read it: let the pin go now
            del self._store_jobs[job_id]
            self._pending_store_results.append(StoreResult(job_id, False))
            return
        rnd.lookup_supplied |= from_lookup
        match = rnd.add_stored_blocks(keys, block_ids, job_id)
        if match.local_idxs and rnd.demand_received:
            self._submit_transfer(kv_request_id, match, rnd, round_seq)

    def on_fetch(self, kv_request_id: str, keys: Sequence[OffloadKey], block_indexes: Sequence[int], round_seq: int = 0) -> None:
        """The peer's demand for one round. An empty fetch means the request is over there:
        its lookups close and every round ends, with no ``transfer_done`` (nobody waits)."""
        st = self._requests.get(kv_request_id)
        old = st.outbound.get(round_seq) if st is not None else None
        if old is not None and old.demand_received:
            raise ValueError(f"duplicate fetch for kv_request_id={kv_request_id} round={round_seq}")
        rnd = self._round(kv_request_id, round_seq)
        match = rnd.add_fetch_demand(keys, block_indexes)
        if not keys:
            self._finish_inbound_lookups(kv_request_id)
            for key in list(self._requests[kv_request_id].outbound):
                self._finalize_outbound(kv_request_id, key, send_done=False)
            return
        if rnd.lookup_supplied and rnd.demanded:
            # Lookup pins come before the fetch, so a key still missing never will: fail the
            # round now rather than make the peer wait for its load timeout.
            logger.warning(
                "P2PSession %s: fetch %s round=%s wants %d blocks with no pinned supply",
                self._peer_id,
                kv_request_id,
                round_seq,
                len(rnd.demanded),
            )
            self._finalize_outbound(kv_request_id, round_seq, success=False)
        elif match.local_idxs:
            self._submit_transfer(kv_request_id, match, rnd, round_seq)
        elif rnd.finishing and not rnd.inflight:  # finished locally before the peer asked
            self._finalize_outbound(kv_request_id, round_seq)

    def finish(self, kv_request_id: str) -> None:
        """The request finished locally: no more supply. Rounds the peer already asked for
        end now (or when their writes do); the others when the fetch comes."""
        self._finish_inbound_lookups(kv_request_id)
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        for key, rnd in list(st.outbound.items()):
            rnd.finishing = True
            if rnd.demand_received and not rnd.inflight:
                self._finalize_outbound(kv_request_id, key)

    def _submit_transfer(self, kv_request_id: str, match: _MatchResult, rnd: _OutboundRequestState, round_key: int) -> None:
        tid: int | None = None
        raised: Exception | None = None
        if self.peer_fault is None:
            try:
                tid = self._transport.write_blocks(self._peer_id, match.local_idxs, match.remote_idxs)
            except Exception as exc:  # e.g. a peer's block index the transport cannot even encode
                # The manager's submit_store gets here too: a raise would reach the scheduler and
                # leave this round's blocks popped with nothing in flight. Fail the round instead.
                raised = exc  # logged below, with its traceback
        if tid is not None:
            rnd.inflight += 1
            self._inflight_add(tid, _InflightXfer(kv_request_id, len(match.local_idxs), match.job_ids, rnd, round_key))
            return
        logger.warning(
            "P2PSession %s: write_blocks failed for %s (%d blocks)", self._peer_id, kv_request_id, len(match.local_idxs), exc_info=raised
        )
        # These blocks can never arrive: the round fails once its other writes end.
        rnd.finishing = True
        if not rnd.inflight and self._registered(kv_request_id, round_key, rnd):
            self._finalize_outbound(kv_request_id, round_key, success=False)

    # -- peer lookups (symmetric P2P) -------------------------------------------------------------

    def on_lookup(self, kv_request_id: str, keys: Sequence[OffloadKey], round_seq: int = 0) -> None:
        """Queue a peer ``lookup``: the parent tier may only be asked in the next serve."""
        self._get_or_create_request(kv_request_id).pending_lookups.append(_PendingLookup(list(keys), time.monotonic(), round_seq))
        self._serve_pending.add(kv_request_id)

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer queued lookups and re-ask parked keys (``parent`` is valid for this call
        only), then tell the parent which lookups ended since the last serve."""
        for kv_request_id in list(self._serve_pending):
            st = self._requests.get(kv_request_id)
            if st is not None:
                queued, st.pending_lookups = st.pending_lookups, []
                for pl in queued:
                    self._process_inbound_lookup(kv_request_id, pl.keys, pl.enqueued_at, pl.round_seq, parent)
                self._resolve_pending_lookups(kv_request_id, parent)
                st = self._requests.get(kv_request_id)
            if st is None or not (st.pending_lookups or st.lookups):
                self._serve_pending.discard(kv_request_id)
                self._maybe_prune(kv_request_id)
        finished, self._finished_lookup_ctxs = self._finished_lookup_ctxs, []
        for ctx in finished:
            parent.on_request_finished(ctx)

    def _process_inbound_lookup(
        self, kv_request_id: str, keys: list[OffloadKey], enqueued_at: float, round_seq: int, parent: ParentManager
    ) -> None:
        self._lookup_id_counter += 1
        lookup_id = self._lookup_id_counter
        ctx = ReqContext(req_id=f"p2p:{self._peer_id}:{kv_request_id}:lu{lookup_id}")
        lookup = _ActiveLookup(lookup_id, kv_request_id, ctx, round_seq, list(keys), deadline=enqueued_at + _LOOKUP_PENDING_TIMEOUT_S)
        parent.on_new_request(ctx)
        self._poll_lookup_keys(lookup, dict.fromkeys(lookup.keys), parent)
        if lookup.pending:
            self._get_or_create_request(kv_request_id).lookups[lookup_id] = lookup
        else:
            self._finalize_lookup(lookup, parent)

    def _poll_lookup_keys(self, lookup: _ActiveLookup, keys: Iterable[OffloadKey], parent: ParentManager) -> None:
        """Ask the parent about ``keys`` and pin the hits in one job, as this round's supply.
        Nothing can evict between the lookup and the pin: the whole serve runs under the
        tiering manager's lock."""
        hits: list[OffloadKey] = []
        for key in keys:
            if key in lookup.resolved:
                continue
            result = parent.lookup(key, lookup.ctx)
            if result in (LookupResult.HIT, LookupResult.MISS):
                lookup.resolved[key] = result is LookupResult.HIT
                lookup.pending.discard(key)
                if result is LookupResult.HIT:
                    hits.append(key)
            else:
                lookup.pending.add(key)
        if hits:
            job = parent.create_store_job(hits, lookup.ctx)
            chunk_ids = [int(c) for c in job.chunk_ids]
            self.add_stored_blocks(lookup.kv_request_id, list(job.keys), chunk_ids, job.job_id, lookup.round_seq, from_lookup=True)

    def _resolve_pending_lookups(self, kv_request_id: str, parent: ParentManager) -> None:
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        now = time.monotonic()
        for lookup_id, lookup in list(st.lookups.items()):
            self._poll_lookup_keys(lookup, list(lookup.pending), parent)
            if lookup.pending and now >= lookup.deadline:  # a stuck producer: the peer falls back
                lookup.resolved.update(dict.fromkeys(lookup.pending, False))
                lookup.pending.clear()
            if not lookup.pending:
                del st.lookups[lookup_id]
                self._finalize_lookup(lookup, parent)

    def _finalize_lookup(self, lookup: _ActiveLookup, parent: ParentManager) -> None:
        if lookup.keys:
            hits = [lookup.resolved[k] for k in lookup.keys]
            self._send(LookupRespMsg.make(kv_request_id=lookup.kv_request_id, keys=list(lookup.keys), hits=hits))
        parent.on_request_finished(lookup.ctx)

    def _finish_inbound_lookups(self, kv_request_id: str) -> None:
        """No more lookups for this request (empty fetch, or local finish): drop queued ones
        (the parent never heard of them) and owe the parent the end of parked ones, which no
        answer follows (the peer has moved on)."""
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        st.pending_lookups.clear()
        self._finished_lookup_ctxs.extend(lu.ctx for lu in st.lookups.values())
        st.lookups.clear()
        self._serve_pending.discard(kv_request_id)
        self._maybe_prune(kv_request_id)

    # -- aborts -----------------------------------------------------------------------------------

    def on_abort_fetch(self, kv_request_id: str, round_seq: int = 0) -> None:
        """The peer gave up on a round. Repeats only retry the drain."""
        st = self._requests.get(kv_request_id)
        if (st is None or not st.outbound) and not self._has_inflight_for(kv_request_id):
            logger.warning("P2PSession %s: abort_fetch for unknown kv_request_id=%s (a race, or stale)", self._peer_id, kv_request_id)
        self._get_or_create_request(kv_request_id)
        self._pending_aborts.setdefault((kv_request_id, round_seq), time.monotonic())
        self._drain_abort(kv_request_id, round_seq)

    def drain_pending_aborts(self) -> None:
        for kv_request_id, round_seq in list(self._pending_aborts):
            self._drain_abort(kv_request_id, round_seq)

    def _drain_abort(self, kv_request_id: str, round_seq: int) -> None:
        """Cancel the round; ack once none of its writes can still land -- the ack hands the
        peer its blocks back. A write NIXL does not confirm stopped is never forced: past
        ``_CANCEL_DRAIN_TIMEOUT_S`` the drain only warns."""
        rnd = self._requests[kv_request_id].outbound.get(round_seq)
        if rnd is not None and not rnd.cancelled:
            rnd.cancelled = True
            self._pending_store_results.extend(self._fail_unwritten_round_jobs(rnd))
        tids = [t for t, x in self._inflight.items() if x.kv_request_id == kv_request_id and x.round_key == round_seq]
        if tids:
            now = time.monotonic()
            key = (kv_request_id, round_seq)
            if now - self._pending_aborts[key] >= _CANCEL_DRAIN_TIMEOUT_S and key not in self._slow_aborts:
                self._slow_aborts.add(key)
                logger.warning(
                    "P2PSession %s: abort of %s round=%s still waits for %d writes after %.0fs; pins and ack held",
                    self._peer_id,
                    kv_request_id,
                    round_seq,
                    len(tids),
                    _CANCEL_DRAIN_TIMEOUT_S,
                )
            if not self._cancel_due(self._inflight[tids[0]].round, now):
                return
            still = set(self._transport.cancel(tids, mode="wait"))
            for tid in tids:
                if tid not in still:  # released by the transport: no poll will report it
                    self._inflight_pop(tid)
            if still:
                return
        if rnd is not None and self._registered(kv_request_id, round_seq, rnd):
            self._finalize_outbound(kv_request_id, round_seq, success=False, send_done=False)
        self._pending_aborts.pop((kv_request_id, round_seq), None)
        self._slow_aborts.discard((kv_request_id, round_seq))
        self._send(AbortAckMsg.make(kv_request_id=kv_request_id, round_seq=round_seq))
        self._maybe_prune(kv_request_id)

    @staticmethod
    def _cancel_due(rnd: _OutboundRequestState, now: float) -> bool:
        """Each wait-mode cancel calls NIXL on the scheduler thread: once per interval per round."""
        if rnd.last_cancel_at is not None and now - rnd.last_cancel_at < _CANCEL_RETRY_INTERVAL_S:
            return False
        rnd.last_cancel_at = now
        return True

    # -- endings ----------------------------------------------------------------------------------

    def _read_job_ids(self, rnd: _OutboundRequestState | None = None) -> set[int]:
        """Jobs an in-flight write (of ``rnd``, or any) still reads: their pins must hold."""
        return {j for x in self._inflight.values() if rnd is None or x.round is rnd for j in x.job_ids}

    def _end_jobs(self, job_ids: Iterable[int], success: bool) -> list[StoreResult]:
        """A result for each job still open (a job ends once, whichever path sees it first)."""
        return [StoreResult(j, success) for j in job_ids if self._store_jobs.pop(j, None) is not None]

    def _fail_unwritten_round_jobs(self, rnd: _OutboundRequestState) -> list[StoreResult]:
        """Fail a cancelled round's jobs no write carries; the others end with their write."""
        unwritten = rnd.pending_job_ids - self._read_job_ids(rnd)
        rnd.pending_job_ids -= unwritten
        return self._end_jobs(sorted(unwritten), False)

    def _settle_xfer_jobs(self, xfer: _InflightXfer, success: bool) -> list[StoreResult]:
        """End the jobs of a write that is terminal -- but in a cancelled round, not one that
        another in-flight write (of any round) still reads."""
        held = self._read_job_ids() if xfer.round.cancelled else set()
        ended = self._end_jobs(sorted(xfer.job_ids - held), success)
        xfer.round.pending_job_ids -= {r.job_id for r in ended}
        return ended

    def _finalize_cancelled(self, kv_request_id: str, round_key: int) -> None:
        """An aborted round gets ``abort_ack`` (from its drain), not ``transfer_done``."""
        aborted = (kv_request_id, round_key) in self._pending_aborts
        self._finalize_outbound(kv_request_id, round_key, success=False, send_done=not aborted)

    def _finalize_outbound(self, kv_request_id: str, round_key: int, success: bool | None = None, send_done: bool = True) -> None:
        """End one round: its jobs' results, and ``transfer_done`` if the peer asked for it.
        ``success`` None: whether every demanded block was written. A cancelled round waits
        for its last write."""
        st = self._requests[kv_request_id]
        rnd = st.outbound[round_key]
        if rnd.cancelled and rnd.inflight:
            return
        del st.outbound[round_key]
        if rnd.cancelled:
            success = False
        elif success is None:
            success = rnd.demand_received and rnd.remaining == 0
        self._pending_store_results.extend(self._end_jobs(sorted(rnd.pending_job_ids), success))
        rnd.pending_job_ids.clear()
        logger.debug("P2PSession %s: round %s/%s ends, success=%s", self._peer_id, kv_request_id, round_key, success)
        if send_done and rnd.demand_received:
            self._send(TransferDoneMsg.make(kv_request_id=kv_request_id, success=success, round_seq=round_key))
        self._maybe_prune(kv_request_id)

    # -- each tick --------------------------------------------------------------------------------

    def collect_results(self) -> list[StoreResult]:
        """Time limits, then the writes this peer's transport finished, then the results that
        ended in between. (The poll is scoped to the peer: one transport serves every
        session, and a poll consumes what it reports.)"""
        results = self._timeout_pending_store_jobs()
        polled = self._transport.poll(self._peer_id)
        if polled.peer_fault is not None:
            self.peer_fault = polled.peer_fault
        for tid in polled.done:
            if (xfer := self._pop_reported(tid, "done")) is not None:
                results += self._settle_xfer_jobs(xfer, success=not xfer.round.cancelled)
                self._on_write_done(xfer)
                self._maybe_prune(xfer.kv_request_id)
        for tid in polled.failed:
            if (xfer := self._pop_reported(tid, "failed")) is not None:
                rnd = xfer.round
                live = self._registered(xfer.kv_request_id, xfer.round_key, rnd)
                if live and not rnd.cancelled:  # one failed write fails the round; its others still run
                    rnd.cancelled = True
                    results += self._fail_unwritten_round_jobs(rnd)
                results += self._settle_xfer_jobs(xfer, success=False)
                if live and not rnd.inflight:
                    self._finalize_cancelled(xfer.kv_request_id, xfer.round_key)
                self._maybe_prune(xfer.kv_request_id)
        results += self._pending_store_results
        self._pending_store_results = []
        return results

    def _pop_reported(self, tid: int, what: str) -> _InflightXfer | None:
        xfer = self._inflight_pop(tid)
        if xfer is None:  # a transport or bookkeeping bug; the jobs fail by the store timeout
            logger.error("P2PSession %s: transport reported %s for unknown transfer_id=%d", self._peer_id, what, tid)
        return xfer

    def _on_write_done(self, xfer: _InflightXfer) -> None:
        rnd = xfer.round
        if not self._registered(xfer.kv_request_id, xfer.round_key, rnd):
            return
        rnd.remaining -= xfer.block_count
        assert rnd.remaining >= 0, f"remaining went negative for {xfer.kv_request_id}"
        if rnd.cancelled:
            if not rnd.inflight:
                self._finalize_cancelled(xfer.kv_request_id, xfer.round_key)
        elif rnd.remaining == 0:
            self._finalize_outbound(xfer.kv_request_id, xfer.round_key, success=True)
        elif rnd.finishing and not rnd.inflight:
            self._finalize_outbound(xfer.kv_request_id, xfer.round_key, success=False)

    def collect_idle_timeouts(self) -> list[StoreResult]:
        """The time limits alone (a session not yet connected has no writes to poll)."""
        return self._timeout_pending_store_jobs()

    def _timeout_pending_store_jobs(self) -> list[StoreResult]:
        """Fail store jobs older than ``_STORE_TIMEOUT_S``. A job still being written first
        cancels its round's writes and keeps its pin until they stop; rounds cancelled
        earlier whose writes did not stop are retried here too."""
        if not self._store_jobs:
            return []
        now = time.monotonic()
        expired = {j for j, t in self._store_jobs.items() if t <= now - _STORE_TIMEOUT_S}
        rounds = {(x.kv_request_id, x.round_key): x.round for x in self._inflight.values() if x.round.cancelled or expired & x.job_ids}
        results: list[StoreResult] = []
        for (kv_request_id, round_key), rnd in rounds.items():
            rnd.cancelled = True
            if not self._cancel_due(rnd, now):
                continue
            tids = [t for t, x in self._inflight.items() if x.round is rnd]
            still = set(self._transport.cancel(tids, mode="wait"))
            for tid in tids:
                if tid not in still and (xfer := self._inflight_pop(tid)) is not None:
                    results += self._settle_xfer_jobs(xfer, success=False)
            if not rnd.inflight and self._registered(kv_request_id, round_key, rnd):
                self._finalize_cancelled(kv_request_id, round_key)
        if not expired:
            return results
        timed_out = self._end_jobs(sorted(expired - self._read_job_ids()), False)
        for r in timed_out:
            logger.warning("P2PSession %s: store job %d timed out", self._peer_id, r.job_id)
        # A failed job's slots are unpinned: never offer them to a fetch again.
        for st in self._requests.values():
            for rnd in st.outbound.values():
                if rnd.pending_job_ids & expired:
                    rnd.pending_job_ids -= expired
                    rnd.available = {k: v for k, v in rnd.available.items() if v[0] not in expired}
        return results + timed_out

    def close(self) -> tuple[list[int], list[ReqContext]]:
        """Tear down: cancel every write. Returns the store jobs to fail and the synthetic
        lookup contexts that still owe ``parent.on_request_finished`` (the manager sends it
        in its next serve; there is no parent here)."""
        failed_stores = list(self._store_jobs)
        if self._inflight:
            self._transport.cancel(list(self._inflight))
        failed_serves = [lu.ctx for st in self._requests.values() for lu in st.lookups.values()]
        failed_serves += self._finished_lookup_ctxs
        self._store_jobs.clear()
        self._inflight.clear()
        self._pending_store_results.clear()
        self._requests.clear()
        self._serve_pending.clear()
        self._pending_aborts.clear()
        self._slow_aborts.clear()
        self._finished_lookup_ctxs = []
        return failed_stores, failed_serves
