"""`python -m kvlab.bench events` -- how fast vLLM's KV-event stream is written and read.

The stream comes from a real run: a KVCacheManager with ``enable_kv_cache_events=True``
serves a seeded workload of requests that share prefixes (a few system prompts, random
continuations, 16-token blocks), so the batches hold the mix a router sees: BlockStored
runs, BlockRemoved per evicted block, int hashes. One batch per "step" of 8 requests.

Printed, each from this one run (minimum over the repeats; this machine's speed drifts):

* decode rate of ``kv_events.decode_batch`` in events/s -- target >= 100,000 events/s,
  what a router must sustain to follow a busy engine (lesson 11's routers read these);
* the same for ``encode_batch`` and for ``CacheIndex.apply`` (decode + index update);
* the cost of producing the events: the manager's allocate/free cycle with events on, as a
  ratio to the same cycle with events off;
* **over ZeroMQ, end to end**: the same batches published by vLLM's publisher
  (``ZmqEventPublisher``: encode, PUB socket) in *another process* and read by a
  ``Subscriber`` here (SUB socket, seq check, decode) over loopback TCP -- events/s from the
  first batch received to the last, plus the publisher's start-up. Both processes share this
  machine's cores, as a router and an engine on one host would.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import random
import time
from collections.abc import Callable

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.distributed.kv_events import CacheIndex, KVEventBatch, decode_batch, encode_batch
from kvlab.distributed.kv_subscriber import Subscriber
from kvlab.request import Request

DECODE_TARGET_EVENTS_PER_S = 100_000
BLOCK_SIZE = 16


def _workload(n_requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(rng.choice((64, 128, 256)))] for _ in range(6)]
    return [rng.choice(prefixes) + [rng.randrange(32000) for _ in range(rng.randrange(8, 200))] for _ in range(n_requests)]


def _serve(prompts: list[list[int]], events: bool) -> tuple[KVCacheManager, list[KVEventBatch]]:
    mgr = KVCacheManager(num_blocks=400, block_size=BLOCK_SIZE, enable_kv_cache_events=events, log_stats=False)
    batches: list[KVEventBatch] = []
    running: list[Request] = []
    for n, toks in enumerate(prompts):
        r = Request(f"r{n}", toks)
        hits, k = mgr.get_computed_blocks(r)
        if mgr.allocate_slots(r, r.num_tokens - k, k, hits) is None:
            for old in running:
                mgr.free(old)
            running.clear()
            hits, k = mgr.get_computed_blocks(r)
            mgr.allocate_slots(r, r.num_tokens - k, k, hits)
        r.num_computed_tokens = r.num_tokens
        running.append(r)
        if len(running) > 12:
            mgr.free(running.pop(0))
        if events and n % 8 == 7:
            batches.append(KVEventBatch(ts=float(n), events=mgr.take_events(), data_parallel_rank=0))
    return mgr, batches


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _publish_worker(endpoint: str, payloads: list[bytes], ready: "mp.synchronize.Event", go: "mp.synchronize.Event") -> None:
    """The engine side, in a child process: publish every batch through vLLM's publisher."""
    from kvlab.distributed.kv_publisher import ZmqEventPublisher

    batches = [decode_batch(p) for p in payloads]
    with ZmqEventPublisher(endpoint=endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="bench") as pub:
        ready.set()
        go.wait(30)
        for b in batches:
            pub.publish(b)
        pub.flush(60.0)
        time.sleep(0.5)  # let the subscriber drain before the sockets close


def zmq_end_to_end(payloads: list[bytes], n_events: int, timeout_s: float = 60.0) -> dict[str, float]:
    """Publish ``payloads`` from a child process, receive them here; rates and times."""
    ctx = mp.get_context("spawn")
    sub = Subscriber("tcp://127.0.0.1:0", topic="bench", bind=True)
    ready, go = ctx.Event(), ctx.Event()
    t_start = time.perf_counter()
    proc = ctx.Process(target=_publish_worker, args=(sub.endpoint, payloads, ready, go), daemon=True)
    proc.start()
    try:
        if not ready.wait(timeout_s):
            raise TimeoutError(f"the publisher process was not ready within {timeout_s} s")
        startup = time.perf_counter() - t_start
        sub.poll(0.2)  # the child has connected; a bound SUB attaches it while polling
        go.set()
        first = last = None
        got = events = 0
        for _, b in sub.receive(timeout_s=5.0, until_seq=len(payloads) - 1):
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            got += 1
            events += len(b.events)
        proc.join(timeout=10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        sub.close()
    span = (last - first) if first is not None and last is not None and last > first else float("nan")
    return dict(
        batches=got,
        events=events,
        rate=(events - (events / max(got, 1))) / span if got > 1 else float("nan"),
        startup_s=startup,
        lost=sub.stats["lost"],
        gaps=len(sub.gaps),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench events")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zmq-copies", type=int, default=5, help="the stream is sent this many times over ZeroMQ")
    args = ap.parse_args(argv)

    prompts = _workload(args.requests, args.seed)
    _, batches = _serve(prompts, events=True)
    payloads = [encode_batch(b) for b in batches]
    n_events = sum(len(b.events) for b in batches)
    kinds: dict[str, int] = {}
    for b in batches:
        for e in b.events:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    n_bytes = sum(map(len, payloads))
    print(f"[events] stream: {len(batches)} batches, {n_events} events {kinds}, {n_bytes / n_events:.0f} bytes/event")

    t_dec = _best(lambda: [decode_batch(p) for p in payloads], args.repeats)
    t_enc = _best(lambda: [encode_batch(b) for b in batches], args.repeats)
    t_idx = _best(lambda: [CacheIndex().apply(p) for p in payloads], args.repeats)
    dec_rate = n_events / t_dec
    print(
        f"[events] decode_batch: {dec_rate:,.0f} events/s "
        f"(target >= {DECODE_TARGET_EVENTS_PER_S:,}: {dec_rate / DECODE_TARGET_EVENTS_PER_S:.1f}x the target)"
    )
    print(f"[events] encode_batch: {n_events / t_enc:,.0f} events/s; decode + CacheIndex.apply: {n_events / t_idx:,.0f} events/s")

    t_off = _best(lambda: _serve(prompts, events=False), max(2, args.repeats // 2))
    t_on = _best(lambda: _serve(prompts, events=True), max(2, args.repeats // 2))
    print(f"[events] serving the workload with events on / off: {t_on / t_off:.2f}x ({t_on * 1e3:.0f} ms vs {t_off * 1e3:.0f} ms)")

    stream = payloads * args.zmq_copies
    best: dict[str, float] | None = None
    for _ in range(max(1, args.repeats // 2)):
        r = zmq_end_to_end(stream, n_events * args.zmq_copies)
        if best is None or r["rate"] > best["rate"]:
            best = r
    assert best is not None
    print(
        f"[events] over ZeroMQ end to end (publisher process -> loopback TCP -> Subscriber here): {best['rate']:,.0f} events/s "
        f"({best['rate'] / DECODE_TARGET_EVENTS_PER_S:.1f}x the target; {best['batches']:.0f} batches, {best['events']:,.0f} events, "
        f"{best['gaps']:.0f} gaps, {best['lost']:.0f} lost); publisher process start-up {best['startup_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
