"""Asynchronous KV loads and delayed frees in the scheduler (vLLM 0.33's P/D path).

A connector may answer ``get_num_new_matched_tokens`` with ``load_kv_async=True``: the
request gets its blocks at once and waits in ``WAITING_FOR_REMOTE_KVS`` (in
``kv_holding_waiting``) until the worker reports the load received; a connector whose
``request_finished`` returns True keeps a finished request's blocks until the worker
reports the send done. Every expected value below was produced first by vLLM 0.33's own
``Scheduler`` on the same story (the same connector script, one full-attention group).
"""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, Request, Scheduler, SimulatedExecutor
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
from kvlab.engine.llm_engine import LLMEngine
from kvlab.outputs import KVConnectorOutput
from kvlab.request import RequestStatus

from scheduler_side_connector import SchedulerSideConnector

BS = 4


class Scripted(SchedulerSideConnector):
    """Answers request ``rid`` with ``offers[rid]``, one answer per ask (the last one repeats;
    none: nothing to offer); keeps the blocks of the finished requests in ``delay``."""

    def __init__(self, offers: dict[str, list[tuple[int, bool]]], delay: frozenset[str] = frozenset()) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.offers, self.delay = dict(offers), delay
        self.finished: list[tuple[str, list[int]]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        answers = self.offers.get(request.request_id)
        if not answers:
            return 0, False
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        return request.request_id in self.delay, None


def make(num_blocks: int, offers: dict, delay: frozenset[str] = frozenset(), **kw):
    mgr = KVCacheManager(num_blocks, BS)
    conn = Scripted(offers, delay)
    sched = Scheduler(mgr, max_num_batched_tokens=kw.pop("budget", 64), max_num_seqs=8, connector=conn, **kw)
    return mgr, sched, conn


def req(rid: str, n: int, mgr: KVCacheManager, max_tokens: int = 2, base: int = 100) -> Request:
    return Request(rid, list(range(base, base + n)), max_tokens=max_tokens, block_hasher=mgr.request_block_hasher)


def step(sched: Scheduler, **kv):
    out = sched.schedule()
    tok = {
        rid: [7]
        for rid, n in out.num_scheduled_tokens.items()
        if sched.requests[rid].num_computed_tokens + n >= sched.requests[rid].num_tokens
    }
    sched.update_from_output(out, tok, kv_connector_output=KVConnectorOutput(**kv) if kv else None)
    sched.check_invariants()
    return out


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def test_a_remote_prefill_waits_holding_its_blocks_then_recomputes_only_the_last_token():
    mgr, sched, _ = make(10, {"A": [(14, True)]})
    sched.add_request(req("A", 14, mgr))
    out = step(sched)
    a = sched.requests["A"]
    assert out.num_scheduled_tokens == {}
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 14
    assert [r.request_id for r in sched.kv_holding_waiting] == ["A"] and not sched.waiting
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4],)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0  # nothing cached before it lands
    out = step(sched)  # not received yet: it waits
    assert out.num_scheduled_tokens == {} and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, finished_recving={"A"})  # the worker reports it received (nothing scheduled)
    out = step(sched)
    # the whole prompt came: its last token is recomputed so the next one can be sampled
    assert out.num_scheduled_tokens == {"A": 1}
    assert [(d.req_id, d.num_computed_tokens, d.block_ids) for d in out.scheduled_new_reqs] == [("A", 13, ([1, 2, 3, 4],))]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3  # the three full blocks, cached on landing


def test_an_aborted_load_keeps_its_blocks_until_the_worker_says_it_received():
    mgr, sched, conn = make(10, {"A": [(12, True)]})
    sched.add_request(req("A", 14, mgr))
    step(sched)
    sched.finish_requests("A")
    assert "A" in sched.requests and sched.requests["A"].is_finished()
    assert not sched.has_unfinished_requests() and sched.has_pending_kv_transfers()
    assert mgr.get_block_ids("A") == ([1, 2, 3],)  # the load may still be writing into them
    assert conn.finished == [("A", [1, 2, 3])]
    step(sched, finished_recving={"A"})
    assert "A" not in sched.requests and not sched.has_pending_kv_transfers()
    assert free_ids(mgr) == [3, 2, 1, 4, 5, 6, 7, 8, 9]


def test_a_finished_request_the_connector_sends_keeps_its_blocks_until_the_send_is_done():
    mgr, sched, conn = make(10, {}, delay=frozenset({"A"}))
    sched.add_request(req("A", 6, mgr, max_tokens=1))
    step(sched)
    assert sched.requests["A"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert mgr.get_block_ids("A") == ([1, 2],) and sched.has_pending_kv_transfers() and not sched.has_unfinished_requests()
    out = sched.schedule()
    with pytest.raises(ValueError, match=r"finished_sending names 'B' \(unknown\)"):
        sched.update_from_output(out, {}, kv_connector_output=KVConnectorOutput(finished_sending={"B"}))
    assert mgr.get_block_ids("A") == ([1, 2],)  # refused: nothing changed
    sched.update_from_output(out, {}, kv_connector_output=KVConnectorOutput(finished_sending={"A"}))
    assert "A" not in sched.requests and free_ids(mgr) == [2, 3, 4, 5, 6, 7, 8, 9, 1]


def test_a_load_that_fails_whole_is_recomputed_and_the_connector_asked_again():
    mgr, sched, _ = make(10, {"A": [(12, True), (0, False)]})
    sched.add_request(req("A", 14, mgr))
    step(sched)
    step(sched, finished_recving={"A"}, failed_recving={"A"})
    assert sched.requests["A"].num_computed_tokens == 0
    out = step(sched)  # its blocks went back; it is looked up (and the connector asked) again
    assert out.num_scheduled_tokens == {"A": 14}
    assert [(d.num_computed_tokens, d.block_ids) for d in out.scheduled_new_reqs] == [(0, ([3, 2, 1, 4],))]


def test_a_bad_block_cuts_the_load_at_that_block_and_caches_what_came_before():
    mgr, sched, _ = make(10, {"A": [(12, True), (0, False)]})
    sched.add_request(req("A", 14, mgr))
    step(sched)
    step(sched, finished_recving={"A"}, invalid_block_ids={2})
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 10}
    assert [(d.num_computed_tokens, d.block_ids) for d in out.scheduled_new_reqs] == [(4, ([1, 2, 3, 4],))]
    assert sched.num_kv_load_failures == 1


def test_under_policy_fail_a_failed_load_finishes_with_an_error():
    mgr, sched, _ = make(10, {"A": [(12, True)]}, kv_load_failure_policy="fail")
    sched.add_request(req("A", 14, mgr))
    step(sched)
    step(sched, finished_recving={"A"}, failed_recving={"A"})
    assert "A" not in sched.requests
    assert free_ids(mgr) == [3, 2, 1, 4, 5, 6, 7, 8, 9]


def test_a_load_is_admitted_only_with_the_blocks_a_running_prefill_still_needs_left_free():
    # A (40 tokens, 10 blocks) prefills 8 tokens a step; B's load needs 3 blocks, and the
    # pool has free what A still needs and fewer than 3 more, until A is done.
    mgr, sched, _ = make(13, {"B": [(12, True)]}, long_prefill_token_threshold=8)
    sched.add_request(req("A", 40, mgr, max_tokens=3))
    sched.add_request(req("B", 14, mgr, base=500))
    seen = []
    while sched.requests["B"].status == RequestStatus.WAITING:
        step(sched)
        seen.append((sched.requests["A"].num_computed_tokens if "A" in sched.requests else None, mgr.block_pool.get_num_free_blocks()))
    assert seen == [(8, 10), (16, 8), (24, 6), (32, 4), (40, 2), (41, 1), (None, 12), (None, 9)]
    assert sched.requests["B"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and mgr.get_block_ids("B") == ([11, 12, 10],)


# -- in the engine ------------------------------------------------------------------------------
class Handoff(SchedulerSideConnector):
    """Both halves of a P/D-style connector over a simulated executor: the scheduler half
    offers the whole prompt of the requests in ``remote`` asynchronously; the worker half
    reports each load ``delay`` steps after it started, and each send one step after its
    request finished (for the requests in ``send``)."""

    def __init__(self, role, remote=frozenset(), send=frozenset(), delay=2, silent=False) -> None:
        super().__init__(role)
        self.remote, self.send, self.delay, self.silent = remote, send, delay, silent
        self.loads: list[str] = []
        self.clock = 0
        self.due: dict[str, int] = {}
        self.sending: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self.remote and num_computed_tokens == 0:
            return request.num_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self.loads.append(request.request_id)

    def build_connector_meta(self, scheduler_output):
        meta = KVConnectorMetadata()
        meta.loads, self.loads = self.loads, []  # type: ignore[attr-defined]
        return meta

    def request_finished(self, request, block_ids):
        return request.request_id in self.send, None

    def start_load_kv(self, **kwargs):
        self.clock += 1
        for rid in self._get_connector_metadata().loads:
            self.due[rid] = self.clock + self.delay

    def get_finished(self, finished_req_ids):
        for rid in finished_req_ids & self.send:
            self.sending[rid] = self.clock + 1
        if self.silent:
            return None, None
        recving = {r for r, t in self.due.items() if t <= self.clock}
        sending = {r for r, t in self.sending.items() if t <= self.clock}
        for r in recving:
            del self.due[r]
        for r in sending:
            del self.sending[r]
        return sending, recving


def _engine(**conn):
    mgr = KVCacheManager(12, BS)
    worker = Handoff(KVConnectorRole.WORKER, **conn)
    sched = Scheduler(mgr, connector=Handoff(KVConnectorRole.SCHEDULER, **conn))
    return LLMEngine(mgr, sched, SimulatedExecutor(kv_connector=worker)), worker


def test_the_engine_steps_while_a_load_is_on_its_way_and_the_prompt_is_not_computed_again():
    eng, _ = _engine(remote=frozenset({"d"}), send=frozenset({"p"}))
    plain, _ = _engine()
    for e in (eng, plain):
        e.add_request(Request("d", list(range(100, 114)), max_tokens=3))
        e.add_request(Request("p", list(range(300, 309)), max_tokens=2))
    statuses = []
    while eng.has_unfinished_requests() or eng.scheduler.has_pending_kv_transfers():
        res = eng.step()
        statuses.append((eng.scheduler.requests["d"].status.name if "d" in eng.scheduler.requests else None, "p" in eng.scheduler.requests))
    plain.run()
    assert statuses == [
        ("WAITING_FOR_REMOTE_KVS", True),  # p prefills; d's load starts
        ("WAITING_FOR_REMOTE_KVS", True),  # p finishes, keeping its blocks for the send
        ("WAITING_FOR_REMOTE_KVS", True),  # nothing to compute: the executor reports d's load
        ("RUNNING", False),  # d recomputes its last prompt token; p's send is reported
        ("RUNNING", False),
        (None, False),
    ]
    assert res.pending_kv_transfers is False
    assert {r: eng.finished[r].output_token_ids for r in "dp"} == {r: plain.finished[r].output_token_ids for r in "dp"}
    # d's 14 prompt tokens came from elsewhere: the executor computed its last one and 2 decodes
    assert eng.executor.num_tokens_computed == 9 + 1 + 1 + 2
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 11


def test_a_transfer_that_never_reports_stops_the_run_with_a_clear_error(monkeypatch):
    import kvlab.engine.llm_engine as le

    monkeypatch.setattr(le, "MAX_STEPS_WAITING_ON_TRANSFERS", 5)
    eng, _ = _engine(remote=frozenset({"d"}), silent=True)
    eng.add_request(Request("d", list(range(100, 114)), max_tokens=3))
    with pytest.raises(RuntimeError, match=r"waited 5 steps in a row on a KV connector's asynchronous transfers"):
        eng.run()
    assert eng.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_a_connector_that_raises_leaves_the_scheduler_as_it_was():
    """All or nothing: a hook raising half way through an asynchronous admission, or while
    the transfers' report is taken in, undoes the whole call."""
    mgr, sched, conn = make(10, {"A": [(12, True)]})
    sched.add_request(req("A", 14, mgr))
    calls = []

    def boom(*args):
        calls.append(args)
        raise RuntimeError("a learner's bug")

    conn.update_state_after_alloc = boom
    with pytest.raises(RuntimeError, match="a learner's bug"):
        sched.schedule()
    a = sched.requests["A"]
    assert (a.status, a.num_computed_tokens, [r.request_id for r in sched.waiting], list(sched.kv_holding_waiting)) == (
        RequestStatus.WAITING,
        0,
        ["A"],
        [],
    )
    assert mgr.block_pool.get_num_free_blocks() == 9 and mgr.get_block_ids("A") == ([],)
    del conn.update_state_after_alloc
    out = sched.schedule()
    conn.update_connector_output = boom
    with pytest.raises(RuntimeError, match="a learner's bug"):
        sched.update_from_output(out, {}, kv_connector_output=KVConnectorOutput(finished_recving={"A"}))
    assert sched.finished_recving_kv_req_ids == set() and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    del conn.update_connector_output
    sched.update_from_output(out, {}, kv_connector_output=KVConnectorOutput(finished_recving={"A"}))
    assert sched.finished_recving_kv_req_ids == {"A"}
    sched.check_invariants()


def test_undoing_a_report_restores_a_running_request_that_was_not_scheduled():
    """A failed block may sit in a running request this step did not schedule (vLLM 0.33
    scans every running request); an exception later in the same call must give it its
    computed tokens back."""
    mgr, sched, conn = make(10, {"B": [(8, False)]})
    sched.add_request(req("X", 4, mgr, base=700))
    sched.add_request(req("B", 12, mgr))
    step(sched)
    b = sched.requests["B"]
    assert b.num_computed_tokens == 12 and mgr.get_block_ids("B") == ([2, 3, 4],)
    sched.max_num_scheduled_tokens = 1  # room for X's decode only
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"X": 1}

    def boom(*args):
        raise RuntimeError("a learner's bug")

    conn.update_connector_output = boom
    with pytest.raises(RuntimeError, match="a learner's bug"):
        sched.update_from_output(out, {"X": [7]}, kv_connector_output=KVConnectorOutput(invalid_block_ids={3}))
    assert b.num_computed_tokens == 12 and sched.num_kv_load_failures == 0
    del conn.update_connector_output
    sched.update_from_output(out, {"X": [7]}, kv_connector_output=KVConnectorOutput(invalid_block_ids={3}))
    assert b.num_computed_tokens == 4 and sched.num_kv_load_failures == 1  # cut at its second block


def test_the_timeline_shows_a_request_loading_while_its_kv_arrives():
    """The event log records the asynchronous load; the replay shows the request as
    "loading" -- queued, holding its blocks -- from the step it starts until it is admitted."""
    from kvlab.eventlog import EventLog
    from kvlab.timeline import Timeline

    log = EventLog()
    mgr = KVCacheManager(10, BS, event_log=log)
    sched = Scheduler(mgr, max_num_batched_tokens=64, max_num_seqs=8, connector=Scripted({"A": [(14, True)]}))
    sched.add_request(req("A", 14, mgr))
    step(sched)
    step(sched)
    step(sched, finished_recving={"A"})
    step(sched)
    loading = [e for e in log.events if e.kind == "request_loading"]
    assert [(e.request_id, e.num_computed_tokens, e.num_external_tokens, e.step) for e in loading] == [("A", 14, 14, 1)]
    tl = Timeline(log)
    assert tl.lifecycles["A"] == [(0, "waiting"), (1, "loading"), (4, "running")]
    assert tl.request_status([1, 2, 3, 4])["A"] == ["loading", "loading", "loading", "running"]
    a = tl.at(2).requests["A"]
    assert (a.status, a.num_computed_tokens, a.block_table) == ("loading", 14, [[1, 2, 3, 4]])
