"""vLLM 0.33's core pieces for KV connectors and its classmethod shapes, with the values vLLM
0.33.0 itself gives (each scenario below was run on vLLM's own ``KVCacheManager`` and on
kvlab's, and printed the same block ids):

* Mamba "align" boundary states handed to a connector (``take_boundary_state_offloads``,
  ``finalize_partial_tail_offloads``): a state table is not append-only, so the manager says
  which block holds which state;
* ``pop_blocks_for_free`` and ``truncate_computed_blocks`` on the manager;
* ``reachable_block_mask`` as a classmethod of its arguments only;
* ``Scheduler._mamba_block_aligned_split`` reading only the scheduler's own settings;
* ``coordinator.retention_interval`` set after construction;
* decode context parallelism (``dcp_world_size``): a sharded group's block covers
  ``block_size x dcp`` tokens.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvlab import KVCacheManager, Request
from kvlab.core.kv_cache_manager import KVCacheBlocks
from kvlab.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    KVCacheBlock,
    generate_block_hash_extra_keys,
    generate_scheduler_kv_cache_config,
    get_none_hash_seed,
    init_none_hash,
    null_head_len,
    resolve_block_hashes,
    resolve_dcp_kv_cache_spec,
)
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.single_type_kv_cache_manager import MambaManager, SlidingWindowManager
from kvlab.distributed.kv_events import BlockStored
from kvlab.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    is_full_attention_spec,
    iter_layer_specs,
)
from kvlab.utils.hashing import sha256


def _manager(num_blocks: int = 24, full_bs: int = 2, mamba_bs: int = 4, hash_bs: int = 2) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=full_bs)),
            KVCacheGroupSpec(["mamba"], MambaSpec(block_size=mamba_bs, shapes=(1, 1), dtypes=("float32",), mamba_cache_mode="align")),
        ],
    )
    return KVCacheManager(config, max_model_len=8192, enable_caching=True, hash_block_size=hash_bs)


def _start(m: KVCacheManager, rid: str, tokens: list[int], n: int) -> Request:
    r = Request(rid, tokens, max_tokens=8)
    hits, num_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, n, num_hit, hits) is not None
    return r


# -- boundary states for a connector -----------------------------------------------------------
def test_a_state_saved_inside_a_block_is_offered_as_its_copy():
    """Hash blocks of 2, Mamba blocks of 4, prompt of 7: the state after token 6 is saved inside
    the request's second state block (id 4). The next step keeps writing into block 4, so the
    cache entry moves to a copy (block 6) -- and that copy is what the connector is offered."""
    m = _manager()
    r = _start(m, "0", [0, 0, 1, 1, 2, 2, 3], 6)
    assert m.take_boundary_state_offloads() == {}  # nothing saved on a state block's end yet
    assert m.get_block_ids("0") == ([1, 2, 3], [0, 4])
    r.num_computed_tokens = 6
    r.append_output_token_ids([3])
    assert m.allocate_slots(r, 1) is not None
    assert m.take_boundary_state_offloads() == {"0": [(1, 6, 6)]}  # (group, the copy, 6 tokens)
    assert m.take_boundary_state_offloads() == {}  # drained
    copies, retained = m.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [(4, 6)]
    assert [b.block_id for b in retained] == [4, 6]
    assert m.finalize_partial_tail_offloads(r) == []  # the copy already handed it over
    m.block_pool.free_blocks(retained)


def test_a_request_that_finishes_first_hands_over_its_own_block_once():
    m = _manager()
    r = _start(m, "0", [0, 0, 1, 1, 2, 2, 3], 6)
    r.num_computed_tokens = 6
    assert m.finalize_partial_tail_offloads(r) == [(1, 4, 6)]
    assert m.finalize_partial_tail_offloads(r) == []
    assert m.take_boundary_state_offloads() == {}


def test_a_block_computed_past_its_state_is_not_handed_over():
    m = _manager()
    r = _start(m, "0", [0, 0, 1, 1, 2, 2, 3], 6)
    r.num_computed_tokens = 7  # the block now holds the state after token 7, not 6
    assert m.finalize_partial_tail_offloads(r) == []
    m2 = _manager()
    r2 = _start(m2, "1", [0, 0, 1, 1, 2, 2, 3], 6)
    assert r2.num_in_flight_tokens == 0  # kvlab's steps run one after the other
    r2.num_computed_tokens, r2.num_in_flight_tokens = 6, 1  # vLLM's asynchronous scheduling: a step in flight
    assert m2.finalize_partial_tail_offloads(r2) == []
    assert m2.finalize_partial_tail_offloads(r2) == []  # consumed all the same


def test_every_state_kept_for_reuse_is_offered_with_its_block():
    """Blocks of 4 (hash and Mamba), a 13-token prompt in chunks of 4: each chunk's state."""
    m = _manager(num_blocks=40, full_bs=4, mamba_bs=4, hash_bs=4)
    r = Request("c", list(range(13)), max_tokens=8)
    hits, num_hit = m.get_computed_blocks(r)
    offers = []
    for step in range(3):
        m.new_step_starts()
        first = step == 0
        assert m.allocate_slots(r, 4, num_hit if first else 0, hits if first else None) is not None
        r.num_computed_tokens += 4
        offers.append(m.take_boundary_state_offloads())
    assert offers == [{"c": [(1, 2, 4)]}, {"c": [(1, 4, 8)]}, {"c": [(1, 6, 12)]}]
    assert m.get_block_ids("c") == ([1, 3, 5], [0, 4, 6])


def test_offers_of_a_freed_request_are_dropped():
    """Its blocks go back to the pool: an offer drained later would name another's state."""
    tokens = [0, 0, 1, 1, 2, 2, 3, 3, 4]
    kept = _manager()
    _start(kept, "0", tokens, 8)
    assert kept.take_boundary_state_offloads() == {"0": [(1, 5, 8)]}  # the chunk's state, on its block's end
    m = _manager()
    m.free(_start(m, "0", tokens, 8))
    assert m.take_boundary_state_offloads() == {}


def test_pure_attention_offers_nothing():
    m = KVCacheManager(num_blocks=10, kv_cache_groups=[FullAttentionSpec(block_size=4)])
    r = Request("a", list(range(9)), max_tokens=4)
    hits, n = m.get_computed_blocks(r)
    m.allocate_slots(r, 9, n, hits)
    r.num_computed_tokens = 9
    assert m.take_boundary_state_offloads() == {} and m.finalize_partial_tail_offloads(r) == []


# -- pop_blocks_for_free, truncate_computed_blocks ----------------------------------------------
def test_pop_blocks_for_free_leaves_the_freeing_to_the_caller():
    m = KVCacheManager(num_blocks=10, kv_cache_groups=[FullAttentionSpec(block_size=4)])
    r = Request("a", list(range(9)), max_tokens=4)
    hits, n = m.get_computed_blocks(r)
    m.allocate_slots(r, 9, n, hits)
    free_before = m.block_pool.get_num_free_blocks()
    blocks = m.pop_blocks_for_free(r)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert m.get_block_ids("a") == ([],) and m.block_pool.get_num_free_blocks() == free_before
    m.block_pool.free_blocks(reversed(blocks))
    assert m.block_pool.get_num_free_blocks() == free_before + 3
    with pytest.raises(TypeError, match="request must be a kvlab.Request, got str 'a'"):
        m.pop_blocks_for_free("a")  # type: ignore[arg-type]


def test_truncate_computed_blocks_cuts_every_group_and_leaves_a_short_mamba_group():
    m = _manager(num_blocks=40, full_bs=4, mamba_bs=4, hash_bs=4)
    r = _start(m, "p", list(range(13)), 12)
    r.num_computed_tokens = 12
    m.free(r)
    hits, n = m.get_computed_blocks(Request("q", list(range(13)), max_tokens=4))
    assert n == 12 and hits.get_block_ids() == ([1, 2, 3], [0, 0, 4])
    refs = [b.ref_cnt for b in hits.blocks[0]]
    cut = m.truncate_computed_blocks(hits, 8)
    assert cut.get_block_ids() == ([1, 2], [0, 0])
    assert hits.get_block_ids() == ([1, 2, 3], [0, 0, 4]) and [b.ref_cnt for b in hits.blocks[0]] == refs  # untouched
    short = type(hits)(([*hits.blocks[0]], hits.blocks[1][:1]))
    assert m.truncate_computed_blocks(short, 12).get_block_ids() == ([1, 2, 3], [0])  # a Mamba group may be shorter
    # vLLM asserts both; kvlab's error is a ValueError and an AssertionError, so either except catches it
    with pytest.raises(AssertionError, match="num_computed_tokens must be a multiple of group 0's block size 4, got 6") as e:
        m.truncate_computed_blocks(hits, 6)
    assert isinstance(e.value, ValueError)
    with pytest.raises(AssertionError, match="num_computed_tokens = 16 needs 4 blocks of group 0, the lookup found 3") as e:
        m.truncate_computed_blocks(hits, 16)
    assert isinstance(e.value, ValueError)


# -- reachable_block_mask as vLLM's classmethod --------------------------------------------------
def test_reachable_block_mask_is_a_function_of_its_arguments():
    sw = SlidingWindowSpec(block_size=4, sliding_window=8)
    T, F = True, False
    assert SlidingWindowManager.reachable_block_mask(0, 12, 16, sw, False) == [F, F, T, T] * 3
    # retention 32: one tail per 8 blocks, plus the tail before a replay boundary at 40
    assert SlidingWindowManager.reachable_block_mask(0, 12, 16, sw, False, 32, (40,)) == [F] * 6 + [T, T] + [F] * 4
    # the last, shorter segment (ending at block 11) keeps its tail too -- not with EAGLE
    assert SlidingWindowManager.reachable_block_mask(0, 12, 16, sw, False, 32, (), 1, 11) == [F] * 6 + [T, T, F, T, T, F]
    assert SlidingWindowManager.reachable_block_mask(0, 12, 16, sw, True, 32, (), 1, 11) == [F] * 6 + [T, T, T, F, F, F]
    assert SlidingWindowManager.reachable_block_mask(0, 12, 6, sw, False) is None  # alignment not a block multiple
    assert SlidingWindowManager.reachable_block_mask(0, 12, None, sw, False) is None
    ms = MambaSpec(block_size=4, shapes=(1, 1), dtypes=("float32",))
    assert MambaManager.reachable_block_mask(0, 10, 4, ms, False, 16, (29,)) == [F, F, F, T, F, F, T, T, F, F]
    assert MambaManager.reachable_block_mask(0, 10, 4, ms, False, 0, (29,)) == [F] * 6 + [T] + [F] * 3
    assert MambaManager.reachable_block_mask(0, 10, 4, ms, False, None, (29,)) is None


def test_retention_set_on_the_coordinator_reaches_every_group():
    m = _manager(num_blocks=40, full_bs=4, mamba_bs=4, hash_bs=4)
    m.coordinator.retention_interval = 0
    assert [g.retention_interval for g in m.coordinator.single_type_managers] == [0, 0]
    with pytest.raises(ValueError, match=r"prefix_cache_retention_interval \(6\) must be non-negative and a multiple of"):
        m.coordinator.retention_interval = 6
    assert m.coordinator.retention_interval == 0  # unchanged by the refusal


# -- the Mamba chunk split, vLLM's shape ----------------------------------------------------------
def _split_self(**over):
    base = dict(
        cache_config=SimpleNamespace(block_size=512),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        max_num_scheduled_tokens=8192,
        hash_block_size=32,
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,
        mamba_partial_cache_hit=True,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
    )
    base.update(over)
    return SimpleNamespace(**base)


def test_the_split_starts_after_the_new_local_and_external_hits():
    r = Request("s", list(range(1, 2001)), max_tokens=4)
    split = Scheduler._mamba_block_aligned_split
    # from 0: the last block boundary before the prompt's end (1536), then the hash-aligned tail
    assert split(_split_self(), r, 8192) == 1536  # type: ignore[arg-type]
    assert split(_split_self(), r, 8192, 1536) == 1984 - 1536  # type: ignore[arg-type]
    assert split(_split_self(), r, 8192, 1024, 512) == 1984 - 1536  # type: ignore[arg-type]  # local + external
    r.num_computed_tokens = 1984
    assert split(_split_self(), r, 16) == 16  # type: ignore[arg-type]  # the prompt's last chunk ends anywhere
    # a block wider than the chunk limit: the chunk runs sub-block instead of stopping at 0
    r.num_computed_tokens = 0
    assert split(_split_self(max_num_scheduled_tokens=256), r, 256) == 256  # type: ignore[arg-type]


def test_a_scheduler_carries_the_settings_the_split_reads():
    m = _manager(num_blocks=40, full_bs=4, mamba_bs=8, hash_bs=4)
    s = Scheduler(m, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    assert (s.cache_config.block_size, s.hash_block_size, s.use_eagle_block_drop, s.num_hash_lookahead_tokens) == (8, 4, False, 0)
    assert (s.scheduler_config.long_prefill_token_threshold, s.scheduler_config.max_num_batched_tokens) == (16, 64)
    assert s.mamba_partial_cache_hit is True


# -- decode context parallelism ----------------------------------------------------------------
def test_a_sharded_group_counts_in_blocks_of_block_size_times_dcp():
    """Blocks of 4 tokens on each of 2 ranks: the manager's block holds 8, and so do its
    hashes, hits and events (vLLM 0.33 gives the same ids and event)."""
    config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4))]
    )
    m = KVCacheManager(config, max_model_len=8192, hash_block_size=8, scheduler_block_size=8, dcp_world_size=2, enable_kv_cache_events=True)
    group = m.coordinator.single_type_managers[0]
    assert (group.block_size, group.dcp_world_size) == (8, 2)
    r = _start(m, "a", list(range(20)), 20)
    r.num_computed_tokens = 20
    assert m.get_block_ids("a") == ([1, 2, 3],)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [(e.block_size, len(e.token_ids)) for e in stored] == [(8, 16)]
    m.free(r)
    hits, n = m.get_computed_blocks(Request("b", list(range(20)) + [7, 7, 7], max_tokens=4))
    assert (n, hits.get_block_ids()) == (16, ([1, 2],))
    # A full report of that hit is published in the manager's 8-token blocks. (vLLM 0.33 hands
    # its pool the spec's 4-token block size against 8-token hashes and fails an assert.)
    m.take_events()
    full = Request("c", list(range(20)) + [7, 7, 7], max_tokens=4, kv_cache_report_mode="full")
    hits, n = m.get_computed_blocks(full)
    assert (n, hits.get_block_ids()) == (16, ([1, 2],))
    assert [(e.block_size, len(e.block_hashes), e.token_ids) for e in m.take_events()] == [(8, 2, list(range(16)))]


def test_dcp_geometry_is_per_group():
    """A sharded target, a replicated MLA draft and a (always replicated) Mamba group."""
    config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4)),
            KVCacheGroupSpec(["draft"], MLAAttentionSpec(block_size=4, dcp_sharded=False)),
            KVCacheGroupSpec(["mamba"], MambaSpec(block_size=8, shapes=(1, 1), dtypes=("float32",), mamba_cache_mode="align")),
        ],
    )
    m = KVCacheManager(config, max_model_len=8192, hash_block_size=4, scheduler_block_size=8, dcp_world_size=2)
    assert [(g.block_size, g.dcp_world_size) for g in m.coordinator.single_type_managers] == [(8, 2), (4, 1), (8, 1)]
    # the Mamba block equals the hash block, but under DCP that still allows partial hits
    assert m.coordinator.enable_partial_hash_hits
    r = Request("a", list(range(26)), max_tokens=4)
    hits, n = m.get_computed_blocks(r)
    for step in range(4):
        m.new_step_starts()
        k = min(8, 26 - r.num_computed_tokens)
        assert m.allocate_slots(r, k, n if step == 0 else 0, hits if step == 0 else None) is not None
        r.num_computed_tokens += k
    assert m.get_block_ids("a") == ([1, 5, 9, 13], [2, 3, 6, 7, 10, 11, 14], [0, 0, 12, 15])
    m.free(r)
    m.new_step_starts()
    hits, n = m.get_computed_blocks(Request("b", list(range(26)) + [9, 9, 9], max_tokens=4))
    assert (n, hits.get_block_ids()) == (24, ([1, 5, 9], [2, 3, 6, 7, 10, 11], [0, 0, 12]))


# -- the config layer: merge, drafts, wrappers, transfer groups -----------------------------------
def test_merge_keeps_one_spec_and_refuses_layers_that_differ():
    full = FullAttentionSpec(block_size=16, num_kv_heads=32)
    assert FullAttentionSpec.merge([full, full]) == full
    assert FullAttentionSpec.merge([full, FullAttentionSpec(block_size=16, num_kv_heads=32, sliding_window=4)]).sliding_window == 4
    with pytest.raises(AssertionError, match="must be the same"):
        FullAttentionSpec.merge([full, FullAttentionSpec(block_size=16, num_kv_heads=16)])
    with pytest.raises(AssertionError, match="must be FullAttentionSpec"):
        FullAttentionSpec.merge([full, SlidingWindowSpec(block_size=16, num_kv_heads=32, sliding_window=1)])
    with pytest.raises(ValueError, match=r"same window size, got sliding_window \[1, 2\]"):
        FullAttentionSpec.merge([full, replace(full, sliding_window=1), replace(full, sliding_window=2)])
    mla = MLAAttentionSpec(block_size=16)
    assert MLAAttentionSpec.merge([mla, mla]) is mla
    with pytest.raises(AssertionError, match="must be MLAAttentionSpec"):
        MLAAttentionSpec.merge([mla, full])


def test_a_draft_layer_shares_its_targets_group():
    target = FullAttentionSpec(block_size=16)
    draft = replace(target, is_draft=True)
    assert draft == target and hash(draft) == hash(target) and draft.is_draft
    assert FullAttentionSpec.merge([target, draft]) == target


def test_uniform_type_specs_wrap_layers_that_need_the_same_slots():
    a, b = FullAttentionSpec(block_size=16), FullAttentionSpec(block_size=16, head_size=128)
    wrapped = UniformTypeKVCacheSpecs.from_specs({"l1": a, "l2": b})
    assert wrapped == UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l1": a, "l2": b})
    assert wrapped.page_size_bytes == a.page_size_bytes + b.page_size_bytes == 4096 + 8192
    assert iter_layer_specs(wrapped) == (a, b) and iter_layer_specs(a) == (a,)
    assert is_full_attention_spec(wrapped) and get_kv_cache_spec_kind(wrapped) == "full_attention"
    swa = SlidingWindowSpec(block_size=16, sliding_window=1)
    assert UniformTypeKVCacheSpecs.from_specs({"l1": a, "l2": swa}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"l1": swa, "l2": replace(swa, sliding_window=2)}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"l1": a, "l2": replace(a, block_size=32)}) is None
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l1": a, "l2": swa})
    assert not is_full_attention_spec(mixed) and get_kv_cache_spec_kind(mixed) == "unknown"
    assert get_kv_cache_spec_sliding_window(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"x": swa, "y": swa})) == 1
    # under DCP the wrapper and its layers grow together; a replicated Mamba wrapper does not
    scaled = resolve_dcp_kv_cache_spec(wrapped, 4)
    assert scaled.block_size == 64 and [s.block_size for s in scaled.kv_cache_specs.values()] == [64, 64]
    mamba = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"m": MambaSpec(block_size=4, shapes=((4, 1),), dtypes=("float32",))})
    assert resolve_dcp_kv_cache_spec(mamba, 4) is mamba
    assert KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m"], mamba)]).needs_kv_cache_zeroing


def test_the_scheduler_config_unwraps_a_group_of_uniform_layers():
    a, b = FullAttentionSpec(block_size=16), FullAttentionSpec(block_size=16, head_size=128)
    worker = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l1", "l2"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l1": a, "l2": b}))],
    )
    assert generate_scheduler_kv_cache_config([worker]) == KVCacheConfig(
        num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l1", "l2"], a)]
    )
    assert isinstance(worker.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)  # the workers' own is left alone
    with pytest.raises(AssertionError, match=r"kv_cache_configs\[1\] has 12 blocks, kv_cache_configs\[0\] 10"):
        generate_scheduler_kv_cache_config([worker, replace(worker, num_blocks=12)])
    # a manager built from the workers' config does the same (vLLM's keyword for it too)
    m = KVCacheManager(kv_cache_config=worker, max_model_len=64)
    assert m.kv_cache_groups == [a]


def test_transfer_groups_leave_out_what_a_connector_does_not_move():
    full = FullAttentionSpec(block_size=4)
    ring = CircularBufferSpec(block_size=4)
    groups = [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["q"], ring), KVCacheGroupSpec(["b"], full, enable_kv_transfer=False)]
    config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)
    assert config.transfer_group_ids == (0, 1) and config.transfer_groups == (groups[0], groups[1])
    assert config.transfer_group_index_by_layer == {"a": 0, "q": 1}
    assert config.prefix_cacheable_group_ids == (0,) and config.prefix_cacheable_groups == (groups[0],)
    assert config.select_transfer_block_ids(([1], [2], [3])) == ([1], [2])
    with pytest.raises(ValueError, match=r"one list per KV cache group \(3\), got 2"):
        config.select_transfer_block_ids(([1], [2]))


def test_block_lists_by_group_and_without_their_null_head():
    pool_blocks = [KVCacheBlock(i) for i in range(4)]
    null = KVCacheBlock(0)
    null.is_null = True
    blocks = KVCacheBlocks(([pool_blocks[1]], [pool_blocks[2]], [pool_blocks[3]]))
    assert blocks.get_block_ids(group_ids=(0, 2)) == ([1], [3])
    assert null_head_len([]) == 0 and null_head_len([null, null, pool_blocks[1], null]) == 2
    table = KVCacheBlocks(([null] * 2 + pool_blocks[1:], [null, pool_blocks[1], null]))
    assert table.get_unhashed_block_ids_all_groups() == [[1, 2, 3], [1]]


def test_the_none_hash_seed_is_reported(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(sha256)
    assert get_none_hash_seed() == "vllm-none-hash"
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    init_none_hash(sha256)
    assert get_none_hash_seed() == "12345"
    monkeypatch.delenv("PYTHONHASHSEED")
    init_none_hash(sha256)


def test_resolve_block_hashes_keeps_the_raw_list_for_fine_grained_hits():
    raw = [bytes([i]) for i in range(8)]
    assert resolve_block_hashes(raw, 2, 2, alignment_tokens=2) is raw
    assert resolve_block_hashes(raw, 2, 4, supports_fine_grained_hash_lookup=True, alignment_tokens=2) is raw
    view = resolve_block_hashes(raw, 2, 4, supports_fine_grained_hash_lookup=True, alignment_tokens=4)
    assert isinstance(view, BlockHashListWithBlockSize) and len(view) == 4
    assert resolve_block_hashes(view, 2, 4) is view
    with pytest.raises(AssertionError, match="already a view at 2 hash blocks per block, not 4"):
        resolve_block_hashes(view, 2, 8)


def test_a_lora_request_set_after_construction():
    r = Request("a", [1, 2, 3], max_tokens=2)
    assert r.lora_request is None
    r.lora_request = SimpleNamespace(lora_name="adapter", lora_int_id=1, lora_path="/p")
    assert (r.lora_name, r.lora_int_id, r.lora_path, r.lora_request.adapter_id) == ("adapter", 1, "/p", 1)
    assert generate_block_hash_extra_keys(r, 0, 3) == (("lora", "adapter", "/p"),)
    with pytest.raises(ValueError, match="lora_int_id=0 is out of range"):
        r.lora_request = SimpleNamespace(lora_name="other", lora_int_id=0, lora_path=None)
    assert r.lora_name == "adapter"  # unchanged by the refusal
    r.lora_request = None
    assert generate_block_hash_extra_keys(r, 0, 3) is None


def test_the_publisher_class_carries_the_endpoint_offset():
    from kvlab.distributed.kv_publisher import ZmqEventPublisher

    assert ZmqEventPublisher.offset_endpoint_port("tcp://*:5557", 1) == "tcp://*:5558"
    assert ZmqEventPublisher.offset_endpoint_port("tcp://*:0", 1) == "tcp://*:0"  # the OS picks each rank's port
    assert ZmqEventPublisher.offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"


def test_a_wildcard_ephemeral_endpoint_binds_this_nodes_ip_and_reports_the_port(monkeypatch):
    """vLLM 0.33: tcp://*:0 binds a free port on this node's IP (get_ip, looked up on
    kv_events: VLLM_HOST_IP, else the routed interface) and reports it; an IP a subscriber
    cannot reach (0.0.0.0) is refused."""
    from kvlab.distributed import kv_events
    from kvlab.distributed.kv_publisher import ZmqEventPublisher
    from kvlab.utils.network_utils import get_ip

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    assert get_ip() == "127.0.0.1"
    pub = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        for ep in (pub.endpoint, pub.replay_endpoint):
            host, port = ep.removeprefix("tcp://").rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
        assert pub.endpoint != pub.replay_endpoint and pub.get_publisher_config().endpoint == pub.endpoint
    finally:
        pub.shutdown()
    monkeypatch.setattr(kv_events, "get_ip", lambda: "0.0.0.0")
    with pytest.raises(ValueError, match=r"endpoint tcp://\*:0 needs a node IP; set VLLM_HOST_IP"):
        ZmqEventPublisher(endpoint="tcp://*:0")


def test_a_step_whose_connector_raises_gives_its_boundary_state_offers_back():
    """The scheduler drains the step's Mamba offers before ``build_connector_meta``; when that
    hook raises, the step is undone -- offers included: the step run again hands the connector
    the same states, in the same blocks, as a step that never failed."""
    from kvlab import LLMEngine, SimulatedExecutor
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from scheduler_side_connector import SchedulerSideConnector

    seen: list[dict] = []  # outside the connector: the undone step restores the connector too
    failures: list[bool] = []

    class Seen(SchedulerSideConnector):
        def build_connector_meta(self, scheduler_output):
            seen.append({r: list(v) for r, v in scheduler_output.kv_connector_block_state.boundary_state_offloads.items()})
            if failures and failures.pop():
                raise RuntimeError("a learner's hook")
            return super().build_connector_meta(scheduler_output)

    def run(fail_first: bool) -> tuple[list[dict], tuple[list[int], ...]]:
        seen.clear()
        failures[:] = [fail_first]
        m = _manager(num_blocks=40, full_bs=4, mamba_bs=4, hash_bs=4)
        eng = LLMEngine(m, Scheduler(m, connector=Seen(KVConnectorRole.SCHEDULER)), SimulatedExecutor())
        eng.add_request(Request("c", list(range(9)), max_tokens=2))
        if fail_first:
            with pytest.raises(RuntimeError, match="a learner's hook"):
                eng.step()
            assert m.take_boundary_state_offloads() == {}  # the undone step's allocation made none
            assert m.get_block_ids("c") == ([], [])
        eng.step()
        return list(seen), m.get_block_ids("c")

    clean, clean_ids = run(False)
    offers, ids = run(True)
    assert clean == [{"c": [(1, 3, 8)]}]  # the 9-token prompt's state after 8 tokens, on its block's end
    assert offers == [clean[0], clean[0]]  # seen by the failing call, then again by the step run again
    assert ids == clean_ids == ([1, 2], [0, 3])  # "align" mode ends the first chunk on a block edge
