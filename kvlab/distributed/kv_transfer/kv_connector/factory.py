"""Build a connector by name (vLLM: ``KVConnectorFactory`` in
``vllm/distributed/kv_transfer/kv_connector/factory.py``)."""

from __future__ import annotations

import importlib
from typing import Any

from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

# name -> (module, class): imported on first use
_REGISTRY: dict[str, tuple[str, str]] = {
    "OffloadingConnector": ("kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector", "OffloadingConnector"),
    "ExampleConnector": ("kvlab.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector"),
}


class KVConnectorFactory:
    @staticmethod
    def create_connector(config: KVTransferConfig, role: KVConnectorRole, block_size: int) -> KVConnectorBase_V1:
        if not isinstance(config, KVTransferConfig):
            raise TypeError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        try:
            module, cls = _REGISTRY[config.kv_connector]
        except KeyError:
            raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {sorted(_REGISTRY)}") from None
        connector_cls: Any = getattr(importlib.import_module(module), cls)
        if cls == "ExampleConnector":
            return connector_cls(role, block_size, config.kv_connector_extra_config, kv_role=config.kv_role)
        return connector_cls(role, block_size, config.kv_connector_extra_config)
