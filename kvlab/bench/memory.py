"""`python -m kvlab.bench memory`: the PagedAttention paper's Fig. 2, re-measured.

One run replays a ShareGPT-like trace (``kvlab.workloads.traces.sharegpt_like``) through the
contiguous Orca-style strategies and the paged cache at several block sizes, all in the
same KV capacity (``kvlab.workloads.memory_sim``), and prints our shares and batch sizes beside the paper's.
Everything is simulated memory bookkeeping, so the run is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import time

from kvlab.workloads.memory_sim import SimResult, compare, format_table
from kvlab.workloads.traces import sharegpt_like

# Capacity in token slots, mirroring the paper's OPT-13B on one A100-40GB:
#   KV per token  = 2 (K and V) x 5120 (hidden) x 40 (layers) x 2 B (FP16) = 819,200 B = 800 KiB
#   GPU memory    = 40 GiB; FP16 weights of ~13 B parameters ~ 24 GiB; activations, CUDA
#                   context and workspace ~ 4 GiB (our assumption, not a paper figure)
#   left for KV   ~ 12 GiB -> 12 GiB / 800 KiB = 15,728 slots
# rounded down to 61 x 256 = 15,616 so that every block size up to 256 divides it (no
# slot is lost to a partial block). 15,616 slots hold 7 reservations of 2,048 (Max) with
# 1,280 slots to spare.
KV_BYTES_PER_TOKEN = 2 * 5120 * 40 * 2
CAPACITY_TOKENS = 15_616

# PagedAttention paper (Kwon et al., SOSP 2023): Fig. 2 shares (token states /
# reservation / internal / external, % of KV memory, OPT-13B) and average batched
# requests (OPT-13B, ShareGPT at 2 req/s). vLLM's bar gives only its token states.
PAPER_SHARES = {
    "max": (20.4, 13.3, 57.3, 8.9),
    "pow2": (26.8, 17.9, 13.6, 41.6),
    "oracle": (38.2, 25.2, None, 36.6),
    "paged": (96.3, None, None, None),
}
PAPER_BATCH = {"max": 7.00, "pow2": 9.81, "oracle": 13.62, "paged": 30.42}
NAMES = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}


def _name(r: SimResult) -> str:
    return NAMES.get(r.strategy, f"paged, block {r.block_size}")


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench memory", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="requests in the trace (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    ap.add_argument(
        "--rate",
        type=float,
        default=10.0,
        help="Poisson arrival rate, req/s (default 10: faster than any strategy serves, "
        "so every strategy runs with a backlog; the paper's batch sizes are at 2)",
    )
    ap.add_argument("--capacity", type=int, default=CAPACITY_TOKENS, help="KV capacity in token slots")
    ap.add_argument("--step-seconds", type=float, default=0.04, help="seconds per engine step (default 0.04)")
    ap.add_argument("--block-sizes", default="8,16,32,64", help="paged block sizes, comma-separated")
    return ap.parse_args(argv)


def main(argv: list[str]) -> None:
    args = _parse(argv)
    t0 = time.perf_counter()
    try:
        block_sizes = tuple(int(b) for b in args.block_sizes.split(","))
        if 16 not in block_sizes:
            block_sizes += (16,)  # the concurrency ratio is quoted for the paper's block size (CacheConfig's default, 16)
        trace = sharegpt_like(args.n, args.seed, rate=args.rate)
        rows = compare(trace, args.capacity, block_sizes=block_sizes, step_seconds=args.step_seconds)
    except (TypeError, ValueError) as e:  # bad flags: say which, without a traceback
        raise SystemExit(f"python -m kvlab.bench memory: error: {e}") from None
    elapsed = time.perf_counter() - t0
    by_label = {r.label: r for r in rows}
    paged16, orca_max = by_label["paged(16)"], by_label["max"]

    gib = args.capacity * KV_BYTES_PER_TOKEN / 2**30
    print("== memory: where KV memory goes (PagedAttention paper, Fig. 2) ==")
    print(trace.summary())
    print(
        f"capacity {args.capacity:,} token slots x {KV_BYTES_PER_TOKEN // 1024} KiB = {gib:.1f} GiB of KV "
        f"(OPT-13B on an A100-40GB); Poisson {args.rate:g} req/s, {args.step_seconds:g} s/step"
    )
    print("shares are % of capacity, averaged over the steps with a waiting backlog\n")

    print("KV memory holding token states     kvlab    paper")
    for r in rows:
        paper = PAPER_SHARES[r.strategy][0] if r.block_size in (None, 16) else None
        note = "  (vLLM)" if r.block_size == 16 else ""
        print(f"  {_name(r):<28} {r.token_states_pct:7.1f} %  {_fmt(paper):>5}{' %' if paper else ''}{note}")

    print("\nFull breakdown (kvlab)")
    print(format_table(rows))
    print("\nPaper, Fig. 2 (token states / reservation / internal / external)")
    for key in ("max", "pow2", "oracle", "paged"):
        label = NAMES.get(key, "vLLM")
        print(f"  {label:<14} " + " / ".join(_fmt(x) for x in PAPER_SHARES[key]))

    print("\nRequests running at once, average (paper: avg batched requests at 2 req/s)")
    for r in rows:
        if r.block_size not in (None, 16):
            continue
        print(f"  {_name(r):<28} {r.avg_running:7.2f}   paper {PAPER_BATCH[r.strategy]:5.2f}")
    ratio = paged16.avg_running / orca_max.avg_running
    paper_ratio = PAPER_BATCH["paged"] / PAPER_BATCH["max"]
    print(f"  paged(16) / Max = {ratio:.2f}x in equal memory   (paper vLLM / Orca Max = {paper_ratio:.2f}x)")

    checks = [
        (f"paged(16) token states >= 96 %: {paged16.token_states_pct:.1f}", paged16.token_states_pct >= 96),
        (f"Max token states <= 40 %: {orca_max.token_states_pct:.1f}", orca_max.token_states_pct <= 40),
        (f"paged(16) / Max concurrency >= 2.5x: {ratio:.2f}", ratio >= 2.5),
    ]
    print("\nTargets")
    for text, ok in checks:
        print(f"  [{'ok' if ok else 'MISS'}] {text}")
    print("\nNotes: Max lands close to the paper. For Pow2 and Oracle our first-fit allocator strands less")
    print("memory between reservations than the paper measured (external 41.6 / 36.6 %), so their token")
    print("states come out higher; the order Max < Pow2 < Oracle << paged is the same. Paged preemptions")
    print("are vLLM-style recomputes of the newest request when blocks run out under a backlog.")
    print(f"\n{len(rows)} simulations of {len(trace)} requests in {elapsed:.2f} s (trace generation included)")
