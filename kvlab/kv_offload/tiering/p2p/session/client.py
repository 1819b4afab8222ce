"""The client half of a P2P session: asking one peer for blocks (vLLM 0.33: ``ClientRole`` in
``vllm/v1/kv_offload/tiering/p2p/session/client.py``).

The session owns the connection and decides when sending is allowed; this role keeps the
books and emits messages through the ``send`` it is given. Per request id it tracks:

* **Probes** (symmetric P2P only): ``register_lookup`` answers None until the peer said
  whether it holds a key, then True or False on every later call. New keys go out together,
  one ``lookup`` message per request per step (``flush_pending_lookups``), tagged with the
  request's current round.
* **Loads**: ``request_blocks`` sends the ``fetch`` that closes the round (and starts the
  next); the peer answers ``transfer_done``. A request may have several loads in flight, one
  per round, matched by round.
* **Time limits**: a load not done in ``_LOAD_TIMEOUT_S`` is aborted (``abort_fetch``); an
  abort not acknowledged in ``_ABORT_ACK_TIMEOUT_S`` fails the load anyway; probes with no
  new answer for ``_LOOKUP_TIMEOUT_S`` are reported by ``get_expired_lookup``, and the
  session gives up on the peer. So no load and no lookup waits on a silent peer forever.

After a fetch the round's probe answers are dropped: once served, both sides unpin the
blocks, so a cached True could claim a block the peer has since evicted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvlab.kv_offload.base import OffloadKey
from kvlab.kv_offload.tiering.p2p.session.protocol import AbortFetchMsg, FetchMsg, LookupMsg

logger = logging.getLogger(__name__)

_LOAD_TIMEOUT_S = 30.0
_ABORT_ACK_TIMEOUT_S = 10.0
_LOOKUP_TIMEOUT_S = 30.0


@dataclass
class _InboundLoadState:
    job_id: int
    submitted_at: float
    aborted_at: float | None = None


@dataclass
class _ClientRequestState:
    probes: dict[OffloadKey, bool | None] = field(default_factory=dict)  # None: asked, not answered
    unsent: list[OffloadKey] = field(default_factory=list)  # registered since the last flush
    round_seq: int = 0  # each fetch closes the round and starts the next
    probed: bool = False  # ran the lookup phase: a fetch may then name only confirmed keys
    peer_lookup_open: bool = False  # a lookup went out since the last fetch: finish owes an empty fetch
    loads: dict[int, _InboundLoadState] = field(default_factory=dict)  # by round

    def idle(self) -> bool:
        return not self.loads and not self.probes and not self.unsent


class LoadResult(NamedTuple):
    job_id: int
    kv_request_id: str
    success: bool


class ClientCloseResult(NamedTuple):
    """What a dead peer leaves undone: the jobs of loads in flight, and every request whose
    lookup would otherwise wait forever (those loads' requests and any with an unanswered probe)."""

    failed_jobs: list[int]
    failed_req_ids: list[str]


class ClientRole:
    """The books of the loads and probes one session sends to its peer."""

    def __init__(self, peer_id: str, send: Callable[[dict], None]) -> None:
        self._peer_id = peer_id
        self._send = send
        self._requests: dict[str, _ClientRequestState] = {}
        self._flush_pending: set[str] = set()  # requests with unsent probes
        self._active_loads: set[str] = set()  # requests with a load in flight or aborting
        self._completed_loads: list[LoadResult] = []
        self._lookup_deadlines: dict[str, float] = {}  # moved on only by a newly answered probe

    def _state(self, kv_request_id: str) -> _ClientRequestState:
        return self._requests.setdefault(kv_request_id, _ClientRequestState())

    def _maybe_prune(self, kv_request_id: str) -> None:
        st = self._requests.get(kv_request_id)
        if st is not None and st.idle():
            del self._requests[kv_request_id]

    def _load_ended(self, kv_request_id: str, st: _ClientRequestState, load: _InboundLoadState, success: bool) -> None:
        self._completed_loads.append(LoadResult(load.job_id, kv_request_id, success))
        if not st.loads:
            self._active_loads.discard(kv_request_id)
            self._maybe_prune(kv_request_id)

    def _abort(self, kv_request_id: str, round_seq: int, load: _InboundLoadState, now: float) -> None:
        load.aborted_at = now
        self._send(AbortFetchMsg.make(kv_request_id=kv_request_id, round_seq=round_seq))

    @property
    def has_active_loads(self) -> bool:
        return bool(self._active_loads)

    def get_expired_lookup(self) -> tuple[str, float] | None:
        """A request whose probes made no progress for ``_LOOKUP_TIMEOUT_S``, with the
        seconds since its last progress; None if there is none."""
        now = time.monotonic()
        for req_id, deadline in self._lookup_deadlines.items():
            if now >= deadline:
                return req_id, now - deadline + _LOOKUP_TIMEOUT_S
        return None

    # -- loads ------------------------------------------------------------------------------------

    def request_blocks(
        self, job_id: int, kv_request_id: str, keys: Sequence[OffloadKey], block_ids: Sequence[int], send_ready: bool
    ) -> None:
        """Send the fetch closing the request's current round: write ``keys`` into my blocks
        ``block_ids``. (``send_ready`` is the session's; the send waits for the handshake.)"""
        st = self._state(kv_request_id)
        round_seq = st.round_seq
        st.round_seq += 1
        st.loads[round_seq] = _InboundLoadState(job_id, time.monotonic())
        self._active_loads.add(kv_request_id)
        st.peer_lookup_open = False
        self._send(
            FetchMsg.make(kv_request_id=kv_request_id, keys=list(keys), block_indexes=[int(b) for b in block_ids], round_seq=round_seq)
        )
        if st.probed and keys:
            assert st.probes, f"symmetric fetch for {kv_request_id} has keys but no probes"
            assert all(st.probes.get(k) is True for k in keys), f"symmetric fetch for {kv_request_id} names a key the peer did not confirm"
        st.probes.clear()
        self._lookup_deadlines.pop(kv_request_id, None)

    def on_transfer_done(self, kv_request_id: str, success: bool, round_seq: int) -> None:
        st = self._requests.get(kv_request_id)
        load = st.loads.pop(round_seq, None) if st is not None else None
        if st is None or load is None:  # a duplicate, or it lost a race with our own abort or timeout
            logger.warning("P2PSession %s: transfer_done for unknown kv_request_id=%s round=%s", self._peer_id, kv_request_id, round_seq)
            return
        self._load_ended(kv_request_id, st, load, success)

    def on_abort_ack(self, kv_request_id: str, round_seq: int) -> None:
        st = self._requests.get(kv_request_id)
        load = st.loads.pop(round_seq, None) if st is not None else None
        if st is None or load is None:
            logger.warning("P2PSession %s: abort_ack for unknown kv_request_id=%s round=%s", self._peer_id, kv_request_id, round_seq)
            return
        logger.warning("P2PSession %s: load %s (job %d) failed after its abort", self._peer_id, kv_request_id, load.job_id)
        self._load_ended(kv_request_id, st, load, False)

    def finish(self, kv_request_id: str) -> None:
        """The request is over: abort its loads still running (their results come with the
        acknowledgements, or the abort timeout), send the empty fetch the peer waits for if a
        lookup of ours is still open there, and drop the probes."""
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        now = time.monotonic()
        for round_seq, load in st.loads.items():
            if load.aborted_at is None:
                self._abort(kv_request_id, round_seq, load, now)
        if st.peer_lookup_open:
            st.peer_lookup_open = False
            self._send(FetchMsg.make(kv_request_id=kv_request_id, keys=[], block_indexes=[], round_seq=st.round_seq))
        st.probes.clear()
        st.unsent.clear()
        self._lookup_deadlines.pop(kv_request_id, None)
        self._flush_pending.discard(kv_request_id)
        self._maybe_prune(kv_request_id)

    def collect_results(self) -> list[LoadResult]:
        """Apply the time limits, then hand over the loads that ended (each once)."""
        now = time.monotonic()
        expired: list[tuple[str, int]] = []
        for req_id in self._active_loads:
            for round_seq, load in self._requests[req_id].loads.items():
                if load.aborted_at is None:
                    if now - load.submitted_at >= _LOAD_TIMEOUT_S:
                        logger.warning("P2PSession %s: %s round=%s timed out, sending abort", self._peer_id, req_id, round_seq)
                        self._abort(req_id, round_seq, load, now)
                elif now - load.aborted_at >= _ABORT_ACK_TIMEOUT_S:
                    logger.warning("P2PSession %s: abort_ack timed out for kv_request_id=%s round=%s", self._peer_id, req_id, round_seq)
                    expired.append((req_id, round_seq))
        for req_id, round_seq in expired:
            st = self._requests[req_id]
            self._load_ended(req_id, st, st.loads.pop(round_seq), False)
        results, self._completed_loads = self._completed_loads, []
        return results

    # -- probes (symmetric P2P) -------------------------------------------------------------------

    def register_lookup(self, kv_request_id: str, key: bytes) -> bool | None:
        """Does the peer hold ``key``? None until it answered (the first call queues the
        probe); then its answer, on every call until a fetch closes the round."""
        st = self._state(kv_request_id)
        st.probed = True
        okey = OffloadKey(key)
        if okey in st.probes:
            return st.probes[okey]
        st.probes[okey] = None
        st.unsent.append(okey)
        self._flush_pending.add(kv_request_id)
        return None

    def flush_pending_lookups(self, send_ready: bool) -> None:
        """Send one lookup per request with new probes (once the handshake is done; the
        response deadline starts with the send)."""
        if not send_ready:
            return
        for req_id in self._flush_pending:
            st = self._requests.get(req_id)
            if st is None or not st.unsent:
                continue
            st.peer_lookup_open = True
            self._lookup_deadlines.setdefault(req_id, time.monotonic() + _LOOKUP_TIMEOUT_S)
            self._send(LookupMsg.make(kv_request_id=req_id, keys=list(st.unsent), round_seq=st.round_seq))
            st.unsent = []
        self._flush_pending.clear()

    def on_lookup_resp(self, kv_request_id: str, keys: Sequence[bytes], hits: Sequence[bool]) -> None:
        """Record the peer's answers (pairs for keys no longer asked are ignored)."""
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        progressed = False
        for raw, hit in zip(keys, hits):
            key = OffloadKey(raw)
            if key in st.probes:
                progressed |= st.probes[key] is None
                st.probes[key] = hit
        if all(hit is not None for hit in st.probes.values()):
            self._lookup_deadlines.pop(kv_request_id, None)
        elif progressed:
            self._lookup_deadlines[kv_request_id] = time.monotonic() + _LOOKUP_TIMEOUT_S

    def close(self) -> ClientCloseResult:
        """The peer is gone: report what it can no longer complete and forget everything."""
        failed_jobs = [load.job_id for st in self._requests.values() for load in st.loads.values()]
        failed_req_ids = [r for r, st in self._requests.items() if st.loads or any(h is None for h in st.probes.values())]
        self._requests.clear()
        self._flush_pending.clear()
        self._active_loads.clear()
        self._completed_loads.clear()
        self._lookup_deadlines.clear()
        return ClientCloseResult(failed_jobs, failed_req_ids)
