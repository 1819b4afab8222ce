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
_TEXT = ("Blocks, not buffers: the KV cache is cut into fixed-size pages, a block table maps each "
         "request's logical blocks to physical ones, and identical prefixes share their blocks. ")


@dataclass
class _TimedExecutor:
    """Wraps the runner to time each step and tell prefill steps from decode steps."""

    runner: ModelRunner
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)

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
    return [ids[7 * i:7 * i + prompt_len] for i in range(num_prompts)]


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
    args = ap.parse_args([] if argv is None else argv)

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
    print(f"[engine] model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}; kernels: {runner.kernels.name}")
    print(f"[engine] {args.prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} tokens each: "
          f"{wall:.2f} s ({cpu:.2f} s CPU: less than wall when other processes share the cores), "
          f"{n_out / wall:.1f} output tok/s, "
          f"{runner.num_tokens_computed / wall:.1f} computed tok/s ({runner.num_tokens_computed} tokens)")
    print(f"[engine] per step: prefill {_ms(timed.prefill_s)}, decode {_ms(timed.decode_s)}; "
          f"{wall / TARGET_S:.2f}x of the {TARGET_S:.0f} s sizing target")
    if args.check:
        same = outputs == [model.generate_dense(p, args.max_tokens) for p in prompts]
        print(f"[engine] tokens identical to the dense forward: {same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
