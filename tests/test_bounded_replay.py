"""DeepSeek-V4's two window options in vLLM 0.33: ``tokens_per_state`` (several tokens
compressed into one stored state) and ``bounded_replay`` (a window whose KV is never cached,
so a prefix hit is rewound by the window and those tokens recomputed).

Every expected value below was produced first by vLLM 0.33's own ``KVCacheManager``, driven
through the same calls with the scheduler's rewind done as vLLM's scheduler does it
(``_mark_prefix_replay``, the drop of a hit no longer than the window, the block alignment
of a connector's hit), and then by kvlab's engine.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, Request, Scheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.engine.llm_engine import build_engine
from kvlab.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec
from kvlab.outputs import KVConnectorOutput
from kvlab.request import RequestStatus
from scheduler_side_connector import SchedulerSideConnector

BASE = list(range(100, 140))


def _groups(window: int = 6) -> list:
    return [FullAttentionSpec(block_size=4), SlidingWindowMLASpec(block_size=4, sliding_window=window, bounded_replay=True)]


def _admit(eng, request: Request):
    """Add ``request`` and run it to the end; its admission's NewRequestData and step."""
    eng.add_request(request)
    first = None
    while eng.has_unfinished_requests():
        res = eng.step()
        for nr in res.scheduler_output.scheduled_new_reqs:
            if nr.req_id == request.request_id:
                first = (nr, res.scheduler_output.num_scheduled_tokens[nr.req_id])
    assert first is not None
    return first


# -- the specs ------------------------------------------------------------------------------------
def test_tokens_per_state_sets_the_page_size_as_vllm():
    # vLLM 0.33: a page holds block_size // tokens_per_state states (the same byte counts)
    assert MLAAttentionSpec(block_size=128, tokens_per_state=4).page_size_bytes == 36864
    assert MLAAttentionSpec(block_size=128).page_size_bytes == 147456
    whisper = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16", tokens_per_state=Fraction(1, 2))
    assert (whisper.num_states, whisper.page_size_bytes) == (32, 131072)
    assert whisper.to_dict()["tokens_per_state"] == "1/2"  # the event log is JSON


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "tokens_per_state=0 is out of range"),
        (Fraction(3, 2), ValueError, "an int >= 1 or a Fraction between 0 and 1, got 3/2"),
        (1.5, TypeError, "must be an int >= 1, got float 1.5"),
        (True, TypeError, "got a bool"),
    ],
)
def test_bad_tokens_per_state_is_refused(value, error, message):
    with pytest.raises(error, match=message):
        FullAttentionSpec(block_size=16, tokens_per_state=value)


def test_hits_must_land_on_the_compression():
    # vLLM 0.33's resolver: with blocks of 4 and 8, hits land on the scheduler block (8);
    # 16 tokens per state cannot resume there (vLLM's message, word for word)
    with pytest.raises(
        ValueError, match=r"prefix-cache boundaries must align with each spec's per-state compression. Got alignments=\[16\]"
    ):
        KVCacheManager(
            num_blocks=16, kv_cache_groups=[FullAttentionSpec(block_size=4), MLAAttentionSpec(block_size=8, tokens_per_state=16)]
        )
    ok = KVCacheManager(
        num_blocks=16, kv_cache_groups=[FullAttentionSpec(block_size=4), MLAAttentionSpec(block_size=8, tokens_per_state=8)]
    )
    assert (ok.coordinator.scheduler_block_size, ok.coordinator.hash_block_size) == (8, 4)


def test_bounded_replay_window_is_not_prefix_cached():
    spec = SlidingWindowMLASpec(block_size=4, sliding_window=6, bounded_replay=True)
    assert (spec.prefix_cacheable, spec.prefix_replay_tokens) == (False, 6)
    plain = SlidingWindowMLASpec(block_size=4, sliding_window=6)
    assert (plain.prefix_cacheable, plain.prefix_replay_tokens) == (True, 0)
    with pytest.raises(TypeError, match="bounded_replay must be True or False, got 'yes'"):
        SlidingWindowMLASpec(block_size=4, sliding_window=6, bounded_replay="yes")


def test_replay_windows_must_agree():
    groups = [FullAttentionSpec(block_size=4), *(SlidingWindowMLASpec(block_size=4, sliding_window=w, bounded_replay=True) for w in (6, 8))]
    with pytest.raises(ValueError, match=r"must share one sliding_window, got \[6, 8\]"):
        build_engine(num_blocks=24, block_size=4, manager_kwargs=dict(kv_cache_groups=groups))


# -- the scheduler's rewind -----------------------------------------------------------------------
def test_a_hit_is_rewound_by_the_window():
    eng = build_engine(num_blocks=24, block_size=4, max_num_batched_tokens=64, manager_kwargs=dict(kv_cache_groups=_groups()))
    nr, n = _admit(eng, Request("a", BASE[:20] + [1], max_tokens=1))
    assert (nr.num_computed_tokens, nr.replay_start, n) == (0, 0, 21)
    assert nr.block_ids == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    # b hits a's 20 tokens: the last 6 (14..19) are recomputed for the window, the full
    # group keeps its 5 cached blocks, the window group holds no cached block at all --
    # three nulls for the tokens below the window, then fresh blocks from position 12
    b = Request("b", BASE[:20] + [2], max_tokens=1)
    nr, n = _admit(eng, b)
    assert (nr.num_computed_tokens, nr.replay_start, n, b.num_cached_tokens) == (14, 14, 7, 20)
    assert nr.block_ids == ([1, 2, 3, 4, 5, 12], [0, 0, 0, 11, 10, 9])
    # a hit of 4 tokens is no longer than the window: all of it would be recomputed, so it
    # is dropped
    c = Request("c", BASE[:4] + [3, 4, 5], max_tokens=1)
    nr, n = _admit(eng, c)
    assert (nr.num_computed_tokens, nr.replay_start, n, c.num_cached_tokens) == (0, 0, 7, 0)
    assert nr.block_ids == ([9, 10], [11, 12])
    # a hit of 8: the replay (2..7) starts inside the first block, so no block is skipped
    d = Request("d", BASE[:9] + [6], max_tokens=1)
    nr, n = _admit(eng, d)
    assert (nr.num_computed_tokens, nr.replay_start, n, d.num_cached_tokens) == (2, 2, 8, 8)
    assert nr.block_ids == ([1, 2, 12], [11, 10, 8])
    free = [b.block_id for b in eng.scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free == [8, 10, 11, 12, 7, 6, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 5, 4, 3, 9, 2, 1]


def test_no_replay_without_a_replay_group():
    eng = build_engine(num_blocks=24, block_size=4, max_num_batched_tokens=64)
    _admit(eng, Request("a", BASE[:20] + [1], max_tokens=1))
    nr, n = _admit(eng, Request("b", BASE[:20] + [2], max_tokens=1))
    assert (nr.num_computed_tokens, nr.replay_start, n) == (20, 0, 1)


class _Remote(SchedulerSideConnector):
    """Offers ``offer`` tokens from elsewhere; ``groups``: what its load restores (None: the
    default, the prefix-cacheable groups, as a store addressed by block hashes)."""

    def __init__(self, offer: int, groups: tuple[int, ...] | None = None) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.offer, self.groups = offer, groups
        self.allocated: list = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.offer, False

    def get_loaded_kv_cache_group_ids(self, request):
        return super().get_loaded_kv_cache_group_ids(request) if self.groups is None else self.groups

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocated.append((blocks.get_block_ids(), num_external_tokens))


@pytest.mark.parametrize(
    ("offer", "groups", "expected"),
    [
        # a hash-addressed store holds no window: its 10 tokens are cut to whole blocks (8),
        # and the last 6 of them replayed
        (10, None, (2, 2, 19, ([1, 2, 5, 6, 7, 8], [3, 4, 9, 10, 11, 12]), 8, 8)),
        # 5 tokens are cut to 4, no longer than the window: dropped
        (5, None, (0, 0, 21, ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]), 0, 0)),
        # a transfer of the request's own blocks restores the window too: taken as it is
        (10, (0, 1), (10, 0, 11, ([1, 2, 3, 6, 7, 8], [0, 4, 5, 9, 10, 11]), 10, 10)),
    ],
)
def test_a_connector_hit_is_replayed_unless_its_load_restores_the_window(offer, groups, expected):
    connector = _Remote(offer, groups)
    eng = build_engine(
        num_blocks=24, block_size=4, max_num_batched_tokens=64, connector=connector, manager_kwargs=dict(kv_cache_groups=_groups())
    )
    eng.add_request(Request("x", list(range(100, 121)), max_tokens=1))
    res = eng.step()
    (nr,) = res.scheduler_output.scheduled_new_reqs
    stats = eng.scheduler.connector_prefix_cache_stats
    got = (nr.num_computed_tokens, nr.replay_start, res.scheduler_output.num_scheduled_tokens["x"], nr.block_ids)
    assert got + (connector.allocated[0][1], stats.hits) == expected
    assert (stats.queries, connector.allocated[0][0]) == (21, nr.block_ids)


def test_replay_only_chunks_make_progress():
    # vLLM's own case: chunks capped at one block, smaller than the 32-token window. The
    # first two chunks only replay (they allocate nothing: the hit's 6 blocks are adopted),
    # the third computes the 4 new tokens
    groups = [FullAttentionSpec(block_size=16), SlidingWindowMLASpec(block_size=16, sliding_window=32, bounded_replay=True)]
    eng = build_engine(num_blocks=64, block_size=16, long_prefill_token_threshold=16, manager_kwargs=dict(kv_cache_groups=groups))
    sched, mgr = eng.scheduler, eng.scheduler.kv_cache_manager
    eng.add_request(Request("first", [0] * 100, max_tokens=50))
    while sched.requests["first"].num_computed_tokens < 100:
        eng.step()
    eng.add_request(Request("second", [0] * 100, max_tokens=50))
    chunks, tables = [], []
    while sched.requests["second"].num_computed_tokens < 100:
        out = eng.step().scheduler_output
        for nr in out.scheduled_new_reqs:
            assert (nr.num_computed_tokens, nr.replay_start) == (64, 64)
        chunks.append(out.num_scheduled_tokens["second"])
        tables.append(len(mgr.get_blocks("second").blocks[0]))
    assert (chunks, tables) == ([16, 16, 4], [6, 6, 7])


@pytest.mark.parametrize(
    ("offer", "expected"),
    [
        # vLLM's own cases, with the load asynchronous: 64 tokens arrive; the replay is set
        # when the load is reported (32 computed, replayed from 32, 68 scheduled)
        (64, (True, 32, 32, 68)),
        # 63 tokens are cut to whole blocks (48) before the load starts
        (63, (True, 16, 16, 84)),
        # a hit no longer than the window is not loaded at all: computed from 0 at once
        (32, (False, 0, 0, 100)),
    ],
)
def test_an_asynchronous_hit_is_replayed_when_its_load_is_reported(offer, expected):
    class Later(_Remote):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.offer, True

    groups = [FullAttentionSpec(block_size=16), SlidingWindowMLASpec(block_size=16, sliding_window=32, bounded_replay=True)]
    mgr = KVCacheManager(64, 16, kv_cache_groups=groups)
    connector = Later(offer)
    sched = Scheduler(mgr, connector=connector)
    sched.add_request(Request("x", list(range(1000, 1100)), max_tokens=1))
    out = sched.schedule()
    waited = sched.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    if waited:
        assert out.num_scheduled_tokens == {}
        sched.update_from_output(out, {}, kv_connector_output=KVConnectorOutput(finished_recving={"x"}))
        out = sched.schedule()
    (nr,) = out.scheduled_new_reqs
    assert (waited, nr.num_computed_tokens, nr.replay_start, out.num_scheduled_tokens["x"]) == expected
    # the replay starts in a window block of its own, not in one the window group retired
    assert nr.block_ids[1][nr.replay_start // 16] != 0
    # what the connector was told to load at each admission: whole blocks, then nothing
    # more when the request is admitted again after the load; or nothing at all
    assert [n for _, n in connector.allocated] == {64: [64, 0], 63: [48, 0], 32: [0]}[offer]
