"""Scheduler behaviour, step by step, with every expected value worked out by hand.

Conventions used in the hand derivations below:

* A fresh pool hands out block ids 1, 2, 3, ... (block 0 is the null block).
* ``free()`` releases a table tail first; a freed block that never got a hash goes to the
  *head* of the free queue, a cached one to the *tail* (keeping its hash until reused).
* A block is cached as soon as an allocation covers it completely with tokens that will be
  computed in that step (``min(computed + scheduled, num_tokens)``).
* A prefix hit covers at most ``num_tokens - 1`` tokens, in whole blocks.
* ``step()`` below plays the executor: a request whose tokens are all computed after the
  step gets one sampled token, ``tok(r)`` = 50_000 + its current length (deterministic and
  never inside a prompt range, so no request can hit another one's blocks by accident).
"""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, Request, RequestStatus, Scheduler
from kvlab.core.sched.output import SchedulerOutput
from kvlab.eventlog.events import EventLog


# --------------------------------------------------------------------------- helpers
def make(num_blocks: int, block_size: int = 4, caching: bool = True, **kw) -> tuple[KVCacheManager, Scheduler, EventLog]:
    log = EventLog()
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_caching=caching, event_log=log)
    return mgr, Scheduler(mgr, **kw), log


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def tok(r: Request) -> int:
    return 50_000 + r.num_tokens


def sample_for(sched: Scheduler, out: SchedulerOutput) -> dict[str, list[int]]:
    """What an executor returns: one token for each request whose known tokens are all
    computed after this step."""
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = sched.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = [tok(r)]
    return sampled


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, sample_for(sched, out))
    return out


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def events_of_step(log: EventLog, n: int) -> list:
    return [e for e in log if e.step == n]


# --------------------------------------------------------------------------- token budget
def test_token_budget_with_chunked_prefill_step_by_step():
    # block_size 16, budget 32. A has 50 prompt tokens, B 10.
    mgr, sched, _ = make(20, block_size=16, max_num_batched_tokens=32)
    a = Request("A", toks(1000, 50), max_tokens=3)
    b = Request("B", toks(2000, 10), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)

    # Step 1: A takes min(50, 32) = 32 tokens -> cdiv(32, 16) = 2 blocks [1, 2]; the budget
    # is spent, so B is not even looked at.
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 32}
    assert out.total_num_scheduled_tokens == 32
    assert out.scheduled_new_req_ids == ["A"]
    assert out.scheduled_running_req_ids == [] and out.scheduled_resumed_req_ids == []
    (nd,) = out.scheduled_new_reqs
    assert (nd.req_id, nd.block_ids, nd.num_computed_tokens) == ("A", ([1, 2],), 0)
    assert nd.new_token_ids == toks(1000, 32)
    assert ids(sched.running) == ["A"] and ids(sched.waiting) == ["B"]
    # A partial prefill gets no token, even if the executor (wrongly) returns one.
    sched.update_from_output(out, {"A": [7]})
    assert a.num_computed_tokens == 32 and a.output_token_ids == [] and a.num_tokens == 50

    # Step 2: running first: A needs the remaining 18 tokens (50 -> cdiv = 4 blocks, it has
    # 2: new [3, 4]); budget 32 - 18 = 14 left; B (10 tokens, 1 block [5]) fits.
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 18, "B": 10}
    assert out.total_num_scheduled_tokens == 28
    assert out.scheduled_running_req_ids == ["A"] and out.scheduled_new_req_ids == ["B"]
    c = out.scheduled_cached_reqs
    assert c.req_ids == ["A"]
    assert c.new_block_ids == [([3, 4],)]
    assert c.num_computed_tokens == [32]
    assert c.new_token_ids == [toks(1032, 18)]
    (nd,) = out.scheduled_new_reqs
    assert (nd.req_id, nd.block_ids, nd.num_computed_tokens, nd.new_token_ids) == ("B", ([5],), 0, toks(2000, 10))
    sched.update_from_output(out, {"A": [7], "B": [8]})  # both prompts complete: both sample
    assert a.output_token_ids == [7] and b.output_token_ids == [8]

    # Step 3: two decodes, one token each; 51 tokens still fit A's 4 blocks, 11 fit B's 1.
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    c = out.scheduled_cached_reqs
    assert c.req_ids == ["A", "B"]
    assert c.new_block_ids == [None, None]
    assert c.num_computed_tokens == [50, 10]
    assert c.new_token_ids == [[7], [8]]
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4],) and mgr.get_block_ids("B") == ([5],)


def test_long_prefill_token_threshold_caps_each_chunk():
    # Budget 100 never binds; threshold 8 caps A (20 tokens) at 8 per step, B (5) is below it.
    mgr, sched, _ = make(20, block_size=16, max_num_batched_tokens=100, long_prefill_token_threshold=8)
    sched.add_request(Request("A", toks(1000, 20), max_tokens=4))
    sched.add_request(Request("B", toks(2000, 5), max_tokens=5))
    got = []
    for _ in range(4):
        out = step(sched)
        got.append(out.num_scheduled_tokens)
    # 1: A 8 (blocks [1]), B 5 (block [2]).  2: A 8 (16 tokens, still one block), B decodes.
    # 3: A the last 4 (20 tokens -> second block [3]).  4: both decode.
    assert got == [{"A": 8, "B": 5}, {"A": 8, "B": 1}, {"A": 4, "B": 1}, {"A": 1, "B": 1}]
    assert mgr.get_block_ids("A") == ([1, 3],) and mgr.get_block_ids("B") == ([2],)


def test_without_chunked_prefill_admission_stops_at_the_first_prompt_that_does_not_fit():
    # Budget 16. A 10, B 12, C 4 tokens.
    mgr, sched, _ = make(20, block_size=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b, c = (Request(n, toks(s, k), max_tokens=5) for n, s, k in (("A", 1000, 10), ("B", 2000, 12), ("C", 3000, 4)))
    for r in (a, b, c):
        sched.add_request(r)
    # Step 1: A 10 (6 left); B's 12 > 6 stops admission -- C's 4 would fit but may not skip.
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 10}
    assert ids(sched.waiting) == ["B", "C"]
    # Step 2: A decodes (15 left), B 12 fits (3 left), C's 4 > 3 stops.
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 1, "B": 12}
    assert out.scheduled_new_req_ids == ["B"] and ids(sched.waiting) == ["C"]
    # Step 3: 1 + 1 + 4.
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1, "C": 4}


def test_with_chunked_prefill_the_same_prompts_are_split():
    # Same requests, chunked prefill on: B gets the 6 tokens left in step 1.
    _, sched, _ = make(20, block_size=16, max_num_batched_tokens=16)
    for n, s, k in (("A", 1000, 10), ("B", 2000, 12), ("C", 3000, 4)):
        sched.add_request(Request(n, toks(s, k), max_tokens=5))
    assert step(sched).num_scheduled_tokens == {"A": 10, "B": 6}
    # Step 2: A 1, B its last 6, C 4 -> 11 of 16.
    assert step(sched).num_scheduled_tokens == {"A": 1, "B": 6, "C": 4}


def test_max_num_seqs_and_finished_ids_reported_once():
    mgr, sched, _ = make(20, block_size=16, max_num_batched_tokens=100, max_num_seqs=2)
    sched.add_request(Request("A", toks(1000, 3), max_tokens=1))
    sched.add_request(Request("B", toks(2000, 3), max_tokens=5))
    sched.add_request(Request("C", toks(3000, 3), max_tokens=5))
    # Step 1: two seats; C waits although 94 tokens of budget are left.
    out = step(sched)
    assert out.scheduled_new_req_ids == ["A", "B"] and ids(sched.waiting) == ["C"]
    # A got its only token and finished in step 1: a seat is free in step 2.
    out = step(sched)
    assert out.finished_req_ids == {"A"}
    assert out.num_scheduled_tokens == {"B": 1, "C": 3} and out.scheduled_new_req_ids == ["C"]
    out = step(sched)
    assert out.finished_req_ids == set()  # reported exactly once


# --------------------------------------------------------------------------- FCFS preemption
def _fcfs_tiny_pool():
    # block_size 4, 5 blocks = 4 usable (ids 1-4), budget 64.
    mgr, sched, log = make(5, max_num_batched_tokens=64)
    a = Request("A", toks(100, 8), max_tokens=3)
    b = Request("B", toks(200, 7), max_tokens=4)
    c = Request("C", toks(300, 2), max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    return mgr, sched, log, a, b, c


def test_fcfs_preempts_the_newest_running_request():
    mgr, sched, log, a, b, c = _fcfs_tiny_pool()
    # Step 1: A 8 tokens -> [1, 2] (both full: cached); B 7 tokens -> [3, 4] (only block 3
    # full: cached). C needs 1 block, none is free: head-of-line stop, C waits.
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 8, "B": 7}
    assert mgr.get_block_ids("A") == ([1, 2],) and mgr.get_block_ids("B") == ([3, 4],)
    assert ids(sched.waiting) == ["C"] and free_ids(mgr) == []

    # Step 2: A (9 tokens) needs a 3rd block, none free -> preempt the newest running
    # request, B. B frees tail first: 4 (no hash) to the head, 3 (cached) to the tail ->
    # queue [4, 3]. A takes 4. B goes to the head of the waiting queue, in front of C.
    # (No admission is tried in a step that preempted; here B could not fit anyway -- see
    # test_priority_no_admission_in_a_step_that_preempted for a case where one would.)
    out = step(sched)
    assert out.preempted_req_ids == {"B"}
    assert out.num_scheduled_tokens == {"A": 1}
    assert out.scheduled_running_req_ids == ["A"]
    assert out.scheduled_new_req_ids == [] and out.scheduled_resumed_req_ids == []
    assert out.scheduled_cached_reqs.new_block_ids == [([4],)]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [tok_at(b, 7)]  # its output survives; only KV is lost
    assert mgr.get_block_ids("B") == ([],)
    assert mgr.get_block_ids("A") == ([1, 2, 4],)
    assert free_ids(mgr) == [3]
    assert ids(sched.waiting) == ["B", "C"]  # the victim goes to the head
    assert ids(sched.running) == ["A"]
    assert sched.num_preemptions == 1
    sched.check_invariants()

    # Step 3: A decodes. B is looked up: its first block (hash of 200..203) is block 3 ->
    # 4 tokens hit; it then needs 2 blocks (block 3 off the free queue + 1 new) but only 1
    # is free -> B fails and blocks C behind it (C alone would have fitted).
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 1}
    lookups = [e for e in events_of_step(log, 3) if e.kind == "prefix_lookup"]
    assert [(e.request_id, e.num_hit_tokens, e.hit_block_ids, e.preempted) for e in lookups] == [("B", 4, [[3]], True)]
    assert ids(sched.waiting) == ["B", "C"]
    # A has its 3 tokens: finished, freed tail first: 4 (10 tokens computed, block 4 not
    # full: no hash) to the head, then 2 and 1 (cached) to the tail -> [4, 3, 2, 1].
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert free_ids(mgr) == [4, 3, 2, 1]

    # Step 4: B resumes, hitting its own surviving block 3 (4 tokens), computes 4 tokens
    # (its 8 = 7 prompt + 1 output) and gets block 4; C then gets block 2 (evicting A's
    # cached block 2).
    out = step(sched)
    assert out.finished_req_ids == {"A"}
    assert out.scheduled_resumed_req_ids == ["B"] and out.scheduled_new_req_ids == ["C"]
    assert out.num_scheduled_tokens == {"B": 4, "C": 2}
    new_data = {nd.req_id: nd for nd in out.scheduled_new_reqs}  # new and resumed, whole
    assert sorted(new_data) == ["B", "C"]
    nb, nc = new_data["B"], new_data["C"]
    assert (nb.block_ids, nb.num_computed_tokens) == (([3, 4],), 4)
    assert nb.new_token_ids == [204, 205, 206, tok_at(b, 7)]
    assert nb.all_token_ids == toks(200, 7) + [tok_at(b, 7)]
    assert (nc.block_ids, nc.num_computed_tokens) == (([2],), 0)
    evicted = [e.block_id for e in events_of_step(log, 4) if e.kind == "block_evicted"]
    assert evicted == [2]
    assert b.num_cached_tokens == 0  # set once, at the first admission (vLLM's field)
    sched.check_invariants()


def tok_at(r: Request, length: int) -> int:
    """The token tok() gave ``r`` when it had ``length`` tokens."""
    return 50_000 + length


def test_preemption_step_events():
    mgr, sched, log, a, b, c = _fcfs_tiny_pool()
    step(sched)
    n0 = len(log)
    step(sched)
    evs = log.events[n0:]
    assert all(e.step == 2 for e in evs)
    assert [e.kind for e in evs] == [
        "step_started",
        "blocks_freed",  # B, tail first
        "request_preempted",
        "blocks_allocated",  # A's new block
        "request_scheduled",
        "tokens_appended",
        "step_finished",
    ]
    started, freed, pre, alloc, sch, app, fin = evs
    assert started.token_budget == 64
    assert (freed.request_id, freed.block_ids, freed.to_head, freed.to_tail) == ("B", [4, 3], [4], [3])
    assert (pre.request_id, pre.for_request_id, pre.num_computed_tokens_lost) == ("B", "A", 7)
    assert "FCFS" in pre.reason and "no free block" in pre.reason
    assert (alloc.request_id, alloc.block_ids) == ("A", [4])
    assert (sch.request_id, sch.num_tokens, sch.num_computed_tokens, sch.phase) == ("A", 1, 8, "running")
    assert (app.request_id, app.token_ids) == ("A", [tok_at(a, 9)])
    # After the step: A running, B and C waiting, 3 of 4 blocks in use, one preemption;
    # step 1 admitted A (8 tokens) and B (7): 15 query tokens, no hits. C (2) was looked up
    # but not admitted, and vLLM records a lookup only at admission.
    assert (fin.num_running, fin.num_waiting, fin.kv_cache_usage, fin.num_preemptions) == (1, 2, 0.75, 1)
    assert (fin.prefix_cache_queries, fin.prefix_cache_hits) == (15, 0)


def test_stats_count_only_new_requests_prefix_lookups():
    # vLLM exports queries/hits of requests that were never preempted; a preempted request
    # re-hitting its own blocks is counted apart (PrefixCacheStats.preempted_*).
    mgr, sched, log, a, b, c = _fcfs_tiny_pool()
    for _ in range(4):
        step(sched)
    # Admissions of new requests: step 1 A 8, B 7; step 4 C 2 -> 17, no hits. C's failed try
    # in step 1 is not a query (recorded at admission, as vLLM 0.33), and B's re-admission
    # after its preemption (8 tokens, 4 hits) is kept apart.
    s = sched.make_stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions) == (17, 0, 1)
    # End of step 4: C (max_tokens 1) finished; B runs on [3, 4]: 2 of 4 blocks.
    assert (s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage) == (1, 0, 0.5)


def test_tail_first_freeing_keeps_the_victims_prefix():
    """After V is preempted, A grows and evicts one of V's freed blocks. Tail-first freeing
    put V's *last* block at the queue head, so V keeps its first two blocks: k = 2 blocks.
    (Freed head first, the queue would be [2, 3, 4]: A would evict block 2 and V's chain
    would break at its first block: 0 hits.)"""
    # block_size 4, 6 blocks = 5 usable, FCFS.
    mgr, sched, log = make(6, max_num_batched_tokens=64)
    a = Request("A", toks(100, 4), max_tokens=6)
    v = Request("V", toks(200, 12), max_tokens=2)
    sched.add_request(a)
    sched.add_request(v)
    # Step 1: A [1]; V [2, 3, 4], all three full -> cached. Free: [5].
    step(sched)
    assert mgr.get_block_ids("V") == ([2, 3, 4],) and free_ids(mgr) == [5]
    # Step 2: A (5 tokens) takes 5. V (13 tokens) needs a 4th block: none. V is the newest:
    # it preempts itself and the running loop ends. Its blocks go to the tail, tail first.
    out = step(sched)
    assert out.preempted_req_ids == {"V"} and out.num_scheduled_tokens == {"A": 1}
    freed = [e for e in events_of_step(log, 2) if e.kind == "blocks_freed"]
    assert [(e.request_id, e.block_ids, e.to_head, e.to_tail) for e in freed] == [("V", [4, 3, 2], [], [4, 3, 2])]
    assert free_ids(mgr) == [4, 3, 2]
    # Steps 3-5: V hits all 3 blocks (12 = 13 - 1 tokens) but would need all 3 free blocks
    # plus a 4th: it waits. A decodes inside its 2 blocks.
    for n in (3, 4, 5):
        out = step(sched)
        assert out.num_scheduled_tokens == {"A": 1}
        (lk,) = [e for e in events_of_step(log, n) if e.kind == "prefix_lookup"]
        assert (lk.request_id, lk.num_hit_tokens) == ("V", 12)
    # Step 6: A computes its 9th token: a 3rd block, the queue head -> block 4, V's tail,
    # is evicted. V's lookup now stops after blocks 2, 3 (8 tokens). A then finishes
    # (6 outputs) and frees [4, 5, 1]: 4 (no hash now) to the head, 5 and 1 to the tail.
    out = step(sched)
    assert mgr.get_block_ids("A") == ([],) and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [e.block_id for e in events_of_step(log, 6) if e.kind == "block_evicted"] == [4]
    (lk,) = [e for e in events_of_step(log, 6) if e.kind == "prefix_lookup"]
    assert (lk.num_hit_tokens, lk.hit_block_ids) == (8, [[2, 3]])
    assert free_ids(mgr) == [4, 3, 2, 5, 1]
    # Step 7: V resumes with k = 2 blocks (8 tokens) from the cache, computes 13 - 8 = 5
    # tokens and takes 2 new blocks from the head: 4 and 5.
    out = step(sched)
    assert out.scheduled_resumed_req_ids == ["V"] and out.num_scheduled_tokens == {"V": 5}
    (nd,) = out.scheduled_new_reqs
    assert (nd.num_computed_tokens, nd.block_ids) == (8, ([2, 3, 4, 5],))
    assert nd.new_token_ids == [208, 209, 210, 211, tok_at(v, 12)]
    sched.check_invariants()


# --------------------------------------------------------------------------- self-preemption
def _self_preemption_setup(policy: str):
    # block_size 4, 5 blocks = 4 usable. V (priority 5) arrives first, A (priority 0) later.
    mgr, sched, log = make(5, max_num_batched_tokens=64, policy=policy)
    v = Request("V", toks(100, 3), max_tokens=10, priority=5, arrival_time=0.0)
    a = Request("A", toks(200, 1), max_tokens=10, priority=0, arrival_time=1.0)
    sched.add_request(v)
    step(sched)  # V [1]
    sched.add_request(a)
    # Steps 2-6: V computes tokens 3..7 (block 3 at step 3), A tokens 0..4 (blocks 2, then
    # 4 at step 6). After step 6 all 4 blocks are held: V [1, 3], A [2, 4].
    for _ in range(5):
        out = step(sched)
        assert not out.preempted_req_ids
    assert mgr.get_block_ids("V") == ([1, 3],) and mgr.get_block_ids("A") == ([2, 4],)
    assert ids(sched.running) == ["V", "A"] and free_ids(mgr) == []
    return mgr, sched, log, v, a


def test_priority_self_preemption_goes_on_with_the_next_request():
    mgr, sched, log, v, a = _self_preemption_setup("priority")
    # Step 7: V (9 tokens) needs a 3rd block. The victim is the largest (priority, arrival):
    # V itself. It preempts itself, and the requests after it rank higher and may fit, so
    # the running loop goes on: A, which needed nothing, is scheduled (vLLM 0.33; its
    # scheduler gave the same steps, tables and free queue).
    out = step(sched)
    assert out.preempted_req_ids == {"V"}
    assert out.num_scheduled_tokens == {"A": 1} and out.total_num_scheduled_tokens == 1
    assert ids(sched.running) == ["A"] and ids(sched.waiting) == ["V"]
    assert (v.status, v.num_computed_tokens, v.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert mgr.get_block_ids("V") == ([],) and free_ids(mgr) == [3, 1]
    # Step 8: A alone.
    assert step(sched).num_scheduled_tokens == {"A": 1}


def test_fcfs_same_situation_preempts_the_newest_instead():
    mgr, sched, log, v, a = _self_preemption_setup("fcfs")
    # Step 7 under FCFS: the victim is A (the newest). A frees [4, 2]: 4 (no hash) to the
    # head, 2 (cached: A's first 4 tokens) to the tail; V takes 4.
    out = step(sched)
    assert out.preempted_req_ids == {"A"} and out.num_scheduled_tokens == {"V": 1}
    assert mgr.get_block_ids("V") == ([1, 3, 4],) and free_ids(mgr) == [2]
    assert ids(sched.waiting) == ["A"]


# --------------------------------------------------------------------------- priority
def test_priority_waiting_order_and_admission_order():
    mgr, sched, _ = make(30, max_num_batched_tokens=100, max_num_seqs=3, policy="priority")
    reqs = [
        Request("a", toks(100, 3), priority=1, arrival_time=0.0),
        Request("b", toks(200, 3), priority=0, arrival_time=3.0),
        Request("c", toks(300, 3), priority=0, arrival_time=1.0),
        Request("d", toks(400, 3), priority=1, arrival_time=2.0),
    ]
    for r in reqs:
        sched.add_request(r)
    # Lower priority first; ties by earlier arrival: c(0, 1.0) b(0, 3.0) a(1, 0.0) d(1, 2.0).
    assert ids(sched.waiting) == ["c", "b", "a", "d"]
    out = sched.schedule()
    assert out.scheduled_new_req_ids == ["c", "b", "a"]  # three seats
    assert ids(sched.running) == ["c", "b", "a"] and ids(sched.waiting) == ["d"]


def test_priority_preempts_largest_priority_arrival_even_if_already_scheduled():
    # block_size 4, 4 blocks = 3 usable. X and Y share priority 1; X arrived later (5.0 vs
    # 3.0) but was admitted first, so running = [X, Y] and Y is the newest.
    mgr, sched, log = make(4, max_num_batched_tokens=64, policy="priority")
    x = Request("X", toks(100, 4), max_tokens=8, priority=1, arrival_time=5.0)
    y = Request("Y", toks(200, 3), max_tokens=8, priority=1, arrival_time=3.0)
    sched.add_request(x)
    step(sched)  # X [1], then samples: 5 tokens
    sched.add_request(y)
    step(sched)  # X 5th token -> [1, 2]; Y [3]
    step(sched)  # X 6th, Y 4th token: no new blocks
    assert ids(sched.running) == ["X", "Y"] and free_ids(mgr) == []
    # Step 4: X is scheduled first (7th token, fits). Y's 5th token needs a 2nd block: the
    # victim is max((1, 5.0), (1, 3.0)) = X -- already scheduled, so its token goes back.
    # X frees [2, 1]: 2 (no hash) to the head, 1 (cached) to the tail; Y takes 2.
    out = step(sched)
    assert out.preempted_req_ids == {"X"}
    assert out.num_scheduled_tokens == {"Y": 1} and out.total_num_scheduled_tokens == 1
    assert out.scheduled_running_req_ids == ["Y"]
    assert mgr.get_block_ids("Y") == ([3, 2],) and free_ids(mgr) == [1]
    assert ids(sched.waiting) == ["X"] and x.num_computed_tokens == 0
    assert [e.request_id for e in events_of_step(log, 4) if e.kind == "request_scheduled"] == ["Y"]
    (pre,) = [e for e in events_of_step(log, 4) if e.kind == "request_preempted"]
    assert (pre.request_id, pre.for_request_id) == ("X", "Y") and "priority" in pre.reason


def test_priority_victim_ties_are_broken_by_arrival_time():
    # block_size 4, 3 blocks = 2 usable. P and Q share priority 1; Q arrived later.
    mgr, sched, log = make(3, max_num_batched_tokens=64, policy="priority")
    p = Request("P", toks(100, 4), max_tokens=5, priority=1, arrival_time=1.0)
    q = Request("Q", toks(200, 3), max_tokens=6, priority=1, arrival_time=2.0)
    sched.add_request(p)
    sched.add_request(q)
    step(sched)  # P [1] (full, cached), Q [2]; pool full
    # Step 2: P's 5th token needs a 2nd block. Victim: max((1, 1.0), (1, 2.0)) = Q, not P
    # itself. Q (3 tokens, block 2 not full) frees 2 to the head; P takes it.
    out = step(sched)
    assert out.preempted_req_ids == {"Q"} and out.num_scheduled_tokens == {"P": 1}
    assert mgr.get_block_ids("P") == ([1, 2],) and ids(sched.waiting) == ["Q"]


def test_priority_no_admission_in_a_step_that_preempted():
    # block_size 4, 6 blocks = 5 usable.
    mgr, sched, log = make(6, max_num_batched_tokens=64, policy="priority")
    a = Request("A", toks(100, 4), max_tokens=8, priority=0, arrival_time=0.0)
    b = Request("B", toks(200, 16), max_tokens=5, priority=3, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # A [1]; B [2, 3, 4, 5], all four cached. Pool full.
    e = Request("E", toks(300, 3), max_tokens=2, priority=1, arrival_time=2.0)
    sched.add_request(e)
    # Step 2: A's 5th token needs a block; the victim is B (priority 3), not yet scheduled.
    # B frees [5, 4, 3, 2] to the tail; A takes 5. Now 3 blocks are free, 63 tokens of budget
    # are left and E (1 block) heads the waiting heap -- but a step that preempted admits
    # no one.
    out = step(sched)
    assert out.preempted_req_ids == {"B"} and out.num_scheduled_tokens == {"A": 1}
    assert out.scheduled_new_req_ids == [] and free_ids(mgr) == [4, 3, 2]
    assert ids(sched.waiting) == ["E", "B"]  # back into the heap, behind E
    # Step 3: E gets the head block, 4 (evicting B's 3rd block). B then hits blocks 2, 3
    # (8 tokens) but needs 5 blocks with only 2 free: it waits.
    out = step(sched)
    assert out.num_scheduled_tokens == {"A": 1, "E": 3} and mgr.get_block_ids("E") == ([4],)
    (lk,) = [ev for ev in events_of_step(log, 3) if ev.kind == "prefix_lookup" and ev.request_id == "B"]
    assert lk.num_hit_tokens == 8 and ids(sched.waiting) == ["B"]


def test_priority_victim_gives_its_tokens_back_to_the_budget():
    # block_size 4, 9 blocks = 8 usable, budget 12. The first-chunk admission rule
    # (scheduler_reserve_full_isl=False) lets D in on 9 of its 25 tokens, so that D's next
    # chunk forces a preemption; vLLM's whole-prompt gate would keep D waiting (next test).
    mgr, sched, log = make(9, max_num_batched_tokens=12, policy="priority", scheduler_reserve_full_isl=False)
    a = Request("A", toks(100, 1), max_tokens=20, priority=0, arrival_time=0.0)
    b = Request("B", toks(200, 9), max_tokens=20, priority=3, arrival_time=1.0)
    c = Request("C", toks(300, 3), max_tokens=20, priority=1, arrival_time=2.0)
    d = Request("D", toks(400, 25), max_tokens=2, priority=2, arrival_time=3.0)
    e = Request("E", toks(500, 2), max_tokens=2, priority=0, arrival_time=4.0)
    sched.add_request(a)
    sched.add_request(b)
    # Step 1: A 1 [1], B 9 [2, 3, 4] (budget 12 -> 2 left).
    assert step(sched).num_scheduled_tokens == {"A": 1, "B": 9}
    sched.add_request(c)
    # Step 2: A 1, B 1, C 3 [5].
    assert step(sched).num_scheduled_tokens == {"A": 1, "B": 1, "C": 3}
    sched.add_request(d)
    # Step 3: A 1, B 1, C 1, D gets the 9 left -> cdiv(9, 4) = 3 blocks [6, 7, 8]. Pool full.
    assert step(sched).num_scheduled_tokens == {"A": 1, "B": 1, "C": 1, "D": 9}
    assert free_ids(mgr) == []
    sched.add_request(e)
    # Step 4: A 1 (11 left), B 1 (10 left; its 12 tokens fill block 4, now cached). C's 5th
    # token needs a 2nd block: victim = max over (0,0) (3,1) (1,2) (2,3) = B, already
    # scheduled -> its token returns: 11 left. B frees [4, 3, 2] (all cached) to the tail.
    # C takes 4 (10 left). D's chunk is min(25 - 9, 10) = 10 tokens -> 19 tokens need 5
    # blocks: 3 and 2. Without the give-back D would have had 9, total 11.
    out = step(sched)
    assert out.preempted_req_ids == {"B"}
    assert out.num_scheduled_tokens == {"A": 1, "C": 1, "D": 10}
    assert out.total_num_scheduled_tokens == 12
    assert out.scheduled_running_req_ids == ["A", "C", "D"]
    assert mgr.get_block_ids("C") == ([5, 4],) and mgr.get_block_ids("D") == ([6, 7, 8, 3, 2],)
    assert [ev.block_id for ev in events_of_step(log, 4) if ev.kind == "block_evicted"] == [4, 3, 2]
    # No admission in this step; B goes back into the heap behind E (priority 0).
    assert out.scheduled_new_req_ids == []
    assert ids(sched.waiting) == ["E", "B"]
    sched.check_invariants()


# --------------------------------------------------------------------------- update_from_output
def test_eos_finishes_stopped_and_frees_blocks():
    mgr, sched, log = make(10)
    r = Request("R", toks(100, 3), max_tokens=10, eos_token_id=99)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.update_from_output(out, {"R": [5]}) == []
    out = sched.schedule()
    # Several tokens at once: appending stops at eos, the rest is dropped.
    finished = sched.update_from_output(out, {"R": [6, 99, 8]})
    assert finished == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.output_token_ids == [5, 6, 99]
    assert ids(sched.running) == [] and mgr.get_block_ids("R") == ([],)
    assert mgr.block_pool.get_num_free_blocks() == 9
    (fin,) = [e for e in log if e.kind == "request_finished"]
    assert (fin.request_id, fin.reason, fin.num_output_tokens) == ("R", "stop", 3)
    out = sched.schedule()
    assert out.finished_req_ids == {"R"} and out.num_scheduled_tokens == {}
    assert not sched.has_unfinished_requests()


def test_max_tokens_finishes_length_capped_before_eos():
    mgr, sched, _ = make(10)
    r = Request("R", toks(100, 3), max_tokens=2, eos_token_id=99)
    sched.add_request(r)
    sched.update_from_output(sched.schedule(), {"R": [5]})
    assert r.status == RequestStatus.RUNNING
    # The 2nd token is both the last allowed one and eos: the length check comes first (vLLM).
    sched.update_from_output(sched.schedule(), {"R": [99]})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.finish_reason == "length"
    assert mgr.block_pool.get_num_free_blocks() == 9


def test_abort_of_running_and_waiting_requests_says_abort_and_frees():
    mgr, sched, _ = make(4)  # 3 usable blocks of 4 tokens
    a, b = Request("A", toks(0, 6), max_tokens=3), Request("B", toks(10, 6), max_tokens=3)
    sched.add_request(a), sched.add_request(b)
    out = sched.schedule()
    assert out.scheduled_new_req_ids == ["A"] and a.finish_reason is None  # B waits: 2 + 2 > 3 blocks
    sched.finish_requests(["A", "B", "unknown"])
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED_ABORTED, "abort")
    assert (b.status, b.finish_reason) == (RequestStatus.FINISHED_ABORTED, "abort")
    assert not sched.has_unfinished_requests() and mgr.block_pool.get_num_free_blocks() == 3
    assert sched.schedule().finished_req_ids == {"A", "B"}


# --------------------------------------------------------------------------- stats
def test_stats_and_prometheus_text():
    # block_size 4, 11 blocks = 10 usable, two seats.
    mgr, sched, _ = make(11, max_num_batched_tokens=64, max_num_seqs=2)
    sched.add_request(Request("R1", toks(100, 9), max_tokens=1))
    # Step 1: R1 9 tokens [1, 2, 3], blocks 1 and 2 cached; finishes (1 token) and frees:
    # 3 to the head, 2 and 1 to the tail.
    step(sched)
    sched.add_request(Request("R2", toks(100, 8) + [500, 501], max_tokens=3))
    sched.add_request(Request("R3", toks(300, 5), max_tokens=3))
    sched.add_request(Request("R4", toks(400, 5), max_tokens=3))
    # Step 2: R2 hits blocks 1, 2 (8 of its 10 tokens) and gets 3; R3 gets [4, 5]; R4 finds
    # no seat and is never looked up. Queries 9 + 10 + 5 = 24 tokens, hits 8.
    # In use: 1, 2, 3, 4, 5 = 5 of 10 blocks.
    step(sched)
    s = sched.make_stats()
    assert (s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage) == (2, 1, 0.5)
    assert (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits) == (0, 24, 8)
    text = s.to_prometheus()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert [ln for ln in lines if not ln.startswith("# HELP")] == [
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="kvlab-tiny"} 2.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="kvlab-tiny"} 1.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{model_name="kvlab-tiny"} 0.5',
        "# TYPE vllm:num_preemptions counter",
        'vllm:num_preemptions_total{model_name="kvlab-tiny"} 0.0',
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{model_name="kvlab-tiny"} 24.0',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{model_name="kvlab-tiny"} 8.0',
    ]
    helps = [ln.split()[2] for ln in lines if ln.startswith("# HELP")]
    assert helps == [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
    ]
    assert 'model_name="m"' in s.to_prometheus(model_name="m")


# --------------------------------------------------------------------------- long prefills
def test_the_long_prefill_cap_spares_a_request_alone():
    # vLLM 0.33 (its scheduler gave the same steps): the cap keeps one long prompt from
    # starving the others of the budget, so a request alone takes its whole prompt at once;
    # two prompts waiting together are cut to 8 tokens a step each
    mgr, sched, _ = make(40, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sched.add_request(Request("solo", toks(100, 20), max_tokens=2))
    steps = [step(sched).num_scheduled_tokens for _ in range(2)]
    sched.add_request(Request("x", toks(200, 20), max_tokens=2))
    sched.add_request(Request("y", toks(300, 20), max_tokens=2))
    steps += [step(sched).num_scheduled_tokens for _ in range(4)]
    assert steps == [{"solo": 20}, {"solo": 1}, {"x": 8, "y": 8}, {"x": 8, "y": 8}, {"x": 4, "y": 4}, {"x": 1, "y": 1}]


def test_new_requests_come_before_resumed_ones_in_the_step_output():
    # vLLM 0.33 with its V2 model runner (its scheduler gave the same steps): the new
    # requests' data first, then the resumed ones', each in admission order -- though the
    # resumed B heads the waiting queue and is admitted before the new C
    mgr, sched, _ = make(6, max_num_batched_tokens=64)
    sched.add_request(Request("A", toks(100, 8), max_tokens=6))
    sched.add_request(Request("B", toks(200, 8), max_tokens=6))
    assert step(sched).num_scheduled_tokens == {"A": 8, "B": 8}
    assert step(sched).preempted_req_ids == {"B"}
    sched.add_request(Request("C", toks(300, 2), max_tokens=1))
    assert [step(sched).num_scheduled_tokens for _ in range(4)] == [{"A": 1}] * 4  # B heads the queue and does not fit
    out = step(sched)
    assert out.num_scheduled_tokens == {"B": 5, "C": 2}
    assert (out.scheduled_new_req_ids, out.scheduled_resumed_req_ids) == (["C"], ["B"])
    assert [nr.req_id for nr in out.scheduled_new_reqs] == ["C", "B"]


def test_a_request_the_connector_cannot_answer_yet_is_passed_over():
    # vLLM 0.33 (its scheduler, with the same scripted connector, gave the same steps): a
    # connector that cannot tell yet (None) does not stall the queue -- A is passed over, B
    # behind it is admitted with 5 tokens from the connector, and A is asked again next step
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from scheduler_side_connector import SchedulerSideConnector

    class Scripted(SchedulerSideConnector):
        asked: list[str] = []

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            self.asked.append(request.request_id)
            if request.request_id == "A":
                return (None, False) if self.asked.count("A") == 1 else (0, False)
            return 5, False

    mgr, sched, _ = make(40, max_num_batched_tokens=64, connector=Scripted(KVConnectorRole.SCHEDULER))
    sched.add_request(Request("A", toks(100, 8), max_tokens=3))
    sched.add_request(Request("B", toks(200, 8), max_tokens=3))
    out = step(sched)
    assert out.num_scheduled_tokens == {"B": 3} and ids(sched.waiting) == ["A"]
    assert [(nr.req_id, nr.num_computed_tokens, nr.block_ids) for nr in out.scheduled_new_reqs] == [("B", 5, ([1, 2],))]
    out = step(sched)
    assert out.num_scheduled_tokens == {"B": 1, "A": 8}
    assert [(nr.req_id, nr.num_computed_tokens, nr.block_ids) for nr in out.scheduled_new_reqs] == [("A", 0, ([4, 5],))]
    assert Scripted.asked == ["A", "B", "A"]


def test_a_finished_request_hands_a_hybrid_connector_only_what_still_matters():
    # vLLM 0.33 (its scheduler gave the same table and free queue): before the connector
    # hears that A finished, the window group's blocks that left the window are freed, and
    # every group's table is cut to the computed tokens; a connector for hybrid models
    # (request_finished_all_groups, vLLM's SupportsHMA) gets every group
    from kvlab import FullAttentionSpec, SlidingWindowSpec
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from scheduler_side_connector import SchedulerSideConnector

    class Hybrid(SchedulerSideConnector):
        tables: list = []

        def request_finished(self, request, block_ids):
            raise AssertionError("a hybrid connector is asked with every group")

        def request_finished_all_groups(self, request, block_ids):
            self.tables.append((request.request_id, request.num_computed_tokens, block_ids))
            return False, None

    groups = [FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=4)]
    mgr = KVCacheManager(num_blocks=40, kv_cache_groups=groups)
    sched = Scheduler(mgr, max_num_batched_tokens=64, connector=Hybrid(KVConnectorRole.SCHEDULER))
    sched.add_request(Request("A", toks(100, 14), max_tokens=3))
    for _ in range(3):
        step(sched)
    assert Hybrid.tables == [("A", 16, ([1, 2, 3, 4], [0, 0, 0, 8]))]
    assert free_ids(mgr) == list(range(9, 40)) + [6, 5, 7, 4, 3, 2, 1, 8]


def test_max_loras_passes_over_a_request_with_one_adapter_too_many():
    # vLLM 0.33 (LoRAConfig.max_loras = 1; its scheduler gave the same steps): B's adapter
    # would be a second one in the batch, so B is passed over while A and C (adapter 1) and
    # D (no adapter) run; B runs once they are done
    mgr, sched, _ = make(40, max_num_batched_tokens=64, max_loras=1)
    for rid, adapter, start in [("A", 1, 100), ("B", 2, 200), ("C", 1, 300), ("D", 0, 400)]:
        lora = dict(lora_name=f"L{adapter}", lora_int_id=adapter, lora_path="/p") if adapter else {}
        sched.add_request(Request(rid, toks(start, 6), max_tokens=2, **lora))
    steps = []
    for _ in range(4):
        steps.append((step(sched).num_scheduled_tokens, ids(sched.waiting)))
    assert steps == [
        ({"A": 6, "C": 6, "D": 6}, ["B"]),
        ({"A": 1, "C": 1, "D": 1}, ["B"]),
        ({"B": 6}, []),
        ({"B": 1}, []),
    ]
    with pytest.raises(ValueError, match="max_loras"):
        make(4, max_loras=0)
