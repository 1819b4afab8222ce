"""Every KV-cache spec and manager of vLLM 0.33's core, with exact block ids.

Each scenario's numbers (hit lengths, hit blocks, new blocks, tables, ref counts, which blocks
are cached) were checked against vLLM 0.33.0's own ``KVCacheManager`` run side by side on the
same operations; kvlab's tests state them as facts. Block size 4 unless a spec says otherwise.
"""

from __future__ import annotations

import pytest

from kvlab import (
    ChunkedLocalAttentionSpec,
    EventLog,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    MLAAttentionSpec,
    Request,
    Scheduler,
    SlidingWindowSpec,
    replay,
)
from kvlab.core.kv_cache_utils import BlockHashListWithBlockSize, unify_kv_cache_spec_page_size
from kvlab.core.single_type_kv_cache_manager import SlidingWindowManager
from kvlab.timeline.snapshot import live_snapshot

P = list(range(100, 124))  # a 24-token prompt; scenarios use prefixes of it


def mgr(groups, num_blocks, **kw):
    log = EventLog()
    return KVCacheManager(num_blocks=num_blocks, block_size=4, kv_cache_groups=groups, event_log=log, **kw), log


def admit(m, rid, tokens, new=None, ext=0, la=0, gate=False, delay=False):
    """Lookup + allocation as the scheduler does it; returns (request, hit, hit ids, new ids)."""
    r = Request(rid, tokens)
    hits, n = m.get_computed_blocks(r)
    num_new = new if new is not None else len(tokens) - n - ext
    out = m.allocate_slots(
        r,
        num_new,
        n,
        hits,
        num_lookahead_tokens=la,
        num_external_computed_tokens=ext,
        full_sequence_must_fit=gate,
        delay_cache_blocks=delay,
    )
    if out is not None:
        r.num_computed_tokens = n + ext + num_new
    m.check_invariants()
    return r, n, hits.get_block_ids(), (out.get_block_ids() if out is not None else None)


def refs(m, ids):
    return [m.block_pool.blocks[i].ref_cnt for i in ids]


def cached(m, ids):
    return [m.block_pool.blocks[i].block_hash is not None for i in ids]


def free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def replay_matches(m, log):
    snap, live = replay(log), live_snapshot(m)
    assert snap.free_queue == live["free_queue"]
    assert [b.ref_cnt for b in snap.blocks] == live["ref_cnt"]
    assert [b.block_hash for b in snap.blocks] == live["hashes"]


# --- sliding windows ---------------------------------------------------------------------------
def test_window_of_one_token_caches_nothing_so_a_hybrid_never_hits():
    """vLLM 0.33: a W = 1 window needs no earlier block for a hit, so no block of the group is
    worth a cache entry; with no cached block the group cannot confirm any hit length, and a
    hybrid hit must hold in every group."""
    m, log = mgr([FullAttentionSpec(), SlidingWindowSpec(sliding_window=1)], 20)
    a, _, _, new = admit(m, "a", P[:12])
    assert new == ([1, 2, 3], [4, 5, 6])
    assert cached(m, range(1, 7)) == [True, True, True, False, False, False]
    m.free(a)
    assert free_ids(m) == [6, 5, 4] + list(range(7, 20)) + [3, 2, 1]
    _, n, hits, new = admit(m, "b", P[:12] + [9, 9])
    assert (n, hits, new) == (0, ([], []), ([6, 5, 4, 7], [8, 9, 10, 11]))
    replay_matches(m, log)


def test_window_of_one_with_eagle_nulls_every_skipped_hit_and_touches_none():
    """With EAGLE the window group needs one block more, so its blocks are cached; the hit
    then lies wholly outside the window: every position is the null block and no hit block of
    that group is touched (ref counts stay 0) -- vLLM's [0, 0, ...] table."""
    m, log = mgr([FullAttentionSpec(), SlidingWindowSpec(sliding_window=1)], 20, use_eagle=True)
    a, *_ = admit(m, "a", P[:12])
    assert cached(m, range(1, 7)) == [True] * 6
    m.free(a)
    _, n, hits, new = admit(m, "b", P[:12] + [9, 9])
    assert (n, hits, new) == (8, ([1, 2], [0, 0]), ([7, 8], [9, 10]))
    assert m.get_block_ids("b") == ([1, 2, 7, 8], [0, 0, 9, 10])
    assert refs(m, range(1, 10)) == [1, 1, 0, 0, 0, 0, 1, 1, 1]
    replay_matches(m, log)


def test_hits_past_the_window_are_nulled_and_not_touched_external_tokens():
    """A hit block the first computed token will not read (here: pushed out of the window by
    8 external tokens) becomes the null block and is not touched; only slots inside the window
    are allocated for the external tokens."""
    m, log = mgr([FullAttentionSpec(), SlidingWindowSpec(sliding_window=5)], 30)
    a, *_ = admit(m, "a", P[:9])
    m.free(a)
    b, n, hits, new = admit(m, "b", P[:8] + [7] * 8 + [1, 2], ext=8)
    assert (n, hits, new) == (8, ([1, 2], [0, 5]), ([8], [9]))
    assert m.get_block_ids("b") == ([1, 2, 6, 3, 8], [0, 0, 0, 7, 9])
    assert refs(m, [1, 2, 3, 5, 6, 7, 8, 9]) == [1, 1, 1, 0, 1, 1, 1, 1]  # 5: the skipped hit
    assert 5 in free_ids(m) and cached(m, [5]) == [True]
    replay_matches(m, log)


def test_several_windows_and_the_fixed_point_hit():
    """Two windows beside full attention: each kind shortens the candidate length until all
    accept it (vLLM's fixed point); every table is cut to the common length."""
    m, log = mgr([FullAttentionSpec(), SlidingWindowSpec(sliding_window=3), SlidingWindowSpec(sliding_window=9)], 40)
    a, *_ = admit(m, "a", P[:20])
    m.free(a)
    _, n, hits, _ = admit(m, "b", P[:20] + [1])
    assert n == 20
    # W = 3 needs 1 block before the hit end, W = 9 needs cdiv(8, 4) = 2
    assert hits == ([1, 2, 3, 4, 5], [0, 0, 0, 0, 10], [0, 0, 0, 14, 15])
    replay_matches(m, log)


# --- chunked local attention, MLA --------------------------------------------------------------
def test_chunked_local_attention_hits_only_its_own_chunk():
    m, log = mgr([FullAttentionSpec(), ChunkedLocalAttentionSpec(attention_chunk_size=8)], 30)
    a, *_ = admit(m, "a", P[:20])
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])  # finished chunks go at the next allocation
    a.append_output_token_ids(1)
    m.allocate_slots(a, 1)
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12])
    m.free(a)
    _, n, hits, new = admit(m, "b", P[:20] + [3])
    assert (n, hits, new) == (20, ([1, 2, 3, 4, 5], [0, 0, 0, 0, 10]), ([12], [11]))
    assert refs(m, range(1, 13)) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    replay_matches(m, log)


def test_chunked_local_skipped_tokens():
    m, _ = mgr([ChunkedLocalAttentionSpec(attention_chunk_size=8)], 5)
    g = m.coordinator.single_type_managers[0]
    assert [g.get_num_skipped_tokens(n) for n in (0, 7, 8, 13, 16)] == [0, 0, 8, 8, 16]


def test_mla_is_full_attention_for_the_block_manager():
    m, log = mgr([MLAAttentionSpec(), SlidingWindowSpec(sliding_window=8)], 30)
    a, *_ = admit(m, "a", P[:17])
    m.free(a)
    _, n, hits, new = admit(m, "b", P[:17] + [3])
    assert (n, hits, new) == (16, ([1, 2, 3, 4], [0, 0, 8, 9]), ([10], [5]))
    replay_matches(m, log)


def test_mla_bytes_per_token():
    """MLA caches one latent of 576 numbers per token, shared by all heads: no separate V."""
    mla = MLAAttentionSpec(block_size=16)
    gqa = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    assert mla.bytes_per_token == 576 * 2 and gqa.bytes_per_token == 2 * 8 * 128 * 2
    assert (mla.page_size_bytes, gqa.page_size_bytes) == (18432, 65536)
    assert MLAAttentionSpec(dtype="fp8").bytes_per_token == 576


# --- groups of different block sizes -----------------------------------------------------------
def test_block_size_resolution_lcm_and_gcd():
    m, _ = mgr(
        [
            FullAttentionSpec(block_size=4),
            SlidingWindowSpec(sliding_window=3, block_size=4),
            SlidingWindowSpec(sliding_window=40, block_size=12),
        ],
        40,
    )
    assert (m.scheduler_block_size, m.hash_block_size) == (12, 4)
    m2, _ = mgr([FullAttentionSpec(block_size=4), SlidingWindowSpec(sliding_window=3, block_size=12)], 10, enable_caching=False)
    assert (m2.scheduler_block_size, m2.hash_block_size) == (12, 12)  # no caching: hash at the LCM


def test_mixed_block_sizes_exact_scenario():
    """Hashes every 4 tokens; a 12-token block's hash is the last 4-token hash inside it.
    Hits are multiples of 12. The 4-token window group caches only the block that ends each
    12-token segment (a hit of a multiple of 12 reads only that one)."""
    groups = [
        FullAttentionSpec(block_size=4),
        SlidingWindowSpec(sliding_window=3, block_size=4),
        SlidingWindowSpec(sliding_window=40, block_size=12),
    ]
    m, log = mgr(groups, 40)
    a, _, _, new = admit(m, "a", P)
    assert new == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14])
    assert cached(m, range(1, 15)) == [True] * 6 + [False, False, True, False, False, True] + [True, True]
    assert m.block_pool.blocks[13].block_hash == a.block_hashes[2]  # tokens 0-11: the 3rd 4-token hash
    assert m.block_pool.blocks[14].block_hash == a.block_hashes[5]
    m.free(a)
    _, n, hits, new = admit(m, "b", P + [5])
    assert (n, hits, new) == (24, ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 12], [13, 14]), ([11], [10], [8]))
    assert refs(m, range(1, 18)) == [1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    replay_matches(m, log)


def test_block_hash_list_with_block_size_takes_the_last_small_hash():
    view = BlockHashListWithBlockSize([b"A", b"B", b"C", b"D", b"E"], 16, 32)
    assert (len(view), list(view), view[1], view[-1], view[0:2]) == (2, [b"B", b"D"], b"D", b"D", [b"B", b"D"])
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(ValueError, match="multiple"):
        BlockHashListWithBlockSize([], 16, 24)


def test_unify_page_size_grows_block_sizes_and_pads_mamba():
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)  # 64 KiB pages
    window = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=1024)  # 32 KiB
    mamba = MambaSpec(block_size=16, shapes=((3, 1024), (32, 64, 8)), dtypes=("bfloat16", "bfloat16"))
    out = unify_kv_cache_spec_page_size([full, window, mamba])
    assert [s.block_size for s in out] == [16, 32, 16]
    assert {s.page_size_bytes for s in out} == {65536}
    assert out[2].page_size_padded == 65536 and mamba.page_size_bytes == 2 * (3 * 1024 + 32 * 64 * 8)
    with pytest.raises(ValueError, match="does not divide"):
        unify_kv_cache_spec_page_size([full, FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=128)])


# --- Mamba -------------------------------------------------------------------------------------
def test_mamba_align_keeps_two_states_and_hits_one():
    m, log = mgr([FullAttentionSpec(), MambaSpec(block_size=4)], 30)
    a, _, _, new = admit(m, "a", P[:14], new=8)
    assert new == ([1, 2], [0, 3])  # the state after 8 tokens, in the block at position 1
    for n, want_new, want_table in ((4, ([4], [5]), ([1, 2, 4], [0, 3, 5])), (2, ([6], [7]), ([1, 2, 4, 6], [0, 0, 5, 7]))):
        assert m.allocate_slots(a, n).get_block_ids() == want_new
        a.num_computed_tokens += n
        assert m.get_block_ids("a") == want_table
        m.check_invariants()
    assert cached(m, range(1, 8)) == [True, True, True, True, True, False, False]  # 3 was freed, still cached
    m.new_step_starts()
    _, n, hits, new = admit(m, "b", P[:14] + [1])
    assert (n, hits, new) == (12, ([1, 2, 4], [0, 0, 5]), ([8], [9]))
    assert refs(m, range(1, 10)) == [2, 2, 0, 2, 2, 1, 1, 1, 1]
    replay_matches(m, log)


def test_mamba_state_cached_this_step_is_usable_only_next_step():
    m, _ = mgr([FullAttentionSpec(), MambaSpec(block_size=4)], 30)
    admit(m, "a", P[:9], new=8)  # a chunk ending on a block boundary saves the state after 8
    before = free_ids(m)
    _, n, _, new = admit(m, "b", P[:9] + [1])
    assert (n, new) == (8, None) and free_ids(m) == before  # vLLM: not before the step that writes it
    m.new_step_starts()
    _, n, hits, new = admit(m, "b2", P[:9] + [1])
    assert (n, hits) == (8, ([1, 2], [0, 3])) and new is not None


def test_mamba_none_mode_needs_caching_off_and_keeps_one_state():
    with pytest.raises(ValueError, match="align"):
        KVCacheManager(num_blocks=10, block_size=4, kv_cache_groups=[MambaSpec(mamba_cache_mode="none")])
    m = KVCacheManager(
        num_blocks=10, block_size=4, enable_caching=False, kv_cache_groups=[MambaSpec(mamba_cache_mode="none", block_size=64)]
    )
    r = Request("r", list(range(40)))
    assert m.allocate_slots(r, 40).get_block_ids() == ([1],)
    r.num_computed_tokens = 40
    assert m.allocate_slots(r, 1).get_block_ids() == ([],)
    m.check_invariants()


def test_scheduler_cuts_prefill_chunks_at_mamba_block_boundaries():
    m = KVCacheManager(num_blocks=60, block_size=4, kv_cache_groups=[FullAttentionSpec(), MambaSpec(block_size=4)])
    s = Scheduler(m, max_num_batched_tokens=10)
    r = Request("r", list(range(23)), max_tokens=2)
    s.add_request(r)
    chunks = []
    while r.num_computed_tokens < r.num_prompt_tokens:
        out = s.schedule()
        chunks.append(out.num_scheduled_tokens["r"])
        s.update_from_output(out, {"r": [1]})
        s.check_invariants()
    # 8 + 8 (block-aligned), 4 (stop at 20 = the last boundary before the final token), 3.
    assert chunks == [8, 8, 4, 3]


# --- EAGLE -------------------------------------------------------------------------------------
def test_eagle_drops_the_last_matched_block():
    m, _ = mgr([FullAttentionSpec()], 20, use_eagle=True)
    a, *_ = admit(m, "a", P[:13])
    m.free(a)
    _, n, hits, new = admit(m, "b", P[:13] + [1])
    assert (n, hits, new) == (8, ([1, 2],), ([4, 5],))


def test_eagle_in_a_hybrid():
    m, _ = mgr([FullAttentionSpec(), SlidingWindowSpec(sliding_window=5)], 30, use_eagle=True)
    a, *_ = admit(m, "a", P[:17])
    m.free(a)
    _, n, hits, new = admit(m, "b", P[:17] + [1])
    assert (n, hits, new) == (12, ([1, 2, 3], [0, 0, 8]), ([10, 5], [11, 12]))


# --- external tokens, lookahead, empty prompt ------------------------------------------------------
def test_external_tokens_get_blocks_and_are_cached_unless_delayed():
    m, log = mgr([FullAttentionSpec()], 20)
    r, _, _, new = admit(m, "a", P[:13], ext=8, delay=True)
    assert new == ([3, 4],) and m.get_block_ids("a") == ([1, 2, 3, 4],)  # 1, 2 receive the connector's KV
    assert cached(m, range(1, 5)) == [False] * 4
    m.cache_blocks(r, 13)  # the transfer finished: now the blocks may serve hits
    assert cached(m, range(1, 5)) == [True, True, True, False]
    _, n, hits, _ = admit(m, "b", P[:13])
    assert (n, hits) == (12, ([1, 2, 3],))
    replay_matches(m, log)


def test_external_tokens_refused_leave_nothing_behind():
    m, _ = mgr([FullAttentionSpec(), MambaSpec(block_size=4)], 6)
    before = (free_ids(m), refs(m, range(6)))
    # vLLM 0.33 counts one Mamba block here and fails half-way; kvlab counts both.
    _, _, _, new = admit(m, "a", list(range(60)), new=10, ext=40)
    assert new is None and (free_ids(m), refs(m, range(6))) == before


def test_empty_prompt_with_lookahead_slots():
    """vLLM's manager allocates for a request with no prompt (e.g. a draft's lookahead)."""
    m = KVCacheManager(num_blocks=10, block_size=4)
    r = Request("0", [])
    assert m.allocate_slots(r, 3, num_lookahead_tokens=2).get_block_ids() == ([1, 2],)
    assert KVCacheManager(num_blocks=10, block_size=4).allocate_slots(Request("1", []), 3, num_lookahead_tokens=4).get_block_ids() == (
        [1, 2],
    )
    with pytest.raises(ValueError, match="must not be empty"):
        Scheduler(KVCacheManager(num_blocks=10, block_size=4)).add_request(Request("e", []))


# --- the admission gate ----------------------------------------------------------------------------
def test_gate_refuses_what_the_whole_prompt_cannot_fit():
    m, _ = mgr([FullAttentionSpec()], 6)
    admit(m, "x", P[:8])
    before = free_ids(m)
    _, _, _, new = admit(m, "g", list(range(300, 320)), new=4, gate=True)  # 5 blocks, 3 free
    assert new is None and free_ids(m) == before
    _, _, _, new = admit(m, "g2", list(range(300, 320)), new=4)  # first chunk fits
    assert new == ([3],)


def test_gate_counts_prefix_hits():
    m, _ = mgr([FullAttentionSpec()], 8)
    x, *_ = admit(m, "x", P[:16])
    m.free(x)
    admit(m, "y", list(range(400, 408)))
    _, n, _, new = admit(m, "g", P[:16] + [1] * 4, new=4, gate=True)  # 4 evictable hits + 1 new = 5 free
    assert (n, new) == (16, ([7],))


@pytest.mark.parametrize("in_flight, admitted", [(4, True), (None, False)])
def test_gate_counts_at_most_what_a_window_holds(in_flight, admitted):
    """A window group never holds the whole prompt: the gate counts at most W - 1 tokens plus
    one step in flight (+1 block), vLLM's max_admission_blocks_per_request."""
    m, _ = mgr([FullAttentionSpec(), SlidingWindowSpec(sliding_window=4)], 10, max_in_flight_tokens=in_flight)
    _, _, _, new = admit(m, "g", list(range(300, 324)), new=4, gate=True)  # 6 + min(6, 3) vs 6 + 6; 9 free
    assert (new is not None) == admitted


# --- prompt embeddings -----------------------------------------------------------------------------
def test_prompt_embeddings_go_into_the_hash():
    np = pytest.importorskip("numpy")
    rows = [[0.5 * i, -1.0, 2.0] for i in range(8)]
    same_list = Request("a", [0] * 8, prompt_embeds=rows)
    same_np = Request("b", [0] * 8, prompt_embeds=np.asarray(rows, dtype=np.float32))
    other = Request("c", [0] * 8, prompt_embeds=[[9.0, 9.0, 9.0]] + rows[1:])
    plain = Request("d", [0] * 8)
    m = KVCacheManager(num_blocks=10, block_size=4)
    for r in (same_list, same_np, other, plain):
        m.get_computed_blocks(r)
    assert same_list.block_hashes == same_np.block_hashes  # float32 rows: the same bytes
    assert other.block_hashes[0] != same_list.block_hashes[0] and other.block_hashes[1] != same_list.block_hashes[1]
    assert plain.block_hashes[0] != same_list.block_hashes[0]
    from kvlab.core.kv_cache_utils import generate_block_hash_extra_keys

    ((tag, digest),) = generate_block_hash_extra_keys(same_np, 4, 8)
    import hashlib

    assert tag == "prompt_embeds" and digest == hashlib.sha256(np.asarray(rows[4:8], dtype=np.float32).tobytes()).digest()
    # prompts of placeholder ids: only the embeddings tell them apart
    m2 = KVCacheManager(num_blocks=10, block_size=4)
    first = Request("f", [0] * 9, prompt_embeds=rows + [[1.0, 1.0, 1.0]])
    admit_hits = m2.get_computed_blocks(first)
    m2.allocate_slots(first, 9, admit_hits[1], admit_hits[0])
    assert m2.get_computed_blocks(Request("g", [0] * 9, prompt_embeds=rows + [[3.0, 3.0, 3.0]]))[1] == 8
    assert m2.get_computed_blocks(Request("h", [0] * 9))[1] == 0


def test_an_embeddings_only_prompt_has_placeholder_ids_and_hashes_its_rows():
    """vLLM 0.33: prompt_token_ids=None with prompt_embeds -- the positions hold id 0, and the
    hashes equal those of the same rows given with explicit zeros; the digest of a block is
    SHA-256 of tensor_data(rows), the bytes vLLM's tensor_data gives."""
    np = pytest.importorskip("numpy")
    from kvlab.core.kv_cache_utils import generate_block_hash_extra_keys, get_request_block_hasher, tensor_data
    from kvlab.utils.hashing import get_hash_fn_by_name

    rows = np.arange(15, dtype=np.float32).reshape(5, 3)
    hasher = get_request_block_hasher(2, get_hash_fn_by_name("sha256"))
    only = Request("e", None, prompt_embeds=rows, block_hasher=hasher)
    zeros = Request("z", [0] * 5, prompt_embeds=rows, block_hasher=hasher)
    assert only.prompt_token_ids == [0] * 5 and only.num_prompt_tokens == 5 and len(only.block_hashes) == 2
    assert only.block_hashes == zeros.block_hashes
    import hashlib

    assert tensor_data(rows[2:4]) == rows[2:4].tobytes() and len(tensor_data(rows[2:4])) == 24
    assert generate_block_hash_extra_keys(only, 2, 4) == (("prompt_embeds", hashlib.sha256(rows[2:4].tobytes()).digest()),)
    with pytest.raises(TypeError, match="prompt_token_ids must be a sequence of ints, got NoneType"):
        Request("n", None)


# --- the multimodal resume rule ------------------------------------------------------------------
def test_block_completed_by_generated_tokens_keeps_every_overlapping_image():
    """vLLM >= 0.31 resumes at the first item overlapping the block; vLLM <= 0.30 resumed at
    the LAST item only, so an earlier image overlapping the same block was left out."""
    from kvlab import MultiModalFeature
    from kvlab.core.kv_cache_utils import get_request_block_hasher
    from kvlab.utils.hashing import sha256

    feats = [MultiModalFeature("img-a", 18, 4), MultiModalFeature("img-b", 24, 4)]
    results = {}
    for rule in ("window", "last"):
        hasher = get_request_block_hasher(16, sha256, mm_resume=rule)
        gen = Request("gen", list(range(30)), mm_features=feats, block_hasher=hasher)
        gen.append_output_token_ids([7, 7])  # completes block 1 [16, 32) with generated tokens
        again = Request("again", list(range(30)) + [7, 7, 7], mm_features=feats, block_hasher=hasher)  # the same block, from a prompt
        results[rule] = gen.block_hashes[1] == again.block_hashes[1]
    assert results == {"window": True, "last": False}


# --- the real-model path stays small ----------------------------------------------------------
def test_runner_refuses_specs_it_does_not_model():
    pytest.importorskip("torch")
    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    model = TinyLlama(TinyLlamaConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32), seed=0)
    for spec in (MambaSpec(), ChunkedLocalAttentionSpec(attention_chunk_size=8), MLAAttentionSpec()):
        with pytest.raises(ValueError, match="simulated"):
            ModelRunner(model, num_blocks=8, block_size=4, kv_cache_groups=[FullAttentionSpec(), spec])


def test_sliding_window_manager_constructor_keeps_its_positional_form():
    spec = SlidingWindowSpec(sliding_window=32, block_size=16)
    m = SlidingWindowManager(spec, KVCacheManager(num_blocks=3).block_pool, 0)
    assert m.get_num_skipped_tokens(50) == 19


# --- an MLA window and hidden states (vLLM 0.33) ---------------------------------------------------
def test_an_mla_window_is_a_window_with_mla_bytes_and_hidden_states_are_full_attention():
    """``SlidingWindowMLASpec`` keeps MLA's one latent per token (576 x 2 bytes in bf16) and
    frees like a window; ``HiddenStateCacheSpec`` is laid out like MLA and managed as full
    attention. Their KV events name them as vLLM 0.33 does (a differential with vLLM's
    manager over both, with rings beside them, found no difference in any event field)."""
    from kvlab.kv_cache_interface import (
        HiddenStateCacheSpec,
        SlidingWindowMLASpec,
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    mla_window = SlidingWindowMLASpec(sliding_window=8)
    assert (mla_window.bytes_per_token, get_kv_cache_spec_kind(mla_window), get_kv_cache_spec_sliding_window(mla_window)) == (
        1152,
        "sliding_window_mla",
        8,
    )
    assert get_kv_cache_spec_kind(HiddenStateCacheSpec()) == "mla_attention"
    tables = []
    for window, full in (
        (SlidingWindowMLASpec(sliding_window=8), HiddenStateCacheSpec()),
        (SlidingWindowSpec(sliding_window=8), FullAttentionSpec()),
    ):
        m, _ = mgr([full, window], 30)
        r, n, _, _ = admit(m, "A", P[:18])
        r.num_computed_tokens = 18
        for t in range(6):
            r.append_output_token_ids(t)
            m.allocate_slots(r, 1)
            r.num_computed_tokens += 1
        tables.append(m.get_block_ids("A"))
    assert tables[0] == tables[1] == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12])  # as vLLM 0.33 gave
