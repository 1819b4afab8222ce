"""The P2P tier's control channel, as an interface (vLLM 0.33:
``vllm/v1/kv_offload/tiering/p2p/control/base.py``).

Engines that share KV through the P2P tier first talk: who holds which blocks, which
transfers to start, who left. That talk goes over a *control transport* -- one per engine,
listening at ``host:port`` -- holding one *connection* per peer. The transport carries
dicts and never reads them; the sessions above it give them meaning. The bytes of the KV
travel elsewhere (the data path).

Nothing here runs on a thread of its own: whoever owns the transport calls ``poll()`` now
and then (the tiering manager does, under its lock), and that call does all the I/O --
reads what arrived, accepts peers that wrote first, notices peers that went away. Calls
never overlap, so sockets that are not thread-safe are fine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class ControlConnection(ABC):
    """Messages to and from one peer (``peer_id``: the ``host:port`` it listens at).

    Made by the transport (``connect`` or ``poll``); ``mark_dead`` when the peer is gone
    (``alive`` turns False, the resources stay until ``close``, so what arrived can still be
    read); ``close`` frees the sockets (twice is harmless).
    """

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False after ``mark_dead`` or ``close``."""

    @abstractmethod
    def send(self, msg: dict) -> None:
        """Queue ``msg`` for the peer and return at once. Raises on a dead connection, and
        when the peer has stopped reading (its queue is full) rather than wait."""

    @abstractmethod
    def recv(self) -> Sequence[dict]:
        """Every message that arrived since the last call, in order (empty if none). The
        sequence is the caller's to read, not to change."""

    @abstractmethod
    def mark_dead(self) -> None:
        """The peer is gone: stop using this connection (``close`` still has to run)."""

    @abstractmethod
    def close(self) -> None:
        """Free the connection's resources. Idempotent."""


class ControlTransport(ABC):
    """One engine's end of the control channel: a listening address and its connections."""

    @abstractmethod
    def connect(self, peer_id: str) -> ControlConnection:
        """A new connection to ``peer_id`` (``"host:port"``), usable at once: what is sent
        before the peer polls waits for it. A dead connection to the same peer that is still
        registered is replaced; a live one is a mistake (AssertionError)."""

    @abstractmethod
    def poll(self) -> Sequence[ControlConnection]:
        """Do the I/O: read what arrived into each connection, notice lost peers, and
        return the connections opened by peers that wrote first (each returned once, its
        first messages already waiting in ``recv``)."""

    @abstractmethod
    def close(self) -> None:
        """Close the listening end and every connection. Idempotent."""
