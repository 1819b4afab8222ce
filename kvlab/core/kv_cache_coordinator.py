"""The coordinator: one single-type manager per group, one pool for all (lesson 07).

vLLM: ``vllm/v1/core/kv_cache_coordinator.py`` (v0.33). A hybrid model has layers of
several kinds -- full attention, MLA, sliding windows of different sizes, chunked local
attention, Mamba states -- and each kind keeps its own block table per request, yet all
tables draw from ONE pool and a prefix hit is usable only if *every* group can serve it.
Three coordinators, as in vLLM:

* ``KVCacheCoordinatorNoPrefixCache`` -- caching off: never a hit;
* ``UnitaryKVCacheCoordinator`` -- one group: its own rule decides;
* ``HybridKVCacheCoordinator`` -- any number of groups. Groups with equal specs are looked
  up together. The hit length is found by a fixed point: start from the longest possible
  length; each kind in turn either accepts the current length or shortens it; when one
  shortens it, ask every kind again. Full attention goes first (its left-to-right walk gives
  the tightest first bound and it can only be cut back later, never re-searched), and every
  length is a multiple of the scheduler block size (the LCM of the groups' block sizes), so
  that each group's hit is a whole number of its blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import KVCacheBlock, eagle_proof_margin, partial_hash_hits_enabled
from kvlab.core.hisparse_managers import HiSparseSourceManager
from kvlab.core.single_type_kv_cache_manager import (
    MANAGER_FOR_SPEC,
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    cdiv,
    get_manager_for_kv_cache_spec,
)
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvlab.utils.hashing import BlockHash

logger = logging.getLogger("kvlab.kv_cache")


def _check_retention_interval(retention_interval: int | None, scheduler_block_size: int, specs: Sequence[KVCacheSpec]) -> int | None:
    """vLLM 0.33's ``_validate_prefix_cache_retention_interval``: only window and Mamba groups
    act on it, so a model without them must leave it None or 0; else a multiple of the
    scheduler block size (hits land there)."""
    if retention_interval is None:
        return None
    if type(retention_interval) is not int:
        raise TypeError(f"prefix_cache_retention_interval must be None or an int, got {retention_interval!r}")
    if not any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in specs):
        if retention_interval == 0:
            return 0
        raise ValueError(
            "prefix_cache_retention_interval is set but this model has no sliding-window or Mamba KV cache group, so "
            "retention has no effect. Set it to 0 (it only applies to sliding-window and Mamba attention)."
        )
    if retention_interval < 0 or retention_interval % scheduler_block_size:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention_interval}) must be non-negative and a multiple of "
            f"scheduler_block_size ({scheduler_block_size})."
        )
    return retention_interval


class KVCacheCoordinator:
    """What every coordinator does: ask each group's manager, in group order."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        block_pool: BlockPool,
        enable_caching: bool,
        *,
        scheduler_block_size: int,
        hash_block_size: int,
        use_eagle: bool = False,
        max_model_len: int | None = None,
        max_in_flight_tokens: int | None = None,
        manager_classes: Mapping[type, type[SingleTypeKVCacheManager]] | None = None,
        eagle_group_ids: Collection[int] = (),
        prefix_cache_retention_interval: int | None = None,
        num_prefill_lookahead: int = 0,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        needs_kv_cache_zeroing: bool = False,
        hisparse_source_group_ids: Collection[int] = (),
    ) -> None:
        """``hisparse_source_group_ids``: HiSparse's host-resident source groups, each run by a
        ``HiSparseSourceManager`` (vLLM 0.33 picks it by the group's role).
        ``needs_kv_cache_zeroing``: the pool's groups mix kinds or dtypes, so each group's
        manager records the attention blocks it hands out, to be zeroed (vLLM 0.33).
        ``specs``: as the manager sees them -- under decode context parallelism a sharded
        group's block size is already ``dcp_world_size`` times its spec's (see
        ``KVCacheManager``); the sizes are recorded on each group's manager, as in vLLM."""
        self.block_pool = block_pool
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.specs = list(specs)
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.use_eagle = use_eagle
        # The groups of an EAGLE drafter's layers (KVCacheGroupSpec.is_eagle_group): only they
        # give back a hit's last block. None flagged and EAGLE on: every group (vLLM's fallback).
        self.explicit_eagle_groups = bool(eagle_group_ids)
        self.eagle_group_ids: set[int] = set(eagle_group_ids)
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(self.specs)))
        self.drop_eagle_group_ids: set[int] = self.eagle_group_ids if use_eagle else set()
        # Multi-module MTP (vLLM 0.33): at a chunk boundary the drafter reads the next
        # ``num_prefill_lookahead`` prompt tokens, and the chunk's last ``that - 1`` tokens
        # may be computed again, so their KV is not final and is not cached yet.
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        # A hit's dropped tail is one scheduler block, so it must hold the drafter's lookahead.
        if enable_caching and self.eagle_group_ids and scheduler_block_size < num_prefill_lookahead:
            raise ValueError(
                f"Multi-module MTP with prefix caching requires scheduler_block_size (={scheduler_block_size}) >= "
                f"num_speculative_tokens (={num_prefill_lookahead})."
            )
        # spec type -> manager class; ``manager_classes`` overrides some (a seam: the
        # exercises run a learner's free order or block count in a manager subclass).
        self.manager_for_spec: dict[type, type[SingleTypeKVCacheManager]] = {**MANAGER_FOR_SPEC, **(manager_classes or {})}
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                spec,
                block_pool,
                gid,
                enable_caching,
                scheduler_block_size,
                max_in_flight_tokens,
                max_model_len,
                manager_cls=HiSparseSourceManager if gid in hisparse_source_group_ids else self.manager_for_spec[type(spec)],
                needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            )
            for gid, spec in enumerate(self.specs)
        )
        for m in self.single_type_managers:
            if getattr(m.kv_cache_spec, "dcp_sharded", False):  # a replicated group keeps 1 and 1
                m.dcp_world_size, m.pcp_world_size = dcp_world_size, pcp_world_size
        # Sparse retention of window and Mamba states (vLLM 0.33); checked with vLLM's rules.
        self.retention_interval = prefix_cache_retention_interval
        replay_use_eagle = bool(self.drop_eagle_group_ids)
        for m in self.single_type_managers:
            m.replay_use_eagle = replay_use_eagle
        # Encoder-decoder models: the cross-attention groups get room for the encoder's
        # tokens, not the decoder's (empty for every other model).
        self.cross_attention_group_ids = frozenset(
            gid for gid, m in enumerate(self.single_type_managers) if isinstance(m, CrossAttentionManager)
        )

    @property
    def retention_interval(self) -> int | None:
        """Sparse retention of window and Mamba states (vLLM 0.33's
        ``prefix_cache_retention_interval``). vLLM's coordinator hands it to every
        ``cache_blocks`` call, so its tests set it on the coordinator after construction;
        here setting it checks it (vLLM's rules; nothing changes on a refusal) and gives it
        to each group manager."""
        return self._retention_interval

    @retention_interval.setter
    def retention_interval(self, value: int | None) -> None:
        value = _check_retention_interval(value, self.scheduler_block_size, self.specs)
        self._retention_interval = value
        for m in self.single_type_managers:
            m.retention_interval = value

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_encoder_tokens: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """``prefill_end``: where the request's prefill ends. Under retention 0 a Mamba group
        reserves a prefill checkpoint only for the chunk that reaches it; otherwise every
        chunk's checkpoint is kept, and it is ignored."""
        cross = self.cross_attention_group_ids
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for i, m in enumerate(self.single_type_managers):
            if i in cross:  # one static allocation for the encoder's tokens (vLLM 0.33)
                total += m.get_num_blocks_to_allocate(request_id, num_encoder_tokens, [], 0, 0, num_encoder_tokens, apply_admission_cap)
                continue
            args = (request_id, num_tokens, new_computed_blocks[i], total_computed_tokens, num_local_computed_tokens, num_tokens_main_model)
            if isinstance(m, MambaManager):
                total += m.get_num_blocks_to_allocate(*args, apply_admission_cap, prefill_end=prefill_end)
            else:
                total += m.get_num_blocks_to_allocate(*args, apply_admission_cap)
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        """Adopt a new request's hits in every group FIRST, then allocate the blocks for its
        external tokens: an earlier group's allocation must not evict a later group's
        not-yet-touched hit (vLLM issue #33775). ``skip_zeroing_group_ids``: groups whose
        external blocks an asynchronous load writes (not to be zeroed)."""
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            assert not any(new_computed_blocks), "a running request cannot receive prefix hits"
            return
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for i, m in enumerate(self.single_type_managers):
                m.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens, i not in skip_zeroing_group_ids
                )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        """Group by group: group 0 takes its blocks from the queue head, then group 1, ...
        (a cross-attention group: room for ``num_encoder_tokens``)."""
        cross = self.cross_attention_group_ids
        return tuple(
            m.allocate_new_blocks(request_id, num_encoder_tokens if i in cross else num_tokens, num_tokens_main_model)
            for i, m in enumerate(self.single_type_managers)
        )

    #: Whether hits may end inside a block (vLLM 0.33: a Mamba hybrid whose blocks are larger
    #: than the hash block); only the hybrid coordinator turns it on.
    enable_partial_hash_hits = False
    #: After a lookup: how far the longest hit one kind of group found alone went beyond the
    #: hit all agree on (vLLM 0.33 returns it as a third value); 0 with one kind of group.
    num_uncached_common_prefix_tokens = 0

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """The prefix whose KV is final: all of it, less the tokens a multi-module MTP
        drafter may have the target recompute."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        for gid, m in enumerate(self.single_type_managers):
            if m.enable_caching:
                m.cache_blocks(request, self.get_num_cacheable_tokens(num_computed_tokens, gid))

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Every group's blocks of the request, group after group, its bookkeeping dropped
        and the blocks not yet freed (vLLM 0.33; the caller frees them, tail first)."""
        blocks: list[KVCacheBlock] = []
        for m in self.single_type_managers:
            blocks.extend(m.pop_blocks_for_free(request_id))
        return blocks

    def emit_cached_block_events(self, request: Any, computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        """A prefix hit, told on the KV-event stream: one ``BlockStored`` per group that hit,
        of the hit's whole blocks. A hit that ends inside a block (partial hits on a Mamba
        hybrid) leaves that block out: it has no full-block hash to publish. vLLM 0.33 counts
        it anyway and fails with an IndexError reading a hash the request does not have."""
        for gid, (m, group_blocks) in enumerate(zip(self.single_type_managers, computed_blocks)):
            whole = len(m.block_pool.resolve_block_hashes(request.block_hashes, m.block_size))
            if group_blocks and whole:
                m.block_pool.emit_cached_block_events(request, min(len(group_blocks), whole), m.block_size, gid)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.single_type_managers)

    def new_step_starts(self) -> None:
        for m in self.single_type_managers:
            m.new_step_starts()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Caching off: any number of groups, never a hit."""

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its manager's rule is the whole answer."""

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        m = self.single_type_managers[0]
        return type(m).find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            [0],
            self.block_pool,
            m.kv_cache_spec,
            drop_eagle_block=0 in self.drop_eagle_group_ids,
            alignment_tokens=m.block_size,
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.single_type_managers[0].use_eagle = 0 in self.drop_eagle_group_ids

    # One group: each question goes straight to its manager (the base class's loops over
    # groups, without the loop -- these run for every request in every step).
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_encoder_tokens: int = 0,
        prefill_end: int = 0,
    ) -> int:
        m = self.single_type_managers[0]
        if isinstance(m, MambaManager):  # a model of Mamba layers only: the general path
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
                num_encoder_tokens,
                prefill_end,
            )
        return m.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks[0],
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        m = self.single_type_managers[0]
        if request_id in m.num_cached_block:
            assert not any(new_computed_blocks), "a running request cannot receive prefix hits"
            return
        m.add_local_computed_blocks(request_id, new_computed_blocks[0], num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            m.allocate_external_computed_blocks(
                request_id, num_local_computed_tokens, num_external_computed_tokens, 0 not in skip_zeroing_group_ids
            )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self.single_type_managers[0].allocate_new_blocks(request_id, num_tokens, num_tokens_main_model),)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        m = self.single_type_managers[0]
        if m.enable_caching:
            m.cache_blocks(request, self.get_num_cacheable_tokens(num_computed_tokens, 0))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        self.single_type_managers[0].remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return (self.single_type_managers[0].req_to_blocks.get(request_id, []),)


class SpecGroup(NamedTuple):
    """Groups that share one spec: cached and looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: the fixed-point hit search of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for m in self.single_type_managers:
            if m.kv_cache_spec.prefix_cacheable and m.block_size % self.hash_block_size:
                raise ValueError(
                    f"group {m.kv_cache_group_id}: block_size {m.block_size} is not a multiple of the hash block size {self.hash_block_size}"
                )
            if isinstance(m, ChunkedLocalAttentionManager) and m.block_size != self.scheduler_block_size:
                raise ValueError(
                    "ChunkedLocalAttentionSpec needs every group to share its block size "
                    f"({m.block_size} vs scheduler block size {self.scheduler_block_size}), as in vLLM"
                )
            if isinstance(m, ChunkedLocalAttentionManager) and self.use_eagle:
                raise ValueError("EAGLE with chunked local attention is not supported (as in vLLM)")
            if isinstance(m, MambaManager) and self.use_eagle:
                m.drop_eagle_checkpoint_block = True  # Mamba states follow EAGLE's replay boundary
        # Fine-grained partial hits (vLLM 0.33): a hit may end on any hash boundary, inside a
        # block; the request then writes into a private copy of that block (copy-on-write).
        self.enable_partial_hash_hits = partial_hash_hits_enabled(
            self.specs, self.hash_block_size, self.dcp_world_size, [type(m) for m in self.single_type_managers]
        )
        for m in self.single_type_managers:
            m.cache_hit_alignment_tokens = self._cache_hit_alignment_tokens
        self.attention_groups: list[SpecGroup] = []
        for gid, (spec, m) in enumerate(zip(self.specs, self.single_type_managers)):
            if not spec.prefix_cacheable:
                continue  # scratch (a ring): never in a hit; its slot in the answer stays empty
            use_eagle = gid in self.drop_eagle_group_ids
            for idx, g in enumerate(self.attention_groups):
                # Looked up together: the same spec, run by the same kind of manager, over the
                # same pool (HiSparse's host group shares its spec with the indexer's).
                if g.spec == spec and g.manager_cls is type(m) and self.single_type_managers[g.group_ids[0]].block_pool is m.block_pool:
                    g.group_ids.append(gid)
                    if use_eagle and not g.use_eagle:
                        self.attention_groups[idx] = g._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(SpecGroup(spec, [gid], type(m), use_eagle))
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        for g in self.attention_groups:
            for gid in g.group_ids:
                self.single_type_managers[gid].use_eagle = g.use_eagle
        # The full-attention group a per-group lookup is measured against (vLLM 0.33): full
        # attention is downward-closed, so no other group can truly hit deeper than it.
        first = self.attention_groups[0] if self.attention_groups else None
        self.full_attention_group_id: int | None = (
            first.group_ids[0] if first is not None and isinstance(first.spec, FullAttentionSpec) else None
        )

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Hits land on hash boundaries with partial hits, else on scheduler blocks."""
        return self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size

    def _align_cacheable(self, num_tokens: int) -> int:
        """The longest prefix of ``num_tokens`` a future hit could match. With partial hits,
        none is cut off: even rounding to the hash block would register a copied Mamba tail
        again."""
        if self.enable_partial_hash_hits:
            return num_tokens
        return num_tokens // self.scheduler_block_size * self.scheduler_block_size

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Only what a future hit can reach: hits are multiples of the scheduler block size
        (of the hash block, with partial hits). An EAGLE group also caches the block past
        the boundary (its hit drops it again)."""
        aligned = self._align_cacheable(num_computed_tokens)
        m = self.single_type_managers[kv_cache_group_id]
        if m.use_eagle and aligned > 0:
            # vLLM 0.33 holds back the reprefillable tokens here only (a group without the
            # EAGLE drop caches the aligned prefix as it is).
            final = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(final, self._align_cacheable(final) + m.block_size)
        return aligned

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        n_groups = len(self.single_type_managers)
        hit_length = max_cache_hit_length
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * n_groups
        hit_len_by_group = [0] * n_groups
        simple = len(self.attention_groups) == 2 and isinstance(self.attention_groups[0].spec, FullAttentionSpec)
        eagle_verified: set[int] = set()  # kinds whose EAGLE drop holds at the current length
        longest = 0  # the longest hit any kind alone found (a shared prefix others lack)
        while True:
            curr = hit_length
            for idx, group in enumerate(self.attention_groups):
                gids = group.group_ids
                if isinstance(group.spec, FullAttentionSpec) and hit_blocks[gids[0]] is not None:
                    curr = min(curr, hit_len_by_group[gids[0]])  # downward-closed: just cut back
                    continue
                drop = group.use_eagle and idx not in eagle_verified
                blocks, new_len = self._group_hit(group, block_hashes, curr, drop)
                if drop:
                    eagle_verified.add(idx)
                elif new_len < curr:
                    eagle_verified.clear()
                curr = new_len
                for gid, lst in zip(gids, blocks):
                    hit_blocks[gid] = lst
                    hit_len_by_group[gid] = new_len
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        for g in self.attention_groups:
            if not isinstance(g.spec, FullAttentionSpec) or self.single_type_managers[g.group_ids[0]].retains_longer_hit:
                continue
            keep = cdiv(hit_length, self.single_type_managers[g.group_ids[0]].block_size)
            for gid in g.group_ids:
                found = hit_blocks[gid]
                if found is not None:
                    del found[keep:]
        self.num_uncached_common_prefix_tokens = longest - hit_length
        return tuple(lst if lst is not None else [] for lst in hit_blocks), hit_length

    def _group_hit(
        self, group: SpecGroup, block_hashes: Sequence[BlockHash], max_length: int, drop: bool
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """One kind of group's longest hit up to ``max_length``. With the EAGLE drop (``drop``)
        an attention group matches one unit further, then drops it: back at the candidate."""
        spec, gids, cls = group.spec, group.group_ids, group.manager_cls
        if drop and not isinstance(spec, MambaSpec):
            fine = self.enable_partial_hash_hits and cls.supports_fine_grained_hash_lookup
            margin = eagle_proof_margin(self.single_type_managers[gids[0]].block_size, self.hash_block_size, fine)
            max_length = min(max_length + margin, len(block_hashes) * self.hash_block_size)
        return cls.find_longest_cache_hit(
            block_hashes,
            max_length,
            gids,
            self.single_type_managers[gids[0]].block_pool,
            spec,
            drop_eagle_block=drop,
            alignment_tokens=self._cache_hit_alignment_tokens,
        )

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each group's own longest hit, without the fixed point that makes them agree (vLLM
        0.33). Under block pressure a Mamba hybrid's groups diverge -- full attention's tail
        evicted while a deeper Mamba state survives, or the reverse -- and this shows by how
        much; vLLM's P2P connectors (nixl) start from full attention's hit and bring the
        lagging state themselves. An EAGLE group matches one unit further and drops it, as in
        ``find_longest_cache_hit``. Returns (blocks per group, hit length per group); a group
        that is never looked up (a ring) reports [] and 0."""
        n_groups = len(self.single_type_managers)
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(n_groups)]
        hit_lengths = [0] * n_groups
        for group in self.attention_groups:
            blocks, hit = self._group_hit(group, block_hashes, max_cache_hit_length, group.use_eagle)
            for gid, lst in zip(group.group_ids, blocks):
                hit_blocks[gid] = lst
                hit_lengths[gid] = hit
        return tuple(hit_blocks), tuple(hit_lengths)


def get_kv_cache_coordinator(
    specs: Sequence[KVCacheSpec],
    block_pool: BlockPool,
    enable_caching: bool,
    *,
    scheduler_block_size: int,
    hash_block_size: int,
    use_eagle: bool = False,
    max_model_len: int | None = None,
    max_in_flight_tokens: int | None = None,
    manager_classes: Mapping[type, type[SingleTypeKVCacheManager]] | None = None,
    eagle_group_ids: Collection[int] = (),
    prefix_cache_retention_interval: int | None = None,
    num_prefill_lookahead: int = 0,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    needs_kv_cache_zeroing: bool = False,
    hisparse_source_group_ids: Collection[int] = (),
) -> KVCacheCoordinator:
    kw = dict(
        hisparse_source_group_ids=hisparse_source_group_ids,
        needs_kv_cache_zeroing=needs_kv_cache_zeroing,
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        eagle_group_ids=eagle_group_ids,
        num_prefill_lookahead=num_prefill_lookahead,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        use_eagle=use_eagle,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        manager_classes=manager_classes,
    )
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(specs, block_pool, False, **kw)  # type: ignore[arg-type]  # kw holds the keyword arguments every coordinator takes
    if len(specs) == 1:
        return UnitaryKVCacheCoordinator(specs, block_pool, True, **kw)
    return HybridKVCacheCoordinator(specs, block_pool, True, **kw)
