"""The P2P control channel over ZeroMQ (vLLM 0.33: ``ZmqTransport`` and ``ZmqConnection`` in
``vllm/v1/kv_offload/tiering/p2p/control/zmq.py``).

Each engine binds one ROUTER socket at ``host:port`` -- its peer id -- and talks to each
peer through a DEALER socket of its own, connected to that peer's ROUTER, whose identity is
the engine's own peer id. So every message arrives at a ROUTER tagged with who sent it, and
the reply goes back over the receiver's DEALER to the sender's ROUTER: two one-way pipes per
pair of engines, never a socket shared by two peers. Messages are dicts encoded with
msgpack (msgspec), the same encoder vLLM's KV events use.

What keeps it from ever hanging the engine:

* ``send`` never blocks: a DEALER holds at most ``_SNDHWM`` messages for a peer that does
  not read, and the next send raises ConnectionError instead of waiting.
* A closed DEALER flushes for at most ``_DEALER_LINGER_MS`` (the default would let the
  context's teardown wait forever on an unreachable peer).
* ZeroMQ heartbeats (every 2 s, 10 s to answer) end a connection to a peer that vanished
  without a word; a socket monitor per DEALER reports disconnections and failed handshakes,
  and ``poll`` marks those connections dead.
* The ROUTER hands an identity over to its newest connection (``ROUTER_HANDOVER``), so a
  peer that reconnects before its old connection is torn down is heard at once (vLLM 0.33
  does not set it, and its own reconnect test fails now and then on that race).
* A transport dropped without ``close()`` (a test that fails half-way, a caller that
  raises) still lets go of its sockets: a finalizer holding the context and every socket
  closes them without lingering. Left to the garbage collector, a context and its sockets
  die in one cycle, the context's weak list of sockets is cleared first, and its teardown
  waits forever on sockets it no longer knows are open.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from kvlab.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport

logger = logging.getLogger(__name__)

_HEARTBEAT_IVL_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 10000
_HEARTBEAT_TTL_MS = 10000
_SNDHWM = 1000  # queued messages per peer before send raises (set, not libzmq's default)
_DEALER_LINGER_MS = 500

# Monitor events after which the peer cannot be reached through this socket again.
_FATAL_MONITOR_EVENTS: frozenset[int] = frozenset(
    {zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED}
    | {
        getattr(zmq, name)
        for name in ("EVENT_HANDSHAKE_FAILED_AUTH", "EVENT_HANDSHAKE_FAILED_PROTOCOL", "EVENT_HANDSHAKE_FAILED_NO_DETAIL")
        if hasattr(zmq, name)
    }
)
_MONITOR_EVENT_MASK = 0
for _event in _FATAL_MONITOR_EVENTS:
    _MONITOR_EVENT_MASK |= _event


def _release(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    for sock in sockets:
        if not sock.closed:
            sock.close(linger=0)
    ctx.destroy(linger=0)


def _heartbeat(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, _HEARTBEAT_TTL_MS)


def _peer_id(identity: bytes) -> str | None:
    """``identity`` as a peer id (``"host:port"``), or None if it is not one."""
    try:
        text = identity.decode()
    except UnicodeDecodeError:
        return None
    host, sep, port = text.rpartition(":")
    return text if sep and host and port.isdigit() else None


@dataclass
class _Sockets:
    dealer: zmq.Socket
    monitor: zmq.Socket


class ZmqConnection(ControlConnection):
    """One peer: the DEALER that sends to it, its monitor, and the messages it sent us."""

    def __init__(self, peer_id: str, sockets: _Sockets) -> None:
        super().__init__(peer_id)
        self._sockets = sockets
        # Two flags: a peer can be gone (dead) with the sockets still open (not closed),
        # and close() must still free them then.
        self._dead = False
        self._closed = False
        self._inbox: list[dict] = []

    @property
    def alive(self) -> bool:
        return not (self._dead or self._closed)

    def send(self, msg: dict) -> None:
        if not self.alive:
            raise RuntimeError(f"ZmqConnection: send on closed connection to {self.peer_id}")
        try:
            self._sockets.dealer.send(msgspec.msgpack.encode(msg), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise ConnectionError(f"ZmqConnection: send queue to {self.peer_id} is full ({_SNDHWM} messages unread)") from exc

    def recv(self) -> Sequence[dict]:
        msgs, self._inbox = self._inbox, []
        return msgs

    def enqueue(self, msg: dict) -> None:
        """A message from the peer (the transport calls this)."""
        self._inbox.append(msg)

    def mark_dead(self) -> None:
        self._dead = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._dead = True
        self._sockets.monitor.close()
        self._sockets.dealer.close()

    @property
    def monitor_socket(self) -> zmq.Socket:
        return self._sockets.monitor


class ZmqTransport(ControlTransport):
    """The ROUTER every peer writes to, and a DEALER per peer we write to.

    ``local_id``: this engine's peer id, ``"host:port"`` as the others connect to it (it is
    the identity on every message we send). ``host``, ``port``: where the ROUTER binds.
    """

    def __init__(self, local_id: str, host: str, port: int) -> None:
        self._local_id = local_id
        self._closed = False
        self._connections: dict[str, ZmqConnection] = {}
        self._pending_inbound: list[tuple[str, dict]] = []
        self._monitor_seq = 0  # makes each monitor endpoint unique, see _open_connection
        self._zmq_ctx = zmq.Context()
        self._router: zmq.Socket = self._zmq_ctx.socket(zmq.ROUTER)
        # Every socket this transport opens; the finalizer holds them (not self) strongly.
        self._owned: list[zmq.Socket] = [self._router]
        self._release = weakref.finalize(self, _release, self._zmq_ctx, self._owned)
        _heartbeat(self._router)
        # A peer that reconnects (after a lookup timeout, say) reuses its identity while the
        # old TCP pipe may still be closing; without handover the ROUTER keeps the old pipe
        # and silently drops every message of the new one.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            self._release()
            raise

    def connect(self, peer_id: str) -> ZmqConnection:
        # A session may mark its connection dead after this poll's sweep; the entry then
        # stays until the next poll. A reconnect in between replaces it.
        existing = self._connections.get(peer_id)
        if existing is not None:
            assert not existing.alive, f"ZmqConnection to {peer_id} already exists"
            self._connections.pop(peer_id).close()
        return self._open_connection(peer_id)

    def poll(self) -> Sequence[ControlConnection]:
        # Sweep first too: a peer that reconnects right after its old connection was marked
        # dead would otherwise have its first message routed into the dead one and lost.
        self._sweep()
        self._read_router()
        self._read_monitors()
        self._sweep()
        accepted: list[ControlConnection] = []
        for sender, msg in self._pending_inbound:
            conn = self._connections.get(sender)
            if conn is None:
                logger.info("ZmqTransport %s: accepting a connection from %s", self._local_id, sender)
                conn = self._open_connection(sender)
                accepted.append(conn)
            conn.enqueue(msg)
        self._pending_inbound.clear()
        return accepted

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
        self._release()

    def _open_connection(self, peer_id: str) -> ZmqConnection:
        host, port = peer_id.rsplit(":", 1)
        dealer = self._zmq_ctx.socket(zmq.DEALER)
        self._owned[:] = [s for s in self._owned if not s.closed] + [dealer]
        _heartbeat(dealer)
        dealer.identity = self._local_id.encode()
        dealer.setsockopt(zmq.SNDHWM, _SNDHWM)
        dealer.setsockopt(zmq.LINGER, _DEALER_LINGER_MS)
        # One endpoint per connection, not per peer: libzmq frees an inproc endpoint on its
        # own thread after close() returns, so reusing a peer's address on a quick
        # reconnect can fail with EADDRINUSE.
        endpoint = f"inproc://p2p-monitor-{peer_id.replace(':', '-').replace('/', '-')}-{self._monitor_seq}"
        self._monitor_seq += 1
        dealer.monitor(endpoint, _MONITOR_EVENT_MASK)
        monitor = self._zmq_ctx.socket(zmq.PAIR)
        self._owned.append(monitor)
        monitor.connect(endpoint)
        dealer.connect(f"tcp://{host}:{port}")  # queues until the TCP connection is up
        conn = self._connections[peer_id] = ZmqConnection(peer_id, _Sockets(dealer, monitor))
        return conn

    def _sweep(self) -> None:
        for peer_id in [p for p, c in self._connections.items() if not c.alive]:
            self._connections.pop(peer_id).close()

    def _read_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.warning("ZmqTransport %s: receive failed: %s", self._local_id, exc)
                return
            if len(frames) != 2:
                logger.warning("ZmqTransport %s: dropped a message of %d frames (expected 2)", self._local_id, len(frames))
                continue
            sender = _peer_id(frames[0])
            if sender is None:  # we answer a peer at its identity: it must be "host:port"
                logger.warning("ZmqTransport %s: dropped a message from identity %r (not host:port)", self._local_id, frames[0][:64])
                continue
            try:
                msg = msgspec.msgpack.decode(frames[1])
            except Exception as exc:  # DecodeError, but also TypeError, RecursionError on hostile payloads
                logger.warning("ZmqTransport %s: dropped an undecodable message from %s: %s", self._local_id, sender, exc)
                continue
            conn = self._connections.get(sender)
            if conn is not None:
                conn.enqueue(msg)
            else:
                self._pending_inbound.append((sender, msg))

    def _read_monitors(self) -> None:
        for conn in self._connections.values():
            while conn.alive:
                try:
                    event = zmq.utils.monitor.recv_monitor_message(conn.monitor_socket, zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    logger.warning("ZmqTransport %s: monitor of %s failed: %s", self._local_id, conn.peer_id, exc)
                    break
                if event["event"] in _FATAL_MONITOR_EVENTS:
                    conn.mark_dead()
