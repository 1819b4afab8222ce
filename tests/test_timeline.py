"""The data layer: event classes, the Timeline's jumps, per-step series, block histories.

* every event kind is one class that applies, describes and serialises itself, and no
  module of the package switches on event kinds;
* ``Timeline.at(step)`` equals a fresh ``replay(log, step)`` for every step, visited in any
  order, with any checkpoint spacing -- and snapshots handed out earlier stay unchanged
  while the timeline moves on (records are shared copy-on-write);
* the per-step series come from the ``StepFinished`` records, with the simulated clock;
* a free block names the request that *released* it last, not the one that took it last.
"""

from __future__ import annotations

import pathlib
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import FullAttentionSpec, Request, SlidingWindowSpec
from kvlab.engine.llm_engine import build_engine
from kvlab.scenarios import preemption, shared_prefix
from kvlab.timeline import Timeline, replay
from kvlab.eventlog.events import EVENT_CLASSES, Event, EventLog, StepFinished, event_from_dict
from kvlab.timeline.snapshot import Holding

KVLAB = pathlib.Path(__file__).resolve().parents[1] / "kvlab"


def _run(policy: str = "fcfs", hybrid: bool = False, seed: int = 0, n: int = 24) -> EventLog:
    """A run with prefix hits and preemptions (and, hybrid, blocks leaving the window)."""
    rng = random.Random(seed)
    bs = 4
    kw = dict(manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)])) if hybrid else {}
    e = build_engine(num_blocks=24 if hybrid else 16, block_size=bs, max_num_batched_tokens=24, policy=policy, **kw)
    prefixes = [[rng.randrange(500) for _ in range(2 * bs)] for _ in range(2)]
    for i in range(n):
        prompt = prefixes[rng.randrange(2)] + [rng.randrange(500) for _ in range(rng.randint(1, 2 * bs))]
        e.add_request(Request(f"r{i}", prompt, max_tokens=rng.randint(2, 3 * bs), priority=rng.randrange(3), arrival_time=float(i)))
        if i % 3 == 2:
            e.step()
    e.run()
    assert e.events is not None
    return e.events


@pytest.fixture(scope="module")
def runs() -> dict[str, EventLog]:
    return {"fcfs": _run(), "priority": _run("priority", seed=1), "hybrid": _run(hybrid=True, seed=2)}


# -- one class per event kind ---------------------------------------------------------------------
def test_every_event_kind_describes_and_round_trips_itself() -> None:
    assert len(EVENT_CLASSES) == 32
    for kind, cls in EVENT_CLASSES.items():
        assert cls.kind == kind and issubclass(cls, Event)
        assert cls.describe is not Event.describe, f"{kind} has no words of its own"
        e = cls()
        e.seq, e.step = 7, 3
        back = event_from_dict(e.to_dict())
        assert type(back) is cls and back == e and (back.seq, back.step) == (7, 3)


def test_json_carries_a_format_version_and_rejects_bad_events() -> None:
    log = EventLog()
    log.emit(StepFinished(time=1.5, num_prefill_tokens=3, num_decode_tokens=1))
    text = log.to_json()
    assert text.startswith('{"version": 1,')
    assert EventLog.from_json(text).events == log.events
    with pytest.raises(ValueError, match="unknown event kind 'nope'"):
        event_from_dict({"kind": "nope"})
    with pytest.raises(ValueError, match=r"step_finished\) has unknown field\(s\) \['no_such_field'\]"):
        event_from_dict({"kind": "step_finished", "seq": 0, "step": 0, "no_such_field": 1})


def test_no_module_switches_on_event_kinds() -> None:
    """Each kind is defined once, in kvlab/eventlog/events.py: nothing else reads ``.kind``."""
    offenders = []
    for path in KVLAB.rglob("*.py"):
        if path == KVLAB / "eventlog" / "events.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.kind\b", line):
                offenders.append(f"{path.relative_to(KVLAB.parent)}:{i}: {line.strip()}")
    assert offenders == []


# -- jumps ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fcfs", "priority", "hybrid"])
@pytest.mark.parametrize("every", [1, 7, 256])
def test_any_step_in_any_order_equals_a_fresh_replay(runs, name: str, every: int) -> None:
    log = runs[name]
    tl = Timeline(log, checkpoint_events=every)
    order = list(tl.steps)
    random.Random(every).shuffle(order)
    kept = {s: tl.at(s) for s in order}
    for s in reversed(tl.steps):  # move the cursor around: earlier snapshots must not change
        tl.at(s)
    for s, snap in kept.items():
        assert snap == replay(log, s), (name, every, s)
    assert tl.at(tl.last_step) == replay(log)


def test_the_runs_exercise_preemption_hits_and_the_window(runs) -> None:
    for name, log in runs.items():
        s = Timeline(log).series
        assert sum(s.preemptions) > 0 and s.prefix_cache_hits[-1] > 0, name
    assert any(e.kind == "blocks_skipped" for e in runs["hybrid"])


_JUMP_LOG = _run(seed=5, n=16)


@given(st.integers(min_value=1, max_value=64), st.lists(st.integers(min_value=-2, max_value=_JUMP_LOG.step + 2), max_size=25))
def test_jumps_property(every: int, steps: list[int]) -> None:
    tl = Timeline(_JUMP_LOG, checkpoint_events=every)
    seen = [(s, tl.at(s)) for s in steps]
    for s, snap in seen:
        assert snap == replay(_JUMP_LOG, s)


def test_a_live_log_is_followed_and_stale_snapshots_dropped() -> None:
    e = build_engine(num_blocks=12, block_size=4)
    tl = Timeline(e.events)
    e.add_request(Request("a", list(range(10)), max_tokens=3))
    assert tl.request_ids == ["a"] and tl.at(0).waiting == ["a"]
    e.step()
    assert tl.last_step == 1 and tl.at(1).running == ["a"] and tl.in_step is False
    e.add_request(Request("b", list(range(5)), max_tokens=3))  # an event of step 1
    assert tl.at(1).waiting == ["b"] == replay(e.events, 1).waiting
    while e.has_unfinished_requests():
        e.step()
        assert tl.at(tl.last_step) == replay(e.events)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="checkpoint_events"):
        Timeline([], checkpoint_events=0)
    tl = Timeline(_JUMP_LOG)
    with pytest.raises(TypeError, match="step must be an int"):
        tl.at("3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_id"):
        tl.block_history(10_000)
    with pytest.raises(ValueError, match="log order"):
        Timeline(list(_JUMP_LOG)[::-1])
    assert Timeline([]).steps == [0] and Timeline([]).at(0).num_blocks == 0


# -- per-step facts ---------------------------------------------------------------------------------
def test_series_come_from_step_finished_with_the_clock() -> None:
    sc = shared_prefix()
    s = sc.timeline().series
    assert s.step == list(range(1, 9))
    assert s.num_running == [1, 2, 1, 0, 1, 0, 1, 0] and s.num_waiting == [0] * 8  # req1 arrives after step 1 ends
    assert [round(u, 1) for u in s.kv_cache_usage] == [0.4, 0.5, 0.4, 0.0, 0.4, 0.0, 1.0, 0.0]
    assert round(s.hit_rate[1], 4) == round(48 / 53, 4) and s.hit_rate[0] == 0.0 and s.hit_rate[2] is None
    # Tokens: req0's 55-token prompt; req1's 5 uncached tokens + req0's decode; ...; the long 159.
    assert s.num_scheduled_tokens == [55, 6, 2, 1, 7, 1, 159, 1]
    assert s.num_prefill_tokens == [55, 5, 0, 0, 7, 0, 159, 0] and s.num_decode_tokens == [0, 1, 2, 1, 0, 1, 0, 1]
    # Step 1 on the default cost model: 10 ms + 55 prefill tokens x 0.12 ms + 55 context tokens x 0.1 us.
    assert s.time[0] == pytest.approx(0.010 + 55 * 0.00012 + 55 * 1e-7, abs=1e-12)
    # The clock: set by the engine, the same numbers as engine.clock, increasing.
    assert s.time[-1] == sc.engine.clock and s.time == sorted(s.time)
    assert [r["time"] for r in s.rows()] == s.time
    again = Timeline(EventLog.from_json(sc.log.to_json())).series  # a saved log says the same
    assert again.rows() == s.rows()


def test_series_counts_preemptions_per_step() -> None:
    sc = preemption("fcfs")
    s = sc.timeline().series
    k = s.step.index(sc.step_of("preempted"))
    assert s.preemptions[k] == 1 and sum(s.preemptions) == 1 and s.num_preemptions[-1] == 1


def test_attention_batch_and_events_of_a_step() -> None:
    sc = shared_prefix()
    tl = sc.timeline()
    evs = tl.events_of(2)
    assert evs[0].describe() == "— step 2 —" and {e.step for e in evs} == {2}
    assert [e.describe() for e in evs] == tl.at(2).step_events
    assert tl.events_of(99) == [] and tl.attention_batch(2) is None  # the simulated executor emits none


def test_request_status_and_lifecycles() -> None:
    sc = preemption("fcfs")
    tl = sc.timeline()
    pre, res = sc.step_of("preempted"), sc.step_of("resumed with hits")
    changes = tl.lifecycles["Q"]
    assert changes[0] == (1, "waiting") and (pre, "preempted") in changes and (res, "running") in changes
    status = tl.request_status(tl.steps)["Q"]
    assert status[0] is None and status[pre] == "preempted" and status[res] == "running"
    assert status[-1] in ("finished", None)


# -- who held a block last --------------------------------------------------------------------------
def _last_taker_frees_first():
    """A computes a 2-block prefix; B hits it (the last to *take* the blocks), finishes
    first; A finishes last -- so A's release is what puts the prefix on the free queue."""
    e = build_engine(num_blocks=12, block_size=4)
    prefix = list(range(100, 108))
    e.add_request(Request("A", prefix + [1], max_tokens=6))
    e.step()
    e.add_request(Request("B", prefix + [2], max_tokens=2))
    e.run()
    return e


def test_free_block_names_the_request_that_released_it_last() -> None:
    e = _last_taker_frees_first()
    tl = Timeline(e.events)
    end = tl.at(tl.last_step)
    assert [end.blocks[b].state for b in (1, 2)] == ["cached", "cached"]
    assert end.blocks[1].last_holder == Holding("A", 0, 0) and end.blocks[2].last_holder == ("A", 0, 1)
    b_done = next(s for s in tl.steps if "B" in tl.at(s).finished)
    shared = tl.at(b_done).blocks[1]
    assert shared.owners == ["A"] and shared.last_holder == ("A", 0, 0)  # B let go, A still holds it
    assert tl.at(b_done - 1).blocks[1].last_holder == ("B", 0, 0)  # while both held it: the newest


def test_block_history() -> None:
    e = _last_taker_frees_first()
    hist = Timeline(e.events).block_history(1)
    assert [(r.action, r.holding.request_id if r.holding else None, r.ref_cnt) for r in hist] == [
        ("take", "A", 1),
        ("cache", None, 1),
        ("take", "B", 2),
        ("release", "B", 1),
        ("release", "A", 0),
    ]
    assert hist[1].block_hash is not None and [r.step for r in hist] == sorted(r.step for r in hist)
    assert all(e.events[r.seq].step == r.step for r in hist)


def test_first_busy_step_is_where_a_replay_opens() -> None:
    """The first step with a block allocated, touched or cached; an idle log's first step."""
    e = build_engine(num_blocks=8, block_size=4)
    assert Timeline(e.events).first_busy_step == 0  # nothing happened yet
    e.step()  # no request: the step runs, moves no block
    e.step()
    e.add_request(Request("a", list(range(9)), max_tokens=1))
    e.run()
    tl = Timeline(e.events)
    assert tl.steps == [0, 1, 2, 3] and tl.first_busy_step == 3  # steps 1-2 ran no request; 2 only added one
