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

from kvlab import KVCacheManager, Request, Scheduler
from kvlab.outputs import KVConnectorOutput
from kvlab.request import RequestStatus

from scheduler_side_connector import SchedulerSideConnector

BS = 4


class Scripted(SchedulerSideConnector):
    """Answers request ``rid`` with ``offers[rid]``, one answer per ask (the last one repeats;
    none: nothing to offer); keeps the blocks of the finished requests in ``delay``."""

    def __init__(self, offers: dict[str, list[tuple[int, bool]]], delay: frozenset[str] = frozenset()) -> None:
        from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

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
