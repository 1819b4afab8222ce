"""`python -m kvlab.bench trace`: what watching the kernel's loads costs under the interpreter.

Two ratios, each measured in one run (this machine's speed drifts):

* one ``unified_attention`` call traced (:func:`kvlab.kernels.trace.traced_unified_attention`)
  versus untraced, for a lesson-sized decode batch and a prefill batch -- ms per call;
* an engine step of the tiny model with the runner's tracing on (one layer per KV-cache
  group, the default under the interpreter) versus off -- ms per step.

Under the interpreter a kernel program costs ~1.5 ms whatever it does; tracing adds a
range test per load and a few numpy operations per watched load. The goal: the runner's
tracing costs the lessons well under 25 % per step.

Times are this process's CPU time (``time.process_time``), one thread: on a machine shared
with other work, wall-clock ratios swing by ±30 % from one run to the next, CPU time far less.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import kvlab.kernels as K  # noqa: I001  (first: decides TRITON_INTERPRET before triton is imported)
import torch

from kvlab.kernels.trace import traced_unified_attention


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: the interpreter rewrites the kernel's source once
    times = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return 1000 * statistics.median(times)


def kernel_calls(reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, hq, d = 48, 16, 2, 4, 32
    kv = torch.randn(nb, 2, bs, hkv, d, generator=g)
    k, v = kv[:, 0], kv[:, 1]
    perm = torch.randperm(nb - 1, generator=g) + 1
    cases = {
        "decode, 4 seqs x 100 tokens": ([100] * 4, [1] * 4),
        "prefill, 2 seqs x 120 tokens": ([120] * 2, [120] * 2),
    }
    print(f"{'one unified_attention call':<34} {'untraced':>10} {'traced':>10} {'ratio':>7}")
    for name, (lens, qlens) in cases.items():
        per = [-(-n // bs) for n in lens]
        table = torch.zeros(len(lens), max(per), dtype=torch.int32)
        it = iter(perm.tolist())
        for s, n in enumerate(per):
            for j in range(n):
                table[s, j] = next(it)
        q = torch.randn(sum(qlens), hq, d, generator=g)
        cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(qlens), 0).tolist()), dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        plain = _median_ms(lambda: K.unified_attention(q, k, v, cu, seq_lens, table, d**-0.5), reps)
        traced = _median_ms(lambda: traced_unified_attention(q, k, v, cu, seq_lens, table, d**-0.5), reps)
        print(f"{name:<34} {plain:8.1f} ms {traced:8.1f} ms {traced / plain:6.2f}x")


def engine_steps(reps: int) -> None:
    from kvlab import EventLog, KVCacheManager, Request
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.model_runner import ModelRunner
    from kvlab.worker.tokenizer import ByteTokenizer

    tok, model = ByteTokenizer(), TinyLlama(seed=0)

    def run(trace: bool) -> float:
        log = EventLog()
        mgr = KVCacheManager(num_blocks=16, block_size=8, event_log=log)
        runner = ModelRunner(model, event_log=log, trace_reads=trace)
        eng = LLMEngine(mgr, Scheduler(mgr), runner, tokenizer=tok)
        for i, p in enumerate(("The KV cache grows", "One token at a time, please")):
            eng.add_request(Request(f"g{i}", tok.encode(p), max_tokens=16))
        t = time.process_time()
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        return 1000 * (time.process_time() - t) / steps

    run(False)  # warm-up
    off = statistics.median(run(False) for _ in range(reps))
    on = statistics.median(run(True) for _ in range(reps))
    print(f"{'lesson 00 engine step (2 layers)':<34} {off:8.1f} ms {on:8.1f} ms {on / off:6.2f}x   (tracing 1 of 2 layers)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench trace", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("trace benchmark: the cost of observing the attention kernel's loads (CPU ms, median)")
    if not K.INTERPRET:
        print("compiled Triton (CUDA): loads cannot be traced; kvlab.kernels.trace.probe_reads_nan observes them")
        return
    kernel_calls(opts.reps)
    engine_steps(max(1, opts.reps // 2))
