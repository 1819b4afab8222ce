"""Building a secondary tier, and its back-pressure detector, from its config (vLLM 0.33:
``vllm/v1/kv_offload/tiering/factory.py``).

``SecondaryTierFactory`` maps a tier type (``{"type": "example", ...}``) to its class; a
type it does not know is imported from the config's ``module_path`` (``{"type":
"MyTier", "module_path": "my_pkg.tiers"}``), so a tier of your own plugs in without touching
kvlab. kvlab registers the example tier, the file-system tier (``"fs"``), the peer-to-peer tier
(``"p2p"``: engines fetch each other's KV) and the object-store tier (``"obj"``); the last
two move bytes with NIXL. vLLM's KVCR tier is not built.

A config is a dict such as ``{"backpressure_cls": "EMABackpressureDetector",
"policy_cls": "DropStorePolicy", "high_water_s": 0.02}``. A short class name is looked up in
:mod:`kvlab.kv_offload.tiering.backpressure`; a dotted one (``"my_pkg.MyDetector"``) is
imported from its module, so a detector of your own plugs in without touching kvlab. Water
marks the config leaves out come from the detector's ``default_config`` for the tier's type
and locality (local-disk marks for ``"fs"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from kvlab.kv_offload.base import NotASubclassError
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector, BackpressurePolicy
from kvlab.kv_offload.tiering.base import SecondaryTierManager

_DEFAULT_PACKAGE = "kvlab.kv_offload.tiering.backpressure"


def _import_class(name: str) -> type:
    """``name`` as a class: dotted names are ``module.Class``, bare ones live in the
    back-pressure module."""
    module_path, _, class_name = name.rpartition(".") if "." in name else (_DEFAULT_PACKAGE, "", name)
    module = importlib.import_module(module_path)
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise ValueError(f"{module_path} has no class {class_name!r}") from None
    if not isinstance(cls, type):
        raise TypeError(f"{module_path}.{class_name} is not a class")
    return cls


def create_backpressure_detector(
    bp_config: Mapping[str, Any] | None, tier_type: str, *, locality: str | None = None
) -> BackpressureDetector | None:
    """The detector ``bp_config`` describes for a tier of ``tier_type``, or None without a
    config (the tier then takes every cascade, vLLM's default)."""
    if bp_config is None:
        return None
    if not isinstance(bp_config, Mapping):
        raise TypeError(f"backpressure must be None or a dict with 'backpressure_cls', got {type(bp_config).__name__}")
    config = dict(bp_config)
    cls_name = config.pop("backpressure_cls", None)
    if cls_name is None:
        raise ValueError("backpressure config must include 'backpressure_cls' (e.g. 'EMABackpressureDetector')")
    policy_name = config.pop("policy_cls", None)
    policy = None
    if policy_name:
        policy_cls = _import_class(policy_name)
        if not issubclass(policy_cls, BackpressurePolicy):
            raise TypeError(f"policy_cls {policy_name!r} is not a BackpressurePolicy")
        policy = policy_cls()
    detector_cls = _import_class(cls_name)
    if not issubclass(detector_cls, BackpressureDetector):
        raise TypeError(f"backpressure_cls {cls_name!r} is not a BackpressureDetector")
    for key, value in (detector_cls.default_config(tier_type, locality=locality) or {}).items():
        config.setdefault(key, value)
    detector: BackpressureDetector = detector_cls(policy=policy, **config)
    return detector


class SecondaryTierFactory:
    """Tier types and the classes that implement them (one registry per process)."""

    _registry: dict[str, Callable[[], type[SecondaryTierManager]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``tier_type`` (imported when first asked for)."""
        if tier_type in cls._registry:
            raise ValueError(f"Tier '{tier_type}' is already registered.")

        def loader() -> type[SecondaryTierManager]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[tier_type] = loader

    @classmethod
    def get_tier_class(cls, tier_config: Mapping[str, Any]) -> type[SecondaryTierManager]:
        """The class of ``tier_config["type"]``: registered, or named by ``module_path``."""
        if not isinstance(tier_config, Mapping):
            raise TypeError(f"tier_config must be a dict with 'type', got {type(tier_config).__name__}")
        tier_type = tier_config.get("type")
        if not tier_type:
            raise ValueError("Secondary tier configuration must include 'type'")
        if tier_type in cls._registry:
            return cls._registry[tier_type]()
        module_path = tier_config.get("module_path")
        if module_path is None:
            raise ValueError(
                f"Unknown secondary tier type: {tier_type!r}. Supported types: {list(cls._registry)}. "
                "For an out-of-tree tier, also set 'module_path'."
            )
        tier_cls = getattr(importlib.import_module(module_path), tier_type, None)
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
            raise NotASubclassError(f"{module_path}.{tier_type} is not a SecondaryTierManager subclass")
        return tier_cls

    @classmethod
    def create_secondary_tier(
        cls, tier_config: Mapping[str, Any], primary_kv_view: memoryview, offloading_spec: Any
    ) -> SecondaryTierManager:
        """Build the tier: ``type`` and ``module_path`` pick the class, ``backpressure`` its
        detector (:func:`create_backpressure_detector`), every other key is a keyword of the
        tier's constructor."""
        tier_cls = cls.get_tier_class(tier_config)
        config = dict(tier_config)
        tier_type = config.pop("type")
        config.pop("module_path", None)
        detector = create_backpressure_detector(config.pop("backpressure", None), tier_type, locality=config.get("locality"))
        return tier_cls(
            offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type, backpressure_detector=detector, **config
        )


SecondaryTierFactory.register_tier("example", "kvlab.kv_offload.tiering.example.manager", "ExampleSecondaryTierManager")
SecondaryTierFactory.register_tier("fs", "kvlab.kv_offload.tiering.fs.manager", "FileSystemTierManager")
SecondaryTierFactory.register_tier("p2p", "kvlab.kv_offload.tiering.p2p.manager", "P2PSecondaryTierManager")
SecondaryTierFactory.register_tier("obj", "kvlab.kv_offload.tiering.obj.manager", "ObjectStoreSecondaryTierManager")
