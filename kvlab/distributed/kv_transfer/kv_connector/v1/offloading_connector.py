"""The offloading connector: CPU and disk tiers behind the GPU pool (vLLM:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``; lesson 12).

Without it, a cached prefix lives only as long as its blocks stay in the GPU pool: once
LRU eviction reuses them, the next request with that prefix recomputes it. With it, every
prompt block the engine computes is also copied to host memory (and from there to a file),
each tier with its own LRU; a prefix that left the GPU pool is still found in a tier and
*loaded* back -- a copy instead of a prefill. The scheduler sees those blocks as external
computed tokens.

Which blocks: a model with one full-attention group, that group's; under HiSparse (vLLM
0.33) the indexer group's alone -- the source K/V already lives whole in HiSparse's host
pool -- and a load never reaches past the prefix the host pool still holds
(``_max_loadable_tokens``), since nothing would fill the source K/V beyond it.

One class, two roles, as in vLLM: built with ``KVConnectorRole.SCHEDULER`` it keeps the
tiers' books (:mod:`...offloading.staged_scheduler`), with ``KVConnectorRole.WORKER`` it moves the
bytes (:mod:`...offloading.worker`). Both are built from the same ``KVTransferConfig``
(``kv_connector="OffloadingConnector"``; extra config ``num_cpu_blocks``,
``storage_path`` and ``num_storage_blocks`` for a disk tier, ``offload_prompt_only``,
``self_describing_kv_events``; the CPU
tier's ``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``; the disk tier's
``backpressure``).

Built with vLLM 0.33's call, ``OffloadingConnector(vllm_config, role, kv_cache_config)``,
and an extra config that names an offloading *spec* (``spec_name``, ``spec_module_path`` or
vLLM's CPU size ``cpu_bytes_to_use``), the connector runs vLLM's own halves instead:
:class:`...offloading.scheduler.OffloadingConnectorScheduler` and
:class:`...offloading.worker.OffloadingConnectorWorker`, both over the backend
``OffloadingSpecFactory.create_spec(build_offloading_config(vllm_config, kv_cache_config))``
returns -- every hook delegated as vLLM's connector delegates it (stores one step late,
loads asynchronous unless the spec's ``sync_load_budget_bytes`` lets them run in the step).
vLLM's call without a spec key builds kvlab's staged tiers, as before; a spec key beside one
that only kvlab's tiers read (``num_cpu_blocks``, ``storage_path``, ``num_storage_blocks``)
is refused: which tiers would that be?
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from functools import cached_property
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata, OffloadingWorkerMetadata
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
    get_offloading_group_ids,
    resolve_blocks_per_chunk,
)
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.staged_scheduler import StagedOffloadingConnectorScheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker, StagedOffloadingConnectorWorker
from kvlab.kv_offload.base import OffloadingSpec
from kvlab.kv_offload.factory import OffloadingSpecFactory
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.tiering.factory import create_backpressure_detector
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.staged import StagedTieringManager
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.utils.checks import check_int

if TYPE_CHECKING:
    from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.outputs import KVConnectorOutput
    from kvlab.request import Request

_KNOWN = {
    "num_cpu_blocks",
    "storage_path",
    "num_storage_blocks",
    "offload_prompt_only",
    "eviction_policy",
    "cache_policy_module_path",
    "store_threshold",
    "backpressure",
    "self_describing_kv_events",
    "block_size",
    "blocks_per_chunk",
}
#: Keys that name a spec-built backend (vLLM 0.33's): with vLLM's call they select it.
_SPEC_KEYS = frozenset({"spec_name", "spec_module_path", "cpu_bytes_to_use"})
#: Keys only kvlab's staged tiers read: beside a spec key they are a contradiction.
_STAGED_ONLY_KEYS = frozenset({"num_cpu_blocks", "storage_path", "num_storage_blocks"})


def builds_spec_halves(extra_config: Any) -> bool:
    """Whether vLLM's call with this extra config builds vLLM's spec-built halves (a spec
    key is present) rather than kvlab's staged tiers. A spec key beside a key only the
    staged tiers read is refused, naming both."""
    spec_keys = sorted(_SPEC_KEYS & set(extra_config))
    staged_keys = sorted(_STAGED_ONLY_KEYS & set(extra_config))
    if spec_keys and staged_keys:
        raise ValueError(
            f"kv_connector_extra_config mixes an offloading spec's keys {spec_keys} with kvlab's staged tiers' keys "
            f"{staged_keys}: give {sorted(_SPEC_KEYS)} for vLLM's spec-built halves (the CPU tier sized by cpu_bytes_to_use), "
            f"or {sorted(_STAGED_ONLY_KEYS)} for kvlab's tiers -- not both"
        )
    return bool(spec_keys)


class _WorkerJobLedger:
    """What the spec-built worker was told and has reported, kept outside the books an undone
    step restores.

    kvlab undoes an interrupted engine step by restoring a deep copy of the connector's
    books (``kvlab.core.transaction``). The worker is not undone: it may hold that step's
    jobs (a store waits for the next step) and will report them, and the reports it sent
    during the step are not sent again. So this record is shared by every copy
    (``__deepcopy__``): ``next_id`` -- the half's job counter moves past ids once issued,
    and reports of those ``undone`` jobs are dropped instead of being credited to new jobs
    that reused their ids; ``completions`` -- every worker report per job, so a completion
    the undone step had applied is applied again. (One int per job; a teaching engine's
    jobs are few.)"""

    __slots__ = ("next_id", "undone", "completions")

    def __init__(self) -> None:
        self.next_id = 0
        self.undone: set[int] = set()
        self.completions: dict[int, int] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> _WorkerJobLedger:
        return self


def _with_worker_meta(connector_output: KVConnectorOutput, worker_meta: Any) -> KVConnectorOutput:
    """A copy of the step's output carrying another worker report (kvlab's record or vLLM's:
    both answer to ``kv_connector_worker_meta``)."""
    out = copy.copy(connector_output)
    out.kv_connector_worker_meta = worker_meta
    return out


class OffloadingConnector(KVConnectorBase_V1, SupportsHMA):
    #: The staged scheduler half's class: a seam (the ``tier_hits`` exercise plugs a subclass in).
    scheduler_cls: type[StagedOffloadingConnectorScheduler] = StagedOffloadingConnectorScheduler
    #: The offloading backend of a spec-built connector (None: kvlab's staged tiers).
    spec: OffloadingSpec | None = None
    connector_scheduler: StagedOffloadingConnectorScheduler | OffloadingConnectorScheduler | None
    connector_worker: StagedOffloadingConnectorWorker | OffloadingConnectorWorker | None

    def __init__(self, role: Any, block_size: Any = None, extra_config: Any = None) -> None:
        """kvlab's call, ``(role, block_size, extra_config)``, builds kvlab's staged tiers.
        vLLM 0.33's call, ``(vllm_config, role, kv_cache_config)`` -- told apart by its first
        argument, an engine config with a ``kv_transfer_config`` -- reads the extra config
        from ``vllm_config.kv_transfer_config``: with a spec key it builds vLLM's spec-built
        halves; without, the staged tiers for the offloaded group's block size."""
        if not isinstance(role, KVConnectorRole) and hasattr(role, "kv_transfer_config"):
            vllm_config, role, kv_cache_config = role, block_size, extra_config
            self._init_from_vllm_config(vllm_config, role, kv_cache_config)
            return
        self._init_staged(role, block_size, extra_config)

    def _init_from_vllm_config(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        if not hasattr(kv_cache_config, "kv_cache_groups"):
            raise TypeError(
                "OffloadingConnector(vllm_config, role, kv_cache_config): kv_cache_config must be a KVCacheConfig, "
                f"got {type(kv_cache_config).__name__}"
            )
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError("OffloadingConnector(vllm_config, ...): vllm_config.kv_transfer_config must be set")
        extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        if not builds_spec_halves(extra):
            # kvlab's tiers keep the one offloaded group (HiSparse: the indexer's) at its block size.
            groups = get_offloading_group_ids(kv_cache_config)
            block_size = kv_cache_config.kv_cache_groups[groups[0] if groups else 0].kv_cache_spec.block_size
            self._init_staged(role, block_size, extra)
            # The staged half reads its settings from the extra config alone, but keeps what
            # vLLM's call gave, as every connector built that way does.
            self._vllm_config, self._kv_transfer_config = vllm_config, transfer
            return
        super().__init__(vllm_config, role, kv_cache_config)  # checks the role
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        spec = OffloadingSpecFactory.create_spec(offloading_config)  # every check passed: build
        self.spec = spec
        self.block_size = offloading_config.groups[0].tokens_per_block
        self.connector_scheduler = None
        self.connector_worker = None
        self._ledger = _WorkerJobLedger()
        if role is KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
        else:
            self.connector_worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)

    def _init_staged(self, role: KVConnectorRole, block_size: int, extra_config: dict[str, Any] | None) -> None:
        super().__init__(role)
        cfg = dict(extra_config or {})
        spec_keys = sorted(_SPEC_KEYS & set(cfg))
        if spec_keys:
            raise ValueError(
                f"OffloadingConnector: extra config {spec_keys} names an offloading spec, which vLLM's call builds: "
                "OffloadingConnector(vllm_config, role, kv_cache_config); kvlab's call (role, block_size, extra_config) "
                f"builds kvlab's staged tiers, configured by {sorted(_KNOWN)}"
            )
        unknown = set(cfg) - _KNOWN
        if unknown:
            raise ValueError(f"OffloadingConnector: unknown extra config {sorted(unknown)}; known: {sorted(_KNOWN)}")
        self.block_size = check_int("block_size", block_size, 1)
        # vLLM 0.33 may coalesce several GPU blocks into one tier chunk (extra config
        # "blocks_per_chunk", or "block_size" in tokens); kvlab's tiers keep one block each.
        per_chunk = resolve_blocks_per_chunk(cfg, (self.block_size,))
        if per_chunk != 1:
            raise ValueError(
                f"kvlab's offloading tiers keep one GPU block per chunk; the extra config asks for {per_chunk} "
                f"(blocks_per_chunk=1, or block_size={self.block_size})"
            )
        self.num_cpu_blocks = check_int("num_cpu_blocks", cfg.get("num_cpu_blocks", 64), 1)
        path = cfg.get("storage_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise TypeError(f"storage_path must be None or a directory path, got {path!r}")
        self.storage_path = path
        self.num_storage_blocks = check_int("num_storage_blocks", cfg.get("num_storage_blocks", 4 * self.num_cpu_blocks), 1)
        offload_prompt_only = cfg.get("offload_prompt_only", True)
        if not isinstance(offload_prompt_only, bool):
            raise TypeError(f"offload_prompt_only must be a bool, got {offload_prompt_only!r}")
        # With KV events on, publish the tiers' stores with their tokens and every block hash
        # (vLLM 0.33's opt-in), not placeholders that name one hash.
        self_describing = cfg.get("self_describing_kv_events", False)
        if not isinstance(self_describing, bool):
            raise TypeError(f"self_describing_kv_events must be a bool, got {self_describing!r}")
        # The CPU tier's cache policy and admission (vLLM's CPU spec reads the same keys).
        self.eviction_policy = cfg.get("eviction_policy", "lru")
        self.cache_policy_module_path = cfg.get("cache_policy_module_path")
        self.store_threshold = check_int("store_threshold", cfg.get("store_threshold", 0), 0)
        # The disk tier's back-pressure (vLLM 0.33's "backpressure" dict); built here, before
        # any tier, so a bad config leaves nothing half made.
        detector = create_backpressure_detector(cfg.get("backpressure"), StagedFileSystemTier.tier_type)
        if detector is not None and path is None:
            raise ValueError("backpressure applies to the disk tier: set storage_path too")
        self.connector_scheduler = None
        self.connector_worker = None
        if role is KVConnectorRole.SCHEDULER:
            storage = (
                StagedFileSystemTier(self.num_storage_blocks, path, block_size=self.block_size, backpressure_detector=detector)
                if path is not None
                else None
            )
            cpu = CPUOffloadingManager(
                self.num_cpu_blocks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=True,
                store_threshold=self.store_threshold,
            )
            manager = StagedTieringManager(cpu, storage)
            self.connector_scheduler = self.scheduler_cls(manager, self.block_size, offload_prompt_only, self_describing)
        else:
            self.connector_worker = StagedOffloadingConnectorWorker(self.num_cpu_blocks, self.block_size)

    @property
    def scheduler(self) -> Any:
        """The scheduler half: kvlab's staged one, or vLLM's spec-built one (``self.spec``)."""
        scheduler = self.connector_scheduler
        if scheduler is None:
            self._check_role(KVConnectorRole.SCHEDULER, "scheduler")
        assert scheduler is not None
        return scheduler

    @property
    def worker(self) -> Any:
        """The worker half: kvlab's staged one, or vLLM's spec-built one (``self.spec``)."""
        self._check_role(KVConnectorRole.WORKER, "worker")
        assert self.connector_worker is not None
        return self.connector_worker

    @property
    def manager(self) -> Any:
        """The tiers' books (scheduler side): kvlab's ``StagedTieringManager`` (``manager.primary``
        is the CPU tier), or the spec's ``OffloadingManager``."""
        return self.scheduler.manager

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache (vLLM 0.33): a store that never lands is a future miss, not a
        lost request, so nothing waits for it."""
        return False

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Any) -> None:
        """The runner's paged caches. vLLM's form is ``{layer name: tensor}`` (kvlab's runner
        names its layers ``"layers.{i}"``); kvlab's staged worker takes them in layer order,
        so a dict is read in its order there, and a list still works. The spec-built worker
        finds each offloaded layer by the name the ``kv_cache_config`` gives it: a cache
        missing one -- the simulated executor has no tensors at all -- is refused here."""
        if self.spec is None:
            self.worker.register_kv_caches(list(kv_caches.values()) if isinstance(kv_caches, Mapping) else kv_caches)
            return
        worker = self.worker
        if not isinstance(kv_caches, Mapping):
            raise TypeError(
                "the spec-built offloading worker takes vLLM's {layer name: KV cache tensor}, got "
                f"{type(kv_caches).__name__}; kvlab's ModelRunner passes that form"
            )
        config = self._kv_cache_config
        wanted = [name for g in get_offloading_group_ids(config) for name in config.kv_cache_groups[g].layer_names]
        missing = [name for name in wanted if name not in kv_caches]
        if missing or not wanted:
            raise ValueError(
                f"the spec-built offloading worker copies the KV tensors of layers {wanted}, but the executor registered "
                f"{sorted(kv_caches)} (missing {missing}): run it with a ModelRunner whose layers the kv_cache_config "
                "names ('layers.{i}'); the SimulatedExecutor has no KV tensors to copy -- use kvlab's staged tiers there "
                "(extra config num_cpu_blocks, no spec keys)"
            )
        worker.register_kv_caches(dict(kv_caches))

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Spec-built: finish the stores of preempted requests before their blocks are reused
        (kvlab's staged stores finish within their step: nothing to do)."""
        if self.spec is None:
            return
        assert isinstance(kv_connector_metadata, OffloadingConnectorMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        if self.spec is None:
            self.worker.start_load_kv(meta)
        else:  # last step's stores, then this step's loads (vLLM's start_kv_transfers)
            self.worker.start_kv_transfers(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores copy every layer at once, in wait_for_save (as vLLM's offloading connector)

    def wait_for_save(self, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        """Staged: copy this step's stores now. Spec-built: queue them for the next step's
        start (vLLM 0.33), so the copies never delay the tokens this step samples."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        if self.spec is None:
            self.worker.wait_for_save(meta, skip_req_ids)
        else:
            self.worker.prepare_store_kv(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Spec-built: the requests whose asynchronous load landed (stores report through the
        worker metadata). Staged transfers end within their step: nothing."""
        if self.spec is None:
            return None, None
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.spec is None:
            return self.worker.get_block_ids_with_load_errors()
        return set()  # vLLM 0.33's spec-built worker has no failed loads (a failure raises)

    def build_connector_worker_meta(self) -> Any:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()

    def shutdown(self) -> None:
        if isinstance(self.connector_worker, OffloadingConnectorWorker):
            self.connector_worker.shutdown()
        if isinstance(self.connector_scheduler, OffloadingConnectorScheduler):
            self.connector_scheduler.shutdown()

    # -- scheduler side ---------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Bind the scheduler's manager (the scheduler half checks it can serve it first:
        a refused manager leaves the connector as it was). The config is kept too: which
        groups bound a load is read from it (``_bounding_group_ids``)."""
        scheduler = self.__dict__.get("connector_scheduler")
        if self.spec is not None:
            self._check_spec_manager(kv_cache_manager)
            super().bind_kv_cache_manager(kv_cache_manager)
            return  # the config vLLM's call gave stays: it names the layers
        if isinstance(scheduler, StagedOffloadingConnectorScheduler):  # not a test's stand-in
            scheduler.bind(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_cache_config = kv_cache_manager.kv_cache_config
        self.__dict__.pop("_bounding_group_ids", None)  # read again from this config

    def _check_spec_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """A spec-built half keys its chunks by the config vLLM's call gave it: the manager
        must run the same pool (block count, groups and their block sizes, one hash per block
        granularity) -- else block ids and hashes would name other things. And kvlab's engine
        undoes an interrupted step by deep-copying the connector's books: a backend whose
        books hold a lock or a thread (vLLM's tiering manager polls its tiers from one)
        cannot be copied, so it cannot run in kvlab's engine."""
        mine, theirs = self._kv_cache_config, kv_cache_manager.kv_cache_config
        shape = [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size) for g in mine.kv_cache_groups]
        given = [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size) for g in theirs.kv_cache_groups]
        if (mine.num_blocks, shape) != (theirs.num_blocks, given):
            raise ValueError(
                f"the offloading connector was built for {mine.num_blocks} blocks in groups {shape}, but the KV-cache "
                f"manager runs {theirs.num_blocks} blocks in groups {given}: build both from one kv_cache_config"
            )
        tokens_per_hash = self.scheduler.config.tokens_per_hash
        if kv_cache_manager.hash_block_size != tokens_per_hash:
            raise ValueError(
                f"the offloading connector keys chunks by hashes of {tokens_per_hash} tokens, the KV-cache manager "
                f"hashes every {kv_cache_manager.hash_block_size}: give the manager hash_block_size={tokens_per_hash}"
            )
        if not kv_cache_manager.enable_caching:
            raise ValueError("the offloading connector needs block hashes: build the KV-cache manager with enable_caching=True")
        try:
            copy.deepcopy(self.scheduler.manager)
        except TypeError as e:
            raise ValueError(
                f"the offloading spec {type(self.spec).__name__} keeps books kvlab's engine cannot copy ({e}): an "
                "interrupted step could not be undone. Run it with CPUOffloadingSpec, or with kvlab's staged tiers "
                "(extra config num_cpu_blocks / storage_path, no spec keys)"
            ) from None

    @cached_property
    def _bounding_group_ids(self) -> tuple[int, ...]:
        """The prefix-cacheable groups this connector does not offload (vLLM 0.33): under
        HiSparse, the source group, whose K/V lives in the host pool. A load must not reach
        past such a group's own cached prefix -- nothing would fill its K/V there. Empty
        before a manager is bound (no config to read)."""
        config = self._kv_cache_config
        if config is None:
            return ()
        offloaded = set(get_offloading_group_ids(config))
        return tuple(
            group_id
            for group_id, group in enumerate(config.kv_cache_groups)
            if group.kv_cache_spec.prefix_cacheable and group_id not in offloaded
        )

    def _max_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """How far past ``num_computed_tokens`` a load may reach: None when unbounded (every
        prefix-cacheable group is offloaded), else the shortest cached prefix among the
        groups this connector does not keep, less what is computed already."""
        if not self._bounding_group_ids:
            return None
        manager = self._kv_cache_manager
        if manager is None:
            raise RuntimeError("no KV cache manager is bound: the scheduler binds it before it asks")
        # A bounding group beside an offloaded one: two groups or more, so a hybrid coordinator.
        coordinator = cast("HybridKVCacheCoordinator", manager.coordinator)
        _, per_group_hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, request.num_tokens - 1)
        bound = min(per_group_hits[group_id] for group_id in self._bounding_group_ids)
        return max(0, bound - num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        """Spec-built: the half starts tracking the request (a backend may begin a slow
        lookup now). kvlab's staged half looks up when asked."""
        if self.spec is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens, max_num_new_tokens=self._max_loadable_tokens(request, num_computed_tokens)
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._skip_undone_job_ids()  # a load job takes its id here
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        self._record_issued_job_ids()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def reset_cache(self) -> bool:
        """Empty the tiers. kvlab's staged tiers say False while a job is in flight; vLLM's
        spec-built half flushes and fences in-flight jobs, so it is always done (True)."""
        if self.spec is None:
            return bool(self.scheduler.reset_cache())
        self._skip_undone_job_ids()  # the reset fences ids below the counter
        self.scheduler.reset_cache()
        return True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        self._skip_undone_job_ids()  # store jobs take their ids here
        meta = self.scheduler.build_connector_meta(scheduler_output)
        self._record_issued_job_ids()
        return cast(OffloadingConnectorMetadata, meta)

    def has_pending_push_work(self) -> bool:
        """Spec-built: jobs in flight, a reset's fence, or work the backend still has keep
        the engine stepping (a store lands one step after the request that made it)."""
        return self.spec is not None and self.scheduler.has_pending_push_work()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.spec is None:
            self.scheduler.update_connector_output(connector_output)
            return
        self._skip_undone_job_ids()
        ledger, half = self._ledger, self.scheduler
        # Completions an undone step had applied: the worker will not report them again.
        lost = {
            job_id: n - (half.config.num_workers - job.pending_count)
            for job_id, job in half._jobs.items()
            if (n := ledger.completions.get(job_id, 0)) > half.config.num_workers - job.pending_count
        }
        if lost:
            half.update_connector_output(_with_worker_meta(connector_output, OffloadingWorkerMetadata(completed_jobs=lost)))
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, OffloadingWorkerMetadata):
            done = {job_id: n for job_id, n in meta.completed_jobs.items() if job_id not in ledger.undone}
            for job_id, n in done.items():
                ledger.completions[job_id] = ledger.completions.get(job_id, 0) + n
            if len(done) != len(meta.completed_jobs):
                connector_output = _with_worker_meta(connector_output, replace(meta, completed_jobs=done))
        half.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.spec is not None:
            return cast(tuple[bool, dict[str, Any] | None], self.scheduler.request_finished(request))
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the same as ``request_finished`` -- the halves keep every
        offloaded group's blocks in their own books, so the tables add nothing."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def undo_shared_objects(self) -> list[Any]:
        """What kvlab's engine must share, not copy, when it deep-copies this connector's
        books to undo an interrupted step (``kvlab.core.transaction``): the spec-built half
        keeps each tracked request's ``Request`` -- a finished one too, until its stores land,
        when the scheduler has already forgotten it. A request is the scheduler's state."""
        half = self.connector_scheduler
        if self.spec is None or not isinstance(half, OffloadingConnectorScheduler):
            return []
        return [status.req for status in half._req_status.values()]

    # -- job ids across an undone step (spec-built only; see _WorkerJobLedger) ----------------------
    def _skip_undone_job_ids(self) -> None:
        """If an undone step wound the half's job counter back, mark the ids it had issued as
        undone and move the counter past them: no new job reuses an id the worker may report."""
        if self.spec is None:
            return
        half = cast(OffloadingConnectorScheduler, self.scheduler)
        ledger = self._ledger
        if half._job_counter < ledger.next_id:
            ledger.undone.update(range(half._job_counter, ledger.next_id))
            half._job_counter = ledger.next_id

    def _record_issued_job_ids(self) -> None:
        if self.spec is not None:
            half = cast(OffloadingConnectorScheduler, self.scheduler)
            self._ledger.next_id = max(self._ledger.next_id, half._job_counter)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Layer-outermost pages ("LBHNC"), or block-outermost ("BLHNC") under HiSparse, whose
        host pages copy whole (vLLM 0.33)."""
        attention = getattr(vllm_config, "attention_config", None)
        return "BLHNC" if getattr(attention, "hisparse_config", None) is not None else "LBHNC"

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """The scheduler half's metrics payload (the worker half reports through its
        metadata, so it has none of its own)."""
        return self.connector_scheduler.get_stats() if self.connector_scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadingConnectorStats:
        return OffloadingConnectorStats(data=data) if data is not None else OffloadingConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]
    ) -> Any:
        """The offload metrics as Prometheus metrics (:class:`OffloadPromMetrics`). The
        metrics a backend reports come from its spec class (``spec_name``); kvlab's own tiers
        (a config without ``spec_name`` or vLLM's ``cpu_bytes_to_use``) report as vLLM's
        tiering spec does -- a CPU tier in front, a file tier behind it when there is one."""
        import dataclasses

        from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        if "spec_name" not in extra and "cpu_bytes_to_use" not in extra:
            # The same engine config, its extra config naming the tiering spec and its tiers.
            tiers = [{"type": "fs", "root_dir": extra["storage_path"]}] if extra.get("storage_path") else []
            extra = {**extra, "spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}
            vllm_config = copy.copy(vllm_config)
            vllm_config.kv_transfer_config = dataclasses.replace(transfer, kv_connector_extra_config=extra)
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> list[Any]:
        return list(self.scheduler.take_events())
