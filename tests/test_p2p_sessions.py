"""A P2P session (vLLM 0.33's ``P2PSession`` and its ``ServerRole``): the handshake, a fetch
served and its pins let go, aborts, peer lookups, time limits and the ways a session dies.
Two sessions talk over an in-memory wire; the data path is either kvlab's ``NixlTransport``
over ``nixl_fake.py`` (real bytes) or a scripted transport. Clocks are moved by the test."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from kvlab.kv_offload.base import LookupResult, RequestOffloadingContext
from kvlab.kv_offload.nixl_loopback import loopback_nixl
from kvlab.kv_offload.tiering.base import TransferJob
from kvlab.kv_offload.tiering.p2p.control.base import ControlConnection
from kvlab.kv_offload.tiering.p2p.data import NixlTransport, PollResult
from kvlab.kv_offload.tiering.p2p.data.base import DataTransport
from kvlab.kv_offload.tiering.p2p.session import LoadResult, P2PSession, SessionCloseResult, StoreResult
from kvlab.kv_offload.tiering.p2p.session import server as server_module
from kvlab.kv_offload.tiering.p2p.session import session as session_module
from kvlab.kv_offload.tiering.p2p.session.protocol import ConnectAckMsg, ConnectMsg, validate_message

K1, K2, K3 = b"k1" * 6, b"k2" * 6, b"k3" * 6
ME, PEER = "10.0.0.1:5000", "10.0.0.2:5000"


class WireEnd(ControlConnection):
    """One end of an in-memory control connection; a session's end checks that everything
    it sends is a valid message (``checked``; the test's own end may send malformed ones)."""

    def __init__(self, peer_id: str) -> None:
        super().__init__(peer_id)
        self.other: WireEnd | None = None
        self.inbox: list[dict] = []
        self.sent: list[dict] = []
        self.checked = True
        self._alive = True

    @property
    def alive(self) -> bool:
        return self._alive

    def send(self, msg: dict) -> None:
        if not self._alive:
            raise ConnectionError("dead")
        if self.checked:
            validate_message(msg)
        self.sent.append(msg)
        if self.other is not None:
            self.other.inbox.append(msg)

    def recv(self) -> list[dict]:
        msgs, self.inbox = self.inbox, []
        return msgs

    def mark_dead(self) -> None:
        self._alive = False

    def close(self) -> None:
        self._alive = False

    def types(self) -> list[str]:
        return [m["type"] for m in self.sent]


def wire(a_id: str, b_id: str) -> tuple[WireEnd, WireEnd]:
    """Two ends joined: the first is ``a_id``'s (its peer is ``b_id``), the second ``b_id``'s."""
    a, b = WireEnd(b_id), WireEnd(a_id)
    a.other, b.other = b, a
    return a, b


class ScriptedTransport(DataTransport):
    """A data path the test drives: writes are recorded; ``poll`` reports ``done``; a
    wait-mode ``cancel`` leaves the ids in ``running`` running; registration resolves when
    the test says (``registrations``)."""

    def __init__(self, num_blocks: int = 8, block_len: int = 16) -> None:
        super().__init__(memoryview(bytearray(num_blocks * block_len)).cast("B", (num_blocks, block_len)))
        self.writes: list[tuple[str, list[int], list[int]]] = []
        self.done: list[int] = []
        self.running: set[int] = set()
        self.cancels: list[tuple[list[int], str]] = []
        self.registrations: list[Future[None]] = []
        self.fault: str | None = None

    def get_agent_metadata(self) -> bytes:
        return b"scripted"

    def add_remote_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> None:
        raise AssertionError("the session registers asynchronously")

    def add_remote_peer_async(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> Future[None]:
        self.registrations.append(Future())
        return self.registrations[-1]

    def remove_remote_peer(self, peer_id: str) -> None:
        pass

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        self.writes.append((peer_id, list(local_idxs), list(remote_idxs)))
        return len(self.writes) - 1

    def poll(self, peer_id: str | None = None) -> PollResult:
        done, self.done = self.done, []
        return PollResult(done, [], self.fault)

    def cancel(self, transfer_ids, mode="immediate") -> list[int]:
        ids = list(transfer_ids)
        self.cancels.append((ids, mode))
        return [t for t in ids if t in self.running] if mode == "wait" else []

    def close(self) -> None:
        pass


class Parent:
    """The tiering manager as a peer lookup sees it: ``stored`` key -> CPU chunk, ``pending``
    keys still being written; every call recorded."""

    def __init__(self, stored: dict[bytes, int], pending: set[bytes] | None = None) -> None:
        self.stored, self.pending = dict(stored), set(pending or ())
        self.calls: list[tuple] = []
        self._job_ids = iter(range(1000, 2000))

    def on_new_request(self, ctx):
        self.calls.append(("new", ctx.req_id))
        return RequestOffloadingContext()

    def lookup(self, key, ctx):
        if key in self.pending:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if key in self.stored else LookupResult.MISS

    def create_store_job(self, keys, ctx):
        self.calls.append(("pin", list(keys)))
        return TransferJob(next(self._job_ids), list(keys), np.array([self.stored[k] for k in keys]), False, ctx)

    def on_request_finished(self, ctx):
        self.calls.append(("finished", ctx.req_id))


@pytest.fixture
def clock(monkeypatch):
    c = SimpleNamespace(now=1000.0)
    fake = SimpleNamespace(monotonic=lambda: c.now)
    monkeypatch.setattr(server_module, "time", fake)
    monkeypatch.setattr(session_module, "time", fake)
    return c


def connected(transport: ScriptedTransport, hash_seed: str = "0") -> tuple[P2PSession, WireEnd]:
    """A session whose handshake is done; returns it and the peer's end of the wire."""
    mine, peer = wire(ME, PEER)
    peer.checked = False
    s = P2PSession(PEER, ME, transport, transport.block_len, "0", conn=mine)
    peer.send(ConnectMsg.make(peer_id=PEER, agent_metadata=b"m", base_addr=0, num_blocks=8, block_len=16, hash_seed=hash_seed))
    peer.send(ConnectAckMsg.make(peer_id=PEER))
    s.poll()
    if transport.registrations:
        transport.registrations[-1].set_result(None)
        s.poll()
    peer.recv()  # connect and connect_ack
    return s, peer


def fetch(kv_request_id: str, keys: list[bytes], idxs: list[int], round_seq: int = 0) -> dict:
    return {"type": "fetch", "kv_request_id": kv_request_id, "keys": keys, "block_indexes": idxs, "round_seq": round_seq}


def test_two_sessions_shake_hands_and_a_fetch_writes_the_bytes_then_lets_the_pin_go():
    def engine(name, rows):
        with loopback_nixl():
            return NixlTransport(name, memoryview(rows))

    decoder_rows, prefiller_rows = np.zeros((6, 32), dtype=np.uint8), np.arange(4 * 32, dtype=np.uint8).reshape(4, 32)
    td, tp = engine(ME, decoder_rows), engine(PEER, prefiller_rows)
    wd, wp = wire(ME, PEER)
    decoder = P2PSession(PEER, ME, td, 32, "0", conn=wd)
    prefiller = P2PSession(ME, PEER, tp, 32, "0", conn=wp)
    prefiller.add_stored_blocks("req", [K1, K2], [0, 3], job_id=7)  # supply first (disaggregated prefill)
    decoder.request_blocks(1, "req", [K1, K2], [5, 1])  # queued until the handshake
    assert wd.types() == ["connect"]
    loads, stores = [], []
    for _ in range(500):  # registrations run on the transports' threads: bounded wait
        loads += decoder.poll().loads
        stores += prefiller.poll().stores
        if loads:
            break
        time.sleep(0.002)
    assert loads == [LoadResult(1, "req", True)] and stores == [StoreResult(7, True)]
    assert decoder_rows[5].tolist() == prefiller_rows[0].tolist() and decoder_rows[1].tolist() == prefiller_rows[3].tolist()
    assert decoder_rows[[0, 2, 3, 4]].sum() == 0
    assert wp.types() == ["connect", "connect_ack", "transfer_done"]
    assert sorted(wd.types()) == ["connect", "connect_ack", "fetch"]
    assert [m for m in wd.sent if m["type"] == "fetch"] == [fetch("req", [K1, K2], [5, 1])]
    assert prefiller._server._requests == {} and prefiller._server._store_jobs == {}  # nothing left pinned
    agents = [td._agent, tp._agent]
    for s, t in ((decoder, td), (prefiller, tp)):
        assert s.close() == SessionCloseResult([], [], [], [])
        t.close()
    assert [a.live for a in agents] == [set(), set()]  # every NIXL handle given back


def test_connect_ack_waits_for_the_peer_s_registration_and_sends_wait_for_the_peer_s_ack():
    t = ScriptedTransport()
    mine, peer = wire(ME, PEER)
    s = P2PSession(PEER, ME, t, 16, "0", conn=mine)
    s.request_blocks(1, "req", [K1], [2])
    peer.send(ConnectMsg.make(peer_id=PEER, agent_metadata=b"m", base_addr=0, num_blocks=8, block_len=16, hash_seed="0"))
    s.poll()
    assert mine.types() == ["connect"] and s.has_pending_work  # registering: no ack, no fetch
    peer.send(ConnectAckMsg.make(peer_id=PEER))
    s.poll()
    assert s.ready and mine.types() == ["connect", "fetch"]  # the peer acked: ours may flow
    t.registrations[0].set_result(None)
    s.poll()
    assert mine.types() == ["connect", "fetch", "connect_ack"]  # only now may the peer send
    assert mine.sent[-1] == {"type": "connect_ack", "peer_id": ME}


def test_a_fetch_before_its_supply_is_parked_and_written_when_the_store_comes(clock):
    t = ScriptedTransport()
    s, peer = connected(t)
    peer.send(fetch("req", [K1, K2], [6, 7]))
    assert s.poll().new_fetch_ids == ["req"] and t.writes == []
    s.add_stored_blocks("req", [K2, K3, K1], [4, 5, 0], job_id=9)
    assert t.writes == [(PEER, [4, 0], [7, 6])]  # K3 was not asked for
    assert s.poll().stores == [] and s._server._store_jobs == {9: 1000.0}  # pinned while writing
    t.done = [0]
    assert s.poll().stores == [StoreResult(9, True)]
    assert peer.inbox[-1] == {"type": "transfer_done", "kv_request_id": "req", "success": True, "round_seq": 0}
    assert s._server._requests == {}


def test_an_abort_holds_pin_and_ack_until_the_write_stops(clock):
    t = ScriptedTransport()
    s, peer = connected(t)
    s.add_stored_blocks("req", [K1], [0], job_id=7)
    peer.send(fetch("req", [K1], [5]))
    s.poll()
    t.running = {0}  # NIXL cannot stop this write yet
    peer.send({"type": "abort_fetch", "kv_request_id": "req", "round_seq": 0})
    assert s.poll().stores == [] and peer.inbox == []  # no result (pin held) and no ack
    assert t.cancels == [([0], "wait")]
    s.poll()
    assert len(t.cancels) == 1  # retries are paced: at most one per 0.1 s per round
    t.running = set()
    clock.now += 0.1
    assert s.poll().stores == [StoreResult(7, False)]
    assert peer.inbox == [{"type": "abort_ack", "kv_request_id": "req", "round_seq": 0}]  # once, with no transfer_done
    assert s._server._requests == {} and s._server._pending_aborts == {}


def test_an_abort_of_a_round_with_nothing_written_acks_at_once_and_fails_its_job(clock):
    t = ScriptedTransport()
    s, peer = connected(t)
    s.add_stored_blocks("req", [K1], [0], job_id=4)  # supplied, never fetched
    peer.send({"type": "abort_fetch", "kv_request_id": "req", "round_seq": 0})
    assert s.poll().stores == [StoreResult(4, False)]
    assert peer.inbox == [{"type": "abort_ack", "kv_request_id": "req", "round_seq": 0}] and t.cancels == []
    s.add_stored_blocks("req", [K2], [1], job_id=5)  # a later round 0 store starts afresh
    assert s._server._store_jobs == {5: 1000.0}


def test_a_peer_lookup_is_parked_until_the_parent_knows_then_its_hits_are_pinned_and_served(clock):
    t = ScriptedTransport()
    s, peer = connected(t)
    parent = Parent({K1: 2, K2: 4}, pending={K2})
    peer.send({"type": "lookup", "kv_request_id": "req", "keys": [K1, K2, K3], "round_seq": 0})
    s.poll()
    s.serve_external_requests(parent)
    ctx = f"p2p:{PEER}:req:lu1"
    assert parent.calls == [("new", ctx), ("pin", [K1])] and peer.inbox == []  # K2 still being written
    parent.pending.clear()
    s.serve_external_requests(parent)
    assert parent.calls[2:] == [("pin", [K2]), ("finished", ctx)]
    assert peer.inbox == [{"type": "lookup_resp", "kv_request_id": "req", "keys": [K1, K2, K3], "hits": [True, True, False]}]
    peer.send(fetch("req", [K1, K2], [6, 7]))
    s.poll()
    assert t.writes == [(PEER, [2, 4], [6, 7])]
    t.done = [0]
    assert s.poll().stores == [StoreResult(1000, True), StoreResult(1001, True)]


def test_a_key_the_parent_never_settles_is_answered_miss_after_5_s(clock):
    s, peer = connected(ScriptedTransport())
    parent = Parent({}, pending={K1})
    peer.send({"type": "lookup", "kv_request_id": "req", "keys": [K1], "round_seq": 0})
    s.poll()
    s.serve_external_requests(parent)
    clock.now += 4.99
    s.serve_external_requests(parent)
    assert peer.inbox == []
    clock.now += 0.01
    s.serve_external_requests(parent)
    assert peer.inbox == [{"type": "lookup_resp", "kv_request_id": "req", "keys": [K1], "hits": [False]}]
    assert parent.calls == [("new", f"p2p:{PEER}:req:lu1"), ("finished", f"p2p:{PEER}:req:lu1")]


def test_an_unfetched_store_job_fails_after_30_s_even_before_a_peer_connects(clock):
    s = P2PSession(PEER, ME, ScriptedTransport(), 16, "0")  # pending: no connection yet
    s.add_stored_blocks("req", [K1], [0], job_id=3)
    clock.now += 29.99
    assert s.poll().stores == []
    clock.now += 0.01
    assert s.poll().stores == [StoreResult(3, False)]
    assert s.alive and not s.connected


@pytest.mark.parametrize(
    ("msgs", "reason"),
    [
        ([fetch("r", [K1], [])], "protocol error: malformed 'fetch': keys/block_indexes length mismatch: 1 vs 0"),
        ([fetch("r", [K1], [3]), fetch("r", [K2], [4])], "protocol error: malformed 'fetch': duplicate fetch for kv_request_id=r round=0"),
        (
            [ConnectMsg.make(peer_id=PEER, agent_metadata=b"m", base_addr=0, num_blocks=8, block_len=16, hash_seed="0")],
            "protocol error: duplicate connect after handshake",
        ),
    ],
)
def test_a_protocol_violation_kills_the_session_with_its_reason_and_tells_the_peer(clock, msgs, reason):
    s, peer = connected(ScriptedTransport())
    for msg in msgs:
        peer.send(msg)
    peer.send({"type": "lookup", "kv_request_id": "late", "keys": [K1], "round_seq": 0})  # after the violation: ignored
    s.poll()
    assert not s.alive and s.death_reason == reason
    assert peer.inbox[-1] == {"type": "disconnect"}
    assert "late" not in s._server._requests


def test_an_incompatible_peer_is_rejected_and_a_silent_one_times_out(clock, monkeypatch):
    t = ScriptedTransport()
    s, peer = connected(t, hash_seed="42")
    assert not s.alive and t.registrations == []  # never registered, never acked
    assert s.death_reason == (
        f"rejected peer connect: hash seed mismatch from {PEER}: remote='42', local='0' (PYTHONHASHSEED must match on all peers)"
    )
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "2")
    silent = P2PSession(PEER, ME, t, 16, "0", conn=wire(ME, PEER)[0])
    clock.now += 2.0
    silent.poll()
    assert silent.alive
    clock.now += 0.01
    silent.poll()
    assert not silent.alive and silent.death_reason == "handshake timed out"


def test_a_data_plane_fault_disconnects_once_writes_drain_and_close_reports_the_work_to_fail(clock):
    t = ScriptedTransport()
    s, peer = connected(t)
    s.add_stored_blocks("served", [K1], [0], job_id=7)
    peer.send(fetch("served", [K1], [5]))
    s.request_blocks(2, "mine", [K2], [3])
    s.poll()
    t.fault = "3 consecutive transfer failures"
    s.poll()
    assert s.alive and s.data_plane_fault == "3 consecutive transfer failures"  # a write still runs
    clock.now += 10.0
    s.poll()
    assert not s.alive and s.death_reason == "data plane: 3 consecutive transfer failures"
    assert [m["type"] for m in peer.recv()] == ["fetch", "disconnect"]  # told once; close() finds the wire dead
    assert s.close() == SessionCloseResult(failed_jobs=[2], failed_req_ids=["mine"], failed_stores=[7], failed_serves=[])
    assert t.cancels[-1] == ([0], "immediate")


def test_a_key_that_is_not_bytes_is_the_peer_s_malformed_message(clock):
    s, peer = connected(ScriptedTransport())
    peer.send(fetch("r", ["k1"], [3]))  # bytes() of a str raises TypeError: an internal error
    s.poll()
    assert not s.alive and s.death_reason == "protocol error: malformed 'fetch': keys: expected bytes, got str"
    assert "r" not in s._server._requests


def test_a_write_the_transport_cannot_start_fails_its_round_instead_of_raising(clock, caplog):
    t = ScriptedTransport()
    s, peer = connected(t)
    peer.send(fetch("req", [K1], [2**40]))  # a valid index on the wire; NIXL's int32 cannot hold it
    s.poll()

    def refuse(peer_id, local_idxs, remote_idxs):
        raise OverflowError("Python integer 1099511627776 out of bounds for int32")

    t.write_blocks = refuse  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger=server_module.__name__):
        s.add_stored_blocks("req", [K1], [0], job_id=7)  # what the manager's submit_store calls: no raise
    # One warning, carrying the transport's exception and its traceback.
    [record] = [r for r in caplog.records if r.name == server_module.__name__]
    assert record.getMessage() == "P2PSession 10.0.0.2:5000: write_blocks failed for req (1 blocks)"
    assert record.exc_info is not None and isinstance(record.exc_info[1], OverflowError)
    assert s.poll().stores == [StoreResult(7, False)]
    assert peer.inbox == [{"type": "transfer_done", "kv_request_id": "req", "success": False, "round_seq": 0}]
    assert s.alive and s._server._requests == {} and s._server._store_jobs == {}
