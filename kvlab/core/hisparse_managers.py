"""HiSparse's three kinds of group (vLLM 0.33: ``HiSparseSourceManager``,
``HiSparseHotManager`` and ``HiSparseResidentManager`` in ``single_type_kv_cache_manager.py``).

A sparse-attention model reads, each decode step, only the earlier tokens its indexer picks;
HiSparse keeps the whole K/V in host memory and little on the GPU:

* the **source** group holds every page of a request in a private *host* pool. It owns the
  prefix cache: its hashes are published only once a page's host copy is complete, so a hit
  never reads a page that is still being written;
* the **resident** group holds GPU copies of the newest pages (the forward pass writes them
  there, and they are copied to the host behind it). Its table is append-only; the pages a
  request no longer reads from the GPU are told to the worker as residency changes, not by
  editing the table;
* the **hot** group is a fixed buffer per request (``blocks_per_request``) that it holds
  while it reads history from the host.

The managers hold the tables; what moves between them -- write-backs, unpinning, adoption
of GPU copies, deferred frees -- is the coordinator's (:mod:`kvlab.hisparse.coordinator`),
which binds itself to them (``manager.coordinator``) before the first request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.core.kv_cache_utils import MANAGER_FOR_SPEC, KVCacheBlock, trim_null_head
from kvlab.core.single_type_kv_cache_manager import _AS_SET, FullAttentionManager, SingleTypeKVCacheManager
from kvlab.utils.kv_events import MEDIUM_CPU
from kvlab.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec
from kvlab.utils.checks import check_int
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:
    from kvlab.utils.kv_events import KVEvent

__all__ = ["HiSparseHotManager", "HiSparseResidentManager", "HiSparseSourceManager", "SharedEventQueueBlockPool"]


class SharedEventQueueBlockPool(BlockPool):
    """A pool whose KV events go into another pool's queue (vLLM 0.33's HiSparse host pool):
    one stream, drained once, carries both tiers, each event marked with its medium. The
    queue is read through the owner on every use, since ``take_events`` swaps it."""

    def __init__(self, *args: Any, event_owner: BlockPool, **kwargs: Any) -> None:
        self._event_owner = event_owner
        super().__init__(*args, **kwargs)

    @property
    def kv_event_queue(self) -> list[KVEvent]:
        return self._event_owner.kv_event_queue

    @kv_event_queue.setter
    def kv_event_queue(self, events: list[KVEvent]) -> None:
        # BlockPool.__init__ seeds an empty queue and take_events swaps one in: the owner's
        # (an undo puts the owner's own queue back, which is allowed).
        if events and events is not self._event_owner.kv_event_queue:
            raise ValueError("a shared-queue pool's events belong to its owner: drain them there")


class HiSparseSourceManager(FullAttentionManager):
    """The host-resident source group: full attention over a private host pool.

    Every page a request has gets a host block, so admission fails when the host pool
    cannot back the request (every GPU page can then be written back and given up).
    Caching is the coordinator's to time: ``cache_blocks`` hands it the request, and the
    coordinator publishes (``publish_blocks``) only the pages whose host copy is complete.
    """

    coordinator: Any = None
    #: The host keeps prefixes the GPU groups lost: its hit is not cut back to theirs.
    retains_longer_hit = True

    @property
    def records_new_block_ids(self) -> bool:
        return False  # host blocks are never zeroed by the runner

    def take_new_block_ids(self) -> list[int]:
        self.new_block_ids = []
        return []

    def bind_host_pool(self, num_blocks: int) -> None:
        """Swap the GPU pool this group was built with for a host pool of ``num_blocks``
        blocks (events marked CPU, in the GPU pool's queue)."""
        num_blocks = check_int("num_blocks", num_blocks, 2, why=" (block 0 is the null block)")
        device = self.block_pool
        collector = device.metrics_collector
        host = SharedEventQueueBlockPool(
            num_blocks,
            self.enable_caching and self.kv_cache_spec.prefix_cacheable,
            enable_kv_cache_events=device.enable_kv_cache_events,
            kv_events_use_int_block_hashes=device.kv_events_use_int_block_hashes,
            metrics_collector=None if collector is None else KVCacheMetricsCollector(collector.sample_rate),
            prepend_uncached_blocks=device.prepend_uncached_blocks,
            hash_block_size=device.hash_block_size,
            num_hash_lookahead_tokens=device.num_hash_lookahead_tokens,
            event_owner=device,
        )
        host.medium = MEDIUM_CPU
        device.sibling_pools.append(host)  # a request's freed blocks may mix both pools
        self.block_pool = host
        self._null_block = host.null_block

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        return []  # host copies go to the connector (take_host_cow_copies), not the runner

    def take_host_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The host copy-on-write pairs, for the coordinator to hand to the connector."""
        pairs, self._pending_cow_copies = self._pending_cow_copies, []
        return pairs

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """0 GPU blocks -- host blocks come from the host pool -- unless the host pool is
        short, then more than the GPU pool has, so the admission fails (vLLM's sentinel)."""
        need = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens, num_tokens_main_model
        )
        if need > self.block_pool.get_num_free_blocks():
            return self.coordinator.gpu_pool.num_gpu_blocks + 1
        return 0

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int, record_for_zeroing: bool = True
    ) -> None:
        """A connector writes these host pages; they become readable when its receive
        succeeds (``finish_host_import``), not when the blocks are handed out."""
        if num_external_computed_tokens <= 0:
            return
        self.coordinator.record_pending_host_import(request_id, num_local_computed_tokens + num_external_computed_tokens)
        super().allocate_external_computed_blocks(request_id, num_local_computed_tokens, num_external_computed_tokens, record_for_zeroing)

    def cache_blocks(
        self, request: Any, num_tokens: int, retention_interval: Any = _AS_SET, *, replay_boundaries: Sequence[int] | None = None
    ) -> None:
        """Hand the request to the coordinator, which publishes the durable pages now and
        the rest as their host copies complete."""
        self.coordinator.publish_when_ready(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)

    def publish_blocks(
        self, request: Any, num_tokens: int, retention_interval: Any = _AS_SET, *, replay_boundaries: Sequence[int] | None = None
    ) -> None:
        """Cache the first ``num_tokens`` tokens' pages in the host pool (the coordinator
        calls it once they are durable)."""
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.coordinator.free(request_id)
        return super().pop_blocks_for_free(request_id)


class _HiSparseAuxiliaryManager(SingleTypeKVCacheManager):
    """A GPU group whose pages are scratch: the host source owns prefix caching."""

    coordinator: Any = None

    def cache_blocks(
        self, request: Any, num_tokens: int, retention_interval: Any = _AS_SET, *, replay_boundaries: Sequence[int] | None = None
    ) -> None:
        return None

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        return tuple([] for _ in kv_cache_group_ids), 0


class HiSparseHotManager(_HiSparseAuxiliaryManager):
    """A request's hot buffer: ``blocks_per_request`` GPU blocks, allocated only once the
    request must read history from the host (an import, a host prefix hit, or the
    coordinator asking: ``require_hot``)."""

    def __init__(self, kv_cache_spec: HiSparseHotSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.blocks_per_request = kv_cache_spec.blocks_per_request
        self.hot_required: set[str] = set()

    def require_hot(self, request_id: str) -> None:
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """The buffer, when this allocation gives the request host-backed history; a running
        request keeps the answer it had."""
        host_import = total_computed_tokens > num_local_computed_tokens
        resumes_host_prefix = num_local_computed_tokens > 0 and request_id not in self.num_cached_block
        if host_import or resumes_host_prefix or request_id in self.hot_required:
            return self.get_num_required_blocks(request_id)
        return 0

    def get_num_required_blocks(self, request_id: str) -> int:
        return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, ())), 0)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block[request_id] = 0
        if num_local_computed_tokens > 0 or not self.coordinator.resident_managers:
            self.require_hot(request_id)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int, record_for_zeroing: bool = True
    ) -> None:
        self.require_hot(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        self.num_cached_block[request_id] = 0  # a cold admission skips add_local_computed_blocks
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if request_id not in self.hot_required:
            return []
        num_new = self.blocks_per_request - len(blocks)
        if num_new <= 0:
            return []
        new = self.block_pool.get_new_blocks(num_new, request_id=request_id, group=self.kv_cache_group_id)
        blocks.extend(new)
        return new

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.hot_required.discard(request_id)
        return super().pop_blocks_for_free(request_id)


class HiSparseResidentManager(_HiSparseAuxiliaryManager):
    """GPU copies of a request's pages. The table only grows; which pages are read from the
    GPU now is the table with ``residency_changes`` applied (a page given up reads the null
    block: the host has it; a null page may adopt a GPU copy another request left)."""

    def __init__(self, kv_cache_spec: HiSparseResidentSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.residency_changes: dict[str, dict[int, KVCacheBlock]] = {}

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Pages past the host-backed prefix (capped at one step's worth for the admission
        gate); an import needs its last page writable, the earlier ones stay on the host."""
        existing = len(self.req_to_blocks.get(request_id, ()))
        if total_computed_tokens > num_local_computed_tokens:
            imported = cdiv(total_computed_tokens, self.block_size)
            needs_tail = self.get_resident_page(request_id, imported - 1) is None
            return int(needs_tail) + max(cdiv(num_tokens, self.block_size) - max(imported, existing), 0)
        host_pages = cdiv(num_local_computed_tokens, self.block_size)
        required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            required = min(required, self.max_admission_blocks_per_request)
        return max(required - max(existing, host_pages), 0)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int, record_for_zeroing: bool = True
    ) -> None:
        """Only the imported prefix's last page gets a GPU block (it is written again when the
        last token is replayed); the pages before it stay host-only (null)."""
        if num_external_computed_tokens <= 0:
            return
        num_tokens = num_local_computed_tokens + num_external_computed_tokens
        blocks = self.req_to_blocks.setdefault(request_id, [])
        tail = (num_tokens - 1) // self.block_size
        if len(blocks) <= tail:
            blocks.extend([self._null_block] * (tail + 1 - len(blocks)))
        if self.get_resident_page(request_id, tail) is None:
            blocks[tail] = self.block_pool.get_new_blocks(1, request_id=request_id, group=self.kv_cache_group_id)[0]

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """A host prefix hit: its pages start host-only (null); the coordinator may later
        point them at GPU copies still in the pool."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not blocks, "a new request already has blocks"
        num_host_pages = cdiv(num_local_computed_tokens, self.block_size)
        blocks.extend([self._null_block] * num_host_pages)
        self.num_cached_block[request_id] = 0
        self.coordinator.commit_computed_blocks(request_id, num_host_pages)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new = self.block_pool.get_new_blocks(num_new, request_id=request_id, group=self.kv_cache_group_id)
        blocks.extend(new)
        return new

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The pages the request still pins (its residency row), after the coordinator let
        go of the clean ones."""
        self.coordinator.free(request_id)
        blocks = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        super().pop_blocks_for_free(request_id)
        return trim_null_head(blocks)

    def adopt_resident_page(self, request_id: str, block_idx: int, block: KVCacheBlock) -> bool:
        """Read a host-only page from ``block``, a GPU copy of it; False if it has one."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks) or self.get_resident_page(request_id, block_idx) is not None:
            return False
        self.residency_changes.setdefault(request_id, {})[block_idx] = block
        return True

    def drop_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """Stop reading a page from the GPU; the block it was read from, if any."""
        block = self.get_resident_page(request_id, block_idx)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[block_idx] = self._null_block
        return block

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks):
            return None
        block = blocks[block_idx]
        changes = self.residency_changes.get(request_id)
        if changes:
            block = changes.get(block_idx, block)
        return None if block.is_null else block

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The table from ``start`` with the residency changes applied (host-only pages are
        the null block)."""
        blocks = self.req_to_blocks.get(request_id, [])[start:]
        changes = self.residency_changes.get(request_id)
        if not changes:
            return blocks
        return [changes.get(i, b) for i, b in enumerate(blocks, start)]


MANAGER_FOR_SPEC.update({HiSparseHotSpec: HiSparseHotManager, HiSparseResidentSpec: HiSparseResidentManager})
