"""Engines in their own processes publishing KV events, and a router that learns their caches
from the streams (issue 14): the scheduler's publisher hook, the server process and its
client, the router's hashing, the policies, and the lock-step fleet."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from kvlab.core import kv_cache_utils
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.distributed.kv_subscriber import Subscriber
from kvlab.engine.llm_engine import build_engine
from kvlab.entrypoints.kv_server import KVServer, ServerDied, ServerError
from kvlab.executor.scripted import ScriptedExecutor
from kvlab.kv_events import BlockStored, KVEventBatch
from kvlab.request import Request
from kvlab.routing.fleet import Fleet, compare, format_table
from kvlab.routing.policies import KVAware, LeastLoaded, ReplicaState, RoundRobin, make_policy, prompt_block_hashes
from kvlab.timeline.kv_stream import KVStream
from kvlab.workloads.traces import multi_tenant, multi_turn

pytestmark = pytest.mark.timeout(300)


class ListPublisher:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


# --- the scheduler publishes one batch per step ------------------------------------------------------
def test_scheduler_publishes_each_steps_events_stamped_with_the_clock():
    pub = ListPublisher()
    eng = build_engine(
        num_blocks=16, block_size=4, event_log=None, manager_kwargs=dict(enable_kv_cache_events=True), kv_event_publisher=pub
    )
    eng.add_request(Request("a", list(range(10)), max_tokens=3))
    clocks = []
    while eng.has_unfinished_requests():
        clocks.append(eng.step().time)
    assert pub.batches and all(b.events for b in pub.batches)
    assert pub.batches[0].ts == clocks[0] and isinstance(pub.batches[0].events[0], BlockStored)
    assert eng.kv_cache_manager.take_events() == []  # the scheduler took them
    with pytest.raises(ValueError, match="enable_kv_cache_events=True"):
        build_engine(num_blocks=16, block_size=4, kv_event_publisher=pub)
    with pytest.raises(TypeError, match="publish"):
        build_engine(num_blocks=16, block_size=4, manager_kwargs=dict(enable_kv_cache_events=True), kv_event_publisher=object())


def test_scripted_executor_answers_with_the_trace():
    tr = multi_turn(2, 3, 0, rate=None)
    ex = ScriptedExecutor()
    eng = build_engine(num_blocks=256, block_size=16, executor=ex, event_log=None)
    for r in tr:
        ex.add_script(r.request_id, r.prompt_len, r.output_token_ids)
    eng.run_trace(tr.to_requests())
    assert all(list(eng.finished[r.request_id].output_token_ids) == r.output_token_ids for r in tr)


# --- the router hashes exactly as the replica -----------------------------------------------------------
def test_router_hashes_equal_the_replicas_published_hashes():
    mgr = KVCacheManager(num_blocks=32, block_size=16, enable_kv_cache_events=True, hash_algo="sha256_cbor")
    toks = list(range(1000, 1070))
    for salt in (None, "tenant-secret"):
        mgr.reset_prefix_cache()
        mgr.take_events()
        r = Request(f"r-{salt}", toks, cache_salt=salt)
        hits, k = mgr.get_computed_blocks(r)
        mgr.allocate_slots(r, r.num_tokens - k, k, hits)
        published = [h for ev in mgr.take_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]
        mgr.free(r)
        assert published == prompt_block_hashes(toks, 16, cache_salt=salt)
        assert len(published) == 4
    assert prompt_block_hashes(toks, 16) != prompt_block_hashes(toks, 16, cache_salt="x")
    assert prompt_block_hashes(toks, 16, hash_algo="sha256") != prompt_block_hashes(toks, 16)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in prompt_block_hashes(toks, 16, use_int=False))


@pytest.fixture
def env(monkeypatch):
    """monkeypatch, and the chain roots derived again once the environment is restored."""
    yield monkeypatch
    monkeypatch.undo()
    kv_cache_utils.init_none_hash()


def test_a_router_with_another_pythonhashseed_matches_nothing(env):
    """vLLM >= 0.29 derives NONE_HASH from PYTHONHASHSEED: a router and replicas that disagree
    on it compute different keys for every block."""
    toks = list(range(64))
    here = prompt_block_hashes(toks, 16)
    env.setenv("PYTHONHASHSEED", "1234")
    kv_cache_utils.init_none_hash()
    there = prompt_block_hashes(toks, 16)
    assert len(here) == len(there) == 4 and not set(here) & set(there)


# --- policies on what the router knows ---------------------------------------------------------------
def replicas(loads, cached):
    out = []
    for i, (load, hs) in enumerate(zip(loads, cached)):
        st = ReplicaState(f"r{i}", load=load)
        st.index.apply(
            [
                BlockStored(
                    block_hashes=list(hs),
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                )
            ]
        )
        out.append(st)
    return out


def test_policies_choose_as_documented():
    reps = replicas([3, 1, 1, 5], [[], [10], [10, 11, 12], [10, 11, 12]])
    assert [RoundRobin().choose(None, [], reps) for _ in range(1)] == [0]
    rr = RoundRobin()
    assert [rr.choose(None, [], reps) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert LeastLoaded().choose(None, [], reps) == 1
    assert [r.cached_prefix_blocks([10, 11, 12, 13]) for r in reps] == [0, 1, 3, 3]
    assert [r.cached_prefix_blocks([99, 10, 11]) for r in reps] == [0, 0, 0, 0]  # the walk stops at the first miss
    kv = KVAware()
    assert kv.choose(None, [10, 11, 12, 13], reps) == 2 and kv.last_scores == [0, 1, 3, 3]  # tie -> less loaded
    assert kv.choose(None, [99], reps) == 1  # nothing cached anywhere: least loaded
    bal = KVAware(load_weight=1.0)
    assert bal.name == "kv_aware+load(1)" and bal.choose(None, [10, 11, 12], reps) == 2
    heavy = replicas([9, 0], [[10, 11, 12], []])
    assert KVAware().choose(None, [10, 11, 12], heavy) == 0 and KVAware(0.5).choose(None, [10, 11, 12], heavy) == 1
    assert make_policy("kv_aware").name == "kv_aware"
    with pytest.raises(ValueError, match="unknown"):
        make_policy("random")
    with pytest.raises(TypeError, match="choose"):
        make_policy(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_weight"):
        KVAware(-1)


# --- one server process ------------------------------------------------------------------------------
def test_a_server_process_streams_what_an_in_process_engine_caches():
    trace = multi_tenant(2, 24, 3, rate=4.0)
    engine = dict(num_blocks=64, block_size=16)
    sub = Subscriber("tcp://127.0.0.1:0", topic="kv@s", bind=True, catch_up=True)
    srv = KVServer.start(
        name="s",
        engine=engine,
        kv_events_config=dict(enable_kv_cache_events=True, endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="kv@s"),
    )
    try:
        assert srv.alive and srv.startup_s > 0 and srv.replay_endpoint.startswith("tcp://127.0.0.1:")
        sub.replay_endpoint = srv.replay_endpoint
        sub.poll(0.05)
        for r in trace:
            srv.advance(r.arrival_time)
            srv.add([r])
        status = srv.run()
        stream = KVStream(sub.receive(timeout_s=1.0, until_seq=status["published"] - 1))
        metrics = {m["request_id"]: m for m in srv.metrics()}
        with pytest.raises(ServerError, match="unknown op"):
            srv.call("bogus")
        with pytest.raises(ServerError, match="already added"):
            srv.add([trace[0]])
        assert srv.status()["num_finished"] == len(trace)  # errors changed nothing
    finally:
        stop_s = srv.stop()
        sub.close()
    assert not srv.alive and stop_s < 30
    # the same trace, same config, in this process: same cache, same hits
    pub = ListPublisher()
    eng = build_engine(
        num_blocks=64,
        block_size=16,
        executor=ScriptedExecutor(),
        event_log=None,
        manager_kwargs=dict(enable_kv_cache_events=True, hash_algo="sha256_cbor"),
        kv_event_publisher=pub,
    )
    eng.run_trace(trace.to_requests())
    local = KVStream(enumerate(pub.batches))
    assert len(stream) == len(local) == status["published"]
    assert dict(stream.at().nodes) == dict(local.at().nodes)
    assert {k: m["num_cached_tokens"] for k, m in metrics.items()} == {k: m.num_cached_tokens for k, m in eng.metrics.items()}


def test_a_dead_server_is_reported_not_waited_for():
    srv = KVServer.start(
        name="doomed", engine=dict(num_blocks=16), kv_events_config=dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:1")
    )
    try:
        srv.kill()
        with pytest.raises(ServerDied, match="doomed .* exited with code"):
            srv.status(timeout_s=30)
    finally:
        srv.stop(timeout_s=2)
    with pytest.raises(ValueError, match="unknown keys"):
        KVServer.start(engine=dict(num_blok=3))
    with pytest.raises(ValueError, match=r"engine\['num_blocks'\]=0 is out of range"):  # refused before a process starts
        KVServer.start(
            name="bad", engine=dict(num_blocks=0), kv_events_config=dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:1")
        )
    leftovers = lambda: set(glob.glob(os.path.join(tempfile.gettempdir(), "kvlab-unbindable-*.stderr")))  # noqa: E731
    before = leftovers()
    with pytest.raises(ServerDied, match="before it was ready"):  # the process itself cannot bind its socket
        KVServer.start(
            name="unbindable", kv_events_config=dict(enable_kv_cache_events=True, endpoint="ipc:///nonexistent-kvlab-dir/kv.sock")
        )
    assert leftovers() == before  # the dead server's stderr file is removed once its tail is in the error


# --- the fleet -----------------------------------------------------------------------------------------
def test_fleet_routes_in_lock_step_deterministically_and_kv_aware_wins_hits():
    small = dict(max_model_len=512, mean_output=48.0)
    traces = {"tenants": multi_tenant(4, 40, 1, rate=6.0, shared_prefix_len=128, **small), "turns": multi_turn(6, 4, 1, rate=1.0, **small)}
    with Fleet(2, engine=dict(num_blocks=48, block_size=16), keep_streams=True) as fleet:
        assert fleet.startup_s > 0 and len(fleet.replica_startup_s) == 2
        res = compare(traces, ["round_robin", "least_loaded", "kv_aware"], fleet=fleet)
        again = fleet.route(traces["tenants"], "kv_aware", name="tenants")
        blind = fleet.route(traces["tenants"], "kv_aware", name="tenants", router_hash_algo="sha256")
        ll = fleet.route(traces["tenants"], "least_loaded", name="tenants")
    by = {(r.trace, r.policy): r for r in res}
    assert again.row() == by[("tenants", "kv_aware")].row()  # same trace, same policy: same numbers
    assert [x.replica for x in again.requests] == [x.replica for x in by[("tenants", "kv_aware")].requests]
    for t in traces:
        assert by[(t, "kv_aware")].hit_rate > by[(t, "round_robin")].hit_rate
        assert sum(by[(t, "round_robin")].requests_per_replica) == len(traces[t])
    assert by[("tenants", "kv_aware")].prediction_exact > 0.9
    # a router hashing with another function finds nothing and falls back to least-loaded
    assert all(x.predicted_cached_tokens == 0 for x in blind.requests)
    assert [x.replica for x in blind.requests] == [x.replica for x in ll.requests]
    assert all(not r.gaps or all(g.complete for g in r.gaps) for r in res)
    s = by[("turns", "kv_aware")].streams
    assert s is not None and all(len(x) > 0 for x in s)
    table = format_table(res)
    assert table.count("\n") == 6 and "kv_aware" in table


def test_fleet_reports_a_replica_that_died():
    with Fleet(2, engine=dict(num_blocks=32, block_size=16)) as fleet:
        fleet.servers[1].kill()
        with pytest.raises(ServerDied, match="replica-1"):
            fleet.route(multi_tenant(2, 5, 0, rate=2.0), "round_robin")
    assert not any(s.alive for s in fleet.servers)


@pytest.mark.slow
def test_bench_routing_prints_the_table(capsys):
    from kvlab.bench import routing

    routing.main(["--replicas", "2", "--requests", "30"])  # the whole table is lesson 11's (checked there)
    out = capsys.readouterr().out
    assert "multi-tenant: multi_tenant (seed 0): 30 requests" in out and "multi-turn: multi_turn (seed 0): 30 requests" in out
    assert out.count("multi-tenant ") >= 4 and "kv_aware+load(2)" in out and "replica processes ready" in out
    assert "stopping 2 processes" in out
