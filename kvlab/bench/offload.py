"""`python -m kvlab.bench offload` -- prefix hits and TTFT with KV offload tiers (lesson 12).

A multi-turn chat trace whose working set (every conversation's history) is several times
the GPU pool: between two turns of a conversation, the other conversations push its blocks
out of the GPU pool. Without offloading, the next turn recomputes its history; with a CPU
tier (and a disk tier behind it) the history comes back as a copy. The engine is the
simulated one (scripted answers, so each turn's prompt holds what the engine generated);
the disk tier writes real files to a temporary directory. TTFT is the simulated clock's
(``CostModel``: prefill 120 us per token, loads 5.2 us per token from CPU, 44 us from
disk). Reported per run: prefix hit rate (tokens served by the GPU pool + the tiers, over
prompt tokens), the share each tier served, prefill tokens computed, mean / p50 / p90 TTFT.
vLLM offloads prompt blocks only by default (``offload_prompt_only``); the last run also
offloads the answers, which the next turn's prompt repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.transaction import unguarded
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.scripted import ScriptedExecutor
from kvlab.workloads.traces import Trace, multi_turn, percentile

if TYPE_CHECKING:
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector


@dataclass
class OffloadRun:
    name: str
    prompt_tokens: int
    gpu_hit_tokens: int
    tier_hit_tokens: dict[str, int]
    prefill_tokens: int
    ttfts: list[float]
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return (self.gpu_hit_tokens + sum(self.tier_hit_tokens.values())) / self.prompt_tokens

    def share(self, medium: str) -> float:
        return self.tier_hit_tokens.get(medium, 0) / self.prompt_tokens

    @property
    def gpu_share(self) -> float:
        return self.gpu_hit_tokens / self.prompt_tokens

    @property
    def mean_ttft(self) -> float:
        return statistics.mean(self.ttfts)

    def ttft_pct(self, q: float) -> float:
        return percentile(sorted(self.ttfts), q)


def chat_trace(num_conversations: int = 24, turns: int = 6, seed: int = 0) -> Trace:
    """The bench's workload: conversations that come back every few seconds."""
    return multi_turn(
        num_conversations, turns, seed, mean_user_len=48, mean_output=48, sigma=0.5, rate=4.0, think_time=3.0, max_model_len=2048
    )


def scripted(trace: Trace) -> ScriptedExecutor:
    """An executor that answers each turn with the trace's answer (the next turn's prompt holds it)."""
    ex = ScriptedExecutor()
    for r in trace:
        assert r.output_token_ids is not None  # multi_turn traces carry every answer
        ex.add_script(r.request_id, r.prompt_len, r.output_token_ids)
    return ex


def working_set_tokens(trace: Trace) -> int:
    """Tokens of every conversation's longest prompt: what a cache must hold to hit them all."""
    longest: dict[str | None, int] = {}
    for r in trace:
        longest[r.group] = max(longest.get(r.group, 0), r.prompt_len)
    return sum(longest.values())


def run_trace(
    trace: Trace,
    name: str,
    num_gpu_blocks: int,
    block_size: int = 16,
    cpu_blocks: int = 0,
    disk_blocks: int = 0,
    offload_prompt_only: bool = True,
    event_log: Any = None,
) -> tuple[OffloadRun, LLMEngine]:
    """One engine over ``trace``: no tiers when ``cpu_blocks`` is 0."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvlab-disk-tier-") as disk:
        cfg = None
        if cpu_blocks:
            extra: dict[str, Any] = dict(num_cpu_blocks=cpu_blocks, offload_prompt_only=offload_prompt_only)
            if disk_blocks:
                extra.update(storage_path=disk, num_storage_blocks=disk_blocks)
            cfg = KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra)
        eng = build_engine(
            num_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_batched_tokens=512,
            executor=scripted(trace),
            event_log=event_log,
            kv_transfer_config=cfg,
        )
        with unguarded(eng):  # a private engine until it is returned: if the run stops, it is dropped
            eng.run_trace(trace.to_requests())
    m = [eng.metrics[r.request_id] for r in trace]
    conn = eng.scheduler.connector
    # a connector is there only when cfg (above) named the OffloadingConnector
    tiers = dict(cast("OffloadingConnector", conn).scheduler.num_hit_tokens) if conn is not None else {}
    tier_total = sum(tiers.values())
    run = OffloadRun(
        name,
        sum(x.num_prompt_tokens for x in m),
        sum(x.num_cached_tokens for x in m) - tier_total,
        tiers,
        sum(x.prefill_tokens_computed for x in m),
        [x.ttft for x in m if x.ttft is not None],
        time.perf_counter() - t0,
    )
    return run, eng


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench offload")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--gpu-blocks", type=int, default=128)
    a = ap.parse_args(argv)
    trace = chat_trace(a.conversations, a.turns)
    bs = 16
    ws = working_set_tokens(trace)
    pool = (a.gpu_blocks - 1) * bs
    print(
        f"[offload] multi-turn trace: {len(trace)} requests, {a.conversations} conversations x {a.turns} turns, "
        f"{sum(r.prompt_len for r in trace):,} prompt tokens"
    )
    print(f"[offload] working set {ws:,} tokens = {ws / pool:.1f}x the GPU pool ({a.gpu_blocks} blocks x {bs} = {pool:,} token slots)")
    g = a.gpu_blocks
    runs = [
        run_trace(trace, "GPU pool only", g)[0],
        run_trace(trace, f"+ CPU tier ({2 * g} blocks)", g, cpu_blocks=2 * g)[0],
        run_trace(trace, f"+ CPU ({g}) + disk ({8 * g})", g, cpu_blocks=g, disk_blocks=8 * g)[0],
        run_trace(trace, f"+ CPU ({2 * g}) + disk ({8 * g})", g, cpu_blocks=2 * g, disk_blocks=8 * g)[0],
        run_trace(trace, "  same, answers offloaded too", g, cpu_blocks=2 * g, disk_blocks=8 * g, offload_prompt_only=False)[0],
    ]
    print(
        f"{'run':28} {'hit rate':>8} {'GPU':>6} {'CPU':>6} {'disk':>6} {'prefill tok':>11} {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'wall':>6}"
    )
    for r in runs:
        print(
            f"{r.name:28} {r.hit_rate:>8.1%} {r.gpu_share:>6.1%} {r.share('CPU'):>6.1%} {r.share('STORAGE'):>6.1%} "
            f"{r.prefill_tokens:>11,} {r.mean_ttft * 1e3:>7.1f}ms {r.ttft_pct(50) * 1e3:>5.1f}ms {r.ttft_pct(90) * 1e3:>5.1f}ms "
            f"{r.wall_s:>5.1f}s"
        )
    base = runs[0]
    for r in runs[1:]:
        print(
            f"[offload] {r.name}: hit rate {base.hit_rate:.1%} -> {r.hit_rate:.1%}, prefill tokens "
            f"{r.prefill_tokens / base.prefill_tokens:.2f}x, mean TTFT {r.mean_ttft / base.mean_ttft:.2f}x"
        )
