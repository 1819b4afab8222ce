"""Per-group managers: one block table per request for one KV-cache group (lesson 07).

vLLM: ``vllm/v1/core/single_type_kv_cache_manager.py`` (v0.33). The group's spec decides
three things: which cached prefix counts as a hit (``find_longest_cache_hit``), which
blocks a request may drop (``get_num_skipped_tokens``), and which full blocks are worth a
prefix-cache entry at all (``reachable_block_mask``).

=========================  ===============================================================
manager                    what a hit needs / what the request may drop
=========================  ===============================================================
``FullAttentionManager``   every block from block 0 / nothing (also MLA: one latent, same
                           table)
``SlidingWindowManager``   the ``cdiv(W - 1, block_size)`` blocks before the hit end /
                           every block that left the window
``ChunkedLocalAttention``  the cached blocks of the hit's own chunk / every finished chunk
``MambaManager``           one saved state: the block ending at the hit / all but the state
                           it reads and the one it writes
=========================  ===============================================================

Every manager keeps its tables append-only except for null padding: a block a request no
longer needs becomes the null block (id 0) in its table and goes back to the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any, ClassVar

from kvlab.core.block_pool import BlockPool, group_suffix
from kvlab.core.kv_cache_utils import MANAGER_FOR_SPEC, KVCacheBlock, resolve_dcp_kv_cache_spec, trim_null_head
from kvlab.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseResidentSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from kvlab.eventlog.events import BlockCopied, BlockRelocated, BlocksSkipped, BlocksTouched
from kvlab.utils.checks import check_int, check_optional_int
from kvlab.utils.hashing import BlockHash
from kvlab.utils.math_utils import cdiv


def check_context_parallelism(specs: Sequence[KVCacheSpec], dcp_world_size: Any, pcp_world_size: Any) -> tuple[int, int]:
    """vLLM 0.33's ``dcp_world_size`` / ``pcp_world_size``, checked with its rules: decode
    context parallelism (DCP) spreads each block's tokens over the ranks, so only full
    attention (MLA included) can be sharded -- a window or chunk would be cut across ranks --
    and every other group must be replicated (``dcp_sharded=False``; Mamba states always
    are). Prefill context parallelism (PCP) leaves the cache manager as it is; vLLM allows
    it with full attention and replicated attention groups only. Returns the two sizes."""
    dcp = check_int("dcp_world_size", dcp_world_size, 1)
    pcp = check_int("pcp_world_size", pcp_world_size, 1)
    for gid, spec in enumerate(specs):
        replicated = not getattr(spec, "dcp_sharded", False)
        if pcp > 1 and not (isinstance(spec, FullAttentionSpec) or (isinstance(spec, AttentionSpec) and replicated)):
            raise ValueError(
                f"pcp_world_size = {pcp}: prefill context parallelism supports full attention and replicated attention "
                f"groups only (vLLM 0.33), got group {gid}: {type(spec).__name__}"
            )
        if dcp > 1 and not (isinstance(spec, FullAttentionSpec) or replicated):
            raise ValueError(
                f"dcp_world_size = {dcp}: decode context parallelism supports full-attention, Mamba and replicated "
                f"(dcp_sharded=False) groups only (vLLM 0.33), got group {gid}: {type(spec).__name__}"
            )
    return dcp, pcp


_AS_SET = object()  # cache_blocks: "the retention interval the manager was set up with"


class SingleTypeKVCacheManager:
    """The block tables of one KV-cache group."""

    #: Whether the kind registers a prompt tail that ends inside a block as a partial prefix
    #: entry when its blocks are larger than the hash block (vLLM 0.33: full attention).
    supports_partial_tail = False
    #: Whether a hit of this kind may end inside one of its blocks, on a hash boundary (vLLM
    #: 0.33's fine-grained lookup: full attention and Mamba). The coordinator turns it on
    #: only for a Mamba hybrid whose blocks are larger than the hash block.
    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    #: Whether this group's hit is kept whole when the groups agree on a shorter one (vLLM
    #: 0.33: HiSparse's host group, which holds prefixes the GPU groups have lost).
    retains_longer_hit: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool = True,
        scheduler_block_size: int | None = None,
        max_admission_blocks_per_request: int | None = None,
        *,
        needs_kv_cache_zeroing: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> None:
        assert kv_cache_spec.block_size is not None
        dcp, pcp = check_context_parallelism([kv_cache_spec], dcp_world_size, pcp_world_size)
        # This group's share of context parallelism (vLLM 0.33): a replicated group has none.
        # Under DCP a block's tokens are spread over the ranks, so the manager's block -- the
        # unit of its tables, hashes and hits -- holds block_size x dcp tokens.
        sharded = bool(getattr(kv_cache_spec, "dcp_sharded", False))
        self.dcp_world_size = dcp if sharded else 1
        self.pcp_world_size = pcp if sharded else 1
        kv_cache_spec = resolve_dcp_kv_cache_spec(kv_cache_spec, self.dcp_world_size)
        assert kv_cache_spec.block_size is not None
        self.kv_cache_spec = kv_cache_spec
        self.block_size: int = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        # Hits land on multiples of this (the LCM of the groups' block sizes); the
        # coordinator sets it. The pool's hashes come every `hash_block_size` tokens.
        self.scheduler_block_size = scheduler_block_size or self.block_size
        self.cache_hit_alignment_tokens = self.scheduler_block_size
        # The most blocks a request of this group can hold at once (window/chunk groups
        # only): the admission gate counts no more than this for the whole prompt.
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.use_eagle = False  # set by the coordinator
        # Sparse retention (vLLM 0.33's prefix_cache_retention_interval; the coordinator sets
        # it): None caches every reachable block; 0 only what a replay of the prompt (or a
        # shared-prefix junction) can hit; k > 0 also one segment tail every k tokens. Window
        # and Mamba groups act on it; the others cache densely. ``replay_use_eagle``: whether
        # any group drops for EAGLE (the replay boundaries then sit a block lower).
        self.retention_interval: int | None = None
        self._replay_boundaries: tuple[int, ...] | None = None  # given to one cache_blocks call (vLLM's shape)
        self.replay_use_eagle = False
        self._null_block = block_pool.null_block
        # request id -> its block table for this group (append-only, except null padding).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its blocks are cached (have a hash in the map).
        self.num_cached_block: dict[str, int] = {}
        # Block zeroing (vLLM 0.33; the manager sets it where KVCacheConfig.needs_kv_cache_zeroing):
        # an attention group writes down the ids of the blocks it is handed, for the runner.
        self._record_new_block_ids = records_new_block_ids(kv_cache_spec, needs_kv_cache_zeroing)
        self.new_block_ids: list[int] = []
        # vLLM 0.33's partial prompt-tail entries: full attention whose blocks are larger than
        # the hash block (decided here once, so the common case pays one attribute read).
        hash_block_size = block_pool.hash_block_size
        self._caches_partial_tail = self.supports_partial_tail and bool(hash_block_size) and self.block_size != hash_block_size
        # Copy-on-write (vLLM 0.33): a hit that ends inside a block shares that block's first
        # tokens, but the request must write the rest. request id -> (table position, the
        # shared block), until allocate_new_blocks gives the request a private copy; and the
        # (source, copy) pairs the runner must copy before the next forward pass.
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    # -- how many blocks ------------------------------------------------------------------------
    @staticmethod
    def _get_num_evictable_blocks(blocks: Sequence[KVCacheBlock]) -> int:
        """Hits that sit in the free queue: adopting one takes it out, as an allocation would."""
        return len([b for b in blocks if b.ref_cnt == 0 and not b.is_null])

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
        """Free blocks needed so the request has slots for ``num_tokens`` tokens.

        A hit block that sits on the free queue (ref 0, evictable) counts too: adopting it
        takes it out of the free supply. Hit blocks that already left the window are not
        adopted, so they do not count; neither do slots before the window.
        ``apply_admission_cap`` (the whole-prompt admission gate) counts at most the blocks
        a request of this group can ever hold at once.
        """
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # A running request: no new hits.
            return max(num_required - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_blocks = len(new_computed_blocks) + num_req_blocks
        num_new = max(num_required - max(num_skipped_blocks, num_local_blocks), 0)
        num_skipped_hits = max(0, num_skipped_blocks - num_req_blocks)
        hits = new_computed_blocks[num_skipped_hits:] if num_skipped_hits else new_computed_blocks
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            num_new += 1  # the private copy of the hit's last block
        return num_new + self._get_num_evictable_blocks(hits)

    def _has_partial_local_hit(self, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int) -> bool:
        """The hit ends inside one of this group's blocks: its last block needs a copy."""
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    # -- adopting hits and allocating -----------------------------------------------------------
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Start a new request's table with its prefix hits.

        Hit positions the first computed token will never read (outside the window or the
        chunk) become the null block and their blocks are NOT touched: the request does not
        hold them, so they stay evictable. The rest are touched before anything is
        allocated, so an allocation cannot evict them.
        """
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, "a new request already has blocks"
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(total) // self.block_size
        hits = list(new_computed_blocks[num_skipped:]) if num_skipped else list(new_computed_blocks)
        if not self.enable_caching:
            assert not any(not b.is_null for b in hits), "prefix hits while caching is off"
        adopted = [self._null_block] * num_skipped + hits
        self._touch(request_id, adopted)
        req_blocks.extend(adopted)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(hits, num_local_computed_tokens):
            # The hit ends inside its last block: allocate_new_blocks swaps in a private copy,
            # and that copy is cached again once full (so it is not counted as cached).
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, hits[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int, record_for_zeroing: bool = True
    ) -> None:
        """Blocks for tokens whose KV a connector supplies (``num_external_computed_tokens``):
        the request needs slots to receive them, except where they fall outside the window.
        Runs only after every group's hits were touched (vLLM issue #33775).
        ``record_for_zeroing=False``: an asynchronous load writes these blocks after this
        step, and zeroing them would race with it."""
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total)
        if skipped > 0:
            num_external_computed_tokens = min(total - skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, cdiv(total, self.block_size) - len(req_blocks))
        new = self.block_pool.get_new_blocks(num_new, request_id=request_id, group=self.kv_cache_group_id)
        req_blocks.extend(new)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids += [b.block_id for b in new]

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        cow: list[KVCacheBlock] = []
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            # A hit that ends inside a block: the request writes into a private copy of it
            # (the extra block was counted by get_num_blocks_to_allocate).
            block_idx, source = self._partial_hit_reqs.pop(request_id)
            cow = self.block_pool.get_new_blocks(1, group=self.kv_cache_group_id)
            self._apply_cow(request_id, block_idx, source, cow[0])
            self.new_block_ids.append(cow[0].block_id)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return cow
        new = self.block_pool.get_new_blocks(num_new, request_id=request_id, group=self.kv_cache_group_id)
        blocks.extend(new)
        if self._record_new_block_ids:
            self.new_block_ids += [b.block_id for b in new]
        return cow + new if cow else new

    def _apply_cow(self, request_id: str, block_idx: int, source: KVCacheBlock, cow_block: KVCacheBlock) -> None:
        """Copy-on-write: the request's table takes ``cow_block`` instead of the shared
        ``source`` at ``block_idx``, and the pair waits for the runner, which copies the
        source's page into the copy before the forward pass writes the rest of it. Until
        that copy has run, both stay held (``take_pending_cow_copies``): the source keeps
        the reference the hit took, the copy gets one more than the request's."""
        req_blocks = self.req_to_blocks[request_id]
        assert block_idx < len(req_blocks) and req_blocks[block_idx] is source
        assert not source.is_null and source.ref_cnt > 0
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source, cow_block))
        cow_block.ref_cnt += 1
        self._copied(request_id, block_idx, source, cow_block, moved_hashes=False)

    def _copied(self, request_id: str, block_idx: int, source: KVCacheBlock, cow_block: KVCacheBlock, moved_hashes: bool) -> None:
        """The ``BlockCopied`` event for the pictures (vLLM sends no KV event for a copy)."""
        events = self.block_pool.events
        if events is not None:
            events.emit(
                BlockCopied(
                    request_id=request_id,
                    group=self.kv_cache_group_id,
                    position=block_idx,
                    src_block_id=source.block_id,
                    dst_block_id=cow_block.block_id,
                    moved_hashes=moved_hashes,
                )
            )

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The (source, copy) pairs waiting for the runner; the list starts empty again."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    @property
    def records_new_block_ids(self) -> bool:
        """Whether the runner zeroes this group's new blocks (vLLM 0.33)."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        """The ids of the blocks handed out since the last call, oldest first; the list
        starts empty again."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def _touch(self, request_id: str, blocks: list[KVCacheBlock]) -> None:
        """``BlockPool.touch`` (vLLM's) and the ``BlocksTouched`` event for the pictures: the
        table positions as the request will hold them, null blocks included."""
        if not blocks:
            return
        pool = self.block_pool
        pool.touch(blocks)
        if pool.events is not None:
            pool.events.emit(BlocksTouched(request_id=request_id, group=self.kv_cache_group_id, block_ids=[b.block_id for b in blocks]))

    # -- caching --------------------------------------------------------------------------------
    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: Any,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Which of blocks ``[start, end)`` could ever serve a hit (None: all of them), for
        hits landing on multiples of ``alignment_tokens``. ``reachable_boundaries``: token
        positions a later request is known to resume at (sparse retention keeps what a hit
        there needs). A function of its arguments only -- vLLM 0.33's classmethod shape,
        which its tests call on the class; :meth:`block_mask` asks it with this manager's
        settings."""
        return None

    def block_mask(self, start_block: int, end_block: int, reachable_boundaries: Sequence[int] = ()) -> list[bool] | None:
        """:meth:`reachable_block_mask` with this group's alignment, spec, EAGLE setting and
        retention interval."""
        return self.reachable_block_mask(
            start_block,
            end_block,
            self.cache_hit_alignment_tokens,
            self.kv_cache_spec,
            self.use_eagle,
            self.retention_interval,
            reachable_boundaries,
        )

    def reachable_boundaries(self, request: Any) -> list[int]:
        """Where a later request can resume this one's prompt (vLLM 0.33): the replay
        boundaries, and a shared-prefix junction that a lookup found (a longer prefix that
        one group had cached and another had not), one block lower too for EAGLE."""
        given = self._replay_boundaries
        boundaries = (
            list(replay_boundaries(request.num_prompt_tokens, self.scheduler_block_size, self.replay_use_eagle))
            if given is None
            else list(given)
        )
        junction = request.shared_prefix_boundary
        if junction:
            boundaries.append(junction)
            if self.use_eagle:
                boundaries.append(junction - self.block_size)
        return boundaries

    def cache_blocks(
        self, request: Any, num_tokens: int, retention_interval: Any = _AS_SET, *, replay_boundaries: Sequence[int] | None = None
    ) -> None:
        """Cache the request's blocks that ``num_tokens`` computed tokens have filled; then,
        for full attention with blocks larger than the hash block, the prompt's tail as a
        partial entry (vLLM 0.33: ``FullAttentionManager.cache_blocks``).

        vLLM's coordinator passes ``retention_interval`` and ``replay_boundaries`` on every
        call; kvlab's sets them on the manager once (``self.retention_interval``) and
        derives the boundaries from the request. Given here, they hold for this call."""
        if retention_interval is _AS_SET and replay_boundaries is None:
            return self._cache_blocks(request, num_tokens)
        saved = self.retention_interval, self._replay_boundaries
        if retention_interval is not _AS_SET:
            self.retention_interval = check_optional_int("retention_interval", retention_interval, 0)
        self._replay_boundaries = None if replay_boundaries is None else tuple(replay_boundaries)
        try:
            return self._cache_blocks(request, num_tokens)
        finally:
            self.retention_interval, self._replay_boundaries = saved

    def _cache_blocks(self, request: Any, num_tokens: int) -> None:
        if not self.kv_cache_spec.prefix_cacheable:
            return
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed_tokens = len(request.block_hashes) * (self.block_pool.hash_block_size or self.block_size)
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached < num_full:
            boundaries = self.reachable_boundaries(request) if self.retention_interval is not None else ()
            self.block_pool.cache_full_blocks(
                request,
                self.req_to_blocks[rid],
                num_cached,
                num_full,
                self.block_size,
                self.kv_cache_group_id,
                self.block_mask(num_cached, num_full, boundaries),
            )
            self.num_cached_block[rid] = num_full
        if self._caches_partial_tail:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Any, num_tokens: int) -> None:
        raise NotImplementedError  # only the kinds with supports_partial_tail have one

    # -- freeing --------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release the table *tail first*: the tail is the least reusable part of a prefix,
        so it should be the first to be evicted (lesson 04). Leading null blocks (a window's
        skipped prefix) are not passed on."""
        blocks = self.pop_blocks_for_free(request_id)
        self.block_pool.free_blocks(self.free_order(blocks), request_id=request_id, group=self.kv_cache_group_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and hand back its blocks, in table order without the leading
        null blocks, *without* returning them to the pool (vLLM 0.33): the caller frees them,
        tail first."""
        blocks = trim_null_head(self.req_to_blocks.pop(request_id, []))
        self.num_cached_block.pop(request_id, None)
        if self._partial_hit_reqs:
            self._partial_hit_reqs.pop(request_id, None)
        return blocks

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Drain the saved states this group offers a KV connector: (request id, group id,
        block, tokens the state covers). Only a Mamba "align" group has any (vLLM 0.33): its
        table is not append-only, so a connector is told which block holds which state."""
        return []

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """When a request finishes: the state it saved inside a block and never copied, as
        (group id, block, boundary) -- only if nothing past the boundary was computed, so the
        block still holds it. Once per request; only a Mamba "align" group has one."""
        return None

    @staticmethod
    def free_order(blocks: list[KVCacheBlock]) -> Iterable[KVCacheBlock]:
        """The order a table goes back to the pool, which is its eviction order: *tail
        first*, because the tail is the least reusable part of a prefix (lesson 04).
        (The free_order exercise swaps this in a subclass.)"""
        return reversed(blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens no future query of this group reads, once ``num_computed_tokens`` are done."""
        return 0

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        """Replace blocks no future query can read with the null block, and free them.
        ``num_prompt_tokens``: the prompt's length, for a kind that frees a gap after it
        (R-SWA); the others ignore it."""
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        self._remove_blocks_in_range(request_id, 0, min(num_skipped_tokens // self.block_size, len(blocks)))

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Null and free blocks ``[first, last)``, walking backwards and stopping at the first
        null (everything before it was nulled by an earlier call)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or first_block >= last_block:
            return
        removed: list[KVCacheBlock] = []
        positions: list[int] = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            positions.append(i)
            blocks[i] = self._null_block
        self._free_removed(request_id, positions, removed)

    def _free_removed(self, request_id: str, positions: list[int], removed: list[KVCacheBlock]) -> None:
        if not removed:
            return
        events = self.block_pool.events
        if events is not None:
            events.emit(
                BlocksSkipped(
                    request_id=request_id, group=self.kv_cache_group_id, positions=positions, block_ids=[b.block_id for b in removed]
                )
            )
        self.block_pool.free_blocks(removed, request_id=request_id, group=self.kv_cache_group_id, reason="window")

    def new_step_starts(self) -> None:
        return None

    # -- prefix hits ----------------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool = False,
        alignment_tokens: int | None = None,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest usable hit of at most ``max_length`` tokens for the groups
        ``kv_cache_group_ids`` (all of this spec), as (one block list per group, hit length).
        Positions the next token will not read are the null block. ``drop_eagle_block``:
        give back the last matched block (EAGLE recomputes it to get its hidden states);
        ``alignment_tokens``: the hit length must be a multiple of it."""
        raise NotImplementedError


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying a prompt can resume (vLLM 0.33): a resend of the same
    prompt hits at most ``num_prompt_tokens - 1`` tokens; with EAGLE, one block below the
    resend's and below a longer sibling's last aligned block (a hit drops that block)."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def _lookup(block_pool: BlockPool, block_hash: BlockHash, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
    if len(group_ids) == 1:
        blk = block_pool.cached_block_hash_to_block.get_one_block(block_hash + group_suffix(group_ids[0]))
        return None if blk is None else [blk]
    return block_pool.get_cached_block(block_hash, group_ids)


class FullAttentionManager(SingleTypeKVCacheManager):
    supports_partial_tail = True
    supports_fine_grained_hash_lookup = True

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        """Walk the chain from the first block and stop at the first miss (a later block
        cannot be cached without its parent having been: the hashes are chained)."""
        bs = kv_cache_spec.block_size
        alignment = alignment_tokens or bs
        hashes = block_pool.resolve_block_hashes(block_hashes, bs)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        n = max(0, max_length) // bs
        if len(kv_cache_group_ids) == 1:  # the common case, without the per-group zip
            out = computed[0]
            get = block_pool.cached_block_hash_to_block.get_one_block
            suffix = group_suffix(kv_cache_group_ids[0])
            for h in islice(hashes, n):
                blk = get(h + suffix)
                if blk is None:
                    break
                out.append(blk)
        else:
            for i in range(min(n, len(hashes))):
                hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
                if hit is None:
                    break
                for lst, blk in zip(computed, hit):
                    lst.append(blk)
        hit_length = len(computed[0]) * bs
        if alignment < bs and bs % alignment == 0:
            # Fine-grained (partial hits on): the hit may go on into the first block that is
            # not cached whole, up to its last hash boundary that is a key -- the prompt tail
            # another request registered there (cache_partial_block). Longest first.
            scale = bs // alignment
            first = len(computed[0]) * scale
            last = min(first + scale - 1, max(0, max_length) // alignment, len(block_hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                hit = _lookup(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
                if hit is None:
                    continue
                for lst, blk in zip(computed, hit):
                    lst.append(blk)
                hit_length = (fine_idx + 1) * alignment
                break
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment, bs)
        hit_length -= hit_length % alignment
        keep = cdiv(hit_length, bs)
        for lst in computed:
            del lst[keep:]
        return computed, hit_length

    def _cache_partial_tail_block(self, request: Any, num_tokens: int) -> None:
        """Register the last hash boundary of the prompt, when it falls inside a block, as a
        partial prefix entry of that block (``BlockPool.cache_partial_block``). Only that
        one boundary: the others inside the same block are skipped. A request repeating the
        prompt can match at most ``prompt - 1`` tokens (one is always computed), so the
        boundary is taken below that; with EAGLE the lookup reads the whole prompt before it
        drops a hash block, so the whole prompt counts."""
        hash_block_size = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks.get(request.request_id, ())
        block_idx = boundary // self.block_size
        if block_idx >= len(blocks):
            return
        self.block_pool.cache_partial_block(request, blocks[block_idx], boundary, self.kv_cache_group_id, self.block_size)


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with static sinks (vLLM 0.33): the sink keys and values fill blocks of
    their own, so ``sink_len`` must be a multiple of the block size; otherwise full
    attention in every respect."""

    def __init__(
        self, kv_cache_spec: SinkFullAttentionSpec, block_pool: BlockPool, kv_cache_group_id: int, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, *args, **kwargs)
        sink_len = kv_cache_spec.sink_len
        if sink_len is None or sink_len % self.block_size:
            raise ValueError(
                f"SinkFullAttentionSpec.sink_len must be a positive multiple of the block size {self.block_size} "
                f"(the sinks fill whole blocks), got {sink_len}"
            )


class CircularBufferManager(FullAttentionManager):
    """A ring (vLLM 0.33): each request takes one block the first time it is allocated for
    and keeps it until it is freed -- however many tokens it computes, whatever a connector
    supplies. No hashes, no hits, nothing cached, nothing skipped: the block holds scratch
    rows that are overwritten as the request goes. The coordinator leaves the group out of
    the prefix-hit search, so its slot in a hit is always empty."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def _claim_ring_block(self, request_id: str, record_for_zeroing: bool = True) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            return []
        new = self.block_pool.get_new_blocks(1, request_id=request_id, group=self.kv_cache_group_id)
        blocks.extend(new)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids += [b.block_id for b in new]
        return new

    def get_num_blocks_to_allocate(self, request_id: str, *args: Any, **kwargs: Any) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int, record_for_zeroing: bool = True
    ) -> None:
        self._claim_ring_block(request_id, record_for_zeroing)

    def add_local_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        return  # never a hit

    def _cache_blocks(self, request: Any, num_tokens: int) -> None:
        return

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        return

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        return tuple([] for _ in kv_cache_group_ids), 0


class RSWAManager(FullAttentionManager):
    """R-SWA (vLLM 0.33): full attention whose generated tokens older than the last
    ``rswa_window`` are never read again. Given the prompt's length, each step frees the
    *gap*: the whole blocks after the prompt's last block and before the window. They become
    the null block in the table (the kernel masks those positions), so a request holds
    O(prompt + window) blocks however long it decodes. The prompt's blocks, including a last
    one that decode tokens share, are never freed."""

    def __init__(self, kv_cache_spec: RSWASpec, block_pool: BlockPool, kv_cache_group_id: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, *args, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        first_gap_block = cdiv(num_prompt_tokens, self.block_size)  # the first block wholly after the prompt
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, first_gap_block, window_start // self.block_size)


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        # The window's W - 1 tokens and those kept below it for an MTP drafter's recompute
        # (the spec's one definition, read once: this count is asked at every allocation).
        self.num_retained_tokens = kv_cache_spec.num_retained_tokens

    @staticmethod
    def _contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        """Blocks a hit needs right before its end: the next token reads W - 1 earlier
        tokens (one more block when EAGLE drops the last one)."""
        return cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.num_retained_tokens)

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: Any,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """A window hit at an aligned length reads only the ``need`` blocks before it, so a
        block that is never among them is not worth a cache entry.

        Hits land on multiples of ``cache_hit_alignment_tokens`` (one block when all groups
        have this block size: then every block may end a hit and all are cached). With a
        larger alignment only the last ``need`` blocks of each aligned segment are cached.
        ``W = 1`` needs no block at all, so -- as in vLLM 0.33 -- no block of such a group is
        ever cached, and the group allows no hit.

        Sparse retention (``retention_interval`` not None): segments are ``retention_interval``
        tokens long instead (0: none at all), and the ``need`` blocks before each of
        ``reachable_boundaries`` are kept too -- a replay of the prompt still hits.
        ``final_segment_end_block`` (vLLM 0.33; kvlab's own caching does not pass it): the end
        of the request's last, shorter segment, whose ``need`` blocks are kept too without
        EAGLE."""
        alignment = alignment_tokens
        if alignment is None:
            return None
        bs = kv_cache_spec.block_size * dcp_world_size
        if alignment % bs:
            return None
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, use_eagle)
        shift = 1 if use_eagle else 0
        retention = retention_interval
        segment = alignment if retention is None else (retention or None)
        mask = [False] * (end_block - start_block)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            mask = [i >= shift and (i - shift) % per_segment >= per_segment - need for i in range(start_block, end_block)]
            last = final_segment_end_block
            tail = 0 if last is None or use_eagle else last % per_segment
            if last is not None and tail:
                for i in range(max(start_block, last - tail, last - need), min(end_block, last)):
                    mask[i - start_block] = True
        if retention is not None:
            for boundary in reachable_boundaries:
                end = boundary // alignment * alignment // bs + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        """Search right to left for ``need`` contiguous cached blocks ending at an aligned
        length; blocks before the run are the null block. Without such a run, only a run
        starting at block 0 is usable (nothing before it was ever in the window)."""
        bs = kv_cache_spec.block_size
        alignment = alignment_tokens or bs
        hashes = block_pool.resolve_block_hashes(block_hashes, bs)
        need = cls._contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, drop_eagle_block)
        n = min(max(0, max_length) // bs, len(hashes))
        null = block_pool.null_block
        computed = tuple([null] * n for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(n - 1, -1, -1):
            hit = _lookup(block_pool, hashes[i], kv_cache_group_ids)
            if hit is None:
                run = 0
                continue
            if run == 0 and bs != alignment:
                end_blocks = i if drop_eagle_block else i + 1
                if end_blocks * bs % alignment:
                    continue  # a run must end at an aligned length
            for lst, blk in zip(computed, hit):
                lst[i] = blk
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run :]
                found = True
                break
        if not found:
            for lst in computed:
                del lst[run:]
            while bs != alignment and len(computed[0]) * bs % alignment:
                for lst in computed:
                    lst.pop()
        if drop_eagle_block and computed[0]:
            for lst in computed:
                lst.pop()
            while bs != alignment and len(computed[0]) * bs % alignment:
                for lst in computed:
                    lst.pop()
        return computed, len(computed[0]) * bs


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(
        self, kv_cache_spec: ChunkedLocalAttentionSpec, block_pool: BlockPool, kv_cache_group_id: int, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, *args, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token of a finished chunk: the next query reads only its own chunk."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        """Blocks of chunks before the hit's own chunk are never read: they count as hit
        without a lookup (null blocks). Inside the last chunk, walk left to right."""
        bs = kv_cache_spec.block_size
        hashes = block_pool.resolve_block_hashes(block_hashes, bs)
        n = min(max(0, max_length) // bs, len(hashes))
        chunk = kv_cache_spec.attention_chunk_size
        start_block = (max(0, max_length) // chunk * chunk) // bs
        computed = tuple([block_pool.null_block] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, n):
            hit = _lookup(block_pool, hashes[i], kv_cache_group_ids)
            if hit is None:
                break
            for lst, blk in zip(computed, hit):
                lst.append(blk)
        return computed, len(computed[0]) * bs


class MambaManager(SingleTypeKVCacheManager):
    """A state group: the "table" of a request holds state blocks, one per
    ``block_size`` tokens in ``align`` mode, all but the last one or two of them null.

    When its blocks are larger than the hash block (vLLM 0.33 raises a hybrid's block size
    to hundreds of tokens, lesson 07b), a state can also be saved at the prompt's last hash
    boundary inside a block: the block holding it gets that boundary as a partial key, and a
    later request that hits it starts from a private copy (copy-on-write), since it will
    overwrite the state with its own."""

    supports_fine_grained_hash_lookup = True

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, kv_cache_group_id: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, *args, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        if self.enable_caching and self.mamba_cache_mode != "align":
            raise ValueError("a MambaSpec group with prefix caching needs mamba_cache_mode='align' (as in vLLM)")
        # Scratch states for draft tokens (MTP/EAGLE): one block per draft, after the running state.
        self.num_speculative_blocks: int = kv_cache_spec.num_speculative_blocks
        # A backend that writes the prompt's reusable state from inside the last chunk gets
        # one block reserved for it: request id -> (its token position, its table index).
        self.has_prefill_checkpoint_blocks = self.mamba_cache_mode == "align" and kv_cache_spec.num_prefill_checkpoint_blocks > 0
        self._checkpoints: dict[str, tuple[int, int]] = {}
        # Saved states cached during this step: another request may not start from them
        # before the step that writes them has run (vLLM defers it to the next step).
        self.cached_blocks_this_step: set[bytes] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        # With EAGLE a saved state sits one hash block earlier (the coordinator sets it).
        self.drop_eagle_checkpoint_block = False
        # Also save the state at a shared-prefix junction inside a block (opt-in; the
        # KVCacheManager decides, as the scheduler reads the same flag).
        self.shared_prefix_checkpoint = False
        # Hand-offs to a KV connector (vLLM 0.33). A state table is not append-only (old
        # states become null, scratch blocks move), so a connector cannot find a saved state
        # by its position: each one is offered as (request, group, block, tokens it covers),
        # drained by KVCacheManager.take_boundary_state_offloads. A state this request saved
        # inside a block, where it keeps writing: (that block, its boundary), until the copy
        # that preserves it is made -- or the request finishes first.
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is needed."""
        return num_computed_tokens - 1

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: Any,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Dense (every state cached) unless sparse retention is on: then one state per
        ``retention_interval`` tokens (0: none), plus the state that ends on each of
        ``reachable_boundaries`` -- a hit needs exactly that one block (no window, no EAGLE
        shift: ``use_eagle`` is not read)."""
        retention = retention_interval
        if retention is None or alignment_tokens is None:
            return None
        bs = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention:
            per_segment = retention // bs
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        alignment = alignment_tokens
        for boundary in reachable_boundaries:
            block = boundary // alignment * alignment // bs - 1
            if start_block <= block < end_block:
                mask[block - start_block] = True
        return mask

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        """One saved state suffices: the LAST cached block (right to left) whose end is an
        aligned length; the blocks before it are the null block."""
        bs = kv_cache_spec.block_size
        alignment = alignment_tokens or bs
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        if alignment < bs and bs % alignment == 0:
            # Fine-grained: a state saved at any hash boundary will do, inside a block too.
            scale = bs // alignment
            for fine_idx in range(min(max(0, max_length) // alignment, len(block_hashes)) - 1, -1, -1):
                hit = _lookup(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
                if hit is None:
                    continue
                for lst, blk in zip(computed, hit):
                    lst.extend([block_pool.null_block] * (fine_idx // scale))
                    lst.append(blk)
                return computed, (fine_idx + 1) * alignment
            return computed, 0
        hashes = block_pool.resolve_block_hashes(block_hashes, bs)
        for i in range(min(max(0, max_length) // bs, len(hashes)) - 1, -1, -1):
            hit = _lookup(block_pool, hashes[i], kv_cache_group_ids)
            if hit is None or (bs != alignment and (i + 1) * bs % alignment):
                continue
            for lst, blk in zip(computed, hit):
                lst.extend([block_pool.null_block] * i)
                lst.append(blk)
            return computed, (i + 1) * bs
        return computed, 0

    def _needs_internal_checkpoint(
        self, request_id: str, query_start: int, query_end: int, checkpoint_position: int, prefill_end: int
    ) -> bool:
        """Whether this chunk exports the prompt's state into a block of its own: the backend
        can (``is_mamba_prefill_checkpoint_valid``), the chunk reaches the prefill's end (under
        sparse retention; 0 otherwise), and the target column holds nothing -- no block yet,
        a null, or one of the request's own scratch blocks."""
        spec = self.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        idx = cdiv(query_end, self.block_size) - 2
        blocks = self.req_to_blocks.get(request_id, ())
        return (
            self.has_prefill_checkpoint_blocks
            and query_end >= prefill_end
            and is_mamba_prefill_checkpoint_valid(
                query_start,
                query_end,
                checkpoint_position,
                self.block_pool.hash_block_size or self.block_size,
                self.block_size,
                spec.prefill_checkpoint_alignment,
            )
            and idx >= 0
            and (
                idx >= len(blocks)
                or blocks[idx].is_null
                or (request_id in self._allocated_block_reqs and idx >= len(blocks) - self.num_speculative_blocks)
            )
        )

    def get_num_blocks_to_allocate(
        self,
        request_id,
        num_tokens,
        new_computed_blocks,
        total_computed_tokens,
        num_local_computed_tokens,
        num_tokens_main_model,
        apply_admission_cap=False,
        prefill_end: int = 0,
    ):
        if new_computed_blocks and new_computed_blocks[-1].cache_key in self.cached_blocks_this_step:
            # The state was saved by a request of this very step: usable only from the next.
            return self.block_pool.num_gpu_blocks + 1
        nspec = self.num_speculative_blocks
        if self.mamba_cache_mode != "align":
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * nspec,  # room for the draft tokens' scratch states
                new_computed_blocks,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
            )
        held = self.req_to_blocks.get(request_id, ())
        # One new state block per step at most (lookahead slots are not states; vLLM counts
        # the main model's tokens only), one more for the copy of a state saved inside a
        # block, and on the first allocation the draft tokens' scratch blocks.
        num_new = cdiv(num_tokens_main_model, self.block_size) + nspec - len(new_computed_blocks) - len(held)
        has_partial_hit = (
            self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens) or request_id in self._partial_hit_reqs
        )
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        checkpoint_block = 0
        if self.has_prefill_checkpoint_blocks:  # off by default: no work on the common path
            # The state this chunk may export from inside (keyed on the chunk's end, as the
            # runner computes it); only the admission gate's what-if leaves the record alone.
            checkpoint_position = self._checkpoint_position(num_tokens_main_model, self.cache_hit_alignment_tokens)
            if not self._needs_internal_checkpoint(
                request_id, total_computed_tokens, num_tokens_main_model, checkpoint_position, prefill_end
            ):
                checkpoint_position = 0
            checkpoint_block = int(checkpoint_position > 0)
            if not apply_admission_cap:
                if checkpoint_position > 0:
                    self._checkpoints[request_id] = (checkpoint_position, cdiv(num_tokens_main_model, self.block_size) - 2)
                else:
                    self._checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 + int(has_partial_hit) + checkpoint_block + (0 if request_id in self._allocated_block_reqs else nspec)
            num_new = min(num_new, cap)
        count = num_new + self._get_num_evictable_blocks(new_computed_blocks)
        if (
            not apply_admission_cap
            and total_computed_tokens > num_local_computed_tokens
            and not held
            and request_id not in self.num_cached_block
        ):
            # External tokens (a connector supplies their KV) get a state block of their
            # own in allocate_external_computed_blocks, which vLLM 0.33 leaves out of this
            # count: it can then fail half-way through an allocation. kvlab also counts
            # what the three allocation stages really take and asks for the larger number,
            # so it refuses whenever vLLM refuses, and where vLLM would crash.
            skipped = max(0, total_computed_tokens - 1) // self.block_size
            length = max(skipped, len(new_computed_blocks))
            ext_new = max(0, cdiv(total_computed_tokens, self.block_size) - length)
            exact = self._get_num_evictable_blocks(new_computed_blocks[skipped:]) + ext_new
            # (a checkpoint block shortens the null padding by one: one more new block)
            exact += min(max(0, cdiv(num_tokens_main_model, self.block_size) + nspec - length - ext_new), 1 + nspec + checkpoint_block)
            count = max(count, exact)
        return count

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        nspec = self.num_speculative_blocks
        if self.mamba_cache_mode != "align":
            return super().allocate_new_blocks(request_id, num_tokens + self.block_size * nspec, num_tokens_main_model)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required = cdiv(num_tokens_main_model, self.block_size) + nspec
        partial = self._partial_hit_reqs.get(request_id) if self._partial_hit_reqs else None
        checkpoint_block = int(request_id in self._checkpoints)
        if num_required <= len(blocks) and partial is None and not checkpoint_block:
            self._allocated_block_reqs.add(request_id)
            return []
        prev = len(blocks)
        allocated = request_id in self._allocated_block_reqs
        if allocated:
            # The state this step reads: the running state, just before the scratch blocks.
            # It is freed once the new state exists.
            self.last_state_block_idx[request_id] = prev - 1 - nspec
        elif prev > 0:
            self.last_state_block_idx[request_id] = prev - 1  # a hit's saved state
        # The new state goes at position num_required - 1 - nspec; positions in between
        # will never hold a state this request reads: null -- except the one just before it,
        # when this chunk exports the prompt's state there.
        num_skipped = num_required - nspec - 1
        pad = [self._null_block] * max(0, num_skipped - checkpoint_block - prev)
        if pad:
            self._touch(request_id, pad)  # null padding: no ref count moves; the event records the positions
            blocks.extend(pad)
        if allocated:
            # Scratch blocks the new running state leaves behind follow it to the end of
            # the table (the runner's table only grows): moved, not freed and taken again.
            # (One at the checkpoint's column stays: the runner exports the state into it.)
            for idx in range(prev - nspec, prev):
                if idx >= num_skipped - checkpoint_block:
                    break
                self._relocate_speculative_block(blocks, idx, request_id)
        num_new = max(num_required - len(blocks), 0)
        assert num_new <= 1 + checkpoint_block + (0 if allocated else nspec), "a Mamba group allocates at most one state block per step"
        returned = blocks[prev:]
        if partial is not None:
            # A state saved inside a block: a copy of it is taken first (its block comes off
            # the queue before the new state's, as in vLLM).
            block_idx, source = partial
            cow_block = self.block_pool.get_new_blocks(1, group=self.kv_cache_group_id)[0]
            if allocated:
                # The request saved that state itself and keeps writing into its block (the
                # runner's table only grows): the cache entry moves to the copy instead.
                assert blocks[block_idx] is source
                self.block_pool.move_block_hashes(source, cow_block)
                self._pending_cow_copies.append((source, cow_block))
                source.ref_cnt += 1
                producer = self._producer_partial_tail_reqs.pop(request_id, None)
                if producer is not None:
                    # the state it saved survives in the copy, once the copy has run: offer that
                    assert producer[0] is source
                    self._pending_boundary_state_offloads.append((request_id, self.kv_cache_group_id, cow_block, producer[1]))
                if cow_block.cache_key is not None:
                    self.cached_blocks_this_step.add(cow_block.cache_key)  # filled by this step's copy
                self._copied(request_id, block_idx, source, cow_block, moved_hashes=True)
            else:
                self._apply_cow(request_id, block_idx, source, cow_block)
                returned = [cow_block] + returned
            self._partial_hit_reqs.pop(request_id, None)
        new = self.block_pool.get_new_blocks(num_new, request_id=request_id, group=self.kv_cache_group_id)
        blocks.extend(new)
        self._allocated_block_reqs.add(request_id)
        return returned + new

    def _relocate_speculative_block(self, blocks: list[KVCacheBlock], idx: int, request_id: str | None = None) -> None:
        """Move the block at ``idx`` to the table's end, a null block in its place (vLLM
        0.33's call shape; ``request_id`` names the request in the event log)."""
        block = blocks[idx]
        assert not block.is_null and block.ref_cnt == 1 and block.cache_key is None, (
            "a speculative Mamba block must be exclusively owned and unhashed to move"
        )
        blocks.append(block)
        blocks[idx] = self._null_block
        events = self.block_pool.events
        if events is not None:
            events.emit(BlockRelocated(request_id=request_id, group=self.kv_cache_group_id, position=idx, block_id=block.block_id))

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        if self.mamba_cache_mode != "align":
            return super()._remove_blocks_in_range(request_id, first_block, last_block)
        blocks = self.req_to_blocks.get(request_id, [])
        first_block = max(first_block, self._num_retired_blocks.get(request_id, 0))
        last_block = min(last_block, len(blocks))
        if first_block >= last_block:
            return
        removed: list[KVCacheBlock] = []
        positions: list[int] = []
        for i in range(last_block - 1, first_block - 1, -1):  # nulls between states are skipped
            if blocks[i].is_null:
                continue
            removed.append(blocks[i])
            positions.append(i)
            blocks[i] = self._null_block
        self._free_removed(request_id, positions, removed)
        self._num_retired_blocks[request_id] = last_block

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if self.mamba_cache_mode != "align":
            return
        idx = self.last_state_block_idx.get(request_id)
        blocks = self.req_to_blocks.get(request_id)
        if idx is not None and blocks and idx < cdiv(processed_computed_tokens, self.block_size) - 1 and not blocks[idx].is_null:
            # The state the previous step read has been copied forward: free it.
            removed = [blocks[idx]]
            blocks[idx] = self._null_block
            self._free_removed(request_id, [idx], removed)

    def _cache_blocks(self, request: Any, num_tokens: int) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super()._cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(rid, 0)
        if self.mamba_cache_mode == "align":
            key = self._cache_partial_tail_block(request, num_tokens)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        blocks = self.req_to_blocks.get(rid, [])
        align = self.mamba_cache_mode == "align"
        for idx in range(before, min(after, len(blocks))):
            b = blocks[idx]
            if not b.is_null and b.cache_key is not None:
                self.cached_blocks_this_step.add(b.cache_key)
                if align:
                    # every state kept for reuse is offered with its block and exact length (the
                    # connector decides which it stores)
                    n = b.block_hash_num_tokens or (idx + 1) * self.block_size
                    self._pending_boundary_state_offloads.append((rid, self.kv_cache_group_id, b, n))

    def _cache_partial_tail_block(  # type: ignore[override]  # returns the key it made
        self, request: Any, num_tokens: int, retention_interval: Any = _AS_SET
    ) -> bytes | None:
        """Save the state at the prompt's last hash boundary (below the last prompt token, one
        hash block lower with EAGLE) -- or, opted in, at a shared-prefix junction within the
        prompt -- as a partial key of the block that holds it, when the computed tokens reach
        exactly that boundary: the scheduler ends a chunk there
        (``Scheduler._mamba_block_aligned_split``). Inside a block, the request keeps
        writing its state into that block, so its next allocation moves the key to a copy.
        ``retention_interval``: vLLM 0.33's third argument; given, it holds for this call only."""
        if retention_interval is not _AS_SET and retention_interval != self.retention_interval:
            saved = self.retention_interval
            self.retention_interval = check_optional_int("retention_interval", retention_interval, 0)
            try:
                return self._cache_partial_tail_block(request, num_tokens)
            finally:
                self.retention_interval = saved
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None:
            return self._cache_prefill_checkpoint(request, *checkpoint)
        hash_block_size = self.block_pool.hash_block_size
        if not hash_block_size or num_tokens <= 0 or num_tokens % hash_block_size:
            return None
        at_junction = (
            self.shared_prefix_checkpoint
            and num_tokens == request.shared_prefix_boundary
            and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
        )
        if num_tokens != self._checkpoint_position(request.num_prompt_tokens, hash_block_size) and not at_junction:
            return None
        block_idx = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks.get(request.request_id, ())
        if block_idx >= len(blocks) or blocks[block_idx].is_null:
            return None
        source = blocks[block_idx]
        if self._keyed_at(source, block_idx, num_tokens):
            return None  # keyed there already (a hit, or an earlier step); a whole block's key covers all of it
        key = self.block_pool.cache_partial_block(request, source, num_tokens, self.kv_cache_group_id, self.block_size)
        if key is not None and num_tokens % self.block_size:
            self._partial_hit_reqs[request.request_id] = (block_idx, source)
            self.num_cached_block[request.request_id] = block_idx
            # this request saved the state; its next step overwrites it in place (see __init__)
            self._producer_partial_tail_reqs[request.request_id] = (source, num_tokens)
        return key

    def _checkpoint_position(self, num_tokens: int, alignment: int) -> int:
        """``get_mamba_prefill_checkpoint_position`` with this group's EAGLE drop and the pool's
        lookahead: where a prefill of ``num_tokens`` saves its reusable state, on multiples of
        ``alignment``."""
        return get_mamba_prefill_checkpoint_position(
            num_tokens, alignment, self.drop_eagle_checkpoint_block, self.block_pool.num_hash_lookahead_tokens
        )

    def _keyed_at(self, block: KVCacheBlock, idx: int, num_tokens: int) -> bool:
        """Whether ``block`` (at table index ``idx``) already has a key for exactly ``num_tokens``
        tokens: a partial key there, or the whole block's key when that ends there."""
        if block.cache_key is None:
            return False
        n = block.block_hash_num_tokens
        return (idx + 1) * self.block_size == num_tokens if n is None else n == num_tokens

    def _cache_prefill_checkpoint(self, request: Any, position: int, idx: int) -> bytes | None:
        """Key the block the runner exports this chunk's checkpoint into, at the checkpoint's
        position -- if a later request can use it: the prompt's reusable boundary, a state
        sparse retention keeps, or a shared-prefix junction. Otherwise the block only holds
        a passing state, and any key it had from earlier this step is dropped."""
        blocks = self.req_to_blocks[request.request_id]
        assert 0 <= idx < len(blocks)
        block = blocks[idx]
        is_prompt_checkpoint = position == self._checkpoint_position(request.num_prompt_tokens, self.cache_hit_alignment_tokens)
        is_retained = False
        if position % self.block_size == 0:
            b = position // self.block_size - 1
            mask = self.block_mask(b, b + 1)  # the retention segments only: the prompt and junction are checked here
            is_retained = mask is None or mask[0]
        pool = self.block_pool
        if not is_prompt_checkpoint and not is_retained and position != request.shared_prefix_boundary:
            pool.evict_blocks([block.block_id])  # its keys go, with their BlockRemoved events
            return None
        if self._keyed_at(block, idx, position):
            return None  # keyed there already
        return pool.cache_partial_block(request, block, position, self.kv_cache_group_id, self.block_size, replace_existing_hashes=True)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._checkpoints.pop(request_id, None)
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        self._producer_partial_tail_reqs.pop(request_id, None)
        if self._pending_boundary_state_offloads:
            # Its blocks go back to the pool now, and another request may get them: a hand-off
            # not yet drained would point a connector at someone else's state. Dropped.
            self._pending_boundary_state_offloads = [e for e in self._pending_boundary_state_offloads if e[0] != request_id]
        return super().pop_blocks_for_free(request_id)

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        if self.mamba_cache_mode != "align":
            return None
        producer = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer is None:
            return None
        block, boundary = producer
        if num_in_flight_tokens or num_computed_tokens != boundary:
            return None  # a later token was computed (or is being): the block no longer holds that state
        return self.kv_cache_group_id, block, boundary

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention (vLLM 0.33): the coordinator gives this group room for the encoder's
    tokens -- once, when the request is first scheduled -- instead of the decoder's. Its
    blocks are the request's own: never a prefix hit, never cached, never loaded by a
    connector."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        if new_computed_blocks:
            raise ValueError("a cross-attention group never has prefix hits: its blocks are not shared between requests")

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int, record_for_zeroing: bool = True
    ) -> None:
        return  # no prefix caching, no external KV

    def _cache_blocks(self, request: Any, num_tokens: int) -> None:
        raise ValueError("cross-attention blocks are never cached: an encoder-decoder model runs with prefix caching off")

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block=False, alignment_tokens=None
    ):
        raise NotImplementedError("CrossAttentionManager does not support caching")


# The registry lives below this module (kv_cache_utils reads it); the managers fill it here.
MANAGER_FOR_SPEC.update(
    {
        FullAttentionSpec: FullAttentionManager,
        MLAAttentionSpec: FullAttentionManager,
        HiddenStateCacheSpec: FullAttentionManager,
        SinkFullAttentionSpec: SinkFullAttentionManager,
        CircularBufferSpec: CircularBufferManager,
        RSWASpec: RSWAManager,
        SlidingWindowSpec: SlidingWindowManager,
        SlidingWindowMLASpec: SlidingWindowManager,
        ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
        MambaSpec: MambaManager,
        CrossAttentionSpec: CrossAttentionManager,
    }
)
spec_manager_map = MANAGER_FOR_SPEC  # vLLM's name


def register_all_kvcache_specs(vllm_config: Any = None) -> None:
    """vLLM 0.33 registers its built-in specs' managers at engine start-up (its tests call
    this before they build a scheduler). kvlab's are registered when this module is
    imported -- above, and HiSparse's in ``hisparse_managers`` -- so there is nothing left
    to do; the call is kept so that code written for vLLM runs unchanged."""
    return None


def records_new_block_ids(kv_cache_spec: KVCacheSpec, needs_kv_cache_zeroing: bool) -> bool:
    """Whether a group writes down the blocks it hands out, for the runner to zero (vLLM
    0.33): only when the pool needs zeroing, and only attention groups -- a Mamba state is
    overwritten whole, and a ring (CircularBufferSpec) overwrites its one block as it goes."""
    return needs_kv_cache_zeroing and isinstance(kv_cache_spec, AttentionSpec) and not isinstance(kv_cache_spec, CircularBufferSpec)


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    block_pool: BlockPool,
    kv_cache_group_id: int,
    enable_caching: bool = True,
    scheduler_block_size: int | None = None,
    max_in_flight_tokens: int | None = None,
    max_model_len: int | None = None,
    manager_cls: type[SingleTypeKVCacheManager] | None = None,
    needs_kv_cache_zeroing: bool = False,
) -> SingleTypeKVCacheManager:
    """The manager of a spec. Window and chunk groups recycle blocks, so the admission gate
    counts at most what one request can hold (vLLM: ``max_admission_blocks_per_request``,
    from ``max_in_flight_tokens`` -- one step's tokens -- and ``max_model_len``); without
    ``max_in_flight_tokens`` there is no cap, as in vLLM when it is unset."""
    cap = None
    if isinstance(kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) and max_in_flight_tokens is not None:
        cap = kv_cache_spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len or max_in_flight_tokens + 2**40)
    elif isinstance(kv_cache_spec, HiSparseResidentSpec) and (max_in_flight_tokens or max_model_len):
        # HiSparse's resident pages: one step's worth (vLLM 0.33 reads max_model_len for an
        # unset max_in_flight_tokens), which the coordinator also reads as the window past
        # which a prefill must read older pages from the host.
        in_flight = max_in_flight_tokens or max_model_len
        cap = kv_cache_spec.max_admission_blocks_per_request(in_flight, max_model_len or in_flight)  # type: ignore[arg-type]  # one of the two is set
    cls = manager_cls or MANAGER_FOR_SPEC[type(kv_cache_spec)]
    return cls(
        kv_cache_spec,
        block_pool,
        kv_cache_group_id,
        enable_caching,
        scheduler_block_size,
        cap,
        needs_kv_cache_zeroing=needs_kv_cache_zeroing,
    )
