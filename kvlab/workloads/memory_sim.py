"""Where does KV memory go? A simulator for Fig. 2 of the PagedAttention paper.

Before vLLM, serving systems such as Orca gave every request one *contiguous* stretch of
KV memory, sized when the request was admitted - because the attention kernels of the day
wanted each sequence's keys and values side by side. The paper (Kwon et al., SOSP 2023,
Fig. 2) measured what that costs: with OPT-13B only 20-38 % of the KV memory held token
states; vLLM's paged cache held 96.3 %. This module replays a :mod:`kvlab.workloads` trace
through both designs and splits the memory the same way, so a learner can watch the gap
open and then vary block size, capacity and workload.

Strategies
----------
Contiguous (one address space of ``capacity_tokens`` slots, first-fit placement, so free
space really does break into gaps that no waiting request fits - external fragmentation):

* ``"max"``    - Orca(Max): reserve ``max_model_len`` slots for every request.
* ``"pow2"``   - Orca(Pow2): reserve the smallest power of two >= prompt + output
  (capped at ``max_model_len``), i.e. up to 2x what the request will use.
* ``"oracle"`` - Orca(Oracle): reserve exactly prompt + output; it knows the future.

Paged (``"paged"``, with ``block_size`` a power of two): ``capacity_tokens // block_size``
blocks in a pool; a request takes the blocks for its prompt (plus its first output token)
when admitted and one more block each time its last block is full. Nothing is reserved,
only the last block of a request can have empty slots, and any free block serves anyone.
When a running request needs a block and none is free, the most recently admitted request
is preempted (vLLM V1's recompute policy): its blocks are freed, it goes to the head of the
queue, and when readmitted it recomputes its prompt plus the tokens it had generated.

The clock
---------
Time advances in engine steps of ``step_seconds`` (default 0.04 s, our assumption for one
decode iteration of a 13B model - it only converts arrival times to steps). In each step:

1. Requests that have arrived join the tail of the waiting queue (FCFS).
2. Paged only: every running request, oldest first, gets a slot for its next token,
   taking a new block if its last one is full and preempting as described above.
3. Admission, head first, while the head fits (contiguous: a free gap of its reservation
   size; paged: enough free blocks). A head that does not fit blocks everyone behind it
   (head-of-line blocking, as in FCFS). No admission in a step that preempted (vLLM V1).
4. Compute: a newly admitted request processes its whole prompt and produces its first
   output token; a running one produces one more. We count a token's state as stored in
   the step that produces it, so a request with prompt P and output O holds P + k token
   states after its k-th step and P + O when it finishes, in its O-th step.
5. **Measurement** (below), then finished requests free their memory.

The split of memory (each step, as a share of ``capacity_tokens``)
------------------------------------------------------------------
For every running request with P prompt tokens, true output O, k steps done:

* **token states** - slots holding a computed token: P + k.
* **reservation** - slots held now for tokens the request will certainly produce later:
  contiguous P + O - (P + k) = O - k. Paged: 0 (nothing is held ahead of need).
* **internal fragmentation** - slots held by a request that no token will ever fill:
  contiguous reservation - (P + O) (Max and Pow2 over-reservation; 0 for Oracle). Paged:
  the empty slots of the request's last block, block_size * blocks - (P + k). (Part of that
  tail would be filled if the request lived on; counting all of it as waste is the
  conservative choice, at most block_size - 1 slots per request.)
* **external fragmentation** - free slots that cannot be used. Contiguous: in a step where
  the waiting head does not fit in any gap, *every* free slot, because none can hold the
  request that must go next (this includes a remainder smaller than one reservation, such
  as the leftover below the next 2,048-slot block under Max). Paged: free blocks are
  always usable, so only the ``capacity_tokens % block_size`` slots that make no whole
  block - 0 when the capacity is a multiple of the block size, as in the bench.
* **free** - the remaining unheld slots (contiguous: nobody waiting; paged: free blocks).

The five shares add up to 100 % in every step. The reported shares are averages over the
*saturated* steps: steps that end admission with a non-empty waiting queue, so that memory,
not the arrival rate, limits the batch. That is the regime of the paper's figure: under
load, the share of memory holding token states is the share doing useful work. (A trace
that never saturates is averaged over its busy steps instead; ``measured_on`` says which.)

Mapping to the paper's Fig. 2: "token states", "reservation", "internal fragmentation" and
"external fragmentation" are the four bars of Orca(Max), Orca(Pow2) and Orca(Oracle) of the
same names; the paper's vLLM bar corresponds to our paged(16) token-state share. Our free
share (0 for the contiguous strategies when saturated, under one request's worth of
blocks for paged) has no bar in the paper. We simulate memory only - no kernel speed, no
swapping, no prefix sharing - so the numbers match the paper in kind and rough size, not
to the digit; ``python -m kvlab.bench memory`` prints both side by side.

Speed: between steps where something happens (an arrival to an empty queue, a finish, a
preemption, a paged block shortage) the state changes in a way that is linear in the
step count, so those stretches are summed in closed form. A 1,000-request ShareGPT-like
trace through every strategy and eight block sizes takes a second or two.
``fast=False`` walks every step instead; the tests check that both agree exactly.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from kvlab.utils.checks import check_int, check_number
from kvlab.workloads.traces import DEFAULT_MAX_MODEL_LEN, TraceRequest
from kvlab.utils.math_utils import cdiv, round_up

__all__ = [
    "CONTIGUOUS_STRATEGIES",
    "DEFAULT_STEP_SECONDS",
    "STRATEGIES",
    "SimResult",
    "compare",
    "format_table",
    "paged_decisions",
    "reservation_size",
    "simulate",
]

STRATEGIES = ("max", "pow2", "oracle", "paged")
CONTIGUOUS_STRATEGIES = ("max", "pow2", "oracle")
DEFAULT_STEP_SECONDS = 0.04


@dataclass(slots=True)
class SimResult:
    """One strategy's memory split on one trace: a row of the comparison table.

    The ``*_pct`` fields are percentages of ``capacity_tokens`` averaged over the measured
    steps and add up to 100. ``avg_running`` is the mean number of requests running in
    those steps - the batch size memory allows; ``peak_running`` is the maximum over the
    whole run.
    """

    strategy: str
    block_size: int | None  # None for the contiguous strategies
    capacity_tokens: int
    token_states_pct: float
    reservation_pct: float
    internal_pct: float
    external_pct: float
    free_pct: float
    avg_running: float
    peak_running: int
    measured_on: str  # "saturated" (a backlog existed) or "busy" (never saturated)
    measured_steps: int
    saturated_steps: int
    busy_steps: int  # steps with at least one running request
    total_steps: int  # first arrival to last finish
    num_requests: int
    num_preemptions: int

    @property
    def label(self) -> str:
        """``"max"``, ``"pow2"``, ``"oracle"`` or ``"paged(16)"``."""
        return self.strategy if self.block_size is None else f"{self.strategy}({self.block_size})"

    @property
    def waste_pct(self) -> float:
        """Reservation + internal + external: held or stranded, but holding no token."""
        return self.reservation_pct + self.internal_pct + self.external_pct

    def as_dict(self) -> dict[str, object]:
        """A plain dict (with ``label``), e.g. for ``pandas.DataFrame(rows)``."""
        d = asdict(self)
        d["label"] = self.label
        return d


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def reservation_size(strategy: str, total_len: int, max_model_len: int) -> int:
    """Slots a contiguous strategy reserves for a request that will reach ``total_len``
    tokens (prompt + output): Max ``max_model_len``, Pow2 the next power of two (capped at
    ``max_model_len``), Oracle ``total_len`` itself."""
    if strategy == "max":
        return max_model_len
    if strategy == "pow2":
        return min(_next_pow2(total_len), max_model_len)
    if strategy == "oracle":
        return total_len
    raise ValueError(f"strategy={strategy!r} has no reservation; choose one of {', '.join(CONTIGUOUS_STRATEGIES)}")


def _check_strategy(strategy: object) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown; choose one of {', '.join(map(repr, STRATEGIES))}")
    return strategy


def _check_block_size(block_size: object) -> int:
    block_size = check_int("block_size", block_size)
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} is not allowed; it must be a power of two >= 1, such as 1, 2, 4, ..., 256")
    return block_size


@dataclass(slots=True, eq=False)
class _Job:
    """A request inside the simulator (compared by identity).

    While running, the job holds ``key + t`` token states just before step ``t``, where
    ``key`` = prompt + generated - admission step (it computes prompt + generated tokens and
    produces one more in its admission step, then one per step). Keeping that one number per
    job lets the sums below be written as "sum of keys + n * t". ``generated`` counts the
    outputs produced before the current admission (non-zero only after a preemption, whose
    readmission recomputes them)."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival_step: int
    reserve: int  # contiguous reservation in slots (0 for paged)
    generated: int = 0
    key: int = 0
    finish: int = -1  # step in which it produces its last token
    offset: int = -1  # contiguous placement
    running: bool = False


class _FirstFit:
    """One contiguous address space; ``place`` returns the lowest start of a gap that
    fits, like a first-fit ``malloc``. Holes left by finished requests stay where they are
    - there is no compaction, because moving a request's KV is what these systems avoid."""

    __slots__ = ("capacity", "segments")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.segments: list[tuple[int, int]] = []  # (start, size), sorted by start

    def place(self, size: int) -> int | None:
        end = 0
        for i, (start, seg_size) in enumerate(self.segments):
            if start - end >= size:
                self.segments.insert(i, (end, size))
                return end
            end = start + seg_size
        if self.capacity - end >= size:
            self.segments.append((end, size))
            return end
        return None

    def release(self, start: int) -> None:
        for i, seg in enumerate(self.segments):
            if seg[0] == start:
                del self.segments[i]
                return
        raise AssertionError(f"no segment starts at {start}")


class _Acc:
    """Slot-step sums for one measurement window (ints, so shares are exact)."""

    __slots__ = ("steps", "tokens", "reservation", "internal", "external", "free", "running")

    def __init__(self) -> None:
        self.steps = self.tokens = self.reservation = self.internal = 0
        self.external = self.free = self.running = 0

    def add(self, steps: int, tokens: int, reservation: int, internal: int, external: int, free: int, running: int) -> None:
        self.steps += steps
        self.tokens += tokens
        self.reservation += reservation
        self.internal += internal
        self.external += external
        self.free += free
        self.running += running


# --------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------


class _Sim:
    def __init__(self, jobs: list[_Job], capacity: int, strategy: str, block_size: int) -> None:
        self.jobs = jobs
        self.capacity = capacity
        self.paged = strategy == "paged"
        self.bs = block_size
        self.total_blocks = capacity // block_size if self.paged else 0
        self.dead_slots = capacity - self.total_blocks * block_size if self.paged else 0
        self.held = 0  # paged: blocks held by running jobs, between steps
        self.alloc = _FirstFit(capacity)
        self.reserved_sum = 0  # contiguous: sum of running reservations
        self.final_sum = 0  # contiguous: sum of running prompt + output
        self.key_sum = 0  # sum of running jobs' keys
        self.next_job = 0
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.sat = _Acc()
        self.busy = _Acc()
        self.peak = 0
        self.preemptions = 0
        self.last_step = 0
        # (step, "admit" | "preempt", request_id), in the order the decisions are made
        self.decisions: list[tuple[int, str, str]] = []

    # -- one full step, exactly as described in the module docstring ------------------
    def step(self, t: int) -> bool:
        """Run step ``t``. Returns True when memory was freed (a preemption or a finish):
        then step ``t + 1`` may admit someone and must be a full step too."""
        jobs, waiting, running, bs = self.jobs, self.waiting, self.running, self.bs
        while self.next_job < len(jobs) and jobs[self.next_job].arrival_step <= t:
            waiting.append(jobs[self.next_job])
            self.next_job += 1

        preempted = False
        free = self.total_blocks - self.held
        if self.paged and running:
            # A job whose token count is a multiple of bs has a full last block.
            wanting = sum(1 for j in running if (j.key + t) % bs == 0)
            if wanting <= free:
                free -= wanting
            else:
                free, preempted = self._grow_with_preemption(t, free)

        if not preempted:  # vLLM V1 admits nobody in a step that preempted
            while waiting:
                job = waiting[0]
                base = job.prompt_len + job.generated
                if self.paged:
                    need = cdiv(base + 1, bs)
                    if need > free:
                        break
                    free -= need
                else:
                    offset = self.alloc.place(job.reserve)
                    if offset is None:
                        break
                    job.offset = offset
                    self.reserved_sum += job.reserve
                    self.final_sum += job.prompt_len + job.output_len
                waiting.popleft()
                job.key = base - t
                job.finish = t + job.output_len - job.generated - 1
                job.running = True
                self.key_sum += job.key
                running.append(job)
                self.decisions.append((t, "admit", job.request_id))

        n = len(running)
        tokens = self.key_sum + n * (t + 1)
        if self.paged:
            self.held = self.total_blocks - free
            held_slots = self.held * bs
            self._measure(1, tokens, 0, held_slots - tokens, self.dead_slots, free * bs, n)
        else:
            unreserved = self.capacity - self.reserved_sum
            saturated = bool(waiting)
            self._measure(
                1,
                tokens,
                self.final_sum - tokens,
                self.reserved_sum - self.final_sum,
                unreserved if saturated else 0,
                0 if saturated else unreserved,
                n,
            )
        self.peak = max(self.peak, n)

        done = [j for j in running if j.finish == t]
        for job in done:
            running.remove(job)
            self._release(job, t + 1)
        if done:
            self.last_step = t
        return preempted or bool(done)

    def _grow_with_preemption(self, t: int, free: int) -> tuple[int, bool]:
        """Growth when blocks run short: oldest first; when none is free, preempt the
        newest running job (possibly the one asking), as vLLM V1's scheduler does."""
        running, bs = self.running, self.bs
        preempted = False
        i = 0
        while i < len(running):
            job = running[i]
            if (job.key + t) % bs == 0:
                while free < 1:
                    victim = running.pop()
                    free += self._release(victim, t)
                    victim.generated = victim.key + t - victim.prompt_len
                    self.waiting.appendleft(victim)
                    self.preemptions += 1
                    self.decisions.append((t, "preempt", victim.request_id))
                    preempted = True
                    if victim is job:
                        break
                if not job.running:  # it preempted itself: it was the newest
                    break
                free -= 1
            i += 1
        return free, preempted

    def _release(self, job: _Job, t: int) -> int:
        """Take ``job`` (holding key + t tokens) out of the sums; returns its blocks."""
        job.running = False
        self.key_sum -= job.key
        if self.paged:
            blocks = cdiv(job.key + t, self.bs)
            self.held -= blocks
            return blocks
        self.alloc.release(job.offset)
        self.reserved_sum -= job.reserve
        self.final_sum -= job.prompt_len + job.output_len
        return 0

    def _measure(self, steps: int, tokens: int, reservation: int, internal: int, external: int, free: int, running: int) -> None:
        if running == 0:
            return
        self.busy.add(steps, tokens, reservation, internal, external, free, running)
        if self.waiting:
            self.sat.add(steps, tokens, reservation, internal, external, free, running)

    # -- the stretch between two full steps, in closed form ----------------------------
    def next_full_step(self, t: int, freed: bool, fast: bool) -> int | None:
        """The next step at which anything but linear growth happens (None: all done).

        In the steps skipped over nobody finishes, nobody arrives to an empty queue, and
        free memory only shrinks - so no admission can become possible and nothing but the
        token counts (and paged block counts) changes."""
        running, waiting = self.running, self.waiting
        arrival = self.jobs[self.next_job].arrival_step if self.next_job < len(self.jobs) else None
        if not running and not waiting:
            return arrival  # idle: jump to the next arrival (None: all done)
        if freed or not fast or not running:
            return t + 1
        nxt = min(j.finish for j in running)
        if arrival is not None and not waiting:  # an arrival behind a backlog changes nothing
            nxt = min(nxt, arrival)
        if self.paged and nxt > t + 1:
            nxt = min(nxt, t + self._first_shortage(t))
        return nxt

    def _first_shortage(self, t: int) -> int:
        """Smallest d >= 1 such that step t + d finds no free block for some job's growth.

        Job i holds s_i tokens after step t and needs a new block in the steps t + d with
        s_i + d - 1 a multiple of bs: first at d_i = (-s_i mod bs) + 1, then every bs steps.
        So each window of bs steps brings exactly one need per job, in the order of the
        d_i, and the (free + 1)-th need overall is the first that cannot be met."""
        bs, n = self.bs, len(self.running)
        firsts = sorted((-(j.key + t + 1)) % bs + 1 for j in self.running)
        k = self.total_blocks - self.held  # needs that can still be met
        return (k // n) * bs + firsts[k % n]

    def skip(self, t: int, m: int) -> None:
        """Account for steps t+1 .. t+m, in which every running request just adds one
        token per step: sums of arithmetic series (and of ceilings, for paged blocks)."""
        running = self.running
        n = len(running)
        if m <= 0 or n == 0:
            return
        tokens = m * (self.key_sum + n * (t + 1)) + n * m * (m + 1) // 2
        cap_steps = self.capacity * m
        if self.paged:
            bs = self.bs
            block_steps = 0
            held_end = 0
            # Sum over d = 1..m of ceil((s + d) / bs), via C(x) = sum of ceil(i / bs) for
            # i = 1..x = bs * q(q+1)/2 + r(q+1) with x = q * bs + r. The simulator's hottest loop.
            for j in running:
                s = j.key + t + 1
                q0, r0 = divmod(s, bs)
                q1, r1 = divmod(s + m, bs)
                block_steps += bs * (q1 * (q1 + 1) - q0 * (q0 + 1)) // 2 + r1 * (q1 + 1) - r0 * (q0 + 1)
                held_end += q1 + (r1 > 0)
            self.held = held_end
            held = bs * block_steps
            dead = self.dead_slots * m
            self._measure(m, tokens, 0, held - tokens, dead, cap_steps - held - dead, n * m)
        else:
            unreserved = cap_steps - self.reserved_sum * m
            saturated = bool(self.waiting)
            self._measure(
                m,
                tokens,
                self.final_sum * m - tokens,
                (self.reserved_sum - self.final_sum) * m,
                unreserved if saturated else 0,
                0 if saturated else unreserved,
                n * m,
            )

    def run(self, fast: bool) -> None:
        t: int | None = self.jobs[0].arrival_step
        while t is not None:
            freed = self.step(t)
            nxt = self.next_full_step(t, freed, fast)
            if nxt is not None and self.running:
                self.skip(t, nxt - t - 1)
            t = nxt


def _jobs_from_trace(
    trace: Iterable[TraceRequest], strategy: str, block_size: int, capacity: int, max_model_len: int, step_seconds: float
) -> list[_Job]:
    jobs: list[_Job] = []
    usable = capacity if strategy != "paged" else (capacity // block_size) * block_size
    for req in trace:
        p, o = len(req.prompt_token_ids), req.max_tokens
        if p < 1 or o < 1:
            raise ValueError(f"request {req.request_id!r} has prompt {p} and output {o} tokens; both must be >= 1")
        if p + o > max_model_len:
            raise ValueError(
                f"request {req.request_id!r} needs prompt + output = {p + o} tokens, more than "
                f"max_model_len={max_model_len}; raise max_model_len or clip the trace"
            )
        if strategy == "paged":
            need = round_up(p + o, block_size)
        else:
            need = reservation_size(strategy, p + o, max_model_len)
        if need > usable:
            what = f"{need // block_size} blocks of {block_size} = " if strategy == "paged" else ""
            raise ValueError(
                f"capacity_tokens={capacity} is smaller than one request: {req.request_id!r} needs "
                f"{what}{need} slots under strategy {strategy!r}; capacity_tokens must be >= {need}"
            )
        # Arrival time -> step; the tiny epsilon keeps e.g. 0.3 s / 0.1 s on step 3, not 2.
        arrival_step = math.floor(req.arrival_time / step_seconds + 1e-9)
        jobs.append(_Job(req.request_id, p, o, arrival_step, need if strategy != "paged" else 0))
    if not jobs:
        raise ValueError("trace is empty; the simulator needs at least one request")
    jobs.sort(key=lambda j: j.arrival_step)  # stable: equal steps keep trace order
    return jobs


def simulate(
    trace: Iterable[TraceRequest],
    capacity_tokens: int,
    strategy: str = "paged",
    *,
    block_size: int = 16,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    step_seconds: float = DEFAULT_STEP_SECONDS,
    fast: bool = True,
) -> SimResult:
    """Replay ``trace`` in ``capacity_tokens`` KV slots under one strategy.

    ``strategy`` is ``"max"``, ``"pow2"``, ``"oracle"`` or ``"paged"`` (``block_size`` is
    used only by ``"paged"``). Every request's prompt + ``max_tokens`` must fit in
    ``max_model_len``, and one request alone must fit in the capacity (otherwise it could
    never run and FCFS would stall forever). ``fast=False`` simulates every step one by one
    (same result, slower; for tests and for curious learners).
    """
    strategy = _check_strategy(strategy)
    bs = _check_block_size(block_size)
    capacity = check_int("capacity_tokens", capacity_tokens, 1)
    mml = check_int("max_model_len", max_model_len, 1)
    step_seconds = check_number("step_seconds", step_seconds, 0, strict=True)
    if strategy == "paged" and bs > capacity:
        raise ValueError(f"capacity_tokens={capacity} is smaller than one block of block_size={bs}")
    jobs = _jobs_from_trace(trace, strategy, bs, capacity, mml, float(step_seconds))

    sim = _Sim(jobs, capacity, strategy, bs)
    sim.run(fast)
    acc, measured_on = (sim.sat, "saturated") if sim.sat.steps else (sim.busy, "busy")
    denom = acc.steps * capacity

    def pct(x: int) -> float:
        return 100.0 * x / denom

    return SimResult(
        strategy=strategy,
        block_size=bs if strategy == "paged" else None,
        capacity_tokens=capacity,
        token_states_pct=pct(acc.tokens),
        reservation_pct=pct(acc.reservation),
        internal_pct=pct(acc.internal),
        external_pct=pct(acc.external),
        free_pct=pct(acc.free),
        avg_running=acc.running / acc.steps,
        peak_running=sim.peak,
        measured_on=measured_on,
        measured_steps=acc.steps,
        saturated_steps=sim.sat.steps,
        busy_steps=sim.busy.steps,
        total_steps=sim.last_step - jobs[0].arrival_step + 1,
        num_requests=len(jobs),
        num_preemptions=sim.preemptions,
    )


def paged_decisions(
    trace: Iterable[TraceRequest],
    capacity_tokens: int,
    *,
    block_size: int = 16,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    step_seconds: float = DEFAULT_STEP_SECONDS,
) -> list[tuple[int, str, str]]:
    """The paged strategy's scheduling decisions: ``(step, "admit" | "preempt", request_id)``
    in the order it makes them (arrival steps as in :func:`simulate`).

    These are the decisions vLLM V1's scheduler makes for the same memory, and the tests
    replay them through kvlab's real ``Scheduler``: FCFS, running requests first (oldest
    first) each taking a slot for its next token, the newest preempted when no block is
    free, admission only of a head whose prompt fits and never in a step that preempted.
    One difference is a matter of bookkeeping: here a token's slot is taken in the step
    that *produces* it, while the engine writes a sampled token's K/V in the next step. So
    a request with prompt P here is one with prompt P + 1 in the engine (its first output
    already stored), and both hold the same blocks at every step.
    """
    strategy = "paged"
    bs = _check_block_size(block_size)
    capacity = check_int("capacity_tokens", capacity_tokens, bs)
    mml = check_int("max_model_len", max_model_len, 1)
    step_seconds = check_number("step_seconds", step_seconds, 0, strict=True)
    sim = _Sim(_jobs_from_trace(trace, strategy, bs, capacity, mml, step_seconds), capacity, strategy, bs)
    sim.run(fast=True)
    return sim.decisions


def compare(
    trace: Iterable[TraceRequest],
    capacity_tokens: int,
    strategies: Sequence[str] = STRATEGIES,
    block_sizes: Sequence[int] = (16,),
    *,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    step_seconds: float = DEFAULT_STEP_SECONDS,
) -> list[SimResult]:
    """One :class:`SimResult` per contiguous strategy, and one per block size for
    ``"paged"``, all on the same trace and the same capacity - the rows of Fig. 2."""
    trace = list(trace)
    for s in strategies:
        _check_strategy(s)
    if "paged" in strategies:
        if not block_sizes:
            raise ValueError("block_sizes is empty; strategy 'paged' needs at least one block size")
        for b in block_sizes:
            _check_block_size(b)
    rows: list[SimResult] = []
    for s in strategies:
        for b in block_sizes if s == "paged" else (16,):
            rows.append(simulate(trace, capacity_tokens, s, block_size=b, max_model_len=max_model_len, step_seconds=step_seconds))
    return rows


def format_table(rows: Iterable[SimResult]) -> str:
    """A fixed-width text table of results (one line per strategy)."""
    header = ("strategy", "token states %", "reservation %", "internal %", "external %", "free %", "avg running", "peak", "preempted")
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.label,
                f"{r.token_states_pct:.1f}",
                f"{r.reservation_pct:.1f}",
                f"{r.internal_pct:.1f}",
                f"{r.external_pct:.1f}",
                f"{r.free_pct:.1f}",
                f"{r.avg_running:.2f}",
                str(r.peak_running),
                str(r.num_preemptions),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        out.append("  ".join(cells))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
