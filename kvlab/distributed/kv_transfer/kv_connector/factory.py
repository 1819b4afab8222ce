"""Build a connector by name (vLLM: ``KVConnectorFactory`` in
``vllm/distributed/kv_transfer/kv_connector/factory.py``)."""

from __future__ import annotations

import importlib
from typing import Any

from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, supports_hma

# name -> (module, class): imported on first use
_REGISTRY: dict[str, tuple[str, str]] = {
    "OffloadingConnector": ("kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector", "OffloadingConnector"),
    "ExampleConnector": ("kvlab.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector"),
    "HiSparseConnector": ("kvlab.distributed.kv_transfer.kv_connector.v1.hisparse.connector", "HiSparseConnector"),
    "MultiConnector": ("kvlab.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiConnector"),
}
# These two take kvlab's (role, block_size, extra_config) in kvlab's call; every other class
# is built with vLLM's (vllm_config, role, kv_cache_config) -- in kvlab's call, only a class a
# caller registered takes kvlab's shape. In vLLM's call, OffloadingConnector takes vLLM's
# shape too and decides itself: a spec key in the extra config builds vLLM's spec-built
# halves, none kvlab's staged tiers (see offloading_connector.builds_spec_halves).
_KVLAB_SHAPED = frozenset({"OffloadingConnector", "ExampleConnector"})
_VLLM_SHAPED_BUILTINS = frozenset(_REGISTRY) - _KVLAB_SHAPED
_BOTH_SHAPED = frozenset({"OffloadingConnector"})


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

    @classmethod
    def create_connector(cls, config: Any, role: KVConnectorRole, kv_cache_config: Any) -> KVConnectorBase_V1:
        """kvlab's call, ``(KVTransferConfig, role, block_size)``, or vLLM 0.33's,
        ``(VllmConfig, role, KVCacheConfig)``. In vLLM's, a connector class registered by a
        caller is built as vLLM builds it, ``cls(vllm_config, role, kv_cache_config)``; kvlab's
        ExampleConnector is built from the transfer config and the first group's block size;
        OffloadingConnector from vLLM's call (it picks spec-built or staged halves itself).
        As in vLLM, a connector that does not support the hybrid allocator is refused while
        the config keeps it on (``scheduler_config.disable_hybrid_kv_cache_manager``)."""
        vllm_config = None
        if not isinstance(config, KVTransferConfig) and hasattr(config, "kv_transfer_config"):
            vllm_config, config = config, config.kv_transfer_config
            if config is None:
                raise ValueError("kv_transfer_config must be set to create a connector")
        if not isinstance(config, KVTransferConfig) and not (vllm_config is not None and hasattr(config, "kv_connector")):
            raise TypeError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        connector_cls: Any = cls.get_connector_class(config)
        if vllm_config is None:
            if config.kv_connector in _VLLM_SHAPED_BUILTINS:
                raise TypeError(
                    f"{config.kv_connector} is built from vLLM's call, create_connector(vllm_config, role, kv_cache_config): "
                    "it reads the KV-cache config, not a block size"
                )
            block_size = kv_cache_config
        else:
            hma_enabled = not getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", False)
            if hma_enabled and not supports_hma(connector_cls):
                raise ValueError(
                    f"Connector {connector_cls.__name__} does not support HMA but HMA is enabled. "
                    "Please set `--disable-hybrid-kv-cache-manager`."
                )
            if config.kv_connector not in _KVLAB_SHAPED or config.kv_connector in _BOTH_SHAPED:
                return connector_cls(vllm_config, role, kv_cache_config)
            block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        extra = getattr(config, "kv_connector_extra_config", None) or {}
        if config.kv_connector == "ExampleConnector":
            return connector_cls(role, block_size, extra, kv_role=config.kv_role)
        return connector_cls(role, block_size, extra)

    @classmethod
    def get_connector_class_by_name(cls, connector_name: str) -> type[KVConnectorBase_V1]:
        """The class registered under ``connector_name`` (imported now)."""
        try:
            module, name = _REGISTRY[connector_name]
        except KeyError:
            raise ValueError(f"Connector '{connector_name}' is not registered.") from None
        connector_cls: type[KVConnectorBase_V1] = getattr(importlib.import_module(module), name)
        return connector_cls

    @classmethod
    def get_connector_class(cls, kv_transfer_config: Any) -> type[KVConnectorBase_V1]:
        """The class ``kv_transfer_config.kv_connector`` names: from
        ``kv_connector_module_path`` when the config gives one (vLLM 0.33), else the registry."""
        name = kv_transfer_config.kv_connector
        module_path = getattr(kv_transfer_config, "kv_connector_module_path", None)
        if module_path is not None and not module_path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if module_path:
            module = importlib.import_module(module_path)
            try:
                connector_cls: type[KVConnectorBase_V1] = getattr(module, name)
            except AttributeError:
                raise AttributeError(f"Class {name} not found in {module_path}") from None
            return connector_cls
        if name not in _REGISTRY:
            raise ValueError(f"unknown kv_connector {name!r}; known: {sorted(_REGISTRY)}")
        return cls.get_connector_class_by_name(name)

    @classmethod
    def supports_hma_config(cls, kv_transfer_config: Any) -> bool:
        """Whether the connector this config names supports the hybrid allocator
        (``SupportsHMA``; vLLM turns the allocator off when it does not)."""
        return supports_hma(cls.get_connector_class(kv_transfer_config))
