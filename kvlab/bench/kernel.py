"""`python -m kvlab.bench kernel`: decode attention against the memory roofline and SDPA.

Decode attention reads every cached K and V byte once and does ~2 FLOPs per byte, so its
speed limit is memory bandwidth. The headline number is therefore *achieved KV bandwidth*
(bytes of K and V read / time) as a fraction of the GPU's peak, plus the speed relative
to PyTorch's ``scaled_dot_product_attention`` reading the same KV from a contiguous
(unpaged) layout: what paging costs, or doesn't.

On CUDA: 64 sequences x 4,096-token contexts, 32 q heads, 8 kv heads, head_dim 128,
fp16 and bf16, blocks placed at random. Also sweeps the number of KV splits so the
planner's choice can be checked on this GPU. Without CUDA the kernels run under the
Triton interpreter: a scaled-down shape, and the times measure Python, not a GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import kvlab.kernels as K  # noqa: I001  (first: decides TRITON_INTERPRET before triton is imported)
import torch

from kvlab.kernels.attention import _launch, _plan

# Vendor spec-sheet HBM bandwidth, TB/s. Matched as substrings of the device name, first
# match wins, so more specific names come first ("GH200" before "H200", "A100" before "A10").
_PEAK_TBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4.0),  # 96 GB HBM3 variant
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM5, reported as "NVIDIA H100 80GB HBM3"
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB", 1.935),  # PCIe
    ("A100", 1.555),  # 40 GB, SXM4 or PCIe
    ("A10G", 0.6),
    ("A10", 0.6),
    ("L40S", 0.864),
    ("L40", 0.864),
    ("L4", 0.3),
    ("RTX 4090", 1.008),
    ("RTX 3090", 0.936),
    ("V100", 0.9),
    ("T4", 0.32),
)


def peak_bandwidth(device_name: str) -> float | None:
    """Peak HBM bandwidth in bytes/s for a known device name, else None."""
    for key, tbps in _PEAK_TBPS:
        if key in device_name:
            return tbps * 1e12
    return None


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


GPU_SHAPE = Shape(batch=64, context=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
CPU_SHAPE = Shape(batch=4, context=256, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)


def _time(fn: Callable[[], object], warmup: int, reps: int, cuda: bool) -> float:
    """Median seconds per call: CUDA events on a GPU, perf_counter otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_batch(shape: Shape, dtype: torch.dtype, device: str, seed: int = 0):
    """Paged caches with randomly placed blocks, plus the same K/V laid out contiguously."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages = shape.context // shape.block_size
    num_blocks = shape.batch * pages + 1  # block 0 stays unused, like vLLM's null block
    block_table = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    block_table = block_table.view(shape.batch, pages).to(device)
    kv = torch.randn(num_blocks, 2, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    q = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    cu = torch.arange(shape.batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    return q, kv, cu, seq_lens, block_table


def _dense_kv(kv: torch.Tensor, block_table: torch.Tensor, shape: Shape, which: int) -> torch.Tensor:
    """[batch, kv_heads, context, head_dim] contiguous copy of K (which=0) or V (which=1)."""
    paged = kv[:, which][block_table.long()]  # [batch, pages, block_size, H, D]
    dense = paged.reshape(shape.batch, shape.context, shape.num_kv_heads, shape.head_dim)
    return dense.transpose(1, 2).contiguous()


def _sdpa(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    try:
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
    except (TypeError, RuntimeError):  # older torch or a backend without GQA support
        group = q4.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q4, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=scale
        )


def run(shape: Shape, dtype: torch.dtype, cuda: bool, warmup: int, reps: int, sweep: tuple[int, ...]) -> None:
    device = "cuda" if cuda else K.DEVICE
    q, kv, cu, seq_lens, table = _decode_batch(shape, dtype, device)
    kc, vc = kv[:, 0], kv[:, 1]
    scale = shape.head_dim**-0.5
    args = (q, kc, vc, cu, seq_lens, table, scale)

    plan = _plan(q, shape.num_kv_heads, shape.batch, table.shape[1] * shape.block_size)
    out = K.unified_attention(*args)  # validates once; timed calls below skip validation
    t_kernel = _time(lambda: _launch(*args), warmup, reps, cuda)
    t_api = _time(lambda: K.unified_attention(*args), warmup, reps, cuda)

    k_dense, v_dense = _dense_kv(kv, table, shape, 0), _dense_kv(kv, table, shape, 1)
    q4 = q.unsqueeze(2)  # [batch, q_heads, 1, head_dim]
    ref = _sdpa(q4, k_dense, v_dense, scale).squeeze(2)
    t_sdpa = _time(
        functools.partial(_sdpa, q4, k_dense, v_dense, scale), warmup, reps, cuda
    )  # not a closure: the tensors are deleted below
    max_err = (out.float() - ref.float()).abs().max().item()

    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * q.element_size()
    name = str(dtype).removeprefix("torch.")
    print(
        f"\n[{name}] plan: BLOCK_M={plan.block_m} (q tokens/tile {plan.block_q}), BLOCK_N={plan.block_n}, "
        f"kv splits={plan.num_splits}; max |kernel - sdpa| = {max_err:.2e}"
    )
    print(f"  {'':28s}{'time':>12s}{'KV GB/s':>12s}{'% peak':>9s}")
    peak = peak_bandwidth(torch.cuda.get_device_name()) if cuda else None

    def row(label: str, t: float) -> None:
        bw = kv_bytes / t
        pct = f"{100 * bw / peak:8.1f}%" if peak else "      n/a"
        print(f"  {label:28s}{t * 1e3:10.3f}ms{bw / 1e9:12.4g}{pct}")

    row("unified_attention (kernel)", t_kernel)
    row("unified_attention (+checks)", t_api)
    row("sdpa, contiguous KV", t_sdpa)
    print(f"  speed vs sdpa: {t_sdpa / t_kernel:.3g}x  (sdpa time / kernel time; >1: the paged kernel is faster)")
    if cuda and sweep:
        print("  kv-split sweep (kernel only):")
        for splits in sweep:
            t = _time(functools.partial(_launch, *args, num_splits=splits), warmup, reps, cuda)
            mark = "  <- planner" if splits == plan.num_splits else ""
            row(f"    splits={splits}{mark}", t)
    del kv, k_dense, v_dense
    if cuda:
        torch.cuda.empty_cache()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench kernel", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, help="sequences in the decode batch")
    parser.add_argument("--context", type=int, help="tokens of context per sequence (multiple of 16)")
    parser.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    parser.add_argument("--dtype", choices=["fp16", "bf16", "both"], default="both")
    parser.add_argument("--no-sweep", action="store_true", help="skip the kv-split sweep on CUDA")
    parser.add_argument(
        "--model",
        default=os.environ.get("KVLAB_MODEL") or None,
        help="a Hugging Face checkpoint (directory or Hub id; default: $KVLAB_MODEL): "
        "also time its attention shape (q heads, KV heads, head_dim)",
    )
    opts = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not K.INTERPRET
    shape = GPU_SHAPE if cuda else CPU_SHAPE
    model_shape = None
    if opts.model:
        cfg = model_attention_shape(opts.model)
        model_shape = Shape(shape.batch, shape.context, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, shape.block_size)
    if opts.batch or opts.context:
        shape = Shape(
            opts.batch or shape.batch,
            opts.context or shape.context,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.block_size,
        )
    if shape.context % shape.block_size:
        parser.error(f"--context must be a multiple of the block size {shape.block_size}")
    warmup, reps = (5, 30) if cuda else (1, 3)
    reps = opts.reps or reps
    dtypes = {"fp16": [torch.float16], "bf16": [torch.bfloat16], "both": [torch.float16, torch.bfloat16]}[opts.dtype]

    print("kernel benchmark: decode attention (one query token per sequence)")
    if cuda:
        name = torch.cuda.get_device_name()
        peak = peak_bandwidth(name)
        print(f"device: {name}; peak HBM bandwidth: " + (f"{peak / 1e12:.2f} TB/s (vendor figure)" if peak else "unknown peak"))
    else:
        print("!" * 78)
        print("!! NO CUDA: Triton is running under its INTERPRETER (numpy on the CPU).")
        print("!! The shape is scaled down and every time below measures Python overhead,")
        print("!! not a GPU kernel. Bandwidth and SDPA ratios here say nothing about GPUs.")
        print("!" * 78)
    print(
        f"shape: {shape.batch} seqs x {shape.context} tokens, {shape.num_q_heads} q heads, "
        f"{shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, block_size {shape.block_size}, "
        f"random block placement; median of {reps} (warmup {warmup})"
    )
    sweep = () if opts.no_sweep else (1, 2, 4, 8, 16)
    for i, dtype in enumerate(dtypes):
        # Each split count is its own compiled variant: sweep one dtype only.
        run(shape, dtype, cuda, warmup, reps, sweep if i == 0 else ())
    if model_shape is not None:
        print(
            f"\n{opts.model}: {model_shape.num_q_heads} q heads, {model_shape.num_kv_heads} kv heads, "
            f"head_dim {model_shape.head_dim}; the same batch and context against SDPA"
        )
        for dtype in dtypes:
            run(model_shape, dtype, cuda, warmup, reps, ())


def model_attention_shape(path_or_id: str):  # noqa: ANN201
    """A checkpoint's attention geometry, read from its config.json alone (no weights loaded)."""
    from kvlab.worker.hf_checkpoint import read_config, resolve_checkpoint_dir
    from kvlab.worker.hf_config import HFModelConfig

    directory = resolve_checkpoint_dir(path_or_id)
    return HFModelConfig.from_dict(read_config(directory), dtype=torch.float32, where=str(directory / "config.json"))
