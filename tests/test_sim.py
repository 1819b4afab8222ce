"""Tests for kvlab.workloads.memory_sim: hand-computed memory splits, an independent reference, invariants."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvlab.workloads import memory_sim as S
from kvlab.workloads.memory_sim import (
    CONTIGUOUS_STRATEGIES,
    STRATEGIES,
    SimResult,
    compare,
    format_table,
    reservation_size,
    simulate,
)
from kvlab.workloads.traces import Trace, alpaca_like, from_lengths, sharegpt_like

SHARES = ("token_states_pct", "reservation_pct", "internal_pct", "external_pct", "free_pct")


def run(specs, capacity, strategy, **kw) -> SimResult:
    """Simulate a hand-made trace; one step per second, so arrival times are step numbers."""
    kw.setdefault("step_seconds", 1.0)
    return simulate(from_lengths(specs), capacity, strategy, **kw)


def shares(r: SimResult) -> tuple[float, ...]:
    return tuple(getattr(r, f) for f in SHARES)


def pct(slot_steps: float, steps: int, capacity: int) -> float:
    return 100 * slot_steps / (steps * capacity)


# ------------------------------------------------------------------ hand-computed cases
#
# Notation: A(P, O) is a request with P prompt tokens and O output tokens. After its k-th
# step it holds P + k token states; it finishes (and frees memory) in its O-th step.


def test_oracle_two_requests_in_ten_slots() -> None:
    # A(2,3) and B(3,2) each reserve exactly 5: slots [0,5) and [5,10). C(1,1) waits.
    # step 0: A holds 3, B 4 -> tokens 7, reserved for later (5-3)+(5-4) = 3
    # step 1: A 4, B 5 (B done)  -> tokens 9, reservation 1
    # step 2: C fits in B's slots, nobody waits -> not a saturated step
    r = run([(2, 3), (3, 2), (1, 1)], 10, "oracle")
    assert (r.saturated_steps, r.busy_steps, r.total_steps) == (2, 3, 3)
    assert r.measured_on == "saturated"
    assert shares(r) == pytest.approx((80.0, 20.0, 0.0, 0.0, 0.0))
    assert (r.avg_running, r.peak_running, r.num_preemptions) == (2.0, 2, 0)


def test_max_reserves_the_model_length() -> None:
    # max_model_len 6, capacity 13: A [0,6), B [6,12), 1 slot left; C needs 6 -> waits.
    # Per saturated step: internal (6-5) * 2 = 2, external 1 (the lone free slot).
    # step 0: tokens 3+4 = 7, reservation 2+1 = 3; step 1: tokens 9, reservation 1.
    r = run([(2, 3), (3, 2), (1, 1)], 13, "max", max_model_len=6)
    assert r.saturated_steps == 2
    assert r.token_states_pct == pytest.approx(pct(16, 2, 13))
    assert r.reservation_pct == pytest.approx(pct(4, 2, 13))
    assert r.internal_pct == pytest.approx(pct(4, 2, 13))
    assert r.external_pct == pytest.approx(pct(2, 2, 13))
    assert r.free_pct == 0.0


def test_pow2_over_reservation_and_head_of_line_blocking() -> None:
    # A(2,3) and B(3,2) both reserve pow2(5) = 8 of 10 slots: B waits, and C(1,1) - which
    # would fit in the 2 free slots - waits behind it (FCFS head-of-line blocking).
    # steps 0-2: A holds 3, 4, 5; reservation 2, 1, 0; internal 8-5 = 3; external 2.
    # step 3: B takes [0,8), C takes [8,10): nobody waits any more.
    r = run([(2, 3), (3, 2), (1, 1)], 10, "pow2", max_model_len=8)
    assert (r.saturated_steps, r.busy_steps, r.total_steps, r.peak_running) == (3, 5, 5, 2)
    assert shares(r) == pytest.approx((40.0, 10.0, 30.0, 20.0, 0.0))
    assert r.avg_running == 1.0


def test_first_fit_leaves_a_gap_nobody_can_use() -> None:
    # Oracle, 10 slots: A(2,1)->[0,3), B(1,3)->[3,7), C(2,1)->[7,10); D(4,1) needs 5.
    # After step 0, A and C leave two 3-slot holes: 6 slots free, but no gap of 5, so D
    # waits until B finishes (step 2) - real external fragmentation, 60 % of memory.
    # step 0: tokens 3+2+3 = 8, reservation (B) 2, external 0
    # step 1: tokens 3, reservation 1, external 6; step 2: tokens 4, reservation 0, external 6
    r = run([(2, 1), (1, 3), (2, 1), (4, 1)], 10, "oracle", max_model_len=8)
    assert r.saturated_steps == 3
    assert shares(r) == pytest.approx((50.0, 10.0, 0.0, 40.0, 0.0))


def test_first_fit_allocator_offsets() -> None:
    ff = S._FirstFit(10)
    assert [ff.place(3), ff.place(4), ff.place(3)] == [0, 3, 7]
    ff.release(0)
    ff.release(7)
    assert ff.place(5) is None  # 6 free slots, largest gap 3
    assert ff.place(3) == 0  # first fit: lowest gap that fits
    ff.release(3)
    assert ff.place(5) == 3  # freed [3,7) merges with the tail gap [7,10)


def test_paged_waste_is_the_empty_tail_of_the_last_block() -> None:
    # Block size 4, 16 slots = 4 blocks. A(5,2) holds 6 tokens in 2 blocks (2 empty slots);
    # B(9,1) needs ceil(10/4) = 3 blocks > 2 free, so it waits.
    # step 0: tokens 6, internal 2, free 8; step 1: tokens 7, internal 1, free 8.
    r = run([(5, 2), (9, 1)], 16, "paged", block_size=4, max_model_len=16)
    assert r.saturated_steps == 2
    assert shares(r) == pytest.approx((pct(13, 2, 16), 0.0, pct(3, 2, 16), 0.0, 50.0))


def test_paged_slots_that_make_no_whole_block_are_external() -> None:
    # 18 slots with block size 4: 4 blocks + 2 stranded slots (external in every step).
    r = run([(5, 2), (9, 1)], 18, "paged", block_size=4, max_model_len=16)
    assert r.external_pct == pytest.approx(100 * 2 / 18)
    assert r.token_states_pct == pytest.approx(pct(13, 2, 18))


def test_paged_preempts_the_newest_and_recomputes() -> None:
    # Block size 2, 8 slots = 4 blocks. A(3,4), B(3,4) take 2 blocks each (4 tokens).
    # step 1: A's last block is full, none free -> B (newest) is preempted; it had made 1
    #         output, so readmission needs ceil((3+1+1)/2) = 3 blocks. A: 5 tokens, 3 blocks.
    # step 2: A 6 tokens, 3 blocks, free 1 block; B still does not fit.
    # step 3: A takes the last block, 7 tokens, finishes. step 4: B readmitted; done step 6.
    r = run([(3, 4), (3, 4)], 8, "paged", block_size=2, max_model_len=8)
    assert r.num_preemptions == 1
    assert (r.saturated_steps, r.total_steps, r.peak_running) == (3, 7, 2)
    assert r.token_states_pct == pytest.approx(pct(5 + 6 + 7, 3, 8))
    assert r.internal_pct == pytest.approx(pct(1 + 0 + 1, 3, 8))
    assert r.free_pct == pytest.approx(pct(2 + 2 + 0, 3, 8))


def test_preempted_request_goes_back_to_the_head_of_the_queue() -> None:
    # As above plus C(1,1), waiting from step 0. When B is preempted in step 1 it goes in
    # front of C; B needs 3 blocks and only 1 is free, so C (which would fit) waits behind
    # it until A finishes. Both are admitted in step 4.
    # saturated steps 0-3: tokens 8, 5, 6, 7; internal 0, 1, 0, 1; free 0, 2, 2, 0.
    r = run([(3, 4), (3, 4), (1, 1)], 8, "paged", block_size=2, max_model_len=8)
    assert (r.num_preemptions, r.saturated_steps, r.total_steps, r.peak_running) == (1, 4, 7, 2)
    assert shares(r) == pytest.approx((pct(26, 4, 8), 0.0, pct(2, 4, 8), 0.0, pct(4, 4, 8)))
    assert r.avg_running == 1.25


def test_never_saturated_trace_is_measured_on_busy_steps() -> None:
    r = run([(2, 2), (2, 2, 5)], 100, "oracle")
    assert (r.measured_on, r.saturated_steps, r.busy_steps, r.total_steps) == ("busy", 0, 4, 7)
    # steps 0,1 and 5,6: tokens 3, 4, 3, 4 of 100; free the rest.
    assert shares(r) == pytest.approx((3.5, 0.5, 0.0, 0.0, 96.0))


def test_arrival_times_become_steps() -> None:
    trace = from_lengths([(1, 1, 0.0), (1, 1, 0.3)])
    r = simulate(trace, 10, "oracle", step_seconds=0.1, max_model_len=4)
    assert r.total_steps == 4  # second request runs in step 3 (0.3 s / 0.1 s), not 2


def test_reservation_sizes() -> None:
    assert reservation_size("max", 5, 2048) == 2048
    assert [reservation_size("pow2", n, 2048) for n in (1, 5, 8, 9, 1500)] == [1, 8, 8, 16, 2048]
    assert reservation_size("pow2", 1500, 1800) == 1800  # capped at the model length
    assert reservation_size("oracle", 77, 2048) == 77


# ------------------------------------------------------------------ comparison and table


def test_compare_rows_and_table() -> None:
    trace = sharegpt_like(60, 1, rate=None)
    rows = compare(trace, 4096, block_sizes=(8, 16))
    assert [r.label for r in rows] == ["max", "pow2", "oracle", "paged(8)", "paged(16)"]
    table = format_table(rows)
    assert table.splitlines()[0].startswith("strategy")
    assert all(r.label in table for r in rows)
    assert rows[0].as_dict()["label"] == "max"
    assert rows[4].waste_pct == pytest.approx(rows[4].internal_pct)


def test_paper_shape_on_sharegpt() -> None:
    # The Fig. 2 story at a smaller scale: Max wastes most memory, paged almost none,
    # and paged runs several times more requests at once in the same memory.
    trace = sharegpt_like(300, 0, rate=10.0)
    rows = {r.label: r for r in compare(trace, 15_616, block_sizes=(16,))}
    assert rows["max"].token_states_pct < rows["pow2"].token_states_pct < rows["oracle"].token_states_pct
    assert rows["max"].token_states_pct <= 40
    assert rows["paged(16)"].token_states_pct >= 94
    assert rows["max"].avg_running == 7.0  # 15,616 // 2,048
    assert rows["paged(16)"].avg_running / rows["max"].avg_running >= 2.5


def test_fast_path_runs_a_thousand_requests() -> None:
    # 1,000 ShareGPT-like requests through the closed-form stepping (its speed is measured by
    # `python -m kvlab.bench`, not here: a shared test machine makes timings noise).
    rows = {r.label: r for r in compare(sharegpt_like(1000, 0, rate=10.0), 15_616, block_sizes=(16, 64))}
    assert list(rows) == ["max", "pow2", "oracle", "paged(16)", "paged(64)"]
    assert {k: round(r.token_states_pct, 2) for k, r in rows.items()} == {
        "max": 21.24,
        "pow2": 37.92,
        "oracle": 50.41,
        "paged(16)": 97.28,
        "paged(64)": 92.81,
    }
    assert rows["max"].avg_running == 7.0 and round(rows["paged(16)"].avg_running, 2) == 32.06


def test_bench_memory_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.bench import memory

    memory.main(["--n", "150", "--seed", "1"])
    out = capsys.readouterr().out
    for needle in ("Orca (Max)", "paged, block 16", "20.4", "96.3", "paged(16) / Max", "Full breakdown"):
        assert needle in out


# ------------------------------------------------------------------ bad input

TINY = from_lengths([(3, 2)])
BAD = [
    (lambda: simulate(TINY, 0, "oracle"), ValueError, "capacity_tokens=0"),
    (lambda: simulate(TINY, 100, "lru"), ValueError, "strategy='lru'"),
    (lambda: simulate(TINY, 100, "paged", block_size=3), ValueError, "block_size=3"),
    (lambda: simulate(TINY, 100, "paged", block_size=0), ValueError, "block_size=0"),
    (lambda: simulate(TINY, 100, "paged", block_size=-4), ValueError, "block_size=-4"),
    (lambda: simulate(TINY, 100, "paged", block_size=16.0), TypeError, "block_size"),
    (lambda: simulate(TINY, 1000, "max"), ValueError, "capacity_tokens=1000 is smaller than one request"),
    (lambda: simulate(TINY, 4, "oracle"), ValueError, "capacity_tokens=4 is smaller than one request"),
    (lambda: simulate(TINY, 7, "pow2"), ValueError, "capacity_tokens=7"),
    (lambda: simulate(TINY, 8, "paged", block_size=16), ValueError, "capacity_tokens=8"),
    (lambda: simulate(TINY, 100, "oracle", max_model_len=4), ValueError, "max_model_len=4"),
    (lambda: simulate(TINY, 100, "oracle", step_seconds=0), ValueError, "step_seconds"),
    (lambda: simulate([], 100, "oracle"), ValueError, "trace is empty"),
    (lambda: compare(TINY, 100, strategies=("max", "best")), ValueError, "strategy='best'"),
    (lambda: compare(TINY, 100, block_sizes=(16, 12)), ValueError, "block_size=12"),
    (lambda: compare(TINY, 100, block_sizes=()), ValueError, "block_sizes"),
    (lambda: reservation_size("paged", 5, 10), ValueError, "strategy='paged'"),
]


@pytest.mark.parametrize("call,exc,needle", BAD, ids=[b[2] for b in BAD])
def test_bad_input_names_the_argument(call, exc, needle) -> None:
    with pytest.raises(exc, match=needle.replace("(", r"\(")):
        call()


# ------------------------------------------------------------------ independent reference


def reference(trace: Trace, capacity: int, strategy: str, bs: int, max_model_len: int) -> dict[str, float]:
    """The rules of kvlab.workloads.memory_sim's docstring, written the slow obvious way: a slot array for
    contiguous memory, a free-block counter and per-request block lists for paged, one
    loop iteration per step, every quantity counted directly. Arrival times are steps."""
    paged = strategy == "paged"
    owner: list[object] = [None] * capacity
    free_blocks = capacity // bs
    pending = deque(sorted((int(r.arrival_time), i, r) for i, r in enumerate(trace)))
    waiting: deque[dict] = deque()
    running: list[dict] = []
    sums = {"sat": [0] * 7, "busy": [0] * 7}
    peak = preemptions = last = 0
    t = pending[0][0]
    while pending or waiting or running:
        if not running and not waiting and pending[0][0] > t:
            t = pending[0][0]
        while pending and pending[0][0] <= t:
            r = pending.popleft()[2]
            waiting.append({"p": r.prompt_len, "o": r.max_tokens, "gen": 0, "stored": 0, "blocks": 0})
        preempted = False
        if paged:
            k = 0
            while k < len(running):
                j = running[k]
                if j["stored"] == j["blocks"] * bs:
                    while free_blocks == 0:
                        v = running.pop()
                        free_blocks += v["blocks"]
                        v["gen"], v["stored"], v["blocks"] = v["stored"] - v["p"], 0, 0
                        waiting.appendleft(v)
                        preemptions += 1
                        preempted = True
                        if v is j:
                            break
                    if not any(x is j for x in running):
                        break
                    j["blocks"] += 1
                    free_blocks -= 1
                j["stored"] += 1
                k += 1
        else:
            for j in running:
                j["stored"] += 1
        while waiting and not preempted:
            j = waiting[0]
            base = j["p"] + j["gen"]
            if paged:
                need = -(-(base + 1) // bs)
                if need > free_blocks:
                    break
                free_blocks -= need
                j["blocks"] = need
            else:
                size = reservation_size(strategy, j["p"] + j["o"], max_model_len)
                start = next((s for s in range(capacity - size + 1) if all(x is None for x in owner[s : s + size])), None)
                if start is None:
                    break
                owner[start : start + size] = [j] * size
                j["size"] = size
            waiting.popleft()
            j["stored"] = base + 1
            running.append(j)
        n = len(running)
        tokens = sum(j["stored"] for j in running)
        if paged:
            held = sum(j["blocks"] for j in running) * bs
            row = [tokens, 0, held - tokens, capacity - (capacity // bs) * bs, free_blocks * bs]
        else:
            unused = owner.count(None)
            row = [
                tokens,
                sum(j["p"] + j["o"] - j["stored"] for j in running),
                sum(j["size"] - j["p"] - j["o"] for j in running),
                unused if waiting else 0,
                0 if waiting else unused,
            ]
        assert sum(row) == capacity
        if n:
            for key in ["busy", "sat"] if waiting else ["busy"]:
                sums[key] = [a + b for a, b in zip(sums[key], row + [n, 1])]
        peak = max(peak, n)
        for j in [j for j in running if j["stored"] == j["p"] + j["o"]]:
            running.remove(j)
            last = t
            if paged:
                free_blocks += j["blocks"]
            else:
                owner = [None if x is j else x for x in owner]
        t += 1
    acc = sums["sat"] if sums["sat"][6] else sums["busy"]
    out = {f: 100 * acc[i] / (acc[6] * capacity) for i, f in enumerate(SHARES)}
    out.update(
        avg_running=acc[5] / acc[6],
        measured_steps=acc[6],
        saturated_steps=sums["sat"][6],
        busy_steps=sums["busy"][6],
        peak_running=peak,
        num_preemptions=preemptions,
        total_steps=last - trace[0].arrival_time + 1,
    )
    return out


tiny_traces = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=8)


@settings(max_examples=120, deadline=None)
@given(specs=tiny_traces, capacity=st.integers(24, 60), bs=st.sampled_from([1, 2, 4, 8]), strategy=st.sampled_from(STRATEGIES))
def test_simulator_matches_the_slow_reference(specs, capacity, bs, strategy) -> None:
    trace = from_lengths([(p, o, float(a)) for p, o, a in specs])
    want = reference(trace, capacity, strategy, bs, 24)
    for fast in (True, False):
        got = simulate(trace, capacity, strategy, block_size=bs, max_model_len=24, step_seconds=1.0, fast=fast)
        for key, value in want.items():
            assert getattr(got, key) == pytest.approx(value, abs=1e-9), (key, fast)


@settings(max_examples=120, deadline=None)
@given(specs=tiny_traces, capacity=st.integers(32, 80), bs=st.sampled_from([1, 2, 4, 8, 16]))
def test_shares_sum_to_100_and_none_is_negative(specs, capacity, bs) -> None:
    trace = from_lengths([(p, o, float(a)) for p, o, a in specs])
    for r in compare(trace, capacity, block_sizes=(bs,), max_model_len=24, step_seconds=1.0):
        assert sum(shares(r)) == pytest.approx(100.0)
        assert all(x >= 0 for x in shares(r))
        assert 1 <= r.avg_running <= r.peak_running <= len(trace)
        assert r.measured_steps == (r.saturated_steps or r.busy_steps) and r.measured_steps <= r.total_steps
        if r.strategy == "paged":
            assert r.reservation_pct == 0.0 and r.external_pct == pytest.approx(100 * (capacity % bs) / capacity)
        else:
            assert r.num_preemptions == 0 and (r.free_pct == 0.0 or r.measured_on == "busy")
        if r.strategy == "oracle":
            assert r.internal_pct == 0.0


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(20, 60),
    capacity=st.sampled_from([2048, 3072, 4096]),
    bs=st.sampled_from([1, 2, 4, 8, 16]),
    shape=st.sampled_from(["sharegpt", "alpaca"]),
    rate=st.sampled_from([None, 50.0]),
)
def test_paged_holds_more_token_states_than_any_reservation(seed, n, capacity, bs, shape, rate) -> None:
    # The claim of Fig. 2, for realistic traces whenever memory is the bottleneck (the paged
    # run has a backlog). Not a theorem for arbitrary tiny traces: the averages run over
    # different steps, and e.g. [(6,17,12), (17,13,0), (17,11,0), (24,5,9)] in 77 slots gives
    # paged(1) 71.4 % vs Oracle 71.9 %. Realistic traces clear it by tens of points.
    make = sharegpt_like if shape == "sharegpt" else alpaca_like
    trace = make(n, seed, rate=rate)
    paged = simulate(trace, capacity, "paged", block_size=bs)
    assume(paged.measured_on == "saturated")
    for strategy in CONTIGUOUS_STRATEGIES:
        assert paged.token_states_pct >= simulate(trace, capacity, strategy).token_states_pct


def test_documented_counterexample_for_tiny_traces() -> None:
    specs = [(6, 17, 12), (17, 13, 0), (17, 11, 0), (24, 5, 9)]
    paged = run(specs, 77, "paged", block_size=1, max_model_len=64)
    oracle = run(specs, 77, "oracle", max_model_len=64)
    assert paged.measured_on == oracle.measured_on == "saturated"
    assert paged.token_states_pct < oracle.token_states_pct


def test_module_has_no_torch() -> None:
    src = open(S.__file__, encoding="utf-8").read()
    assert "import torch" not in src and "import numpy" not in src
