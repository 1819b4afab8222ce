"""Mutation tests for the kernel exercises (run under the Triton interpreter on CPU)."""

from __future__ import annotations


import pytest

import kvlab.kernels  # noqa: F401, I001  (first: it picks the Triton mode before triton is imported)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.exercises import (
    check,  # imports kvlab.kernels first: it picks the Triton mode
)


@triton.jit
def step_ok(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # Written differently from the notebook's solution: exp2 with log2(e) folded in.
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    blk = tl.load(block_table_ptr + start // BLOCK_SIZE)
    inside = (start + offs) < seq_len
    base = blk * stride_block + offs[:, None] * stride_tok + d[None, :]
    k = tl.load(k_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    s = tl.where(inside, tl.sum(k * q[None, :], axis=1) * (scale * 1.4426950408889634), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    corr = tl.exp2((m_i - m_new) * 1.4426950408889634 / 1.4426950408889634)
    p = tl.exp2(s - m_new)
    return m_new, l_i * corr + tl.sum(p, axis=0), acc * corr + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def step_no_mask(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    blk = tl.load(block_table_ptr + start // BLOCK_SIZE)
    base = blk * stride_block + offs[:, None] * stride_tok + d[None, :]
    k = tl.load(k_cache_ptr + base).to(tl.float32)
    v = tl.load(v_cache_ptr + base).to(tl.float32)
    s = tl.sum(k * q[None, :], axis=1) * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def step_no_running_max(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    blk = tl.load(block_table_ptr + start // BLOCK_SIZE)
    inside = (start + offs) < seq_len
    base = blk * stride_block + offs[:, None] * stride_tok + d[None, :]
    k = tl.load(k_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    s = tl.where(inside, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    p = tl.exp(s)
    return m_i, l_i + tl.sum(p, axis=0), acc + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def step_logical_block(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    blk = start // BLOCK_SIZE  # forgot the block table
    inside = (start + offs) < seq_len
    base = blk * stride_block + offs[:, None] * stride_tok + d[None, :]
    k = tl.load(k_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    s = tl.where(inside, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def step_no_rescale(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    blk = tl.load(block_table_ptr + start // BLOCK_SIZE)
    inside = (start + offs) < seq_len
    base = blk * stride_block + offs[:, None] * stride_tok + d[None, :]
    k = tl.load(k_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    s = tl.where(inside, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def step_stub(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    raise NotImplementedError("your code here")


def test_kernel_checker_accepts_a_differently_written_step():
    res = check("paged_attention_kernel", step_ok)
    assert res, str(res)


@pytest.mark.parametrize(
    "step,idea",
    [
        (step_no_mask, "the block lookup is right, but the slots past seq_len"),
        (step_no_running_max, "running max"),
        (step_logical_block, "read logical block j as if it were physical block j"),
        (step_no_rescale, ""),
    ],
    ids=["missing mask", "no running max", "logical block as physical", "no rescale of acc"],
)
def test_kernel_checker_rejects_classic_bugs(step, idea):
    res = check("paged_attention_kernel", step)
    assert not res and not res.not_implemented, str(res)
    assert idea in str(res), str(res)


def test_kernel_checker_tells_a_missing_lookup_from_a_missing_mask():
    """The two mistakes used to get one message; each now names only its own fix."""
    no_mask, logical = str(check("paged_attention_kernel", step_no_mask)), str(check("paged_attention_kernel", step_logical_block))
    assert "mask the loads" in no_mask and "look the block up" not in no_mask
    assert "look the block up" in logical and "mask the loads" not in logical


def test_kernel_stub_reports_not_implemented():
    res = check("paged_attention_kernel", step_stub)
    assert res.not_implemented, str(res)


SLOT_WRONG = {
    "off by one": lambda bt, s, n, bs: [bt[p // bs] * bs + p % bs for p in range(s + 1, s + n + 1)],
    "positions as slots": lambda bt, s, n, bs: list(range(s, s + n)),
    "block index not looked up": lambda bt, s, n, bs: [p for p in range(s, s + n)],
    "offset from 0 every chunk": lambda bt, s, n, bs: [bt[p // bs] * bs + p % bs for p in range(n)],
}


@pytest.mark.parametrize("name", sorted(SLOT_WRONG))
def test_slot_mapping_rejects(name):
    res = check("slot_mapping", SLOT_WRONG[name])
    assert not res and "expected" in str(res)


def test_slot_mapping_accepts_alternative():
    def slots(block_table, start_pos, num_tokens, block_size):
        out = []
        for p in range(start_pos, start_pos + num_tokens):
            blk, off = divmod(p, block_size)
            out.append(block_table[blk] * block_size + off)
        return out

    assert check("slot_mapping", slots)


def test_a_failing_kernel_check_draws_the_learners_loads():
    """Forgetting the block table sends loads into other blocks (block 0 included); the
    check says so and ``show()`` draws the loads against the table."""
    res = check("paged_attention_kernel", step_logical_block)
    assert not res and "your kernel's loads: seq0: 37 slots loaded that its table does not hold" in str(res)
    assert "result.show() draws them" in str(res)
    fig = res.show()
    titles = [a.text for a in fig.layout.annotations if a.text.startswith("Attention read")]
    assert [t.split(" · ")[1].split("<br>")[0] for t in titles] == ["seq0", "seq1", "seq2"]
    assert any(
        "✖ 0 (null)" in str(list(ax.ticktext or ()))
        for k, ax in fig.layout.to_plotly_json().items()
        if k.startswith("yaxis")
        for ax in [fig.layout[k]]
    )
    res = check("paged_attention_kernel", step_no_mask)  # loads past the end of each sequence
    assert "seq0: 11 slots loaded that its table does not hold" in str(res)
    d = res.extra["kernel_reads"]
    from kvlab.timeline import Timeline
    from kvlab.viz import kernel

    tl = Timeline(d)
    b = tl.attention_batch(1)
    g = kernel.figure_data(tl.at(1), "seq0", batch=b, at_batch=tl.after_event(b.seq))["groups"][0]
    assert g["past_end_loads"] == 11 and g["stray_blocks"] == [] and not g["missed"]
