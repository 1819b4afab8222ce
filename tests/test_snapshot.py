"""Snapshots rebuilt from the event log: exact facts at named steps, JSON, replay == live.

The views draw snapshots and nothing else, so a snapshot must say exactly what the engine
would say. Three kinds of checks:

* the shared-prefix story of vLLM's documentation, block id for block id, at its named
  steps (states, ref counts, free-queue order, tables, the hash chain);
* JSON round trips of snapshots and of whole event logs;
* replaying the log after every ``engine.step()`` reproduces the live objects' facts
  (``live_snapshot``) on runs with preemptions and prefix hits, under FCFS and priority,
  and on a hybrid full + sliding-window manager -- also through a ``Timeline`` that is
  refreshed as the log grows, as the live player uses it.
"""

from __future__ import annotations

import random

import pytest

from kvlab import FullAttentionSpec, MambaSpec, Request, SlidingWindowSpec
from kvlab.engine.llm_engine import build_engine
from kvlab.scenarios import SYSTEM_48, preemption, shared_prefix, sliding_window
from kvlab.eventlog.events import EventLog
from kvlab.timeline.snapshot import (
    CACHED,
    FREE,
    IN_USE,
    NULL,
    SHARED,
    Snapshot,
    live_snapshot,
)
from kvlab.timeline.timeline import Timeline, replay
from kvlab.worker.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def story():
    return shared_prefix()


def states(snap: Snapshot) -> list[str]:
    return [b.state for b in snap.blocks]


def refs(snap: Snapshot) -> list[int]:
    return [b.ref_cnt for b in snap.blocks]


# -- the shared-prefix story, step by step ----------------------------------------------------
def test_req0_prefill_takes_blocks_1_to_4(story) -> None:
    s = story.at("req0 prefill")
    assert s.requests["req0"].block_table == [[1, 2, 3, 4]]
    assert states(s) == [NULL] + [IN_USE] * 4 + [FREE] * 6
    assert refs(s) == [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    # Blocks 1-3 are full (48 tokens) and hashed; block 4 holds 7 prompt tokens + 1 output.
    assert [b.block_hash is not None for b in s.blocks[1:5]] == [True, True, True, False]
    assert s.free_queue == [5, 6, 7, 8, 9, 10]
    assert s.running == ["req0"] and s.waiting == ["req1"]


def test_req1_hits_the_shared_prefix(story) -> None:
    s = story.at("req1 prefix hit")
    assert s.requests["req1"].block_table == [[1, 2, 3, 5]]
    assert states(s) == [NULL, SHARED, SHARED, SHARED, IN_USE, IN_USE] + [FREE] * 5
    assert refs(s)[:6] == [0, 2, 2, 2, 1, 1]
    assert s.blocks[1].owners == ["req0", "req1"]
    assert s.free_queue == [6, 7, 8, 9, 10]
    lk = s.last_lookup
    assert lk is not None and lk.request_id == "req1"
    assert (lk.num_hit_blocks, lk.num_hit_tokens, lk.max_hit_tokens) == (3, 48, 52)
    assert lk.hit_block_ids == [[1, 2, 3]]
    assert s.scheduled == {"req0": 1, "req1": 5} and s.scheduled_phase == {"req0": "running", "req1": "new"}


def test_free_queue_after_both_finish(story) -> None:
    after_req0 = story.at("req0 freed")
    assert after_req0.free_queue == [4, 6, 7, 8, 9, 10]  # req0's partial tail goes to the head
    assert refs(after_req0)[1:4] == [1, 1, 1]  # still held by req1
    s = story.at("both freed")
    assert s.free_queue == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert states(s) == [NULL, CACHED, CACHED, CACHED] + [FREE] * 7
    assert [s.blocks[b].free_position for b in (5, 4, 1)] == [0, 1, 9]
    assert s.running == [] and s.finished == ["req1"]
    assert s.requests["req0"].status == "finished" and s.requests["req0"].block_table == [[]]


def test_cached_prefix_is_one_hash_chain(story) -> None:
    s = story.at("both freed")
    assert len(s.hash_nodes) == 3
    (root,) = s.roots()
    chain = [root]
    while kids := s.children(chain[-1].block_hash):
        assert len(kids) == 1
        chain.append(kids[0])
    assert [n.block_ids for n in chain] == [[1], [2], [3]]
    tok = ByteTokenizer()
    assert [tok.decode(n.token_ids) for n in chain] == [SYSTEM_48[i : i + 16] for i in (0, 16, 32)]
    assert chain[0].parent_hash is None and chain[1].parent_hash == chain[0].block_hash


def test_req2_hits_again_then_long_request_evicts_in_queue_order(story) -> None:
    s = story.at("req2 hit")
    assert s.requests["req2"].block_table == [[1, 2, 3, 5]]
    assert s.free_queue == [4, 6, 7, 8, 9, 10]
    assert story.at("req2 freed").free_queue == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    before = set(story.at("req2 freed").hash_nodes)
    s = story.at("long request evicts")
    assert s.requests["long"].block_table == [[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]
    assert s.free_queue == [] and states(s)[1:] == [IN_USE] * 10
    evictions = [e for e in s.step_events if e.startswith("evict")]
    assert [e.split()[2] for e in evictions] == ["3", "2", "1"]  # the prefix's tail goes first
    assert not before & set(s.hash_nodes)  # the shared prefix is gone from the cache


def test_pretty_print_shows_the_pool_and_queue(story) -> None:
    text = story.at("both freed").pretty_print()
    assert "pool  [∅ccc.......]" in text
    assert "free queue (evict next → last): [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]" in text


def test_preemption_snapshot_fcfs() -> None:
    sc = preemption("fcfs")
    s = sc.at("preempted")
    assert s.preempted == ["Q"] and s.running == ["P"] and s.waiting == ["Q", "R"]
    q = s.requests["Q"]
    assert (q.status, q.num_computed_tokens, q.num_preemptions, q.block_table) == ("preempted", 0, 1, [[]])
    assert s.requests["P"].block_table == [[1, 2, 3, 4, 8]]
    assert s.free_queue == [7, 6, 5]  # Q's cached blocks, its tail first
    assert all(s.blocks[b].state == CACHED for b in (5, 6, 7))
    r = sc.at("resumed with hits")
    assert r.scheduled_phase["Q"] == "resumed"
    assert r.requests["Q"].block_table[0][:2] == [5, 6]  # its own surviving blocks


def test_sliding_window_snapshot_has_null_padding() -> None:
    sc = sliding_window()
    s = sc.at("blocks leave the window")
    assert s.requests["S1"].block_table == [[1, 2, 3, 4, 9], [0, 0, 7, 8, 10]]
    assert s.free_queue[-2:] == [6, 5] and s.blocks[5].state == CACHED
    s = sc.at("S2 hit with null padding")
    assert s.requests["S2"].block_table == [[1, 2, 3, 4, 11], [0, 0, 7, 8, 12]]
    assert [s.blocks[b].state for b in (1, 2, 3, 4, 7, 8)] == [SHARED] * 6
    assert s.groups[1]["sliding_window"] == 32


# -- JSON ---------------------------------------------------------------------------------------
def test_snapshot_json_round_trip(story) -> None:
    t = story.timeline()
    for step in t.steps:
        snap = t.at(step)
        back = Snapshot.from_json(snap.to_json())
        assert back == snap, f"step {step}"


def test_event_log_json_round_trip_replays_identically(story, tmp_path) -> None:
    log = story.log
    again = EventLog.from_json(log.to_json())
    assert len(again) == len(log) and again.step == log.step
    assert [e.to_dict() for e in again] == [e.to_dict() for e in log]
    path = tmp_path / "log.json"
    log.save(str(path))
    loaded = EventLog.load(str(path))
    t1, t2 = Timeline(log), Timeline(loaded)
    assert t1.steps == t2.steps
    for step in t1.steps:
        assert t1.at(step) == t2.at(step)


def test_unknown_event_kind_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        EventLog.from_json('{"version": 1, "step": 0, "events": [{"kind": "nope", "seq": 0, "step": 0}]}')


# -- replay == live -----------------------------------------------------------------------------
def _workload(seed: int, n: int, block_size: int, priorities: bool) -> list[Request]:
    """Requests sharing a few prefixes (so there are hits), sized to force preemptions."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(rng.choice((2 * block_size, 3 * block_size)))] for _ in range(2)]
    reqs = []
    for i in range(n):
        prompt = (prefixes[rng.randrange(2)] if rng.random() < 0.8 else []) + [
            rng.randrange(500) for _ in range(rng.randint(1, 2 * block_size))
        ]
        reqs.append(
            Request(
                f"r{i}",
                prompt,
                max_tokens=rng.randint(2, 3 * block_size),
                priority=rng.randrange(3) if priorities else 0,
                arrival_time=float(i),
            )
        )
    return reqs


def _compare(e, timeline: Timeline, where: str) -> None:
    snap = replay(e.events)
    live = live_snapshot(e.kv_cache_manager, e.scheduler)
    assert snap.free_queue == live["free_queue"], where
    assert [b.ref_cnt for b in snap.blocks] == live["ref_cnt"], where
    assert [b.block_hash for b in snap.blocks] == live["hashes"], where
    assert snap.running == live["running"] and snap.waiting == live["waiting"], where
    assert {r: snap.requests[r].block_table for r in snap.running} == live["tables"], where
    assert {r: snap.requests[r].num_computed_tokens for r in snap.running} == live["computed"], where
    # States agree with the ref counts and hashes, and every block is in exactly one place.
    for b in snap.blocks[1:]:
        expected = SHARED if b.ref_cnt > 1 else IN_USE if b.ref_cnt == 1 else CACHED if b.block_hash else FREE
        assert b.state == expected, (where, b)
        assert (b.free_position is None) == (b.ref_cnt > 0), (where, b)
    # The live player's view: a Timeline refreshed as the log grows.
    timeline.refresh()
    assert timeline.at(timeline.last_step) == snap, where


@pytest.mark.parametrize(
    ("policy", "hybrid", "seed"),
    [
        ("fcfs", False, 0),
        ("fcfs", False, 1),
        ("priority", False, 2),
        ("priority", False, 3),
        ("fcfs", True, 4),
        ("priority", True, 5),
        ("fcfs", "mamba", 6),
        ("priority", "mamba", 7),
    ],
)
def test_replay_matches_live_engine_every_step(policy: str, hybrid: bool | str, seed: int) -> None:
    """``hybrid="mamba"``: a Mamba hybrid with blocks of 8 hashed every 4 tokens, so hits end
    inside blocks and their last block is copied (copy-on-write, both kinds)."""
    bs = 4
    kwargs: dict = {}
    if hybrid == "mamba":
        groups = [FullAttentionSpec(block_size=8), MambaSpec(block_size=8)]
        kwargs = dict(manager_kwargs=dict(kv_cache_groups=groups, prefix_match_unit=4))
    elif hybrid:
        kwargs = dict(manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)]))
    e = build_engine(num_blocks=24 if hybrid else 14, block_size=bs, max_num_batched_tokens=24, policy=policy, **kwargs)
    pending = _workload(seed, 10, bs, priorities=policy == "priority")
    timeline = Timeline(e.events)
    preemptions = hits = 0
    steps = 0
    while pending or e.has_unfinished_requests():
        for _ in range(min(len(pending), 2)):  # arrivals between steps, as a live user adds them
            e.add_request(pending.pop(0))
        e.step()
        steps += 1
        _compare(e, timeline, f"{policy} hybrid={hybrid} seed={seed} step {steps}")
        assert steps < 500, "the run does not finish"
    s = replay(e.events)
    preemptions, hits = s.metrics["num_preemptions"], s.metrics["prefix_cache_hits"]
    assert preemptions > 0, "the workload should force preemptions"
    assert hits > 0, "the workload should produce prefix hits"
    if hybrid == "mamba":
        copied = [ev for ev in e.events if ev.kind == "block_copied"]
        assert {ev.moved_hashes for ev in copied} == {False, True}, "both kinds of copy should happen"
    elif hybrid:
        assert any(e.kind == "blocks_skipped" for e in e.events), "blocks should leave the window"


def test_replay_at_every_step_equals_the_timeline(story) -> None:
    t = Timeline(story.log)
    for step in t.steps:
        assert replay(story.log, step) == t.at(step)


def test_timeline_refresh_drops_stale_snapshots() -> None:
    """A request added after step 1 is an event *of step 1*: a cached step-1 snapshot
    must not survive the refresh (this was a replay bug, fixed in Timeline.refresh)."""
    e = build_engine(num_blocks=12, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=3, arrival_time=0.0))
    e.step()
    t = Timeline(e.events)
    assert t.at(1).waiting == [] and t.at(5).running == ["a"]
    e.add_request(Request("b", list(range(5)), max_tokens=3, arrival_time=0.0))
    t.refresh()
    assert t.at(1).waiting == ["b"] == replay(e.events, 1).waiting
    e.step()
    t.refresh()
    assert t.at(2) == replay(e.events, 2) and t.at(2).running == ["a", "b"]
