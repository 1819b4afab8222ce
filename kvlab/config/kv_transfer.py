"""Which KV connector an engine runs, and how (vLLM: ``KVTransferConfig`` in
``vllm/config/kv_transfer.py``; lessons 12-13).

vLLM is started with ``--kv-transfer-config '{"kv_connector": "OffloadingConnector",
"kv_role": "kv_both", "kv_connector_extra_config": {...}}'``; the same record, as a
dataclass, builds both halves of a kvlab connector (``KVConnectorFactory``).

``kv_role``: "kv_producer" (saves KV for others: a prefill engine), "kv_consumer" (loads
it: a decode engine) or "kv_both" (an offloading cache does both).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    #: This engine's name among engines that share KV (one per data-parallel rank); a
    #: random one when not given, as in vLLM. Offload files and P/D handshakes carry it.
    engine_id: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))
        elif not isinstance(self.engine_id, str) or not self.engine_id:
            raise TypeError(f"engine_id must be a non-empty string or None, got {self.engine_id!r}")
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise TypeError(f"kv_connector must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise TypeError(f"kv_connector_extra_config must be a dict, got {type(self.kv_connector_extra_config).__name__}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy must be 'recompute' or 'fail', got {self.kv_load_failure_policy!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def hisparse_host_pool_gib(kv_transfer_config: Any) -> float | None:
    """The host pool HiSparse was given, in GiB (vLLM 0.33): the ``host_pool_gib`` of the one
    ``HiSparseConnector`` in ``kv_transfer_config`` -- the connector itself, or one of a
    ``MultiConnector``'s ``connectors``. None when no HiSparse connector is configured; a
    second one, a missing or a non-positive size are refused."""
    if kv_transfer_config is None:
        return None
    extra = kv_transfer_config.kv_connector_extra_config
    if kv_transfer_config.kv_connector == "MultiConnector":
        connectors = extra.get("connectors", [])
    else:
        connectors = [{"kv_connector": kv_transfer_config.kv_connector, "kv_connector_extra_config": extra}]
    entries = [c.get("kv_connector_extra_config", {}) for c in connectors if c.get("kv_connector") == "HiSparseConnector"]
    if len(entries) > 1:
        raise ValueError("Only one HiSparseConnector may be configured")
    if not entries:
        return None
    gib = entries[0].get("host_pool_gib")
    if gib is None:
        raise ValueError("HiSparseConnector requires host_pool_gib")
    gib = float(gib)
    if gib <= 0:
        raise ValueError(f"HiSparseConnector host_pool_gib must be positive, got {gib}")
    return gib
