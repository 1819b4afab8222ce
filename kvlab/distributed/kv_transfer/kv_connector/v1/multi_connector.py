"""Several KV connectors as one (vLLM 0.33: ``MultiConnector`` in
``vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py``).

A deployment often wants two things from the KV that leaves the GPU: hand it to a decode
engine (a P/D connector) *and* keep it in a CPU or disk tier for the next request with the
same prefix (an offloading connector). The scheduler holds one connector, so vLLM wraps the
children in a ``MultiConnector``, configured as::

    KVTransferConfig(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {...}},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", ...},
    ]})

Its rules, which are vLLM's:

* **load from one**: ``get_num_new_matched_tokens`` asks every child, in the configured order,
  and the first that offers tokens serves the request's load. Only that child is told the
  external tokens in ``update_state_after_alloc``; the others are given the request's blocks
  with 0 external tokens (they may still want to save them). Loading from two children would
  fill the same blocks twice.
* **save to all**: every hook that saves, steps or reports goes to every child, in order; each
  child gets its own metadata (``MultiKVConnectorMetadata`` holds one per child, in the same
  order) and its own worker report (``MultiKVConnectorWorkerMetadata``).
* **free once all are done**: a finished request whose blocks two children still send
  (``request_finished`` returned True twice) must not be freed at the first child's
  ``finished_sending``. The scheduler half counts the *extra* senders per request and passes
  the count to the worker half in the metadata; the worker half hides a request's first
  ``finished_sending`` reports until only the last one is left.
* **stats apart**: metrics are kept per child class (``MultiKVConnectorStats``), since summing
  one connector's transfer times into another's would mean nothing.

In kvlab a ``MultiConnector`` is built as vLLM builds it, ``MultiConnector(vllm_config, role,
kv_cache_config)`` (any object with vLLM's attribute names will do as ``vllm_config``); its
children are built by ``KVConnectorFactory.create_connector`` from a copy of the config whose
``kv_transfer_config`` is the child's, so kvlab's own connectors can be children too.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from kvlab.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from kvlab.logger import init_logger
from kvlab.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request

__all__ = [
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorPromMetrics",
    "MultiKVConnectorStats",
    "MultiKVConnectorWorkerMetadata",
]

logger = init_logger(__name__)


def _factory() -> Any:
    """``KVConnectorFactory``. The factory sits above this package (it imports the connectors
    defined here), so it is looked up when asked for, as ``metrics.py`` does."""
    return importlib.import_module("kvlab.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory


def _child_entries(kv_transfer_config: Any) -> list[dict[str, Any]]:
    """The ``connectors`` list of a MultiConnector's transfer config, checked."""
    entries = kv_transfer_config.kv_connector_extra_config.get("connectors")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(
            "MultiConnector needs kv_connector_extra_config={'connectors': [<one dict of KVTransferConfig fields per child>, ...]}, "
            f"got connectors={entries!r}"
        )
    return entries


def _child_transfer_config(kv_transfer_config: Any, index: int, entry: dict[str, Any]) -> KVTransferConfig:
    """Child ``index``'s transfer config: its own entry, with the parent's ``engine_id`` unless
    it names one (every child serves the same engine)."""
    try:
        return KVTransferConfig(**{"engine_id": kv_transfer_config.engine_id, **entry})
    except TypeError as e:
        allowed = sorted(f.name for f in dataclasses.fields(KVTransferConfig))
        raise TypeError(
            f"kv_connector_extra_config['connectors'][{index}]: {e}; a child's keys are KVTransferConfig's fields {allowed}"
        ) from None


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    """One step's metadata for every child, in the children's order; and the extra senders
    counted since the last step (request id -> senders beyond the first), for the worker half."""

    metadata: tuple[KVConnectorMetadata, ...]
    extra_async_saves: dict[str, int] | None = None


@dataclass
class MultiKVConnectorWorkerMetadata:
    """Every child's worker report, in the children's order (None: that child had nothing to
    say). Reports of several workers merge child by child."""

    metadata: tuple[Any, ...]

    def aggregate(self, other: MultiKVConnectorWorkerMetadata) -> MultiKVConnectorWorkerMetadata:
        if not isinstance(other, MultiKVConnectorWorkerMetadata):
            raise TypeError(f"other must be a MultiKVConnectorWorkerMetadata, got {type(other).__name__}")
        if len(other.metadata) != len(self.metadata):
            raise ValueError(f"cannot merge reports of {len(self.metadata)} and {len(other.metadata)} connectors")
        merged = [a if b is None else b if a is None else a.aggregate(b) for a, b in zip(self.metadata, other.metadata)]
        return MultiKVConnectorWorkerMetadata(metadata=tuple(merged))

    # kvlab's executor reads three more things off a worker report (``KVConnectorOutput``'s
    # ``num_loaded_tokens``, ``num_stored_tokens``: the simulated clock charges the copies;
    # ``errors``: why a load failed). vLLM has no such fields; here they are the children's,
    # merged: token counts add up per medium, error messages are joined per request.
    def _counts(self, name: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for child in self.metadata:
            for medium, n in (getattr(child, name, None) or {}).items():
                total[medium] = total.get(medium, 0) + n
        return total

    @property
    def num_loaded_tokens(self) -> dict[str, int]:
        return self._counts("num_loaded_tokens")

    @property
    def num_stored_tokens(self) -> dict[str, int]:
        return self._counts("num_stored_tokens")

    @property
    def errors(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for child in self.metadata:
            for req_id, why in (getattr(child, "errors", None) or {}).items():
                merged[req_id] = f"{merged[req_id]}; {why}" if req_id in merged else why
        return merged


@dataclass
class MultiKVConnectorStats(KVConnectorStats):
    """One payload per child connector class, keyed by its class name (``data``: name ->
    that connector's ``KVConnectorStats``). Each is aggregated, reduced and reset by its own
    rules; the key is also how the frontend finds the class that rebuilds a payload that
    crossed processes as plain data (``MultiConnector.build_kv_connector_stats``)."""

    def to_dict(self) -> dict[str, Any]:
        return {name: stats.to_dict() for name, stats in self.data.items()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Merge ``other``'s payloads into this one (in place; returns self): a connector seen
        in both is aggregated by its own class, one new here is taken as it is."""
        if not isinstance(other, MultiKVConnectorStats):
            raise TypeError(f"other must be a MultiKVConnectorStats, got {type(other).__name__}")
        for name, stats in other.data.items():
            if name not in self.data:
                self[name] = stats
                continue
            mine = self[name]
            if not isinstance(stats, type(mine)):
                raise TypeError(f"cannot aggregate {name}'s {type(stats).__name__} into its {type(mine).__name__}")
            self[name] = mine.aggregate(stats)
        return self

    def reset(self) -> None:
        for stats in self.data.values():
            stats.reset()

    def reduce(self) -> dict[str, Any]:
        """Each connector's numbers under its name (one log line shows them all)."""
        return {name: stats.reduce() for name, stats in self.data.items()}

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())

    def __getitem__(self, connector_id: str) -> KVConnectorStats:
        stats: KVConnectorStats = self.data[connector_id]
        return stats

    def __setitem__(self, connector_id: str, stats: KVConnectorStats) -> None:
        self.data[connector_id] = stats


class MultiKVConnectorPromMetrics(KVConnectorPromMetrics):
    """The children's Prometheus metrics, one per child class (``prom_metrics``: class name ->
    its ``KVConnectorPromMetrics``). A payload is split by connector and each part goes to its
    own metrics; a child that keeps stats but exports no metrics is skipped."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[Any]],
        prom_metrics: dict[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._prom_metrics = prom_metrics

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, data in transfer_stats_data.items():
            metrics = self._prom_metrics.get(name)
            if metrics is not None:
                metrics.observe(data, engine_idx)


class MultiConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads each request from the first child that has its tokens, saves to every child (see
    the module's docstring). Every hook of ``KVConnectorBase_V1`` is forwarded to the
    children; ``SupportsHMA`` is declared by the class, and honoured per request only when
    every child supports the hybrid allocator (``_all_support_hma``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._kv_transfer_config is None:
            raise TypeError(
                "MultiConnector is built as in vLLM, MultiConnector(vllm_config, role, kv_cache_config), from a config naming its children"
            )
        # Checked before any child is built: a child may create files or directories.
        _child_entries(self._kv_transfer_config)
        self._all_support_hma = MultiConnector.all_children_support_hma(self._kv_transfer_config)
        scheduler_config = getattr(vllm_config, "scheduler_config", None)
        if not getattr(scheduler_config, "disable_hybrid_kv_cache_manager", False) and not self._all_support_hma:
            raise ValueError(
                "MultiConnector: the hybrid KV cache manager (HMA) is on, but not every child connector supports it "
                "(SupportsHMA); set scheduler_config.disable_hybrid_kv_cache_manager=True"
            )
        factory = _factory()
        self._connectors: list[KVConnectorBase_V1] = []
        self._ktc_kv_transfer_config: list[KVTransferConfig] = []
        for _, child_config in self._get_connector_classes_and_configs(vllm_config):
            self._connectors.append(factory.create_connector(child_config, role, kv_cache_config))
            self._ktc_kv_transfer_config.append(child_config.kv_transfer_config)
        # Scheduler half: request id -> index of the child serving its load.
        self._requests_to_connector: dict[str, int] = {}
        # Request id -> senders beyond the first still to report finished_sending. Counted by
        # the scheduler half at request_finished, sent in the metadata, consumed by the worker
        # half. (Loads need no such count: one child loads a request.)
        self._extra_async_saves: dict[str, int] = {}

    # -- configuration (classmethods: asked before any connector is built) ---------------------
    @classmethod
    def _get_connector_classes_and_configs(cls, vllm_config: Any) -> list[tuple[type[KVConnectorBase_V1], Any]]:
        """Each child's class and a shallow copy of ``vllm_config`` whose
        ``kv_transfer_config`` is the child's own."""
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ValueError("MultiConnector needs vllm_config.kv_transfer_config")
        factory = _factory()
        out: list[tuple[type[KVConnectorBase_V1], Any]] = []
        for i, entry in enumerate(_child_entries(ktc)):
            child_config = copy.copy(vllm_config)
            child_config.kv_transfer_config = _child_transfer_config(ktc, i, entry)
            out.append((factory.get_connector_class(child_config.kv_transfer_config), child_config))
        return out

    @classmethod
    def all_children_support_hma(cls, kv_transfer_config: Any) -> bool:
        """Whether there are children and every one supports the hybrid allocator."""
        if "connectors" not in kv_transfer_config.kv_connector_extra_config:
            return False
        entries = _child_entries(kv_transfer_config)
        factory = _factory()
        return bool(entries) and all(
            factory.supports_hma_config(_child_transfer_config(kv_transfer_config, i, e)) for i, e in enumerate(entries)
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The one layout the children need (None: any). The paged cache is allocated once, in
        one layout, for all of them: two children that need different ones cannot share it."""
        layouts = {
            layout
            for connector_cls, child_config in cls._get_connector_classes_and_configs(vllm_config)
            if (layout := connector_cls.get_required_kvcache_layout(child_config)) is not None
        }
        if len(layouts) > 1:
            raise ValueError(
                f"KV cache layout mismatch: the child connectors need {sorted(layouts)}; all connectors must use the same layout"
            )
        return next(iter(layouts), None)

    @property
    def sub_connectors(self) -> list[KVConnectorBase_V1]:
        """The children, in the configured order (a copy)."""
        return list(self._connectors)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Only if every child can complete such a hit: the scheduler looks the request up once,
        for whichever child ends up loading it."""
        return bool(self._connectors) and all(c.supports_divergent_local_hybrid_hits for c in self._connectors)

    # ==============================  worker side  ==============================
    def register_kv_caches(self, kv_caches: Any) -> None:
        for c in self._connectors:
            c.register_kv_caches(kv_caches)

    def _check_metadata(self, connector_metadata: KVConnectorMetadata) -> MultiKVConnectorMetadata:
        if not isinstance(connector_metadata, MultiKVConnectorMetadata):
            raise TypeError(f"connector_metadata must be a MultiKVConnectorMetadata, got {type(connector_metadata).__name__}")
        if len(connector_metadata.metadata) != len(self._connectors):
            raise ValueError(f"connector_metadata holds {len(connector_metadata.metadata)} parts for {len(self._connectors)} connectors")
        return connector_metadata

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Give each child its own part. The MultiConnector keeps the whole too (the base
        class's binding), so that ``has_connector_metadata()`` answers for it."""
        connector_metadata = self._check_metadata(connector_metadata)
        if connector_metadata.extra_async_saves:
            self._extra_async_saves.update(connector_metadata.extra_async_saves)
        for c, part in zip(self._connectors, connector_metadata.metadata):
            c.bind_connector_metadata(part)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        for c in self._connectors:
            c.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        for c in self._connectors:
            c.start_load_kv(**kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self._connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        for c in self._connectors:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        for c in self._connectors:
            c.wait_for_save(skip_req_ids=skip_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The children's results together. A request two children send is reported sent only
        with its last sender's report: each earlier one uses up one extra sender."""
        results = KVConnectorTransferResults()
        for c in self._connectors:
            child = c.get_transfer_results(finished_req_ids)
            results.finished_recving |= child.finished_recving
            results.failed_recving |= child.failed_recving
            for req_id in child.finished_sending:
                extra = self._extra_async_saves.get(req_id)
                if extra is None:
                    results.finished_sending.add(req_id)
                elif extra == 1:
                    del self._extra_async_saves[req_id]
                else:
                    self._extra_async_saves[req_id] = extra - 1
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed: set[int] = set()
        for c in self._connectors:
            failed |= c.get_block_ids_with_load_errors()
        return failed

    def build_connector_worker_meta(self) -> MultiKVConnectorWorkerMetadata | None:
        """Every child's report in one, or None when no child has anything to report."""
        reports = [c.build_connector_worker_meta() for c in self._connectors]
        if all(r is None for r in reports):
            return None
        return MultiKVConnectorWorkerMetadata(metadata=tuple(reports))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Each child with its own part of the step's metadata."""
        meta = self._check_metadata(kv_connector_metadata)
        for c, part in zip(self._connectors, meta.metadata):
            c.handle_preemptions(part)

    def shutdown(self) -> None:
        """Shut every child down, even after one failed; then raise the last failure."""
        failure: Exception | None = None
        for c in self._connectors:
            try:
                c.shutdown()
            except Exception as e:  # noqa: BLE001 - every child gets its shutdown; the failure is raised below
                logger.exception("Exception during connector %s shutdown.", type(c).__name__)
                failure = e
        if failure is not None:
            raise failure

    # ==============================  scheduler side  ==============================
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Each child binds the manager its own way (and is offered the GPU pool by it)."""
        for c in self._connectors:
            c.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        for c in self._connectors:
            c.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The first child (in order) that offers tokens serves the load. Every child is asked,
        so each sees every request; a child that cannot tell yet (None) makes the answer None,
        and the scheduler asks again next step."""
        answer: tuple[int | None, bool] = (0, False)
        for i, c in enumerate(self._connectors):
            num_tokens, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                return None, False
            if answer[0] == 0 and num_tokens > 0:
                self._requests_to_connector[request.request_id] = i
                answer = (num_tokens, load_async)
        return answer

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The groups the serving child's load restores."""
        chosen = self._requests_to_connector.get(request.request_id)
        if chosen is None:
            raise RuntimeError(
                f"MultiConnector: no child connector serves request {request.request_id!r}; "
                "ask get_loaded_kv_cache_group_ids after get_num_new_matched_tokens offered tokens"
            )
        return self._connectors[chosen].get_loaded_kv_cache_group_ids(request)

    def on_new_request(self, request: Request) -> None:
        for c in self._connectors:
            c.on_new_request(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The serving child's split: only it loaded anything."""
        chosen = self._requests_to_connector.get(request.request_id)
        if chosen is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self._connectors[chosen].get_external_cache_hit_sources(request, num_external_tokens)

    def has_pending_block_frees(self) -> bool:
        return any(c.has_pending_block_frees() for c in self._connectors)

    def has_pending_push_work(self) -> bool:
        return any(c.has_pending_push_work() for c in self._connectors)

    def reset_cache(self) -> bool:
        """Every child is asked, even after one could not (each forgets what it can); done
        only if none said False."""
        results = [c.reset_cache() is not False for c in self._connectors]
        return all(results)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The serving child is told the external tokens; every other child gets the request's
        blocks with 0 of them (it loads nothing, but may save the blocks later)."""
        chosen = self._requests_to_connector.get(request.request_id)
        for i, c in enumerate(self._connectors):
            c.update_state_after_alloc(request, blocks, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        meta = MultiKVConnectorMetadata(metadata=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors))
        if self._extra_async_saves:  # sent once: the worker half keeps counting from here
            meta.extra_async_saves, self._extra_async_saves = self._extra_async_saves, {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees the step's output with its own worker report in
        ``kv_connector_worker_meta`` (and, kvlab's field, its own load ``errors``, when the
        record has them); the output is given back as it came."""
        multi = connector_output.kv_connector_worker_meta
        if multi is not None and not isinstance(multi, MultiKVConnectorWorkerMetadata):
            raise TypeError(
                f"connector_output.kv_connector_worker_meta must be a MultiKVConnectorWorkerMetadata or None, got {type(multi).__name__}"
            )
        has_errors = hasattr(connector_output, "errors")  # kvlab's record; vLLM's has none
        errors = connector_output.errors if has_errors else None
        try:
            for i, c in enumerate(self._connectors):
                if multi is not None:
                    child = multi.metadata[i]
                    connector_output.kv_connector_worker_meta = child
                    if has_errors:
                        connector_output.errors = dict(getattr(child, "errors", None) or {})
                c.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = multi
            if has_errors:
                connector_output.errors = errors  # type: ignore[assignment]  # has_errors: it was a dict

    def _aggregate_request_finished(
        self, request: Request, per_connector: Callable[[KVConnectorBase_V1], tuple[bool, dict[str, Any] | None]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Ask every child; the blocks are kept while any child still sends them (the senders
        beyond the first are counted for the worker half), and the children's transfer params
        are merged -- a key two children both set is an error, not a silent overwrite."""
        senders = 0
        params: dict[str, Any] | None = None
        for c in self._connectors:
            sends, child_params = per_connector(c)
            senders += bool(sends)
            if child_params is None:
                continue
            if params is None:
                params = child_params
                continue
            clashes = set(params) & set(child_params)
            if clashes:
                raise RuntimeError(f"Key clash in kv_transfer_params from multiple connectors: {clashes}")
            params.update(child_params)
        if senders > 1:
            self._extra_async_saves[request.request_id] = senders - 1
        self._requests_to_connector.pop(request.request_id, None)
        return senders > 0, params

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._aggregate_request_finished(request, lambda c: c.request_finished(request, block_ids))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Every group's table to children that all support the hybrid allocator; with one that
        does not, only a single-group request can be finished (its one table)."""
        if not self._all_support_hma:
            if len(block_ids) != 1:
                raise ValueError(
                    f"request {request.request_id!r} has {len(block_ids)} KV-cache groups, but not every child connector "
                    "supports HMA (SupportsHMA): a hybrid model needs children that do"
                )
            return self.request_finished(request, block_ids[0])
        return self._aggregate_request_finished(
            request,
            lambda c: cast(SupportsHMA, c).request_finished_all_groups(request, block_ids),
        )

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        """Offered to every child (each may keep the states); the blocks are held if any took them."""
        accepted = [c.register_finished_partial_tail(request, block_ids, partial_tail_offloads) for c in self._connectors]
        return any(accepted)

    def undo_shared_objects(self) -> list[Any]:
        """What kvlab's engine must share, not copy, when it undoes an interrupted step by
        deep-copying this connector's books: every child's (a spec-built offloading child
        keeps the requests whose stores are still in flight)."""
        out: list[Any] = []
        for c in self._connectors:
            more = getattr(c, "undo_shared_objects", None)
            if callable(more):
                out.extend(more())
        return out

    def take_events(self) -> Iterable[Any]:
        for c in self._connectors:
            yield from c.take_events()

    # -- metrics -----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The children's payloads by class name (two children of one class are aggregated),
        or None when no child has any."""
        out: MultiKVConnectorStats | None = None
        for c in self._connectors:
            stats = c.get_kv_connector_stats()
            if stats is None:
                continue
            if out is None:
                out = MultiKVConnectorStats()
            name = type(c).__name__
            out[name] = out[name].aggregate(stats) if name in out.data else stats
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """The payload ``data`` stands for: connector name -> its payload, either the object
        itself (same process) or its plain data (it crossed processes), which the class
        registered under that name rebuilds. A connector whose class keeps no stats (builds
        None) is left out; an unregistered name is an error."""
        if data is None:
            return MultiKVConnectorStats()
        rebuilt: dict[str, KVConnectorStats] = {}
        for name, value in data.items():
            if isinstance(value, KVConnectorStats):
                rebuilt[name] = value
                continue
            stats = _factory().get_connector_class_by_name(name).build_kv_connector_stats(data=value)
            if stats is not None:
                rebuilt[name] = stats
        return MultiKVConnectorStats(data=rebuilt)

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]
    ) -> KVConnectorPromMetrics:
        """Each child class's metrics, built once per class (two children of one class share
        their series, as they share their stats key)."""
        prom_metrics: dict[str, KVConnectorPromMetrics] = {}
        seen: set[type] = set()
        for connector_cls, child_config in cls._get_connector_classes_and_configs(vllm_config):
            if connector_cls in seen:
                continue
            seen.add(connector_cls)
            metrics = connector_cls.build_prom_metrics(child_config, metric_types, labelnames, per_engine_labelvalues)
            if metrics is not None:
                prom_metrics[connector_cls.__name__] = metrics
        return MultiKVConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, prom_metrics)
