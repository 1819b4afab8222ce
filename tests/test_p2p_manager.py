"""The P2P tier (vLLM 0.33's ``P2PSecondaryTierManager``) between two engines in this process:
each a real manager built the normal way, talking over real ZeroMQ sockets on 127.0.0.1, with
``nixl_fake.py``'s agent writing the bytes from one engine's rows into the other's. What is
checked: the PD store that waits for its decoder and the bytes that land, the store nobody
fetches, symmetric lookups, a peer that leaves, a drain that gives up on a silent peer, and a
shutdown that lets go of everything. vLLM's own tests of the manager run on kvlab's through
``scripts/vllm_tests``."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import zmq

from kvlab.kv_offload.base import (
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvlab.kv_offload.tiering.base import JobResult, ParentManager, TransferJob
from kvlab.kv_offload.nixl_loopback import loopback_nixl
from kvlab.kv_offload.tiering.factory import SecondaryTierFactory
from kvlab.kv_offload.tiering.p2p import manager as manager_module
from kvlab.kv_offload.tiering.p2p.data import nixl as nixl_module
from kvlab.kv_offload.tiering.p2p.session import client as client_module
from kvlab.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager
from kvlab.metrics.cache_hit_source import CacheHitSource
from offload_tiers import tier_spec

K1, K2 = b"k1" * 6, b"k2" * 6
STEP_END = ScheduleEndContext(new_req_ids=[], preempted_req_ids=[])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiers() -> Iterator[Callable[..., P2PSecondaryTierManager]]:
    """Build engines' P2P tiers over ``rows`` (one row per CPU chunk); each is shut down at the end."""
    built: list[P2PSecondaryTierManager] = []

    def build(rows: np.ndarray, **kwargs) -> P2PSecondaryTierManager:
        for _ in range(8):  # a free port can be taken between the probe and the bind
            try:
                with loopback_nixl():
                    tier = P2PSecondaryTierManager(tier_spec(), memoryview(rows), host="127.0.0.1", port=_free_port(), **kwargs)
            except zmq.ZMQError:
                continue
            built.append(tier)
            return tier
        raise AssertionError("no free port")

    yield build
    for tier in built:
        tier.shutdown()  # a second shutdown is harmless


def _pump(tiers: list[P2PSecondaryTierManager], done: Callable[..., bool], what: str, each: Callable[[], None] = lambda: None):
    """Poll every tier, as the engine does each step, until ``done(*results so far)``; return
    each tier's results."""
    got: list[list[JobResult]] = [[] for _ in tiers]
    end = time.monotonic() + 20.0
    while True:
        each()
        for results, tier in zip(got, tiers):
            results.extend(tier.get_finished_jobs())
        if done(*got):
            return got
        assert time.monotonic() < end, f"{what}: not reached; results so far {got}"
        time.sleep(0.002)


def _job(job_id: int, keys: list[bytes], chunks: list[int], ctx: ReqContext, promotion: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks), is_promotion=promotion, req_context=ctx)


def _consumer_ctx(producer: P2PSecondaryTierManager, kv_request_id: str, role: str = "remote_prefiller") -> ReqContext:
    host, port = producer._local_id.rsplit(":", 1)
    return ReqContext("consumer", {role: {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": int(port)}})


def _rows(n: int, fill: str) -> np.ndarray:
    return np.arange(n * 32, dtype=np.uint8).reshape(n, 32) if fill == "arange" else np.zeros((n, 32), dtype=np.uint8)


def test_without_nixl_the_tier_refuses_before_opening_a_socket():
    port = _free_port()
    with patch.object(nixl_module, "_NixlAgent", None), pytest.raises(RuntimeError, match=r"NIXL is not installed.*use the 'fs' tier"):
        P2PSecondaryTierManager(tier_spec(), memoryview(_rows(4, "zeros")), host="127.0.0.1", port=port)
    with socket.socket() as s:  # nothing listens there: the control socket was never bound
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}, ValueError, "Back-pressure is not supported for the P2P tier"),
        ({"unbound_store_timeout_s": 0}, ValueError, "unbound_store_timeout_s must be a positive number of seconds, got 0"),
        ({"unbound_store_timeout_s": "soon"}, ValueError, "got 'soon'"),
        ({"unbound_store_timeout_s": float("nan")}, ValueError, "got nan"),
        ({"unbound_store_timout_s": 5}, TypeError, "unexpected keyword argument 'unbound_store_timout_s'"),
    ],
)
def test_the_factory_builds_the_p2p_tier_and_refuses_a_bad_config(config, error, match):
    view, port = memoryview(_rows(4, "zeros")), _free_port()
    with loopback_nixl():
        tier = SecondaryTierFactory.create_secondary_tier({"type": "p2p", "host": "127.0.0.1", "port": port}, view, tier_spec())
        with pytest.raises(error, match=match):
            SecondaryTierFactory.create_secondary_tier({"type": "p2p", "port": _free_port(), **config}, view, tier_spec())
    try:
        assert type(tier) is P2PSecondaryTierManager and tier.tier_type == "p2p"
        assert tier._local_id == f"127.0.0.1:{port}" and tier.cache_hit_source is CacheHitSource.P2P
        assert tier._unbound_store_timeout_s == 60.0 and tier.has_pending_work() is True
    finally:
        tier.shutdown()


def test_a_parked_store_is_fetched_by_its_decoder_byte_for_byte(tiers):
    prefiller_rows, decoder_rows = _rows(4, "arange"), _rows(4, "zeros")
    prefiller, decoder = tiers(prefiller_rows), tiers(decoder_rows)
    producer_ctx = ReqContext("producer", {"remote_decoder": {"kv_request_id": "r1"}})
    assert prefiller.on_new_request(producer_ctx).policy is OffloadPolicy.REQUEST_LEVEL  # the decoder needs every block
    prefiller.submit_store(_job(7, [K1, K2], [2, 0], producer_ctx, promotion=False))
    assert list(prefiller.get_finished_jobs()) == [] and [b.job_id for b in prefiller._unbound_stores["r1"]] == [7]

    consumer_ctx = _consumer_ctx(prefiller, "r1")
    assert decoder.on_new_request(consumer_ctx).policy is OffloadPolicy.CHUNK_LEVEL
    assert list(decoder._sessions) == [prefiller._local_id]
    assert decoder.lookup(K1, consumer_ctx) is LookupResult.HIT  # PD: the prefiller computed it for us
    decoder.submit_load(_job(9, [K1, K2], [1, 3], consumer_ctx, promotion=True))
    got_p, got_d = _pump([prefiller, decoder], lambda p, d: len(p) + len(d) == 2, "the fetch")

    assert (got_p, got_d) == ([JobResult(job_id=7, success=True)], [JobResult(job_id=9, success=True)])
    assert decoder_rows[1].tolist() == prefiller_rows[2].tolist() == list(range(64, 96))
    assert decoder_rows[3].tolist() == prefiller_rows[0].tolist() == list(range(0, 32))
    assert decoder_rows[[0, 2]].sum() == 0
    assert prefiller._unbound_stores == {} and prefiller._kv_to_session["r1"] is prefiller._sessions[decoder._local_id]

    prefiller.on_request_finished(producer_ctx)
    decoder.on_request_finished(consumer_ctx)
    assert prefiller._kv_to_session == {} and decoder._failed_req_ids == set()


def test_a_store_nobody_fetches_fails_and_a_late_fetch_fails_at_once(tiers):
    prefiller, decoder = tiers(_rows(4, "arange"), unbound_store_timeout_s=0.05), tiers(_rows(4, "zeros"))
    producer_ctx = ReqContext("producer", {"remote_decoder": {"kv_request_id": "r1"}})
    prefiller.on_new_request(producer_ctx)
    prefiller.submit_store(_job(7, [K1], [2], producer_ctx, promotion=False))
    (reaped,) = _pump([prefiller], lambda p: bool(p), "the reap")
    assert reaped == [JobResult(job_id=7, success=False)] and list(prefiller._reaped_stores) == ["r1"]
    prefiller.submit_store(_job(8, [K2], [3], producer_ctx, promotion=False))  # a prefill that outran the timeout
    assert prefiller._unbound_stores == {} and list(prefiller.get_finished_jobs()) == [JobResult(job_id=8, success=False)]

    consumer_ctx = _consumer_ctx(prefiller, "r1")
    decoder.on_new_request(consumer_ctx)
    # The decoder's client role runs on a stopped clock: its 30 s load timeout (and the abort
    # after it) cannot fire, so the failure below can only be the prefiller's own answer.
    with patch.object(client_module, "time", SimpleNamespace(monotonic=lambda: 0.0)):
        decoder.submit_load(_job(9, [K1], [0], consumer_ctx, promotion=True))
        got_p, got_d = _pump([prefiller, decoder], lambda p, d: bool(d), "the refusal")
    assert (got_p, got_d) == ([], [JobResult(job_id=9, success=False)])
    assert decoder.lookup(K1, consumer_ctx) is LookupResult.MISS  # the scheduler prefills locally
    assert "r1" not in prefiller._kv_to_session  # never bound: later stores keep being refused
    decoder.on_request_finished(consumer_ctx)
    assert decoder._failed_req_ids == set()


class _Parent(ParentManager):
    """The serving engine's tiers as its P2P tier sees them: ``chunks`` maps the keys it holds to
    their CPU chunks."""

    def __init__(self, chunks: dict[bytes, int]) -> None:
        self.chunks, self.jobs, self.finished = chunks, [], []

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def lookup(self, key, req_context):
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def create_store_job(self, keys, req_context):
        self.jobs.append(_job(50 + len(self.jobs), list(keys), [self.chunks[k] for k in keys], req_context, promotion=False))
        return self.jobs[-1]

    def on_request_finished(self, req_context):
        self.finished.append(req_context.req_id)


def test_symmetric_lookups_answer_retry_then_hit_or_miss_and_the_hit_loads(tiers):
    server_rows, consumer_rows = _rows(4, "arange"), _rows(4, "zeros")
    server, consumer = tiers(server_rows), tiers(consumer_rows)
    parent = _Parent({K1: 1})
    ctx = _consumer_ctx(server, "s1", role="remote_kv_source")
    consumer.on_new_request(ctx)
    _pump([server, consumer], lambda s, c: consumer._sessions[server._local_id].ready, "the handshake")
    assert [consumer.lookup(k, ctx) for k in (K1, K2)] == [LookupResult.RETRY, LookupResult.RETRY]
    consumer.on_schedule_end(STEP_END)  # one lookup message for both keys

    _pump(
        [server, consumer],
        lambda s, c: consumer.lookup(K2, ctx) is not LookupResult.RETRY,
        "the answer",
        lambda: server.serve_external_requests(parent),
    )
    assert [consumer.lookup(k, ctx) for k in (K1, K2)] == [LookupResult.HIT, LookupResult.MISS]
    assert [list(j.keys) for j in parent.jobs] == [[K1]] and parent.finished == [parent.jobs[0].req_context.req_id]

    consumer.submit_load(_job(9, [K1], [2], ctx, promotion=True))
    got_s, got_c = _pump([server, consumer], lambda s, c: len(s) + len(c) == 2, "the load")
    assert (got_s, got_c) == ([JobResult(job_id=50, success=True)], [JobResult(job_id=9, success=True)])
    assert consumer_rows[2].tolist() == server_rows[1].tolist() == list(range(32, 64))
    assert consumer_rows[[0, 1, 3]].sum() == 0


def test_a_peer_that_leaves_fails_the_load_and_its_request_falls_back(tiers):
    prefiller, decoder = tiers(_rows(4, "arange")), tiers(_rows(4, "zeros"))
    ctx = _consumer_ctx(prefiller, "r1")
    decoder.on_new_request(ctx)
    _pump([prefiller, decoder], lambda p, d: decoder._sessions[prefiller._local_id].ready, "the handshake")
    decoder.submit_load(_job(9, [K1], [0], ctx, promotion=True))
    _pump([prefiller, decoder], lambda p, d: "r1" in prefiller._kv_to_session, "the fetch")  # waiting for the store
    prefiller.shutdown()

    (got,) = _pump([decoder], lambda d: bool(d), "the peer's departure")
    assert got == [JobResult(job_id=9, success=False)] and decoder._sessions == {}
    assert decoder.lookup(K1, ctx) is LookupResult.MISS and decoder._failed_req_ids == {"r1"}
    decoder.on_request_finished(ctx)
    assert decoder._failed_req_ids == set()


def test_shutdown_fails_parked_stores_and_lets_go_of_sockets_and_nixl(tiers):
    prefiller, decoder = tiers(_rows(4, "arange")), tiers(_rows(4, "zeros"))
    producer_ctx = ReqContext("producer", {"remote_decoder": {"kv_request_id": "r2"}})
    prefiller.on_new_request(producer_ctx)
    prefiller.submit_store(_job(7, [K1], [0], producer_ctx, promotion=False))
    decoder.on_new_request(_consumer_ctx(prefiller, "r1"))
    _pump([prefiller, decoder], lambda p, d: decoder._sessions[prefiller._local_id].ready, "the handshake")
    agent = prefiller._data._agent
    assert agent.remotes == {decoder._nixl_agent_name} and [b.job_id for b in prefiller._unbound_stores["r2"]] == [7]

    prefiller.shutdown()
    assert prefiller._finished_jobs == [JobResult(job_id=7, success=False)]
    assert (prefiller._sessions, prefiller._unbound_stores, prefiller._kv_to_session) == ({}, {}, {})
    assert agent.live == set() and agent.remotes == set()  # every NIXL handle and remote agent given back
    port = int(prefiller._local_id.rsplit(":", 1)[1])
    with socket.socket() as s:  # the control socket no longer listens
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_drain_jobs_gives_up_on_a_peer_that_never_answers(tiers, monkeypatch):
    prefiller, decoder = tiers(_rows(4, "arange")), tiers(_rows(4, "zeros"))  # the prefiller is never polled
    ctx = _consumer_ctx(prefiller, "r1")
    decoder.on_new_request(ctx)
    decoder.submit_load(_job(9, [K1], [0], ctx, promotion=True))
    monkeypatch.setattr(decoder, "drain_timeout_s", 3.0)
    clock = SimpleNamespace(now=0.0, polls=0)  # the manager's clock: each pause between polls is 1 s

    def sleep(_: float) -> None:
        clock.now += 1.0

    poll_once = decoder._poll_once

    def counted_poll() -> None:
        clock.polls += 1
        poll_once()

    with monkeypatch.context() as m:
        m.setattr(manager_module, "time", SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep))
        m.setattr(decoder, "_poll_once", counted_poll)
        with pytest.raises(TimeoutError, match=rf"transfers with \['{prefiller._local_id}'\] still running after 4 s"):
            decoder.drain_jobs()
    assert clock.polls == 5  # waited 0, 1, 2, 3 s (not past 3 s), then 4 s: gives up
    assert list(decoder.get_finished_jobs()) == [] and decoder._sessions[prefiller._local_id].alive  # nothing cancelled
