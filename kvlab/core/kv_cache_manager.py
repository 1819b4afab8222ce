"""The KV-cache manager: the scheduler's only door to KV memory (lessons 02-05, 07).

vLLM: ``vllm/v1/core/kv_cache_manager.py``. Three questions, three methods:

* ``get_computed_blocks(request)`` -- which leading blocks of this request are already
  cached? (Side-effect free on the pool: nothing is reserved until allocation succeeds.)
* ``allocate_slots(request, n, ...)`` -- give the request room for ``n`` more tokens, adopt
  its prefix hits, and cache the blocks that became full. All or nothing: if the blocks
  do not fit it returns None and no ref count has moved.
* ``free(request)`` -- give every block back, tail first.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvlab.core.block_pool import BlockPool, group_suffix
from kvlab.core.hisparse_coordinator import HiSparseCoordinator, get_hisparse_coordinator
from kvlab.core.kv_cache_coordinator import HybridKVCacheCoordinator, get_kv_cache_coordinator
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.core.kv_cache_utils import (
    check_lookahead_tokens,
    KVCacheBlock,
    KVCacheBlockCopy,
    get_request_block_hasher,
    resolve_block_sizes_of_specs,
    resolve_dcp_kv_cache_spec,
    scheduler_kv_cache_groups,
    trim_null_head,
)
from kvlab.core.single_type_kv_cache_manager import (
    MambaManager,
    SingleTypeKVCacheManager,
    check_context_parallelism,
)
from kvlab.core.transaction import manager_call, manager_lookup
from kvlab.utils.kv_events import BlockStored, KVEvent
from kvlab.kv_cache_interface import (
    KV_CACHE_SPEC_TYPES,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvlab.metrics.stats import PrefixCacheStats
from kvlab.request import Request
from kvlab.eventlog.events import EventLog, PoolCreated, PrefixLookup
from kvlab.utils.checks import AssertedValueError, check_int, check_optional_int
from kvlab.utils.hashing import get_hash_fn_by_name
from kvlab.utils.math_utils import cdiv, round_up

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheBlocks:
    """A request's blocks, one list per KV-cache group (the scheduler/manager interface)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, group_ids: Sequence[int] | None = None) -> tuple[list[int], ...]:
        """One list of block ids per group -- or per group of ``group_ids`` (vLLM 0.33)."""
        groups = self.blocks if group_ids is None else [self.blocks[i] for i in group_ids]
        return tuple([b.block_id for b in blks] for blks in groups)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, the ids of the blocks not in the prefix cache (no key), the null blocks
        left out (vLLM 0.33): the blocks a connector must fill, whose KV no hit supplies."""
        return [[b.block_id for b in trim_null_head(list(g)) if b.cache_key is None and not b.is_null] for g in self.blocks]

    def new_empty(self) -> "KVCacheBlocks":
        if len(self.blocks) == 1:
            return KVCacheBlocks(([],))
        return KVCacheBlocks(tuple([] for _ in self.blocks))

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks)

    def __bool__(self) -> bool:
        return any(self.blocks)


def _from_kv_cache_config(
    config: Any, block_size: Any, kv_cache_groups: Any, retention_interval: int | None, hash_block_size: int | None
) -> tuple[Any, list[Any], int | None, int | None]:
    """The block count, groups, retention interval and hash block size that vLLM's
    ``KVCacheManager(kv_cache_config, ...)`` reads from its config."""
    if kv_cache_groups is not None or block_size != 16:
        raise TypeError(
            "with a KVCacheConfig as the first argument, give max_model_len and the rest by keyword "
            "(the config holds the groups and their block sizes)"
        )
    cfg_interval = getattr(config, "prefix_cache_retention_interval", None)
    if cfg_interval is not None:
        if retention_interval is not None and retention_interval != cfg_interval:
            raise ValueError(
                f"prefix_cache_retention_interval = {retention_interval} disagrees with the config's {cfg_interval}; give it once"
            )
        retention_interval = cfg_interval
    if hash_block_size is None:
        hash_block_size = getattr(config, "hash_block_size", None)
    # A group of layers of one kind but several shapes (UniformTypeKVCacheSpecs) is, for the
    # manager, its first layer's spec -- as in vLLM's generate_scheduler_kv_cache_config.
    return config.num_blocks, scheduler_kv_cache_groups(config.kv_cache_groups), retention_interval, hash_block_size


def _check_manager_args(
    block_size: Any,
    kv_cache_groups: Any,
    enable_caching: Any,
    hash_algo: Any,
    log_stats: Any,
    max_model_len: Any,
    event_log: Any,
    use_eagle: Any,
    max_in_flight_tokens: Any,
    block_pool_cls: Any,
    manager_classes: Any,
    kv_events_use_int_block_hashes: Any,
) -> tuple[int, list[KVCacheSpec], Any, int | None, int | None, bool, frozenset[int], frozenset[int]]:
    """``KVCacheManager``'s arguments, checked before anything is built (raising, named) and
    normalised: the block size, the specs (each with its block size), the hash function, the
    two limits, the KV-event hash format (None reads vLLM's environment variable), and the
    groups given as a ``KVCacheGroupSpec`` with ``is_eagle_group``."""
    block_size = check_int("block_size", block_size, 1)
    if kv_events_use_int_block_hashes is None:
        env = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
        try:
            kv_events_use_int_block_hashes = bool(int(env))
        except ValueError:
            raise ValueError(f"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be an integer (0 or 1), got {env!r}") from None
    for name, flag in (("enable_caching", enable_caching), ("log_stats", log_stats), ("use_eagle", use_eagle)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    hash_fn = get_hash_fn_by_name(hash_algo)
    if event_log is not None and not isinstance(event_log, EventLog):
        raise TypeError(f"event_log must be None or an EventLog, got {type(event_log).__name__}")
    if not (isinstance(block_pool_cls, type) and issubclass(block_pool_cls, BlockPool)):
        raise TypeError(f"block_pool_cls must be BlockPool or a subclass of it, got {block_pool_cls!r}")
    if manager_classes is not None and not isinstance(manager_classes, Mapping):
        raise TypeError(f"manager_classes must be None or a dict {{spec type: manager class}}, got {type(manager_classes).__name__}")
    if kv_cache_groups is not None and (isinstance(kv_cache_groups, (str, bytes)) or not isinstance(kv_cache_groups, Sequence)):
        raise TypeError(f"kv_cache_groups must be None or a list of specs, got {type(kv_cache_groups).__name__}")
    groups = list(kv_cache_groups) if kv_cache_groups is not None else [FullAttentionSpec()]
    if not groups:
        raise ValueError("kv_cache_groups must hold at least one spec")
    eagle_groups = frozenset(i for i, g in enumerate(groups) if isinstance(g, KVCacheGroupSpec) and g.is_eagle_group)
    # HiSparse's source group (its K/V kept whole in a host pool) runs its own manager.
    source_groups = frozenset(
        i for i, g in enumerate(groups) if isinstance(g, KVCacheGroupSpec) and g.role == KVCacheGroupRole.HISPARSE_SOURCE
    )
    for i, g in enumerate(groups):
        if isinstance(getattr(g, "kv_cache_spec", g), (HiSparseHotSpec, HiSparseResidentSpec)) and not source_groups:
            raise ValueError(
                f"kv_cache_groups[{i}] is one of HiSparse's GPU groups, which copy to and from a host pool: give a KVCacheConfig "
                "with a HISPARSE_SOURCE group and hisparse_host_num_blocks (kvlab.hisparse.layout builds one)"
            )
    for i, g in enumerate(groups):
        if isinstance(g, KVCacheGroupSpec):  # vLLM's group: its spec, and whether a drafter's layers are in it
            if not isinstance(g.is_eagle_group, bool):
                raise TypeError(f"kv_cache_groups[{i}].is_eagle_group must be a bool, got {g.is_eagle_group!r}")
            groups[i] = g.kv_cache_spec
    specs: list[KVCacheSpec] = []
    for i, g in enumerate(groups):
        if type(g) not in KV_CACHE_SPEC_TYPES:
            names = ", ".join(t.__name__ for t in KV_CACHE_SPEC_TYPES)
            raise TypeError(f"kv_cache_groups[{i}] must be one of {names} (or a KVCacheGroupSpec holding one); got {type(g).__name__}")
        specs.append(g if g.block_size is not None else g.with_block_size(block_size))
    max_model_len = check_optional_int("max_model_len", max_model_len, 1)
    max_in_flight_tokens = check_optional_int("max_in_flight_tokens", max_in_flight_tokens, 1)
    for i, spec in enumerate(specs):
        if isinstance(spec, CrossAttentionSpec) and enable_caching:
            raise ValueError(
                f"kv_cache_groups[{i}] is a CrossAttentionSpec: an encoder-decoder model runs with enable_caching=False "
                "(vLLM turns prefix caching off for such models: every request's encoder input differs)"
            )
        if isinstance(spec, ChunkedLocalAttentionSpec) and spec.attention_chunk_size % spec.block_size:  # type: ignore[operator]  # every spec has its block size after the defaults above
            raise ValueError(
                f"kv_cache_groups[{i}]: attention_chunk_size {spec.attention_chunk_size} must be a multiple of block_size {spec.block_size}"
            )
    return block_size, specs, hash_fn, max_model_len, max_in_flight_tokens, kv_events_use_int_block_hashes, eagle_groups, source_groups


def _check_hisparse(host_num_blocks: int | None, source_groups: frozenset[int], event_log: Any) -> None:
    """A HiSparse config is whole -- a host pool and a source group, each with the other --
    and runs without kvlab's event log; checked before anything is built, so a refusal
    leaves no trace (not even a PoolCreated event)."""
    if source_groups and host_num_blocks is None:
        raise ValueError(
            f"kv_cache_groups {sorted(source_groups)} hold HiSparse's source K/V, which lives in a host pool: "
            "give a KVCacheConfig with hisparse_host_num_blocks"
        )
    if host_num_blocks is None:
        return
    if not source_groups:
        raise ValueError(
            f"KVCacheConfig.hisparse_host_num_blocks = {host_num_blocks}, but No HiSparse cache group is configured "
            "(no group has the role HISPARSE_SOURCE)"
        )
    if event_log is not None:
        raise ValueError(
            "event_log must be None with a HiSparse host pool: kvlab's pictures do not follow the host pool, the "
            "pages given back while still read, or the transfers' holds yet (vLLM's KV events do: enable_kv_cache_events)"
        )


class KVCacheManager:
    """The scheduler's only door to KV memory: it answers "what is cached?", "is there room?"
    and "give it back", and hides everything behind (vLLM: ``KVCacheManager``).

    Why one door: the scheduler decides *who* runs; whether a prompt's beginning is already
    in the cache (lesson 03), which physical blocks hold a request (lesson 02), how ref
    counts and the free queue make sharing and eviction safe (lesson 04), and how a hybrid
    model's groups share one pool (lesson 07) are this object's business. Its allocation is
    all or nothing, so the scheduler can simply try, and preempt when the answer is None
    (lesson 05). It owns a :class:`BlockPool` (the blocks, ref counts, free queue and
    prefix-cache map) and a :class:`KVCacheCoordinator` (one block table per group), and it
    binds each request's block hasher, so that ``request.block_hashes`` grows as tokens
    arrive and lookups only read it.

    ``num_blocks`` counts block 0, the null block, which is never handed out. Prefix-cache
    hit/query counters are kept when ``log_stats`` (lesson 08); every state change is
    emitted to ``event_log`` when one is given, for the pictures. ``block_pool_cls`` and
    ``manager_classes`` (spec type -> single-type manager class) are seams: a subclass with
    one method swapped runs inside the real manager -- how the exercises check a learner's
    free queue, touch, eviction, free order and block count.

    ``kv_cache_groups`` takes any number of specs of any kinds (full attention, MLA, sliding
    windows, chunked local attention, Mamba states); a spec without a ``block_size`` gets
    ``block_size``. ``use_eagle``: drop the last matched block of every hit (EAGLE
    recomputes it). ``max_in_flight_tokens`` (one step's tokens; ``build_engine`` passes
    ``max_num_batched_tokens``) caps what the whole-prompt admission gate counts for window
    and chunk groups; None means no cap.
    """

    #: The open transaction's checkpoint, set and cleared by ``kvlab.core.transaction`` (kvlab's
    #: addition: every call is all or nothing); the manager itself never reads it.
    _txn: Any = None

    def __init__(
        self,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_cache_groups: Sequence[KVCacheSpec] | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        log_stats: bool = True,
        max_model_len: int | None = None,
        event_log: EventLog | None = None,
        *,
        use_eagle: bool = False,
        max_in_flight_tokens: int | None = None,
        block_pool_cls: type[BlockPool] = BlockPool,
        manager_classes: Mapping[type, type[SingleTypeKVCacheManager]] | None = None,
        enable_kv_cache_events: bool = False,
        kv_events_use_int_block_hashes: bool | None = None,
        metrics_collector: KVCacheMetricsCollector | None = None,
        prepend_uncached_blocks: bool = True,
        prefix_match_unit: int | None = None,
        prefix_cache_retention_interval: int | None = None,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int | None = None,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        watermark: float = 0.0,
        kv_cache_config: Any = None,
    ) -> None:
        """vLLM 0.33's call shape is taken too: ``KVCacheManager(kv_cache_config,
        max_model_len=..., scheduler_block_size=..., hash_block_size=..., ...)``, the config
        (a ``KVCacheConfig``) giving the block count, the groups with their block sizes and
        ``prefix_cache_retention_interval``. ``hash_block_size`` then plays the part of
        ``prefix_match_unit``; ``scheduler_block_size`` must be the one kvlab derives (the
        LCM of the groups' block sizes, after context parallelism). Context parallelism follows
        vLLM 0.33's rules (``check_context_parallelism``): ``dcp_world_size`` spreads each
        sharded full-attention block's tokens over the ranks, so the manager sees blocks that
        many times larger; ``pcp_world_size`` leaves the manager as it is. The admission
        watermark is not modelled: ``watermark`` must be 0.

        ``enable_kv_cache_events``: queue vLLM's KV cache events (``take_events()``).
        ``kv_events_use_int_block_hashes``: publish hashes as 64-bit ints (vLLM's default) or
        as 32-byte digests; None reads ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` as vLLM does
        (default "1"). ``metrics_collector``: a ``KVCacheMetricsCollector`` sampling block
        residency. ``prepend_uncached_blocks=False``: free with vLLM <= 0.22's rule (every
        freed block to the free-queue tail). ``prefix_match_unit`` (vLLM 0.33's
        ``--prefix-match-unit``): hash every this many tokens instead of every GCD of the
        groups' block sizes; on a Mamba hybrid with larger blocks it lets hits end inside a
        block (``coordinator.enable_partial_hash_hits``), the hit's last block then copied.
        ``prefix_cache_retention_interval`` (vLLM 0.33): how densely window and Mamba groups
        keep cache entries -- None every reachable block (as vLLM's ``KVCacheConfig``
        default), 0 only what a replay of a prompt or a shared-prefix junction can hit (vLLM's
        server default, ``CacheConfig``), k > 0 also one segment every k tokens.
        ``enable_mamba_shared_prefix_checkpoint`` (vLLM 0.33, opt-in): with EAGLE and partial
        hits, a Mamba state is also saved exactly at a shared-prefix junction, inside a block
        (the scheduler ends a chunk there), not only at the block boundary before it.
        ``num_prefill_lookahead`` and ``num_hash_lookahead_tokens`` (vLLM 0.33, a multi-module
        MTP drafter that reads k prompt tokens past a chunk's end): the last k - 1 computed
        tokens are not cached yet (the target may compute them again), a chunk never ends
        within k of the prefill's end (the scheduler), and -- with lookahead hashes, which
        vLLM turns on for such a drafter with prefix caching and no KV connector, passing
        ``use_eagle=False`` -- each block's hash also covers the k tokens after it, so a hit
        needs no EAGLE drop (vLLM's ``VllmConfig.num_prefill_lookahead_tokens`` and
        ``num_hash_lookahead_tokens``). ``num_prefill_lookahead=None``: 1 with ``use_eagle``
        (an EAGLE-family drafter reads the next token), else 0, as vLLM derives it."""
        if not isinstance(enable_mamba_shared_prefix_checkpoint, bool):
            raise TypeError(f"enable_mamba_shared_prefix_checkpoint must be a bool, got {enable_mamba_shared_prefix_checkpoint!r}")
        if kv_cache_config is not None:  # vLLM's keyword for its first argument
            if num_blocks is not None:
                raise TypeError("give num_blocks or kv_cache_config, not both")
            num_blocks = kv_cache_config
        if num_blocks is None:
            raise TypeError("KVCacheManager needs num_blocks (kvlab's form) or a KVCacheConfig (vLLM's)")
        given_config = None
        if not isinstance(num_blocks, int) and hasattr(num_blocks, "kv_cache_groups"):
            given_config = num_blocks
            num_blocks, kv_cache_groups, prefix_cache_retention_interval, hash_block_size = _from_kv_cache_config(
                num_blocks, block_size, kv_cache_groups, prefix_cache_retention_interval, hash_block_size
            )
        if watermark != 0.0:
            raise ValueError(f"watermark must be 0.0 (kvlab models no admission watermark), got {watermark!r}")
        (
            block_size,
            specs,
            hash_fn,
            max_model_len,
            max_in_flight_tokens,
            kv_events_use_int_block_hashes,
            eagle_groups,
            hisparse_source_groups,
        ) = _check_manager_args(
            block_size,
            kv_cache_groups,
            enable_caching,
            hash_algo,
            log_stats,
            max_model_len,
            event_log,
            use_eagle,
            max_in_flight_tokens,
            block_pool_cls,
            manager_classes,
            kv_events_use_int_block_hashes,
        )
        host_num_blocks = None if given_config is None else getattr(given_config, "hisparse_host_num_blocks", None)
        _check_hisparse(host_num_blocks, hisparse_source_groups, event_log)
        # Decode context parallelism (vLLM 0.33): a sharded group's block covers block_size x
        # dcp tokens, and the manager counts in those blocks throughout (events included).
        dcp_world_size, pcp_world_size = check_context_parallelism(specs, dcp_world_size, pcp_world_size)
        specs = [resolve_dcp_kv_cache_spec(s, dcp_world_size) for s in specs]
        prefix_match_unit = check_optional_int("prefix_match_unit", prefix_match_unit, 1)
        num_hash_lookahead_tokens = check_lookahead_tokens(num_hash_lookahead_tokens)
        # None: what vLLM derives for the drafter use_eagle stands for (an EAGLE-family
        # drafter reads the one next token; no drafter, none).
        num_prefill_lookahead = (
            int(use_eagle) if num_prefill_lookahead is None else check_int("num_prefill_lookahead", num_prefill_lookahead, 0)
        )
        # A k-module drafter may have the last k - 1 tokens recomputed: every window group
        # keeps them below its window (vLLM 0.33's planner tags each window spec the same way).
        specs = [
            replace(s, extra_retained_tokens=max(0, num_prefill_lookahead - 1)) if isinstance(s, SlidingWindowSpec) else s for s in specs
        ]
        if hash_block_size is not None and prefix_match_unit is None:
            hash_block_size = check_int("hash_block_size", hash_block_size, 1)
            if hash_block_size != resolve_block_sizes_of_specs(specs, enable_caching)[1]:
                prefix_match_unit = hash_block_size
        derived_scheduler_block_size, hash_block_size = resolve_block_sizes_of_specs(
            specs, enable_caching, prefix_match_unit, dcp_world_size
        )
        if scheduler_block_size is not None and scheduler_block_size != derived_scheduler_block_size:
            raise ValueError(
                f"scheduler_block_size must be {derived_scheduler_block_size} (the LCM of the groups' block sizes), got {scheduler_block_size!r}"
            )
        scheduler_block_size = derived_scheduler_block_size
        # The pool checks num_blocks (its door), the coordinator the mix of groups; both are
        # built before the first event is emitted, so a refused configuration leaves no trace.
        block_pool = block_pool_cls(
            num_blocks,
            enable_caching,
            event_log,
            enable_kv_cache_events=enable_kv_cache_events,
            kv_events_use_int_block_hashes=kv_events_use_int_block_hashes,
            metrics_collector=metrics_collector,
            prepend_uncached_blocks=prepend_uncached_blocks,
            hash_block_size=hash_block_size,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
        num_blocks = block_pool.num_gpu_blocks
        # vLLM 0.33: with Mamba layers or attention groups of several dtypes, the runner zeroes
        # the attention blocks handed out each step (KVCacheConfig.needs_kv_cache_zeroing);
        # each group's manager records them.
        needs_kv_cache_zeroing = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=tuple(KVCacheGroupSpec((), s) for s in specs)
        ).needs_kv_cache_zeroing
        coordinator = get_kv_cache_coordinator(
            specs,
            block_pool,
            enable_caching,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            use_eagle=use_eagle,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            manager_classes=manager_classes,
            eagle_group_ids=eagle_groups,
            hisparse_source_group_ids=hisparse_source_groups,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            num_prefill_lookahead=num_prefill_lookahead,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
        )

        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.kv_cache_groups: list[KVCacheSpec] = specs
        # Hit lengths and Mamba chunk ends are multiples of the scheduler block size (the LCM
        # of the groups' block sizes); hashes come every hash block size (their GCD).
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.use_eagle = use_eagle
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.num_prefill_lookahead = num_prefill_lookahead
        self.log_stats = log_stats
        self.events = event_log
        if event_log is not None:
            event_log.emit(
                PoolCreated(
                    num_blocks=num_blocks,
                    block_size=block_size,
                    groups=[s.to_dict() for s in specs],
                    enable_caching=enable_caching,
                    hash_algo=hash_algo,
                )
            )
        self.block_pool = block_pool
        self.coordinator = coordinator
        # One predicate read by the scheduler (where a chunk ends) and the Mamba groups (what
        # they save), so a chunk never stops at a junction whose state would not be kept.
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint
            and bool(coordinator.eagle_group_ids)
            and coordinator.enable_partial_hash_hits
            # multi-module MTP hands the groups less than the chunk's end to cache
            and coordinator.num_reprefillable_tokens == 0
        )
        for m in coordinator.single_type_managers:
            if isinstance(m, MambaManager):
                m.shared_prefix_checkpoint = self.mamba_shared_prefix_checkpoint
        self.needs_kv_cache_zeroing = needs_kv_cache_zeroing
        self.enable_kv_cache_events = enable_kv_cache_events
        self.metrics_collector = metrics_collector
        # (kind, sliding window) per group, filled into every BlockStored by take_events().
        self.kv_cache_event_metadata = tuple((get_kv_cache_spec_kind(s), get_kv_cache_spec_sliding_window(s)) for s in specs)
        self.num_kv_cache_groups = len(specs)
        self.request_block_hasher = get_request_block_hasher(hash_block_size, hash_fn, num_hash_lookahead_tokens=num_hash_lookahead_tokens)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self._requests: dict[str, Request] = {}
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple([] for _ in specs))
        # Groups whose hit is not cut back to the one all groups agree on (HiSparse's host group).
        self.retained_hit_group_ids = tuple(m.kv_cache_group_id for m in coordinator.single_type_managers if m.retains_longer_hit)
        # HiSparse (vLLM 0.33): a config with a host pool runs its coordinator, which moves the
        # source group onto the host pool before the first request.
        self.hisparse_host_num_blocks = host_num_blocks
        self._hisparse_config = given_config if host_num_blocks is not None else None
        self.hisparse: HiSparseCoordinator | None = None
        if host_num_blocks is not None:  # checked above: the config has a source group
            self.hisparse = get_hisparse_coordinator(self)

    # -- helpers --------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """KV-cache usage in [0, 1] (blocks in use / blocks, null excluded)."""
        return self.block_pool.get_usage()

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The pool's geometry as vLLM's engine core hands it to every worker
        (``initialize_from_config``): the block count and each group's spec, block size
        included. ``LLMEngine`` gives it to a ``ModelRunner`` built without one, so the
        lessons state ``num_blocks`` and ``block_size`` once, here. (kvlab's manager knows
        no layer names and lays out no tensors: those fields are empty.)"""
        if self._hisparse_config is not None:
            return self._hisparse_config  # HiSparse's groups carry roles and a host pool: the config as given
        eagle = self.coordinator.eagle_group_ids if self.coordinator.explicit_eagle_groups else ()
        groups = tuple(
            KVCacheGroupSpec(layer_names=(), kv_cache_spec=spec, is_eagle_group=i in eagle) for i, spec in enumerate(self.kv_cache_groups)
        )
        return KVCacheConfig(num_blocks=self.block_pool.num_gpu_blocks, kv_cache_tensors=(), kv_cache_groups=groups)

    def _bind(self, request: Request) -> None:
        if type(request) is Request and request._block_hasher is self.request_block_hasher:
            return  # bound to this manager's hasher already (every call after the first)
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__}")
        request.bind_block_hasher(self.request_block_hasher)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks.new_empty()

    def new_step_starts(self) -> None:
        """The scheduler calls this at the start of every step (a Mamba state saved during a
        step becomes usable by other requests from the next one)."""
        self.coordinator.new_step_starts()

    # -- the three questions ----------------------------------------------------------------
    @manager_lookup
    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None) -> tuple[KVCacheBlocks, int]:
        """Longest prefix of the request whose KV every group can supply from the cache.

        Capped at ``num_tokens - 1``: the last prompt token must be computed anyway, since
        its logits choose the next token. So a 25-token prompt at block size 16 gets at
        most 16 tokens from the cache, and a fully cached 32-token prompt only 16. The
        length is a multiple of the scheduler block size; positions a group will not read
        (outside a window, a finished chunk, an older Mamba state) are the null block.
        ``max_cache_hit_length`` (vLLM's name) caps it lower.
        """
        max_hit = self._check_max_hit(request, max_cache_hit_length)
        self._bind(request)
        return self._find_computed_blocks(request, max_hit)

    def _check_max_hit(self, request: Request, max_cache_hit_length: int | None) -> int:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__}")
        longest = max(0, request.num_tokens - 1)
        if max_cache_hit_length is None:
            return longest
        return check_int("max_cache_hit_length", max_cache_hit_length, 0, longest, why=" (the last token is always computed)")

    def _find_computed_blocks(self, request: Request, max_hit: int) -> tuple[KVCacheBlocks, int]:
        if not self.prefix_cache_lookup_enabled(request):
            request.shared_prefix_boundary = 0
            return self.empty_kv_cache_blocks.new_empty(), 0
        coord = self.coordinator
        blocks, num_hit_tokens = coord.find_longest_cache_hit(request.block_hashes, max_hit)
        # The junction of a longer prefix one group had and another lacked (vLLM 0.33 returns it
        # and the scheduler keeps it on the request): caching this request keeps its states.
        uncached = coord.num_uncached_common_prefix_tokens
        request.shared_prefix_boundary = num_hit_tokens + uncached if uncached else 0
        if num_hit_tokens > 0 and self.enable_kv_cache_events and request.kv_cache_report_mode == "full":
            # vLLM 0.33: a request may ask for its hit to be published too (every lookup's).
            self.coordinator.emit_cached_block_events(request, blocks)
        self._record_lookup(request, blocks, num_hit_tokens, max_hit)
        return self.create_kv_cache_blocks(blocks), num_hit_tokens

    def _record_lookup(self, request: Request, blocks: Sequence[Sequence[KVCacheBlock]], num_hit_tokens: int, max_hit: int) -> None:
        if self.events is not None:
            self.events.emit(
                PrefixLookup(
                    request_id=request.request_id,
                    num_tokens=request.num_tokens,
                    block_hashes=list(request.block_hashes),
                    hit_block_ids=[[b.block_id for b in g] for g in blocks],
                    num_hit_tokens=num_hit_tokens,
                    max_hit_tokens=max_hit,
                    preempted=request.num_preemptions > 0,
                )
            )

    @manager_lookup
    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local hit of a request scheduled with a KV connector that can complete a
        *divergent* hybrid hit (vLLM 0.33; P2P connectors such as nixl).

        Under block pressure a Mamba hybrid's groups disagree: full attention's tail may be
        evicted while a deeper Mamba state survives, or the reverse. ``get_computed_blocks``
        settles on the depth every group has; such a connector instead starts from full
        attention's own hit -- it moves the missing suffix and brings the lagging Mamba
        state itself -- so that is the hit given here, with ``hit_diverged`` True when
        another group lags behind it. Returns (blocks, hit tokens, shared-prefix boundary,
        hit_diverged). Where nothing can diverge (no Mamba group, no full attention) and
        where a lagging group hit *deeper* than full attention (its blocks were evicted:
        full attention is downward-closed, so that depth is not real), it is
        ``get_computed_blocks``' answer with False. As there, the request keeps the
        boundary (0 here: a per-group walk finds no uncached shared prefix)."""
        max_hit = self._check_max_hit(request, max_cache_hit_length)
        self._bind(request)
        coord = self.coordinator
        if not (
            isinstance(coord, HybridKVCacheCoordinator)
            and coord.full_attention_group_id is not None
            and any(isinstance(g, MambaSpec) for g in self.kv_cache_groups)
        ):
            return *self._find_computed_blocks(request, max_hit), request.shared_prefix_boundary, False
        fa_group_id = coord.full_attention_group_id
        if not self.prefix_cache_lookup_enabled(request):
            request.shared_prefix_boundary = 0
            return self.empty_kv_cache_blocks.new_empty(), 0, 0, False
        blocks, hits = coord.find_longest_cache_hit_per_group(request.block_hashes, max_hit)
        num_local = hits[fa_group_id]
        if any(hit > num_local for hit in hits):
            return *self._find_computed_blocks(request, max_hit), request.shared_prefix_boundary, False
        request.shared_prefix_boundary = 0
        self._record_lookup(request, blocks, num_local, max_hit)
        return self.create_kv_cache_blocks(blocks), num_local, 0, min(hits) < num_local

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether the cache is read for ``request`` (vLLM's name): not when caching is off,
        nor for a request that skips reading it (one that wants its prompt's logprobs)."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one lookup in the prefix-cache stats. The scheduler calls it when it ADMITS
        the request (vLLM >= 0.27: "record at admission so unscheduled lookups are not
        counted"): a request the admission gate turns away is looked up again at every step,
        and those retries are not queries. Lookups of preempted requests are kept apart."""
        if self.prefix_cache_stats is not None and self.prefix_cache_lookup_enabled(request):  # a skipped lookup is no query
            self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    @manager_call
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Room for ``num_new_tokens`` more tokens. Returns the *newly allocated* blocks, an
        empty KVCacheBlocks when none are needed, or None when the pool cannot supply them --
        then no ref count has moved and nothing was cached.

        The token layout, as in vLLM::

            | computed | new hits | external | new | lookahead |
                       |<------------- allocated ------------->|

        * ``num_new_computed_tokens`` / ``new_computed_blocks``: this request's prefix hit
          (from ``get_computed_blocks``; only for a request that holds no blocks yet);
        * ``num_external_computed_tokens``: tokens whose KV a connector (another engine, an
          offload tier) will write; they get blocks and, unless ``delay_cache_blocks``, are
          cached like computed tokens;
        * ``num_lookahead_tokens``: slots for draft tokens (speculative decoding), never cached;
        * ``full_sequence_must_fit``: the admission gate -- fail unless the WHOLE sequence
          (``request.num_tokens``), after the hit and without what a window will drop, fits
          in the free blocks now, even if only the first chunk is scheduled. The scheduler
          passes its ``scheduler_reserve_full_isl`` (True by default, as in vLLM) for
          waiting requests (lesson 05);
        * ``skip_zeroing_group_ids``: groups whose external blocks an asynchronous load
          writes after this step, so they are not recorded for zeroing (vLLM 0.33);
        * ``num_encoder_tokens``: an encoder-decoder model's encoder tokens; a
          cross-attention group gets room for these, not for the decoder's tokens;
        * ``reserved_blocks``: free blocks this allocation must leave alone. The scheduler
          passes what the requests still prefilling need to finish when it admits an
          asynchronous load, whose blocks stay held, with nothing computed, until the KV
          arrives: it must not take the blocks an admitted prefill is counting on (vLLM 0.33);
        * ``has_scheduled_reqs``: whether a request is already scheduled this step. vLLM
          applies its free-block watermark to a waiting request only then; kvlab's watermark
          is 0, so it changes nothing here (taken for vLLM 0.33's call shape).

        The arguments are in vLLM 0.33's order.
        """
        if not isinstance(has_scheduled_reqs, bool):
            raise TypeError(f"has_scheduled_reqs must be True or False, got {has_scheduled_reqs!r}")
        reserved_blocks = check_int("reserved_blocks", reserved_blocks, 0)
        if skip_zeroing_group_ids:
            self._check_group_ids("skip_zeroing_group_ids", skip_zeroing_group_ids)
        if num_encoder_tokens:
            num_encoder_tokens = check_int("num_encoder_tokens", num_encoder_tokens, 0)
            if not self.coordinator.cross_attention_group_ids:
                raise ValueError(f"num_encoder_tokens = {num_encoder_tokens}, but this manager has no CrossAttentionSpec group")
        self._bind(request)
        num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens, hits = self._check_allocate_args(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
        )
        rid = request.request_id
        has_hits = any(hits)

        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local_computed + num_external_computed_tokens
        if self.max_model_len is not None:
            total_computed = min(total_computed, self.max_model_len)
        coord = self.coordinator
        # Where the prefill ends, as the scheduler splits chunks against it (a resumed request
        # replays its output tokens too).
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            # The admission gate: would the whole sequence fit now?
            full = request.num_tokens if self.max_model_len is None else min(request.num_tokens, self.max_model_len)
            need = coord.get_num_blocks_to_allocate(
                rid,
                full,
                hits,
                total_computed,
                num_local_computed,
                full,
                apply_admission_cap=True,
                num_encoder_tokens=num_encoder_tokens,
                prefill_end=prefill_end,
            )
            if need > self.block_pool.get_num_free_blocks():
                return None

        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens
        if self.max_model_len is not None:
            num_tokens_need_slot = min(num_tokens_need_slot, self.max_model_len)
        # Blocks that left the window are freed even if this allocation fails: no future
        # query reads them, and freeing them first may make room.
        coord.remove_skipped_blocks(rid, total_computed, request.num_prompt_tokens)
        need = coord.get_num_blocks_to_allocate(
            rid,
            num_tokens_need_slot,
            hits,
            total_computed,
            num_local_computed,
            num_tokens_main_model,
            num_encoder_tokens=num_encoder_tokens,
            prefill_end=prefill_end,
        )
        if need > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if has_hits or num_external_computed_tokens > 0:
            # Hits are adopted before anything is allocated: an allocation must not evict them.
            coord.allocate_new_computed_blocks(rid, hits, num_local_computed, num_external_computed_tokens, skip_zeroing_group_ids)
        new_blocks = coord.allocate_new_blocks(rid, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens)
        self._requests[rid] = request
        if self.enable_caching and not delay_cache_blocks:
            # Cache only what will really be computed (never lookahead slots), and never
            # past the tokens the request actually has.
            coord.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    # -- block zeroing (vLLM 0.33) ----------------------------------------------------------
    def take_new_block_ids(self) -> list[int]:
        """The attention blocks handed out since the last call, for the runner to zero
        (empty unless ``needs_kv_cache_zeroing``); the lists start empty again. The scheduler
        drains them every step (``SchedulerOutput.new_block_ids_to_zero``)."""
        ids: list[int] = []
        for m in self.coordinator.single_type_managers:
            ids += m.take_new_block_ids()
        return ids

    # -- copy-on-write (vLLM 0.33) ----------------------------------------------------------
    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's Mamba states for a KV connector to offload (vLLM 0.33): request id ->
        [(group id, block id, tokens the state covers), ...] -- each state a request saved for
        reuse, and the copy that keeps a state saved inside a block. Drained: a second call
        returns {}. Empty without a Mamba group in "align" mode."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.coordinator.single_type_managers:
            for request_id, group_id, block, num_tokens in m.take_pending_boundary_state_offloads():
                offloads.setdefault(request_id, []).append((group_id, block.block_id, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """When ``request`` finishes, before its blocks are freed: a state it saved inside a
        block that no copy preserved, as [(group id, block id, boundary)] -- only where its
        block still holds that state (nothing computed past it). A connector offloads it, so a
        later request can still hit there. Once per request (vLLM 0.33)."""
        out: list[tuple[int, int, int]] = []
        for m in self.coordinator.single_type_managers:
            got = m.finalize_partial_tail_offload(request.request_id, request.num_computed_tokens, request.num_in_flight_tokens)
            if got is not None:
                group_id, block, boundary = got
                out.append((group_id, block.block_id, boundary))
        return out

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The pages to copy before the next forward pass, and the blocks they keep held.

        A hit that ends inside a block (partial hits on a Mamba hybrid) shares that block's
        first tokens but writes the rest into a private copy; a request that saved a Mamba
        state inside a block hands that state to a copy and goes on writing. Each pair's
        two blocks hold one extra reference each until the copy has run: the caller frees
        the returned blocks once it has (the scheduler: right away, since the copies run
        with the step it hands them to). The lists start empty again."""
        pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for m in self.coordinator.single_type_managers:
            pairs += m.take_pending_cow_copies()
        copies = [KVCacheBlockCopy(src_block_id=src.block_id, dst_block_id=dst.block_id) for src, dst in pairs]
        return copies, [b for pair in pairs for b in pair]

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record the request's blocks from ``start_token`` on for zeroing again: a failed
        asynchronous KV load left them unwritten and their zeroing was skipped.
        ``start_token`` must start a block in every recording group -- zeroing a block that
        holds valid tokens would wipe them."""
        recording = [m for m in self.coordinator.single_type_managers if m.records_new_block_ids]
        start_token = check_int("start_token", start_token, 0)
        for m in recording:
            if start_token % m.block_size:
                raise ValueError(
                    f"start_token = {start_token} is not a multiple of group {m.kv_cache_group_id}'s block size {m.block_size}"
                )
        for m in recording:
            m.new_block_ids += [b.block_id for b in m.req_to_blocks.get(request_id, ())[start_token // m.block_size :]]

    def _check_group_ids(self, name: str, ids: Any) -> None:
        if not isinstance(ids, tuple):
            raise TypeError(f"{name} must be a tuple of group ids, got {type(ids).__name__}")
        for g in ids:
            if type(g) is not int or not 0 <= g < self.num_kv_cache_groups:
                raise ValueError(f"{name}: {g!r} is not a group id (0..{self.num_kv_cache_groups - 1})")

    # -- argument checks (kvlab's: a learner's bad call is refused before anything changes) ----
    def _check_allocate_args(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
    ) -> tuple[int, int, int, int, tuple[list[KVCacheBlock], ...]]:
        """``allocate_slots``' arguments, checked and normalised (token counts as ints, the
        hits as one block list per group); raises naming the argument. Changes nothing."""
        # (Each `type(x) is not int or x < 0` only spares the common case a call.)
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            num_new_tokens = check_int("num_new_tokens", num_new_tokens, 0)
        if type(num_new_computed_tokens) is not int or num_new_computed_tokens < 0:
            num_new_computed_tokens = check_int("num_new_computed_tokens", num_new_computed_tokens, 0)
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            num_lookahead_tokens = check_int("num_lookahead_tokens", num_lookahead_tokens, 0)
        if type(num_external_computed_tokens) is not int or num_external_computed_tokens < 0:
            num_external_computed_tokens = check_int("num_external_computed_tokens", num_external_computed_tokens, 0)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be >= 1 when there are no computed tokens to adopt")
        if type(delay_cache_blocks) is not bool:
            raise TypeError(f"delay_cache_blocks must be a bool, got {delay_cache_blocks!r}")
        if type(full_sequence_must_fit) is not bool:
            raise TypeError(f"full_sequence_must_fit must be a bool, got {full_sequence_must_fit!r}")
        rid = request.request_id
        known = self._requests.get(rid)
        if known is not None and known is not request:
            raise ValueError(f"request id {rid!r} is already held by another request in this manager; ids must be unique")
        if new_computed_blocks is not None and not isinstance(new_computed_blocks, KVCacheBlocks):
            raise TypeError(
                f"new_computed_blocks must be None or the KVCacheBlocks that get_computed_blocks() returned, "
                f"got {type(new_computed_blocks).__name__}"
            )
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self.empty_kv_cache_blocks.blocks
        if len(hits) != self.num_kv_cache_groups:
            raise ValueError(f"new_computed_blocks has {len(hits)} groups, the manager has {self.num_kv_cache_groups}")
        has_hits = any(hits)
        retained = self.retained_hit_group_ids
        if retained and has_hits:
            # HiSparse's host group may have found more than the hit all groups agree on: it
            # keeps the part the local and external tokens cover (vLLM 0.33).
            reused = num_new_computed_tokens + num_external_computed_tokens
            hits = tuple(g[: cdiv(reused, self.kv_cache_groups[i].block_size)] if i in retained else g for i, g in enumerate(hits))  # type: ignore[arg-type]  # every spec has its block size by now
        partial = self.coordinator.enable_partial_hash_hits  # a hit may end inside its last block
        for gid, (spec, g) in enumerate(zip(self.kv_cache_groups, hits)) if has_hits else ():
            if gid in retained:
                continue  # its own length (checked against the pool's hashes in _check_hits)
            if not spec.prefix_cacheable:  # scratch (a ring): a hit never carries blocks for it
                if g:
                    raise ValueError(f"new_computed_blocks has {len(g)} blocks for a {type(spec).__name__} group, which is never a hit")
                continue
            bs: int = spec.block_size  # type: ignore[assignment]  # every spec has its block size by now
            if (
                (len(g) != cdiv(num_new_computed_tokens, bs) or num_new_computed_tokens % self.hash_block_size)
                if partial
                else len(g) * bs != num_new_computed_tokens
            ):
                raise ValueError(
                    f"num_new_computed_tokens = {num_new_computed_tokens} does not match new_computed_blocks "
                    f"({len(g)} blocks of {spec.block_size} tokens in a group)"
                )
        if not has_hits and num_new_computed_tokens:
            raise ValueError(f"num_new_computed_tokens = {num_new_computed_tokens} but new_computed_blocks is empty")
        if (known is not None or request.num_computed_tokens) and (has_hits or num_external_computed_tokens):
            raise ValueError(
                f"request {rid!r} is already running (it has computed tokens); prefix hits and external tokens are only for new requests"
            )
        if request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens > request.num_tokens:
            raise ValueError(
                f"request {rid!r}: {request.num_computed_tokens} computed + {num_new_computed_tokens} hit + "
                f"{num_external_computed_tokens} external tokens exceed its {request.num_tokens} tokens"
            )
        if has_hits:
            self._check_hits(request, hits, num_new_computed_tokens)
        return num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens, hits

    def _check_hits(self, request: Request, hits: tuple[list[KVCacheBlock], ...], num_hit_tokens: int) -> None:
        """Prefix hits are adopted only if each is a block of THIS pool that still carries
        the hash it was found under (lesson 04). Between ``get_computed_blocks`` and this
        call a hit can be evicted and reused for another prompt: adopting it would make the
        request read that prompt's K/V, silently. Checked before anything changes. (Only a
        full-attention group's hits may not be padded with the null block. A hit that ends
        inside its last block -- partial hits -- must find that block under the key of its
        last hash boundary.)"""
        for gid, (spec, group_hits) in enumerate(zip(self.kv_cache_groups, hits)):
            if not spec.prefix_cacheable:
                continue  # never a hit (checked empty before)
            pool = self.coordinator.single_type_managers[gid].block_pool  # HiSparse's host group has its own
            blocks = pool.blocks
            hashes = pool.resolve_block_hashes(request.block_hashes, spec.block_size)  # type: ignore[arg-type]  # every spec has its block size by now
            if num_hit_tokens % spec.block_size and group_hits:  # type: ignore[operator]  # as above
                # the last block is shared part-way: checked here, the rest below
                self._check_partial_hit(request, gid, group_hits[-1], num_hit_tokens, isinstance(spec, FullAttentionSpec), spec.block_size)  # type: ignore[arg-type]  # as above
                group_hits = group_hits[:-1]
            if len(group_hits) > len(hashes):
                raise ValueError(
                    f"new_computed_blocks[{gid}] has {len(group_hits)} blocks, but request {request.request_id!r} "
                    f"has only {len(hashes)} full blocks of {spec.block_size} tokens"
                )
            suffix = group_suffix(gid)
            full = isinstance(spec, FullAttentionSpec)
            try:  # the common case in one comprehension; the loop below names what is wrong
                if type(group_hits) is list and not [
                    b
                    for b, h in zip(group_hits, hashes)
                    if blocks[b.block_id] is not b or (b.cache_key != h + suffix and (full or not b.is_null))
                ]:
                    continue
            except (AttributeError, IndexError, TypeError):
                pass
            for i, b in enumerate(group_hits):
                where = f"new_computed_blocks[{gid}][{i}]"
                bid = self._check_pool_block(where, b, pool)
                if b.is_null:
                    if isinstance(spec, FullAttentionSpec):
                        raise ValueError(f"{where} is the null block; a full-attention group's hits are real blocks")
                    continue
                if b.cache_key != hashes[i] + suffix:
                    raise ValueError(
                        f"{where}: block {bid} no longer carries the hash of block {i} of request "
                        f"{request.request_id!r} -- it was evicted and reused since get_computed_blocks() found it, "
                        "so it holds another prompt's K/V. Look the request up again (get_computed_blocks) and "
                        "allocate with the new hits"
                    )

    def _check_pool_block(self, where: str, b: Any, pool: BlockPool | None = None) -> int:
        """``b`` is a block of this manager's pool (or of ``pool``: a group's own) -- a hit;
        returns its id."""
        if not isinstance(b, KVCacheBlock):
            raise TypeError(f"{where} must be a KVCacheBlock, got {type(b).__name__}")
        blocks = (pool or self.block_pool).blocks
        bid = b.block_id
        if type(bid) is not int or not 0 <= bid < len(blocks) or blocks[bid] is not b:
            raise ValueError(
                f"{where} (block {bid!r}) is not a block of this manager's pool; pass the hits that this "
                "manager's get_computed_blocks() returned"
            )
        return bid

    def _check_partial_hit(self, request: Request, gid: int, b: Any, num_hit_tokens: int, append_only: bool, block_size: int) -> None:
        """A hit's last block, shared part-way: findable under the key of the hit's last hash
        boundary -- or, for full attention, whose K/V only grows, of a later boundary in the
        same block (an EAGLE hit gives one hash block back)."""
        where = f"new_computed_blocks[{gid}][-1]"
        bid = self._check_pool_block(where, b)
        if b.is_null:
            raise ValueError(f"{where} is the null block; the block a hit ends inside is a real one")
        hb = self.hash_block_size
        first = num_hit_tokens // hb
        last = min(round_up(num_hit_tokens, block_size) // hb, len(request.block_hashes)) if append_only else first
        keys = {b.cache_key, *self.block_pool.cached_block_hashes_by_block.get(bid, ())}
        suffix = group_suffix(gid)
        if not any(request.block_hashes[k - 1] + suffix in keys for k in range(max(first, 1), last + 1) if k <= len(request.block_hashes)):
            raise ValueError(
                f"{where}: block {bid} is no longer findable under the hash of the request's first {num_hit_tokens} tokens -- "
                "it was evicted and reused since get_computed_blocks() found it. Look the request up again and allocate "
                "with the new hits"
            )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's blocks up to ``num_computed_tokens`` (after a delayed
        allocation: a connector has now written the external tokens)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def evict_blocks(self, block_ids: set[int] | Sequence[int]) -> list[int]:
        """Drop these blocks from the prefix cache (their KV failed to load; vLLM's name)."""
        return self.block_pool.evict_blocks(block_ids)

    @manager_call
    def free(self, request: Request) -> None:
        """Release all blocks of a finished or preempted request (tail first)."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r}")
        self.coordinator.free(request.request_id)
        self._requests.pop(request.request_id, None)

    @manager_call
    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request and hand back its blocks, group after group in table order,
        *without* returning them to the pool (vLLM 0.33): the caller frees them later, tail
        first (``block_pool.free_blocks(reversed(blocks))``) -- e.g. once a copy that still
        reads them has run. :meth:`free` does both at once."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r}")
        blocks = self.coordinator.pop_blocks_for_free(request.request_id)
        self._requests.pop(request.request_id, None)
        return blocks

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """A lookup result cut to its first ``num_computed_tokens`` tokens, group by group
        (vLLM 0.33): a copy -- ``blocks`` and every ref count are left as they are. The length
        must end on every group's block; a Mamba group may hold fewer (its state can come
        from a connector's load instead)."""
        n = check_int("num_computed_tokens", num_computed_tokens, 0)
        if not isinstance(blocks, KVCacheBlocks) or len(blocks.blocks) != len(self.kv_cache_groups):
            raise TypeError(f"blocks must be a KVCacheBlocks with one list per group ({len(self.kv_cache_groups)}), got {blocks!r}")
        out: list[list[KVCacheBlock]] = []
        for gid, (group_blocks, spec, m) in enumerate(zip(blocks.blocks, self.kv_cache_groups, self.coordinator.single_type_managers)):
            if not spec.prefix_cacheable:
                if group_blocks:
                    raise ValueError(f"group {gid} is never a prefix hit, but blocks.blocks[{gid}] holds {len(group_blocks)} blocks")
                out.append([])
                continue
            if n % m.block_size:
                raise AssertedValueError(f"num_computed_tokens must be a multiple of group {gid}'s block size {m.block_size}, got {n}")
            count = n // m.block_size
            if isinstance(spec, MambaSpec):
                count = min(count, len(group_blocks))
            elif count > len(group_blocks):
                raise AssertedValueError(
                    f"num_computed_tokens = {n} needs {count} blocks of group {gid}, the lookup found {len(group_blocks)}"
                )
            out.append(list(group_blocks[:count]))
        return self.create_kv_cache_blocks(tuple(out))

    @manager_call
    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        """Free the blocks no query will read again once ``processed_computed_tokens`` are
        computed -- those that left a window or a local chunk (replaced by the null block).
        The scheduler calls it when a request finishes, before it hands the block table to a
        KV connector (vLLM 0.33), so the connector is given only blocks that still matter."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        n = check_int("processed_computed_tokens", processed_computed_tokens, 0)
        p = check_optional_int("num_prompt_tokens", num_prompt_tokens, 0)
        self.coordinator.remove_skipped_blocks(request_id, n, p)

    # -- queries ----------------------------------------------------------------------------
    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """The request's block table cut to the blocks that hold its first
        ``num_computed_tokens`` tokens, group by group (vLLM 0.33's name; what a connector
        is handed when the request finishes). Mamba groups are not cut."""
        n = check_int("num_computed_tokens", num_computed_tokens, 0)
        out = []
        for spec, ids in zip(self.kv_cache_groups, self.get_block_ids(request_id)):
            if isinstance(spec, AttentionSpec) and not isinstance(spec, CrossAttentionSpec):
                ids = ids[: cdiv(n, spec.block_size)]  # type: ignore[arg-type]  # every group has its block size
            out.append(ids)
        return tuple(out)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table: one list of physical block ids per group (empty lists
        for a request that holds no blocks)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str, num_running_requests: int | None = None) -> list[int]:
        """0 for every group, as vLLM >= 0.32 returns since cascade attention was removed
        (the method stays for schedulers that call it). Earlier vLLM counted the leading
        blocks every request shared in full-attention groups, 0 for window groups and for
        every group with caching off."""
        return [0] * self.num_kv_cache_groups

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (e.g. after a weight update). Refused (False) while any
        request holds blocks. Every pool is reset, each once (HiSparse's host pool too: its
        hashes would still serve hits), and each is asked even if an earlier one refused, as
        in vLLM 0.33."""
        pools = dict.fromkeys(m.block_pool for m in self.coordinator.single_type_managers)
        ok = all([pool.reset_prefix_cache() for pool in pools])
        if ok and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return ok

    def take_events(self) -> list[KVEvent]:
        """The KV cache events queued since the last call, oldest first (empty unless
        ``enable_kv_cache_events``). As vLLM's manager does, each ``BlockStored`` gets its
        group's spec kind and sliding window here -- the pool does not know specs. Batch
        them with ``kv_events.KVEventBatch(ts=..., events=...)`` to publish."""
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for ev in events:
            if type(ev) is not BlockStored or ev.group_idx is None:
                continue
            if not 0 <= ev.group_idx < len(meta):
                # A pool used on its own can cache under any group id; vLLM warns and leaves
                # such an event without a spec.
                logger.warning("Group index `%s` not in KV cache metadata", ev.group_idx)
                continue
            ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = meta[ev.group_idx]
        return events

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Stats since the previous call (then start counting afresh), as vLLM's loggers do."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def check_invariants(self, held: Iterable[KVCacheBlock] = ()) -> None:
        """Pool invariants + every ref count equals the number of tables holding the block
        (plus one for each copy waiting for the runner that names it, and one for each time
        ``held`` names it: references the caller keeps, as the scheduler's deferred frees),
        and no table holds a block of another group's hash."""
        self.block_pool.check_invariants()
        if self.hisparse is not None:
            # HiSparse: an unpinned page is read without a reference and a transfer holds one
            # more at each end -- the coordinator's books, not the tables, account for them.
            assert self.hisparse.host_manager is not None
            self.hisparse.host_manager.block_pool.check_invariants()
            return
        counts: dict[int, int] = {}
        for b in held:
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for gid, m in enumerate(self.coordinator.single_type_managers):
            for rid, blocks in m.req_to_blocks.items():
                assert rid in self._requests or not blocks, f"blocks held by unknown request {rid!r}"
                for b in blocks:
                    if not b.is_null:
                        counts[b.block_id] = counts.get(b.block_id, 0) + 1
                        assert b.cache_key is None or b.cache_key[-4:] == gid.to_bytes(4, "big"), (
                            f"block {b.block_id} in a group-{gid} table is cached for another group"
                        )
                num_cached = m.num_cached_block.get(rid, 0)
                req = self._requests.get(rid)
                if req is None or not num_cached or not self.enable_caching or req.is_finished():
                    # (a finished request holding its blocks for a transfer reads nothing
                    # more; a failed load under policy "fail" may have evicted some of them)
                    continue
                hashes = self.block_pool.resolve_block_hashes(req.block_hashes, m.block_size)
                assert num_cached <= len(hashes), f"{rid!r}: {num_cached} cached blocks but {len(hashes)} block hashes"
                suffix = group_suffix(gid)
                # Positions a window group never caches (its reachable-block mask) may hold
                # an uncached block; every other position below num_cached holds a block
                # cached under THIS request's hash there -- else the request reads another
                # prompt's K/V (an adopted stale hit).
                boundaries = m.reachable_boundaries(req) if m.retention_interval is not None else ()
                mask = m.block_mask(0, num_cached, boundaries) if m.kv_cache_spec.prefix_cacheable else [False] * num_cached
                for i, b in enumerate(blocks[:num_cached]):
                    if b.is_null or ((mask is not None and not mask[i]) and b.cache_key is None):
                        continue
                    if b.cache_key is None and isinstance(m, MambaManager) and m.has_prefill_checkpoint_blocks:
                        continue  # a checkpoint block that held a passing state: its keys were dropped (vLLM 0.33)
                    n_tokens = b.block_hash_num_tokens
                    if n_tokens is not None and n_tokens != (i + 1) * m.block_size:
                        # Keyed inside a block: a Mamba prefill checkpoint sits one column
                        # before the block its tokens end in (vLLM 0.33), so check the key
                        # against the request's own hash at that boundary instead.
                        n = n_tokens // (self.block_pool.hash_block_size or m.block_size)
                        assert b.cache_key == req.block_hashes[n - 1] + suffix, (
                            f"{rid!r}: block {b.block_id} at position {i} of group {gid} carries another prefix's partial key"
                        )
                        continue
                    assert b.cache_key == hashes[i] + suffix, (
                        f"{rid!r}: block {b.block_id} at position {i} of group {gid} carries "
                        f"{'no hash' if b.cache_key is None else 'another prefix' + chr(39) + 's hash'}; "
                        "the request would read another prompt's K/V"
                    )
            for pair in m._pending_cow_copies:  # a copy waiting for the runner holds both its blocks once more
                for b in pair:
                    counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == counts.get(b.block_id, 0), (
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {counts.get(b.block_id, 0)} tables and waiting copies"
                )
