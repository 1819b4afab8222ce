"""Building a secondary tier's back-pressure detector from its config (vLLM 0.33:
``vllm/v1/kv_offload/tiering/factory.py``, the detector half of
``SecondaryTierFactory.create_secondary_tier``).

A config is a dict such as ``{"backpressure_cls": "EMABackpressureDetector",
"policy_cls": "DropStorePolicy", "high_water_s": 0.02}``. A short class name is looked up in
:mod:`kvlab.kv_offload.tiering.backpressure`; a dotted one (``"my_pkg.MyDetector"``) is
imported from its module, so a detector of your own plugs in without touching kvlab. Water
marks the config leaves out come from the detector's ``default_config`` for the tier's type
and locality (local-disk marks for ``"fs"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kvlab.kv_offload.tiering.backpressure import BackpressureDetector, BackpressurePolicy

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
