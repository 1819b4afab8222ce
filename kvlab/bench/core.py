"""`python -m kvlab.bench core` -- the speed of the block pool and of block hashing.

Two questions, each answered as a ratio measured in this one run:

* How long does one allocate + cache + free cycle of 64 blocks take on a 100,000-block
  pool whose free blocks are all cached (so every allocated block is an eviction)? Target:
  <= 25 floor units (vLLM's own BlockPool measures about 31 on the same machine).
* How long does the engine's chained block hash take per block -- the request block hasher
  extending a 64-block request, 16 tokens a block -- per algorithm, next to raw SHA-256
  over the same bytes? Target: kvlab's sha256 <= 1.5x raw SHA-256 of its bytes. vLLM
  pickles the block tuple before hashing; that variant is timed too, for comparison.

* Does a decode step cost more for a request that holds more blocks? The engine's step
  (schedule + execute with the model-free executor + update, the undo checkpoint on) per
  running request, for 8 requests each holding 16, 256 and 2,048 blocks, and the growth
  from the first to the last. A step's work should be what it changes (one token, at most
  one new block), not the context behind it; the table's copy in the undo checkpoint is
  what still grows (a C-speed list copy per request).

Why a "floor": this machine's speed drifts by 1.5x or more while others use the CPU, so
every figure is also printed as a multiple of a floor loop timed in the same run: 64 list
pops and 64 list appends written as plainly as Python allows (``b.append(a.pop())``, 64
times), the least work a 64-block cycle could possibly do -- the floor of the published
anchors. Measurements are short interleaved rounds (floor, cycle, hashes, floor, ...) and
each figure is the MEDIAN over the rounds: a neighbour that takes the CPU for a few
milliseconds spoils a minority of rounds, not the median.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import pickle
import random
import statistics
import time
from collections.abc import Callable

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens
from kvlab.core.transaction import checkpoint_pool, release_pool
from kvlab.request import Request
from kvlab.utils.hashing import HASH_ALGOS, UNSAFE_HASH_ALGOS, encode, get_hash_fn_by_name

CYCLE_BLOCKS = 64
BLOCK_SIZE = 16
POOL_BLOCKS = 100_000
CYCLE_TARGET_FLOOR_UNITS = 25.0
VLLM_CYCLE_FLOOR_UNITS = 31.0
SHA256_TARGET_RATIO = 1.5


class _BenchRequest:
    """The attributes ``BlockPool.cache_full_blocks`` reads (no events are emitted)."""

    __slots__ = ("request_id", "block_hashes", "all_token_ids")

    def __init__(self, hashes: list[bytes]) -> None:
        self.request_id = "bench"
        self.block_hashes = hashes
        self.all_token_ids: list[int] = []


class _CycleBench:
    """A pool whose every free block is cached, and enough distinct hash sets that a set
    comes back only after its previous blocks were evicted (no duplicate map entries)."""

    def __init__(self, num_blocks: int) -> None:
        rng = random.Random(0)
        self.pool = pool = BlockPool(num_blocks)
        n = pool.get_num_free_blocks()
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(_BenchRequest([rng.randbytes(32) for _ in range(n)]), blocks, 0, n, BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
        num_sets = n // CYCLE_BLOCKS + 2
        self.requests = [_BenchRequest([rng.randbytes(32) for _ in range(CYCLE_BLOCKS)]) for _ in range(num_sets)]
        self.next = 0

    def run(self, k: int) -> None:
        get, cache, free = self.pool.get_new_blocks, self.pool.cache_full_blocks, self.pool.free_blocks
        reqs, m, i = self.requests, len(self.requests), self.next
        for _ in range(k):
            blocks = get(CYCLE_BLOCKS)
            cache(reqs[i], blocks, 0, CYCLE_BLOCKS, BLOCK_SIZE, 0)
            free(reversed(blocks))
            i = (i + 1) % m
        self.next = i

    def run_split(self, k: int) -> tuple[float, float, float]:
        """The same cycle, timed phase by phase (microseconds per cycle, summed over k)."""
        get, cache, free = self.pool.get_new_blocks, self.pool.cache_full_blocks, self.pool.free_blocks
        reqs, m, i = self.requests, len(self.requests), self.next
        clock = time.perf_counter_ns
        t_get = t_cache = t_free = 0
        for _ in range(k):
            t0 = clock()
            blocks = get(CYCLE_BLOCKS)
            t1 = clock()
            cache(reqs[i], blocks, 0, CYCLE_BLOCKS, BLOCK_SIZE, 0)
            t2 = clock()
            free(reversed(blocks))
            t3 = clock()
            t_get, t_cache, t_free = t_get + t1 - t0, t_cache + t2 - t1, t_free + t3 - t2
            i = (i + 1) % m
        self.next = i
        return t_get / k / 1000.0, t_cache / k / 1000.0, t_free / k / 1000.0


class _JournaledCycleBench(_CycleBench):
    """The same cycle inside an engine step: the pool journals every change so the step can
    be undone (``kvlab.core.transaction``); the journal is released every call, as a step's is."""

    def run(self, k: int) -> None:
        cp = checkpoint_pool(self.pool)
        super().run(k)
        release_pool(self.pool, cp)


class _Floor:
    """The anchors' floor: 64 pops from one list + 64 appends to another, direction swapped
    every call; methods are looked up as plain code does (nothing bound in advance)."""

    def __init__(self) -> None:
        self.a: list[int] = list(range(CYCLE_BLOCKS))
        self.b: list[int] = []

    def run(self, k: int) -> None:
        a, b = self.a, self.b
        for _ in range(k):
            for _ in range(CYCLE_BLOCKS):
                b.append(a.pop())
            a, b = b, a
        self.a, self.b = a, b


class _BoundFloor(_Floor):
    """The floor this bench used before (pop/append bound once): cheaper, so its units were
    larger and not comparable with the anchors. Printed for reference only."""

    def run(self, k: int) -> None:
        a, b = self.a, self.b
        for _ in range(k):
            pop, app = a.pop, b.append
            for _ in range(CYCLE_BLOCKS):
                app(pop())
            a, b = b, a
        self.a, self.b = a, b


HASH_REQUEST_BLOCKS = 64


def _request_hasher(fn: Callable, tokens: list[int]) -> Callable[[int], None]:
    """The engine's path: a request's block hasher hashing all its blocks (per block = / 64)."""
    req = Request("bench", tokens)  # never bound: every call hashes all blocks afresh
    hasher = get_request_block_hasher(BLOCK_SIZE, fn)

    def run(k: int) -> None:
        for _ in range(k):
            hasher(req)

    return run


def _hash_chain(fn: Callable, tokens: list[int]) -> Callable[[int], None]:
    def run(k: int) -> None:
        h = None
        for _ in range(k):
            h = hash_block_tokens(fn, h, tokens)

    return run


def _raw_sha256(body: bytes) -> Callable[[int], None]:
    def run(k: int) -> None:
        sha = hashlib.sha256
        for _ in range(k):
            sha(body).digest()

    return run


def _pickle_sha256(parent: bytes, tokens: list[int]) -> Callable[[int], None]:
    """vLLM's sha256: pickle the (parent, tokens, extra) tuple, then hash the pickle."""

    def run(k: int) -> None:
        sha, dumps = hashlib.sha256, pickle.dumps
        for _ in range(k):
            sha(dumps((parent, tuple(tokens), None), protocol=5)).digest()

    return run


def _time_per_op(fn: Callable[[int], None], k: int) -> float:
    t = time.perf_counter_ns()
    fn(k)
    return (time.perf_counter_ns() - t) / k / 1000.0  # microseconds


def measure(repeats: int = 200, pool_blocks: int = POOL_BLOCKS, budget_s: float = 0.0005) -> dict[str, float]:
    """Median over ``repeats`` interleaved rounds of microseconds per operation (a hash
    figure is per block). Each round of each case lasts about ``budget_s``."""
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(BLOCK_SIZE)]
    parent = rng.randbytes(32)
    request_tokens = [rng.randrange(50_000) for _ in range(BLOCK_SIZE * HASH_REQUEST_BLOCKS)]
    cycle_bench = _CycleBench(pool_blocks)
    # name -> (run(k), operations per k): a request-hasher call hashes HASH_REQUEST_BLOCKS blocks
    cases: dict[str, tuple[Callable[[int], None], int]] = {
        "floor": (_Floor().run, 1),
        "floor (bound methods)": (_BoundFloor().run, 1),
        "cycle": (cycle_bench.run, 1),
        "cycle (journaled)": (_JournaledCycleBench(pool_blocks).run, 1),
    }
    for name in HASH_ALGOS:
        cases[f"hash:{name}"] = (_request_hasher(get_hash_fn_by_name(name), request_tokens), HASH_REQUEST_BLOCKS)
    cases["raw sha256"] = (_raw_sha256(encode((parent, tuple(tokens), None))), 1)
    cases["pickle+sha256 (vLLM)"] = (_pickle_sha256(parent, tokens), 1)
    cases["hash_block_tokens(list)"] = (_hash_chain(get_hash_fn_by_name("sha256"), tokens), 1)

    # Calibrate: enough iterations for ~budget_s per round, so rounds are short and interleave.
    iters = {}
    for name, (fn, _) in cases.items():
        k = 1
        while True:
            t = time.perf_counter()
            fn(k)
            dt = time.perf_counter() - t
            if dt > budget_s / 4 or k >= 1 << 20:
                break
            k *= 2
        iters[name] = max(1, round(k * budget_s / max(dt, 1e-9)))

    samples: dict[str, list[float]] = {name: [] for name in cases}
    split: list[tuple[float, float, float]] = []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # as timeit does: a collection walking 100,000 blocks is not the pool's cost
    try:
        for _ in range(repeats):
            for name, (fn, per) in cases.items():
                samples[name].append(_time_per_op(fn, iters[name]) / per)
            split.append(cycle_bench.run_split(iters["cycle"]))
    finally:
        if gc_was_enabled:
            gc.enable()
    out = {name: statistics.median(v) for name, v in samples.items()}
    phases = [statistics.median(p) for p in zip(*split)]
    out["cycle:get_new_blocks"], out["cycle:cache_full_blocks"], out["cycle:free_blocks"] = phases
    return out


DECODE_HELD = (16, 256, 2048)


def decode_step_us(blocks_held: int, num_requests: int = 8, steps: int = 30, rounds: int = 3) -> float:
    """Median over ``rounds`` of the thread CPU time of one engine decode step per running
    request, each request holding ``blocks_held`` blocks (prefill excluded)."""
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.executor.simulated import SimulatedExecutor

    samples = []
    for _ in range(rounds):
        mgr = KVCacheManager(num_blocks=num_requests * (blocks_held + 4) + 2, block_size=BLOCK_SIZE, enable_caching=False)
        sched = Scheduler(mgr, max_num_batched_tokens=10**7, max_num_seqs=num_requests, max_model_len=10**7)
        eng = LLMEngine(mgr, sched, SimulatedExecutor())
        for i in range(num_requests):
            eng.add_request(Request(f"r{i}", [7] * (blocks_held * BLOCK_SIZE - 1), max_tokens=steps + 2))
        eng.step()  # the prefill
        t = time.thread_time()
        for _ in range(steps):
            eng.step()
        samples.append((time.thread_time() - t) / steps / num_requests * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench core", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200, help="interleaved rounds; each figure is the median (default 200)")
    ap.add_argument("--pool-blocks", type=int, default=POOL_BLOCKS, help=f"pool size (default {POOL_BLOCKS:,})")
    args = ap.parse_args(argv or [])
    if args.pool_blocks <= CYCLE_BLOCKS or args.repeats < 1:
        ap.error(f"--pool-blocks must be > {CYCLE_BLOCKS} and --repeats >= 1")

    t0 = time.perf_counter()
    r = measure(repeats=args.repeats, pool_blocks=args.pool_blocks)
    floor = r["floor"]

    def row(label: str, us: float, extra: str = "") -> None:
        print(f"  {label:<36} {us:9.3f} us   {us / floor:7.2f} floor units{extra}")

    print(f"[core] block pool and hashing, one run ({args.repeats} interleaved rounds, median of each)")
    row(f"floor: {CYCLE_BLOCKS} x b.append(a.pop())", floor)
    units = r["cycle"] / floor
    verdict = "OK" if units <= CYCLE_TARGET_FLOOR_UNITS else "MISSED"
    row(
        f"cycle: {CYCLE_BLOCKS} x alloc+cache+free",
        r["cycle"],
        f"   target <= {CYCLE_TARGET_FLOOR_UNITS:g} (vLLM ~{VLLM_CYCLE_FLOOR_UNITS:g}): {verdict}",
    )
    print(f"  {'':<36} {r['cycle'] / CYCLE_BLOCKS:9.3f} us per block, pool of {args.pool_blocks:,} blocks, all evictions")
    row(
        "  the same, undo journal on (an engine step)",
        r["cycle (journaled)"],
        f"   {r['cycle (journaled)'] / r['cycle']:.2f}x the cycle (a step that can be undone)",
    )
    print("  where a cycle's time goes (timed phase by phase; the timer adds a little):")
    row("  get_new_blocks(64) + 64 evictions", r["cycle:get_new_blocks"])
    row("  cache_full_blocks(64 hashes)", r["cycle:cache_full_blocks"])
    row("  free_blocks(reversed(64))", r["cycle:free_blocks"])
    print(
        f"  (the old floor, pop/append bound in advance: {r['floor (bound methods)']:.3f} us; the cycle is "
        f"{r['cycle'] / r['floor (bound methods)']:.2f} of those units)"
    )
    raw = r["raw sha256"]
    print(f"  chained block hash of {BLOCK_SIZE} tokens, per block, as the engine hashes (request block hasher,")
    print(f"  {HASH_REQUEST_BLOCKS} blocks), vs raw SHA-256 of the same bytes:")
    row("raw sha256 of encode(block)", raw, "   1.00x raw")
    for name in HASH_ALGOS:
        us = r[f"hash:{name}"]
        extra = f"   {us / raw:5.2f}x raw"
        if name == "sha256":
            extra += f"   target <= {SHA256_TARGET_RATIO:g}x: {'OK' if us / raw <= SHA256_TARGET_RATIO else 'MISSED'}"
        if name in UNSAFE_HASH_ALGOS:
            extra += "   (unsafe, teaching only)"
        row(f"hash: {name}", us, extra)
    row("pickle+sha256 (vLLM's sha256)", r["pickle+sha256 (vLLM)"], f"   {r['pickle+sha256 (vLLM)'] / raw:5.2f}x raw")
    row(
        "one-off hash_block_tokens(16 ints)",
        r["hash_block_tokens(list)"],
        f"   {r['hash_block_tokens(list)'] / raw:5.2f}x raw (packs the ints per call)",
    )
    print("  engine decode step per running request (8 requests; CPU time, median of 3), by blocks each holds:")
    held = {n: decode_step_us(n) for n in DECODE_HELD}
    for n, us in held.items():
        row(f"  decode step, {n:,} blocks held", us)
    print(f"  {'':<36} growth {DECODE_HELD[0]} -> {DECODE_HELD[-1]:,} blocks held: {held[DECODE_HELD[-1]] / held[DECODE_HELD[0]]:.2f}x")
    print(f"  ({time.perf_counter() - t0:.1f} s, pid {os.getpid()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
