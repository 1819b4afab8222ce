"""The model runner, driven WITHOUT the scheduler: a test-local driver plays the scheduler
and the KV-cache manager (block allocation with shuffled ids, prefix sharing, sliding-window
freeing, preemption) and hands the runner SchedulerOutputs built by hand.

Ground truth is always ``TinyLlama.generate_dense`` / ``forward_dense`` (no cache at all).
The kernels are the real Triton ones (interpreted on CPU), so the model is kept tiny.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvlab.core.kv_cache_utils import KVCacheBlockCopy
from kvlab.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.worker.model import TinyLlama, TinyLlamaConfig
from kvlab.worker.model_runner import ModelRunner

# Tiny ops: one thread is much faster than two fighting over 2 shared cores.
torch.set_num_threads(1)

BS = 4  # small blocks: many blocks per prompt, so the tables are interesting
WINDOW = 8
SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
HYBRID = TinyLlamaConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, sliding_window=WINDOW, sliding_window_layers=(1,)
)
# Logits: paged (online softmax in the kernel, per-block accumulation) vs dense SDPA in
# float32 differ by rounding only; observed max |diff| is ~1e-5.
LOGIT_TOL = dict(rtol=1e-4, atol=2e-4)

PROMPTS = [
    list(b"Blocks, not buffers: paged."),  # 27 tokens: 7 blocks, the last one partial
    list(b"Logical -> physical."),  # 20 tokens: exactly 5 blocks
    list(b"Short one."),
]


def new_request_data(req_id, prompt, all_tokens, block_ids, computed, todo) -> NewRequestData:
    """kvlab's scheduler's shape: vLLM 0.33's fields, the V2 runner's prefill tokens, this step's tokens."""
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=block_ids,
        num_computed_tokens=computed,
        lora_request=None,
        prefill_token_ids=all_tokens,
        new_token_ids=todo,
    )


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(SMALL, seed=0)


@pytest.fixture(scope="module")
def hybrid() -> TinyLlama:
    return TinyLlama(HYBRID, seed=0)


# ----------------------------------------------------------------------------- test driver


class Pool:
    """Block ids 1..num_blocks-1 in shuffled order, with ref counts; 0 is the null block.

    A released block goes on top of the free list, so it is the very next one handed out:
    stale ids in a runner's table then point at blocks that now hold someone else's tokens.
    """

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.ref: dict[int, int] = {}

    def take(self) -> int:
        block = self.free.pop()
        self.ref[block] = 1
        return block

    def share(self, block: int) -> None:
        self.ref[block] += 1

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            del self.ref[block]
            self.free.append(block)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int]
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # the manager's view (nulls included)
    pending: list[list[int]] = field(default_factory=list)  # appended since the last step
    sent: bool = False
    resumed: bool = False
    outputs: list[int] = field(default_factory=list)


class Driver:
    """Plays scheduler + KV-cache manager for one runner."""

    def __init__(self, runner: ModelRunner, chunk: int | None = None, pool_seed: int = 0, check_logits: bool = True) -> None:
        self.runner = runner
        self.pool = Pool(runner.num_blocks, pool_seed)
        self.chunk = chunk
        self.check_logits = check_logits
        self.groups = runner.num_groups
        self.window = runner.group_windows[1] if self.groups > 1 else None
        self.active: dict[str, Req] = {}
        self.waiting: dict[str, Req] = {}
        self.done: dict[str, Req] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.num_steps = 0
        self.max_logit_diff = 0.0

    def add(self, rid: str, prompt: list[int], max_tokens: int, hit: tuple[int, list[list[int]]] | None = None) -> Req:
        req = Req(rid, list(prompt), max_tokens, list(prompt))
        req.blocks = [[] for _ in range(self.groups)]
        req.pending = [[] for _ in range(self.groups)]
        if hit is not None:  # prefix-cache hit: share these blocks, start computing after them
            req.computed, shared = hit
            for g, row in enumerate(shared):
                for b in row:
                    if b:
                        self.pool.share(b)
                req.blocks[g] = list(row)
        self.active[rid] = req
        return req

    def preempt(self, rid: str) -> None:
        """vLLM's recompute preemption: free everything, forget the progress."""
        req = self.active.pop(rid)
        self._free(req)
        req.computed, req.sent, req.resumed = 0, False, True
        req.blocks = [[] for _ in range(self.groups)]
        req.pending = [[] for _ in range(self.groups)]
        self.preempted.add(rid)
        self.waiting[rid] = req

    def resume(self, rid: str) -> None:
        self.active[rid] = self.waiting.pop(rid)

    def _free(self, req: Req) -> None:
        for row in req.blocks:
            for b in reversed(row):
                if b:
                    self.pool.release(b)

    def step(self) -> dict[str, list[int]]:
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        sched: dict[str, int] = {}
        for req in self.active.values():
            remaining = len(req.tokens) - req.computed
            n = remaining if self.chunk is None else min(self.chunk, remaining)
            if self.window is not None:  # blocks wholly before the window go back to the pool
                skipped = max(0, req.computed - self.window + 1)
                row = req.blocks[1]
                for i in range(min(skipped // BS, len(row))):
                    if row[i]:
                        self.pool.release(row[i])
                        row[i] = 0
            need = -(-(req.computed + n) // BS)
            for g in range(self.groups):
                while len(req.blocks[g]) < need:
                    b = self.pool.take()
                    req.blocks[g].append(b)
                    req.pending[g].append(b)
            todo = req.tokens[req.computed : req.computed + n]
            if not req.sent:
                new_reqs.append(
                    new_request_data(req.rid, req.prompt, list(req.tokens), tuple(list(r) for r in req.blocks), req.computed, todo)
                )
                req.sent = True
            else:
                cached.req_ids.append(req.rid)
                cached.new_block_ids.append(tuple(req.pending) if any(req.pending) else None)
                cached.num_computed_tokens.append(req.computed)
                cached.new_token_ids.append(todo)
            req.pending = [[] for _ in range(self.groups)]
            sched[req.rid] = n
        so = SchedulerOutput(
            step=self.num_steps,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
            scheduled_new_req_ids=[r.req_id for r in new_reqs if not self.active[r.req_id].resumed],
            scheduled_resumed_req_ids=[r.req_id for r in new_reqs if self.active[r.req_id].resumed],
            scheduled_running_req_ids=list(cached.req_ids),
            preempted_req_ids=self.preempted,
            finished_req_ids=self.finished,
        )
        self.preempted, self.finished = set(), set()
        self.num_steps += 1
        out = self.runner.execute_model(so)
        complete = {rid for rid, n in sched.items() if self.active[rid].computed + n == len(self.active[rid].tokens)}
        assert set(out) == complete, "tokens only for requests whose known tokens are all computed"
        batch = self.runner.last_batch
        for row, rid in enumerate(batch.req_ids if batch is not None else ()):
            req = self.active[rid]
            req.computed += sched[rid]
            if self.check_logits:
                dense = self.runner.model.forward_dense(req.tokens[: req.computed])[-1]
                torch.testing.assert_close(batch.logits[row], dense, **LOGIT_TOL)
                finite = dense.isfinite()
                self.max_logit_diff = max(self.max_logit_diff, float((batch.logits[row] - dense)[finite].abs().max()))
        for rid, toks in out.items():
            req = self.active[rid]
            assert len(toks) == 1
            req.tokens += toks
            req.outputs += toks
            if len(req.outputs) == req.max_tokens:
                self._free(req)
                self.finished.add(rid)
                self.done[rid] = self.active.pop(rid)
        return out

    def run(self, max_steps: int = 200) -> dict[str, list[int]]:
        while self.active:
            self.step()
            assert self.num_steps < max_steps
        return {rid: r.outputs for rid, r in self.done.items()}


def make_runner(model: TinyLlama, num_blocks: int = 64, **kwargs) -> ModelRunner:
    return ModelRunner(model, num_blocks=num_blocks, block_size=BS, **kwargs)


def expected(model: TinyLlama, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    return {f"r{i}": model.generate_dense(p, max_tokens) for i, p in enumerate(prompts)}


# ----------------------------------------------------------------------------- (a)-(e)


def test_prefill_and_decode_match_dense(model: TinyLlama) -> None:
    runner = make_runner(model)
    driver = Driver(runner, pool_seed=1)
    for i, p in enumerate(PROMPTS):
        driver.add(f"r{i}", p, 4)
    assert driver.run() == expected(model, PROMPTS, 4)
    assert driver.max_logit_diff < 2e-4
    assert runner.history == []  # keep_history is off by default
    assert runner.num_tokens_computed == sum(len(p) + 4 - 1 for p in PROMPTS)
    # The last step's finished ids reach the runner with the next SchedulerOutput.
    assert set(runner.requests) == {"r0", "r1", "r2"}
    driver.step()
    assert runner.requests == {}


def test_batch_record_shows_what_the_kernels_got(model: TinyLlama) -> None:
    runner = make_runner(model, keep_history=True)
    driver = Driver(runner, pool_seed=2)
    driver.add("r0", PROMPTS[0][:10], 2)
    driver.add("r1", PROMPTS[1][:5], 2)
    driver.step()
    rec = runner.last_batch
    t0, t1 = driver.active["r0"].blocks[0], driver.active["r1"].blocks[0]
    assert rec.req_ids == ["r0", "r1"] and rec.num_scheduled_tokens == [10, 5]
    assert rec.cu_seqlens_q == [0, 10, 15] and rec.seq_lens == [10, 5]
    assert rec.positions == list(range(10)) + list(range(5))
    assert rec.slot_mappings[0][:5] == [t0[p // BS] * BS + p % BS for p in range(5)]
    assert rec.slot_mappings[0][10:] == [t1[p // BS] * BS + p % BS for p in range(5)]
    assert rec.block_tables[0] == [t0, t1 + [0]]  # padded with 0 to the widest row
    assert rec.logits_indices == [9, 14]
    driver.step()
    assert runner.last_batch.positions == [10, 5] and runner.last_batch.seq_lens == [11, 6]
    assert len(runner.history) == 2


def test_chunked_prefill_matches_dense(model: TinyLlama) -> None:
    runner = make_runner(model)
    driver = Driver(runner, chunk=7, pool_seed=3)
    for i, p in enumerate(PROMPTS[:2]):
        driver.add(f"r{i}", p, 3)
    first = driver.step()
    assert first == {}  # both prompts are longer than one chunk: no token yet
    assert runner.last_batch.num_scheduled_tokens == [7, 7]
    assert driver.run() == expected(model, PROMPTS[:2], 3)


def test_prefix_hit_skips_compute(model: TinyLlama) -> None:
    shared = list(b"System: be paged. ")  # 18 tokens -> 4 full blocks of 4 are shareable
    p0, p1 = shared + list(b"Hi!"), shared + list(b"Bonjour.")
    runner = make_runner(model)
    driver = Driver(runner, pool_seed=4)
    r0 = driver.add("r0", p0, 4)
    driver.step()  # r0's prefill
    driver.step()
    k = len(shared) // BS
    hit_blocks = r0.blocks[0][:k]
    before = runner.num_tokens_computed
    driver.add("r1", p1, 4, hit=(k * BS, [hit_blocks]))
    driver.step()
    rec = runner.last_batch
    row = rec.req_ids.index("r1")
    assert rec.num_scheduled_tokens[row] == len(p1) - k * BS  # only the uncached tail was fed
    assert rec.positions[rec.cu_seqlens_q[row]] == k * BS
    assert runner.num_tokens_computed - before == len(p1) - k * BS + 1  # + r0's decode token
    r1_slots = rec.slot_mappings[0][rec.cu_seqlens_q[row] : rec.cu_seqlens_q[row + 1]]
    assert not {s // BS for s in r1_slots} & set(hit_blocks)  # shared blocks are read, never written
    assert runner.block_table("r1")[0][:k] == hit_blocks
    assert driver.run() == {"r0": model.generate_dense(p0, 4), "r1": model.generate_dense(p1, 4)}


def test_sliding_window_groups_with_null_and_reused_blocks(hybrid: TinyLlama) -> None:
    runner = make_runner(hybrid, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=WINDOW)])
    assert runner.layer_to_group == (0, 1)
    driver = Driver(runner, pool_seed=5)
    prompts = [PROMPTS[0][:22], PROMPTS[2]]
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, 7)
    driver.step()
    # A third request hits r0's first 4 blocks (16 tokens). In the window group only the
    # blocks that still overlap the window of position 16 (keys 9..16) are needed; the ones
    # before are the null block, as the manager would hand them over.
    r0 = driver.active["r0"]
    k = 4
    first_needed = (k * BS - WINDOW + 1) // BS
    window_row = [0] * first_needed + r0.blocks[1][first_needed:k]
    p2 = PROMPTS[0][: k * BS] + list(b"tail")
    driver.add("r2", p2, 5, hit=(k * BS, [r0.blocks[0][:k], window_row]))
    rows: dict[str, list[int]] = {}
    while driver.active:
        driver.step()
        rows |= {rid: runner.block_table(rid)[1] for rid in driver.active}
    assert rows["r2"][:first_needed] == [0] * first_needed
    got = {rid: r.outputs for rid, r in driver.done.items()}
    want = {"r0": hybrid.generate_dense(prompts[0], 7), "r1": hybrid.generate_dense(prompts[1], 7), "r2": hybrid.generate_dense(p2, 5)}
    assert got == want
    # Window blocks that left the window went back to the pool and were handed out again
    # while the runner's (append-only) rows still held their old ids: some physical block
    # appears twice among the rows. Safe only because the kernel never reads keys outside
    # the window.
    ids = [b for row in rows.values() for b in row if b]
    assert len(ids) != len(set(ids))


def test_preempted_then_resumed_matches_dense(model: TinyLlama) -> None:
    runner = make_runner(model)
    driver = Driver(runner, pool_seed=7)
    for i, p in enumerate(PROMPTS[:2]):
        driver.add(f"r{i}", p, 7)
    for _ in range(3):
        driver.step()
    driver.preempt("r1")
    driver.step()  # r1 dropped by the runner this step
    assert "r1" not in runner.requests
    driver.step()
    driver.resume("r1")
    before = runner.num_tokens_computed
    driver.step()  # r1 comes back whole: prompt + its 3 outputs are recomputed
    rec = runner.last_batch
    row = rec.req_ids.index("r1")
    assert rec.num_scheduled_tokens[row] == len(PROMPTS[1]) + 3
    assert runner.num_tokens_computed - before == len(PROMPTS[1]) + 3 + 1
    assert driver.run() == expected(model, PROMPTS[:2], 7)


def test_temperature_sampling_is_seeded(model: TinyLlama) -> None:
    outs = []
    for _ in range(2):
        # The sampler is under test, not the kernels: the torch reference kernels suffice.
        driver = Driver(make_runner(model, temperature=1.0, seed=11, backend="reference"), check_logits=False)
        driver.add("r0", PROMPTS[2], 5)
        outs.append(driver.run()["r0"])
    assert outs[0] == outs[1]
    assert outs[0] != model.generate_dense(PROMPTS[2], 5)  # not greedy


# ----------------------------------------------------------------------------- bad input


def _new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0, groups: int = 1) -> NewRequestData:
    return new_request_data(req_id, tokens, tokens, tuple([list(blocks)] * groups), computed, tokens[computed:])


def _output(
    new: list[NewRequestData],
    cached: CachedRequestData | None = None,
    sched: dict[str, int] | None = None,
    finished: set[str] | None = None,
) -> SchedulerOutput:
    cached = cached or CachedRequestData()
    if sched is None:
        sched = {r.req_id: len(r.new_token_ids) for r in new}
        sched |= {rid: len(t) for rid, t in zip(cached.req_ids, cached.new_token_ids)}
    return SchedulerOutput(
        0, new, cached, sched, sum(sched.values()), [r.req_id for r in new], [], list(cached.req_ids), set(), finished or set()
    )


def test_bad_scheduler_outputs_raise_and_change_nothing(model: TinyLlama) -> None:
    runner = make_runner(model, num_blocks=16)
    toks = list(b"abcdefghij")  # 10 tokens -> 3 blocks of 4
    runner.execute_model(_output([_new("ok", toks, [3, 4, 5])]))
    state = runner.block_table("ok"), list(runner.requests["ok"].token_ids)
    computed = runner.num_tokens_computed
    nxt = runner.requests["ok"].token_ids[-1]
    cases = [
        (_output([_new("a", toks, [3, 4])]), "need 3 blocks"),
        (_output([_new("a", toks, [3, 4, 99])]), r"out of range 0\.\.15"),
        (_output([_new("a", toks, [3, 0, 5])]), "null block"),
        (_output([_new("a", toks, [3, 4, 5], groups=2)]), "one list per KV-cache group"),
        (_output([_new("a", toks, [3, 4, 5])], sched={"a": 4}), "num_scheduled_tokens"),
        (_output([_new("a", toks, [3, 4, 5])], sched={"a": 10, "b": 1}), "not scheduled"),
        (_output([new_request_data("a", toks, toks, ([3, 4, 5],), 11, [1])]), "num_computed_tokens"),
        (_output([_new("a", [1, 500], [3])]), "out of range 0..258"),
        (_output([], CachedRequestData(["ghost"], [None], [3], [[1]])), "unknown to the runner"),
        (_output([], CachedRequestData(["ok"], [None], [10], [[nxt + 1]])), "holds"),
        (_output([], CachedRequestData(["ok"], [([6], [7])], [10], [[nxt]])), "one list per KV-cache group"),
        (_output([], CachedRequestData(["ok"], [None], [10], [[nxt]]), finished={"ok"}), "finished"),
        (_output([_new("ok", toks, [3, 4, 5])], CachedRequestData(["ok"], [None], [10], [[nxt]]), sched={"ok": 10}), "twice"),
    ]
    for so, match in cases:
        with pytest.raises(ValueError, match=match):
            runner.execute_model(so)
        assert (runner.block_table("ok"), runner.requests["ok"].token_ids) == state
        assert runner.num_tokens_computed == computed and set(runner.requests) == {"ok"}
    with pytest.raises(TypeError, match="SchedulerOutput"):
        runner.execute_model({"ok": 1})  # type: ignore[arg-type]


def test_the_runner_zeroes_the_blocks_the_scheduler_names_before_the_step(model: TinyLlama) -> None:
    """vLLM 0.33's ``new_block_ids_to_zero``: every layer's pages of those blocks become 0
    before the forward pass; a bad id is refused before anything changes."""
    runner = make_runner(model, num_blocks=16)
    toks = list(b"abcdefghij")
    runner.execute_model(_output([_new("a", toks, [3, 4, 5])], finished=set()))
    assert all(bool(kv[[3, 4, 5]].abs().sum() > 0) for kv in runner.kv_caches)
    before = [kv.clone() for kv in runner.kv_caches]
    bad = _output([_new("b", toks[:3], [6])], finished={"a"})
    bad.new_block_ids_to_zero = [4, 16]
    with pytest.raises(ValueError, match=r"new_block_ids_to_zero: 16 is not a block id of this cache \(1..15\)"):
        runner.execute_model(bad)
    assert all(torch.equal(kv, b) for kv, b in zip(runner.kv_caches, before)) and set(runner.requests) == {"a"}
    so = _output([_new("b", toks[:3], [6])], finished={"a"})
    so.new_block_ids_to_zero = [4, 5]
    runner.execute_model(so)
    for kv, b in zip(runner.kv_caches, before):
        assert not kv[[4, 5]].any()  # zeroed
        assert torch.equal(kv[3], b[3])  # untouched
        assert kv[6].abs().sum() > 0  # b's step wrote its block after the zeroing


def test_the_runner_copies_the_pages_the_scheduler_names_after_zeroing(model: TinyLlama) -> None:
    """vLLM 0.33's ``kv_cache_block_copies`` (copy-on-write): after zeroing, each destination
    page becomes its source page in every layer, before the forward pass; a bad copy is
    refused before anything changes."""
    runner = make_runner(model, num_blocks=16)
    toks = list(b"abcdefghij")
    runner.execute_model(_output([_new("a", toks, [3, 4, 5])], finished=set()))
    before = [kv.clone() for kv in runner.kv_caches]
    for copies, match in (
        ([KVCacheBlockCopy(4, 16)], r"dst_block_id 16 is not a block id of this cache \(1..15\)"),
        ([KVCacheBlockCopy(0, 7)], r"src_block_id 0 is not a block id"),
        ([KVCacheBlockCopy(4, 4)], "block 4 is copied onto itself"),
    ):
        bad = _output([_new("b", toks[:3], [6])], finished={"a"})
        bad.kv_cache_block_copies = copies
        with pytest.raises(ValueError, match=match):
            runner.execute_model(bad)
        assert all(torch.equal(kv, b) for kv, b in zip(runner.kv_caches, before)) and set(runner.requests) == {"a"}
    so = _output([_new("b", toks[:3], [6])], finished={"a"})
    so.new_block_ids_to_zero = [7, 8]
    so.kv_cache_block_copies = [KVCacheBlockCopy(4, 7), KVCacheBlockCopy(3, 9)]
    runner.execute_model(so)
    for kv, b in zip(runner.kv_caches, before):
        assert torch.equal(kv[7], b[4]) and torch.equal(kv[9], b[3])  # zeroed, then copied
        assert not kv[8].any() and torch.equal(kv[4], b[4])


def test_empty_step_drops_finished(model: TinyLlama) -> None:
    runner = make_runner(model, num_blocks=8)
    runner.execute_model(_output([_new("a", [65, 66], [2])]))
    assert runner.execute_model(_output([], finished={"a"})) == {}
    assert runner.requests == {} and runner.last_batch is None


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(num_blocks=1), ValueError, "num_blocks"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(backend="cuda-graphs"), ValueError, "backend"),
        (dict(kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)]), ValueError, "do not match"),
        (dict(kv_cache_groups=[SlidingWindowSpec(sliding_window=8)]), ValueError, "full-attention group"),
        (dict(kv_cache_groups=[FullAttentionSpec(block_size=16)]), ValueError, "block_size"),
    ],
)
def test_bad_constructor_args(model: TinyLlama, kwargs: dict, exc: type, match: str) -> None:
    args = dict(num_blocks=8, block_size=BS) | kwargs
    with pytest.raises(exc, match=match):
        ModelRunner(model, **args)


def test_window_model_needs_its_group(hybrid: TinyLlama) -> None:
    with pytest.raises(ValueError, match="do not match"):
        ModelRunner(hybrid, num_blocks=8, block_size=BS, kv_cache_groups=[FullAttentionSpec()])
    assert ModelRunner(hybrid, num_blocks=8, block_size=BS).group_windows == (None, WINDOW)
