"""The KV connector interface (vLLM: ``KVConnectorBase_V1`` in
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``; lessons 12 and 13).

A connector lets KV come from somewhere other than the model's own forward pass -- a CPU or
disk tier behind the GPU pool, another engine that ran the prefill -- and lets KV leave for
there. vLLM splits every connector in two halves with the same class and a *role*:

* the **scheduler** half (``KVConnectorRole.SCHEDULER``) decides. When a waiting request's
  local prefix hit ends, the scheduler asks ``get_num_new_matched_tokens(request,
  num_computed_tokens)``: how many more tokens can you supply? Those become *external
  computed tokens*: the KV-cache manager allocates blocks for them
  (``allocate_slots(..., num_external_computed_tokens=n)``) and the model never computes
  them. ``update_state_after_alloc`` tells the connector which blocks it must fill;
  ``build_connector_meta`` packs this step's loads and saves into a
  :class:`KVConnectorMetadata` that travels to the worker with the ``SchedulerOutput``;
  ``request_finished`` is called once before a finished request's blocks are freed.
* the **worker** half (``KVConnectorRole.WORKER``) moves bytes. The model runner binds the
  step's metadata, calls ``start_load_kv()`` before the forward pass,
  ``wait_for_layer_load(layer)`` before each layer's attention reads the cache,
  ``save_kv_layer(layer, kv, meta)`` after each layer wrote it, and ``wait_for_save()`` at the
  end of the step. Blocks that failed to load are reported by
  ``get_block_ids_with_load_errors()``; the scheduler recomputes them.

kvlab's own connectors move their bytes inside the step (vLLM's "sync load" path). The
scheduler also runs vLLM's asynchronous path, for a connector that answers
``load_kv_async=True``: the request holds its blocks in ``WAITING_FOR_REMOTE_KVS`` until the
worker reports the load in ``KVConnectorOutput.finished_recving`` (or failed:
``failed_recving``, ``invalid_block_ids``); and a ``request_finished`` that returns True
keeps a finished request's blocks until ``finished_sending`` names it. Layers are named
``"layers.{i}"``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from kvlab.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.metrics.kv_connector_stats import KVConnectorStats
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request


def layer_name(layer_idx: int) -> str:
    """kvlab's name for a layer in the connector hooks (vLLM passes module paths)."""
    return f"layers.{layer_idx}"


class SupportsHMA(ABC):
    """A connector that works with the hybrid memory allocator (vLLM's name, "HMA": several
    KV-cache groups -- full attention beside a window or a Mamba state -- in one pool). At a
    request's finish it is given every group's block table, not just the first group's:
    a hybrid model's KV is not whole without the other groups' blocks. The scheduler asks
    ``request_finished_all_groups`` instead of ``request_finished`` of such a connector."""

    @abstractmethod
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Called once before a finished request's blocks are freed, with each group's
        table (cut to the computed tokens). As ``request_finished``: True keeps the blocks
        until the worker reports the request in ``finished_sending``; the dict is the
        request's ``kv_transfer_params``."""


def supports_hma(connector: Any) -> bool:
    """Whether ``connector`` (an instance or a class) is a :class:`SupportsHMA` connector."""
    return issubclass(connector, SupportsHMA) if isinstance(connector, type) else isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    """Where this half of a connector runs: beside the scheduler, or in the worker."""

    SCHEDULER = 0
    WORKER = 1


@dataclass(slots=True)
class KVConnectorTransferResults:
    """The worker's asynchronous transfers that ended since the last report (vLLM 0.33's
    name). A failed receive is also in ``finished_recving``: the request leaves its wait
    either way, and the scheduler recomputes what did not arrive."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class KVConnectorMetadata:  # noqa: B903 - a base class the connectors extend
    """What the scheduler half tells the worker half for one step (subclassed by each
    connector; travels as ``SchedulerOutput.kv_connector_metadata``)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """Base class of every connector. Subclasses implement the abstract hooks of both roles;
    each instance serves the one ``role`` it was built for."""

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Whether this connector can complete a *divergent* local hit on a Mamba hybrid
        (vLLM 0.33): start from full attention's deeper hit and bring the lagging Mamba
        state itself, as vLLM's P2P connectors do. Then the scheduler looks the request up
        with ``KVCacheManager.get_computed_blocks_for_connector``. False by default: none of
        kvlab's connectors moves Mamba states (and kvlab's scheduler refuses one that says
        True on a Mamba hybrid)."""
        return False

    def __init__(self, vllm_config: Any = None, role: KVConnectorRole | None = None, kv_cache_config: Any = None) -> None:
        """kvlab's call, ``(role)``, or vLLM 0.33's, ``(vllm_config, role, kv_cache_config)``:
        a connector written for vLLM passes its engine config and the KV-cache config on, and
        reads its own settings from ``self._kv_transfer_config`` as in vLLM."""
        if role is None and kv_cache_config is None:
            vllm_config, role = None, vllm_config  # kvlab's (role)
        elif vllm_config is not None and not hasattr(vllm_config, "kv_transfer_config"):
            raise TypeError(
                "a connector is built as (role) in kvlab or (vllm_config, role, kv_cache_config) as in vLLM; "
                f"vllm_config must be a VllmConfig (with kv_transfer_config), got {type(vllm_config).__name__}"
            )
        if not isinstance(role, KVConnectorRole):
            raise TypeError(f"role must be a KVConnectorRole (SCHEDULER or WORKER), got {role!r}")
        self._role = role
        self._vllm_config = vllm_config
        self._kv_transfer_config = None if vllm_config is None else vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: KVConnectorMetadata | None = None
        self._kv_cache_manager: KVCacheManager | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    def _check_role(self, role: KVConnectorRole, hook: str) -> None:
        if self._role is not role:
            raise RuntimeError(
                f"{type(self).__name__}.{hook} is a {role.name.lower()}-side hook, but this connector was built with role={self._role.name}"
            )

    # ==============================  worker side  ==============================
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The model runner hands over the step's metadata before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """... and takes it back after the step."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: the model runner binds it before start_load_kv")
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: Any) -> None:
        """The runner's per-layer paged caches (``[num_blocks, 2, block_size, kv_heads,
        head_dim]`` each), as vLLM registers them: ``{layer name: cache}``, kvlab's layers
        named ``"layers.{i}"`` in layer order (empty for the simulated executor, which has
        no tensors)."""
        return

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Load the KV this step's metadata asks for into the paged cache (before the
        forward pass; kvlab's loads finish before this returns)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (layer-by-layer pipelining; a no-op
        when loads are synchronous)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving one layer's KV from the paged cache, right after the layer wrote it."""

    @abstractmethod
    def wait_for_save(self, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        """Finish this step's saves (called once per step, after the forward pass).
        ``skip_req_ids`` (kvlab): requests the runner left out of this step's forward pass
        because their KV failed to load -- their blocks hold nothing worth saving."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous send / receive finished since the last call: (sends of
        finished requests whose ``request_finished`` returned True, loads of requests the
        scheduler holds in ``WAITING_FOR_REMOTE_KVS``). ``finished_req_ids``: the requests
        that finished this step. kvlab's own connectors move their bytes within the step:
        nothing."""
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` together with the receives that failed (vLLM 0.33; the executor
        calls this one)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step whose load failed: the scheduler recomputes them."""
        return set()

    def build_connector_worker_meta(self) -> Any:
        """The worker's report to the scheduler half (completed jobs, failures)."""
        return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called on the worker every step, before the step's metadata is bound (vLLM 0.33):
        a connector whose stores may still read a preempted request's blocks finishes them
        here, before the forward pass writes other requests' KV into those blocks."""
        return

    def shutdown(self) -> None:
        return

    # ==============================  scheduler side  ==============================
    #: The tier a connector's hits come from when it does not split them (vLLM 0.33's
    #: default): a connector that knows its tiers overrides ``get_external_cache_hit_sources``.
    _cache_hit_source: CacheHitSource = CacheHitSource.EXTERNAL_UNSPECIFIED

    def on_new_request(self, request: Request) -> None:
        """A request was added to the scheduler (vLLM 0.33), before anything is looked up:
        a connector may start a slow lookup for it now, to have the answer when asked."""
        return

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Where this request's ``num_external_tokens`` came from, per tier (only non-zero
        counts; they add up to ``num_external_tokens``). The scheduler asks after the load is
        planned, for the prefix-cache stats; by default all of them from ``_cache_hit_source``."""
        if num_external_tokens == 0:
            return {}
        return {self._cache_hit_source: num_external_tokens}

    def has_pending_block_frees(self) -> bool:
        """Whether this connector will soon give GPU blocks back (vLLM 0.33): then a request
        that does not fit waits for them instead of preempting a running one."""
        return False

    def has_pending_push_work(self) -> bool:
        """Whether this connector still has work to push with no request left to schedule
        (vLLM 0.33): the engine keeps stepping until it is done."""
        return False

    def reset_cache(self) -> bool | None:
        """Forget every block this connector keeps (vLLM 0.33, with ``reset_prefix_cache``).
        False: it could not now; None or True: done."""
        return None

    # ------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler binds its manager once (vLLM 0.33 does the same): the connector reads
        block tables and emits events into the manager's event log through it. Then the GPU
        pool is offered to ``bind_gpu_block_pool``, as in vLLM."""
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's hook for a connector that follows the GPU pool itself (ref counts, its
        prefix-cached blocks); none of kvlab's does."""
        return

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The paged-cache layout this connector needs the worker to allocate (vLLM's names:
        "NHD", "HND", "LBHNC", "BLHNC"); None: any."""
        return None

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The KV-cache groups this connector's load restores for ``request`` (asked once it
        has matched tokens). By default the prefix-cacheable groups, which is all a store
        addressed by block hashes holds; a connector that moves the request's own blocks
        (prefill to decode) restores every group. A DeepSeek-V4.1 window group is restored
        only by the latter, and then its window need not be replayed (vLLM 0.33)."""
        mgr = self._kv_cache_manager
        if mgr is None:
            raise RuntimeError("no KV cache manager is bound: the scheduler binds it before it asks")
        return tuple(i for i, spec in enumerate(mgr.kv_cache_groups) if spec.prefix_cacheable)

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond the local hit (``num_computed_tokens``) the connector can
        supply, and whether it loads them asynchronously. ``None``: ask again next step.
        May be called several times for a request the admission gate turns away, so it
        changes nothing that matters."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The request was admitted: ``blocks`` is its whole block table; the last
        ``num_external_tokens`` tokens of the computed prefix are the connector's to fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Pack this step's loads and saves for the worker (must not change the output)."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker's report for the step (completions, failures)."""
        return

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once before a finished request's blocks are freed. ``True`` would mean "I
        am still sending them, free later" (kvlab's connectors are synchronous: always
        False); the dict is handed back with the request's output (vLLM's
        ``kv_transfer_params``)."""
        return False, None

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        """A finishing request's Mamba states saved inside a block that no copy preserved
        (``KVCacheManager.finalize_partial_tail_offloads``: [(group id, block id, tokens)]),
        offered before its blocks are cleaned up -- only to a connector of a KV producer.
        True: the connector takes them, and the blocks stay held until the worker reports the
        request in ``finished_sending``. By default declined (vLLM 0.33)."""
        return False

    # -- metrics (vLLM 0.33) ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This connector's metrics since the last call (reset), or None: the scheduler puts
        them in its step's stats (``kv_connector_stats``)."""
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """The payload object this connector's stats ``data`` stands for (a payload crosses
        processes as plain data), or None for a connector that keeps no metrics."""
        return None

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]
    ) -> Any:
        """This connector's Prometheus metrics (a ``KVConnectorPromMetrics``; see
        ``kv_connector/v1/metrics.py``), or None for a connector that exports none."""
        return None

    def take_events(self) -> Iterable[Any]:
        """vLLM KV-cache events of the tiers this connector owns (``BlockStored`` /
        ``BlockRemoved`` with ``medium`` "CPU" or "STORAGE")."""
        return ()
