"""Which manager runs a group of each kind of KV-cache spec (vLLM 0.33:
``vllm/v1/kv_cache_spec_registry.py``).

A plugin that adds a layer kind (its own ``KVCacheSpec`` subclass) registers the manager
that allocates, caches and frees its blocks; a subclass it does not register is run as its
nearest registered base. kvlab keeps one table, ``MANAGER_FOR_SPEC`` in
:mod:`kvlab.core.kv_cache_utils`, which its managers fill on import: this class reads and
extends that table with vLLM's calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from kvlab.core.hisparse_managers import HiSparseSourceManager
from kvlab.core.kv_cache_utils import MANAGER_FOR_SPEC
from kvlab.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheGroupRole,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
)

if TYPE_CHECKING:
    from kvlab.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from kvlab.kv_cache_interface import KVCacheSpec

_S = TypeVar("_S", bound=type)

#: spec class -> the base it shares a group with (a registered spec not listed: itself). The
#: full-attention variants share full attention's groups.
_UNIFORM_BASE: dict[type, type] = {
    cls: FullAttentionSpec for cls in (MLAAttentionSpec, RSWASpec, HiddenStateCacheSpec, SinkFullAttentionSpec)
}
#: group role -> the manager that runs every group of that role, whatever its spec.
_ROLE_MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {KVCacheGroupRole.HISPARSE_SOURCE: HiSparseSourceManager}


def _nearest(table: Mapping[type, Any], spec_cls: type) -> Any:
    for base in spec_cls.__mro__:
        if base in table:
            return table[base]
    return None


class KVCacheSpecRegistry:
    @classmethod
    def register(
        cls,
        kvcache_spec_cls: type[KVCacheSpec],
        manager_class: type[SingleTypeKVCacheManager] | None = None,
        uniform_type_base_spec: type[KVCacheSpec] | None = None,
    ) -> None:
        """Run groups of ``kvcache_spec_cls`` with ``manager_class``; its layers may share a
        group with ``uniform_type_base_spec``'s (a base class of it; default: itself). The
        same registration twice is allowed, a different one for a registered class is not."""
        if manager_class is None:
            raise AssertionError("manager_class is required")
        base = kvcache_spec_cls if uniform_type_base_spec is None else uniform_type_base_spec
        if not issubclass(kvcache_spec_cls, base):
            raise AssertionError(f"{kvcache_spec_cls.__name__} must inherit from its declared uniform_type_base_spec {base.__name__}.")
        known = MANAGER_FOR_SPEC.get(kvcache_spec_cls)
        if known is not None and (known is not manager_class or _UNIFORM_BASE.get(kvcache_spec_cls, kvcache_spec_cls) is not base):
            raise AssertionError(f"Conflicting registration for KVCacheSpec : {kvcache_spec_cls.__name__}")
        MANAGER_FOR_SPEC[kvcache_spec_cls] = manager_class
        _UNIFORM_BASE[kvcache_spec_cls] = base

    @classmethod
    def register_role_manager(cls, role: str, manager_class: type[SingleTypeKVCacheManager]) -> None:
        """Run every group of ``role`` with ``manager_class``, before any spec's manager."""
        known = _ROLE_MANAGERS.get(role)
        if known is not None and known is not manager_class:
            raise AssertionError(f"Conflicting manager registration for group role {role}")
        _ROLE_MANAGERS[role] = manager_class

    @classmethod
    def get_manager_class(cls, kvcache_spec: KVCacheSpec, role: str | None = None) -> type[SingleTypeKVCacheManager] | None:
        """The manager for a group of ``kvcache_spec`` (and ``role``); None when none runs it."""
        if role is not None and role in _ROLE_MANAGERS:
            return _ROLE_MANAGERS[role]
        return _nearest(MANAGER_FOR_SPEC, type(kvcache_spec))

    @classmethod
    def get_uniform_type_base_spec(cls, kvcache_spec: KVCacheSpec) -> type[KVCacheSpec] | None:
        """The class whose layers this spec's layers may share a group with; None if unregistered."""
        for base in type(kvcache_spec).__mro__:
            if base in MANAGER_FOR_SPEC:
                return _UNIFORM_BASE.get(base, base)
        return None

    @classmethod
    def check_kv_cache_spec_registry(cls, kv_cache_spec: Mapping[str, KVCacheSpec]) -> None:
        """Refuse, naming the layer, a spec no registered manager runs."""
        for layer_name, spec in kv_cache_spec.items():
            if cls.get_manager_class(spec) is None:
                raise ValueError(
                    f"No manager found for KV cache spec type for layer {layer_name}: {type(spec)}. "
                    "Please register it using @register_kv_cache_spec decorator."
                )


def register_kv_cache_spec(
    manager_class: type[SingleTypeKVCacheManager] | None = None, uniform_type_base_spec: type[KVCacheSpec] | None = None
) -> Callable[[_S], _S]:
    """Class decorator: ``KVCacheSpecRegistry.register`` for the decorated spec class."""

    def decorator(kvcache_spec_cls: _S) -> _S:
        KVCacheSpecRegistry.register(kvcache_spec_cls, manager_class, uniform_type_base_spec)
        return kvcache_spec_cls

    return decorator
