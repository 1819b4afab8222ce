"""What every offload tier shares (vLLM: ``vllm/v1/kv_offload/base.py``; lesson 12).

An *offloading manager* runs beside the scheduler and keeps the books of one store of KV
blocks outside the GPU pool -- which block hashes it holds, in which slot, which of them are
being read or written right now, which one goes first when room is needed. It never
touches bytes: the worker copies them (``kvlab.kv_offload.cpu.gpu_worker``). Its verbs, as in
vLLM 0.33 -- each one takes the :class:`ReqContext` of the request it acts for:

* ``lookup(key, req_context)`` -- is this block here and readable?
* ``prepare_load(keys, req_context)`` -- pin these blocks (no eviction while they are read),
  return where they are; ``complete_load(keys, req_context)`` unpins them;
* ``prepare_store(keys, req_context)`` -- find room for these blocks (evicting what the
  cache policy picks), return their slots and what was evicted; ``complete_store(keys,
  req_context, success)`` makes them readable (or, on failure, forgets them);
* ``touch(keys, req_context)`` -- mark blocks recently used;
* ``on_new_request`` / ``on_request_finished`` -- a request's first and last word. vLLM 0.33
  ranks a tier's blocks per request: the recency of what a request read or wrote is
  committed when it finishes, its blocks ordered head to tail by the token position the
  scheduler records in the context (``set_offload_key_position``).

A block is named by an *offload key*: its block hash followed by its KV-cache group as 4
big-endian bytes -- byte for byte kvlab's ``KVCacheBlock.cache_key`` (vLLM's
``make_offload_key``), so a tier and the GPU prefix cache speak of the same block.
"""

from __future__ import annotations

import contextlib
import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import numpy as np

from kvlab.kv_offload.config import OffloadingConfig
from kvlab.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from kvlab.kv_offload.stats import OffloadingConnectorStats

OffloadKey = bytes
_T = TypeVar("_T")

#: The labels of one series of ``vllm:kv_offload_config_info``: label name -> value.
ConfigInfoMapping = Mapping[str, str | int | float | bool]


@dataclass(frozen=True)
class ConfigInfo:
    """Static facts one offload component publishes as ``vllm:kv_offload_config_info`` (vLLM
    0.33): each field is one label, fixed for the process's lifetime, so a dashboard can
    show how big a tier is next to how full it is. See ``CPUOffloadingInfo``."""

    @classmethod
    def config_info_keys(cls) -> tuple[str, ...]:
        """One label name per field, in field order."""
        return tuple(f.name for f in fields(cls))

    def as_config_info(self) -> ConfigInfoMapping:
        """The label values (a None value reads "None", not empty)."""
        return {f.name: "None" if getattr(self, f.name) is None else getattr(self, f.name) for f in fields(self)}


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """A block hash and its KV-cache group packed into one key (vLLM's layout)."""
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


def get_offload_block_hash(key: OffloadKey) -> bytes:
    return key[:-4]


def get_offload_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


class Medium(str, enum.Enum):
    """Where a tier keeps its blocks (vLLM's ``Medium``; the value is what KV events carry).
    A ``str`` enum, so ``Medium.CPU == "CPU"``: kvlab's timeline records the plain value."""

    CPU = "CPU"
    STORAGE = "STORAGE"


#: The cache-hit source a tier on each medium reports (vLLM 0.33's metrics): host memory, or a
#: disk -- a block loaded from disk counts as disk though it passes through a CPU slot.
CACHE_HIT_SOURCE_OF_MEDIUM: dict[str, CacheHitSource] = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}


class Locality(enum.Enum):
    """Where a tier's storage sits relative to the engine that publishes its events."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class TierMatcher(NamedTuple):
    """One pattern over (medium, locality); None on either side matches anything."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | str | None, locality: Locality | None) -> bool:
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True)
class TierFilter:
    """Which tiers a request may load from: a tier passes if any matcher matches it.
    ``TierFilter.ALL`` (one match-all matcher) lets every tier serve."""

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]

    def allows(self, medium: Medium | str | None, locality: Locality | None) -> bool:
        return self is TierFilter.ALL or any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter(matchers=(TierMatcher(),))


@dataclass
class ReqContext:
    """What a tier knows of the request it is acting for.

    Two scratch spaces: ``set_state``/``get_state`` keep one value per type (a cache policy
    keeps the request's recency rank there, the manager the keys the request touched), and
    ``set_offload_key_position``/``get_offload_key_position`` the end-token position of each
    of the request's keys -- what lets a policy order a request's blocks head to tail even
    when stores arrive out of order."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: Any = None
    load_tier_filter: TierFilter = TierFilter.ALL
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[OffloadKey, int] = field(default_factory=dict, repr=False, init=False)

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._offload_key_positions.get(key)

    def owned_state(self, owner: object, cls: type[_T]) -> _T | None:
        """kvlab: ``get_state`` for one of several owners of the same state type -- kvlab's
        storage tier runs the CPU tier's books (and policy) too, and both keep a record of the
        request. vLLM has one such owner per request, and keys the state by type alone."""
        return self._state.get(_Owned, {}).get((owner, cls))

    def set_owned_state(self, owner: object, val: Any) -> None:
        self._state.setdefault(_Owned, {})[(owner, type(val))] = val


class _Owned:
    """The key under which ``ReqContext`` keeps per-owner state (see ``owned_state``)."""


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()  # here, but still being written: not readable yet
    RETRY = enum.auto()  # ask again later (vLLM: a tier still looking, asynchronously)


class OffloadPolicy(enum.Enum):
    """Which of a request's blocks a tier wants: only the newly computed ones (the default),
    or all of them, prefix hits included (a tier that needs a request's whole context)."""

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """A tier's answer to ``on_new_request``."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class ScheduleEndContext(NamedTuple):
    """What ``on_schedule_end`` is told about the step that ends."""

    new_req_ids: Collection[str]
    preempted_req_ids: Collection[str]


class LoadStoreSpec:
    """Where a worker finds (or puts) blocks of one medium -- opaque to the scheduler."""


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks named by index: GPU block ids, or a CPU tier's chunk (slot) ids. An int32
    array, as vLLM hands it to the copy kernels."""

    def __init__(self, block_ids: Iterable[int]) -> None:
        self.block_ids = np.array(list(block_ids), dtype=np.int32)

    def __repr__(self) -> str:
        return repr(self.block_ids)


@dataclass
class PrepareStoreOutput:
    """Which of the offered keys need storing (the others are here already), where they go
    (``store_spec``; a CPU tier's chunk ids), and the keys evicted to make room."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]
    evicted_slots: list[int] = field(default_factory=list)  # kvlab: the slots they freed

    @property
    def slots(self) -> list[int]:
        """The slot each of ``keys_to_store`` gets (``store_spec.block_ids`` as ints)."""
        ids = getattr(self.store_spec, "block_ids", ())
        return [int(i) for i in ids]


@dataclass
class OffloadingEvent:
    """A change to a tier's contents: ``removed`` False = stored (readable now), True = gone.

    vLLM's fields, then kvlab's two: ``slots`` (which slots the keys held) and ``reason``
    ("lru": the cache policy evicted them; otherwise why the entry was dropped).
    ``metadata_only``: a failed store released its reservation -- vLLM does not announce it
    as an eviction (the block was never readable); kvlab's timeline still shows it."""

    keys: list[OffloadKey]
    medium: Medium | str
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False
    slots: list[int] = field(default_factory=list)
    reason: str = "lru"


class OffloadingManager(ABC):
    """The scheduler-side books of one tier (see the module docstring). ``req_context`` may
    be left out in kvlab (a call for no particular request); vLLM always passes it."""

    medium: Medium | str = Medium.CPU

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """What a caller holds around every call but ``shutdown`` (vLLM 0.33): a manager
        entered from one thread only needs none (this default does nothing); one with a
        thread of its own (the tiering manager's tier-poll thread) returns a real, non
        reentrant lock. A caller holds it across a lookup HIT and the load that pins it, so
        no other thread can evict the block in between."""
        return contextlib.nullcontext()

    def get_load_source(self, key: OffloadKey, req_context: ReqContext | None = None) -> CacheHitSource:
        """The tier that supplied ``key``'s last HIT (asked only after a HIT). Unknown by
        default; the CPU tier says HOST, the tiering manager remembers a promoted block's
        origin (a disk hit is reported as a disk hit though it is read from host memory)."""
        return CacheHitSource.EXTERNAL_UNSPECIFIED

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult: ...

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        """Pin ``keys`` (all must be readable) and say where they are."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        return

    @abstractmethod
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        """Room for the keys not here yet (never evicting one of ``keys``), or None when there
        is not enough unpinned room -- then no block was evicted or allocated."""

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True) -> None:
        return

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        return

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        return

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        return

    def on_reset_flushed(self) -> None:
        """The workers reported every job in flight at the last ``reset_cache``: the chunks
        it freed are no longer being written."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def shutdown(self) -> None:
        return

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The metrics collected since the last call (and reset), or None when it keeps none."""
        return None

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """The labels of ``vllm:kv_offload_config_info``, one mapping per series; one empty
        series by default, so the metric exists whenever offloading runs."""
        return [{}]


@dataclass(frozen=True)
class OffloadingKVEventsConfig:
    """Which KV events an offloading backend publishes (vLLM 0.33's ``OffloadingSpec.kv_events_config``).

    ``enable_kv_cache_events``: the engine's own switch (``--kv-events-config``). When it is
    off nobody drains ``take_events``, so a tier that buffered events anyway would only grow
    its buffer: a tier's own opt-in (the fs tier's ``enable_kv_events``) counts only with it on.
    ``self_describing_kv_events``: the connector's opt-in (``kv_connector_extra_config``) to
    stored events that carry what a reader needs to use the block without asking the engine;
    it means nothing while ``enable_kv_cache_events`` is off."""

    enable_kv_cache_events: bool
    self_describing_kv_events: bool


# --- What the worker is handed (vLLM 0.33): GPU block specs, the canonical KV tensors, and
# how one worker's page maps into a parallelism-free ("canonical") page. The worker's copies
# live in kvlab.kv_offload.cpu.gpu_worker; these are plain records, so this module stays free
# of torch (a tensor field is typed Any).


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks of one transfer, ordered by KV-cache group.

    ``group_sizes[g]``: how many of ``block_ids`` belong to group ``g`` (they add up to
    ``len(block_ids)``). ``block_indices[g]``: the position in the request of group ``g``'s
    first block -- needed when an offloaded chunk spans several GPU blocks, because a
    group's first GPU block may then sit in the middle of its first chunk."""

    def __init__(self, block_ids: Iterable[int], group_sizes: Sequence[int], block_indices: Sequence[int]) -> None:
        ids = np.array(list(block_ids), dtype=np.int32)
        if sum(group_sizes) != len(ids):
            raise ValueError(f"group_sizes {tuple(group_sizes)} add up to {sum(group_sizes)}, but there are {len(ids)} block_ids")
        if len(block_indices) != len(group_sizes):
            raise ValueError(f"block_indices has {len(block_indices)} entries; it needs one per group ({len(group_sizes)})")
        self.block_ids = ids
        self.group_sizes: Sequence[int] = group_sizes
        self.block_indices: Sequence[int] = block_indices


@dataclass
class CanonicalKVCacheTensor:
    """One KV cache tensor whose first dimension is the block (``(num_blocks, ...)``), and
    its page size per block in bytes, padding included."""

    tensor: Any  # torch.Tensor
    page_size_bytes: int


@dataclass(frozen=True)
class CopyRun:
    """A strided correspondence of bytes between this worker's page and the canonical page:
    fragment ``i`` (of ``num_fragments``, ``fragment_size`` bytes each) sits at
    ``local_offset + i * local_stride`` in the worker's page and at ``canonical_offset + i *
    canonical_stride`` in the canonical one -- e.g. one head shard of every token."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


#: vLLM 0.33's physical KV-cache layouts (``KVCacheLayout``'s member names): the logical
#: axes [L, B, H, N, C] -- layer, block, head, token, content -- in memory order.
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
#: The canonical byte format's version (vLLM 0.33: 1); a change to the page format bumps it.
CANONICAL_FORMAT_VERSION = 1


def canonical_format_id(kv_cache_layout: str) -> str:
    """The name of the canonical byte format, for the storage namespace (vLLM 0.33's
    ``canonical_format_id``): a canonical page keeps the worker's layout family, so the name
    pairs the format version with that family -- "v1-nhd" for tokens before heads
    (``LBNHC``), "v1-hnd" for heads before tokens (``LBHNC``, the older spellings kept so
    files written before the layout names existed still match), else the layout's name in
    lower case. Canonical and direct bytes never share a folder."""
    if kv_cache_layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache_layout must be one of {KV_CACHE_LAYOUTS}, got {kv_cache_layout!r}")
    family = {"LBNHC": "nhd", "LBHNC": "hnd"}.get(kv_cache_layout, kv_cache_layout.lower())
    return f"v{CANONICAL_FORMAT_VERSION}-{family}"


@dataclass(frozen=True)
class CanonicalPageMapping:
    """How this worker's page lands in the canonical page (never serialized). ``runs``
    cover the whole local page. Workers that hold the very same bytes (``num_writers`` of
    them, this one ``writer_index``) take turns storing them, one block each, so each page
    is written once and the writes spread over the workers."""

    canonical_page_size_bytes: int
    local_page_size_bytes: int  # this worker's page, without padding
    runs: tuple[CopyRun, ...]
    num_writers: int
    writer_index: int
    parallelism_agnostic: bool  # the canonical bytes are the same under any parallel config

    def is_writer(self, block_id: int) -> bool:
        """Whether this worker stores the canonical page of ``block_id``."""
        return block_id % self.num_writers == self.writer_index


@dataclass
class CanonicalKVCacheRef:
    """A layer's (or a group of layers') reference to one of the canonical tensors, with the
    layer's page size without padding; ``mapping`` None: no canonical mapping is certified."""

    tensor_idx: int
    page_size_bytes: int
    mapping: CanonicalPageMapping | None = None


@dataclass
class CanonicalKVCaches:
    """The KV caches as the worker sees them: the distinct tensors, and per KV-cache group
    the references that say which tensor each layer uses."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


@dataclass
class TransferResult:
    """A finished transfer job: whether it worked, its bytes and seconds (None: unknown)."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


# -- metric definitions (vLLM 0.33): what a spec declares, so the frontend can create the metrics --
# A backend's ``build_metric_definitions`` maps each metric name to one of these; the kind is the
# class. kvlab's own tiers report values (``get_stats``) and declare none themselves.


@dataclass(frozen=True)
class OffloadingMetricMetadata:
    """One metric's help text and label names (fixed for the process)."""

    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclass(frozen=True)
class OffloadingCounterMetadata(OffloadingMetricMetadata):
    """A count that only grows (bytes moved, jobs failed)."""


@dataclass(frozen=True)
class OffloadingGaugeMetadata(OffloadingMetricMetadata):
    """A value that goes up and down (chunks pinned, jobs in flight). ``multiprocess_mode``:
    how Prometheus merges the samples of several API-server processes; every frontend gets
    the engine's whole snapshot each step, so the newest sample is the value ("mostrecent")
    -- a sum would count it once per frontend."""

    multiprocess_mode: str = "mostrecent"


@dataclass(frozen=True)
class OffloadingHistogramMetadata(OffloadingMetricMetadata):
    """A distribution (lookup delays); ``buckets`` None: the client library's default ones."""

    buckets: tuple[float, ...] | None = None


# -- the worker's verbs and the spec that builds both halves (vLLM 0.33) -----------------------


class NotASubclassError(TypeError, AssertionError):
    """A class named by configuration (an out-of-tree spec or tier) is not of the base it must
    extend. vLLM ``assert``s this; kvlab says which class and which base, and stays catchable
    as either error."""


class OffloadingWorker(ABC):
    """The worker side of one offloading backend: it moves the bytes the manager's books
    describe. ``submit_*`` start a job and return at once (True: accepted); ``get_finished``
    reports each job once; ``wait`` blocks until the named jobs are done."""

    @abstractmethod
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool: ...

    @abstractmethod
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool: ...

    @abstractmethod
    def get_finished(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None:
        return


class OffloadingSpec(ABC):
    """One offloading backend, built from the engine's :class:`~kvlab.kv_offload.config.OffloadingConfig`
    by :class:`~kvlab.kv_offload.factory.OffloadingSpecFactory` (``extra_config["spec_name"]``).

    Why a spec and not the manager directly: the scheduler process needs only the books
    (``get_manager``) and each worker process only the copies (``get_worker``); the spec is
    the one object both build from, so both sides agree on the sizes it derives here (tokens
    per block per group, blocks per chunk) and in subclasses (chunks, bytes per chunk)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The metrics this backend reports (name -> kind, help text, labels): none by default."""
        return {}

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The label names the manager's ``config_info`` fills (see :class:`ConfigInfo`)."""
        return ()

    def __init__(self, config: OffloadingConfig) -> None:
        if not isinstance(config, OffloadingConfig):
            raise TypeError(
                f"config must be an OffloadingConfig (kvlab.kv_offload.config: the engine's facts a backend "
                f"reads -- not a VllmConfig), got {type(config).__name__}"
            )
        if not isinstance(config.extra_config, Mapping):
            raise TypeError(f"config.extra_config must be a dict (kv_connector_extra_config), got {type(config.extra_config).__name__}")
        self.config = config
        self.extra_config = config.extra_config
        self.replicated_layout: bool = False  # a subclass that can share one copy says so
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=config.enable_kv_cache_events,
            self_describing_kv_events=bool(self.extra_config.get("self_describing_kv_events", False)),
        )
        # Offload the prompt's blocks only (the default): what a request generated is often
        # dropped before its next turn (a reasoning model strips its thinking).
        self.offload_prompt_only: bool = bool(self.extra_config.get("offload_prompt_only", True))
        self.tokens_per_block: tuple[int, ...] = tuple(g.tokens_per_block for g in config.groups)
        self.tokens_per_hash: int = config.cache.tokens_per_hash
        self.blocks_per_chunk: int = config.cache.blocks_per_chunk

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The books, for the scheduler side (built once, then the same object)."""

    @abstractmethod
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The copies between ``kv_caches`` and this backend, for a worker (built once)."""
