"""The attention kernel's reads, observed: interpreter load tracing and the NaN probe.

The slots a kernel loads are recorded from the interpreter's load primitive
(``kvlab.kernels.trace``) -- these tests check that the record is what the kernel really
fetched: the same as an independent method (NaN poisoning) on the same inputs, different
when the kernel is given a different table, and empty for masked-off lanes.
"""

from __future__ import annotations

import pytest
import torch

import kvlab.kernels  # noqa: F401  (first: it picks the interpreter)
from kvlab.kernels import INTERPRET, unified_attention
from kvlab.kernels.trace import probe_reads_nan, trace_loads, traced_unified_attention

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="load tracing runs under the Triton interpreter")

NB, BS, HKV, HQ, D = 11, 4, 2, 4, 32


def _caches(seed: int = 0, interleaved: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if interleaved:  # the runner's layout: one [blocks, 2, bs, H, D] tensor, K and V as strided views
        kv = torch.randn(NB, 2, BS, HKV, D, generator=g)
        return kv[:, 0], kv[:, 1]
    return torch.randn(NB, BS, HKV, D, generator=g), torch.randn(NB, BS, HKV, D, generator=g)


def _decode_batch(seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HQ, D, generator=g)
    table = torch.tensor([[1, 2, 3, 6], [4, 5, 0, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq_lens = torch.tensor([13, 8], dtype=torch.int32)
    return q, table, cu, seq_lens


def _slots(table_row: list[int], positions: range) -> list[int]:
    return sorted({table_row[p // BS] * BS + p % BS for p in positions})


@needs_interpreter
@pytest.mark.parametrize("interleaved", [True, False], ids=["kv-interleaved", "separate-k-v"])
def test_traced_loads_are_exactly_each_sequences_slots(interleaved: bool) -> None:
    k, v = _caches(interleaved=interleaved)
    q, table, cu, seq_lens = _decode_batch()
    out, reads = traced_unified_attention(q, k, v, cu, seq_lens, table, D**-0.5)
    assert torch.equal(out, unified_attention(q, k, v, cu, seq_lens, table, D**-0.5))  # tracing changes nothing
    assert reads == [_slots([1, 2, 3, 6], range(13)), _slots([4, 5], range(8))]
    assert reads[0] == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 24]
    assert not any(s // BS == 0 for r in reads for s in r)  # the null block: never loaded


@needs_interpreter
def test_traced_loads_follow_the_window_and_the_prefill() -> None:
    k, v = _caches()
    q, table, cu, seq_lens = _decode_batch()
    windowed = torch.tensor([[0, 2, 3, 6], [4, 5, 0, 0]], dtype=torch.int32)  # block 1 left the window: null
    _, reads = traced_unified_attention(q, k, v, cu, seq_lens, windowed, D**-0.5, sliding_window=6)
    # W = 6: the query at 12 reads positions 7..12, the one at 7 reads 2..7.
    assert reads == [_slots([0, 2, 3, 6], range(7, 13)), _slots([4, 5], range(2, 8))]
    g = torch.Generator().manual_seed(3)
    q_pre = torch.randn(21, HQ, D, generator=g)  # both sequences prefill every token this step
    cu_pre = torch.tensor([0, 13, 21], dtype=torch.int32)
    _, reads = traced_unified_attention(q_pre, k, v, cu_pre, seq_lens, windowed, D**-0.5, sliding_window=6)
    # The union of every query's window: from the first query's window start (position 0) on,
    # so the null entry of the first row *would* be read -- the kernel reads block 0 here.
    assert reads[1] == _slots([4, 5], range(8)) and 0 in {s // BS for s in reads[0]}


@needs_interpreter
def test_a_wrong_table_shows_in_the_loads() -> None:
    k, v = _caches()
    q, table, cu, seq_lens = _decode_batch()
    swapped = table[[1, 0]].contiguous()  # a runner that forgot to move table rows with their requests
    _, reads = traced_unified_attention(q, k, v, cu, seq_lens, swapped, D**-0.5)
    assert reads[0] == _slots([4, 5, 0, 0], range(13))  # r0 reads r1's blocks and the null block
    assert {s // BS for s in reads[0]} == {0, 4, 5}


@needs_interpreter
def test_the_nan_probe_finds_the_same_slots_as_the_trace() -> None:
    """Two independent observations of one kernel: intercepted loads, and NaN poisoning."""
    k, v = _caches()
    q, table, cu, seq_lens = _decode_batch()
    for t, w in ((table, None), (torch.tensor([[0, 2, 3, 6], [4, 5, 0, 0]], dtype=torch.int32), 6)):
        _, traced = traced_unified_attention(q, k, v, cu, seq_lens, t, D**-0.5, sliding_window=w)
        assert probe_reads_nan(q, k, v, cu, seq_lens, t, D**-0.5, sliding_window=w) == traced


def test_the_nan_probe_leaves_the_caches_alone_and_checks_its_input() -> None:
    k, v = _caches()
    k0, v0 = k.clone(), v.clone()
    q, table, cu, seq_lens = _decode_batch()
    probe_reads_nan(q, k, v, cu, seq_lens, table, D**-0.5, blocks=[1, 4])
    assert torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(ValueError, match="blocks: 11 is not a block id in 0..10"):
        probe_reads_nan(q, k, v, cu, seq_lens, table, D**-0.5, blocks=[11])


@needs_interpreter
def test_masked_lanes_are_not_loads_and_traces_do_not_leak() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_first(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
        tl.store(dst_ptr + offs, x)

    src = torch.arange(16, dtype=torch.float32).reshape(16, 1)
    dst = torch.zeros(16, dtype=torch.float32)
    with trace_loads(["src_ptr"]) as trace:
        copy_first[(1,)](src, dst, 5, BLOCK=16)
    (launch,) = trace.launches
    assert launch.kernel == "copy_first" and launch.keys("src_ptr").tolist() == [0, 1, 2, 3, 4]
    # Outside the block nothing is recorded, and the interpreter is back to normal.
    from triton.runtime import interpreter

    assert "create_masked_load" not in vars(interpreter.interpreter_builder)
    copy_first[(1,)](src, dst, 5, BLOCK=16)
    assert len(trace.launches) == 1


def test_trace_arguments_are_checked() -> None:
    if not INTERPRET:
        with pytest.raises(RuntimeError, match="needs the Triton interpreter"), trace_loads(["k"]):
            pass
        return
    with pytest.raises(TypeError, match="not a single string"), trace_loads("key_cache_ptr"):
        pass
    with pytest.raises(RuntimeError, match="do not nest"), trace_loads(["a"]), trace_loads(["b"]):
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nan_probe_on_the_gpu_finds_each_sequences_slots() -> None:
    """On a GPU the compiled kernel cannot be traced; the NaN probe observes its reads."""
    k, v = (t.cuda() for t in _caches())
    q, table, cu, seq_lens = (t.cuda() for t in _decode_batch())
    reads = probe_reads_nan(q, k, v, cu, seq_lens, table, D**-0.5)
    assert reads == [_slots([1, 2, 3, 6], range(13)), _slots([4, 5], range(8))]
    swapped = table[[1, 0]].contiguous()
    assert probe_reads_nan(q, k, v, cu, seq_lens, swapped, D**-0.5)[0] == _slots([4, 5, 0, 0], range(13))
    windowed = torch.tensor([[0, 2, 3, 6], [4, 5, 0, 0]], dtype=torch.int32, device="cuda")
    assert probe_reads_nan(q, k, v, cu, seq_lens, windowed, D**-0.5, sliding_window=6) == [
        _slots([0, 2, 3, 6], range(7, 13)),
        _slots([4, 5], range(2, 8)),
    ]


# -- the model runner puts the observed loads into the data layer ----------------------------------
def _real_engine(config=None, num_blocks: int = 11, block_size: int = 4, **runner_kwargs):
    from kvlab import EventLog, KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.model_runner import ModelRunner
    from kvlab.worker.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    model = TinyLlama(config, seed=0) if config is not None else TinyLlama(seed=0)
    log = EventLog()
    groups = None
    if model.config.sliding_window is not None:
        groups = [
            FullAttentionSpec(block_size=block_size),
            SlidingWindowSpec(block_size=block_size, sliding_window=model.config.sliding_window),
        ]
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, event_log=log, **({"kv_cache_groups": groups} if groups else {}))
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, event_log=log, **runner_kwargs)
    return LLMEngine(mgr, Scheduler(mgr), runner, tokenizer=tok), log, tok


@needs_interpreter
def test_the_runner_records_every_steps_loads_and_the_view_draws_them() -> None:
    from kvlab import Request
    from kvlab.timeline import Timeline
    from kvlab.eventlog.events import AttentionBatch
    from kvlab.viz import KernelView

    engine, log, tok = _real_engine()
    engine.add_request(Request("r0", tok.encode("Paged KV!!"), max_tokens=6))
    engine.step()
    engine.add_request(Request("r1", tok.encode("blocks"), max_tokens=4))
    engine.run()
    batches = log.of_type(AttentionBatch)
    assert all(b.read_layers == [0] and b.kernel_reads is not None for b in batches)
    for b in batches:  # every step: each request loaded exactly the slots of its positions
        for i, rid in enumerate(b.req_ids):
            assert b.kernel_reads[0][i] == _slots(b.block_tables[0][i], range(b.seq_lens[i]))
    step4 = next(b for b in batches if b.step == 4)
    assert step4.kernel_reads[0][step4.req_ids.index("r0")] == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 24]
    tl = Timeline(log)
    view = KernelView(tl)
    view.update(tl.at(4), "r0")
    d = view.last_data
    (g,) = d["groups"]
    assert d["source"] == "traced" and g["observed_slots"] == g["read_slots"] and not g["missed"] and not g["unexpected"]
    assert g["null_loads"] == 0 and "13 slots loaded = the table's 13; block 0 never read" in d["subtitle"]
    assert len(view.figure.data[1].x) == 13 and len(view.figure.data[3].x) == 0  # 13 dots, no ✖
    # Untraced run: the same picture, derived and labelled so.
    engine2, log2, _ = _real_engine(trace_reads=False)
    engine2.add_request(Request("r0", tok.encode("Paged KV!!"), max_tokens=2))
    engine2.run()
    assert all(b.kernel_reads is None for b in log2.of_type(AttentionBatch))


@needs_interpreter
def test_traced_reads_per_group_on_a_hybrid_model() -> None:
    from kvlab import Request
    from kvlab.eventlog.events import AttentionBatch
    from kvlab.worker.model import TinyLlamaConfig

    cfg = TinyLlamaConfig(num_layers=2, sliding_window=8, sliding_window_layers=(1,))
    engine, log, tok = _real_engine(cfg, num_blocks=24)
    engine.add_request(Request("w", tok.encode("a sliding window of eight"), max_tokens=3))
    engine.run()
    last = log.of_type(AttentionBatch)[-1]
    assert last.read_layers == [0, 1] and len(last.kernel_reads) == 2
    n = last.seq_lens[0]
    full, window = last.kernel_reads[0][0], last.kernel_reads[1][0]
    assert full == _slots(last.block_tables[0][0], range(n))
    assert window == _slots(last.block_tables[1][0], range(n - 8, n))  # only the last 8 positions
    assert not any(s // 4 == 0 for s in window)


@needs_interpreter
def test_a_runner_with_swapped_table_rows_reads_the_other_requests_blocks() -> None:
    from kvlab.lessons.kernel_reads import reads_summary, swapped_rows_run
    from kvlab.timeline import Timeline
    from kvlab.viz import kernel
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    log = swapped_rows_run(TinyLlama(seed=0), tok, {"r0": ("Paged KV!!", 6), "r1": ("blocks", 4)})
    assert reads_summary(log, 2) == [
        "r1: its table [4, 5] · the kernel got [1, 2, 3] · loaded blocks 1 (r0's), 2 (r0's)",
        "r0: its table [1, 2, 3] · the kernel got [4, 5, 0] · loaded blocks 0 (null), 4 (r1's), 5 (r1's)",
    ]
    tl = Timeline(log)
    b = tl.attention_batch(2)
    d = kernel.figure_data(tl.at(2), "r0", batch=b, at_batch=tl.after_event(b.seq))
    (g,) = d["groups"]
    assert g["table"] == [1, 2, 3] and g["given_table"] == [4, 5, 0] and g["stray_blocks"] == [0, 4, 5]
    assert g["null_loads"] == 3 and len(g["missed"]) == 11 and g["observed_slots"] == [0, 1, 2] + list(range(16, 24))
    assert d["row_labels"][-3:] == ["✖ 0 (null)", "✖ 4 (r1's)", "✖ 5 (r1's)"]
    assert "blocks [4,5] NOT in the table" in d["subtitle"] and "3 slots of null block 0" in d["subtitle"]


def test_trace_reads_argument_is_checked() -> None:
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.model_runner import ModelRunner

    with pytest.raises(TypeError, match="trace_reads must be a bool"):
        ModelRunner(TinyLlama(seed=0), num_blocks=4, block_size=4, trace_reads="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the Triton backend under the interpreter"):
        ModelRunner(TinyLlama(seed=0), num_blocks=4, block_size=4, backend="reference", trace_reads=True)


@needs_interpreter
def test_bench_trace_runs_and_reports_ratios(capsys) -> None:
    from kvlab.bench import trace

    trace.main(["--reps", "1"])
    out = capsys.readouterr().out
    assert "decode, 4 seqs x 100 tokens" in out and "lesson 00 engine step" in out
    assert out.count("x") >= 3 and "ms" in out
