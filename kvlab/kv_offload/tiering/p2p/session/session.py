"""One session per peer, both ways on one connection (vLLM 0.33: ``P2PSession`` in
``vllm/v1/kv_offload/tiering/p2p/session/session.py``).

A session is a thin coordinator: it owns the control connection, the handshake and the
gate on sending, and hands each checked message to the role it is for -- the client role
(:mod:`.client`: my loads from the peer) or the server role (:mod:`.server`: the peer's
loads from me).

**Handshake.** Each side sends ``connect`` (its data-transport metadata) as soon as it has
a connection. A peer's ``connect`` starts registering the peer's region off this thread;
``connect_ack`` goes out only once that registration landed, and our own messages are
queued until the peer's ``connect_ack`` arrives. So whoever may send to us is a peer we
have registered, and no write can target an unregistered region.

**Giving up on a peer.** Every wait is bounded: a handshake past
``VLLM_P2P_HANDSHAKE_TIMEOUT_S``, a malformed message (one is enough), five internal errors
in a row, a failed send, a lookup the peer leaves unanswered, or a data-plane fault reported
by the transport (after in-flight writes drain, for at most ``_PEER_FAULT_DRAIN_S``) all
mark the connection dead with a reason; the manager reaps the session and ``close`` reports
the work to fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

from kvlab.kv_offload.base import OffloadKey
from kvlab.kv_offload.tiering.p2p.session.client import ClientRole, LoadResult
from kvlab.kv_offload.tiering.p2p.session.protocol import (
    TYPE_KEY,
    AbortAckMsg,
    AbortFetchMsg,
    ConnectAckMsg,
    ConnectMsg,
    DisconnectMsg,
    FetchMsg,
    LookupMsg,
    LookupRespMsg,
    TransferDoneMsg,
)
from kvlab.kv_offload.tiering.p2p.session.server import ServerRole, StoreResult

if TYPE_CHECKING:
    from kvlab.kv_offload.base import ReqContext
    from kvlab.kv_offload.tiering.base import JobId, ParentManager
    from kvlab.kv_offload.tiering.p2p.control.base import ControlConnection
    from kvlab.kv_offload.tiering.p2p.data.base import DataTransport

__all__ = ["LoadResult", "P2PSession", "SessionCloseResult", "SessionPollResult", "StoreResult"]

logger = logging.getLogger(__name__)

# Internal errors in a row before the session gives up (a protocol violation needs one).
_MAX_CONSECUTIVE_DISPATCH_ERRORS = 5
# How long a data-plane fault waits for in-flight writes before disconnecting.
_PEER_FAULT_DRAIN_S = 10.0


def _handshake_timeout_s() -> int:
    """vLLM's ``envs.VLLM_P2P_HANDSHAKE_TIMEOUT_S`` (read each time, as vLLM's envs are).
    It covers the peer registering our region before it acks, hence the generous 30 s."""
    return int(os.environ.get("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "30"))


def _keys(raw: Sequence) -> list[OffloadKey]:
    """A message's keys. Only bytes-like ones: ``bytes(n)`` of a peer's int would allocate
    ``n`` bytes, and a str would fail as an internal error; either is the peer's malformed
    message (ValueError), not ours."""
    keys = []
    for k in raw:
        if not isinstance(k, (bytes, bytearray, memoryview)):
            raise ValueError(f"keys: expected bytes, got {type(k).__name__}")
        keys.append(OffloadKey(k if isinstance(k, bytes) else bytes(k)))
    return keys


class SessionPollResult(NamedTuple):
    """One tick: loads and stores that ended, and the requests whose fetch arrived (the
    manager binds them to this session and replays stores it parked -- reported, not called
    back, so calls only go down)."""

    loads: list[LoadResult]
    stores: list[StoreResult]
    new_fetch_ids: list[str]


class SessionCloseResult(NamedTuple):
    """What the manager must fail when a session goes."""

    failed_jobs: list[int]  # client load jobs
    failed_req_ids: list[str]  # client requests: loads in flight or probes unanswered
    failed_stores: list[int]  # server store jobs
    failed_serves: list[ReqContext]  # peer lookups the parent still owes on_request_finished


class P2PSession:
    """Client and server roles toward one peer. Made without ``conn`` it is *pending*: it
    takes supply (a prefiller's stores before the decoder connects) but sends nothing until
    ``attach_connection``."""

    def __init__(
        self,
        peer_id: str,
        local_id: str,
        transport: DataTransport,
        local_block_len: int,
        local_hash_seed: str,
        conn: ControlConnection | None = None,
    ) -> None:
        self.peer_id = peer_id
        self._local_id = local_id
        self._transport = transport
        self._local_block_len = local_block_len
        self._local_hash_seed = local_hash_seed
        self._conn: ControlConnection | None = None
        self._send_ready = False  # the peer acked our connect
        self._queued: list[dict] = []  # sent before that
        self._dispatch_error_count = 0
        self._death_reason: str | None = None
        self._peer_fault_at: float | None = None
        self._connected_at: float | None = None
        self._last_activity_at = time.monotonic()
        self._new_fetch_ids: list[str] = []
        self._pending_registration: Future[None] | None = None  # the peer's region, registering
        self._client = ClientRole(peer_id=peer_id, send=self._send)
        self._server = ServerRole(peer_id=peer_id, transport=transport, send=self._send)
        if conn is not None:
            self.attach_connection(conn)

    # -- state ------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """A pending session is alive; only a dead connection is not."""
        return self._conn is None or self._conn.alive

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def ready(self) -> bool:
        return self._send_ready

    @property
    def has_pending_work(self) -> bool:
        return self._pending_registration is not None or self._client.has_active_loads or self._server.has_inflight_transfers

    @property
    def death_reason(self) -> str:
        """The first recorded cause; a connection the transport killed itself has none."""
        return self._death_reason or "control connection lost"

    @property
    def data_plane_fault(self) -> str | None:
        return self._server.peer_fault

    @property
    def last_activity_at(self) -> float:
        return self._last_activity_at

    def attach_connection(self, conn: ControlConnection) -> None:
        """Connect a pending session and announce ourselves (both sides do: whichever gets a
        connection first can register the other)."""
        if self._conn is not None:
            raise ValueError(f"P2PSession {self.peer_id}: already connected")
        self._conn = conn
        self._connected_at = self._last_activity_at = time.monotonic()
        conn.send(
            ConnectMsg.make(
                peer_id=self._local_id,
                agent_metadata=self._transport.get_agent_metadata(),
                base_addr=self._transport.base_addr,
                num_blocks=self._transport.num_blocks,
                block_len=self._transport.block_len,
                config_fingerprint=self._transport.config_fingerprint,
                hash_seed=self._local_hash_seed,
            )
        )

    # -- the manager's calls ----------------------------------------------------------------------

    def request_blocks(self, job_id: JobId, kv_request_id: str, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        self._client.request_blocks(job_id, kv_request_id, keys, block_ids, send_ready=self._send_ready)

    def add_stored_blocks(self, kv_request_id: str, keys: Sequence[OffloadKey], block_ids: Sequence[int], job_id: JobId) -> None:
        self._server.add_stored_blocks(kv_request_id, keys, block_ids, job_id)

    def finish_request(self, kv_request_id: str) -> None:
        """The request is over here: both roles let go of it."""
        self._client.finish(kv_request_id)
        self._server.finish(kv_request_id)

    def register_lookup(self, kv_request_id: str, key: bytes) -> bool | None:
        return self._client.register_lookup(kv_request_id, key)

    def flush_pending_lookups(self) -> None:
        self._client.flush_pending_lookups(send_ready=self._send_ready)

    def serve_external_requests(self, parent: ParentManager) -> None:
        self._server.serve_external_requests(parent)

    def poll(self) -> SessionPollResult:
        """One tick: read, finish the handshake, apply every deadline, collect results."""
        if self._conn is None:
            return SessionPollResult([], self._server.collect_idle_timeouts(), [])
        # Read first: an ack already waiting must count before the handshake deadline does.
        messages = self._conn.recv()
        if messages:
            self._last_activity_at = time.monotonic()
        for msg in messages:
            self._on_message(msg)
        self._poll_registration()
        if not self._send_ready and self._conn.alive and self._connected_at is not None:
            timeout = _handshake_timeout_s()
            if time.monotonic() - self._connected_at > timeout:
                logger.warning("P2PSession %s: handshake timed out after %ds", self.peer_id, timeout)
                self._mark_dead("handshake timed out")
        loads = self._client.collect_results()
        stores = self._server.collect_results()
        self._server.drain_pending_aborts()
        self._escalate_peer_fault()
        expired = self._client.get_expired_lookup()  # after draining replies: they may have come
        if expired is not None:
            logger.warning("P2PSession %s: no lookup answer for %s in %.1fs", self.peer_id, expired[0], expired[1])
            self._disconnect("lookup response timed out")
        new_fetch_ids, self._new_fetch_ids = self._new_fetch_ids, []
        return SessionPollResult(loads, stores, new_fetch_ids)

    def close(self) -> SessionCloseResult:
        """Shut down; report what the manager must fail. A registration still running is
        abandoned (the manager's ``remove_remote_peer`` makes its worker discard it)."""
        if self._pending_registration is not None:
            self._pending_registration.cancel()
            self._pending_registration = None
        client = self._client.close()
        failed_stores, failed_serves = self._server.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send(DisconnectMsg.make())
            self._conn.close()
            self._conn = None
        return SessionCloseResult(client.failed_jobs, client.failed_req_ids, failed_stores, failed_serves)

    # -- dispatch ---------------------------------------------------------------------------------

    def _on_message(self, msg: dict) -> None:
        """A malformed message (ValueError) ends the session at once; other errors are
        probably ours, so only a run of them does."""
        msg_type = msg.get(TYPE_KEY) if isinstance(msg, dict) else msg
        try:
            self._dispatch_message(msg)
        except ValueError as exc:
            self._protocol_error(f"malformed {msg_type!r}: {exc}")
            return
        except Exception:
            self._dispatch_error_count += 1
            logger.exception("P2PSession %s: error handling %r (%d in a row)", self.peer_id, msg_type, self._dispatch_error_count)
            if self._dispatch_error_count >= _MAX_CONSECUTIVE_DISPATCH_ERRORS:
                self._protocol_error(f"too many consecutive dispatch errors ({self._dispatch_error_count})")
            return
        self._dispatch_error_count = 0

    def _dispatch_message(self, msg: dict) -> None:
        if self._conn is not None and not self._conn.alive:
            return  # read in the same batch as a disconnect: the session is over
        kind = msg.get(TYPE_KEY) if isinstance(msg, dict) else None
        if kind == ConnectMsg.TYPE:
            self._on_connect(msg)
        elif kind == ConnectAckMsg.TYPE:
            ConnectAckMsg.validate(msg)
            self._on_connect_ack()
        elif kind == FetchMsg.TYPE:
            FetchMsg.validate(msg)
            req_id = msg[FetchMsg.KV_REQUEST_ID]
            self._server.on_fetch(req_id, _keys(msg[FetchMsg.KEYS]), msg[FetchMsg.BLOCK_INDEXES], msg[FetchMsg.ROUND_SEQ])
            self._new_fetch_ids.append(req_id)
        elif kind == AbortFetchMsg.TYPE:
            AbortFetchMsg.validate(msg)
            self._server.on_abort_fetch(msg[AbortFetchMsg.KV_REQUEST_ID], msg[AbortFetchMsg.ROUND_SEQ])
        elif kind == TransferDoneMsg.TYPE:
            TransferDoneMsg.validate(msg)
            m = TransferDoneMsg
            self._client.on_transfer_done(msg[m.KV_REQUEST_ID], msg[m.SUCCESS], msg[m.ROUND_SEQ])
        elif kind == AbortAckMsg.TYPE:
            AbortAckMsg.validate(msg)
            self._client.on_abort_ack(msg[AbortAckMsg.KV_REQUEST_ID], msg[AbortAckMsg.ROUND_SEQ])
        elif kind == LookupMsg.TYPE:
            LookupMsg.validate(msg)
            self._server.on_lookup(msg[LookupMsg.KV_REQUEST_ID], _keys(msg[LookupMsg.KEYS]), msg[LookupMsg.ROUND_SEQ])
        elif kind == LookupRespMsg.TYPE:
            LookupRespMsg.validate(msg)
            m2 = LookupRespMsg
            self._client.on_lookup_resp(msg[m2.KV_REQUEST_ID], _keys(msg[m2.KEYS]), msg[m2.HITS])
        elif kind == DisconnectMsg.TYPE:
            self._mark_dead("peer disconnected")
        else:  # a newer peer's kind: ignore, don't fight
            logger.warning("P2PSession %s: unknown message type %r", self.peer_id, kind)

    # -- handshake --------------------------------------------------------------------------------

    def _on_connect(self, msg: dict) -> None:
        """Check the peer is compatible, then start registering it. A second connect would
        re-register a live peer: a protocol error. An incompatible one is rejected."""
        if self._send_ready or self._pending_registration is not None:
            self._protocol_error("duplicate connect after handshake")
            return
        try:
            ConnectMsg.validate(msg)
            self._check_compatible(msg)
            self._pending_registration = self._transport.add_remote_peer_async(
                self.peer_id,
                agent_metadata=msg[ConnectMsg.AGENT_METADATA],
                base_addr=msg[ConnectMsg.BASE_ADDR],
                num_blocks=msg[ConnectMsg.NUM_BLOCKS],
                block_len=msg[ConnectMsg.BLOCK_LEN],
            )
        except ValueError as exc:
            logger.error("P2PSession %s: rejecting peer connect: %s", self.peer_id, exc)
            self._mark_dead(f"rejected peer connect: {exc}")

    def _check_compatible(self, msg: dict) -> None:
        """Peers that differ in block size, model layout or hash seed would swap wrong bytes."""
        if msg[ConnectMsg.BLOCK_LEN] != self._local_block_len:
            raise ValueError(f"block_len mismatch from {self.peer_id}: remote={msg[ConnectMsg.BLOCK_LEN]}, local={self._local_block_len}")
        remote_fp, local_fp = msg.get(ConnectMsg.CONFIG_FINGERPRINT, ""), self._transport.config_fingerprint
        if local_fp and remote_fp and remote_fp != local_fp:
            raise ValueError(f"config fingerprint mismatch from {self.peer_id}: remote={remote_fp!r}, local={local_fp!r}")
        if msg[ConnectMsg.HASH_SEED] != self._local_hash_seed:
            raise ValueError(
                f"hash seed mismatch from {self.peer_id}: remote={msg[ConnectMsg.HASH_SEED]!r}, "
                f"local={self._local_hash_seed!r} (PYTHONHASHSEED must match on all peers)"
            )

    def _poll_registration(self) -> None:
        """Ack the peer once its registration landed (the ack lets it send); reject it if
        registration failed."""
        reg = self._pending_registration
        if reg is None or not reg.done():
            return
        self._pending_registration = None
        try:
            reg.result()
        except Exception as exc:
            logger.error("P2PSession %s: peer registration failed: %s", self.peer_id, exc)
            self._mark_dead(f"peer registration failed: {exc}")
            return
        if self._conn is not None and self._conn.alive:
            self._do_send(ConnectAckMsg.make(peer_id=self._local_id))

    def _on_connect_ack(self) -> None:
        self._send_ready = True
        queued, self._queued = self._queued, []
        for msg in queued:
            self._do_send(msg)

    # -- sending and dying ------------------------------------------------------------------------

    def _send(self, msg: dict) -> None:
        """The roles' send: held until the peer acked our connect."""
        if self._conn is None or not self._send_ready:
            self._queued.append(msg)
        else:
            self._do_send(msg)

    def _do_send(self, msg: dict) -> None:
        """A failed send means a broken connection: mark it dead, or the loads and lookups
        waiting on this peer would never be failed."""
        if self._conn is None:
            return
        try:
            self._conn.send(msg)
        except Exception:
            logger.warning("P2PSession %s: send of %s failed", self.peer_id, msg.get(TYPE_KEY))
            self._mark_dead(f"send of {msg.get(TYPE_KEY)} failed")
            return
        self._last_activity_at = time.monotonic()

    def _protocol_error(self, reason: str) -> None:
        logger.error("P2PSession %s: protocol error: %s", self.peer_id, reason)
        self._disconnect(f"protocol error: {reason}")

    def _escalate_peer_fault(self) -> None:
        """A data-plane fault ends the session like a control-plane one, once in-flight
        writes are over (their destinations are freed on disconnect) or the wait ran out."""
        fault = self._server.peer_fault
        if fault is None or self._conn is None or not self._conn.alive:
            return
        now = time.monotonic()
        if self._peer_fault_at is None:
            self._peer_fault_at = now
            logger.warning("P2PSession %s: data plane faulted (%s); disconnecting once writes drain", self.peer_id, fault)
        if self._server.has_inflight_transfers and now - self._peer_fault_at < _PEER_FAULT_DRAIN_S:
            return
        self._disconnect(f"data plane: {fault}")

    def _disconnect(self, reason: str) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send(DisconnectMsg.make())
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self._conn is None:
            return
        if self._death_reason is None:
            self._death_reason = reason
        self._conn.mark_dead()
