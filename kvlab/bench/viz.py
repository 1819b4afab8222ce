"""``python -m kvlab.bench viz``: how fast the player redraws on a big pool.

The player must feel instant when a learner presses Step or Play, also on a realistic
pool. This benchmark runs 64 requests (a few shared system prompts, so the hash forest
and shared blocks are non-trivial) on a 2,000-block pool, then steps a ``Player`` with
every view through the run and reports the time of one redraw -- the snapshot lookup plus
every view's ``update`` -- as the median over steps (target: <= 200 ms on a laptop CPU).
Snapshots are built (and cached) by a first pass, so the figure measures drawing, and the
replay cost is reported separately.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from kvlab.engine.llm_engine import build_engine
from kvlab.request import Request
from kvlab.timeline.snapshot import Timeline


def build_run(num_blocks: int, num_requests: int, seed: int = 0):
    """A finished engine run with shared prefixes, preemption-free, on ``num_blocks``."""
    rng = random.Random(seed)
    engine = build_engine(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=4096, max_num_seqs=num_requests)
    systems = [[rng.randrange(32000) for _ in range(rng.choice((64, 128, 256)))] for _ in range(4)]
    for i in range(num_requests):
        prompt = systems[i % len(systems)] + [rng.randrange(32000) for _ in range(rng.randrange(16, 400))]
        engine.add_request(Request(f"r{i:02d}", prompt, max_tokens=rng.randrange(8, 48), arrival_time=float(i)))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return engine, steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench viz", description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2000, help="pool size (default 2000)")
    ap.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    ap.add_argument("--max-steps", type=int, default=60, help="redraws to time (spread over the run)")
    args = ap.parse_args(argv)
    if args.blocks < 2 or args.requests < 1:
        ap.error("--blocks must be >= 2 and --requests >= 1")

    t0 = time.perf_counter()
    engine, num_steps = build_run(args.blocks, args.requests)
    t_run = time.perf_counter() - t0
    assert engine.events is not None
    timeline = Timeline(engine.events)
    t0 = time.perf_counter()
    for s in timeline.steps:
        timeline.at(s)
    t_replay = (time.perf_counter() - t0) / len(timeline.steps)

    import plotly.graph_objects as go

    from kvlab.viz import Player

    go.FigureWidget()  # the first FigureWidget imports plotly's widget stack (seconds): not the player's cost
    t0 = time.perf_counter()
    player = Player(timeline)
    t_build = time.perf_counter() - t0
    steps = timeline.steps
    stride = max(1, len(steps) // args.max_steps)
    chosen = steps[::stride][: args.max_steps]
    per_view: dict[str, list[float]] = {name: [] for name in player.views}
    totals: list[float] = []
    for i, s in enumerate(chosen):
        snap = timeline.at(s)
        sel = f"r{i % args.requests:02d}" if i % 2 else None
        t_all = time.perf_counter()
        for name, v in player.views.items():
            t = time.perf_counter()
            v.update(snap, sel)
            per_view[name].append((time.perf_counter() - t) * 1000)
        totals.append((time.perf_counter() - t_all) * 1000)
    snap = timeline.at(chosen[len(chosen) // 2])
    med = statistics.median(totals)
    print(f"[viz] pool {args.blocks} blocks, {args.requests} requests, {num_steps} engine steps "
          f"(run {t_run:.2f} s, replay {t_replay * 1000:.1f} ms/step, player built in {t_build:.2f} s)")
    print(f"[viz] mid-run snapshot: {len(snap.running)} running, {len(snap.hash_nodes)} cached hashes, "
          f"{len(snap.free_queue)} free blocks")
    print(f"[viz] redraw of all views: median {med:.1f} ms, p90 {sorted(totals)[int(0.9 * (len(totals) - 1))]:.1f} ms "
          f"over {len(totals)} steps (target <= 200 ms) -> {'OK' if med <= 200 else 'SLOW'}")
    for name, ts in per_view.items():
        print(f"[viz]   {name:<9} {statistics.median(ts):7.1f} ms")
    return {"median_ms": med, **{f"{k}_ms": statistics.median(v) for k, v in per_view.items()}}


if __name__ == "__main__":
    main()
