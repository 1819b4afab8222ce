"""The coordinator: one KV-cache manager per group, one pool for all (lesson 07).

vLLM: ``vllm/v1/core/kv_cache_coordinator.py``. With one group it just forwards. With a
full-attention group and a sliding-window group (a hybrid model) a prefix hit must be a
hit for *both*: the full-attention hit bounds the search, the sliding-window rule picks a
length inside it, and the full-attention hit is cut back to that length.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.core.single_type_kv_cache_manager import (
    MANAGER_FOR_SPEC,
    SingleTypeKVCacheManager,
)
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from kvlab.utils.hashing import BlockHash


class KVCacheCoordinator:
    """One single-type manager per KV-cache group, over one shared block pool (vLLM:
    ``vllm/v1/core/kv_cache_coordinator.py``; lesson 07).

    Why a coordinator: a hybrid model has layers that attend to everything and layers that
    see only a sliding window. Each kind keeps its own block table per request (the window
    group may drop blocks that left the window and pad with the null block), yet all tables
    draw from one pool, and a prefix hit is usable only if *every* group has it. The
    coordinator is where "every group" is spelled out: allocation goes group by group, and
    the longest hit is the full-attention hit cut back to what the other group can serve.
    kvlab supports one attention type, or full attention plus one other, as vLLM's hybrid
    coordinator does.
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        block_pool: BlockPool,
        enable_caching: bool,
        manager_classes: Mapping[type, type[SingleTypeKVCacheManager]] | None = None,
    ) -> None:
        self.block_pool = block_pool
        self.specs = list(specs)
        self.enable_caching = enable_caching
        # spec type -> manager class; ``manager_classes`` overrides some (a seam: the
        # exercises run a learner's free order or block count in a manager subclass).
        self.manager_for_spec: dict[type, type[SingleTypeKVCacheManager]] = {**MANAGER_FOR_SPEC, **(manager_classes or {})}
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            self.manager_for_spec[type(spec)](spec, block_pool, gid) for gid, spec in enumerate(specs)
        )
        # Groups with equal specs are looked up together (one hit = a block in each group).
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for gid, spec in enumerate(specs):
            by_spec.setdefault(spec, []).append(gid)
        self._spec_groups = list(by_spec.items())
        if len(self._spec_groups) > 2 or (
            len(self._spec_groups) == 2 and not any(isinstance(s, FullAttentionSpec) for s, _ in self._spec_groups)
        ):
            raise ValueError(
                "kv_cache_groups: kvlab supports one attention type, or full attention plus ONE other "
                f"type (as vLLM's hybrid coordinator); got {[s for s, _ in self._spec_groups]}"
            )

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        if len(self._spec_groups) == 1:
            spec, gids = self._spec_groups[0]
            cls = self.manager_for_spec[type(spec)]
            hit = cls.find_longest_cache_hit(block_hashes, max_cache_hit_length, gids, self.block_pool, spec)
            return self._order(((gids, hit),)), len(hit[0]) * spec.block_size  # type: ignore[operator]
        (full_spec, full_gids), (other_spec, other_gids) = sorted(
            self._spec_groups, key=lambda sg: not isinstance(sg[0], FullAttentionSpec)
        )
        full_hit = self.manager_for_spec[FullAttentionSpec].find_longest_cache_hit(
            block_hashes, max_cache_hit_length, full_gids, self.block_pool, full_spec
        )
        hit_length = len(full_hit[0]) * full_spec.block_size  # type: ignore[operator]
        other_hit = self.manager_for_spec[type(other_spec)].find_longest_cache_hit(
            block_hashes, hit_length, other_gids, self.block_pool, other_spec
        )
        hit_length = len(other_hit[0]) * other_spec.block_size  # type: ignore[operator]
        for lst in full_hit:
            del lst[hit_length // full_spec.block_size :]  # type: ignore[operator]
        return self._order(((full_gids, full_hit), (other_gids, other_hit))), hit_length

    def _order(self, parts: Sequence[tuple[Sequence[int], tuple[list[KVCacheBlock], ...]]]) -> tuple[list[KVCacheBlock], ...]:
        out: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        for gids, hits in parts:
            for gid, lst in zip(gids, hits):
                out[gid] = lst
        return tuple(out)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
            for i, m in enumerate(self.single_type_managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        for i, m in enumerate(self.single_type_managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Group by group: group 0 takes its blocks from the queue head, then group 1, ..."""
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.single_type_managers)
