"""HiSparse's coordinator (vLLM 0.33: ``vllm/v1/hisparse/coordinator.py`` and ``types.py``):
what moves between the GPU and the host pool, and when.

The GPU-resident pages are a *write-back cache* of the host tier. Each page goes through
three states:

1. **dirty** -- only the GPU copy exists (the forward pass just wrote it). Its block is held.
2. **clean** -- a transfer copied it to the host block (``valid_pages``). The host hash may
   now be published (a prefix hit will only ever read a complete host page).
3. **unpinned** -- clean, and its reference given back with ``BlockPool.unpin_blocks``: the
   pool counts the block as free and hands it out last; until it does, the request goes on
   reading it, and when it does (the reuse callback) the page is *lost* -- read from the
   host from then on, which the worker learns through a residency update, never by editing
   the append-only block table.

A request may only lose pages once it can read from the host, i.e. holds its hot buffer.
One that cannot keeps its clean pages pinned, and asks for a hot buffer when the GPU pool
runs low or when it holds the resident pages admission reserved for it.

Transfers are planned here (``build_offload_command``) and run by the worker connector; the
blocks at both ends stay held (touched) until every worker reported it done
(``update_spills``). A request that finishes while its last pages are in flight leaves
them *detached*: they are published once the copies complete (deferred free).

Host pages also keep a *copy index*: the GPU copy of each published host page, readable
until the pool reuses it, so that a later prefix hit on the host comes back GPU-resident
where it still can (adoption).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlab.core.block_pool import BlockPool
from kvlab.core.hisparse_managers import HiSparseHotManager, HiSparseResidentManager, HiSparseSourceManager
from kvlab.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock, KVCacheBlockCopy
from kvlab.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from kvlab.kv_cache_interface import HiSparseResidentSpec
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "HiSparseCoordinator",
    "SparseKVOffloadCommand",
    "SparseKVPageTransfer",
    "SparseKVResidencyUpdate",
    "SparseKVRowMirror",
    "get_hisparse_coordinator",
]

#: Sealed pages this close to the end of a request's block table stay pinned on the GPU: a
#: step still in flight may be writing them, so their blocks must not be handed out yet.
ACTIVE_TAIL_PAGES = 2


# --- what the scheduler tells the worker -------------------------------------------------------
@dataclass(frozen=True)
class SparseKVPageTransfer:
    """Copy one page between a GPU block of each resident group and a host block: GPU to
    host (a write-back; ``after_forward``: once this step's forward pass wrote it), or host
    to GPU (``restore``: an imported prefix's last page, which the request writes again)."""

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    after_forward: bool
    restore: bool = False


@dataclass(frozen=True)
class SparseKVRowMirror:
    """Copy ``num_rows`` rows from each resident group's GPU rows at ``source_starts`` to the
    host rows at ``destination_start`` (the rows a step writes, mirrored as it goes)."""

    source_starts: tuple[int, ...]
    destination_start: int
    num_rows: int


@dataclass(frozen=True)
class SparseKVResidencyUpdate:
    """For some of a request's pages, the GPU block each resident group reads it from (the
    null block's id: read it from the host)."""

    pages: list[int]
    block_ids: tuple[list[int], ...]


@dataclass
class SparseKVOffloadCommand:
    """One step's transfers, for the worker connector."""

    page_transfers: list[SparseKVPageTransfer]


# --- the coordinator's books -------------------------------------------------------------------
@dataclass
class _PendingPublication:
    """A request's caching, waiting for its pages' host copies."""

    request: Any
    num_computed_tokens: int
    num_pages: int
    retention_interval: Any
    replay_boundaries: Sequence[int] | None
    detached_blocks: list[KVCacheBlock] | None = None  # the request finished first: its host blocks
    num_cached_blocks: int = 0


@dataclass
class _HiSparseRequestState:
    """One request's residency. ``valid_pages``: clean pages (host copy complete);
    ``ready_prefix_pages``: how many leading pages are clean (what may be published);
    ``pending_pages``: page -> transfer in flight; ``pinned_clean``: clean pages still holding
    their block; ``unpinned_pages``: clean pages given back but still read; ``pages_to_adopt``:
    host prefix pages to point at GPU copies after the admitting allocation;
    ``synced_pages`` / ``stale_pages``: what the worker already knows of the residency."""

    valid_pages: set[int] = field(default_factory=set)
    ready_prefix_pages: int = 0
    pending_pages: dict[int, int] = field(default_factory=dict)
    publication: _PendingPublication | None = None
    copies_recorded_blocks: int = 0
    pinned_clean: set[int] = field(default_factory=set)
    unpinned_pages: set[int] = field(default_factory=set)
    pages_to_adopt: int = 0
    synced_pages: int = 0
    stale_pages: set[int] = field(default_factory=set)


@dataclass
class _PendingSpill:
    """A transfer in flight, and how many workers must report it done."""

    transfer_id: int
    page: tuple[str, int]
    request_state: _HiSparseRequestState
    host_block: KVCacheBlock
    resident_blocks: tuple[KVCacheBlock, ...]
    restore: bool = False
    expected_worker_completions: int = 0
    worker_completions: int = 0
    enqueue_applied: bool = False


class HiSparseCoordinator:
    """Host allocation, host publication, transfers and GPU residency of HiSparse's groups
    (see the module docstring)."""

    def __init__(
        self,
        kv_cache_config: Any,
        managers: tuple[SingleTypeKVCacheManager, ...],
        max_model_len: int | None,
        *,
        num_reprefillable_tokens: int,
    ) -> None:
        self.managers = managers
        self.max_model_len = max_model_len
        self.num_reprefillable_tokens = num_reprefillable_tokens
        groups = kv_cache_config.kv_cache_groups
        resident: list[HiSparseResidentManager] = []
        hot: list[HiSparseHotManager] = []
        resident_ids: list[int] = []
        for gid, (group, m) in enumerate(zip(groups, managers)):
            if isinstance(group.kv_cache_spec, HiSparseResidentSpec):
                if not isinstance(m, HiSparseResidentManager):
                    raise TypeError(f"kv_cache_groups[{gid}] is a HiSparseResidentSpec group but runs {type(m).__name__}")
                if group.host_resident:
                    raise ValueError(f"kv_cache_groups[{gid}]: HiSparse's resident pages live on the GPU (host_resident=False)")
                resident.append(m)
                resident_ids.append(gid)
            if isinstance(m, HiSparseHotManager):
                if group.host_resident:
                    raise ValueError(f"kv_cache_groups[{gid}]: HiSparse's hot buffer lives on the GPU (host_resident=False)")
                hot.append(m)
        self.resident_managers = tuple(resident)
        self.hot_managers = tuple(hot)
        self.host_manager: HiSparseSourceManager | None = None
        self.host_group_id: int | None = None
        self.max_spill_pages = 0
        sources = [(gid, m) for gid, m in enumerate(managers) if isinstance(m, HiSparseSourceManager)]
        if len(sources) > 1:
            raise ValueError(f"kv_cache_groups {[g for g, _ in sources]} are HiSparse source groups; only one is supported")
        num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        if sources and num_host_blocks is None:
            raise ValueError("HiSparse's source group needs a host pool: KVCacheConfig.hisparse_host_num_blocks is None")
        if resident:
            if not sources:
                raise ValueError("HiSparse's resident groups need a source group (role HISPARSE_SOURCE) to write back to")
            source_gid, source = sources[0]
            if source_gid > min(resident_ids):
                raise ValueError(f"HiSparse's source group ({source_gid}) must come before its resident groups {resident_ids}")
            sizes = {m.block_size for m in resident}
            if len(sizes) != 1:
                raise ValueError(f"HiSparse's resident groups must share one block size, got {sorted(sizes)}")
            if source.block_size not in sizes:
                raise ValueError(f"HiSparse's source block size {source.block_size} differs from its resident groups' {sizes.pop()}")
        # Checked: now bind (nothing above changed anything).
        for m in (*resident, *hot):
            m.coordinator = self
        if sources:
            self.host_group_id, self.host_manager = sources[0]
            self.host_manager.coordinator = self
            self.host_manager.bind_host_pool(num_host_blocks)
        self.has_host_cache = self.host_manager is not None
        self.gpu_pool: BlockPool | None = None
        self.transition_watermark = 0
        if resident:
            block_size = resident[0].block_size
            self.max_spill_pages = (max_model_len or 0) // block_size
            self.gpu_pool = resident[0].block_pool
            # Requests start reading from the host once this few GPU blocks are free, so that
            # admissions find evictable pages rather than pinned ones.
            self.transition_watermark = max(sum(m.blocks_per_request for m in hot), kv_cache_config.num_blocks // 10)
        # Host copies handed to the worker, by destination block id, until it ran them.
        self._retained_copies: dict[int, tuple[KVCacheBlock, KVCacheBlock]] = {}
        # request -> the prefix an external load is still writing into host pages.
        self._pending_imports: dict[str, int] = {}
        # Requests whose resident pages were all on the GPU when last looked at.
        self._resident_requests: set[str] = set()
        self.spills_to_send: list[SparseKVPageTransfer] = []
        self.pending_spills: dict[int, _PendingSpill] = {}
        self.request_states: dict[str, _HiSparseRequestState] = {}
        self.next_spill_id = 0
        # Published host page key -> the GPU copies of it (one per resident group).
        self.copies: dict[BlockHashWithGroupId, tuple[KVCacheBlock, ...]] = {}
        self._copy_by_block: dict[int, BlockHashWithGroupId] = {}
        # Unpinned GPU block id -> the (request, page) pairs still reading it.
        self._owners: dict[int, set[tuple[str, int]]] = {}

    def _get_request_state(self, request_id: str) -> _HiSparseRequestState:
        state = self.request_states.get(request_id)
        if state is None:
            state = self.request_states[request_id] = _HiSparseRequestState()
        return state

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        """A host prefix hit: its pages are clean by definition (published = complete)."""
        self._resident_requests.discard(request_id)
        if not self.resident_managers or self.host_manager is None:
            return
        num_host_pages = min(num_host_pages, len(self.host_manager.req_to_blocks.get(request_id, ())))
        if num_host_pages == 0:
            return
        state = self._get_request_state(request_id)
        state.valid_pages.update(range(num_host_pages))
        state.ready_prefix_pages = max(num_host_pages, state.ready_prefix_pages)
        # Adopting GPU copies pins them: only after the admitting allocation (update_residency).
        state.pages_to_adopt = max(state.pages_to_adopt, num_host_pages)
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_host_pages)

    # -- host copy-on-write ----------------------------------------------------------------
    def take_host_block_copies(self) -> tuple[KVCacheBlockCopy, ...]:
        """The host copy-on-write pairs for the connector; both ends stay held until the
        worker reports the copies done (``release_completed_host_copies``)."""
        if self.host_manager is None:
            return ()
        pairs = self.host_manager.take_host_cow_copies()
        for src, dst in pairs:
            self._retained_copies[dst.block_id] = (src, dst)
        return tuple(KVCacheBlockCopy(src_block_id=src.block_id, dst_block_id=dst.block_id) for src, dst in pairs)

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        blocks: list[KVCacheBlock] = []
        for dst in dst_block_ids:
            pair = self._retained_copies.pop(dst, None)
            if pair is not None:
                blocks.extend(pair)
        if blocks:
            assert self.host_manager is not None
            self.host_manager.block_pool.free_blocks(list(reversed(blocks)))

    def get_host_block_pool(self) -> BlockPool | None:
        return None if self.host_manager is None else self.host_manager.block_pool

    # -- GPU copies of published host pages ----------------------------------------------------
    def _adopt_copies(self, request_id: str, state: _HiSparseRequestState, host_blocks: Sequence[KVCacheBlock]) -> None:
        """Point host-only prefix pages at GPU copies still in the pool (page by page: a
        missing copy only means that page is read from the host)."""
        if not self.copies:
            return
        for idx, host_block in enumerate(host_blocks):
            key = host_block.cache_key
            if host_block.is_null or key is None:
                continue
            copies = self.copies.get(key)
            if copies is None:
                continue
            for m, block in zip(self.resident_managers, copies):
                if m.adopt_resident_page(request_id, idx, block):
                    m.block_pool.touch([block])
                    state.pinned_clean.add(idx)
                    if idx < state.synced_pages:
                        state.stale_pages.add(idx)

    def _record_copies(self, request_id: str, num_computed_tokens: int) -> None:
        """Index the GPU copies of host pages just published."""
        if not self.resident_managers:
            return
        assert self.host_manager is not None
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if not host_blocks:
            return
        state = self._get_request_state(request_id)
        num_full = min(num_computed_tokens // self.host_manager.block_size, len(host_blocks))
        for idx in range(state.copies_recorded_blocks, num_full):
            if idx not in state.pending_pages:
                self._record_copy(request_id, idx, host_blocks[idx])
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_full)

    def _record_copy(self, request_id: str, page_idx: int, host_block: KVCacheBlock) -> None:
        key = host_block.cache_key
        if host_block.is_null or key is None:
            return
        blocks: list[KVCacheBlock] = []
        for m in self.resident_managers:
            block = m.get_resident_page(request_id, page_idx)
            if block is None:
                return
            blocks.append(block)
        self._drop_copy(key)
        self.copies[key] = tuple(blocks)
        for b in blocks:
            self._copy_by_block[b.block_id] = key

    def _drop_copy(self, key: BlockHashWithGroupId) -> None:
        for b in self.copies.pop(key, ()):
            self._copy_by_block.pop(b.block_id, None)

    # -- residency -----------------------------------------------------------------------------
    def _can_read_from_host(self, request_id: str) -> bool:
        """Whether the request holds its hot buffer (so its resident pages may be lost)."""
        return bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)

    def _fills_admission_window(self, request_id: str) -> bool:
        """Whether the request holds the resident pages its admission reserved: a prefill
        that kept older pages pinned past that would outgrow the pool it was admitted into."""
        return any(
            m.max_admission_blocks_per_request is not None
            and len(m.req_to_blocks.get(request_id, ())) >= m.max_admission_blocks_per_request
            for m in self.resident_managers
        )

    def _resident_page_blocks(self, request_id: str, page_idx: int) -> list[KVCacheBlock] | None:
        """The page's GPU block in each resident group, if it is sealed (not among the last
        ``ACTIVE_TAIL_PAGES``) and on the GPU in all of them."""
        blocks: list[KVCacheBlock] = []
        for m in self.resident_managers:
            block = m.get_resident_page(request_id, page_idx)
            if page_idx >= len(m.req_to_blocks.get(request_id, ())) - ACTIVE_TAIL_PAGES or block is None:
                return None
            blocks.append(block)
        return blocks

    def _unpin_page(self, request_id: str, state: _HiSparseRequestState, page_idx: int) -> bool:
        if page_idx in state.pending_pages or page_idx not in state.valid_pages:
            return False
        blocks = self._resident_page_blocks(request_id, page_idx)
        if blocks is None:
            return False
        for m, b in zip(self.resident_managers, blocks):
            self._owners.setdefault(b.block_id, set()).add((request_id, page_idx))
            m.block_pool.unpin_blocks([b], self._on_block_reused)
        state.pinned_clean.discard(page_idx)
        state.unpinned_pages.add(page_idx)
        return True

    def _unpin_clean_pages(self, request_id: str, state: _HiSparseRequestState) -> None:
        for page_idx in sorted(state.pinned_clean, reverse=True):  # tail first: lost before the head
            self._unpin_page(request_id, state, page_idx)

    def _page_became_clean(self, request_id: str, state: _HiSparseRequestState, page_idx: int) -> None:
        state.pinned_clean.add(page_idx)
        if self._can_read_from_host(request_id):
            self._unpin_page(request_id, state, page_idx)

    def _on_block_reused(self, block: KVCacheBlock) -> None:
        """The pool handed out an unpinned block: its copy and its readers lose it."""
        key = self._copy_by_block.get(block.block_id)
        if key is not None:
            self._drop_copy(key)
        for request_id, page_idx in self._owners.pop(block.block_id, ()):
            self._lose_page(request_id, page_idx)

    def _lose_page(self, request_id: str, page_idx: int) -> None:
        self._resident_requests.discard(request_id)
        state = self.request_states.get(request_id)
        if state is None:
            return
        for m in self.resident_managers:
            block = m.drop_resident_page(request_id, page_idx)
            if block is not None:
                owners = self._owners.get(block.block_id)
                if owners is not None:
                    owners.discard((request_id, page_idx))
        state.unpinned_pages.discard(page_idx)
        if page_idx < state.synced_pages:
            state.stale_pages.add(page_idx)
        for hot in self.hot_managers:
            hot.require_hot(request_id)

    def update_residency(self, request_id: str) -> None:
        """One step's residency policy for a scheduled request: adopt pending GPU copies;
        if it can read from the host, give back every clean sealed page; if not, keep them
        pinned, and ask for a hot buffer once the pool runs low or the request fills its
        admission window (the pages stay pinned until the buffer is allocated)."""
        if not self.resident_managers:
            return
        state = self._get_request_state(request_id)
        if state.pages_to_adopt:
            assert self.host_manager is not None
            host_blocks = self.host_manager.req_to_blocks.get(request_id, [])
            self._adopt_copies(request_id, state, host_blocks[: state.pages_to_adopt])
            state.pages_to_adopt = 0
        if not self._can_read_from_host(request_id):
            assert self.gpu_pool is not None
            if self.gpu_pool.get_num_free_blocks() >= self.transition_watermark and not self._fills_admission_window(request_id):
                return
            for m in self.hot_managers:
                m.require_hot(request_id)
            return
        self._unpin_clean_pages(request_id, state)

    # -- host publication and transfers --------------------------------------------------------
    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        """Each step, for each scheduled (request id, tokens computed once the step ends):
        plan the write-backs of its sealed pages (never the last ``num_reprefillable_tokens``,
        which multi-module MTP may compute again), then its residency."""
        if not self.resident_managers:
            return
        requests = self._check_scheduled("requests", requests, 2)
        for request_id, num_tokens in requests:
            self.plan_prefix_materialization(request_id, max(0, num_tokens - self.num_reprefillable_tokens))
            self.update_residency(request_id)

    def _check_scheduled(self, name: str, requests: Iterable[Any], width: int) -> list[Any]:
        """``requests`` as a list of (request id, counts...) tuples of ``width`` items, each
        request one this manager holds and each count an int >= 0 -- checked whole before
        anything changes (a bad entry would otherwise leave books for a request that is not
        there)."""
        items = list(requests)
        held = self.resident_managers[0].req_to_blocks
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != width:
                raise TypeError(
                    f"{name}[{i}] must be a tuple of {width} (request id, {'tokens' if width == 2 else 'computed, scheduled'}), got {item!r}"
                )
            if item[0] not in held:
                raise ValueError(f"{name}[{i}]: request {item[0]!r} holds no HiSparse pages here (allocate_slots first)")
            for n in item[1:]:
                if type(n) is not int or n < 0:
                    raise ValueError(f"{name}[{i}]: token counts must be ints >= 0, got {n!r}")
        return items

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        """Plan a write-back for each sealed page that has no host copy yet, within the
        per-step budget (``max_model_len`` pages in all)."""
        if not self.resident_managers:
            return
        assert self.host_manager is not None
        block_size = self.host_manager.block_size
        num_pages = num_computed_tokens // block_size
        importing = cdiv(self._pending_imports.get(request_id, 0), block_size)
        state = self._get_request_state(request_id)
        budget = max(self.max_spill_pages - len(self.spills_to_send), 0)
        for page_idx in range(max(state.ready_prefix_pages, importing), num_pages):
            if budget == 0:
                break
            if page_idx in state.pending_pages or page_idx in state.valid_pages:
                continue
            if any(m.get_resident_page(request_id, page_idx) is None for m in self.resident_managers):
                continue
            if self._plan_page_transfer(request_id, page_idx, after_forward=True):
                budget -= 1

    def publish_when_ready(
        self, request: Any, num_computed_tokens: int, retention_interval: Any, *, replay_boundaries: Sequence[int] | None
    ) -> None:
        """The source group's caching: publish the pages already durable, the rest later."""
        m = self.host_manager
        if m is None:
            return
        self._get_request_state(request.request_id).publication = _PendingPublication(
            request=request,
            num_computed_tokens=num_computed_tokens,
            num_pages=num_computed_tokens // m.block_size,
            retention_interval=retention_interval,
            replay_boundaries=replay_boundaries,
        )
        self._publish_host_blocks_if_ready(request.request_id)

    def _publish_host_blocks_if_ready(self, request_id: str) -> None:
        """Publish the durable prefix of the pending publication now: host writes trail a
        long prefill by about a chunk, and waiting for the whole prefix would leave a
        preempted prefill nothing to resume from."""
        state = self.request_states.get(request_id)
        if state is None or state.publication is None:
            return
        pub = state.publication
        assert self.host_manager is not None
        num_tokens = min(pub.num_computed_tokens, state.ready_prefix_pages * self.host_manager.block_size)
        self.host_manager.publish_blocks(pub.request, num_tokens, pub.retention_interval, replay_boundaries=pub.replay_boundaries)
        self._record_copies(request_id, num_tokens)
        if state.ready_prefix_pages >= pub.num_pages:
            state.publication = None

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        """A connector is writing the first ``num_tokens`` tokens' host pages."""
        self._resident_requests.discard(request_id)
        self._pending_imports[request_id] = num_tokens

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        num_tokens = self._pending_imports.pop(request_id, None)
        if num_tokens is not None and not failed:
            self.complete_host_import(request_id, num_tokens)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        """The imported host pages are complete: clean, published, and the last one restored
        to the GPU (the request writes into it again)."""
        if not self.resident_managers:
            return
        block_size = self.resident_managers[0].block_size
        num_pages = num_computed_tokens // block_size
        state = self._get_request_state(request_id)
        state.valid_pages = set(range(num_pages))
        state.ready_prefix_pages = num_pages
        if num_computed_tokens:
            self._plan_page_transfer(request_id, (num_computed_tokens - 1) // block_size, after_forward=False, restore=True)
        self._publish_host_blocks_if_ready(request_id)

    def _plan_page_transfer(self, request_id: str, page_idx: int, *, after_forward: bool, restore: bool = False) -> bool:
        """Plan one transfer; both ends are held (touched) until it completes."""
        assert self.host_manager is not None
        state = self._get_request_state(request_id)
        if page_idx in state.pending_pages:
            return False
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if host_blocks is None or page_idx >= len(host_blocks) or host_blocks[page_idx].is_null:
            return False
        host_block = host_blocks[page_idx]
        blocks: list[KVCacheBlock] = []
        for m in self.resident_managers:
            block = m.get_resident_page(request_id, page_idx)
            if block is None:
                return False
            blocks.append(block)
        self.host_manager.block_pool.touch([host_block])
        for m, b in zip(self.resident_managers, blocks):
            m.block_pool.touch([b])
        tid = self.next_spill_id
        self.next_spill_id += 1
        self.pending_spills[tid] = _PendingSpill(tid, (request_id, page_idx), state, host_block, tuple(blocks), restore)
        state.pending_pages[page_idx] = tid
        self.spills_to_send.append(
            SparseKVPageTransfer(
                transfer_id=tid,
                host_block_id=host_block.block_id,
                resident_block_ids=tuple(b.block_id for b in blocks),
                after_forward=after_forward,
                restore=restore,
            )
        )
        return True

    # -- what the worker reads ---------------------------------------------------------------
    def build_row_mirrors(self, requests: Iterable[tuple[str, int, int]]) -> tuple[SparseKVRowMirror, ...]:
        """For each scheduled (request id, computed tokens, scheduled tokens): the GPU rows the
        step writes and the host rows they mirror to, one span per page. A page without a GPU
        copy or a host block is skipped alone: the window only moves forward, so dropping
        its neighbours would leave their host rows stale for good."""
        if not self.resident_managers or self.host_manager is None:
            return ()
        block_size = self.resident_managers[0].block_size
        mirrors: list[SparseKVRowMirror] = []
        for request_id, num_computed, num_scheduled in requests:
            host_blocks = self.host_manager.req_to_blocks.get(request_id)
            if host_blocks is None or any(request_id not in m.req_to_blocks for m in self.resident_managers):
                continue
            pos, end = num_computed, num_computed + num_scheduled
            while pos < end:
                page_idx, offset = divmod(pos, block_size)
                num_rows = min(block_size - offset, end - pos)
                pos += num_rows
                starts = []
                for m in self.resident_managers:
                    block = m.get_resident_page(request_id, page_idx)
                    if block is None:
                        break
                    starts.append(block.block_id * block_size + offset)
                if len(starts) != len(self.resident_managers) or page_idx >= len(host_blocks) or host_blocks[page_idx].is_null:
                    continue
                mirrors.append(SparseKVRowMirror(tuple(starts), host_blocks[page_idx].block_id * block_size + offset, num_rows))
        return tuple(mirrors)

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        """Whether every scheduled request reads only GPU-resident K/V this step."""
        if not self.resident_managers:
            return False
        first = self.resident_managers[0]
        for request_id, num_computed, num_scheduled in requests:
            if len(first.req_to_blocks.get(request_id, ())) < cdiv(num_computed + num_scheduled, first.block_size):
                return False
            if request_id in self._resident_requests:
                continue
            if any(b.is_null for m in self.resident_managers for b in m.get_residency_row(request_id)):
                return False
            self._resident_requests.add(request_id)
        return True

    def take_residency_updates(self, request_ids: Iterable[str]) -> dict[str, SparseKVResidencyUpdate]:
        """What the worker lacks of the scheduled requests' residency: the stale pages and
        the pages appended since the last update (an unscheduled request keeps its changes)."""
        updates: dict[str, SparseKVResidencyUpdate] = {}
        if not self.resident_managers:
            return updates
        first = self.resident_managers[0]
        for request_id in request_ids:
            if request_id not in self.request_states and request_id not in first.req_to_blocks:
                continue  # not held here: nothing to send (and no books started for it)
            state = self._get_request_state(request_id)
            num_pages = len(first.req_to_blocks.get(request_id, ()))
            start = state.synced_pages
            if not state.stale_pages and start >= num_pages:
                continue
            stale = sorted(state.stale_pages)
            block_ids: list[list[int]] = []
            for m in self.resident_managers:
                null_id = m.block_pool.null_block.block_id
                ids = []
                for page_idx in stale:
                    block = m.get_resident_page(request_id, page_idx)
                    ids.append(null_id if block is None else block.block_id)
                ids += [b.block_id for b in m.get_residency_row(request_id, start)]
                block_ids.append(ids)
            updates[request_id] = SparseKVResidencyUpdate(pages=[*stale, *range(start, num_pages)], block_ids=tuple(block_ids))
            state.stale_pages.clear()
            state.synced_pages = num_pages
        return updates

    def build_offload_command(self) -> SparseKVOffloadCommand | None:
        """This step's transfers (the list starts empty again)."""
        if not self.resident_managers:
            return None
        command = SparseKVOffloadCommand(page_transfers=self.spills_to_send)
        self.spills_to_send = []
        return command

    def has_pending_reclamation(self) -> bool:
        """Whether a transfer in flight frees a GPU or host block when it completes."""
        return any(
            p.host_block.ref_cnt == 1 or (p.page[0] in self.request_states and self._can_read_from_host(p.page[0]))
            for p in self.pending_spills.values()
        )

    def has_pending_work(self) -> bool:
        return bool(self.spills_to_send or self.pending_spills or self._retained_copies)

    def update_spills(self, enqueued_counts: Mapping[int, int], completed_counts: Mapping[int, int]) -> None:
        """The workers' reports: ``enqueued_counts`` -- transfer id -> how many workers run
        it (the first report counts); ``completed_counts`` -- how many more finished it."""
        for name, counts in (("enqueued_counts", enqueued_counts), ("completed_counts", completed_counts)):
            if not isinstance(counts, Mapping):
                raise TypeError(f"{name} must be a dict {{transfer id: count}}, got {type(counts).__name__}")
            for tid, count in counts.items():
                if type(count) is not int or count < 1:
                    raise ValueError(f"{name}[{tid!r}] must be an int >= 1 (workers), got {count!r}")
        for tid, count in enqueued_counts.items():
            p = self.pending_spills.get(tid)
            if p is not None and p.expected_worker_completions == 0:
                p.expected_worker_completions = count
        for tid, count in completed_counts.items():
            p = self.pending_spills.get(tid)
            if p is not None:
                p.worker_completions += count
        self._apply_enqueued_spills()
        self._complete_host_writes()

    @staticmethod
    def _done(p: _PendingSpill) -> bool:
        return bool(p.expected_worker_completions) and p.worker_completions >= p.expected_worker_completions

    def _apply_enqueued_spills(self) -> None:
        """Every worker finished: the GPU ends let go of their transfer hold."""
        for p in self.pending_spills.values():
            if p.enqueue_applied or not self._done(p):
                continue
            for m, b in zip(self.resident_managers, p.resident_blocks):
                m.block_pool.free_blocks([b])
            p.enqueue_applied = True

    def _complete_host_writes(self) -> None:
        completed = [p for p in self.pending_spills.values() if p.enqueue_applied and self._done(p)]
        # The requests whose pages completed, in completion order. vLLM 0.33 keeps a set of their
        # ids, so it publishes several requests' pages in an order that depends on the string
        # hash seed; kvlab's order is the same on every run.
        finished_requests: list[str] = []
        for p in completed:
            del self.pending_spills[p.transfer_id]
            request_id, page_idx = p.page
            state = p.request_state
            state.pending_pages.pop(page_idx, None)
            if self.request_states.get(request_id) is state:
                if not p.restore:
                    state.valid_pages.add(page_idx)
                if page_idx in state.valid_pages:
                    self._page_became_clean(request_id, state, page_idx)
                    if p.restore:
                        self._record_copy(request_id, page_idx, p.host_block)
                if request_id not in finished_requests:
                    finished_requests.append(request_id)
            elif state.publication is not None:  # the request left: a detached publication
                if not p.restore:
                    state.valid_pages.add(page_idx)
                self._publish_detached_blocks(state)
            assert self.host_manager is not None
            self.host_manager.block_pool.free_blocks([p.host_block])
        for request_id in finished_requests:
            state = self.request_states[request_id]
            while state.ready_prefix_pages in state.valid_pages:
                state.ready_prefix_pages += 1
            self._publish_host_blocks_if_ready(request_id)

    def _publish_detached_blocks(self, state: _HiSparseRequestState) -> None:
        """A finished request's last copies completed: publish its complete prefix, then let
        go of its host blocks."""
        pub = state.publication
        if pub is None or state.pending_pages or pub.detached_blocks is None:
            return
        assert self.host_manager is not None
        while state.ready_prefix_pages in state.valid_pages:
            state.ready_prefix_pages += 1
        host = self.host_manager
        host.block_pool.cache_full_blocks(
            pub.request,
            pub.detached_blocks,
            pub.num_cached_blocks,
            min(state.ready_prefix_pages, pub.num_pages),
            host.block_size,
            host.kv_cache_group_id,
        )
        host.block_pool.free_blocks(list(reversed(pub.detached_blocks)))
        state.publication = None

    def free(self, request_id: str) -> None:
        """The request leaves: its clean pages stay in the pool as readable copies; a
        finished request's host pages still being written are held until published."""
        self._resident_requests.discard(request_id)
        self._pending_imports.pop(request_id, None)
        state = self.request_states.pop(request_id, None)
        if state is None:
            return
        pub = state.publication
        if pub is not None and pub.request.is_finished() and state.pending_pages:
            assert self.host_manager is not None
            pub.detached_blocks = self.host_manager.req_to_blocks[request_id][: pub.num_pages]
            pub.num_cached_blocks = self.host_manager.num_cached_block.get(request_id, 0)
            # Held until published: another allocation must not take them meanwhile.
            self.host_manager.block_pool.touch(pub.detached_blocks)
        else:
            # A preempted request's planned copies do not prove its K/V was computed.
            state.publication = None
        for m in self.resident_managers:
            row = m.get_residency_row(request_id)
            for page_idx in reversed(range(len(row))):  # tail first
                block = row[page_idx]
                if block.is_null:
                    continue
                if page_idx in state.unpinned_pages:
                    owners = self._owners.get(block.block_id)
                    if owners is not None:
                        owners.discard((request_id, page_idx))
                elif page_idx in state.valid_pages and page_idx not in state.pending_pages:
                    m.block_pool.unpin_blocks([block], self._on_block_reused)
                else:
                    continue
                m.drop_resident_page(request_id, page_idx)


def get_hisparse_coordinator(kv_cache_manager: KVCacheManager) -> HiSparseCoordinator:
    """The coordinator of a manager's HiSparse groups, built on the first call (it binds
    itself to the managers and moves the source group onto the host pool)."""
    managers = tuple(kv_cache_manager.coordinator.single_type_managers)
    for m in managers:
        found = getattr(m, "coordinator", None)
        if found is not None:
            assert isinstance(found, HiSparseCoordinator)
            return found
    config = kv_cache_manager.kv_cache_config
    if not any(isinstance(m, HiSparseSourceManager) for m in managers):
        raise ValueError("No HiSparse cache group is configured (no group has the role HISPARSE_SOURCE).")
    return HiSparseCoordinator(
        config, managers, kv_cache_manager.max_model_len, num_reprefillable_tokens=kv_cache_manager.coordinator.num_reprefillable_tokens
    )
