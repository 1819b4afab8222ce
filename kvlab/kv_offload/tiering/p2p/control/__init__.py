"""The P2P tier's control channel: peers find each other and exchange small messages."""

from kvlab.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport
from kvlab.kv_offload.tiering.p2p.control.zmq import ZmqConnection, ZmqTransport

__all__ = ["ControlConnection", "ControlTransport", "ZmqConnection", "ZmqTransport"]
