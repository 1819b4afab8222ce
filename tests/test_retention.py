"""Sparse retention of window and Mamba states (vLLM 0.33's ``prefix_cache_retention_interval``).

A sliding-window group only needs the last ``cdiv(W - 1, block_size)`` blocks before a hit's
end, and a Mamba group one state. vLLM 0.33 keeps only some of them: None keeps every one that
could end a hit (``KVCacheConfig``'s default, and kvlab's manager's); 0 keeps only what a
replay of the prompt can hit, plus a *shared-prefix junction* a lookup found (a longer prefix
full attention had and the window group lacked -- the next request with that prefix hits it);
k > 0 also one segment tail every k tokens. vLLM's server default (``CacheConfig``) is 0.

Every expected value below was first produced by vLLM 0.33.0's ``KVCacheManager`` with the
same calls (the junction set on the request as its scheduler does); a differential run over
five families with retention 0 and two intervals, EAGLE on and off, agrees throughout.
"""

from __future__ import annotations

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec
from kvlab.core.single_type_kv_cache_manager import replay_boundaries

SPECS = [SlidingWindowSpec(block_size=4, sliding_window=8), FullAttentionSpec(block_size=4)]
A = list(range(30))


def story(retention: int | None) -> list[tuple]:
    """A (30 tokens), then B = A + 1, C = A's first 20 + 2, D = A's first 20 + 3, one at a time."""
    m = KVCacheManager(num_blocks=40, kv_cache_groups=SPECS, max_model_len=128, prefix_cache_retention_interval=retention)
    out = []
    for rid, prompt in (("a", A), ("b", A + [99]), ("c", A[:20] + [50, 51]), ("d", A[:20] + [60, 61, 62])):
        r = Request(rid, prompt, max_tokens=2)
        blocks, n = m.get_computed_blocks(r)
        out.append((rid, n, r.shared_prefix_boundary, blocks.get_block_ids()))
        m.allocate_slots(r, len(prompt) - n, n, blocks)
        r.num_computed_tokens = len(prompt)
        out.append((rid, [i for i, b in enumerate(m.get_blocks(rid).blocks[0]) if b.block_hash is not None]))
        m.check_invariants()
        m.free(r)
    return out


def test_dense_keeps_every_window_block_that_can_end_a_hit() -> None:
    assert story(None) == [
        ("a", 0, 0, ([], [])),
        ("a", [0, 1, 2, 3, 4, 5, 6]),
        ("b", 28, 0, ([0, 0, 0, 0, 0, 6, 7], [9, 10, 11, 12, 13, 14, 15])),
        ("b", [5, 6]),
        ("c", 20, 0, ([0, 0, 0, 4, 5], [9, 10, 11, 12, 13])),
        ("c", [3, 4]),
        ("d", 20, 0, ([0, 0, 0, 4, 5], [9, 10, 11, 12, 13])),
        ("d", [3, 4]),
    ]


def test_retention_0_keeps_the_replay_tail_and_learns_a_junction() -> None:
    assert story(0) == [
        ("a", 0, 0, ([], [])),
        ("a", [5, 6]),  # only the two blocks before token 28, where a replay of A hits
        ("b", 28, 0, ([0, 0, 0, 0, 0, 6, 7], [9, 10, 11, 12, 13, 14, 15])),
        ("b", [5, 6]),
        # Full attention has A's first 20 tokens, the window group nothing there: no hit, but
        # a junction at 20, so C keeps the window blocks a hit at 20 needs ...
        ("c", 0, 20, ([], [])),
        ("c", [3, 4]),
        # ... and D, with the same 20 tokens, hits them.
        ("d", 20, 0, ([0, 0, 0, 4, 3], [9, 10, 11, 12, 13])),
        ("d", [3, 4]),
    ]


def test_a_positive_interval_keeps_one_tail_per_segment_too() -> None:
    assert story(16) == [
        ("a", 0, 0, ([], [])),
        ("a", [2, 3, 5, 6]),  # the tail of the 16-token segment, and the replay tail
        ("b", 28, 0, ([0, 0, 0, 0, 0, 6, 7], [9, 10, 11, 12, 13, 14, 15])),
        ("b", [5, 6]),
        ("c", 16, 20, ([0, 0, 3, 4], [9, 10, 11, 12])),
        ("c", [2, 3, 4]),
        ("d", 20, 0, ([0, 0, 0, 4, 8], [9, 10, 11, 12, 13])),
        ("d", [3, 4]),
    ]
    # An interval of 8 is no sparser than the window needs (2 blocks per 2-block segment): dense.
    assert story(8) == story(None)


def test_a_mamba_group_keeps_one_state_per_segment_and_the_replay_state() -> None:
    m = KVCacheManager(num_blocks=40, kv_cache_groups=[FullAttentionSpec(), MambaSpec()], block_size=4, prefix_cache_retention_interval=16)
    mamba = m.coordinator.single_type_managers[1]
    assert mamba.block_mask(0, 10, [29]) == [False, False, False, True, False, False, True, True, False, False]
    assert mamba.block_mask(4, 10, [29]) == [False, False, True, True, False, False]
    mamba.retention_interval = 0
    assert mamba.block_mask(0, 10, [29]) == [False] * 6 + [True] + [False] * 3
    mamba.retention_interval = None
    assert mamba.block_mask(0, 10, [29]) is None


def test_replay_boundaries() -> None:
    assert replay_boundaries(30, 4, use_eagle=False) == (29,)
    assert replay_boundaries(30, 4, use_eagle=True) == (24,)  # resend 28 and sibling 28, one block lower
    assert replay_boundaries(32, 4, use_eagle=True) == (24, 28)  # a block-aligned prompt: the two differ


@pytest.mark.parametrize(
    "groups, retention, exc, match",
    [
        ([FullAttentionSpec()], 16, ValueError, "prefix_cache_retention_interval is set but this model has no sliding-window or Mamba"),
        (SPECS, 6, ValueError, r"prefix_cache_retention_interval \(6\) must be non-negative and a multiple of scheduler_block_size \(4\)"),
        (SPECS, -4, ValueError, r"must be non-negative"),
        (SPECS, 4.0, TypeError, "prefix_cache_retention_interval must be None or an int"),
    ],
)
def test_bad_intervals_are_refused_with_vllms_words(groups, retention, exc, match) -> None:
    with pytest.raises(exc, match=match):
        KVCacheManager(num_blocks=40, kv_cache_groups=groups, block_size=4, prefix_cache_retention_interval=retention)
    assert KVCacheManager(num_blocks=40, block_size=4, prefix_cache_retention_interval=0).coordinator.retention_interval == 0


def test_the_scheduler_stops_a_mamba_chunk_at_a_shared_prefix_junction() -> None:
    """A's 30 tokens run in one chunk, so its Mamba state is saved only at 28. B shares A's
    first 20: full attention has them, Mamba nothing -- no hit, a junction at 20. vLLM 0.33's
    scheduler stops B's first chunk there (the block boundary at or before the junction), so
    B's state after 20 tokens is saved and C, with the same 20 tokens, hits them."""
    from kvlab.engine.llm_engine import build_engine

    eng = build_engine(
        num_blocks=40,
        block_size=4,
        max_num_batched_tokens=64,
        manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=4)]),
    )
    for rid, prompt in (("A", A), ("B", A[:20] + [1, 2, 3, 4, 5]), ("C", A[:20] + [9, 9, 9])):
        eng.add_request(Request(rid, prompt, max_tokens=1))
        eng.run()
    lookups = [(e.request_id, e.num_hit_tokens) for e in eng.events.events if e.kind == "prefix_lookup"]
    chunks = [(e.request_id, e.num_tokens) for e in eng.events.events if e.kind == "request_scheduled"]
    assert lookups == [("A", 0), ("B", 0), ("C", 20)]
    assert chunks == [("A", 28), ("A", 2), ("B", 20), ("B", 4), ("B", 1), ("C", 3)]
    assert eng.finished["B"].shared_prefix_boundary == 20


@pytest.mark.parametrize(
    ("opt_in", "b_chunks", "c_lookup", "c_chunks"),
    [
        (False, [8, 8, 8, 4], ("C", 8, 12), [8, 4, 4, 3]),  # B's chunk stops at 8, the block boundary before 12
        (True, [12, 4, 8, 4], ("C", 12, 0), [4, 4, 4, 3]),  # B stops at the junction itself; C hits it
    ],
)
def test_opting_in_saves_the_mamba_state_at_the_junction_inside_a_block(opt_in, b_chunks, c_lookup, c_chunks) -> None:
    """Blocks of 8 hashed every 4, EAGLE: B shares A's first 22 tokens, full attention has
    them (12 after EAGLE's drop), Mamba has no state there -- a junction at 12, inside B's
    second block. ``enable_mamba_shared_prefix_checkpoint`` saves B's state exactly there."""
    from kvlab.engine.llm_engine import build_engine

    eng = build_engine(
        num_blocks=40,
        block_size=8,
        max_num_batched_tokens=64,
        manager_kwargs=dict(
            kv_cache_groups=[FullAttentionSpec(block_size=8), MambaSpec(block_size=8)],
            prefix_match_unit=4,
            use_eagle=True,
            enable_mamba_shared_prefix_checkpoint=opt_in,
        ),
    )
    assert eng.kv_cache_manager.mamba_shared_prefix_checkpoint is opt_in
    a = list(range(100, 140))
    for rid, prompt in (("A", a), ("B", a[:22] + [1, 2, 3, 4, 5, 6]), ("C", a[:22] + [9, 9, 9, 9, 9])):
        eng.add_request(Request(rid, prompt, max_tokens=1))
        eng.run()
    ev = eng.events.events
    lookups = [(e.request_id, e.num_hit_tokens) for e in ev if e.kind == "prefix_lookup"]
    chunks = {rid: [e.num_tokens for e in ev if e.kind == "request_scheduled" and e.request_id == rid] for rid in "ABC"}
    assert lookups == [("A", 0), ("B", 0), c_lookup[:2]]
    assert (eng.finished["B"].shared_prefix_boundary, eng.finished["C"].shared_prefix_boundary) == (12, c_lookup[2])
    assert chunks == {"A": [32, 4, 4], "B": b_chunks, "C": c_chunks}


def test_the_opt_in_needs_eagle_and_partial_hits_and_a_bool() -> None:
    groups = [FullAttentionSpec(block_size=8), MambaSpec(block_size=8)]
    assert not KVCacheManager(
        num_blocks=8, kv_cache_groups=groups, prefix_match_unit=4, enable_mamba_shared_prefix_checkpoint=True
    ).mamba_shared_prefix_checkpoint
    assert not KVCacheManager(
        num_blocks=8, kv_cache_groups=groups, use_eagle=True, enable_mamba_shared_prefix_checkpoint=True
    ).mamba_shared_prefix_checkpoint
    with pytest.raises(TypeError, match="enable_mamba_shared_prefix_checkpoint must be a bool, got 'yes'"):
        KVCacheManager(num_blocks=8, kv_cache_groups=groups, enable_mamba_shared_prefix_checkpoint="yes")
