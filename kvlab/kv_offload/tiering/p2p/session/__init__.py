"""The P2P tier's sessions, one per peer (vLLM 0.33: ``vllm/v1/kv_offload/tiering/p2p/session/``).

:mod:`.protocol` is the wire format, :mod:`.client` the role that loads from the peer,
:mod:`.server` the role that writes to it, and :mod:`.session` the coordinator that owns the
connection and the handshake and joins the two roles -- what the P2P manager holds per peer."""

from kvlab.kv_offload.tiering.p2p.session.session import (
    LoadResult,
    P2PSession,
    SessionCloseResult,
    SessionPollResult,
    StoreResult,
)

__all__ = ["LoadResult", "P2PSession", "SessionCloseResult", "SessionPollResult", "StoreResult"]
