"""`python -m kvlab.bench engine` — the paged engine end to end on the default tiny model.

Scheduler + KV-cache manager + ModelRunner + Triton kernels (interpreted without a GPU)
generate ``--max-tokens`` tokens for each of ``--prompts`` prompts of ``--prompt-len``
tokens. Reports wall time, tokens/s, and the time per engine step split into prefill
steps (any request fed more than one token) and pure decode steps. ``--check`` also
compares every generated token with the dense, cache-free forward.

The sizing target for the default model: 4 prompts x 100 tokens, 32 tokens each, within
about 20 s on a 2-core CPU under the interpreter, so lessons that run the real engine stay
interactive.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.output import SchedulerOutput
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine
from kvlab.worker.model import TinyLlama, TinyLlamaConfig
from kvlab.worker.model_runner import ModelRunner
from kvlab.worker.tokenizer import ByteTokenizer

TARGET_S = 20.0
_TEXT = (
    "Blocks, not buffers: the KV cache is cut into fixed-size pages, a block table maps each "
    "request's logical blocks to physical ones, and identical prefixes share their blocks. "
)


@dataclass
class _TimedExecutor:
    """Wraps the runner to time each step and tell prefill steps from decode steps."""

    runner: ModelRunner
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    writes_kv_cache: bool = True  # the runner writes K/V into the blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        t0 = time.perf_counter()
        out = self.runner.execute_model(scheduler_output)
        dt = time.perf_counter() - t0
        if scheduler_output.total_num_scheduled_tokens:
            is_prefill = any(n > 1 for n in scheduler_output.num_scheduled_tokens.values())
            (self.prefill_s if is_prefill else self.decode_s).append(dt)
        return out


def make_prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    """Distinct prompts (each starts at a different offset of the text): no prefix hits."""
    ids = ByteTokenizer().encode(_TEXT * (1 + (prompt_len + 7 * num_prompts) // len(_TEXT)))
    return [ids[7 * i : 7 * i + prompt_len] for i in range(num_prompts)]


def _sim_engine(num_requests: int) -> LLMEngine:
    """The simulated executor's engine on a 2,000-block pool, ``num_requests`` requests of
    20-200 prompt tokens, up to 32 running."""
    import random

    from kvlab.engine.llm_engine import build_engine
    from kvlab.request import Request

    eng = build_engine(num_blocks=2000, block_size=16, event_log=None, max_num_batched_tokens=512, max_num_seqs=32)
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(20, 200))]
        eng.add_request(Request(f"r{i}", prompt, max_tokens=rng.randrange(10, 60), arrival_time=float(i)))
    return eng


def checkpoint_overhead(num_requests: int = 300, rounds: int = 3) -> tuple[float, float, float]:
    """What the per-step checkpoint costs (a step can be undone). Two identical
    simulated-executor engines step in lock-step, one with checkpoints and one without
    (``unguarded``: every call taken without an undo point), the order swapped every step so
    both see the same machine; returns the medians of the per-step times (us, without /
    with) and of the per-step ratios, over ``rounds`` runs."""
    import statistics

    from kvlab.core.transaction import unguarded

    ratios: list[float] = []
    plain: list[float] = []
    guarded: list[float] = []
    clock = time.perf_counter
    for _ in range(rounds):
        a, b = _sim_engine(num_requests), _sim_engine(num_requests)
        with unguarded(b) as nocp:
            k = 0
            while a.has_unfinished_requests():
                if k % 2:
                    t0 = clock()
                    b._step(nocp)
                    t1 = clock()
                    a.step()
                    t2 = clock()  # noqa: E702
                    tb, ta = t1 - t0, t2 - t1
                else:
                    t0 = clock()
                    a.step()
                    t1 = clock()
                    b._step(nocp)
                    t2 = clock()  # noqa: E702
                    ta, tb = t1 - t0, t2 - t1
                ratios.append(ta / tb)
                plain.append(tb)
                guarded.append(ta)
                k += 1
    return 1e6 * statistics.median(plain), 1e6 * statistics.median(guarded), statistics.median(ratios)


def _ms(xs: list[float]) -> str:
    return "-" if not xs else f"{1000 * sum(xs) / len(xs):.0f} ms (x{len(xs)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench engine", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="override the default config's num_layers")
    ap.add_argument("--backend", choices=("triton", "reference"), default="triton")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny ops: 1 is fastest)")
    ap.add_argument("--check", action="store_true", help="compare the tokens with the dense forward")
    ap.add_argument("--no-checkpoint-cost", action="store_true", help="skip the per-step checkpoint measurement")
    args = ap.parse_args([] if argv is None else argv)

    if not args.no_checkpoint_cost:
        plain, guarded, ratio = checkpoint_overhead()
        print(
            f"[engine] per-step checkpoint (a step can be undone), simulated executor, 300 requests, up to 32 "
            f"running, 2,000 blocks: {plain:.0f} us/step without, {guarded:.0f} us with; median per-step ratio "
            f"{ratio:.3f} ({(ratio - 1) * 100:+.1f}%)"
        )

    torch.set_num_threads(args.threads)
    cfg = TinyLlamaConfig() if args.layers is None else TinyLlamaConfig(num_layers=args.layers)
    model = TinyLlama(cfg, seed=0)
    prompts = make_prompts(args.prompts, args.prompt_len)
    mgr = KVCacheManager(num_blocks=args.num_blocks, block_size=args.block_size)
    runner = ModelRunner(model, num_blocks=args.num_blocks, block_size=args.block_size, backend=args.backend)
    timed = _TimedExecutor(runner)
    engine = LLMEngine(mgr, Scheduler(mgr), timed)

    t0, c0 = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, max_tokens=args.max_tokens)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_out = sum(len(o) for o in outputs)
    print(
        f"[engine] model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
        f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}; kernels: {runner.kernels.name}"
    )
    print(
        f"[engine] {args.prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} tokens each: "
        f"{wall:.2f} s ({cpu:.2f} s CPU: less than wall when other processes share the cores), "
        f"{n_out / wall:.1f} output tok/s, "
        f"{runner.num_tokens_computed / wall:.1f} computed tok/s ({runner.num_tokens_computed} tokens)"
    )
    print(
        f"[engine] per step: prefill {_ms(timed.prefill_s)}, decode {_ms(timed.decode_s)}; "
        f"{wall / TARGET_S:.2f}x of the {TARGET_S:.0f} s sizing target"
    )
    if not args.no_checkpoint_cost:  # the same run without undo points: what the transaction costs a model step
        from kvlab.core.transaction import unguarded
        from kvlab.request import Request

        bare_mgr = KVCacheManager(num_blocks=args.num_blocks, block_size=args.block_size)
        bare = LLMEngine(bare_mgr, Scheduler(bare_mgr), ModelRunner(model, backend=args.backend))
        c1, steps = time.process_time(), 0  # from the requests' adding on, as generate() above
        for i, p in enumerate(prompts):
            bare.add_request(Request(f"plain-{i}", p, max_tokens=args.max_tokens))
        with unguarded(bare) as nocp:
            while bare.has_unfinished_requests():
                bare._step(nocp)
                steps += 1
        plain_cpu = time.process_time() - c1
        print(
            f"[engine] the same run without undo points: {plain_cpu:.2f} s CPU; the transaction's share of a "
            f"model step: {(cpu - plain_cpu) / cpu * 100:+.1f}% ({steps} steps each)"
        )
    if args.check:
        same = outputs == [model.generate_dense(p, args.max_tokens) for p in prompts]
        print(f"[engine] tokens identical to the dense forward: {same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
