"""A KV connector's telemetry (vLLM 0.33: ``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``,
which re-exports it; it sits here, with the engine's other metrics, so that the offload
tiers that fill a payload need nothing from ``kvlab.distributed``).

Each connector defines its own payload, a subclass of :class:`KVConnectorStats`: the
scheduler collects one per step (``connector.get_kv_connector_stats()``), payloads from
several workers or steps are merged with ``aggregate``, and a logger turns an interval's
payload into a few numbers with ``reduce``. The payload's ``data`` must survive being sent
between processes, so it holds plain values only; ``build_kv_connector_stats(data)`` on the
connector class rebuilds the object on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorStats:
    """The base payload: ``data`` is the connector's own serialisable record."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The serialisable payload."""
        return self.data

    def reset(self) -> None:
        raise NotImplementedError

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        raise NotImplementedError

    def reduce(self) -> dict[str, int | float]:
        """An interval's observations as a few representative numbers (sums, counts)."""
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError
