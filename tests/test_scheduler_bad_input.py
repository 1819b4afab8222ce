"""Bad input to the Scheduler: a clear error that names the argument, raised before any
state changes (nothing queued, nothing emitted, nothing lost)."""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, Request, RequestStatus, Scheduler
from kvlab.eventlog.events import EventLog


def make(num_blocks: int = 5, block_size: int = 4, **kw) -> tuple[KVCacheManager, Scheduler, EventLog]:
    log = EventLog()
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, event_log=log)
    return mgr, Scheduler(mgr, **kw), log


@pytest.mark.parametrize("policy", ["lifo", "FCFS ", "", None, "sjf"])
def test_unknown_policy(policy):
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    with pytest.raises(ValueError, match=r"policy.*fcfs.*priority"):
        Scheduler(mgr, policy=policy)


@pytest.mark.parametrize("arg", ["max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8", None])
def test_non_positive_or_non_int_limits(arg, value):
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    with pytest.raises((ValueError, TypeError), match=arg):
        Scheduler(mgr, **{arg: value})


@pytest.mark.parametrize("value", [-1, 1.5, "4"])
def test_bad_long_prefill_token_threshold(value):
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    with pytest.raises((ValueError, TypeError), match="long_prefill_token_threshold"):
        Scheduler(mgr, long_prefill_token_threshold=value)


def test_limits_of_one_are_accepted():
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    s = Scheduler(mgr, max_num_batched_tokens=1, max_num_seqs=1)
    s.add_request(Request("r", [1, 2, 3], max_tokens=1))
    assert s.schedule().num_scheduled_tokens == {"r": 1}  # one token per step, chunked


def test_kv_cache_manager_must_be_a_manager():
    with pytest.raises(TypeError, match="kv_cache_manager"):
        Scheduler(object())


@pytest.mark.parametrize("bad", ["r0", [1, 2, 3], {"request_id": "r0"}, None, 7])
def test_add_request_rejects_non_requests(bad):
    _, sched, log = make()
    n = len(log)
    with pytest.raises(TypeError, match="request"):
        sched.add_request(bad)
    assert len(sched.waiting) == 0 and sched.requests == {} and len(log) == n


def test_duplicate_request_id_raises_and_loses_nothing():
    mgr, sched, log = make(num_blocks=10)
    first = Request("r0", [1, 2, 3, 4, 5], max_tokens=2)
    sched.add_request(first)
    n = len(log)
    for dup in (Request("r0", [9, 9], max_tokens=1), first):  # another object, the same object
        with pytest.raises(ValueError, match=r"'r0'.*already"):
            sched.add_request(dup)
    assert len(log) == n  # no RequestAdded for the rejected ones
    assert list(sched.waiting) == [first] and sched.requests == {"r0": first}
    # Still a duplicate while it runs.
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r0": 5}
    with pytest.raises(ValueError, match="'r0'"):
        sched.add_request(Request("r0", [9, 9], max_tokens=1))
    # The first one is unharmed and runs to the end.
    sched.update_from_output(out, {"r0": [7]})
    sched.update_from_output(sched.schedule(), {"r0": [8]})
    assert first.status == RequestStatus.FINISHED_LENGTH_CAPPED and first.output_token_ids == [7, 8]
    # Once finished, the id is free again.
    again = Request("r0", [9, 9], max_tokens=1)
    sched.add_request(again)
    assert list(sched.waiting) == [again]


def test_request_that_can_never_fit_the_pool_is_rejected_at_add():
    # 5 blocks of 4 tokens = 4 usable blocks = 16 token slots. A request holds at most
    # prompt + max_tokens - 1 tokens of KV (the last sampled token is never fed back).
    mgr, sched, log = make(num_blocks=5, block_size=4)
    n = len(log)
    with pytest.raises(ValueError, match=r"'long'.*17 prompt.*5 blocks.*4 usable"):
        sched.add_request(Request("long", list(range(17)), max_tokens=1))
    # The prompt fits, prompt + outputs would not: 16 + 2 - 1 = 17 slots.
    with pytest.raises(ValueError, match=r"'grows'.*max_tokens"):
        sched.add_request(Request("grows", list(range(16)), max_tokens=2))
    assert len(sched.waiting) == 0 and sched.requests == {} and len(log) == n
    assert mgr.block_pool.get_num_free_blocks() == 4
    # Exactly the pool: accepted, and it runs to the end without preemption.
    r = Request("exact", list(range(16)), max_tokens=1)
    sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"exact": 16} and mgr.get_block_ids("exact") == ([1, 2, 3, 4],)
    sched.update_from_output(out, {"exact": [5]})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prompt_over_budget_without_chunked_prefill_is_rejected():
    _, sched, _ = make(num_blocks=20, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens"):
        sched.add_request(Request("r", list(range(9)), max_tokens=1))
    assert len(sched.waiting) == 0
    sched.add_request(Request("ok", list(range(8)), max_tokens=1))  # exactly the budget


def test_request_that_already_ran_is_rejected():
    _, s1, _ = make(num_blocks=10)
    r = Request("r", [1, 2, 3], max_tokens=4)
    s1.add_request(r)
    s1.update_from_output(s1.schedule(), {"r": [4]})
    _, s2, _ = make(num_blocks=10)
    with pytest.raises(ValueError, match=r"'r' is already queued in another scheduler"):
        s2.add_request(r)  # still running in s1
    assert len(s2.waiting) == 0
    s1.finish_requests("r")
    with pytest.raises(ValueError, match=r"'r'.*fresh"):
        s2.add_request(r)  # finished in s1: not fresh
    assert len(s2.waiting) == 0
