"""Cache policies by name (vLLM 0.33: ``vllm/v1/kv_offload/cpu/policies/factory.py``).

Built in: ``"lru"`` and ``"arc"``. A policy of your own is either registered under a short
name (``register_cache_policy``) or named with its module at lookup time
(``get_cache_policy_cls(name, module_path)``: ``name`` is then the class name) -- how a
vLLM user plugs one in through ``cache_policy`` / ``cache_policy_module_path`` without
touching vLLM.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from kvlab.kv_offload.cpu.policies.base import CachePolicy

logger = logging.getLogger("kvlab.kv_offload")


class CachePolicyFactory:
    _registry: dict[str, Callable[[], type[CachePolicy]]] = {}

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``name``; the module is imported on first use."""
        if name in cls._registry:
            raise ValueError(f"Cache policy '{name}' is already registered.")

        def load() -> type[CachePolicy]:
            loaded: type[CachePolicy] = getattr(importlib.import_module(module_path), class_name)
            return loaded

        cls._registry[name] = load

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type[CachePolicy]:
        """The class registered as ``name``; else class ``name`` of ``module_path``. A name
        neither registered nor given a module is a ValueError listing the registered ones."""
        if name in cls._registry:
            return cls._registry[name]()
        if module_path is None:
            raise ValueError(
                f"Unknown cache policy: {name!r}. Supported: {list(cls._registry)}. "
                "For an out-of-tree policy, also set cache_policy_module_path."
            )
        logger.warning("Loading out-of-tree cache policy '%s' from '%s' (an experimental API in vLLM).", name, module_path)
        policy_cls = getattr(importlib.import_module(module_path), name)
        if not (isinstance(policy_cls, type) and issubclass(policy_cls, CachePolicy)):
            raise TypeError(f"{module_path}.{name} is not a CachePolicy subclass")
        return policy_cls


CachePolicyFactory.register_cache_policy("lru", "kvlab.kv_offload.cpu.policies.lru", "LRUCachePolicy")
CachePolicyFactory.register_cache_policy("arc", "kvlab.kv_offload.cpu.policies.arc", "ARCCachePolicy")
