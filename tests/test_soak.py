"""Soak: 1,000 ShareGPT-like requests through a deliberately small pool.

Preemption by recompute must be invisible in the results: every request's output tokens
equal those of a run with an unbounded pool (the simulated executor's next token is a
function of the context only). After every step the scheduler's invariants hold; at the
end every request has finished and no block is leaked.

Scale: the paper's ShareGPT means (161 in / 338 out, max_model_len 2048) are scaled down
about 10x (16 in / 24 out, max_model_len 256) with the generator's own heavy-tailed
spreads, so the tail is kept (p50 input 9 tokens, max 170). n stays 1,000. Arrivals are
Poisson at 20 req/s on the simulated clock -- a little above what the small pool can serve,
so a queue forms but stays short (check_invariants() walks the waiting queue every step).
"""

from __future__ import annotations

import random

import pytest

from kvlab import Request, RequestStatus
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.workloads.traces import sharegpt_like

pytestmark = pytest.mark.slow  # minutes on 2 shared cores: `make test` runs it, `make test-fast` does not

N = 1000
BLOCK_SIZE = 8
MAX_MODEL_LEN = 256
# 39 usable blocks = 312 token slots; the longest request alone may need 255 (32 blocks).
SMALL_POOL = 40
BUDGET = 256
MAX_SEQS = 32


@pytest.fixture(scope="module")
def trace():
    t = sharegpt_like(N, seed=1, rate=20.0, max_model_len=MAX_MODEL_LEN, mean_input=16, mean_output=24)
    assert len(t) == N
    lens = sorted(r.prompt_len + r.max_tokens for r in t)
    assert lens[-1] > 8 * lens[N // 2]  # the heavy tail survived the scaling (256 vs 30)
    assert lens[-1] - 1 <= (SMALL_POOL - 1) * BLOCK_SIZE < 2 * (lens[-1] - 1)  # fits alone, not twice
    return t


def make_requests(trace) -> list[Request]:
    # Priorities matter only under policy="priority"; arrival times are the trace's.
    rng = random.Random(7)
    return [
        Request(t.request_id, t.prompt_token_ids, max_tokens=t.max_tokens, priority=rng.randrange(3), arrival_time=t.arrival_time)
        for t in trace
    ]


def drive(eng: LLMEngine, reqs: list[Request], check: bool) -> int:
    """run_trace, with a look after every step. Returns the number of steps."""
    sched = eng.scheduler
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    i = steps = 0
    while i < len(pending) or eng.has_unfinished_requests():
        if not eng.has_unfinished_requests():
            eng.clock = max(eng.clock, pending[i].arrival_time)
        while i < len(pending) and pending[i].arrival_time <= eng.clock:
            eng.add_request(pending[i])
            i += 1
        out = eng.step().scheduler_output
        steps += 1
        if check:
            sched.check_invariants()
            assert out.total_num_scheduled_tokens <= BUDGET
            assert len(sched.running) <= MAX_SEQS
            if out.preempted_req_ids:  # no admission in a step that preempted
                assert not out.scheduled_new_req_ids and not out.scheduled_resumed_req_ids
            assert out.total_num_scheduled_tokens > 0 or out.preempted_req_ids or out.finished_req_ids
        assert steps < 100_000, "no end in sight"
    return steps


@pytest.fixture(scope="module")
def reference(trace) -> dict[str, list[int]]:
    """Unbounded pool and batch: nothing is ever preempted."""
    total = sum(r.prompt_len + r.max_tokens for r in trace)
    eng = build_engine(
        num_blocks=total // BLOCK_SIZE + N + 1, block_size=BLOCK_SIZE, event_log=None, max_num_batched_tokens=1 << 20, max_num_seqs=2 * N
    )
    reqs = make_requests(trace)
    drive(eng, reqs, check=False)
    assert eng.scheduler.num_preemptions == 0
    outs = {r.request_id: list(r.output_token_ids) for r in reqs}
    # And that is what the executor's rule gives, token by token, for a few requests.
    ex = SimulatedExecutor()
    for r in reqs[:: N // 10]:
        ctx = list(r.prompt_token_ids)
        for _ in range(r.max_tokens):
            ctx.append(ex.next_token(ctx))
        assert outs[r.request_id] == ctx[r.num_prompt_tokens :]
    return outs


_prefill: dict[tuple[str, bool], int] = {}


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_soak_small_pool(trace, reference, policy, caching):
    eng = build_engine(
        num_blocks=SMALL_POOL,
        block_size=BLOCK_SIZE,
        event_log=None,
        policy=policy,
        manager_kwargs={"enable_caching": caching},
        max_num_batched_tokens=BUDGET,
        max_num_seqs=MAX_SEQS,
    )
    reqs = make_requests(trace)
    drive(eng, reqs, check=True)
    sched, mgr = eng.scheduler, eng.kv_cache_manager

    # Many preemptions happened (about 400-700 with these settings), each counted once.
    assert sched.num_preemptions >= 200
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    assert sum(1 for r in reqs if r.num_preemptions) >= 100
    # Everyone finished, with exactly max_tokens outputs (the trace has no eos) ...
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert sorted(eng.finished) == sorted(r.request_id for r in reqs)
    # ... identical to the unbounded run.
    mismatched = [r.request_id for r in reqs if r.output_token_ids != reference[r.request_id]]
    assert mismatched == []
    # Nothing leaked: every block but the null block is free, no table is left.
    assert mgr.block_pool.get_num_free_blocks() == SMALL_POOL - 1
    assert mgr.usage == 0.0
    assert sched.requests == {} and sched.running == [] and len(sched.waiting) == 0
    assert all(mgr.get_block_ids(r.request_id) == ([],) for r in reqs)
    mgr.check_invariants()

    # Random token ids share no prefix across requests, so with caching on every hit is a
    # resumed victim finding its own surviving blocks: it must recompute less.
    prefill = sum(m.prefill_tokens_computed for m in eng.metrics.values())
    assert prefill >= sum(r.num_prompt_tokens for r in reqs)
    _prefill[(policy, caching)] = prefill
    other = _prefill.get((policy, not caching))
    if other is not None:
        on, off = (prefill, other) if caching else (other, prefill)
        assert on < off
