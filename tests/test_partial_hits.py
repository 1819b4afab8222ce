"""Fine-grained partial hits and copy-on-write (vLLM 0.33).

On a Mamba hybrid whose blocks are larger than the hash block (``prefix_match_unit``), a
prefix hit may end *inside* a block: the prompt's last hash boundary is saved as a partial
key of the block that holds it, in the full-attention group (its K/V) and in the Mamba
group (the state after exactly that many tokens). A later request that hits there shares
the block's first tokens but must write the rest, so it gets a private copy of that block
(``_apply_cow``); a request that saved a Mamba state inside a block and goes on writing it
hands the cache entry to a copy instead (``move_block_hashes``). The copies reach the
runner as ``SchedulerOutput.kv_cache_block_copies``.

Every expected value below was first produced by vLLM 0.33.0's own ``KVCacheManager`` with
the same calls (the unpacked release wheel, sha256_cbor hashes), and kvlab's equals it.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec
from kvlab.core.kv_cache_utils import KVCacheBlockCopy
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.transaction import checkpoint_manager, restore_manager
from kvlab.engine.llm_engine import build_engine
from kvlab.eventlog.events import EventLog
from replay_check import run_replaying

HYBRID = [FullAttentionSpec(block_size=8), MambaSpec(block_size=8)]


def manager(**kw) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=16,
        kv_cache_groups=HYBRID,
        enable_kv_cache_events=True,
        hash_algo="sha256_cbor",
        max_model_len=64,
        prefix_match_unit=4,
        **kw,
    )


def ids(blocks) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


def free_queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def step(m: KVCacheManager, r: Request, n: int, first: bool = False) -> dict:
    """One allocation as a scheduler step makes it: new step, (lookup,) allocate, hand the
    copies to the runner and let their blocks go."""
    m.new_step_starts()
    hit = None
    if first:
        blocks, hit = m.get_computed_blocks(r)
        got = m.allocate_slots(r, n, hit, blocks)
        r.num_computed_tokens = hit + n
    else:
        got = m.allocate_slots(r, n)
        r.num_computed_tokens += n
    assert got is not None
    copies, retained = m.take_kv_cache_block_copies()
    refs = [b.ref_cnt for b in retained]
    m.block_pool.free_blocks(retained)
    events = [(type(e).__name__, e.block_size, e.group_idx) for e in m.take_events()]
    return dict(
        hit=hit,
        new=ids(got),
        table=ids(m.get_blocks(r.request_id)),
        copies=[(c.src_block_id, c.dst_block_id) for c in copies],
        retained_refs=refs,
        events=events,
        free=free_queue(m),
    )


def test_the_settings_that_turn_partial_hits_on_as_in_vllm() -> None:
    on = manager()
    assert on.coordinator.enable_partial_hash_hits and on.hash_block_size == 4
    assert [x.cache_hit_alignment_tokens for x in on.coordinator.single_type_managers] == [4, 4]
    # Hash blocks as large as the Mamba block: hits stay on block boundaries.
    same = KVCacheManager(num_blocks=16, kv_cache_groups=HYBRID)
    assert not same.coordinator.enable_partial_hash_hits and same.hash_block_size == 8
    # A window group of the hash block size can end a hit anywhere too ...
    swa4 = [FullAttentionSpec(block_size=8), SlidingWindowSpec(block_size=4, sliding_window=16), MambaSpec(block_size=8)]
    assert KVCacheManager(num_blocks=16, kv_cache_groups=swa4, prefix_match_unit=4).coordinator.enable_partial_hash_hits


def test_a_window_group_with_larger_blocks_turns_them_off_with_vllms_warning(caplog) -> None:
    swa8 = [FullAttentionSpec(block_size=8), SlidingWindowSpec(block_size=8, sliding_window=16), MambaSpec(block_size=8)]
    with caplog.at_level(logging.WARNING, logger="kvlab.kv_cache"):
        m = KVCacheManager(num_blocks=16, kv_cache_groups=swa8, prefix_match_unit=4)
    assert not m.coordinator.enable_partial_hash_hits
    assert [x.cache_hit_alignment_tokens for x in m.coordinator.single_type_managers] == [8, 8, 8]
    assert (
        "Disabling fine-grained prefix-cache hits because these KV cache managers require block-aligned lookups: SlidingWindowManager."
        in caplog.text
    )


def test_a_prompt_saved_inside_a_block_is_hit_there_and_copied() -> None:
    """a (14 tokens) runs in the chunks vLLM's scheduler gives it: to the block boundary 8,
    to its last hash boundary 12, then the rest. b shares a's first 12 tokens."""
    m = manager()
    a = Request("a", list(range(14)), max_tokens=4)
    s1 = step(m, a, 8, first=True)
    assert (s1["hit"], s1["table"], s1["events"]) == (0, [[1], [2]], [("BlockStored", 8, 0), ("BlockStored", 8, 1)])
    s2 = step(m, a, 4)
    # Token 12 is inside block 1: each group saves it as a partial key (one hash block).
    assert (s2["table"], s2["copies"], s2["events"]) == ([[1, 3], [2, 4]], [], [("BlockStored", 4, 0), ("BlockStored", 4, 1)])
    s3 = step(m, a, 2)
    # a goes on writing its Mamba state into block 4: the key moves to a copy (5), no event.
    assert (s3["new"], s3["table"], s3["copies"], s3["retained_refs"], s3["events"]) == ([[], []], [[1, 3], [0, 4]], [(4, 5)], [2, 1], [])
    assert s3["free"] == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 5]
    b = Request("b", list(range(12)) + [99, 98, 97], max_tokens=4)
    s4 = step(m, b, 3, first=True)
    # A hit of 12 tokens: block 3 (a's, still writing) and the saved state 5 are shared part-way,
    # so b gets private copies 6 and 7 in their places.
    assert (s4["hit"], s4["new"], s4["table"]) == (12, [[6], [7]], [[1, 6], [0, 7]])
    assert (s4["copies"], s4["retained_refs"]) == ([(3, 6), (5, 7)], [2, 2, 1, 2])
    assert s4["events"] == [("BlockStored", 4, 0)]  # b's own tail (12 in its copy 6)
    assert s4["free"] == [8, 9, 10, 11, 12, 13, 14, 15, 2, 5]
    m.free(a)
    m.free(b)
    assert free_queue(m) == [7, 4, 8, 9, 10, 11, 12, 13, 14, 15, 2, 5, 3, 6, 1]
    m.new_step_starts()
    blocks, hit = m.get_computed_blocks(Request("c", list(range(12)) + [50], max_tokens=4))
    assert (hit, ids(blocks)) == (12, [[1, 3], [0, 5]])
    m.block_pool.check_invariants()


def test_the_scheduler_stops_a_chunk_at_the_prompts_last_hash_boundary_and_hands_over_the_copies() -> None:
    m = KVCacheManager(num_blocks=16, kv_cache_groups=HYBRID, max_model_len=64, prefix_match_unit=4)
    sched = Scheduler(m, max_num_batched_tokens=64, max_num_seqs=4)
    sched.add_request(Request("a", list(range(14)), max_tokens=2))
    chunks, copies = [], []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        copies.append(out.kv_cache_block_copies)
        sched.update_from_output(out, {"a": [7]} if sum(chunks) >= 14 else {})
    assert chunks == [8, 4, 2]
    assert copies == [None, None, [KVCacheBlockCopy(src_block_id=4, dst_block_id=5)]]
    # Both blocks of the copy were let go once it was handed over: 4 stays a's, 5 is cached.
    assert (m.block_pool.blocks[4].ref_cnt, m.block_pool.blocks[5].ref_cnt) == (1, 0)
    sched.check_invariants()


def test_a_connector_with_partial_hits_is_refused(tmp_path) -> None:
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvlab.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    m = KVCacheManager(num_blocks=16, kv_cache_groups=HYBRID, prefix_match_unit=4)
    connector = ExampleConnector(KVConnectorRole.SCHEDULER, 8, {"shared_storage_path": str(tmp_path)})
    with pytest.raises(ValueError, match="a KV connector with partial prefix hits"):
        Scheduler(m, max_num_batched_tokens=64, connector=connector)


def test_a_stale_partial_hit_is_refused_and_changes_nothing() -> None:
    m = manager()
    a = Request("a", list(range(14)), max_tokens=4)
    step(m, a, 8, first=True)
    step(m, a, 4)
    step(m, a, 2)
    b = Request("b", list(range(12)) + [99, 98, 97], max_tokens=4)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 12
    m.block_pool.evict_blocks([3])  # the full-attention block b would share: no longer findable
    m.take_events()
    before = ([x.ref_cnt for x in m.block_pool.blocks], free_queue(m))
    with pytest.raises(
        ValueError, match=r"new_computed_blocks\[0\]\[-1\]: block 3 is no longer findable under the hash of the request's first 12 tokens"
    ):
        m.allocate_slots(b, 3, hit, blocks)
    assert ([x.ref_cnt for x in m.block_pool.blocks], free_queue(m)) == before
    with pytest.raises(ValueError, match="does not match new_computed_blocks"):
        m.allocate_slots(b, 3, 10, blocks)  # not a hash boundary


def test_an_undone_call_keeps_the_copies_waiting_for_the_runner() -> None:
    """Copies not yet taken hold their blocks once more; undoing a later call must count
    those holds again (the ref counts are rebuilt from the tables and the waiting copies)."""
    m = manager(event_log=EventLog())
    a = Request("a", list(range(14)), max_tokens=4)
    for n, first in ((8, True), (4, False), (2, False)):
        m.new_step_starts()
        if first:
            blocks, hit = m.get_computed_blocks(a)
            m.allocate_slots(a, n, hit, blocks)
        else:
            m.allocate_slots(a, n)
        a.num_computed_tokens += n
    refs = [x.ref_cnt for x in m.block_pool.blocks]
    assert (refs[4], refs[5]) == (2, 1)  # the copy 4 -> 5 waits: both held once more
    m.check_invariants()
    cp = checkpoint_manager(m)
    b = Request("b", list(range(12)) + [99, 98, 97], max_tokens=4)
    blocks, hit = m.get_computed_blocks(b)
    m.allocate_slots(b, 3, hit, blocks)
    restore_manager(m, cp)
    assert [x.ref_cnt for x in m.block_pool.blocks] == refs
    copies, retained = m.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [(4, 5)]
    m.block_pool.free_blocks(retained)
    m.block_pool.check_invariants()


# -- a property: random workloads through the scheduler ------------------------------------------
BASE = list(range(100, 160))


@given(
    prompts=st.lists(st.tuples(st.integers(5, 40), st.lists(st.integers(0, 3), max_size=3), st.integers(1, 6)), min_size=2, max_size=10),
    num_blocks=st.integers(10, 30),
    budget=st.sampled_from([8, 12, 32]),
    eagle=st.booleans(),
)
def test_random_workloads_keep_every_invariant_and_replay_exactly(prompts, num_blocks, budget, eagle) -> None:
    """Prompts cut from one long prefix (so hits end inside blocks), run by the scheduler on a
    Mamba hybrid with blocks of 8 hashed every 4 tokens: after every step the ref counts equal
    the tables plus the waiting copies, and the event log replays to the live pool."""
    eng = build_engine(
        num_blocks=num_blocks,
        block_size=8,
        max_num_batched_tokens=budget,
        manager_kwargs=dict(kv_cache_groups=HYBRID, prefix_match_unit=4, use_eagle=eagle),
    )
    for i, (length, tail, max_tokens) in enumerate(prompts):
        eng.add_request(Request(f"r{i}", BASE[:length] + tail, max_tokens=max_tokens))
    run_replaying(eng)


# -- a prompt's checkpoint exported from inside a chunk (vLLM 0.33) -------------------------------
@pytest.mark.parametrize(
    ("checkpoint_blocks", "a_chunks", "copies"),
    [
        (0, [24, 4, 2], [(5, 6), (7, 8)]),  # A stops at 24 (a block) and at 28 (the prompt's hash boundary)
        (1, [30], [(4, 6), (5, 7)]),  # one chunk: the state at 28 is exported into a block of its own
    ],
)
def test_a_backend_that_exports_the_prompts_state_saves_a_forward_pass(checkpoint_blocks, a_chunks, copies) -> None:
    """Blocks of 8 hashed every 4. A (30 tokens) must leave its state after 28 tokens for a
    later hit. Without a checkpoint block the scheduler ends chunks at 24 and 28; a backend
    that writes the state from inside a chunk (alignment 4) gets one block reserved for it,
    and A runs in one chunk. Either way B hits 28 and gets copies of both blocks it shares."""
    mamba = MambaSpec(
        block_size=8, num_prefill_checkpoint_blocks=checkpoint_blocks, prefill_checkpoint_alignment=4 if checkpoint_blocks else None
    )
    eng = build_engine(
        num_blocks=40,
        block_size=8,
        max_num_batched_tokens=64,
        manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(block_size=8), mamba], prefix_match_unit=4),
    )
    a = list(range(100, 130))
    for rid, prompt in (("A", a), ("B", a[:28] + [1, 2, 3, 4, 5, 6])):
        eng.add_request(Request(rid, prompt, max_tokens=1))
        eng.run()
    ev = eng.events.events
    assert [e.num_tokens for e in ev if e.kind == "request_scheduled" and e.request_id == "A"] == a_chunks
    assert [(e.request_id, e.num_hit_tokens) for e in ev if e.kind == "prefix_lookup"] == [("A", 0), ("B", 28)]
    assert [(e.src_block_id, e.dst_block_id) for e in ev if e.kind == "block_copied" and e.request_id == "B"] == copies
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 39


@pytest.mark.parametrize(("num_blocks", "tables"), [(6, None), (7, [[1, 3, 4], [2, 5, 6]])])
def test_a_connectors_tokens_and_a_checkpoint_block_are_counted_before_anything_is_taken(num_blocks, tables) -> None:
    """4 of A's 10 tokens come from a KV connector, 5 are computed now, and the chunk exports
    the state at 8 from inside: the Mamba group takes a block for the connector's state, the
    checkpoint block and the new state. kvlab counts what the allocation really takes (6
    blocks), so with 5 free it refuses and changes nothing -- it used to count 5 and fail
    half-way."""
    m = KVCacheManager(
        num_blocks=num_blocks,
        kv_cache_groups=[
            FullAttentionSpec(block_size=4),
            MambaSpec(block_size=4, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1),
        ],
    )
    a = Request("A", list(range(10)), max_tokens=4)
    hits, _ = m.get_computed_blocks(a)
    got = m.allocate_slots(a, 5, 0, hits, num_external_computed_tokens=4)
    assert (None if got is None else ids(m.get_blocks("A")), m.block_pool.get_num_free_blocks()) == (tables, 0 if tables else 5)


def test_checkpoint_fields_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="MambaSpec.prefill_checkpoint_alignment"):
        MambaSpec(block_size=8, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=0)
    with pytest.raises(ValueError, match="MambaSpec.num_prefill_checkpoint_blocks"):
        MambaSpec(block_size=8, num_prefill_checkpoint_blocks=-1)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(5, 40), st.lists(st.integers(0, 3), max_size=3), st.integers(1, 6)), min_size=2, max_size=8),
    num_blocks=st.integers(14, 40),
    budget=st.sampled_from([8, 16, 64]),
    eagle=st.booleans(),
    nspec=st.integers(0, 2),
    alignment=st.sampled_from([None, 1, 4]),
    retention=st.sampled_from([None, 0]),
    junction_opt_in=st.booleans(),
)
def test_checkpoints_scratch_blocks_and_junctions_keep_every_invariant_and_replay(
    prompts, num_blocks, budget, eagle, nspec, alignment, retention, junction_opt_in
) -> None:
    """Everything vLLM 0.33 adds to a Mamba group at once -- speculative scratch blocks,
    prefill checkpoint blocks, sparse retention, the opt-in junction checkpoint -- through the
    scheduler: invariants after every step, and the event log replays to the live pool."""
    mamba = MambaSpec(
        block_size=8,
        num_speculative_blocks=nspec,
        num_prefill_checkpoint_blocks=int(alignment is not None),
        prefill_checkpoint_alignment=alignment,
    )
    eng = build_engine(
        num_blocks=num_blocks,
        block_size=8,
        max_num_batched_tokens=budget,
        manager_kwargs=dict(
            kv_cache_groups=[FullAttentionSpec(block_size=8), mamba],
            prefix_match_unit=4,
            use_eagle=eagle,
            prefix_cache_retention_interval=retention,
            enable_mamba_shared_prefix_checkpoint=junction_opt_in,
        ),
    )
    for i, (length, tail, max_tokens) in enumerate(prompts):
        eng.add_request(Request(f"r{i}", BASE[:length] + tail, max_tokens=max_tokens))
    run_replaying(eng)


@pytest.mark.parametrize(
    "specs, caching, dcp, expected",
    [
        # vLLM 0.33's test hybrid: a 2-token full-attention block, an 8-token aligned Mamba block
        ([FullAttentionSpec(block_size=2), MambaSpec(block_size=8)], True, 1, 2),
        # a window group cannot end a hit inside its 4-token blocks: hits stay on scheduler blocks (8)
        ([FullAttentionSpec(block_size=2), MambaSpec(block_size=8), SlidingWindowSpec(block_size=4, sliding_window=4)], True, 1, 8),
        # under DCP the full-attention block grows to 4; the Mamba block is still larger than the hash block
        ([FullAttentionSpec(block_size=2), MambaSpec(block_size=8)], True, 2, 2),
    ],
)
def test_resolved_hit_alignment_is_the_coordinators(specs, caching, dcp, expected) -> None:
    # What the engine works out from the configuration alone must be where the coordinator lands hits.
    m = KVCacheManager(num_blocks=64, kv_cache_groups=specs, dcp_world_size=dcp, prefix_match_unit=2)
    c = m.coordinator
    assert _resolved_alignment(specs, caching, dcp, c.scheduler_block_size, c.hash_block_size) == c._cache_hit_alignment_tokens == expected


def test_resolved_hit_alignment_without_prefix_caching_or_with_one_group_is_the_scheduler_block() -> None:
    hybrid = [FullAttentionSpec(block_size=2), MambaSpec(block_size=8)]
    assert _resolved_alignment(hybrid, False, 1, 8, 2) == 8
    assert _resolved_alignment([FullAttentionSpec(block_size=8)], True, 1, 8, 8) == 8


def _resolved_alignment(specs, caching: bool, dcp: int, scheduler_block_size: int, hash_block_size: int) -> int:
    from types import SimpleNamespace

    from kvlab.core.kv_cache_utils import resolve_cache_hit_alignment_tokens
    from kvlab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs))
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=caching), parallel_config=SimpleNamespace(decode_context_parallel_size=dcp)
    )
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=(), kv_cache_groups=groups)
    return resolve_cache_hit_alignment_tokens(config, vllm_config, scheduler_block_size, hash_block_size)


def test_a_full_report_of_a_hit_inside_a_block_publishes_its_whole_blocks() -> None:
    """kv_cache_report_mode="full" publishes a request's hit as BlockStored. A hit that ends
    inside a block has no full-block hash for that block: kvlab publishes the whole blocks
    (here block 1 of the full-attention group and the Mamba group's first slot). vLLM 0.33
    counts the partial block too and raises IndexError reading a hash the request lacks
    (checked on 0.33.0 with these calls); without the full report both find the same hit."""
    m = manager()
    a = Request("a", list(range(14)), max_tokens=4)
    step(m, a, 8, first=True)
    step(m, a, 4)
    step(m, a, 2)
    m.take_events()
    c = Request("c", list(range(12)) + [50], max_tokens=4, kv_cache_report_mode="full")
    blocks, hit = m.get_computed_blocks(c)
    assert (hit, ids(blocks)) == (12, [[1, 3], [0, 5]])
    got = [(type(e).__name__, e.block_size, e.group_idx, len(e.block_hashes), e.token_ids, e.parent_block_hash) for e in m.take_events()]
    assert got == [("BlockStored", 8, 0, 1, list(range(8)), None), ("BlockStored", 8, 1, 1, list(range(8)), None)]


def test_the_manager_class_of_a_spec_is_its_own_or_its_nearest_bases() -> None:
    from dataclasses import dataclass

    from kvlab.core.kv_cache_utils import get_manager_class
    from kvlab.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
    from kvlab.kv_cache_interface import KVCacheSpec

    @dataclass(frozen=True, kw_only=True)
    class MyFullAttention(FullAttentionSpec):  # a subclass runs as full attention, as in vLLM's registry
        pass

    assert get_manager_class(MambaSpec(block_size=8)) is MambaManager
    assert get_manager_class(MyFullAttention(block_size=8)) is FullAttentionManager
    with pytest.raises(ValueError, match=r"no KV cache manager runs a KVCacheSpec; known specs: \['ChunkedLocalAttentionSpec', "):
        get_manager_class(KVCacheSpec(block_size=8))
