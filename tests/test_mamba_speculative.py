"""Speculative decoding on a Mamba hybrid: ``MambaSpec.num_speculative_blocks`` (vLLM 0.33).

A recurrent state cannot be rolled back, so with MTP/EAGLE each draft token gets a scratch
state block after the running one, and the runner continues from the last accepted draft.
In ``align`` mode the running state sits at index ``cdiv(tokens, block_size) - 1`` of the
table and the scratch blocks follow it; when one step crosses more than one block boundary
the scratch blocks left behind move to the end of the table (``_relocate_speculative_block``).

Every expected value below was first produced by vLLM 0.33.0's own ``KVCacheManager`` with
the same calls (the unpacked release wheel, sha256_cbor hashes). A differential run of 200
random workloads (full attention + Mamba, blocks of 4 or 8, hashed every 4 or 8 tokens,
``align`` and ``none`` modes, 0-2 speculative blocks, EAGLE on and off, 1 + 0..k tokens
accepted per step) found no difference in block ids, tables, free queue or KV events.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request
from kvlab.engine.llm_engine import build_engine
from kvlab.eventlog.events import BlockRelocated, EventLog
from replay_check import run_replaying


def ids(blocks) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


def free_head(m: KVCacheManager, n: int = 6) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()][:n]


def test_scratch_blocks_follow_the_running_state_and_move_when_a_step_skips_a_block() -> None:
    log = EventLog()
    m = KVCacheManager(
        num_blocks=16,
        kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=4, num_speculative_blocks=2)],
        hash_algo="sha256_cbor",
        max_model_len=256,
        event_log=log,
    )
    a = Request("A", list(range(100, 114)), max_tokens=8)
    blocks, hit = m.get_computed_blocks(a)
    got = m.allocate_slots(a, 4, hit, blocks)
    a.num_computed_tokens = 4
    # the state after 4 tokens in block 2, two scratch blocks after it
    assert (ids(got), ids(m.get_blocks("A"))) == ([[1], [2, 3, 4]], [[1], [2, 3, 4]])
    m.new_step_starts()
    got = m.allocate_slots(a, 8)  # to 12 tokens: the running state moves two blocks on
    a.num_computed_tokens = 12
    # scratch block 3 (position 1) is left behind: it moves to the end; 4 is the new state
    assert (ids(got), ids(m.get_blocks("A")), free_head(m)) == ([[5, 6], [3, 7]], [[1, 5, 6], [2, 0, 4, 3, 7]], [8, 9, 10, 11, 12, 13])
    moved = [e for e in log.events if isinstance(e, BlockRelocated)]
    assert [(e.request_id, e.group, e.position, e.block_id) for e in moved] == [("A", 1, 1, 3)]
    m.new_step_starts()
    got = m.allocate_slots(a, 2)
    a.num_computed_tokens = 14
    assert (ids(got), ids(m.get_blocks("A"))) == ([[8], [9]], [[1, 5, 6, 8], [0, 0, 4, 3, 7, 9]])
    for n, want in [
        (3, ([[10], [11]], [[1, 5, 6, 8, 10], [0, 0, 0, 3, 7, 9, 11]], [12, 13, 14, 15, 2, 4])),
        (1, ([[], []], [[1, 5, 6, 8, 10], [0, 0, 0, 0, 7, 9, 11]], [12, 13, 14, 15, 2, 4])),
    ]:  # decode: 1 + accepted drafts per step, room for 2 drafts ahead
        m.new_step_starts()
        for t in range(n):
            a.append_output_token_ids(500 + t)
        got = m.allocate_slots(a, n, num_lookahead_tokens=2)
        a.num_computed_tokens += n
        assert (ids(got), ids(m.get_blocks("A")), free_head(m)) == want
    m.free(a)
    assert free_head(m, 15) == [11, 9, 7, 10, 12, 13, 14, 15, 2, 4, 3, 8, 6, 5, 1]
    # B starts from the state A saved after 12 tokens (block 4)
    b = Request("B", list(range(100, 112)) + [7, 7], max_tokens=8)
    m.new_step_starts()
    blocks, hit = m.get_computed_blocks(b)
    got = m.allocate_slots(b, 14 - hit, hit, blocks)
    assert (hit, ids(got), ids(m.get_blocks("B"))) == (12, [[11], [9, 7, 10]], [[1, 5, 6, 11], [0, 0, 4, 9, 7, 10]])
    m.block_pool.check_invariants()


def test_without_prefix_caching_the_scratch_blocks_are_plain_extra_blocks() -> None:
    m = KVCacheManager(
        num_blocks=16,
        kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=64, mamba_cache_mode="none", num_speculative_blocks=2)],
        enable_caching=False,
        max_model_len=64,
    )
    a = Request("A", list(range(10)), max_tokens=4)
    got = m.allocate_slots(a, 10)
    assert ids(got) == [[1, 2, 3], [4, 5, 6]]  # one running state + two scratch states


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_number_of_speculative_blocks_is_refused_by_name(bad) -> None:
    with pytest.raises((TypeError, ValueError), match="MambaSpec.num_speculative_blocks"):
        MambaSpec(block_size=4, num_speculative_blocks=bad)


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(3, 30), st.integers(1, 12)), min_size=2, max_size=6),
    nspec=st.integers(1, 2),
    num_blocks=st.integers(14, 40),
    budget=st.sampled_from([8, 16, 64]),
)
def test_random_runs_keep_every_invariant_and_replay_exactly(prompts, nspec, num_blocks, budget) -> None:
    """Through the scheduler (no drafts: the scratch blocks are still held and moved): after
    every step the event log replays to the live pool and the live block tables."""
    eng = build_engine(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=4, num_speculative_blocks=nspec)]),
    )
    base = list(range(100, 140))
    for i, (length, max_tokens) in enumerate(prompts):
        eng.add_request(Request(f"r{i}", base[:length] + [i], max_tokens=max_tokens))
    run_replaying(eng, max_steps=300, tables=True)
