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
    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``KVTransferConfig(kv_connector=name)`` build ``module_path.class_name``
        (vLLM 0.33's call; the module is imported on first use, so a connector that needs
        a package this machine lacks costs nothing until it is asked for)."""
        for arg, value in (("name", name), ("module_path", module_path), ("class_name", class_name)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{arg} must be a non-empty str, got {value!r}")
        if name in _REGISTRY:
            raise ValueError(f"Connector '{name}' is already registered.")
        _REGISTRY[name] = (module_path, class_name)

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
