"""``python -m kvlab.bench routing`` -- the routing table of lesson 11, measured end to end.

Four kvlab engine processes (``kvlab.entrypoints.kv_server``) publish vLLM's KV events over
ZeroMQ on loopback; a router in this process reads the four streams and replays two traces
(``kvlab.routing.fleet.standard_traces``: multi-tenant, multi-turn) in lock step under four
policies: round-robin, least-loaded, KV-aware (longest cached prefix) and KV-aware with a
load term. Printed, all from this one run:

* the table: prefix-cache hit rate, simulated TTFT (mean, p50, p90 on each replica's cost-
  model clock), prefill imbalance (busiest replica's prefill work / the mean) and requests
  per replica -- the numbers are deterministic (lock step), only the wall times drift;
* how often the router predicted a request's cached tokens exactly from the streams;
* the processes' start-up and stop times and each run's wall time, with gaps seen (and
  recovered) on the event streams.
"""

from __future__ import annotations

import argparse
import time

from kvlab.routing.fleet import STANDARD_ENGINE, STANDARD_REPLICAS, Fleet, compare, format_table, standard_policies, standard_traces


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench routing")
    ap.add_argument("--replicas", type=int, default=STANDARD_REPLICAS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="only the first N requests of each trace (a smoke run; the table is then not lesson 11's)",
    )
    args = ap.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    traces = standard_traces(args.seed)
    if args.requests is not None:
        traces = {name: tr[: args.requests] for name, tr in traces.items()}
    for name, tr in traces.items():
        print(f"[routing] {name}: {tr.summary().splitlines()[0]}")
    t0 = time.perf_counter()
    fleet = Fleet(args.replicas, engine=STANDARD_ENGINE)
    try:
        per = ", ".join(f"{s:.2f}" for s in fleet.replica_startup_s)
        print(
            f"[routing] {args.replicas} replica processes ready in {fleet.startup_s:.2f} s (each, spawn -> ready: {per} s); "
            f"engine {STANDARD_ENGINE}, hash sha256_cbor"
        )
        results = compare(traces, standard_policies(), fleet=fleet)
    finally:
        stop_s = fleet.stop()
    print(format_table(results))
    for r in results:
        gaps = f", {len(r.gaps)} gaps ({sum(g.recovered for g in r.gaps)} batches replayed)" if r.gaps else ", no gaps"
        print(
            f"[routing] {r.trace:12} {r.policy:20} router predicted the cached tokens exactly for {r.prediction_exact:.1%} "
            f"of requests; {r.wall_s:.2f} s wall{gaps}"
        )
    print(f"[routing] stopping {args.replicas} processes: {stop_s:.2f} s; everything: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
