"""The stats payload of vLLM 0.33's NIXL connector (vLLM: the package
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``), and nothing else of it.

kvlab has only the *stats shape* of vLLM's NIXL connector: :class:`NixlKVConnectorStats`,
what vLLM measures about each NIXL transfer (its duration, the time to post it, bytes,
descriptors) and about what went wrong (failed transfers, notifications and handshakes,
requests whose KV expired before the decode engine read it). kvlab has **no NIXL
transport**: no ``NixlConnector`` class, no agents or handshakes, nothing that moves bytes
between engines -- ``KVTransferConfig(kv_connector="NixlConnector")`` is refused as an
unknown connector. The payload is here because a ``MultiConnector``'s stats keep one payload
per child connector, and vLLM's P/D deployments pair NIXL with an offloading connector: this
is the shape such a payload has when it is aggregated, reduced to a log line and reset.
"""

from kvlab.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

__all__ = ["NixlKVConnectorStats"]
