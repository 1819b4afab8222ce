"""Checkers: preempt_victim (lesson 05a) and kv_bytes (lesson 01)."""

from __future__ import annotations

from typing import Any

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.exercises.registry import call, register, returns, same, wrong_kind
from kvlab.exercises.result import CheckResult, WrongAnswerKind, failed, passed
from kvlab.request import Request
from kvlab.eventlog.events import EventLog, RequestPreempted


def preemption_run(policy: str, pick: Any | None) -> tuple[list[str], dict[str, list[int]]]:
    """A tiny pool that forces preemptions; returns the victims in order and the outputs."""
    log = EventLog()
    mgr = KVCacheManager(num_blocks=9, block_size=4, event_log=log)

    class S(Scheduler):
        def select_victim(self) -> Request:
            if pick is None:
                return super().select_victim()
            victim = returns(
                call(pick, list(self.running), self.policy, where="choosing a victim inside the scheduler"), Request, "pick_victim"
            )
            if not any(victim is r for r in self.running):
                raise WrongAnswerKind(f"pick_victim must return one of the running requests, got {victim!r}")
            return victim

    sched = S(mgr, max_num_batched_tokens=64, policy=policy)
    eng = LLMEngine(mgr, sched, SimulatedExecutor(vocab_size=500))
    reqs = [
        Request(f"r{i}", [10 * i + j for j in range(6)], max_tokens=8, priority=p, arrival_time=float(i))
        for i, p in enumerate([1, 0, 2, 0])
    ]
    for r in reqs:
        eng.add_request(r)
    eng.run(max_steps=200)
    victims = [e.request_id for e in log.of_type(RequestPreempted)]
    return victims, {r.request_id: list(r.output_token_ids) for r in reqs}


@register(
    "preempt_victim",
    "Who gets preempted",
    "pick_victim(running, policy) -> Request",
    "05a_token_budget_and_preemption",
    [
        "`running` is in admission order: running[0] was admitted first.",
        "FCFS protects the oldest work: the victim is the most recently admitted request.",
        "policy == 'priority': the largest (priority, arrival_time) — the least important, and among equals the latest.",
    ],
    notebook="ex_scheduler",
)
def check_preempt_victim(fn: Any) -> CheckResult:
    eid = "preempt_victim"
    mk = lambda rid, p, t: Request(rid, [1, 2, 3], priority=p, arrival_time=t)  # noqa: E731
    a, b, c, d = mk("a", 0, 1.0), mk("b", 2, 2.0), mk("c", 1, 3.0), mk("d", 2, 0.5)
    cases = [
        ("fcfs", [a, b, c], c, "FCFS preempts the newest running request (the end of `running`)"),
        ("fcfs", [c, a], a, "admission order, not arrival time, decides under FCFS"),
        ("priority", [a, b, c], b, "largest priority value = least important"),
        ("priority", [a, d, b, c], b, "equal priority: the later arrival is preempted (b arrived at 2.0, d at 0.5)"),
    ]
    for policy, running, want, idea in cases:
        got = call(fn, list(running), policy, where=f"policy={policy!r}, running={[r.request_id for r in running]}")
        if got is None:
            return failed(
                eid,
                "got None — a missing return?",
                expected=want.request_id,
                idea="return the victim: one of the Request objects in `running`",
            )
        if got is not want:
            if policy == "fcfs" and got is running[0]:
                idea = "that is the OLDEST request: preempting it throws away the most finished work"
            return failed(
                eid,
                f"wrong victim under {policy}",
                inputs=f"running (admission order) = {[(r.request_id, r.priority, r.arrival_time) for r in running]} as (id, priority, arrival)",
                expected=want.request_id,
                got=getattr(got, "request_id", repr(got)),
                idea=idea,
            )
    for policy in ("fcfs", "priority"):
        want_v, want_out = preemption_run(policy, None)
        got_v, got_out = preemption_run(policy, fn)
        if got_v != want_v:
            return failed(eid, f"in the engine ({policy}): different preemptions", expected=str(want_v), got=str(got_v))
        if got_out != want_out:
            return failed(eid, "outputs changed with your victim choice; recompute must not change results")
    return passed(eid, f"FCFS takes the newest, priority the largest (priority, arrival); in the engine the victims are {want_v}.")


@register(
    "kv_bytes",
    "How big is one token's KV?",
    "kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) -> int",
    "01_why_blocks",
    [
        "Every layer stores a key AND a value vector per KV head.",
        "bytes = 2 × layers × kv heads × head_dim × bytes per element.",
    ],
    notebook="ex_scheduler",
)
def check_kv_bytes(fn: Any) -> CheckResult:
    eid = "kv_bytes"
    cases = [
        ("OPT-13B, fp16 (the PagedAttention paper: 800 KB)", (40, 40, 128, 2), 819_200),
        ("Llama-2-70B, bf16 (GQA: 8 KV heads)", (80, 8, 128, 2), 327_680),
        ("a tiny model, fp32", (4, 2, 32, 4), 2_048),
    ]
    for name, args, want in cases:
        got = call(fn, *args, where=name)
        bad = wrong_kind(eid, got, want, name, "the size in bytes")
        if bad is not None:
            return bad
        if not same(got, want):
            idea = "bytes = 2 × layers × kv heads × head_dim × dtype bytes"
            if same(got * 2, want):
                idea = "you counted only the keys (or only the values): the cache holds both, so ×2"
            return failed(
                eid,
                f"wrong size for {name}",
                inputs=f"layers, kv heads, head_dim, bytes = {args}",
                expected=f"{want:,} bytes",
                got=f"{got!r}",
                idea=idea,
            )
    return passed(eid, "OPT-13B: 800 KB per token, as in the paper; a 70B GQA model: 320 KiB, so 8,192 tokens = 2.5 GiB.")
