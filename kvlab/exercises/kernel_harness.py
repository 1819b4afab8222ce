"""The kernel exercises' checks themselves (see :mod:`kvlab.exercises.checks_kernels` for
what they check and the hints): the decode kernel around the learner's block step, the
cases, the reference and the diagnosis of classic mistakes.

Why a module of its own: it needs torch and Triton (~1.5 s to import), and
``kvlab.exercises`` is imported by every lesson and exercise notebook that checks anything;
only the two kernel checks import this, when they run.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from kvlab.exercises.registry import call, same, wrong_kind
from kvlab.exercises.result import CheckResult, failed, passed
from kvlab.kernels import INTERPRET, reshape_and_cache, unified_attention_ref
from kvlab.kernels.trace import trace_loads
from kvlab.eventlog.events import (
    AttentionBatch,
    BlocksTouched,
    EventLog,
    PoolCreated,
    RequestAdded,
    RequestScheduled,
    StepStarted,
)

import triton  # noqa: E402, I001  (after kvlab.kernels: it chooses interpreter vs compiled)
import triton.language as tl  # noqa: E402
from kvlab.utils.math_utils import cdiv, round_up

_STEP: Any = None  # the learner's block step, looked up by the kernel at run time


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_q_seq,
    stride_q_head,
    stride_block,
    stride_tok,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + d).to(tl.float32)
    m_i = tl.max(tl.full([HEAD_DIM], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([HEAD_DIM], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    kc = k_cache_ptr + head * HEAD_DIM  # this head's slice of every slot (one kv head per q head)
    vc = v_cache_ptr + head * HEAD_DIM
    for start in range(0, seq_len, BLOCK_SIZE):
        m_i, l_i, acc = _STEP(
            q,
            kc,
            vc,
            block_table_ptr + seq * stride_bt,
            start,
            seq_len,
            m_i,
            l_i,
            acc,
            scale,
            stride_block,
            stride_tok,
            BLOCK_SIZE,
            HEAD_DIM,
        )
    tl.store(out_ptr + seq * stride_q_seq + head * stride_q_head + d, acc / l_i)


def run_decode(
    step: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    loads: list[list[int]] | None = None,
) -> torch.Tensor:
    """Decode attention (one query per sequence) with the learner's block step.

    ``loads``: a list to fill, under the interpreter, with each sequence's loaded slots
    (``block * block_size + offset``, from the K or the V cache) -- observed, not derived.
    """
    global _STEP
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    _STEP = step
    trace = None
    try:
        with (
            trace_loads(("k_cache_ptr", "v_cache_ptr"), kernels=("_decode_kernel",)) if loads is not None and INTERPRET else _no_trace()
        ) as trace:
            _decode_kernel[(num_seqs, num_heads)](
                q,
                k_cache,
                v_cache,
                block_table,
                seq_lens,
                out,
                scale,
                q.stride(0),
                q.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                block_table.stride(0),
                NUM_HEADS=num_heads,
                BLOCK_SIZE=block_size,
                HEAD_DIM=head_dim,
            )
    finally:
        _STEP = None
        if trace is not None and loads is not None:
            per_seq: list[set[int]] = [set() for _ in range(num_seqs)]
            for launch in trace.launches:  # program (seq, head): grid axis 0 is the sequence
                for name in ("k_cache_ptr", "v_cache_ptr"):
                    for (seq, _h, _z), keys in launch.loads.get(name, {}).items():
                        if seq < num_seqs:
                            per_seq[seq].update(int(k) for k in keys)
            loads[:] = [sorted(s) for s in per_seq]
    return out


class _no_trace:
    """Stands in for ``trace_loads`` where loads cannot be watched (a GPU)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def decode_reads_log(table: torch.Tensor, seq_lens: list[int], block_size: int, num_blocks: int, loads: list[list[int]]) -> EventLog:
    """A one-step log of the checker's decode batch with the learner's kernel's loads, for
    the kernel view: sequence ``s`` (request ``seq{s}``) holds the blocks of its table row
    and decodes one token at position ``seq_lens[s] - 1``."""
    log = EventLog()
    log.emit(PoolCreated(num_blocks=num_blocks, block_size=block_size, groups=[{"type": "full"}]))
    rows = [[int(b) for b in table[s, : cdiv(n, block_size)]] for s, n in enumerate(seq_lens)]
    for s, n in enumerate(seq_lens):
        log.emit(RequestAdded(request_id=f"seq{s}", prompt_token_ids=[0] * n, max_tokens=1))
    log.step = 1
    log.emit(StepStarted())
    for s, n in enumerate(seq_lens):
        # The checker placed these blocks by hand (a shuffled table): the table takes them
        # as it would take prefix hits, wherever they sit in the free queue.
        log.emit(RequestScheduled(request_id=f"seq{s}", num_tokens=1, num_computed_tokens=n - 1, phase="new"))
        log.emit(BlocksTouched(request_id=f"seq{s}", block_ids=rows[s]))
    width = max(len(r) for r in rows)
    log.emit(
        AttentionBatch(
            req_ids=[f"seq{s}" for s in range(len(seq_lens))],
            query_lens=[1] * len(seq_lens),
            seq_lens=list(seq_lens),
            block_tables=[[r + [0] * (width - len(r)) for r in rows]],
            slot_mappings=[[rows[s][(n - 1) // block_size] * block_size + (n - 1) % block_size for s, n in enumerate(seq_lens)]],
            block_size=block_size,
            sliding_windows=[None],
            kernel_reads=[[list(x) for x in loads]],
            read_layers=[0],
        )
    )
    return log


def _case(seed: int, seq_lens: list[int], block_size: int = 16, head_dim: int = 32, heads: int = 2, big: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    need = sum(cdiv(n, block_size) for n in seq_lens)
    num_blocks = need + 3
    perm = list(range(1, num_blocks))
    random.Random(seed).shuffle(perm)  # physical placement unrelated to logical order
    max_blocks = max(cdiv(n, block_size) for n in seq_lens)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    it = iter(perm)
    for s, n in enumerate(seq_lens):
        for j in range(cdiv(n, block_size)):
            table[s, j] = next(it)
    k = torch.randn(num_blocks, block_size, heads, head_dim, generator=g) * big
    v = torch.randn(num_blocks, block_size, heads, head_dim, generator=g)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g) * big
    return q, k, v, table, torch.tensor(seq_lens, dtype=torch.int32)


def check_paged_attention_kernel(step: Any) -> CheckResult:
    eid = "paged_attention_kernel"
    cases = [
        (
            "three sequences, shuffled blocks, lengths not multiples of 16",
            1,
            [37, 16, 5],
            1.0,
            "block-table lookup + masked loads: positions >= seq_len must not contribute",
        ),
        (
            "large scores (exp would overflow without the running max)",
            2,
            [40, 23],
            12.0,
            "keep a running max: subtract it before exp, and rescale l_i and acc when it grows",
        ),
        ("a long context across many blocks", 3, [130], 1.0, "rescale the accumulator by alpha at every block"),
    ]
    for name, seed, lens, big, idea in cases:
        q, k, v, table, seq_lens = _case(seed, lens, big=big)
        scale = 1.0 / math.sqrt(q.shape[-1])
        loads: list[list[int]] = []
        try:
            got = run_decode(step, q, k, v, table, seq_lens, scale, loads=loads)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            if "NotImplementedError" in repr(e):  # the interpreter wraps what the step raised
                raise NotImplementedError from e
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            return failed(
                eid,
                f"the kernel failed to run with your step: {type(e).__name__}: {msg}",
                case=name,
                idea="a @triton.jit function returns a tuple (m_i, l_i, acc); every tensor op must be tl.* inside the kernel",
            )
        cu = torch.arange(len(lens) + 1, dtype=torch.int32)
        want = unified_attention_ref(q, k, v, cu, seq_lens, table, scale)
        extra: dict[str, Any] = {}
        if loads:
            extra["kernel_reads"] = decode_reads_log(table, lens, k.shape[1], k.shape[0], loads)
            extra["case"] = name
        if not torch.isfinite(got).all():
            return failed(
                eid,
                f"NaN or inf in the output: {name}",
                case=name,
                expected="finite values",
                got=f"{int((~torch.isfinite(got)).sum())} non-finite values" + _loads_note(loads, table, lens, k.shape[1]),
                idea=idea,
                extra=extra,
            )
        idea = _diagnose(got, q, k, v, table, lens, scale) or idea
        err = (got - want).abs().max().item()
        if err > 1e-4:
            worst = int((got - want).abs().amax(dim=(1, 2)).argmax())
            return failed(
                eid,
                f"wrong attention output: {name}",
                case=name,
                inputs=f"seq_lens={lens}, block_size=16, shuffled block table row {worst}: {table[worst].tolist()}",
                expected=f"out[{worst}, 0, :4] = {[round(x, 4) for x in want[worst, 0, :4].tolist()]}",
                got=f"out[{worst}, 0, :4] = {[round(x, 4) for x in got[worst, 0, :4].tolist()]} (max error {err:.3g})"
                + _loads_note(loads, table, lens, k.shape[1]),
                idea=idea,
                extra=extra,
            )
    return passed(eid, "matches the reference on shuffled block tables, ragged lengths and large scores (fp32 online softmax).")


def _loads_note(loads: list[list[int]], table: torch.Tensor, lens: list[int], block_size: int = 16) -> str:
    """What the traced loads say, in one line (empty when they match the table)."""
    if not loads:
        return ""
    wrong = []
    for s, n in enumerate(lens):
        want = {int(table[s, p // block_size]) * block_size + p % block_size for p in range(n)}
        got = set(loads[s])
        if got != want:
            extra, missing = len(got - want), len(want - got)
            wrong.append(
                f"seq{s}: {extra} slots loaded that its table does not hold" * bool(extra)
                + (", " if extra and missing else "")
                + f"{missing} of its slots not loaded" * bool(missing)
            )
    if not wrong:
        return ""
    return "\n            your kernel's loads: " + "; ".join(wrong) + " -- result.show() draws them"


def _variant_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lens: list[int],
    scale: float,
    *,
    logical: bool = False,
    unmasked: bool = False,
) -> torch.Tensor:
    """Decode attention as a classic mistake computes it: ``logical`` reads logical block j
    as if it were physical block j (no block-table lookup); ``unmasked`` also reads the
    slots past ``seq_len`` in the last block (no mask)."""
    bs = k.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    for s, n in enumerate(lens):
        m = round_up(n, bs) if unmasked else n
        pos = torch.arange(m)
        blocks = pos // bs if logical else table[s, pos // bs].long()
        keys, vals = k[blocks, pos % bs].float(), v[blocks, pos % bs].float()  # [m, heads, dim]
        w = torch.softmax(torch.einsum("hd,mhd->hm", q[s].float(), keys) * scale, dim=-1)
        out[s] = torch.einsum("hm,mhd->hd", w, vals)
    return out


def _diagnose(
    got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: list[int], scale: float
) -> str:
    """Name the mistake when the learner's output equals what one classic mistake computes."""
    if not torch.isfinite(got).all():
        return ""
    # The scale: the scores are q·k × scale (1/sqrt(head_dim)); an output equal to the
    # reference computed with another scale names the scale, whatever else is right.
    for wrong_scale, idea in (
        (
            1.0,
            f"the softmax scale is missing: multiply the scores q·k by scale (= 1/sqrt(head_dim) = {scale:.4g}) before the "
            "softmax -- without it the softmax is far too sharp; the rest (block lookup, loads, online softmax) is right",
        ),
        (
            scale * scale,
            "the softmax scale is applied twice (the scores came out as q·k × scale²): multiply by scale once, "
            "either the scores or q/k, not both",
        ),
    ):
        if torch.allclose(got.float(), _variant_ref(q, k, v, table, lens, wrong_scale), atol=1e-4):
            return idea
    for logical, unmasked, idea in (
        (
            True,
            False,
            "your kernel read logical block j as if it were physical block j: look the block up in the block table "
            "first (block_id = tl.load(block_table_ptr + start // BLOCK_SIZE)) -- the masking is right",
        ),
        (
            False,
            True,
            "the block lookup is right, but the slots past seq_len in the last block were read too: mask the loads "
            "(valid = start + offs < seq_len) and give masked scores -inf",
        ),
        (
            True,
            True,
            "two mistakes: no block-table lookup (logical block j read as physical block j) and no mask for the slots past seq_len",
        ),
    ):
        if torch.allclose(got.float(), _variant_ref(q, k, v, table, lens, scale, logical=logical, unmasked=unmasked), atol=1e-4):
            return idea
    return ""


def reference_slot_mapping(block_table: list[int], start_pos: int, num_tokens: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start_pos, start_pos + num_tokens)]


def check_slot_mapping(fn: Any) -> CheckResult:
    eid = "slot_mapping"
    cases = [
        ("a prefill of 20 tokens", [7, 3], 0, 20, 16, "slot = physical block * block_size + offset"),
        ("a decode at position 37", [4, 9, 2], 37, 1, 16, "decode writes one slot, in logical block 37 // 16 = 2"),
        ("a chunk after a prefix hit", [5, 1, 8, 6], 32, 20, 16, "the chunk starts after the cached tokens: positions 32 … 51"),
        ("block size 4", [3, 0, 7], 2, 7, 4, "works for any block size"),
    ]
    for name, table, start, n, bs, idea in cases:
        want = reference_slot_mapping(table, start, n, bs)
        got = call(fn, list(table), start, n, bs, where=name)
        if isinstance(got, tuple) or hasattr(got, "tolist"):
            got = list(got.tolist() if hasattr(got, "tolist") else got)
        bad = wrong_kind(eid, got, want, name, "the slot mapping")
        if bad is not None:
            return bad
        if not same(got, want):
            if list(got) == reference_slot_mapping(table, start + 1, n, bs) or list(got) == reference_slot_mapping(table, start - 1, n, bs):
                idea = "off by one: the first new token is at position start_pos"
            elif list(got) == list(range(start, start + n)):
                idea = "a position is not a slot: look the block up in the block table"
            return failed(
                eid,
                f"wrong slots: {name}",
                case=name,
                inputs=f"block_table={table}, start_pos={start}, num_tokens={n}, block_size={bs}",
                expected=str(want),
                got=str(list(got)),
                idea=idea,
            )
    # The real kernel writes where the learner's slots say; compare with the reference slots.
    g = torch.Generator().manual_seed(0)
    table, start, n, bs = [6, 2, 9, 4], 10, 30, 16
    key = torch.randn(n, 2, 32, generator=g)
    val = torch.randn(n, 2, 32, generator=g)
    caches = [torch.zeros(12, bs, 2, 32) for _ in range(4)]
    reshape_and_cache(
        key, val, caches[0], caches[1], torch.tensor(call(fn, table, start, n, bs, where="the kernel case"), dtype=torch.int64)
    )
    reshape_and_cache(key, val, caches[2], caches[3], torch.tensor(reference_slot_mapping(table, start, n, bs), dtype=torch.int64))
    if not (torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])):
        return failed(eid, "the Triton reshape_and_cache kernel wrote K/V to the wrong slots with your mapping")
    return passed(eid, "every token lands in its physical slot; the real reshape_and_cache kernel agrees.")
