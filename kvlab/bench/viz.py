"""``python -m kvlab.bench viz``: how fast the Player jumps and redraws.

Two measurements, each printed as ratios taken in one run (this machine's speed drifts):

* **Jumps** (the slider). A 1,000-request run on a small pool (hits, preemptions; about
  50,000 events over about 1,400 steps). Against one full ``replay(log)`` (median of a few):
  building the ``Timeline`` plus its slowest jump (every step visited once, in random
  order, on a fresh timeline) must stay <= 3 x, the median jump <= 0.25 x (aim: <= 50 ms).
* **Redraws** (Play / Step). 64 requests with shared system prompts on a 2,000-block pool;
  a ``Player`` with every view steps through the run; one redraw = every view's
  ``update`` on a cached snapshot, median over steps (target <= 200 ms on a laptop CPU).
* **In the browser** (``--browser``, needs Debian's Chromium and playwright). The capstone's
  run (lesson 09) in the Player's own renderer, in headless Chromium: click to redraw, as the
  browser's Event Timing measures it (from the click to the next paint), for Step ▶ and
  ◀ Back at a learner's pace (target <= 50 ms at p90), and first display, as two parts: the
  kernel packing the first step for the page, and the page loading plotly.js and drawing it
  (target <= 3 s together).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.eventlog.events import RequestPreempted
from kvlab.request import Request
from kvlab.timeline.timeline import Timeline, replay

BUILD_PLUS_SLOWEST_MAX = 3.0  # x one full replay
MEDIAN_JUMP_MAX = 0.25  # x one full replay
MEDIAN_JUMP_AIM_MS = 50.0
REDRAW_TARGET_MS = 200.0
CLICK_TARGET_MS = 50.0
FIRST_DISPLAY_TARGET_S = 3.0
CHROMIUM = "/usr/bin/chromium"


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


def long_run(num_requests: int = 1000, num_blocks: int = 64, seed: int = 0) -> LLMEngine:
    """Many short requests through a small pool: a long log with hits and preemptions."""
    rng = random.Random(seed)
    engine = build_engine(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=512, max_num_seqs=16)
    systems = [[rng.randrange(32000) for _ in range(rng.choice((16, 32, 64)))] for _ in range(4)]
    for i in range(num_requests):
        prompt = systems[i % len(systems)] + [rng.randrange(32000) for _ in range(rng.randrange(8, 96))]
        engine.add_request(Request(f"r{i:04d}", prompt, max_tokens=rng.randrange(4, 32), arrival_time=float(i)))
    engine.run()
    return engine


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_jumps(num_requests: int, rounds: int = 5) -> dict[str, float]:
    engine = long_run(num_requests)
    log = engine.events
    assert log is not None
    replays, builds = [], []
    for _ in range(rounds):  # interleaved, so that drift hits both alike
        gc.collect()
        replays.append(_timed(lambda: replay(log)))
        gc.collect()
        builds.append(_timed(lambda: Timeline(log)))
    t_replay, t_build = statistics.median(replays), statistics.median(builds)
    gc.collect()
    timeline = Timeline(log)
    steps = timeline.steps
    first_late = _timed(lambda: timeline.at(steps[-1] - 1))
    order = list(steps)
    random.Random(1).shuffle(order)
    jumps = [_timed(lambda s=s: timeline.at(s)) for s in order]
    slowest, median = max(jumps + [first_late]), statistics.median(jumps)
    r_slow, r_med = (t_build + slowest) / t_replay, median / t_replay
    preemptions = timeline.series.num_preemptions[-1]
    print(f"[viz] jumps: {num_requests} requests, {len(log)} events, {len(steps)} steps, {preemptions} preemptions")
    print(
        f"[viz]   one full replay {1000 * t_replay:.1f} ms; Timeline built in {1000 * t_build:.1f} ms "
        f"(medians of {rounds}); first jump to step {steps[-1] - 1}: {1000 * first_late:.2f} ms"
    )
    print(
        f"[viz]   build + slowest jump = {r_slow:.2f} x replay (target <= {BUILD_PLUS_SLOWEST_MAX:g}) -> "
        f"{'OK' if r_slow <= BUILD_PLUS_SLOWEST_MAX else 'SLOW'}"
    )
    print(
        f"[viz]   median jump {1000 * median:.2f} ms = {r_med:.4f} x replay (target <= {MEDIAN_JUMP_MAX:g}, aim <= "
        f"{MEDIAN_JUMP_AIM_MS:g} ms) -> {'OK' if r_med <= MEDIAN_JUMP_MAX and 1000 * median <= MEDIAN_JUMP_AIM_MS else 'SLOW'}"
        f"; slowest {1000 * slowest:.2f} ms over {len(jumps)} jumps in random order"
    )
    return {
        "replay_ms": 1000 * t_replay,
        "build_ms": 1000 * t_build,
        "slowest_jump_ms": 1000 * slowest,
        "median_jump_ms": 1000 * median,
        "build_plus_slowest_x": r_slow,
        "median_jump_x": r_med,
    }


def bench_redraw(num_blocks: int, num_requests: int, max_steps: int) -> dict[str, float]:
    t0 = time.perf_counter()
    engine, num_steps = build_run(num_blocks, num_requests)
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
    stride = max(1, len(steps) // max_steps)
    chosen = steps[::stride][:max_steps]
    per_view: dict[str, list[float]] = {name: [] for name in player.views}
    totals: list[float] = []
    for i, s in enumerate(chosen):
        snap = timeline.at(s)
        sel = f"r{i % num_requests:02d}" if i % 2 else None
        t_all = time.perf_counter()
        for name, v in player.views.items():
            t = time.perf_counter()
            v.update(snap, sel)
            per_view[name].append((time.perf_counter() - t) * 1000)
        totals.append((time.perf_counter() - t_all) * 1000)
    snap = timeline.at(chosen[len(chosen) // 2])
    med = statistics.median(totals)
    print(
        f"[viz] redraws: pool {num_blocks} blocks, {num_requests} requests, {num_steps} engine steps "
        f"(run {t_run:.2f} s, snapshot {t_replay * 1000:.1f} ms/step, player built in {t_build:.2f} s)"
    )
    print(
        f"[viz]   mid-run snapshot: {len(snap.running)} running, {len(snap.hash_nodes)} cached hashes, {len(snap.free_queue)} free blocks"
    )
    print(
        f"[viz]   redraw of all views: median {med:.1f} ms, p90 {sorted(totals)[int(0.9 * (len(totals) - 1))]:.1f} ms "
        f"over {len(totals)} steps (target <= {REDRAW_TARGET_MS:g} ms) -> {'OK' if med <= REDRAW_TARGET_MS else 'SLOW'}"
    )
    for name, ts in per_view.items():
        print(f"[viz]     {name:<9} {statistics.median(ts):7.1f} ms")
    return {"median_ms": med, **{f"{k}_ms": statistics.median(v) for k, v in per_view.items()}}


def capstone_run() -> LLMEngine:
    """Lesson 09's workload: chat, document QA and long requests through a 64-block pool."""
    from kvlab.workloads.traces import document_qa, shared_system_prompt_chat, sharegpt_like

    chat = shared_system_prompt_chat(10, seed=11, system_prompt_len=64, mean_user_len=24, mean_output=40, rate=3.0)
    docs = document_qa(2, 4, seed=12, doc_len=160, mean_question_len=16, mean_output=24, rate=3.0)
    longs = sharegpt_like(3, seed=13, rate=0.5, mean_input=360, input_sigma=0.15, mean_output=120, output_sigma=0.3, max_model_len=1024)
    engine = build_engine(num_blocks=64, block_size=16, max_num_batched_tokens=256)
    engine.run_trace(sorted((r.to_request() for t in (chat, docs, longs) for r in t), key=lambda r: r.arrival_time))
    return engine


# In the page: when the body first gets its data-step (the first picture is drawn), and the
# browser's own Event Timing of each click: from the click to the next paint after it
# (entries under 16 ms are not reported: they count as 16).
_INIT = """new MutationObserver((_, obs) => { if (document.body && document.body.dataset.step !== undefined) {
  window.__kvFirstDraw = performance.now(); obs.disconnect(); } }).observe(document, {subtree: true, attributes: true});
window.__kvClicks = [];
new PerformanceObserver(l => { for (const e of l.getEntries()) if (e.name === 'click') window.__kvClicks.push(e.duration); })
  .observe({type: 'event', durationThreshold: 16, buffered: true});"""


def _clicks(page: Any, selector: str, n: int, pause_ms: int) -> list[float]:
    """``n`` real clicks on ``selector`` at a learner's pace; each one's click-to-paint time."""
    page.evaluate("() => { window.__kvClicks = []; }")
    for _ in range(n):
        page.wait_for_timeout(pause_ms)
        page.click(selector)
    page.wait_for_timeout(pause_ms)
    got = page.evaluate("() => window.__kvClicks")
    return [float(x) for x in got] + [16.0] * (n - len(got))


def _changes(page: Any, selector: str, values: list[str], pause_ms: int, event: str = "change") -> list[float]:
    """Set ``selector``'s value to each of ``values`` in turn, as its menu or slider would, and
    time each from the event to the next frame's start, when the browser paints what the
    renderer drew (Event Timing sees only real input, and a real menu pick cannot be
    scripted). The neighbouring steps drawn behind the view afterwards are not counted: they
    run after that paint."""
    out = []
    for v in values:
        page.wait_for_timeout(pause_ms)
        out.append(
            float(
                page.evaluate(
                    """async ([sel, v, ev]) => { const e = document.querySelector(sel), t0 = performance.now();
                    e.value = v; e.dispatchEvent(new Event(ev));
                    await new Promise(r => requestAnimationFrame(() => r()));
                    return performance.now() - t0; }""",
                    [selector, v, event],
                )
            )
        )
    return out


def bench_browser(clicks: int = 20, pause_ms: int = 800) -> dict[str, float]:
    import os
    import tempfile

    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:  # pragma: no cover
        raise SystemExit("--browser needs playwright (pip install 'kvlab[dev]')") from e
    if not os.path.exists(CHROMIUM):
        raise SystemExit(f"--browser needs Debian's Chromium at {CHROMIUM} (apt-get install chromium)")
    from kvlab.show import export_html
    from kvlab.viz import Player
    from kvlab.viz.frames import FramePacker

    engine = capstone_run()
    assert engine.events is not None
    start = next(e.step for e in engine.events.of_type(RequestPreempted))
    player = Player(engine.events, start=start)
    t0 = time.perf_counter()
    FramePacker(player._figures_at).pack([start])
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    FramePacker(player._figures_at).pack(list(range(start - 2, start + 9)))
    t_window = time.perf_counter() - t0
    player._figures_done()
    with tempfile.TemporaryDirectory() as tmp:
        path = export_html(player, os.path.join(tmp, "capstone.html"))
        size_mb = path.stat().st_size / 1e6
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking", "--disable-sync"],
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.add_init_script(_INIT)
                page.goto(path.as_uri())
                page.wait_for_function("() => window.__kvFirstDraw !== undefined", timeout=120_000)
                first_draw_ms = page.evaluate("() => window.__kvFirstDraw")
                steps = _clicks(page, "#kv-next", clicks, pause_ms)
                backs = _clicks(page, "#kv-back", clicks // 2, pause_ms)
                picks = _changes(page, "#kv-request", (player.timeline.request_ids[:8] + [""]) * 2, pause_ms)
                here = int(page.evaluate("() => document.getElementById('kv-slider').value"))
                far = [str((here + 37 * (i + 1)) % len(player.timeline.steps)) for i in range(6)]
                jumps = _changes(page, "#kv-slider", far, pause_ms, event="input")
            finally:
                browser.close()

    def stats(xs: list[float]) -> tuple[float, float]:
        return statistics.median(xs), sorted(xs)[int(0.9 * (len(xs) - 1))]

    med, p90 = stats(steps)
    bmed, bp90 = stats(backs)
    first_s = t_first + first_draw_ms / 1000
    print(f"[viz] in the browser: the capstone run ({len(player.timeline.steps)} steps, 6 views), headless Chromium")
    print(
        f"[viz]   click to redraw (Event Timing: click to next paint), one click every {pause_ms} ms from step {start}: "
        f"Step {med:.0f} ms median, {p90:.0f} ms p90 ({clicks} clicks); Back {bmed:.0f} / {bp90:.0f} ms ({clicks // 2}) "
        f"(target <= {CLICK_TARGET_MS:g} ms) -> {'OK' if max(p90, bp90) <= CLICK_TARGET_MS else 'SLOW'}"
    )
    pmed, pp90 = stats(picks)
    jmed, jp90 = stats(jumps)
    print(
        f"[viz]   picking a request in the menu (no kernel: the page applies the request's patches): {pmed:.0f} ms median, "
        f"{pp90:.0f} ms p90 ({len(picks)} picks); a slider jump to a step not drawn in advance: {jmed:.0f} / {jp90:.0f} ms "
        f"({len(jumps)} jumps; from the event to the next frame)"
    )
    print(
        f"[viz]   first display: kernel packs the first step {1000 * t_first:.0f} ms (a window of 11 steps {1000 * t_window:.0f} ms); "
        f"page loads plotly.js and draws it {first_draw_ms:.0f} ms after navigation ({size_mb:.1f} MB page); "
        f"together {first_s:.2f} s (target <= {FIRST_DISPLAY_TARGET_S:g} s) -> {'OK' if first_s <= FIRST_DISPLAY_TARGET_S else 'SLOW'}"
    )
    return {
        "step_median_ms": med,
        "step_p90_ms": p90,
        "back_median_ms": bmed,
        "pick_median_ms": pmed,
        "jump_median_ms": jmed,
        "first_step_pack_ms": 1000 * t_first,
        "first_draw_ms": first_draw_ms,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench viz", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests of the jump benchmark's run (default 1000)")
    ap.add_argument("--blocks", type=int, default=2000, help="pool of the redraw benchmark (default 2000)")
    ap.add_argument("--redraw-requests", type=int, default=64, help="requests of the redraw benchmark (default 64)")
    ap.add_argument("--max-steps", type=int, default=60, help="redraws to time (spread over the run)")
    ap.add_argument("--no-redraw", action="store_true", help="only the jump benchmark (no plotly needed)")
    ap.add_argument("--browser", action="store_true", help="only the browser benchmark (Chromium: click to redraw, first display)")
    args = ap.parse_args(argv)
    if args.blocks < 2 or args.requests < 1 or args.redraw_requests < 1 or args.max_steps < 1:
        ap.error("--blocks must be >= 2; --requests, --redraw-requests and --max-steps >= 1")
    if args.browser:
        return bench_browser()
    out = bench_jumps(args.requests)
    if not args.no_redraw:
        out.update(bench_redraw(args.blocks, args.redraw_requests, args.max_steps))
    return out


if __name__ == "__main__":
    main()
