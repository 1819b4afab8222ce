"""Soak with faults: 2,500 ShareGPT-like requests (5,000 in ``make test-full``; a third of them
behind one of eight shared system prompts) through a small pool that preempts, while faults
rain from everywhere:

* Jupyter's interrupt -- a ``KeyboardInterrupt`` -- from an event-log subscriber, at random
  events of steps, of ``add_request`` and of aborts;
* a learner's hash function, free queue, ``touch`` and victim choice that raise at random;
* an executor that raises, before or after it computed the step;
* random aborts of queued and running requests.

After every call -- kept or undone -- ``check_invariants()`` must hold and the engine must
not be left interrupted. At the end: every request finished; every one that was not
aborted has exactly the tokens an undisturbed run gives (the simulated executor's token is
a function of the context), an aborted one a prefix of them; no block is held, nothing
hangs, no request is lost. The figures are printed (``pytest -s``) for the closing note.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
import state_fingerprint
from state_fingerprint import comparable, first_difference, fingerprint

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import FreeKVCacheBlockQueue, generate_block_hash_extra_keys, get_request_block_hasher
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.request import Request, RequestStatus
from kvlab.eventlog.events import EventLog
from kvlab.utils import hashing
from kvlab.workloads.traces import sharegpt_like

pytestmark = pytest.mark.slow

# `make test` soaks 2,500 requests, `make test-full` (KVLAB_SWEEP=full) 5,000: the same faults
# at the same rates, over a run half as long.
N = 5000 if os.environ.get("KVLAB_SWEEP", "sample") == "full" else 2500
BLOCK_SIZE = 8
NUM_BLOCKS = 48
VOCAB = 500
SYSTEM_PROMPTS = [[1000 + 50 * k + j for j in range(24)] for k in range(8)]  # 3 blocks each

# Fault probabilities (per call of the faulty function / per event / per step).
P_EVENT = 0.0015
P_HASH = 0.002
P_QUEUE = 0.0015
P_TOUCH = 0.02
P_VICTIM = 0.05
P_EXEC = 0.01
P_ABORT = 0.02


class Fault(Exception):
    """A bug in someone's plugged-in code."""


class Faults:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count: dict[str, int] = {}
        self.armed = False

    def maybe(self, kind: str, p: float, exc: type[BaseException] = Fault) -> None:
        if self.armed and self.rng.random() < p:
            self.count[kind] = self.count.get(kind, 0) + 1
            raise exc(f"injected {kind}")


FAULTS = Faults(seed=5)


def learner_hash(obj: Any) -> bytes:
    FAULTS.maybe("hash function", P_HASH)
    return hashing.sha256(obj)


def learner_extra_keys(request: Any, start: int, end: int) -> Any:
    FAULTS.maybe("extra-keys function", P_HASH)
    return generate_block_hash_extra_keys(request, start, end)


class LearnerQueue(FreeKVCacheBlockQueue):
    """kvlab's queue, as a learner's subclass that sometimes raises half way."""

    def popleft_n(self, n):
        FAULTS.maybe("free queue", P_QUEUE)
        return super().popleft_n(n)

    def remove(self, block):
        FAULTS.maybe("free queue", P_QUEUE)
        super().remove(block)

    def append_n(self, blocks):
        FAULTS.maybe("free queue", P_QUEUE)
        super().append_n(blocks)


class LearnerPool(BlockPool):
    free_queue_cls = LearnerQueue

    def touch(self, blocks):
        for b in blocks:
            if b.is_null:
                continue
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            FAULTS.maybe("touch", P_TOUCH)  # half way through the hits
            b.ref_cnt += 1


class LearnerScheduler(Scheduler):
    def select_victim(self) -> Request:
        FAULTS.maybe("victim choice", P_VICTIM)
        return super().select_victim()


class FlakyExecutor:
    writes_kv_cache = False

    def __init__(self) -> None:
        self.inner = SimulatedExecutor(vocab_size=VOCAB)

    def execute_model(self, so):
        FAULTS.maybe("executor (before)", P_EXEC)
        out = self.inner.execute_model(so)
        FAULTS.maybe("executor (after)", P_EXEC, KeyboardInterrupt)
        return out


def on_event(_e: Any) -> None:
    FAULTS.maybe("interrupt at an event", P_EVENT, KeyboardInterrupt)


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    ex, ctx = SimulatedExecutor(vocab_size=VOCAB), list(prompt)
    for _ in range(n):
        ctx.append(ex.next_token(ctx))
    return ctx[len(prompt) :]


def live_fingerprint(eng: LLMEngine) -> tuple:
    """The engine's state a call can touch: everything about the live requests (the
    scheduler's full fingerprint: pool, tables, queues, counters, requests), the clock, the
    metrics of live requests and how many have finished -- O(live), not O(all requests)."""
    live = sorted(eng.scheduler.requests)
    return (
        fingerprint(eng.scheduler),
        eng.clock,
        eng._ids,
        len(eng.finished),
        list(eng.finished)[-5:],
        [(rid, repr(eng.metrics.get(rid))) for rid in live],
    )


def test_soak_with_faults_everywhere(monkeypatch):
    monkeypatch.setattr(state_fingerprint, "LOG_EVENTS", False)  # O(live state) per call, not O(log)
    trace = sharegpt_like(N, seed=3, rate=25.0, max_model_len=160, mean_input=16, mean_output=20)
    rng = random.Random(9)
    hasher = get_request_block_hasher(BLOCK_SIZE, learner_hash, extra_keys_fn=learner_extra_keys)
    log = EventLog()
    mgr = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, event_log=log, block_pool_cls=LearnerPool)
    mgr.request_block_hasher = hasher
    sched = LearnerScheduler(mgr, max_num_batched_tokens=128, max_num_seqs=24, policy="fcfs")
    eng = LLMEngine(mgr, sched, FlakyExecutor())
    log.subscribe(on_event)
    reqs = []
    for t in trace:
        prompt = (rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.35 else []) + list(t.prompt_token_ids)
        reqs.append(Request(t.request_id, prompt, max_tokens=t.max_tokens, arrival_time=t.arrival_time))
    pending = sorted(reqs, key=lambda r: r.arrival_time)

    failed: dict[str, int] = {}

    def attempt(call, what: str) -> bool:
        """Run one engine call; an injected fault must leave exactly the state before it
        (the engine's fingerprint, the log's length included) and a usable engine."""
        before = live_fingerprint(eng)
        try:
            call()
            ok = True
        except (Fault, KeyboardInterrupt):
            failed[what] = failed.get(what, 0) + 1
            after = live_fingerprint(eng)
            assert after[0][5] in (before[0][5], ())  # sent blocks: kept or forgotten (resync)
            diff = first_difference(comparable(before), comparable(after))
            assert diff is None, f"a failed {what} changed the state: {diff}"
            ok = False
        assert not eng.interrupted
        sched.check_invariants()
        return ok

    FAULTS.armed = True
    t0 = time.perf_counter()
    i = steps = aborts = 0
    while i < len(pending) or eng.has_unfinished_requests():
        if not eng.has_unfinished_requests():
            eng.clock = max(eng.clock, pending[i].arrival_time)
        while i < len(pending) and pending[i].arrival_time <= eng.clock:
            r = pending[i]
            if attempt(lambda r=r: eng.add_request(r), "add_request"):
                eng.metrics[r.request_id].arrival_time = r.arrival_time
                i += 1
        if sched.requests and rng.random() < P_ABORT:
            victim = rng.choice(sorted(sched.requests))
            if attempt(lambda v=victim: eng.abort_request(v), "abort_request"):
                aborts += 1
        if not eng.has_unfinished_requests():
            continue
        if attempt(eng.step, "step"):
            steps += 1
        if len(log) > 20_000:
            log.events.clear()  # between calls: keeps the soak's memory flat
        assert steps + sum(failed.values()) < 200_000, "no end in sight: a hang"
    FAULTS.armed = False
    took = time.perf_counter() - t0

    # Nothing lost, nothing leaked, and every answer is the one an undisturbed run gives.
    assert sorted(eng.finished) == sorted(r.request_id for r in reqs), "a lost request"
    aborted = [r for r in reqs if r.finish_reason == "abort"]
    completed = [r for r in reqs if r.finish_reason != "abort"]
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in completed)
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted) and len(aborted) == aborts
    for r in completed:
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.max_tokens), r.request_id
    for r in aborted:
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.num_output_tokens)
    assert mgr.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1 and mgr.usage == 0.0, "a leaked block"
    assert all(not t for m in mgr.coordinator.single_type_managers for t in m.req_to_blocks.values())
    assert sched.requests == {} and not sched.running and not len(sched.waiting)
    mgr.check_invariants()

    injected = sum(FAULTS.count.values())
    hits = sum(m.num_cached_tokens for m in eng.metrics.values())
    print(
        f"\n[fault soak] {N} requests ({len(completed)} completed, {len(aborted)} aborted), {steps} steps kept, "
        f"calls undone {dict(sorted(failed.items()))}, {injected} faults injected {dict(sorted(FAULTS.count.items()))}, "
        f"{sched.num_preemptions} preemptions, {hits} prefix-hit tokens, {took:.1f} s"
    )
    assert len(aborted) >= 50 and sched.num_preemptions >= 100 and hits > 0
    assert injected >= 500 and all(
        FAULTS.count.get(k, 0) >= 10
        for k in ("interrupt at an event", "hash function", "free queue", "touch", "victim choice", "executor (before)", "executor (after)")
    )
