"""Offloading backends by name (vLLM 0.33: ``OffloadingSpecFactory`` in ``vllm/v1/kv_offload/factory.py``).

``kv_connector_extra_config["spec_name"]`` picks the backend: ``"CPUOffloadingSpec"`` (the
default: one CPU tier) or ``"TieringOffloadingSpec"`` (a CPU tier with secondary tiers
behind it). A name nobody registered is looked up in ``extra_config["spec_module_path"]``,
so an out-of-tree backend needs no change to kvlab.

Why the registry holds loaders rather than classes: a spec's module may pull in worker code
(torch); the scheduler process that never asks for that spec should not pay for it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvlab.kv_offload.base import NotASubclassError, OffloadingSpec
from kvlab.kv_offload.config import OffloadingConfig

logger = logging.getLogger(__name__)

_DEFAULT_SPEC = "CPUOffloadingSpec"


class OffloadingSpecFactory:
    """Spec names and how to load their classes (one registry per process)."""

    _registry: dict[str, Callable[[], type[OffloadingSpec]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``name``; the module is imported when first asked for."""
        for arg, value in (("name", name), ("module_path", module_path), ("class_name", class_name)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{arg} must be a non-empty str, got {value!r}")
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader() -> type[OffloadingSpec]:
            return getattr(importlib.import_module(module_path), class_name)  # checked by get_spec_cls

        cls._registry[name] = loader

    @classmethod
    def get_spec_cls(cls, extra_config: Mapping[str, Any]) -> type[OffloadingSpec]:
        """The class ``extra_config["spec_name"]`` names (default ``"CPUOffloadingSpec"``):
        registered, or found in ``extra_config["spec_module_path"]``."""
        if not isinstance(extra_config, Mapping):
            raise TypeError(f"extra_config must be a dict (kv_connector_extra_config), got {type(extra_config).__name__}")
        spec_name = extra_config.get("spec_name", _DEFAULT_SPEC)
        if spec_name in cls._registry:
            spec_cls: object = cls._registry[spec_name]()
        else:
            module_path = extra_config.get("spec_module_path")
            if module_path is None:
                raise ValueError(
                    f"Unsupported spec type: {spec_name!r}; registered: {sorted(cls._registry)} "
                    "(an out-of-tree spec also needs 'spec_module_path')"
                )
            logger.warning("Loading out-of-tree offloading spec %r from %r (an experimental API).", spec_name, module_path)
            spec_cls = getattr(importlib.import_module(module_path), spec_name, None)
            if spec_cls is None:
                raise ValueError(f"Unsupported spec type: module {module_path!r} has no {spec_name!r}")
        if not (isinstance(spec_cls, type) and issubclass(spec_cls, OffloadingSpec)):
            raise NotASubclassError(f"{spec_name} is not an OffloadingSpec subclass (got {spec_cls!r})")
        return spec_cls

    @classmethod
    def create_spec(cls, config: OffloadingConfig) -> OffloadingSpec:
        """The backend ``config.extra_config`` names, built from ``config``."""
        if not isinstance(config, OffloadingConfig):
            raise TypeError(f"config must be an OffloadingConfig (kvlab.kv_offload.config), got {type(config).__name__}")
        spec_cls = cls.get_spec_cls(config.extra_config)
        logger.info("Creating offloading spec %s", spec_cls.__name__)
        return spec_cls(config)


OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "kvlab.kv_offload.cpu.spec", "CPUOffloadingSpec")
OffloadingSpecFactory.register_spec("TieringOffloadingSpec", "kvlab.kv_offload.tiering.spec", "TieringOffloadingSpec")
