"""``unified_attention``: causal paged attention for a batch that mixes prefills and decodes.

One launch serves every sequence of the step, whatever its phase (hence "unified"):

* a decode has one query token and a long cached context;
* a prefill has many query tokens, and may also have cached context in front of them
  (a prefix-cache hit, or the later chunk of a chunked prefill).

In all cases the new tokens are the LAST ``q_len`` positions of a ``seq_len``-token
sequence and their K/V are already in the cache (``reshape_and_cache`` ran first), so
attention only ever reads K/V from the paged cache, through the block table.

How the work is cut (why the grid looks like this)
--------------------------------------------------
``grid = (q tiles, kv heads, kv splits)``.

* **A q tile** is up to ``BLOCK_Q`` consecutive query tokens of ONE sequence, times all
  ``HEADS_PER_KV`` query heads that share a kv head (grouped-query attention). Its
  ``BLOCK_M`` rows (a power of two, ``BLOCK_Q = BLOCK_M // HEADS_PER_KV``) are laid out
  token-major: row ``r`` -> token ``r // HEADS_PER_KV``, head ``r % HEADS_PER_KV``. So
  each K/V tile loaded from memory serves every query head of its group (GQA's whole
  point: fewer bytes per FLOP), and a group of 5 heads in 16 rows simply leaves row 15
  masked.
  ``tl.dot`` needs tiles of at least 16 in every dimension, hence ``BLOCK_M >= 16`` even
  for a decode (one token x 4 heads = 4 useful rows out of 16: the extra FLOPs are free
  because decode is limited by memory, not arithmetic).
* **The q-tile schedule** (which sequence and which query offset each program takes) is
  built on the host with a few vectorised torch ops and passed as two small int32 arrays.
  vLLM finds the sequence inside the kernel with a binary search; a lookup table is
  easier to read and costs one load.
* **kv splits** ("flash-decoding"): a batch of 64 decodes x 8 kv heads is only 512
  programs, each streaming 4,096 tokens step after step; on a GPU with 132 SMs that is
  a handful of long programs per SM, and whichever SMs finish first sit idle. Cutting
  each sequence's KV range into ``NUM_SPLITS`` pieces gives many shorter programs; each
  writes a partial (running max, sum, and un-normalised output) and a tiny second kernel
  merges the partials with the same rescaling rule the online softmax uses. Under the
  interpreter the cost is per program, so there we use one split. The GPU choice in
  ``_plan`` is a starting point; ``python -m kvlab.bench kernel`` sweeps it.
* **A KV step** covers ``BLOCK_N`` consecutive token positions, i.e. several pages when
  ``BLOCK_N > block_size``. Each position is translated to its physical block on its own
  (``block_table[seq, pos // block_size]``), so any block size works and a tile may
  straddle pages.

Choices are made on the host (``_plan``): no ``@triton.autotune`` (it does not run under
the interpreter) and no device-side asserts (same reason; ``validate.py`` checks inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._env import INTERPRET
from .validate import validate_unified_attention

__all__ = ["unified_attention"]

_LOG2E = 1.0 / math.log(2.0)  # exp(x) == exp2(x * log2(e)); exp2 is the fast hardware op


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,  # split partials (unused when NUM_SPLITS == 1)
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    tile_seq_ptr,
    tile_q_start_ptr,  # q-tile schedule; tile_seq == -1: idle slot
    qk_scale,  # softmax_scale * log2(e): we use exp2, not exp
    sliding_window,  # W (ignored unless USE_WINDOW)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_block,
    stride_vc_block,
    stride_bt_seq,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (fixed per engine)
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PER_KV: tl.constexpr,  # query heads sharing one kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of the q tile = BLOCK_Q * HEADS_PER_KV (+ padding)
    BLOCK_Q: tl.constexpr,  # query tokens per q tile
    BLOCK_N: tl.constexpr,  # key positions per KV step
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand type for tl.dot (fp32 under the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs exact on GPUs (no TF32)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # ---- which sequence, which query tokens --------------------------------------------
    seq = tl.load(tile_seq_ptr + tile)
    live = seq >= 0  # the grid may be padded with idle slots
    seq = tl.maximum(seq, 0)
    q_tile_start = tl.load(tile_q_start_ptr + tile)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.where(live, tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin, 0)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before the new ones

    rows = tl.arange(0, BLOCK_M)
    row_tok = rows // HEADS_PER_KV  # query token within the tile
    row_head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV
    row_ok = (row_tok < BLOCK_Q) & (q_tile_start + row_tok < q_len)
    row_q_pos = context_len + q_tile_start + row_tok  # absolute position of each query
    q_token = q_begin + q_tile_start + row_tok  # row in q / out

    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_token[:, None] * stride_q_tok + row_head[:, None] * stride_q_head + d[None, :], mask=row_ok[:, None], other=0.0)
    # Fold softmax_scale * log2(e) into q once instead of scaling every score tile.
    q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
    q_pos_col = row_q_pos[:, None]

    # ---- which keys: causal (up to the last query of the tile), maybe windowed ---------
    n_q_rows = tl.minimum(q_len - q_tile_start, BLOCK_Q)
    kv_hi = tl.where(live, context_len + q_tile_start + n_q_rows, 0)  # exclusive
    kv_lo = 0
    if USE_WINDOW:
        # The earliest query of the tile sees keys from (its position - W + 1) on.
        kv_lo = tl.maximum(context_len + q_tile_start - sliding_window + 1, 0)
    kv_begin = (kv_lo // BLOCK_N) * BLOCK_N  # start on a BLOCK_N boundary; masks trim it
    # (Plain integer arithmetic rather than tl.cdiv: every call of a @triton.jit helper
    # costs the interpreter a re-patch of triton.language, ~0.5 ms each.)
    num_steps = (kv_hi - kv_begin + BLOCK_N - 1) // BLOCK_N
    steps_per_split = (num_steps + NUM_SPLITS - 1) // NUM_SPLITS
    lo = kv_begin + split * steps_per_split * BLOCK_N
    hi = tl.minimum(lo + steps_per_split * BLOCK_N, kv_hi)

    # ---- online softmax state, one entry per row, in fp32 ------------------------------
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)  # running sum of p * V

    offs_n = tl.arange(0, BLOCK_N)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # logical key positions
        pos_ok = (pos >= kv_lo) & (pos < hi)

        # 1. Block-table lookup: logical page -> physical block, for every position.
        page = pos // BLOCK_SIZE
        block = tl.load(block_table_row + page, mask=pos_ok, other=0).to(tl.int64)
        # Inside a block the cache is dense [block_size, NUM_KV_HEADS, HEAD_DIM].
        in_block = ((pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM

        # 2. Masked loads: K as [HEAD_DIM, BLOCK_N] (already transposed for q @ K^T),
        #    V as [BLOCK_N, HEAD_DIM]. Positions outside the range read nothing.
        k = tl.load(key_cache_ptr + (block * stride_kc_block + in_block)[None, :] + d[:, None], mask=pos_ok[None, :], other=0.0).to(
            DOT_DTYPE
        )
        v = tl.load(value_cache_ptr + (block * stride_vc_block + in_block)[:, None] + d[None, :], mask=pos_ok[:, None], other=0.0).to(
            DOT_DTYPE
        )

        # 3. Scores, then the mask: in range, causal (and inside the window).
        #    -inf => probability exactly 0 after exp2.
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        key_pos = pos[None, :]
        allowed = pos_ok[None, :] & (key_pos <= q_pos_col)
        if USE_WINDOW:
            allowed = allowed & (key_pos > q_pos_col - sliding_window)
        s = tl.where(allowed, s, float("-inf"))

        # 4. Running max and rescale. A row that has seen no allowed key yet keeps
        #    m = -inf; subtracting 0 instead of -inf keeps exp2 at 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)  # how much the old sums shrink
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # 5. Accumulate p @ V on top of the rescaled old accumulator.
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only idle/padding rows have l == 0
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + q_token[:, None] * stride_o_tok + row_head[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        # Partial results of this split; _merge_splits_kernel combines them.
        part = (q_token * (NUM_KV_HEADS * HEADS_PER_KV) + row_head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,  # [num_tokens * NUM_Q_HEADS rows, NUM_SPLITS (, HEAD_DIM)] fp32
    out_ptr,
    num_rows,  # num_tokens * NUM_Q_HEADS
    stride_o_tok,
    stride_o_head,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,  # (token, head) rows per program
):
    """Combine the splits of each (token, head) row, exactly like one more softmax step.

    Split ``s`` holds ``m_s`` (max score, log2 units), ``l_s = sum 2^(x - m_s)`` and
    ``acc_s = sum 2^(x - m_s) v``. Rescaling all of them to the common max ``M`` gives
    ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, HEAD_DIM)
    ok = (r[:, None] < num_rows) & (s[None, :] < NUM_SPLITS)  # [BLOCK_R, S]
    part = r[:, None] * NUM_SPLITS + s[None, :]
    m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    acc = tl.load(part_out_ptr + part[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None], other=0.0)  # [BLOCK_R, S, D]
    m_max = tl.max(m, axis=1)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # a split that saw no key has m = -inf
    w = tl.exp2(m - m_ref[:, None])
    num = tl.sum(acc * w[:, :, None], axis=1)
    den = tl.sum(l * w, axis=1)
    out = num / tl.where(den == 0.0, 1.0, den)[:, None]
    token = r // NUM_Q_HEADS
    head = r % NUM_Q_HEADS
    tl.store(
        out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(r < num_rows)[:, None],
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """Meta-parameters of one launch, chosen on the host from shapes only (no sync)."""

    block_m: int
    block_q: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


_TRITON_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan(
    q: torch.Tensor, num_kv_heads: int, num_seqs: int, max_kv_len: int, num_splits: int | None = None, block_n: int | None = None
) -> _Plan:
    """Pick tile sizes and the number of KV splits, from shapes alone (no host sync).

    Interpreter: each program costs ~2 ms and each tile op ~0.1 ms almost regardless of
    the tile's size (numpy does the elements), so: fat tiles, few programs, one split.
    GPU: a decode-only batch (as many tokens as sequences) gets the smallest legal q
    tile and its KV is split until there are enough programs for many short waves. The GPU
    numbers are starting points, to be tuned with ``python -m kvlab.bench kernel``.
    ``num_splits`` / ``block_n`` override the choice (tests, benchmark sweeps).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    group_pow2 = triton.next_power_of_2(group)
    decode_only = num_tokens == num_seqs
    if INTERPRET:
        # Measured on a 2-core CPU: 64 x 128 tiles beat both smaller ones (more programs
        # and steps) and larger ones (numpy's matmul starts to dominate).
        block_m = max(16, group_pow2) if decode_only else max(64, group_pow2)
        return _Plan(block_m, block_m // group, block_n or 128, num_splits or 1, 4, 1)
    # Keep K and V tiles (x num_stages buffers) well inside shared memory: a 64-token
    # step for 16-bit head_dim <= 128, shorter steps for fp32 or head_dim 256.
    row_bytes = head_dim * q.element_size()
    block_n = block_n or (64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16)
    block_m = max(16, group_pow2) if decode_only else max(64 if head_dim <= 128 else 32, group_pow2)
    block_q = block_m // group
    if num_splits is None and not decode_only:
        # Prefill tiles already give many programs, and their partials would be large
        # (num_tokens x q heads x splits x head_dim fp32): no split.
        num_splits = 1
    if num_splits is None:
        q_tiles = min(num_tokens, num_tokens // block_q + num_seqs)
        programs = q_tiles * num_kv_heads
        # Aim for >= 16 programs per SM (several short waves: a small tail effect). For the
        # benchmark's 64 decodes x 8 kv heads on a 132-SM H200 this gives 8 splits of
        # 512 tokens (8 steps each). Unmeasured guess: tune with the bench's sweep.
        target = 16 * _sm_count(q.device)
        max_useful = max(1, max_kv_len // (4 * block_n))  # keep >= 4 KV steps per split
        num_splits = 1
        while num_splits * 2 <= min(max_useful, 16) and programs * num_splits < target:
            num_splits *= 2
    # ptxas (sm_90, fp16, head_dim 128): the 16-row decode tile needs 94 registers/thread
    # at 4 warps; a 64-row tile needs 198 at 4 warps but 138 at 8, so give it 8.
    num_warps = 4 if block_m <= 32 else 8
    num_stages = 3 if head_dim <= 64 else 2
    return _Plan(block_m, block_q, block_n, num_splits, num_warps, num_stages)


def _schedule(cu_seqlens_q: torch.Tensor, num_tokens: int, block_q: int, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Map grid slot -> (sequence, first query offset) for every q tile of the batch.

    ``exact``: size the grid to the true tile count. That needs the count on the host,
    free for CPU tensors but a stream-stalling sync for CUDA ones; so on CUDA the grid is
    padded to an upper bound and the idle slots get sequence -1 (their programs do
    nothing). The bound: ceil(q / B) <= q // B + 1 and ceil(q / B) <= q, so the tile count
    is at most min(T, T // B + num_seqs); for a pure decode batch that is exact.

    Example: q_lens [3, 0, 10, 1], B = 4 -> seq [0, 2, 2, 2, 3], q_start [0, 0, 4, 8, 0].
    """
    num_seqs = cu_seqlens_q.shape[0] - 1
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tiles = (q_lens + block_q - 1) // block_q
    ends = torch.cumsum(tiles, 0)
    if exact:
        n_slots = int(ends[-1])
    else:
        n_slots = min(num_tokens, num_tokens // block_q + num_seqs)
    slot = torch.arange(n_slots, device=cu_seqlens_q.device)
    seq = torch.searchsorted(ends, slot, right=True)
    first_tile = (ends - tiles)[seq.clamp(max=num_seqs - 1)]
    q_start = (slot - first_tile) * block_q
    seq = torch.where(seq < num_seqs, seq, -1)
    return seq.to(torch.int32), q_start.to(torch.int32)


def _launch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch without validation: for tests (forcing ``num_splits`` / ``block_n``, both
    powers of two, ``block_n >= 16``) and for the benchmark (no host sync per call)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    plan = _plan(q, num_kv_heads, num_seqs, block_table.shape[1] * block_size, num_splits, block_n)
    tile_seq, tile_q_start = _schedule(cu_seqlens_q, num_tokens, plan.block_q, exact=cu_seqlens_q.device.type == "cpu")
    if tile_seq.numel() == 0:
        return out
    if plan.num_splits > 1:
        part_out = torch.empty((num_tokens, num_q_heads, plan.num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_tokens, num_q_heads, plan.num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # never touched; any tensor will do
    if INTERPRET:
        dot_dtype = tl.float32  # numpy matmul on bf16 (stored as uint16) would be garbage
    else:
        dot_dtype = _TRITON_DTYPE[q.dtype]
    grid = (tile_seq.numel(), num_kv_heads, plan.num_splits)
    _unified_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        part_out,
        part_m,
        part_l,
        cu_seqlens_q,
        seq_lens,
        block_table,
        tile_seq,
        tile_q_start,
        float(softmax_scale) * _LOG2E,
        0 if sliding_window is None else int(sliding_window),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        value_cache.stride(0),
        block_table.stride(0),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        BLOCK_N=plan.block_n,
        NUM_SPLITS=plan.num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if plan.num_splits > 1:
        splits_pow2 = triton.next_power_of_2(plan.num_splits)
        num_rows = num_tokens * num_q_heads
        # Interpreter: few fat programs. GPU: ~4K fp32 values per program.
        budget = 1 << 16 if INTERPRET else 4096
        block_r = min(triton.next_power_of_2(num_rows), max(1, budget // (splits_pow2 * head_dim)))
        _merge_splits_kernel[(triton.cdiv(num_rows, block_r),)](
            part_out,
            part_m,
            part_l,
            out,
            num_rows,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=plan.num_splits,
            SPLITS_POW2=splits_pow2,
            BLOCK_R=block_r,
            num_warps=4,
        )
    return out


def unified_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed prefill/decode batch; returns ``out`` like ``q``.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``; fp16, bf16 or fp32; head_dim a power
            of two in [16, 256]; last dim contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            same dtype as q, any block stride, dense inside a block.
        cu_seqlens_q: int32 ``[num_seqs + 1]``; sequence ``s`` owns query rows
            ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``.
        seq_lens: int32 ``[num_seqs]``, context + new tokens (new = the last q_len).
        block_table: int32 ``[num_seqs, max_blocks]``, physical block of each page.
        softmax_scale: usually ``head_dim ** -0.5``.
        sliding_window: ``W`` lets position ``p`` see keys ``p-W+1 .. p``; None = full.
    """
    validate_unified_attention(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window)
    return _launch(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window)
