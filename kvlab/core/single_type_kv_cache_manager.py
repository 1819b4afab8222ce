"""Per-group managers: one block table per request for one KV-cache group.

vLLM: ``vllm/v1/core/single_type_kv_cache_manager.py``. The group's spec decides two
things: which cached prefix counts as a hit, and which blocks a request may drop.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvlab.core.block_pool import BlockPool, group_suffix
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvlab.timeline.events import BlocksSkipped, BlocksTouched
from kvlab.utils.hashing import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        assert kv_cache_spec.block_size is not None
        self.kv_cache_spec = kv_cache_spec
        self.block_size: int = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self._null_block = block_pool.null_block
        # request id -> its block table for this group (append-only, except null padding).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its blocks are cached (have a hash in the map).
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free blocks needed to hold ``num_tokens``. A hit block that sits on the free queue
        (ref 0, evictable) counts too: adopting it takes it out of the free supply."""
        num_required = cdiv(num_tokens, self.block_size)
        have = len(new_computed_blocks) + len(self.req_to_blocks.get(request_id, ()))
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(0, num_required - have) + num_evictable

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Adopt a new request's prefix hits: touch them (before any allocation can evict
        them) and start its block table with them."""
        if request_id not in self.num_cached_block:
            blocks = self.req_to_blocks.setdefault(request_id, [])
            assert not blocks, "a new request already has blocks"
            pool = self.block_pool
            if pool.enable_caching and new_computed_blocks:
                pool.touch(new_computed_blocks)
                if pool.events is not None:
                    pool.events.emit(
                        BlocksTouched(request_id=request_id, group=self.kv_cache_group_id, block_ids=[b.block_id for b in new_computed_blocks])
                    )
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            assert not new_computed_blocks, "a running request cannot receive prefix hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new = self.block_pool.get_new_blocks(num_new, request_id=request_id, group=self.kv_cache_group_id)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache the request's blocks that ``num_tokens`` computed tokens have filled."""
        rid = request.request_id
        num_cached = self.num_cached_block[rid]
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[rid], num_cached, num_full, self.block_size, self.kv_cache_group_id
        )
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Give a finished or preempted request's blocks back, in :meth:`free_order`."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(self.free_order(blocks), request_id=request_id, group=self.kv_cache_group_id)
        self.num_cached_block.pop(request_id, None)

    @staticmethod
    def free_order(blocks: list[KVCacheBlock]) -> Iterable[KVCacheBlock]:
        """The order a table goes back to the pool, which is its eviction order: *tail
        first*, because the tail is the least reusable part of a prefix (lesson 04).
        (The free_order exercise swaps this in a subclass.)"""
        return reversed(blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks no future query can read with the null block, and free them."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        removed: list[KVCacheBlock] = []
        positions: list[int] = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is self._null_block:
                break  # everything before it was nulled by an earlier call
            removed.append(blocks[i])
            positions.append(i)
            blocks[i] = self._null_block
        if not removed:
            return
        events = self.block_pool.events
        if events is not None:
            events.emit(BlocksSkipped(request_id=request_id, group=self.kv_cache_group_id, positions=positions, block_ids=[b.block_id for b in removed]))
        self.block_pool.free_blocks(removed, request_id=request_id, group=self.kv_cache_group_id, reason="window")

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec):
        """Walk the chain from the first block and stop at the first miss."""
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_num_blocks = max_length // kv_cache_spec.block_size
        if len(kv_cache_group_ids) == 1:  # the common case, without the per-group zip
            out = computed[0]
            get = block_pool.cached_block_hash_to_block.get_one_block
            suffix = group_suffix(kv_cache_group_ids[0])
            for h in block_hashes[:max_num_blocks]:
                blk = get(h + suffix)
                if blk is None:
                    break
                out.append(blk)
            return computed
        for h in block_hashes[:max_num_blocks]:
            hit = block_pool.get_cached_block(h, kv_cache_group_ids)
            if hit is None:
                break
            for lst, blk in zip(computed, hit):
                lst.append(blk)
        return computed


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec):
        """A hit needs only the blocks the *next* token's window reads: ``cdiv(W - 1,
        block_size)`` contiguous cached blocks ending at the hit length. Search right to
        left; blocks before the run are padded with the null block."""
        contiguous_needed = cdiv(kv_cache_spec.sliding_window - 1, kv_cache_spec.block_size)
        max_num_blocks = max_length // kv_cache_spec.block_size
        null = block_pool.null_block
        computed = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(max_num_blocks - 1, -1, -1):
            hit = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if hit is not None:
                for lst, blk in zip(computed, hit):
                    lst[i] = blk
                run += 1
                if run >= contiguous_needed:
                    for lst in computed:
                        del lst[i + run :]
                    found = True
                    break
            else:
                run = 0
        if not found:
            # Only a run starting at block 0 is usable when it is shorter than needed
            # (nothing before it was ever in the window).
            for lst in computed:
                del lst[run:]
        return computed


MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}
