"""The P2P tier (vLLM 0.33: ``P2PSecondaryTierManager`` in ``vllm/v1/kv_offload/tiering/p2p/manager.py``).

Engines fetch KV blocks straight from each other's CPU tier. A request says whom it deals
with in ``kv_transfer_params``, under one of three keys:

* ``remote_prefiller`` (disaggregated serving, the decoder): ``kv_request_id``,
  ``remote_host``, ``remote_port``. The prefiller computed this prompt for us, so every
  lookup is a HIT at once and the load fetches the blocks from it.
* ``remote_kv_source`` (symmetric P2P, a consumer): the same fields, but the peer may hold
  only some blocks, so a lookup asks it first -- RETRY until the peer answers.
* ``remote_decoder`` (the prefiller): ``kv_request_id`` only. A store does not leave; it
  waits here until a decoder fetches that id.

One :class:`~kvlab.kv_offload.tiering.p2p.session.P2PSession` per peer plays both roles
(loading from the peer, serving it) over one control connection; blocks travel over the
data transport (NIXL writes). What the tier itself decides:

* **Stores wait for their fetch.** The prefiller does not know which decoder will ask, so a
  store is *parked* under its ``kv_request_id`` (its CPU chunks stay pinned) until a fetch
  for that id arrives on some session, which then serves it. A store nobody fetches within
  ``unbound_store_timeout_s`` fails; its id is remembered for a minute, so a fetch that
  comes later is refused at once rather than left to time out on the decoder.
* **A lost peer costs a recompute, never a hang.** When a session dies its loads fail and
  its requests are marked failed: their lookups answer MISS and the scheduler prefills
  locally. A peer whose data path failed is reconnected at once the first time, then after
  1, 2, 4 ... 60 s while it keeps failing.
* **Sessions are bounded** by ``VLLM_P2P_MAX_PEERS``; near that cap, sessions idle for
  ``VLLM_P2P_IDLE_TIMEOUT_S`` are closed to make room.

Every method runs under the tiering manager's lock, on the scheduler's thread or its
tier-poll thread (``tolerates_off_thread_polling``: a peer's fetch need not wait for the next
step). ``get_finished_jobs`` drives everything -- the control transport, each session, the
timeouts -- so ``has_pending_work`` stays True to keep the engine polling. Nothing waits on a
peer, except ``drain_jobs`` (bounded by ``drain_timeout_s``) and ``shutdown`` (3 s).

NIXL has CUDA wheels only; without it the tier refuses to start and says so. Tests, like
vLLM's, hand the manager transports of their own (``_control``, ``_data``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvlab.core.kv_cache_utils import get_none_hash_seed
from kvlab.kv_offload.base import LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestOffloadingContext, ScheduleEndContext
from kvlab.kv_offload.file_mapper import FileMapper
from kvlab.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from kvlab.kv_offload.tiering.p2p.control import ControlTransport, ZmqTransport
from kvlab.kv_offload.tiering.p2p.data import DataTransport, NixlTransport
from kvlab.kv_offload.tiering.p2p.session import P2PSession
from kvlab.kv_offload.tiering.p2p.session.protocol import DisconnectMsg
from kvlab.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from kvlab.kv_offload.tiering.base import ParentManager
    from kvlab.kv_offload.tiering.p2p.control import ControlConnection
    from kvlab.kv_offload.tiering.p2p.session import SessionPollResult

logger = logging.getLogger(__name__)

# A parked store fails after this long without a fetch (the decoder died, or lost the id);
# config key ``unbound_store_timeout_s``. Once a fetch binds it, the session's timeouts apply.
_UNBOUND_STORE_TIMEOUT_S = 60.0
# How long a reaped id is refused. Past the consumer's own load timeout (the client role's
# _LOAD_TIMEOUT_S) nobody waits on it any more.
_REAPED_ID_RETENTION_S = 60.0
# shutdown() lets running writes end this long, then drops them: a stuck peer must not hold it.
_SHUTDOWN_DRAIN_TIMEOUT_S = 3.0
_DRAIN_SLEEP_S = 0.001  # between polls of the drain loops: short, but no busy spin
_DRAIN_WARN_S = 5.0
# Idle sessions are closed only this close to the cap: a handshake is dear, keep them otherwise.
_IDLE_REAP_HEADROOM = 8
# Reconnect waits after data-plane faults: 0 for the first, then doubling from the min to the max
# while the faults come within the max of the previous wait's end (time alone decides).
_RECONNECT_MIN_BACKOFF_S = 1.0
_RECONNECT_MAX_BACKOFF_S = 60.0


def _env(name: str, default: str) -> str:
    """One of vLLM's ``VLLM_P2P_*`` settings. vLLM reads them through ``vllm.envs`` at each use;
    kvlab reads the same variables, at each use too."""
    return os.environ.get(name, default)


def _max_peers() -> int:
    return int(_env("VLLM_P2P_MAX_PEERS", "128"))


# -- who a request deals with ---------------------------------------------------------------


@dataclass(slots=True)
class P2PSourceInfo:
    """Consumer: this request loads ``kv_request_id`` from ``peer_id`` (``"host:port"``).
    ``do_probe``: ask the peer key by key first (``remote_kv_source``); the PD decoder does not
    (``remote_prefiller``): its prefiller computed the whole prompt for it."""

    kv_request_id: str
    peer_id: str
    do_probe: bool


@dataclass(slots=True)
class P2PDestInfo:
    """Producer: a peer will fetch this request's blocks as ``kv_request_id``. None when the
    ``remote_decoder`` block names no id: still a remote-decode request, so its stores must
    fail rather than succeed locally and leave the decoder waiting."""

    kv_request_id: str | None


def _peer_id_from_params(role_params: dict) -> str | None:
    """``"host:port"`` from a role's ``remote_host``/``remote_port``, or None if either is missing."""
    host, port = role_params.get("remote_host"), role_params.get("remote_port")
    return f"{host}:{port}" if host and port else None


def _parse_source(kv_params: dict | None) -> P2PSourceInfo | None:
    params = kv_params or {}
    do_probe = params.get("remote_prefiller") is None  # PD's key wins when both are there
    role = params.get("remote_kv_source" if do_probe else "remote_prefiller")
    if not isinstance(role, dict):
        return None
    peer_id, kv_request_id = _peer_id_from_params(role), role.get("kv_request_id")
    if peer_id is None or not kv_request_id:
        return None
    return P2PSourceInfo(kv_request_id=kv_request_id, peer_id=peer_id, do_probe=do_probe)


def _parse_dest(kv_params: dict | None) -> P2PDestInfo | None:
    role = (kv_params or {}).get("remote_decoder")
    if role is None:
        return None
    return P2PDestInfo(kv_request_id=(role.get("kv_request_id") if isinstance(role, dict) else None) or None)


def _annotate_req_context(req_context: ReqContext) -> None:
    """Read the request's routing once (``on_new_request``) and keep it on the context, where
    the later calls find it by type."""
    for info in (_parse_source(req_context.kv_transfer_params), _parse_dest(req_context.kv_transfer_params)):
        if info is not None:
            req_context.set_state(info)


@dataclass
class _UnboundStoreBatch:
    """One ``submit_store`` parked until a fetch names its ``kv_request_id``."""

    job_id: JobId
    keys: list[OffloadKey]
    block_ids: Sequence[int]
    submitted_at: float = field(default_factory=time.monotonic)


# -- the tier --------------------------------------------------------------------------------


class P2PSecondaryTierManager(SecondaryTierManager):
    """Peers' CPU tiers as a tier behind ours.

    Config keys (the ``secondary_tiers`` entry): ``host`` and ``port`` -- the control socket's
    address, also the id peers dial (default ``VLLM_P2P_SIDE_CHANNEL_HOST``/``_PORT``,
    ``localhost:5710``; data-parallel rank ``i`` listens at ``port + i``); ``backends`` and
    ``num_threads`` for NIXL's agent; ``unbound_store_timeout_s`` (see the module notes).
    Any other key is refused (TypeError), so a misspelt one is not silently ignored: vLLM's
    constructor swallows unknown keys (``**kwargs``), ``locality`` among them.
    """

    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P
    tolerates_off_thread_polling: ClassVar[bool] = True
    #: ``drain_jobs`` gives up after this long (vLLM waits forever; kvlab bounds every wait).
    drain_timeout_s: ClassVar[float] = 120.0

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "p2p",
        host: str | None = None,
        port: int | None = None,
        backends: list[str] | None = None,
        num_threads: int = 4,
        unbound_store_timeout_s: float = _UNBOUND_STORE_TIMEOUT_S,
        backpressure_detector: Any = None,
    ) -> None:
        if backpressure_detector is not None:
            # Dropping a PD store leaves the decoder waiting out its load timeout, and the
            # rendezvous with the decoder is part of every store's latency: the generic
            # detector would throttle on noise and fail slowly.
            raise ValueError(
                "Back-pressure is not supported for the P2P tier: its store latency includes waiting for the "
                "decoder's fetch, and a dropped store cannot fail fast. Remove 'backpressure' from the p2p tier's config."
            )
        try:
            timeout_s = float(unbound_store_timeout_s)
        except (TypeError, ValueError):
            timeout_s = float("nan")
        if not timeout_s > 0:  # NaN too
            raise ValueError(f"unbound_store_timeout_s must be a positive number of seconds, got {unbound_store_timeout_s!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self._unbound_store_timeout_s = timeout_s
        # NONE_HASH's seed, told to every peer: engines with different seeds hash the same
        # tokens differently, so the handshake refuses them. Read at the first session, not
        # here: the tier is built before init_none_hash picks the seed.
        self._hash_seed: str | None = None
        host = host if host is not None else _env("VLLM_P2P_SIDE_CHANNEL_HOST", "localhost")
        port = int(port if port is not None else _env("VLLM_P2P_SIDE_CHANNEL_PORT", "5710"))
        port += offloading_spec.config.parallel.data_parallel_index  # one socket per DP rank
        # The control id is the address peers dial, verbatim. NIXL's agent name only has to be
        # unique (it travels inside the handshake), and two engines may share host:port.
        self._local_id = f"{host}:{port}"
        self._nixl_agent_name = str(uuid.uuid4())
        mapper = FileMapper.from_offloading_spec(
            root_dir="", offloading_spec=offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True
        )
        self._data: DataTransport = NixlTransport(
            self._nixl_agent_name, primary_kv_view, config_fields=mapper.get_run_config(), backends=backends, num_threads=int(num_threads)
        )
        if getattr(self._data, "available", True) is False:
            self._data.close()
            raise RuntimeError(
                "the P2P tier writes blocks into peers' memory with NIXL, and NIXL is not installed "
                "(its wheels need CUDA: pip install nixl); kvlab's engine can use the 'fs' tier instead"
            )
        try:
            self._control: ControlTransport = ZmqTransport(self._local_id, host, port)
        except BaseException:  # the port is taken, say: let go of NIXL's registration too
            self._data.close()
            raise

        self._sessions: dict[str, P2PSession] = {}
        self._reconnect_backoff: dict[str, tuple[float, float]] = {}  # peer -> (wait, retry_at)
        self._data_plane_faults: dict[str, int] = {}  # peer -> faults ever (for the log)
        self._kv_to_session: dict[str, P2PSession] = {}  # ids a fetch has bound to a session
        self._unbound_stores: dict[str, list[_UnboundStoreBatch]] = {}  # parked, oldest first
        self._reaped_stores: dict[str, float] = {}  # id -> when its parked stores were failed
        self._finished_jobs: list[JobResult] = []
        self._failed_req_ids: set[str] = set()  # consumer ids whose lookups must now MISS
        # Lookups a dead session served for its peer: the parent must be told they finished,
        # which can only happen inside the next serve_external_requests.
        self._failed_serve_ctxs: list[ReqContext] = []

    # -- scheduler-facing calls -----------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        source = req_context.get_state(P2PSourceInfo)
        if source is None or source.kv_request_id in self._failed_req_ids:
            return LookupResult.MISS
        if not source.do_probe:
            return LookupResult.HIT
        session = self._sessions.get(source.peer_id)
        if session is None:
            return LookupResult.MISS
        # The first ask registers the key (it goes out in on_schedule_end); the answer comes later.
        found = session.register_lookup(source.kv_request_id, key)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Read the routing; a consumer opens its session to the producer now, so the handshake
        is under way by the time the load is submitted. A producer wants every block of the
        request (REQUEST_LEVEL): the decoder fetches the whole prompt, prefix hits included."""
        _annotate_req_context(req_context)
        source = req_context.get_state(P2PSourceInfo)
        if source is not None and self._get_or_create_session(source.peer_id) is None:
            self._failed_req_ids.add(source.kv_request_id)
        dest = req_context.get_state(P2PDestInfo)
        if dest is not None and dest.kv_request_id:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """End the request's business with its peer. A producer's parked stores stay: a PD
        prefill finishes before its decoder fetches, so only the timeout may drop them."""
        source = req_context.get_state(P2PSourceInfo)
        if source is not None:  # the consumer knows its producer's address
            self._failed_req_ids.discard(source.kv_request_id)
            session = self._sessions.get(source.peer_id)
            if session is not None:
                session.finish_request(source.kv_request_id)
            return
        dest = req_context.get_state(P2PDestInfo)
        if dest is not None and dest.kv_request_id:  # the producer knows only the fetch's session
            self._failed_req_ids.discard(dest.kv_request_id)
            session = self._kv_to_session.pop(dest.kv_request_id, None)
            if session is not None:
                session.finish_request(dest.kv_request_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        dest = job_metadata.req_context.get_state(P2PDestInfo)
        if dest is None:  # nobody will fetch it: done, nothing kept
            self._finish(job_id, True)
            return
        kv_request_id = dest.kv_request_id
        if not kv_request_id or kv_request_id in self._reaped_stores:
            # No id: no fetch can ever name it. Reaped: its consumer gave up, and parking
            # would pin the chunks for another full timeout.
            logger.warning("P2P %s: store job %d refused (kv_request_id %r missing or expired)", self._local_id, job_id, kv_request_id)
            self._finish(job_id, False)
            return
        keys, block_ids = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        assert len(keys) == len(block_ids), f"job {job_id}: {len(keys)} keys for {len(block_ids)} chunks"
        session = self._kv_to_session.get(kv_request_id)
        if session is not None:
            session.add_stored_blocks(kv_request_id, keys, block_ids, job_id)
        else:
            self._unbound_stores.setdefault(kv_request_id, []).append(_UnboundStoreBatch(job_id=job_id, keys=keys, block_ids=block_ids))

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        source = job_metadata.req_context.get_state(P2PSourceInfo)
        if source is None:
            self._finish(job_id, False)
            return
        keys = list(job_metadata.keys)
        if not keys:
            self._finish(job_id, True)
            return
        session = self._sessions.get(source.peer_id)
        if session is None:
            logger.warning("P2P %s: load job %d has no session to %s", self._local_id, job_id, source.peer_id)
            self._finish(job_id, False)
            self._failed_req_ids.add(source.kv_request_id)
            return
        session.request_blocks(job_id, source.kv_request_id, keys, [int(c) for c in job_metadata.chunk_ids])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._poll_once()
        results, self._finished_jobs = self._finished_jobs, []
        return results

    def has_pending_work(self) -> bool:
        """Always: peers arrive and ask whether or not this engine has requests, and only
        polling (``get_finished_jobs``) hears them."""
        return True

    def drain_jobs(self) -> None:
        """Poll until no session has a load, a write or a peer registration outstanding
        (results wait for the next ``get_finished_jobs``); nothing is cancelled. After
        ``drain_timeout_s`` raise TimeoutError naming the busy peers: a stuck transfer must not
        hang a cache reset."""
        start = time.monotonic()
        warned = False
        while True:
            self._poll_once()
            busy = [pid for pid, s in self._sessions.items() if s.has_pending_work]
            if not busy:
                return
            waited = time.monotonic() - start
            if waited > self.drain_timeout_s:
                raise TimeoutError(f"P2P {self._local_id}: transfers with {busy} still running after {waited:.0f} s")
            if not warned and waited > _DRAIN_WARN_S:
                logger.warning("P2P %s: still draining after %.0fs; transfers with %s have not ended", self._local_id, _DRAIN_WARN_S, busy)
                warned = True
            time.sleep(_DRAIN_SLEEP_S)

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer peers' lookups against this engine's tiers (``parent`` is valid during this
        call only), after releasing the lookups of sessions that died since the last call."""
        failed, self._failed_serve_ctxs = self._failed_serve_ctxs, []
        for ctx in failed:
            parent.on_request_finished(ctx)
        for session in self._sessions.values():
            session.serve_external_requests(parent)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send the step's new lookups: one message per peer and request, not one per key."""
        for session in self._sessions.values():
            session.flush_pending_lookups()

    def shutdown(self) -> None:
        """Let running writes end (3 s at most), close every session, fail the parked stores,
        close both transports. What the sessions owed is dropped: nobody polls a closed tier."""
        self._drain_inflight_for_shutdown()
        try:
            for session in self._sessions.values():
                try:
                    session.close()
                except Exception:
                    logger.warning("P2P %s: closing the session to %s failed", self._local_id, session.peer_id, exc_info=True)
            self._sessions.clear()
            self._kv_to_session.clear()
            for batches in self._unbound_stores.values():
                self._fail_batches(batches)
            self._unbound_stores.clear()
            self._reaped_stores.clear()
        finally:
            try:
                self._control.close()
            finally:
                self._data.close()

    # -- sessions -------------------------------------------------------------------------

    def _get_hash_seed(self) -> str:
        if self._hash_seed is None:
            seed = get_none_hash_seed()
            if seed is None:
                raise ValueError(
                    "NONE_HASH has a random root (init_none_hash(random_root=True)), so no peer can share this "
                    "engine's block hashes; set PYTHONHASHSEED to the same value on every engine"
                )
            self._hash_seed = seed
        return self._hash_seed

    def _new_session(self, peer_id: str, conn: ControlConnection) -> P2PSession:
        return P2PSession(
            peer_id=peer_id,
            local_id=self._local_id,
            transport=self._data,
            local_block_len=self._data.block_len,
            local_hash_seed=self._get_hash_seed(),
            conn=conn,
        )

    def _full(self, direction: str, peer_id: str) -> bool:
        max_peers = _max_peers()
        if len(self._sessions) < max_peers:
            return False
        logger.warning(
            "P2P %s: %s peer %s refused: %d sessions open (VLLM_P2P_MAX_PEERS=%d)",
            self._local_id,
            direction,
            peer_id,
            len(self._sessions),
            max_peers,
        )
        return True

    def _get_or_create_session(self, peer_id: str) -> P2PSession | None:
        """The session to ``peer_id``, opened now if there is none; None if it cannot be (at the
        cap, in reconnect backoff, or the connection failed)."""
        session = self._sessions.get(peer_id)
        if session is not None:
            return session
        if self._reconnect_wait(peer_id) > 0 or self._full("outbound", peer_id):
            return None
        conn = None
        try:
            conn = self._control.connect(peer_id)
            session = self._new_session(peer_id, conn)
        except Exception:
            logger.warning("P2P %s: could not open a session to %s", self._local_id, peer_id, exc_info=True)
            if conn is not None:
                conn.close()
            return None
        self._sessions[peer_id] = session
        return session

    def _accept_new_peers(self, new_connections: Sequence[ControlConnection]) -> None:
        """A session for each peer that connected to us, unless refused: at the cap, in
        reconnect backoff (told so, so its lookups give up now rather than at its handshake
        deadline), or already connected (the session we have stays)."""
        for conn in new_connections:
            peer_id = conn.peer_id
            if self._full("inbound", peer_id):
                conn.close()
                continue
            if self._reconnect_wait(peer_id) > 0:
                logger.info("P2P %s: peer %s refused during its reconnect backoff", self._local_id, peer_id)
                with contextlib.suppress(Exception):
                    conn.send(DisconnectMsg.make())
                conn.close()
                continue
            try:
                if peer_id in self._sessions:
                    raise ValueError("it is already connected")
                self._sessions[peer_id] = self._new_session(peer_id, conn)
            except Exception as exc:
                logger.error("P2P %s: peer %s refused: %s", self._local_id, peer_id, exc)
                conn.close()

    def _retire(self, peer_id: str) -> P2PSession:
        """Close ``peer_id``'s session and settle what it leaves: its jobs fail, its consumer
        requests fall back to local prefill, its ids unbind (later stores for them park again
        and time out unless another session fetches them), and its served lookups wait for
        the next ``serve_external_requests`` to be released."""
        session = self._sessions.pop(peer_id)
        for kv_request_id in [k for k, s in self._kv_to_session.items() if s is session]:
            del self._kv_to_session[kv_request_id]
        closed = session.close()
        for job_id in (*closed.failed_jobs, *closed.failed_stores):
            self._finish(job_id, False)
        self._failed_req_ids.update(closed.failed_req_ids)
        self._failed_serve_ctxs.extend(closed.failed_serves)
        self._data.remove_remote_peer(peer_id)
        return session

    def _reap_dead_sessions(self) -> None:
        for peer_id in [pid for pid, s in self._sessions.items() if s.connected and not s.alive]:
            session = self._retire(peer_id)
            note = ""
            if session.data_plane_fault is not None:
                faults = self._data_plane_faults[peer_id] = self._data_plane_faults.get(peer_id, 0) + 1
                note = f"; data-plane fault #{faults}"
                wait = self._schedule_reconnect_backoff(peer_id)
                if wait:
                    note += f"; reconnect backoff {wait:.0f}s"
            logger.warning("P2P %s: peer %s is gone (%s)%s", self._local_id, peer_id, session.death_reason, note)

    def _schedule_reconnect_backoff(self, peer_id: str) -> float:
        """Record a data-plane fault of ``peer_id`` and return how long it may not reconnect:
        0 the first time, else twice the previous wait (1 s at least, 60 s at most) -- unless
        that wait ended over 60 s ago, which starts the peer over at 0."""
        now = time.monotonic()
        for pid in [p for p, (_, retry_at) in self._reconnect_backoff.items() if now - retry_at > _RECONNECT_MAX_BACKOFF_S]:
            del self._reconnect_backoff[pid]
        previous = self._reconnect_backoff.get(peer_id)
        wait = 0.0 if previous is None else min(max(2 * previous[0], _RECONNECT_MIN_BACKOFF_S), _RECONNECT_MAX_BACKOFF_S)
        self._reconnect_backoff[peer_id] = (wait, now + wait)
        return wait

    def _reconnect_wait(self, peer_id: str) -> float:
        """Seconds before ``peer_id`` may connect again (<= 0: now)."""
        entry = self._reconnect_backoff.get(peer_id)
        return 0.0 if entry is None else entry[1] - time.monotonic()

    def _reap_unbound_stores(self) -> None:
        """Fail the parked stores whose oldest batch waited ``_unbound_store_timeout_s`` for a
        fetch, and remember their ids (see ``_bind``); forget ids reaped over a minute ago."""
        now = time.monotonic()
        for kv_request_id in [k for k, at in self._reaped_stores.items() if at <= now - _REAPED_ID_RETENTION_S]:
            del self._reaped_stores[kv_request_id]
        deadline = now - self._unbound_store_timeout_s
        for kv_request_id in [k for k, batches in self._unbound_stores.items() if batches and batches[0].submitted_at <= deadline]:
            batches = self._unbound_stores.pop(kv_request_id)
            self._reaped_stores[kv_request_id] = now
            self._fail_batches(batches)
            logger.warning(
                "P2P %s: nobody fetched kv_request_id=%s within %g s; %d store job(s) failed",
                self._local_id,
                kv_request_id,
                self._unbound_store_timeout_s,
                len(batches),
            )

    def _reap_idle_sessions(self) -> None:
        """Near the session cap, close sessions with nothing in flight and no message for
        ``VLLM_P2P_IDLE_TIMEOUT_S`` (0: never): room for new peers. Below it, keep them."""
        idle_timeout = int(_env("VLLM_P2P_IDLE_TIMEOUT_S", "300"))
        if idle_timeout <= 0:
            return
        max_peers = _max_peers()
        if len(self._sessions) < max_peers - min(_IDLE_REAP_HEADROOM, max(0, max_peers - 1)):
            return
        deadline = time.monotonic() - idle_timeout
        for peer_id in [p for p, s in self._sessions.items() if not s.has_pending_work and s.last_activity_at <= deadline]:
            self._retire(peer_id)
            logger.info("P2P %s: closed the session to %s, idle over %d s", self._local_id, peer_id, idle_timeout)

    # -- polling ----------------------------------------------------------------------------

    def _poll_once(self) -> None:
        """One round: accept new peers, poll every session and take its results, then apply
        the reaps (dead sessions, expired parked stores, idle sessions)."""
        self._accept_new_peers(self._control.poll())
        for session in self._sessions.values():
            self._collect(session, session.poll())
        self._reap_dead_sessions()
        self._reap_unbound_stores()
        self._reap_idle_sessions()

    def _collect(self, session: P2PSession, result: SessionPollResult) -> None:
        for load in result.loads:
            self._finish(load.job_id, load.success)
            if not load.success:  # its lookups now MISS: the scheduler prefills locally
                self._failed_req_ids.add(load.kv_request_id)
        for store in result.stores:
            self._finish(store.job_id, store.success)
        for kv_request_id in result.new_fetch_ids:
            self._bind(session, kv_request_id)

    def _bind(self, session: P2PSession, kv_request_id: str) -> None:
        """A fetch for ``kv_request_id`` reached ``session``: hand it the parked stores (the
        session matches them against the fetch and starts the writes), and send there every
        later store of the id. A reaped id cannot be served: finishing it at once answers the
        fetch with a failure, and the id stays unbound so later stores keep being refused (none
        is parked under it: the reaper failed those, and ``submit_store`` refuses new ones)."""
        if kv_request_id in self._reaped_stores:
            session.finish_request(kv_request_id)
            return
        self._kv_to_session[kv_request_id] = session
        for batch in self._unbound_stores.pop(kv_request_id, []):
            session.add_stored_blocks(kv_request_id, batch.keys, batch.block_ids, batch.job_id)

    def _drain_inflight_for_shutdown(self) -> None:
        """Give the running writes up to 3 s to end: a wait-mode cancel releases only writes
        that stopped (one released while running may still land, in a peer that reused the
        block). Then release the rest regardless: a stuck peer must not hold the exit."""
        still = [tid for s in self._sessions.values() for tid in s._server._inflight]
        if not still:
            return
        deadline = time.monotonic() + _SHUTDOWN_DRAIN_TIMEOUT_S
        while still and time.monotonic() < deadline:
            still = list(self._data.cancel(still, mode="wait"))
            if still:
                self._data.poll()  # moves the transfers' states on
                time.sleep(_DRAIN_SLEEP_S)
        if still:
            logger.warning("P2P %s: %d writes still running after %.0f s; dropped", self._local_id, len(still), _SHUTDOWN_DRAIN_TIMEOUT_S)
            self._data.cancel(still, mode="immediate")

    # -- results ----------------------------------------------------------------------------

    def _finish(self, job_id: JobId, success: bool) -> None:
        self._finished_jobs.append(JobResult(job_id=job_id, success=success))

    def _fail_batches(self, batches: Iterable[_UnboundStoreBatch]) -> None:
        for batch in batches:
            self._finish(batch.job_id, False)
