"""The memory simulator's paged strategy and kvlab's real Scheduler make the same decisions.

memory_sim.py models vLLM V1's scheduling in closed form (lesson 01's figures); the
Scheduler is the engine's. Where the two models agree by construction -- FCFS, no prefix
caching, a token budget and a sequence cap too large to bind, every request finishing
at its length -- the same trace must give the same admissions and the same preemptions,
step by step and in the same order. The one documented difference is bookkeeping: the
simulator stores a token's state in the step that produces it, the engine writes a
sampled token's K/V one step later, so a simulator request with prompt P is an engine
request with prompt P + 1 (see ``memory_sim.paged_decisions``).
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import KVCacheManager, Request, Scheduler
from kvlab.workloads.memory_sim import paged_decisions, simulate
from kvlab.workloads.traces import from_lengths, sharegpt_like

STEP = 1.0  # one simulator step per second of arrival time


class _RecordingScheduler(Scheduler):
    """FCFS scheduler that notes each victim as it is chosen (select_victim is the seam)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victims: list[str] = []

    def select_victim(self) -> Request:
        victim = super().select_victim()
        self.victims.append(victim.request_id)
        return victim


def scheduler_decisions(trace, capacity_tokens: int, block_size: int) -> list[tuple[int, str, str]]:
    """Replay ``trace`` through the real Scheduler, one engine step per simulator step."""
    mgr = KVCacheManager(num_blocks=capacity_tokens // block_size + 1, block_size=block_size, enable_caching=False)
    sched = _RecordingScheduler(mgr, max_num_batched_tokens=10**9, max_num_seqs=10**6, policy="fcfs")
    pending = sorted(trace, key=lambda r: math.floor(r.arrival_time / STEP + 1e-9))  # stable, as the simulator
    decisions: list[tuple[int, str, str]] = []
    i, t = 0, math.floor(pending[0].arrival_time / STEP + 1e-9)
    while i < len(pending) or sched.has_unfinished_requests():
        while i < len(pending) and math.floor(pending[i].arrival_time / STEP + 1e-9) <= t:
            tr = pending[i]
            # prompt + 1: the simulator's first output token is already stored at admission
            prompt = [(7919 * i + j) % 50_000 for j in range(len(tr.prompt_token_ids) + 1)]
            sched.add_request(Request(tr.request_id, prompt, max_tokens=tr.max_tokens, arrival_time=float(t)))
            i += 1
        if sched.has_unfinished_requests():
            sched.victims.clear()
            queue = [r.request_id for r in sched.waiting]  # FCFS: admitted in queue order
            out = sched.schedule()
            admitted = {nr.req_id for nr in out.scheduled_new_reqs}  # new and resumed
            decisions += [(t, "preempt", rid) for rid in sched.victims]
            decisions += [(t, "admit", rid) for rid in queue if rid in admitted]
            sched.update_from_output(out, {rid: [1] for rid in out.num_scheduled_tokens})
            sched.check_invariants()
        t += 1
    return decisions


def test_a_sharegpt_like_trace_with_many_preemptions():
    trace = sharegpt_like(120, seed=3, rate=6.0, max_model_len=256, mean_input=16, mean_output=24)
    capacity, bs = 40 * 8, 8
    want = paged_decisions(trace, capacity, block_size=bs, max_model_len=256, step_seconds=STEP)
    got = scheduler_decisions(trace, capacity, bs)
    preemptions = sum(1 for _, kind, _ in want if kind == "preempt")
    assert preemptions >= 20, "the trace must exercise preemption"
    assert preemptions == simulate(trace, capacity, "paged", block_size=bs, max_model_len=256, step_seconds=STEP).num_preemptions
    assert got == want


@settings(max_examples=60)
@given(
    specs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(0, 12)), min_size=1, max_size=12),
    bs=st.sampled_from([1, 2, 4, 8]),
    extra_blocks=st.integers(0, 6),
)
def test_random_traces_agree_step_by_step(specs, bs, extra_blocks):
    trace = from_lengths([(p, o, float(a)) for p, o, a in specs])
    longest = max(-(-(p + o) // bs) for p, o, _ in specs)  # the simulator's "fits alone" rule
    capacity = (longest + extra_blocks) * bs
    want = paged_decisions(trace, capacity, block_size=bs, max_model_len=64, step_seconds=STEP)
    assert scheduler_decisions(trace, capacity, bs) == want
