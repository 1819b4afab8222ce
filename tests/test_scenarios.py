"""The built-in scenarios: deterministic real runs that tell the story they claim to tell.

Each test states a scenario's claim as a fact about its event log or snapshots, so a
change in the engine that breaks a lesson's story fails here with the scenario's name.
"""

from __future__ import annotations

import pytest

from kvlab.engine.llm_engine import LLMEngine
from kvlab.scenarios import (
    SCENARIOS,
    Scenario,
    eviction,
    get_scenario,
    preemption,
    salts,
    shared_prefix,
    sliding_window,
)
from kvlab.eventlog.events import (
    BlockEvicted,
    BlocksSkipped,
    EventLog,
    RequestPreempted,
    RequestScheduled,
)
from kvlab.timeline.snapshot import CACHED, SHARED
from kvlab.timeline.timeline import Timeline


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request) -> Scenario:
    return get_scenario(request.param)


def test_scenario_is_a_finished_real_run(scenario: Scenario) -> None:
    assert isinstance(scenario.engine, LLMEngine)
    assert not scenario.engine.has_unfinished_requests()
    kinds = {e.kind for e in scenario.log}
    assert {"pool_created", "scheduler_created", "blocks_allocated", "blocks_freed", "block_cached", "step_finished"} <= kinds
    assert scenario.description and scenario.named_steps
    steps = list(scenario.named_steps.values())
    assert steps == sorted(steps), "named steps are listed in story order"
    t = scenario.timeline()
    assert all(t.steps[0] <= s <= t.last_step for s in steps)
    assert set(scenario.notes) <= set(scenario.named_steps)
    log, info = scenario  # the (EventLog, info) form
    assert log is scenario.log and info is scenario


def test_scenario_is_deterministic(scenario: Scenario) -> None:
    again = get_scenario(scenario.name.split("_fcfs")[0])
    assert again.log.to_json() == scenario.log.to_json()


def test_decode_renders_the_prompt_text(scenario: Scenario) -> None:
    first = next(e for e in scenario.log if e.kind == "request_added")
    text = "".join(scenario.decode(t) for t in first.prompt_token_ids)
    assert text.replace("␣", " ").isprintable()


def test_shared_prefix_reproduces_vllms_block_ids() -> None:
    sc = shared_prefix()
    assert sc.at("req0 prefill").requests["req0"].block_table == [[1, 2, 3, 4]]
    assert sc.at("req1 prefix hit").requests["req1"].block_table == [[1, 2, 3, 5]]
    assert sc.at("both freed").free_queue == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert sc.at("req2 hit").last_lookup.num_hit_blocks == 3
    assert sc.at("long request evicts").requests["long"].block_table == [[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]
    pool = next(e for e in sc.log if e.kind == "pool_created")
    assert (pool.num_blocks, pool.block_size) == (11, 16)


def test_eviction_evicts_the_oldest_chain_tail_first() -> None:
    sc = eviction()
    step = sc.step_of("C evicts A's tail")
    evicted = [e.block_id for e in sc.log if isinstance(e, BlockEvicted) and e.step == step]
    assert evicted == [3, 2]  # A's blocks were 1, 2, 3: freed tail first, so evicted tail first
    s = sc.at(step)
    assert s.blocks[1].state == CACHED and s.free_queue[0] == 1  # A's first block survived
    a2 = sc.at("A2 partial hit").last_lookup
    assert a2.request_id == "A2" and a2.num_hit_blocks == 1 and a2.hit_block_ids == [[1]]
    b2 = sc.at("B2 partial hit").last_lookup
    assert b2.request_id == "B2" and b2.num_hit_blocks == 1 and b2.hit_block_ids == [[4]]


@pytest.mark.parametrize(("policy", "victim", "survivor"), [("fcfs", "Q", "P"), ("priority", "P", "Q")])
def test_preemption_victim_requeues_at_head_and_hits_its_own_blocks(policy: str, victim: str, survivor: str) -> None:
    sc = preemption(policy)
    pre = [e for e in sc.log if isinstance(e, RequestPreempted)]
    assert pre and pre[0].request_id == victim and pre[0].step == sc.step_of("preempted")
    s = sc.at("preempted")
    assert s.waiting[0] == victim and "R" in s.waiting and s.running == [survivor]
    # Its full blocks stay cached on the free queue after the preemption.
    assert s.free_queue and all(s.blocks[b].state == CACHED for b in s.free_queue)
    resumed = next(e for e in sc.log if isinstance(e, RequestScheduled) and e.request_id == victim and e.phase == "resumed")
    assert resumed.step == sc.step_of("resumed with hits")
    assert resumed.num_cached_tokens > 0
    held_before = {b for b in s.free_queue}
    hit = sc.at("resumed with hits").requests[victim].block_table[0][: resumed.num_cached_tokens // 4]
    assert hit and set(hit) <= held_before  # the hit blocks are its own, from before the preemption


def test_preemption_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        preemption("lifo")


def test_salted_tenants_never_share_a_block() -> None:
    sc = salts()
    t = sc.timeline()
    s = sc.at("no salt: shared")
    a, b = (set(s.requests[r].block_table[0]) for r in ("anon-a", "anon-b"))
    assert a & b == {1, 2, 3}
    for step in t.steps:
        snap = t.at(step)
        for blk in snap.blocks:
            tenants = {o.split("-")[0] for o in blk.owners if o.startswith(("alice", "bob"))}
            assert len(tenants) <= 1, f"step {step}: block {blk.block_id} shared across tenants {blk.owners}"
    s = sc.at("salted: not shared")
    assert not set(s.requests["alice-1"].block_table[0]) & set(s.requests["bob-1"].block_table[0])
    s = sc.at("same salt: shared")
    shared = set(s.requests["alice-1"].block_table[0]) & set(s.requests["alice-2"].block_table[0])
    assert len(shared) == 3 and all(s.blocks[b].state == SHARED for b in shared)


def test_sliding_window_drops_blocks_and_pads_with_null() -> None:
    sc = sliding_window()
    skipped = [e for e in sc.log if isinstance(e, BlocksSkipped)]
    assert skipped and all(e.group == 1 for e in skipped)
    s = sc.at("S2 hit with null padding")
    full, window = s.requests["S2"].block_table
    assert 0 not in full and window[:2] == [0, 0]
    assert s.last_lookup.hit_block_ids == [[1, 2, 3, 4], [0, 0, 7, 8]]


def test_named_step_errors_list_the_names() -> None:
    sc = shared_prefix()
    with pytest.raises(KeyError, match="req0 prefill"):
        sc.step_of("no such step")
    assert sc.step_of(3) == 3
    with pytest.raises(ValueError, match="unknown scenario"):
        get_scenario("nope")


def test_scenario_log_survives_json() -> None:
    sc = eviction()
    again = EventLog.from_json(sc.log.to_json())
    t1, t2 = Timeline(sc.log), Timeline(again)
    for name, step in sc.named_steps.items():
        assert t1.at(step) == t2.at(step), name
