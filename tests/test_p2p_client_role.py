"""The client half of a P2P session (vLLM 0.33's ``ClientRole``): the messages it sends and the
loads it reports, on a clock the test moves (no test waits for real time)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlab.kv_offload.tiering.p2p.session import client as client_module
from kvlab.kv_offload.tiering.p2p.session.client import ClientCloseResult, ClientRole, LoadResult
from kvlab.kv_offload.tiering.p2p.session.protocol import validate_message

A, B, C = b"a" * 12, b"b" * 12, b"c" * 12


@pytest.fixture
def role(monkeypatch):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock.now)
    sent: list[dict] = []

    def send(msg):
        validate_message(msg)  # everything the role sends is a well-formed message
        sent.append(msg)

    return ClientRole("10.0.0.2:5000", send), sent, clock


def test_a_lookup_round_then_its_fetch_then_the_next_round(role):
    r, sent, clock = role
    assert [r.register_lookup("req", k) for k in (A, B, A)] == [None, None, None]  # A asked once
    r.flush_pending_lookups(send_ready=False)
    assert sent == []  # not before the handshake
    r.flush_pending_lookups(send_ready=True)
    assert sent == [{"type": "lookup", "kv_request_id": "req", "keys": [A, B], "round_seq": 0}]
    r.on_lookup_resp("req", [A, B, C], [True, False, True])  # C was never asked: ignored
    assert [r.register_lookup("req", k) for k in (A, B)] == [True, False]
    r.request_blocks(7, "req", [A], [42], send_ready=True)
    assert sent[-1] == {"type": "fetch", "kv_request_id": "req", "keys": [A], "block_indexes": [42], "round_seq": 0}
    assert r.register_lookup("req", A) is None  # answers are dropped once served: asked again
    r.flush_pending_lookups(send_ready=True)
    assert sent[-1]["round_seq"] == 1
    r.on_transfer_done("req", True, 0)
    assert r.collect_results() == [LoadResult(7, "req", True)] and r.collect_results() == []


def test_a_silent_peer_gets_an_abort_at_30_s_and_the_load_fails_10_s_later(role):
    r, sent, clock = role
    r.request_blocks(3, "req", [], [], send_ready=True)
    clock.now += 29.9
    assert r.collect_results() == [] and len(sent) == 1
    clock.now += 0.1
    assert r.collect_results() == [] and sent[-1] == {"type": "abort_fetch", "kv_request_id": "req", "round_seq": 0}
    clock.now += 9.9
    assert r.collect_results() == [] and r.has_active_loads
    clock.now += 0.1
    assert r.collect_results() == [LoadResult(3, "req", False)]
    assert not r.has_active_loads and r._requests == {}
    r.on_abort_ack("req", 0)  # a late acknowledgement changes nothing
    assert r.collect_results() == []


def test_finishing_aborts_running_loads_and_releases_the_peer_s_open_lookup(role):
    r, sent, clock = role
    r.request_blocks(1, "req", [], [], send_ready=True)  # round 0, in flight
    r.register_lookup("req", B)
    r.flush_pending_lookups(send_ready=True)  # round 1's lookup is open at the peer
    r.finish("req")
    assert sent[-2:] == [
        {"type": "abort_fetch", "kv_request_id": "req", "round_seq": 0},
        {"type": "fetch", "kv_request_id": "req", "keys": [], "block_indexes": [], "round_seq": 1},
    ]
    r.finish("req")  # already aborting, nothing open: sends nothing more
    assert len(sent) == 4
    r.on_abort_ack("req", 0)
    assert r.collect_results() == [LoadResult(1, "req", False)] and r._requests == {}


def test_lookups_without_progress_expire_and_progress_moves_the_deadline(role):
    r, sent, clock = role
    for k in (A, B):
        r.register_lookup("req", k)
    r.flush_pending_lookups(send_ready=True)
    clock.now += 20
    r.on_lookup_resp("req", [A], [True])  # progress: 30 s more from now
    clock.now += 29
    assert r.get_expired_lookup() is None
    clock.now += 1
    assert r.get_expired_lookup() == ("req", 30.0)
    r.on_lookup_resp("req", [B], [False])  # all answered: no deadline left
    assert r.get_expired_lookup() is None


def test_a_dead_peer_fails_the_loads_in_flight_and_the_requests_waiting_on_it(role):
    r, sent, clock = role
    r.request_blocks(5, "loading", [], [], send_ready=True)
    r.register_lookup("probing", A)
    r.register_lookup("answered", B)
    r.flush_pending_lookups(send_ready=True)
    r.on_lookup_resp("answered", [B], [True])
    assert r.close() == ClientCloseResult(failed_jobs=[5], failed_req_ids=["loading", "probing"])
    assert not r.has_active_loads and r.collect_results() == []


def test_a_symmetric_fetch_of_a_key_the_peer_did_not_confirm_is_a_bug_caught_at_once(role):
    r, sent, clock = role
    r.register_lookup("req", A)
    r.flush_pending_lookups(send_ready=True)
    r.on_lookup_resp("req", [A], [False])
    with pytest.raises(AssertionError, match="names a key the peer did not confirm"):
        r.request_blocks(1, "req", [A], [0], send_ready=True)
