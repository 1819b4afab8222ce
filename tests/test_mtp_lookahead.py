"""Multi-module MTP drafters and the prefix cache: vLLM 0.33's ``num_prefill_lookahead`` and
``num_hash_lookahead_tokens``.

A multi-module MTP drafter with k modules reads the k prompt tokens after a chunk's end, so
(1) the last k - 1 computed tokens are not final and are not cached yet, (2) the scheduler
never ends a prefill chunk within k tokens of the prefill's end, and (3) with lookahead
hashes (vLLM's default for such a drafter with prefix caching and no KV connector) each
block's hash also covers the k tokens after it, its ``BlockStored`` lists them, and no
EAGLE drop is needed.

Every expected value below was first produced by vLLM 0.33.0's own ``KVCacheManager`` (and
``Scheduler._reserve_prefill_lookahead``) with the same calls (the unpacked release wheel,
sha256_cbor hashes). A differential run of 300 random workloads (full attention alone, with
Mamba, with a sliding window; lookahead 1-3 with and without lookahead hashes; LoRA, salts
and images; MTP decode steps) found no difference in hashes, hits, block ids, tables, free
queue, ref counts or KV events, field by field.
"""

from __future__ import annotations

import pytest
from types import SimpleNamespace
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request
from kvlab.core.sched.scheduler import Scheduler
from kvlab.kv_cache_interface import get_mamba_prefill_checkpoint_position
from kvlab.engine.llm_engine import build_engine
from kvlab.kv_cache_interface import KVCacheGroupSpec
from kvlab.request import MultiModalFeature
from replay_check import run_replaying


def manager(
    lookahead: int, prefill_lookahead: int | None, *, use_eagle: bool = False, eagle_group: bool = False, block_size: int = 4
) -> KVCacheManager:
    group = KVCacheGroupSpec(layer_names=("a",), kv_cache_spec=FullAttentionSpec(block_size=block_size), is_eagle_group=eagle_group)
    return KVCacheManager(
        num_blocks=20,
        kv_cache_groups=[group],
        hash_algo="sha256_cbor",
        use_eagle=use_eagle,
        enable_kv_cache_events=True,
        num_hash_lookahead_tokens=lookahead,
        num_prefill_lookahead=prefill_lookahead,
    )


def test_a_block_is_hashed_with_the_tokens_after_it_and_its_event_lists_them() -> None:
    m = manager(2, 2)
    a = Request("A", list(range(100, 114)), max_tokens=8, cache_salt="s1")
    blocks, hit = m.get_computed_blocks(a)
    # 14 tokens, blocks of 4, 2 lookahead tokens: blocks ending at 4, 8 and 12 (12 + 2 <= 14)
    assert [h.hex()[:16] for h in a.block_hashes] == ["6950a524fdc2ddcb", "1079e04183d0fdd3", "5cefb2093df04263"]
    m.allocate_slots(a, 14, hit, blocks)
    a.num_computed_tokens = 14
    (stored,) = m.take_events()
    assert stored.block_hashes == [3823565320739115863, 13428403557826698019, 4513178941750154085]
    assert stored.token_ids == list(range(100, 112))
    assert stored.lookahead_token_ids == [[104, 105], [108, 109], [112, 113]]
    assert stored.extra_keys == [("s1",), None, None]  # the salt, on the first block only


def test_a_hit_ends_where_the_lookahead_tokens_differ() -> None:
    m = manager(2, 2)
    a = Request("A", list(range(100, 114)), max_tokens=8, cache_salt="s1")
    blocks, hit = m.get_computed_blocks(a)
    m.allocate_slots(a, 14, hit, blocks)
    # B shares A's first 13 tokens: block 3 (tokens 8-11) matches, but its hash also
    # covers tokens 12 and 13, and B's token 13 differs -- the hit stops at 8.
    b = Request("B", [*range(100, 113), 999, 5, 6], max_tokens=8, cache_salt="s1")
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, [[x.block_id for x in g] for g in blocks.blocks]) == (8, [[1, 2]])


def test_the_last_k_minus_1_computed_tokens_are_not_cached_yet() -> None:
    m = manager(0, 3, use_eagle=True)  # lookahead hashes off: EAGLE's drop instead
    c = Request("C", list(range(12)), max_tokens=8)
    m.allocate_slots(c, 8)
    c.num_computed_tokens = 8
    # 8 computed, 2 of them re-prefillable: 6 final tokens, one full block
    assert [(len(e.block_hashes), e.token_ids) for e in m.take_events()] == [(1, [0, 1, 2, 3])]
    m.allocate_slots(c, 4)
    c.num_computed_tokens = 12
    assert [(len(e.block_hashes), e.token_ids) for e in m.take_events()] == [(1, [4, 5, 6, 7])]


def test_none_derives_the_lookahead_from_use_eagle() -> None:
    assert (manager(0, None).num_prefill_lookahead, manager(0, None, use_eagle=True).num_prefill_lookahead) == (0, 1)


@pytest.mark.parametrize(("lookahead", "use_eagle", "eagle_group"), [(0, True, False), (5, False, True)])
def test_a_dropped_tail_shorter_than_the_lookahead_is_refused_as_vllm_does(lookahead, use_eagle, eagle_group) -> None:
    with pytest.raises(ValueError) as e:
        manager(lookahead, 5, use_eagle=use_eagle, eagle_group=eagle_group)
    assert str(e.value) == "Multi-module MTP with prefix caching requires scheduler_block_size (=4) >= num_speculative_tokens (=5)."


def test_without_a_drafter_group_a_long_lookahead_is_accepted() -> None:
    assert manager(5, 5).num_prefill_lookahead == 5


@pytest.mark.parametrize(("name", "bad"), [("num_hash_lookahead_tokens", -1), ("num_prefill_lookahead", 1.5)])
def test_a_bad_lookahead_is_refused_by_name(name, bad) -> None:
    with pytest.raises((TypeError, ValueError), match=name):
        KVCacheManager(num_blocks=8, block_size=4, **{name: bad})


def test_the_mamba_checkpoint_leaves_room_for_the_lookahead() -> None:
    # the last hash boundary with L tokens after it: (10 - 3) // 4 * 4 = 4 (8 without lookahead)
    assert [get_mamba_prefill_checkpoint_position(10, 4, False, la) for la in (0, 1, 3)] == [8, 8, 4]
    assert get_mamba_prefill_checkpoint_position(10, 4, True, 3) == 4  # EAGLE's drop rules instead


def run_first_steps(m: KVCacheManager, request: Request, budget: int, steps: int = 2) -> list[tuple[int, list[int]]]:
    sched = Scheduler(m, max_num_batched_tokens=budget)
    sched.add_request(request)
    seen = []
    for _ in range(steps):
        out = sched.schedule()
        n = out.num_scheduled_tokens[request.request_id]
        seen.append((n, out.scheduled_encoder_inputs.get(request.request_id, [])))
        done = request.num_computed_tokens + n == request.num_tokens
        sched.update_from_output(out, {request.request_id: [7]} if done else {})
    return seen


def test_a_prefill_chunk_never_ends_within_the_lookahead_of_the_prompt_end() -> None:
    # 10 tokens, 8 per step, k = 3: a chunk of 8 would leave 2 < 3, so it stops at 7
    assert run_first_steps(manager(3, 3), Request("A", list(range(10)), max_tokens=4), 8) == [(7, []), (3, [])]
    assert run_first_steps(manager(0, 0), Request("A", list(range(10)), max_tokens=4), 8) == [(8, []), (2, [])]


def test_an_image_the_drafter_reads_ahead_into_is_encoded_with_the_chunk() -> None:
    def request() -> Request:
        return Request("A", list(range(16)), max_tokens=4, mm_features=[MultiModalFeature("img", 8, 4)])

    # chunk [0, 8); the image starts at 8: an EAGLE drafter reads token 8, so it is encoded now
    assert run_first_steps(manager(0, None, use_eagle=True), request(), 8) == [(8, [0]), (8, [])]
    assert run_first_steps(manager(0, None), request(), 8) == [(8, []), (8, [0])]


def test_settings_under_which_vllm_would_stall_a_request_are_refused() -> None:
    m = manager(3, 3)
    for kwargs, name in (
        (dict(max_num_batched_tokens=2), "max_num_batched_tokens = 2"),
        (dict(long_prefill_token_threshold=2), "long_prefill_token_threshold = 2"),
    ):
        with pytest.raises(ValueError, match=name):
            Scheduler(m, **kwargs)
    hybrid = KVCacheManager(
        num_blocks=30, kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=4)], num_prefill_lookahead=2
    )
    with pytest.raises(ValueError, match="with a Mamba group in 'align' mode"):
        Scheduler(hybrid)
    # EAGLE (k = 1) with lookahead hashes on the same hybrid is scheduled
    Scheduler(
        KVCacheManager(
            num_blocks=30,
            kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=4)],
            num_hash_lookahead_tokens=1,
            num_prefill_lookahead=1,
        )
    )


def test_what_vllm_does_with_a_mamba_group_and_a_longer_lookahead() -> None:
    """Why the scheduler refuses it: vLLM 0.33's two rules, applied in its order, to a
    5-token prompt, blocks of 4, k = 2, 4 tokens of budget (the same numbers came out of
    vLLM's own methods)."""
    r = Request("A", [100, 101, 102, 103, 1], max_tokens=1)
    # a stand-in ``self`` holding the settings the two methods read, as vLLM's own tests do
    stand_in = SimpleNamespace(
        kv_cache_manager=KVCacheManager(
            num_blocks=30, kv_cache_groups=[FullAttentionSpec(block_size=4), MambaSpec(block_size=4)], num_prefill_lookahead=2
        ),
        cache_config=SimpleNamespace(block_size=4),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        max_num_scheduled_tokens=4,
        hash_block_size=4,
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,
        mamba_partial_cache_hit=False,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
    )
    first = Scheduler._mamba_block_aligned_split(stand_in, r, 4)  # type: ignore[arg-type]  # a stand-in self
    assert (first, Scheduler._reserve_prefill_lookahead(stand_in, r, 0, first)) == (4, 3)  # type: ignore[arg-type]  # the block boundary, then one token back
    r.num_computed_tokens = 3
    second = Scheduler._mamba_block_aligned_split(stand_in, r, 2)  # type: ignore[arg-type]
    assert (second, Scheduler._reserve_prefill_lookahead(stand_in, r, 3, second)) == (1, 0)  # type: ignore[arg-type]  # and from 3: nothing, every step


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(3, 30), st.integers(1, 12)), min_size=2, max_size=6),
    k=st.integers(1, 3),
    hashes=st.booleans(),
    mamba=st.booleans(),  # with k = 1 only (the scheduler refuses a longer lookahead with Mamba)
    num_blocks=st.integers(16, 40),
    budget=st.sampled_from([5, 8, 16, 64]),
)
def test_random_runs_keep_every_invariant_and_replay_exactly(prompts, k, hashes, mamba, num_blocks, budget) -> None:
    """Through the scheduler, shared prefixes, lookahead hashes on or off (then EAGLE's drop):
    after every step the invariants hold and the event log replays to the live pool."""
    groups = [FullAttentionSpec(block_size=4)] + ([MambaSpec(block_size=4)] if mamba and k == 1 else [])
    eng = build_engine(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        manager_kwargs=dict(
            kv_cache_groups=groups,
            use_eagle=not hashes,
            num_hash_lookahead_tokens=k if hashes else 0,
            num_prefill_lookahead=k,
        ),
    )
    base = list(range(100, 140))
    for i, (length, max_tokens) in enumerate(prompts):
        eng.add_request(Request(f"r{i}", base[:length] + [i], max_tokens=max_tokens))
    run_replaying(eng, max_steps=300, tables=True)


def test_a_window_group_keeps_the_tokens_a_drafter_may_have_recomputed() -> None:
    """With k = 3 modules the last 2 computed tokens may be computed again, reading the window
    as it was: every window group keeps 2 more tokens below its window
    (``extra_retained_tokens``, set by the manager as vLLM 0.33's planner sets it). A 10-token
    prompt in chunks of 6 and 4, then 10 decode steps, window 8 in blocks of 4: at 20 computed
    tokens a plain window has dropped 3 blocks, the k = 3 window only 2 (vLLM gave the same
    tables)."""
    from kvlab import SlidingWindowSpec

    tables = {}
    for k in (0, 3):
        m = KVCacheManager(
            num_blocks=32,
            kv_cache_groups=[FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=8, extra_retained_tokens=5)],
            num_prefill_lookahead=k,
        )
        assert m.kv_cache_groups[1].extra_retained_tokens == max(0, k - 1)  # the manager's value replaces the given one
        r = Request("A", list(range(10)), max_tokens=64)
        m.allocate_slots(r, 6)
        r.num_computed_tokens = 6
        m.allocate_slots(r, 4)
        r.num_computed_tokens = 10
        for t in range(10):
            r.append_output_token_ids(50 + t)
            m.allocate_slots(r, 1)
            r.num_computed_tokens += 1
        tables[k] = (m.get_block_ids("A"), m.block_pool.get_num_free_blocks())
    assert tables == {0: (([1, 2, 5, 7, 9], [0, 0, 0, 8, 10]), 24), 3: (([1, 2, 5, 7, 9], [0, 0, 6, 8, 10]), 23)}
    spec = SlidingWindowSpec(block_size=4, sliding_window=8, extra_retained_tokens=2)
    assert (spec.num_retained_tokens, spec.num_skipped_tokens(20), spec.max_admission_blocks_per_request(16, 512)) == (9, 11, 8)
    with pytest.raises(ValueError, match="extra_retained_tokens"):
        SlidingWindowSpec(sliding_window=8, extra_retained_tokens=-1)
