"""Resumable requests: vLLM 0.33's streaming-input sessions. A session's turn ends without
finishing; it keeps its blocks and computed tokens, and its next chunk (a request with the
same id) is prefilled on top of them. The first test's figures are vLLM 0.33.0's own: the
same calls on its Scheduler (prefix caching on, 20 blocks of 4 tokens) give the same
statuses, tokens, block ids and free-block counts."""

from __future__ import annotations

from typing import Any

import pytest

from kvlab import Request
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import hash_block_tokens, init_none_hash
from kvlab.core.sched.scheduler import Scheduler
from kvlab.eventlog import EventLog
from kvlab.kv_cache_interface import FullAttentionSpec
from kvlab.request import MultiModalFeature, RequestStatus, StreamingUpdate
from kvlab.timeline import Timeline
from kvlab.utils.hashing import sha256

BS = 4


def make(num_blocks: int = 20, log: EventLog | None = None, **kw: Any) -> Scheduler:
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=BS, kv_cache_groups=[FullAttentionSpec()], max_model_len=1024, event_log=log)
    return Scheduler(
        mgr,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 8192),
        max_num_seqs=kw.pop("max_num_seqs", 16),
        max_model_len=1024,
        **kw,
    )


def chunk(rid: str, prompt: Any, max_tokens: int, resumable: bool = True, **kw: Any) -> Request:
    return Request(rid, list(prompt), max_tokens=max_tokens, resumable=resumable, **kw)


def step(s: Scheduler, sampled: dict[str, int]) -> tuple[dict[str, int], list[tuple[str, str | None]]]:
    out = s.schedule()
    fin = s.update_from_output(out, {r: [sampled[r]] for r in out.num_scheduled_tokens if r in sampled})
    s.check_invariants()
    return dict(out.num_scheduled_tokens), [(r.request_id, r.finish_reason) for r in fin]


def state(s: Scheduler, rid: str = "s") -> tuple:
    r = s.requests[rid]
    return (
        r.status.name,
        r.num_computed_tokens,
        list(r.prompt_token_ids),
        list(r.output_token_ids),
        s.kv_cache_manager.get_block_ids(rid)[0],
    )


def free(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_session_keeps_its_blocks_between_turns_as_in_vllm():
    s = make()
    s.add_request(chunk("s", range(1, 7), 3))
    assert [step(s, {"s": t}) for t in (100, 101, 102)] == [({"s": 6}, []), ({"s": 1}, []), ({"s": 1}, [])]
    # The turn ended (max_tokens): no finish, its 8 computed tokens stay in blocks 1 and 2.
    assert state(s) == ("WAITING_FOR_STREAMING_REQ", 8, [1, 2, 3, 4, 5, 6], [100, 101, 102], [1, 2])
    assert (free(s), s.get_num_unfinished_requests(), s.has_unfinished_requests(), s.num_waiting_for_streaming_input) == (17, 0, False, 1)
    assert (s.make_stats().num_waiting_reqs, s.get_request_counts()) == (0, (0, 1))  # waiting for input, not to run
    # The next chunk: the output but its last token (102, never computed) becomes prompt.
    s.add_request(chunk("s", [7, 8, 9], 2))
    assert state(s) == ("WAITING", 8, [1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9], [], [1, 2])
    assert (free(s), s.get_num_unfinished_requests(), s.has_unfinished_requests()) == (17, 1, True)
    assert step(s, {"s": 103}) == ({"s": 3}, [])  # only the chunk is prefilled: no lookup, no recompute
    assert state(s) == ("RUNNING", 11, [1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9], [103], [1, 2, 3])
    # A chunk that arrives while the turn runs waits for the turn's end.
    s.add_request(chunk("s", [10, 11, 12, 13, 14], 1))
    assert len(s.requests["s"].streaming_queue) == 1
    assert step(s, {"s": 104}) == ({"s": 1}, [])
    assert state(s) == ("WAITING", 12, [1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9, 103, 10, 11, 12, 13, 14], [], [1, 2, 3])
    assert step(s, {"s": 105}) == ({"s": 5}, [])
    assert state(s) == (
        "WAITING_FOR_STREAMING_REQ",
        17,
        [1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9, 103, 10, 11, 12, 13, 14],
        [105],
        [1, 2, 3, 4, 5],
    )
    assert free(s) == 14
    # Its blocks are cached as it goes: another request hits the session's first two.
    other = chunk("o", [1, 2, 3, 4, 5, 6, 100, 101, 7], 1, resumable=False)
    s.add_request(other)
    assert step(s, {"o": 500}) == ({"o": 1}, [("o", "length")])
    assert other.num_cached_tokens == 8
    # A request that is not resumable closes the session: aborted between turns, blocks freed.
    session = s.requests["s"]
    s.add_request(chunk("s", [0], 1, resumable=False))
    assert (session.status, session.finish_reason, s.requests, free(s)) == (RequestStatus.FINISHED_ABORTED, "abort", {}, 19)
    assert s.num_waiting_for_streaming_input == 0


def test_a_close_queued_while_the_turn_runs_finishes_it_at_the_turn_end():
    s = make()
    s.add_request(chunk("s", range(1, 7), 2))
    step(s, {"s": 100})
    s.add_request(chunk("s", [0], 1, resumable=False))
    assert step(s, {"s": 101}) == ({"s": 1}, [("s", "length")])
    assert (s.requests, free(s), s.num_waiting_for_streaming_input) == ({}, 19, 0)


def test_the_dropped_token_leaves_no_hash_behind():
    """Three prompt tokens and a sampled one fill block 0 and give it a hash; the token is
    dropped with the next chunk, so block 0's hash is computed again over the new tokens."""
    init_none_hash(sha256)
    s = make()
    s.add_request(chunk("s", [1, 2, 3], 1))
    step(s, {"s": 999})
    session = s.requests["s"]
    stale = session.block_hashes[0]
    s.add_request(chunk("s", [42], 1))
    assert session.all_token_ids == [1, 2, 3, 42] and len(session.block_hashes) == 1
    assert session.block_hashes[0] == hash_block_tokens(sha256, None, (1, 2, 3, 42)) != stale


def test_a_chunks_images_are_placed_after_the_kept_tokens():
    s = make()
    img = MultiModalFeature("a", offset=1, length=1)
    s.add_request(chunk("s", [1, 2, 3], 1, mm_features=[img]))
    step(s, {"s": 10})
    s.add_request(chunk("s", [4, 5, 6, 7], 1, mm_features=[MultiModalFeature("b", offset=2, length=1)]))
    assert [(f.identifier, f.offset) for f in s.requests["s"].mm_features] == [("a", 1), ("b", 5)]  # 2 + 3 kept tokens


def test_a_session_between_turns_keeps_its_seat():
    """It holds a place among max_num_seqs (vLLM keeps its model-runner slot)."""
    s = make(max_num_seqs=1)
    s.add_request(chunk("s", range(1, 7), 1))
    step(s, {"s": 100})
    s.add_request(chunk("o", [9, 9], 1, resumable=False))
    assert step(s, {}) == ({}, [])
    s.add_request(chunk("s", [0], 1, resumable=False))  # closed: the seat is free
    assert step(s, {"o": 1}) == ({"o": 2}, [("o", "length")])


def test_bad_chunks_are_refused_and_change_nothing():
    s = make(num_blocks=8)
    s.add_request(chunk("s", range(1, 7), 1, cache_salt="u1"))
    step(s, {"s": 100})
    before = state(s)
    for bad, message in (
        (chunk("s", [7], 1, cache_salt="u2"), r"share its cache_salt \('u1'\), got 'u2'"),
        (chunk("s", [7], 1, cache_salt="u1", lora_name="a", lora_path="/a"), "share its lora_name"),
        (chunk("s", list(range(30)), 1, cache_salt="u1"), "needs 9 blocks, the pool has 7"),
        (chunk("s", list(range(2000)), 1, cache_salt="u1"), "would be 2006 tokens, not below max_model_len 1024"),
    ):
        with pytest.raises(ValueError, match=message):
            s.add_request(bad)
        assert state(s) == before and s.num_waiting_for_streaming_input == 1
    with pytest.raises(ValueError, match=r"needs resumable=True"):
        s2 = make()
        s2.add_request(chunk("x", [1], 1, resumable=False))
        s2.add_request(chunk("x", [2], 1))
    with pytest.raises(ValueError, match="no open streaming session has id 'y'"):
        s.add_streaming_update(chunk("y", [1], 1))
    with pytest.raises(TypeError, match="resumable must be True or False"):
        Request("z", [1], resumable=1)
    with pytest.raises(ValueError, match="cannot carry prompt_embeds"):
        Request("z", [1], resumable=True, prompt_embeds=[[0.0]])


def test_a_chunk_undone_half_way_leaves_the_session_as_it_was():
    log = EventLog()
    s = make(log=log)
    s.add_request(chunk("s", range(1, 7), 1))
    step(s, {"s": 100})
    session = s.requests["s"]
    before = (state(s), list(session.block_hashes), len(log))

    def boom(e: Any) -> None:
        if e.kind == "request_resumed":
            raise RuntimeError("a subscriber fails")

    log.subscribe(boom)
    with pytest.raises(RuntimeError, match="a subscriber fails"):
        s.add_request(chunk("s", [7, 8], 1))
    log.unsubscribe(boom)
    assert (state(s), list(session.block_hashes), len(log)) == before
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ and s.num_waiting_for_streaming_input == 1
    s.check_invariants()
    s.add_request(chunk("s", [7, 8], 1))
    assert step(s, {"s": 101}) == ({"s": 2}, [])


def two_turns() -> EventLog:
    """The event log of a session's two turns of one token each, an idle step between."""
    log = EventLog()
    s = make(log=log)
    s.add_request(chunk("s", range(1, 7), 1))
    step(s, {"s": 100})
    step(s, {})
    s.add_request(chunk("s", [7, 8], 1))
    step(s, {"s": 101})
    return log


def test_the_timeline_shows_the_session_paused_between_turns():
    log = two_turns()
    kinds = [(e.kind, e.step) for e in log.events if e.kind in ("request_paused", "request_resumed")]
    assert kinds == [("request_paused", 1), ("request_resumed", 2), ("request_paused", 3)]
    tl = Timeline(log)
    assert tl.lifecycles["s"] == [(0, "waiting"), (1, "running"), (1, "paused"), (2, "waiting"), (3, "running"), (3, "paused")]
    v = tl.at(2).requests["s"]
    assert (v.status, v.num_prompt_tokens, v.num_computed_tokens, v.num_output_tokens, v.block_table) == ("waiting", 8, 6, 0, [[1, 2]])


def test_streaming_update_from_request():
    assert StreamingUpdate.from_request(chunk("s", [1], 1, resumable=False)) is None
    u = StreamingUpdate.from_request(chunk("s", [1, 2], 5, eos_token_id=7))
    assert (u.prompt_token_ids, u.max_tokens, u.eos_token_id) == ((1, 2), 5, 7)


def test_a_session_on_the_real_model_answers_as_if_it_had_read_the_whole_conversation():
    """Turn two reads turn one's K/V from the session's blocks (no recompute) and must give
    the greedy tokens of a dense forward over the whole conversation so far."""
    import torch

    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)
    mgr = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=True)
    eng = LLMEngine(mgr, Scheduler(mgr), ModelRunner(model, num_blocks=64, block_size=BS))
    p1, p2 = list(b"Paged attention, "), list(b"and more")
    eng.add_request(Request("s", p1, max_tokens=4, resumable=True))
    eng.run()
    session = eng.scheduler.requests["s"]
    turn1 = list(session.output_token_ids)
    assert turn1 == model.generate_dense(p1, 4) and session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    eng.add_request(Request("s", p2, max_tokens=4, resumable=True))
    eng.run()
    assert session.output_token_ids == model.generate_dense(p1 + turn1[:-1] + p2, 4)
    assert eng.metrics["s"].prefill_tokens_computed == len(p1) + len(p2)  # 17 + 8: nothing computed twice
    eng.add_request(Request("s", [0], resumable=False))
    assert eng.finished["s"] is session and session.finish_reason == "abort" and not eng.has_unfinished_requests()


def test_the_gantt_draws_a_paused_session_in_its_own_colour():
    from kvlab.viz import timeline as timeline_view
    from kvlab.viz.style import STATUS_COLORS, STATUS_ORDER

    tl = Timeline(two_turns())
    run = timeline_view.run_data(tl)
    assert run["status"]["s"] == ["waiting", "paused", "waiting", "paused"]  # at the end of steps 0-3
    z = timeline_view.figure_data(tl.at(2), "s", run=run)["z"][0]
    assert [STATUS_ORDER[i] for i in z] == ["waiting", "paused", "waiting", "paused"]
    assert STATUS_COLORS["paused"] not in {STATUS_COLORS[k] for k in STATUS_ORDER if k != "paused"}


def test_a_queued_chunk_that_can_never_fit_ends_the_session_at_its_turn_end():
    """vLLM 0.33 would keep such a session forever, holding its blocks; kvlab ends it."""
    log = EventLog()
    s = make(num_blocks=8, log=log)  # 7 usable blocks: 28 tokens
    s.add_request(chunk("s", range(1, 7), 2))
    step(s, {"s": 100})
    s.add_request(chunk("s", list(range(25)), 1))  # queued: the turn still runs
    assert step(s, {"s": 101}) == ({"s": 1}, [("s", "length")])
    assert (s.requests, free(s)) == ({}, 7)
    assert [e.kind for e in log.events if e.kind in ("request_paused", "request_resumed", "request_finished")] == ["request_finished"]


def test_the_priority_heap_compares_requests_as_they_are_now_as_vllms_does():
    """vLLM 0.33's heap holds the requests and compares their live fields; a session's chunk
    changes its arrival_time while it waits, and the heap is not re-ordered. Checked on
    vLLM 0.33.0's PriorityRequestQueue: a, c, b."""
    from kvlab.core.sched.request_queue import PriorityRequestQueue

    q = PriorityRequestQueue()
    a, b, c = (Request(rid, [1], arrival_time=t) for rid, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
    for r in (a, b, c):
        q.add_request(r)
    c.arrival_time = 0.5  # as a chunk does to a waiting session
    assert [r.request_id for r in q] == ["a", "c", "b"]
    assert [q.pop_request().request_id for _ in range(3)] == ["a", "c", "b"]
