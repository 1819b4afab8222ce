"""The P2P tier's data path: blocks written straight into a peer's memory."""

from kvlab.kv_offload.tiering.p2p.data.base import DataTransport, PollResult
from kvlab.kv_offload.tiering.p2p.data.nixl import NixlTransport

__all__ = ["DataTransport", "NixlTransport", "PollResult"]
