"""A pytest plugin that runs vLLM 0.33's own tests on kvlab (``scripts/vllm_tests/run.sh``).

How: every ``vllm.*`` module that kvlab has at the matching path (``vllm.v1.core.block_pool``
-> ``kvlab.core.block_pool``, see RULES) is imported from kvlab and registered under vLLM's
name. Every other module stays vLLM's own: configs, sampling params, platforms. vLLM's own
infrastructure is imported first, so it keeps vLLM's modules; the tests then get kvlab's.

Three more pieces keep a missing part from hiding what does work:

* A name a test imports from a mapped module that kvlab lacks becomes a placeholder class:
  importing it works, using it raises ``NotImplementedError("kvlab lacks ...")``. Only the
  tests that use it fail.
* A module vLLM has under a mapped package and kvlab lacks (the p2p tier, say) is loaded
  from vLLM. Its tests run vLLM's code, not kvlab's, so ``run.sh`` leaves those files out
  and the report (``KVLAB_ADAPTER_REPORT``) lists every such module. With
  ``KVLAB_ADAPTER_STRICT=1`` such a module stands empty instead, every name a placeholder
  (``run.sh``'s connector table, whose files mix kvlab's parts with parts it lacks).
* kvlab keeps seven call shapes of its own on purpose; the adapter translates them (the
  ``TRANSLATIONS`` section at the end). Nothing else is changed.
"""

from __future__ import annotations

import abc
import atexit
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from types import SimpleNamespace
from typing import Any

RULES = [
    ("vllm.v1.core", "kvlab.core"),
    ("vllm.v1.kv_cache_interface", "kvlab.kv_cache_interface"),
    ("vllm.v1.request", "kvlab.request"),
    ("vllm.v1.kv_offload", "kvlab.kv_offload"),
    ("vllm.v1.hisparse", "kvlab.hisparse"),
    ("vllm.v1.kv_cache_spec_registry", "kvlab.kv_cache_spec_registry"),
    ("vllm.v1.metrics", "kvlab.metrics"),
    ("vllm.utils.hashing", "kvlab.utils.hashing"),
    ("vllm.distributed.kv_events", "kvlab.distributed.kv_events"),
    ("vllm.distributed.kv_transfer", "kvlab.distributed.kv_transfer"),
]
# vLLM's infrastructure, imported before the mapping starts (it keeps vLLM's modules).
PRELOAD = (
    "vllm.config",
    "vllm.sampling_params",
    "vllm.platforms",
    "vllm.multimodal.inputs",
    "vllm.lora.request",
    "vllm.entrypoints.llm",
    "vllm.outputs",
    "tests.conftest",
)
MAPPED: dict[str, str] = {}
# KVLAB_ADAPTER_STRICT=1: a module kvlab lacks is not loaded from vLLM but stands empty (every
# name a placeholder), so no test passes on vLLM's code (run.sh's connector table).
STRICT = os.environ.get("KVLAB_ADAPTER_STRICT") == "1"
VLLM_FALLBACKS: set[str] = set()
MISSING: set[str] = set()
EMPTY_PACKAGES: set[str] = set()  # STRICT: vLLM packages kvlab lacks, standing empty


def kvlab_name(name: str) -> str | None:
    """The kvlab module that stands for vLLM's module ``name``, if kvlab has it."""
    for src, dst in RULES:
        if name == src or name.startswith(src + "."):
            candidate = dst + name[len(src) :]
            try:
                return candidate if importlib.util.find_spec(candidate) is not None else None
            except (ImportError, ValueError):
                return None
    return None


class _MissingMeta(abc.ABCMeta):
    def __getattr__(cls, attr: str) -> Any:
        raise AttributeError(f"kvlab lacks {cls._kvlab_missing}.{attr}")


def _missing(full_name: str) -> type:
    MISSING.add(full_name)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"kvlab lacks {full_name}")

    return _MissingMeta(full_name.rsplit(".", 1)[1], (), {"_kvlab_missing": full_name, "__init__": init})


def _add_placeholders(module: Any, vllm_name: str) -> None:
    if getattr(module, "_kvlab_adapter_placeholders", False):
        return
    own = module.__dict__.get("__getattr__")

    def __getattr__(attr: str) -> Any:
        if own is not None:
            try:
                return own(attr)
            except AttributeError:
                pass
        if attr.startswith("__"):
            raise AttributeError(attr)
        if hasattr(module, "__path__"):  # a package: ``from pkg import sub`` asks here before importing sub
            try:
                return importlib.import_module(f"{vllm_name}.{attr}")
            except ModuleNotFoundError as e:
                if e.name not in (f"{vllm_name}.{attr}", f"{module.__name__}.{attr}"):
                    raise  # sub exists but imports something missing: say so
        return _missing(f"{vllm_name}.{attr}")

    module.__getattr__ = __getattr__
    module._kvlab_adapter_placeholders = True


class _AliasLoader(importlib.abc.Loader):
    """vLLM's module ``spec.name`` as kvlab's ``kvlab_module`` -- or, with None (STRICT, a
    module kvlab lacks), as an empty module -- each missing name a placeholder."""

    def __init__(self, kvlab_module: str | None) -> None:
        self.kvlab_module = kvlab_module

    def create_module(self, spec: Any) -> Any:
        module = types.ModuleType(spec.name) if self.kvlab_module is None else importlib.import_module(self.kvlab_module)
        _add_placeholders(module, spec.name)
        return module

    def exec_module(self, module: Any) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not name.startswith("vllm."):
            return None
        real = kvlab_name(name)
        if real is None:
            parent = name.rsplit(".", 1)[0]
            # kvlab's package, vLLM's module (or, strict, a module under a package kvlab lacks)
            if path is not None and (parent in MAPPED or parent in EMPTY_PACKAGES):
                spec = importlib.machinery.PathFinder.find_spec(name, [os.path.join(VLLM_ROOT, *parent.split("."))])
                if spec is not None:  # (a package attribute asked as a submodule finds none)
                    VLLM_FALLBACKS.add(name)
                    if STRICT:  # empty, and a package where vLLM's is one: its submodules stand empty too
                        is_package = spec.submodule_search_locations is not None
                        if is_package:
                            EMPTY_PACKAGES.add(name)
                        return importlib.util.spec_from_loader(name, _AliasLoader(None), is_package=is_package)
                return spec
            return None
        MAPPED[name] = real
        kspec = importlib.util.find_spec(real)
        is_package = kspec.submodule_search_locations is not None
        spec = importlib.util.spec_from_loader(name, _AliasLoader(real), is_package=is_package)
        if is_package:
            spec.submodule_search_locations = list(kspec.submodule_search_locations)
        return spec


def _report() -> None:
    path = os.environ.get("KVLAB_ADAPTER_REPORT")
    if path:
        with open(f"{path}.{os.getpid()}", "w") as f:
            for kind, names in (("vllm-module", VLLM_FALLBACKS), ("missing-name", MISSING)):
                f.writelines(f"{kind} {n}\n" for n in sorted(names))


import vllm  # noqa: E402

VLLM_ROOT = os.path.dirname(os.path.dirname(vllm.__file__))
for _name in PRELOAD:
    importlib.import_module(_name)
_swapped = [n for n in sorted(sys.modules) if n.startswith("vllm.") and kvlab_name(n) is not None]
for _name in _swapped:
    del sys.modules[_name]
sys.meta_path.insert(0, _Finder())
for _name in _swapped:
    importlib.import_module(_name)


def _rebind_preloaded() -> None:
    """vLLM's preloaded infrastructure (the engine core, say) imported names from modules now
    swapped for kvlab's: it would call vLLM's ``is_full_attention_spec`` on kvlab's specs. Each
    such name is pointed at kvlab's object of the same name, where kvlab has one."""
    swapped = set(_swapped)
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("vllm.") or mod_name in swapped or mod_name in MAPPED or module is None:
            continue
        for attr, value in list(vars(module).items()):
            source = getattr(value, "__module__", None)
            if source in swapped and getattr(value, "__name__", None) == attr:
                replacement = getattr(sys.modules[source], attr, None)
                if replacement is not None and not isinstance(replacement, _MissingMeta):
                    setattr(module, attr, replacement)


_rebind_preloaded()
atexit.register(_report)

# --- TRANSLATIONS: call shapes kvlab keeps on purpose -----------------------------------------
import kvlab.core.kv_cache_manager as _manager  # noqa: E402
import kvlab.core.kv_cache_utils as _utils  # noqa: E402
import kvlab.core.sched.scheduler as _scheduler  # noqa: E402  (kvlab's scheduler keeps kvlab's own manager class)
import kvlab.distributed.kv_events as _events  # noqa: E402
import kvlab.distributed.kv_publisher as _publisher  # noqa: E402
import kvlab.engine.llm_engine  # noqa: E402,F401
import kvlab.engine.vllm_config as _vllm_config  # noqa: E402


_KvlabManager = _manager.KVCacheManager


class KVCacheManager(_KvlabManager):
    """1. ``get_computed_blocks``: vLLM returns (blocks, tokens, shared_prefix_boundary) and
    its scheduler sets the boundary on the request; kvlab's public API returns the pair and
    sets the boundary itself. Through the adapter the request keeps what it had, as vLLM's
    manager leaves it (a test that pins the junction sets it, as vLLM's scheduler does).
    ``get_computed_blocks_for_connector`` returns vLLM's four values in kvlab too; only the
    boundary kvlab leaves on the request is put back."""

    def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(request, "shared_prefix_boundary", 0)
        blocks, num_tokens = super().get_computed_blocks(request, *args, **kwargs)
        boundary = request.shared_prefix_boundary
        request.shared_prefix_boundary = before
        return blocks, num_tokens, boundary

    def get_computed_blocks_for_connector(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(request, "shared_prefix_boundary", 0)
        out = super().get_computed_blocks_for_connector(request, *args, **kwargs)
        request.shared_prefix_boundary = before
        return out


_manager.KVCacheManager = KVCacheManager  # type: ignore[misc]


class _InKvlabShape:
    """1, the other way: a manager a vLLM test hands kvlab's scheduler (a stub, or one built
    through the adapter) answers ``get_computed_blocks`` in vLLM's shape; kvlab's scheduler
    reads kvlab's -- the pair, the boundary left on the request. Everything else passes."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        blocks, num_tokens, request.shared_prefix_boundary = self._manager.get_computed_blocks(request, *args, **kwargs)
        return blocks, num_tokens


_local_hit = _scheduler.Scheduler._get_local_prefix_cache_hit


def _get_local_prefix_cache_hit(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    manager = self.kv_cache_manager
    if getattr(type(manager), "get_computed_blocks", None) is not _KvlabManager.get_computed_blocks:
        self = SimpleNamespace(connector=self.connector, kv_cache_manager=_InKvlabShape(manager))
    return _local_hit(self, request, *args, **kwargs)


_scheduler.Scheduler._get_local_prefix_cache_hit = _get_local_prefix_cache_hit  # type: ignore[method-assign]


# 2. ``block.block_hash``: vLLM's is the cache key (hash + group id), which kvlab calls
#    ``cache_key``; kvlab's ``block_hash`` is the plain hash (the value in request.block_hashes).
def _cache_key_as_block_hash(utils: Any) -> None:
    utils.KVCacheBlock.block_hash = property(lambda self: self.cache_key)


_cache_key_as_block_hash(_utils)

# 3. The publishers: vLLM keeps them in kv_events; kvlab in kv_publisher (kv_events is part
#    of the core, which imports no ZeroMQ).
for _name in ("EventPublisher", "EventPublisherFactory", "NullEventPublisher", "ZmqEventPublisher"):
    setattr(_events, _name, getattr(_publisher, _name))

# 6. ``create_kv_cache_views``: vLLM keeps it in kv_cache_interface; kvlab in
#    kvlab.worker.kv_cache_views (kv_cache_interface is part of the core, which imports no torch).
import kvlab.kv_cache_interface as _interface  # noqa: E402
import kvlab.worker.kv_cache_views as _views  # noqa: E402

_interface.create_kv_cache_views = _views.create_kv_cache_views  # type: ignore[attr-defined]


# 4. ``generate_block_hash_extra_keys``: vLLM returns (keys, the multimodal index the next
#    block resumes from); kvlab's returns the keys alone -- it is the ``extra_keys_fn`` seam a
#    learner's function replaces -- and ``generate_block_hash_extra_keys_and_next_mm`` gives
#    the pair.
def _extra_keys_with_next_mm(utils: Any) -> None:
    utils.generate_block_hash_extra_keys = utils.generate_block_hash_extra_keys_and_next_mm


_extra_keys_with_next_mm(_utils)


# 5. The scheduler's constructor: vLLM's takes the engine config and builds the manager and the
#    connector itself; kvlab's core takes them built (the core imports no connector), and
#    ``kvlab.engine.vllm_config`` builds them from vLLM's config.
class Scheduler(_scheduler.Scheduler):
    def __init__(
        self,
        *args: Any,
        vllm_config: Any = None,
        kv_cache_config: Any = None,
        structured_output_manager: Any = None,
        block_size: int | None = None,
        hash_block_size: int | None = None,
        mm_registry: Any = None,
        include_finished_set: bool = False,
        log_stats: bool = False,
        **kwargs: Any,
    ) -> None:
        if vllm_config is None:
            super().__init__(*args, **kwargs)
            return
        super().__init__(
            **_vllm_config.scheduler_kwargs_from_vllm_config(vllm_config, kv_cache_config, block_size, hash_block_size, log_stats)
        )
        self.structured_output_manager = structured_output_manager


_scheduler.Scheduler = Scheduler  # type: ignore[misc]


# 7. A secondary tier's ``primary_kv_view``: kvlab's base refuses a 1-D memoryview (the CPU
#    tier's rows are 2-D; a flat view would make every "chunk" one byte); vLLM takes any view
#    and some of its tests hand a few flat bytes as a placeholder. The adapter passes such a
#    view on as a proxy with the same strides, which kvlab's base takes as it takes vLLM's mocks.
import kvlab.kv_offload.tiering.base as _tier_base  # noqa: E402


class _FlatView:
    def __init__(self, view: memoryview) -> None:
        self._view = view
        self.strides = view.strides

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


_tier_init = _tier_base.SecondaryTierManager.__init__


def _secondary_tier_init(self: Any, offloading_spec: Any, primary_kv_view: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(primary_kv_view, memoryview) and primary_kv_view.ndim == 1:
        primary_kv_view = _FlatView(primary_kv_view)
    _tier_init(self, offloading_spec, primary_kv_view, *args, **kwargs)


_tier_base.SecondaryTierManager.__init__ = _secondary_tier_init  # type: ignore[method-assign]


# vLLM's tests reload kv_cache_utils (to re-read PYTHONHASHSEED): the reloaded module gets
# translations 2 and 4 again.
_reload = importlib.reload


def _reload_translated(module: Any) -> Any:
    out = _reload(module)
    if getattr(out, "__name__", None) == _utils.__name__:
        for translate in (_cache_key_as_block_hash, _extra_keys_with_next_mm):
            translate(out)
    return out


importlib.reload = _reload_translated  # type: ignore[assignment]
