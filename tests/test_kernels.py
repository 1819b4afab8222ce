"""Triton kernels vs their torch references.

Without a GPU every kernel here runs under the Triton interpreter, where each program
costs a few milliseconds: the batches are small (a handful of sequences, one or two kv
heads) but cover every axis that matters: shuffled physical blocks, GQA ratios 1/4/5,
head_dim 32/64/128, block sizes 16/32, mixed prefill+context+decode batches, sliding
windows (smaller than a block, spanning blocks, of size 1), fp32/fp16/bf16, strided
``kv[:, 0]`` cache views, skipped (-1) slots, forced KV splits.

Device variants: ``interp`` runs where the interpreter is active; ``cuda`` (marked
``gpu``) runs the same comparisons compiled on a GPU and is skipped elsewhere.

Poisoning: every cache slot the kernel must NOT read (unused blocks, the tail of a
sequence's last block, pages before a sliding window) holds NaN, and block-table entries
that must not be read hold -1. A single stray load therefore turns the output into NaN
instead of hiding inside the tolerance.
"""

from __future__ import annotations

import ast
import math
import os
import pathlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import kvlab.kernels as K
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvlab.kernels.attention import _launch, _schedule

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    pytest.param("interp", id="interp", marks=pytest.mark.skipif(not K.INTERPRET, reason="compiled mode: see the cuda variant")),
    pytest.param(
        "cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA or K.INTERPRET, reason="needs CUDA (compiled Triton)")]
    ),
]


def _device(variant: str) -> str:
    return K.DEVICE if variant == "interp" else "cuda"


# Tolerances (kernel vs reference, both reading the same rounded inputs):
# * fp32: both accumulate in fp32; they differ only in summation order (online softmax in
#   tiles vs one dense softmax), a few ulps over a few hundred keys -> 1e-5.
# * fp16: both compute in fp32 and round the output to fp16 once, so results may differ by
#   one fp16 ulp (2^-9 ~ 2e-3 at |x| in [2, 4)). On a GPU the kernel also rounds
#   q * scale and the probabilities to fp16 for the tensor-core dots (relative 2^-11 per
#   term, averaging out over the keys). atol 1e-3 + rtol 1e-3 covers both.
# * bf16: same argument with bf16's 8-bit mantissa: one output ulp is 2^-6 ~ 1.6e-2 at
#   |x| in [2, 4) and P is rounded to bf16 (2^-8) on a GPU -> atol 2e-2, rtol 1e-2.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
}


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the kernel output: it read a poisoned (unused) slot"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[ref.dtype])


# ----------------------------------------------------------------------------------------
# Batch builder
# ----------------------------------------------------------------------------------------


@dataclass
class Batch:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scale: float
    window: int | None

    def args(self) -> tuple:
        return (self.q, self.key_cache, self.value_cache, self.cu_seqlens_q, self.seq_lens, self.block_table, self.scale, self.window)


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    *,
    device: str,
    interleaved: bool = True,
    seed: int = 0,
) -> Batch:
    """A batch whose sequences live in randomly placed blocks of a poisoned cache.

    ``interleaved``: caches are ``kv[:, 0]`` / ``kv[:, 1]`` of one
    ``[num_blocks, 2, block_size, H, D]`` tensor (non-contiguous, as in the runner).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3  # 3 spare blocks, never referenced
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(pages) + 2), -1, dtype=torch.int32)  # 2 padding columns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if interleaved:
        kv = torch.full((num_blocks, 2, *shape[1:]), float("nan"), dtype=dtype)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
    else:
        key_cache = torch.full(shape, float("nan"), dtype=dtype)
        value_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for s, (n, p) in enumerate(zip(seq_lens, pages)):
        table[s, :p] = perm[used : used + p].to(torch.int32)
        used += p
        pos = torch.arange(n)
        blocks, offs = table[s, pos // block_size].long(), pos % block_size
        key_cache[blocks, offs] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        value_cache[blocks, offs] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        if window is not None:
            # Pages entirely before the first query's window are never read: mark them -1.
            first_key = max(0, ctx_lens[s] - window + 1)
            table[s, : first_key // block_size] = -1
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if device != "cpu":
        if interleaved:
            kv = kv.to(device)
            key_cache, value_cache = kv[:, 0], kv[:, 1]
        else:
            key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    return Batch(
        q.to(device),
        key_cache,
        value_cache,
        cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        table.to(device),
        head_dim**-0.5,
        window,
    )


# id: (q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window)
CASES = {
    # decode + prefill-with-cached-context + fresh prefill, GQA 4
    "mixed-gqa4-d64-bs16-fp32": ([1, 5, 37], [130, 18, 0], 8, 2, 64, 16, torch.float32, None),
    # GQA 5 (non power of two: 3 tokens x 5 heads fill 15 of 16 rows), window across blocks
    "mixed-gqa5-d32-bs32-fp16-w20": ([1, 5, 37], [130, 18, 0], 10, 2, 32, 32, torch.float16, 20),
    "decode-gqa1-d128-bs16-fp16": ([1, 1, 1], [200, 15, 33], 2, 2, 128, 16, torch.float16, None),
    # window smaller than a block: most of each sequence's pages are skipped (-1)
    "window5-smaller-than-block-fp32": ([1, 37], [70, 10], 4, 1, 64, 16, torch.float32, 5),
    # window spanning several blocks, decodes and a chunked-prefill continuation
    "window40-spans-blocks-gqa4-fp16": ([5, 37, 1], [130, 18, 90], 4, 1, 64, 16, torch.float16, 40),
    "window1-only-itself-fp32": ([3, 1], [20, 33], 2, 1, 32, 16, torch.float32, 1),
    "bf16-gqa4-d64": ([1, 5], [40, 18], 8, 2, 64, 16, torch.bfloat16, None),
    "prefill-only-gqa5-d32-fp32": ([37], [0], 5, 1, 32, 16, torch.float32, None),
    "chunk-after-130-gqa4-d128-bs32-fp16-w64": ([37], [130], 4, 1, 128, 32, torch.float16, 64),
    # a sequence with no new tokens this step, next to ones that have some
    "zero-q-len-seq-fp32": ([3, 0, 1], [10, 25, 40], 2, 1, 64, 16, torch.float32, None),
}


# ----------------------------------------------------------------------------------------
# unified_attention
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_unified_attention_matches_reference(case: str, variant: str) -> None:
    b = make_batch(*CASES[case], device=_device(variant))
    out = K.unified_attention(*b.args())
    assert_close(out, K.unified_attention_ref(*b.args()))


@pytest.mark.parametrize("variant", DEVICES)
def test_contiguous_caches_and_strided_q(variant: str) -> None:
    """Separately allocated caches, and q as a strided slice of a fused projection."""
    b = make_batch([1, 5, 37], [130, 18, 0], 8, 2, 64, 16, torch.float16, device=_device(variant), interleaved=False, seed=3)
    assert b.key_cache.is_contiguous()
    fused = torch.zeros(b.q.shape[0], 12, 64, dtype=b.q.dtype, device=b.q.device)
    fused[:, 2:10] = b.q
    b.q = fused[:, 2:10]
    assert not b.q.is_contiguous()
    assert_close(K.unified_attention(*b.args()), K.unified_attention_ref(*b.args()))


# The GPU path splits long KV ranges and merges the partials; force it here so the
# interpreter checks the merge too (including splits that see no key: the window case),
# and force small KV steps so one step can be smaller than a page or span several.
@pytest.mark.parametrize("variant", DEVICES)
@pytest.mark.parametrize(
    "case,num_splits,block_n",
    [
        ("mixed-gqa4-d64-bs16-fp32", 3, None),
        ("window40-spans-blocks-gqa4-fp16", 2, 32),  # some splits lie wholly outside the window
        ("decode-gqa1-d128-bs16-fp16", 4, 64),  # 64-token steps = 4 pages each
        ("chunk-after-130-gqa4-d128-bs32-fp16-w64", 1, 16),  # 16-token steps inside 32-token pages
    ],
)
def test_forced_splits_and_step_sizes(case: str, num_splits: int, block_n: int | None, variant: str) -> None:
    b = make_batch(*CASES[case], device=_device(variant), seed=1)
    out = _launch(*b.args(), num_splits=num_splits, block_n=block_n)
    assert_close(out, K.unified_attention_ref(*b.args()))


@pytest.mark.skipif(not K.INTERPRET, reason="interpreter variant (the cuda variants cover GPUs)")
@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(
    seqs=st.lists(st.tuples(st.sampled_from([1, 1, 2, 5, 19]), st.integers(0, 150)), min_size=1, max_size=3),
    group=st.sampled_from([1, 3, 4]),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 80)),
)
def test_random_batches_property(seqs: list[tuple[int, int]], group: int, block_size: int, window: int | None) -> None:
    """Random mixes of decodes/prefills, contexts, GQA 1/3/4, windows from 1 to 80."""
    q_lens, ctx = [s[0] for s in seqs], [s[1] for s in seqs]
    b = make_batch(q_lens, ctx, group, 1, 32, block_size, torch.float32, window, device=K.DEVICE)
    assert_close(K.unified_attention(*b.args()), K.unified_attention_ref(*b.args()))


@pytest.mark.parametrize("variant", DEVICES)
def test_prefill_in_chunks_then_decode_matches_dense_attention(variant: str) -> None:
    """The full pipeline of two engine steps, checked against plain dense attention.

    Step 1: sequence A prefills its first 20 tokens. Step 2: A prefills its next 17 (a
    chunked prefill: 20 tokens of context) while B (12 tokens cached earlier) decodes one.
    Each step writes its new K/V with reshape_and_cache through the block table, then
    attends. The oracle never sees pages: it is causal attention over contiguous K/V, so
    it checks the reference and the kernels at once.
    """
    device = _device(variant)
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, bs, num_blocks = 4, 2, 32, 16, 9
    len_a, len_b = 37, 13
    k_a, v_a, q_a = (torch.randn(len_a, h, d, generator=gen) for h in (hkv, hkv, hq))
    k_b, v_b, q_b = (torch.randn(len_b, h, d, generator=gen) for h in (hkv, hkv, hq))
    kv = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), device=device)
    kc, vc = kv[:, 0], kv[:, 1]
    table = torch.tensor([[7, 2, 5], [4, 0, -1]], dtype=torch.int32, device=device)

    def slots(seq: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=device)
        return table[seq, pos // bs].long() * bs + pos % bs

    # B's first 12 tokens were cached by an earlier step.
    K.reshape_and_cache(k_b[:12].to(device), v_b[:12].to(device), kc, vc, slots(1, 0, 12))
    # Step 1.
    K.reshape_and_cache(k_a[:20].to(device), v_a[:20].to(device), kc, vc, slots(0, 0, 20))
    out1 = K.unified_attention(
        q_a[:20].to(device),
        kc,
        vc,
        torch.tensor([0, 20], dtype=torch.int32, device=device),
        torch.tensor([20], dtype=torch.int32, device=device),
        table[:1],
        d**-0.5,
    )
    # Step 2: A's second chunk and B's decode in one batch.
    new_k = torch.cat([k_a[20:], k_b[12:]]).to(device)
    new_v = torch.cat([v_a[20:], v_b[12:]]).to(device)
    K.reshape_and_cache(new_k, new_v, kc, vc, torch.cat([slots(0, 20, 37), slots(1, 12, 13)]))
    out2 = K.unified_attention(
        torch.cat([q_a[20:], q_b[12:]]).to(device),
        kc,
        vc,
        torch.tensor([0, 17, 18], dtype=torch.int32, device=device),
        torch.tensor([37, 13], dtype=torch.int32, device=device),
        table,
        d**-0.5,
    )

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_, k_, v_ = (x.transpose(0, 1) for x in (q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)))
        n_q, n_k = q.shape[0], k.shape[0]
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)  # queries are the last n_q positions
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask).transpose(0, 1)

    assert_close(out1, dense(q_a[:20], k_a[:20], v_a[:20]))
    assert_close(out2[:17], dense(q_a[20:], k_a, v_a))
    assert_close(out2[17:], dense(q_b[12:], k_b, v_b))


def test_reference_agrees_with_sdpa_sliding_window() -> None:
    """The reference's window rule is vLLM's: position p sees p-W+1 .. p (W keys)."""
    b = make_batch([6], [10], 2, 1, 32, 16, torch.float32, 4, device="cpu", seed=5)
    ref = K.unified_attention_ref(*b.args())
    pos_q = torch.arange(10, 16)[:, None]
    pos_k = torch.arange(16)[None, :]
    mask = (pos_k <= pos_q) & (pos_k > pos_q - 4)
    assert mask.sum(1).tolist() == [4] * 6
    table = b.block_table[0]
    k = b.key_cache[table[:1].long()].reshape(-1, 1, 32)[:16]
    v = b.value_cache[table[:1].long()].reshape(-1, 1, 32)[:16]
    dense = torch.nn.functional.scaled_dot_product_attention(
        b.q.transpose(0, 1), k.expand(-1, 2, -1).transpose(0, 1), v.expand(-1, 2, -1).transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)


def test_empty_batch_returns_empty() -> None:
    b = make_batch([1], [3], 2, 1, 32, 16, torch.float32, device=K.DEVICE)
    q = b.q[:0]
    cu = torch.zeros(1, dtype=torch.int32, device=K.DEVICE)
    out = K.unified_attention(q, b.key_cache, b.value_cache, cu, b.seq_lens[:0], b.block_table[:0], 0.1)
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("exact", [True, False])
def test_schedule_maps_tiles_to_sequences(exact: bool) -> None:
    cu = torch.tensor([0, 3, 3, 13, 14], dtype=torch.int32)
    seq, start = _schedule(cu, num_tokens=14, block_q=4, exact=exact)
    n_real = 5
    assert seq[:n_real].tolist() == [0, 2, 2, 2, 3]
    assert start[:n_real].tolist() == [0, 0, 4, 8, 0]
    if not exact:  # padded to min(14, 14 // 4 + 4) = 7 slots; the rest idle
        assert seq.tolist()[n_real:] == [-1, -1] and start.numel() == 7
    # A pure decode batch: the bound min(T, T // B + num_seqs) is exact.
    seq, start = _schedule(torch.arange(6, dtype=torch.int32), num_tokens=5, block_q=4, exact=False)
    assert seq.tolist() == [0, 1, 2, 3, 4] and start.tolist() == [0] * 5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or K.INTERPRET, reason="needs CUDA (compiled Triton)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_batch_with_automatic_splits_gpu(dtype: torch.dtype) -> None:
    """The benchmark's shape, scaled to 1,024-token contexts: the planner splits KV here."""
    b = make_batch([1] * 64, [1023] * 64, 32, 8, 128, 16, dtype, device="cuda", seed=11)
    assert_close(K.unified_attention(*b.args()), K.unified_attention_ref(*b.args()))


# ----------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", DEVICES)
@pytest.mark.parametrize(
    "num_tokens,heads,head_dim,block_size,dtype",
    [
        (37, 2, 64, 16, torch.float32),
        (200, 1, 128, 32, torch.float16),  # more tokens than one interpreter program takes
        (9, 5, 32, 16, torch.bfloat16),  # 5 heads x 32: a row of 160, padded to 256
    ],
)
def test_reshape_and_cache_matches_reference(
    num_tokens: int, heads: int, head_dim: int, block_size: int, dtype: torch.dtype, variant: str
) -> None:
    device = _device(variant)
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = -(-num_tokens // block_size) + 2
    # key/value as strided slices of one fused projection output, as a model produces them
    fused = torch.randn(num_tokens, 3, heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = fused[:, 1], fused[:, 2]
    kv = torch.randn(num_blocks, 2, block_size, heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens: skipped
    slots = slots.to(device)
    expected = kv.clone()
    K.reshape_and_cache_ref(key, value, expected[:, 0], expected[:, 1], slots)
    before = kv.clone()
    K.reshape_and_cache(key, value, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(kv, expected)  # a copy: bit-exact
    # Independently of the reference: every slot nobody wrote keeps its old K and V.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(num_blocks, block_size)
    assert torch.equal(kv.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched])


def test_reshape_and_cache_all_skipped_and_empty() -> None:
    kv = torch.randn(2, 2, 16, 1, 32, device=K.DEVICE)
    before = kv.clone()
    key = torch.randn(3, 1, 32, device=K.DEVICE)
    K.reshape_and_cache(key, key, kv[:, 0], kv[:, 1], torch.full((3,), -1, dtype=torch.int64, device=K.DEVICE))
    K.reshape_and_cache(key[:0], key[:0], kv[:, 0], kv[:, 1], torch.empty(0, dtype=torch.int64, device=K.DEVICE))
    assert torch.equal(kv, before)


# ----------------------------------------------------------------------------------------
# Validation: every bad input raises before launch, naming the argument
# ----------------------------------------------------------------------------------------


def _rc_args() -> dict:
    kv = torch.zeros(4, 2, 16, 2, 32, device=K.DEVICE)
    return dict(
        key=torch.zeros(5, 2, 32, device=K.DEVICE),
        value=torch.zeros(5, 2, 32, device=K.DEVICE),
        key_cache=kv[:, 0],
        value_cache=kv[:, 1],
        slot_mapping=torch.tensor([0, 17, -1, 63, 5], dtype=torch.int64, device=K.DEVICE),
    )


def _ua_args() -> dict:
    b = make_batch([1, 5], [20, 3], 4, 2, 32, 16, torch.float32, device=K.DEVICE)
    return dict(
        q=b.q,
        key_cache=b.key_cache,
        value_cache=b.value_cache,
        cu_seqlens_q=b.cu_seqlens_q,
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        softmax_scale=b.scale,
        sliding_window=None,
    )


def _set(name: str, fn):
    def mutate(a: dict) -> dict:
        a[name] = fn(a)
        return a

    return mutate


RC_BAD = [
    ("key-not-tensor", _set("key", lambda a: [[0.0]]), TypeError, r"key must be a torch.Tensor"),
    ("key-2d", _set("key", lambda a: a["key"][:, 0]), ValueError, r"key must be 3-D"),
    ("value-shape", _set("value", lambda a: a["value"][:4]), ValueError, r"value must have the shape"),
    ("key-int", _set("key", lambda a: a["key"].int()), ValueError, r"key has dtype int32"),
    ("value-dtype", _set("value", lambda a: a["value"].half()), ValueError, r"value has dtype"),
    ("cache-dtype", _set("key_cache", lambda a: a["key_cache"].half()), ValueError, r"key_cache has dtype"),
    (
        "cache-heads",
        lambda a: {**a, "key_cache": torch.zeros(4, 16, 1, 64, device=K.DEVICE), "value_cache": torch.zeros(4, 16, 1, 64, device=K.DEVICE)},
        ValueError,
        r"key_cache holds \[num_kv_heads, head_dim\] = \(1, 64\) per token but key has \(2, 32\)",
    ),
    (
        "cache-not-dense",
        _set("key_cache", lambda a: a["key_cache"].transpose(1, 2)),
        ValueError,
        r"key_cache must be dense inside each block",
    ),
    ("value-cache-shape", _set("value_cache", lambda a: a["value_cache"][:3]), ValueError, r"value_cache must have the shape"),
    ("slots-int32", _set("slot_mapping", lambda a: a["slot_mapping"].int()), ValueError, r"slot_mapping has dtype int32"),
    ("slots-length", _set("slot_mapping", lambda a: a["slot_mapping"][:4]), ValueError, r"slot_mapping has 4 entries"),
    (
        "slot-too-big",
        _set("slot_mapping", lambda a: a["slot_mapping"].index_fill(0, torch.tensor([3]), 64)),
        ValueError,
        r"slot_mapping\[3\] = 64 is outside the cache.*< num_blocks \* block_size = 4 \* 16 = 64",
    ),
    (
        "slot-duplicate",
        _set("slot_mapping", lambda a: a["slot_mapping"].index_fill(0, torch.tensor([4]), 17)),
        ValueError,
        r"slot_mapping\[1\] and slot_mapping\[4\] both name slot 17",
    ),
    ("slots-other-device", _set("slot_mapping", lambda a: a["slot_mapping"].to("meta")), ValueError, r"slot_mapping is on meta"),
]


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in RC_BAD])
def test_reshape_and_cache_rejects(mutate, exc, match) -> None:
    with pytest.raises(exc, match=match):
        K.reshape_and_cache(**mutate(_rc_args()))


UA_BAD = [
    ("q-not-tensor", _set("q", lambda a: 1.0), TypeError, r"q must be a torch.Tensor"),
    ("scale-str", _set("softmax_scale", lambda a: "0.1"), TypeError, r"softmax_scale must be a float"),
    ("scale-nan", _set("softmax_scale", lambda a: math.nan), ValueError, r"softmax_scale must be a positive"),
    ("window-zero", _set("sliding_window", lambda a: 0), ValueError, r"sliding_window must be >= 1"),
    ("window-float", _set("sliding_window", lambda a: 2.5), TypeError, r"sliding_window must be None or an int"),
    ("q-2d", _set("q", lambda a: a["q"][:, 0]), ValueError, r"q must be 3-D"),
    ("q-dtype", _set("q", lambda a: a["q"].half()), ValueError, r"key_cache has dtype .* but q has"),
    (
        "q-last-dim-strided",
        _set("q", lambda a: torch.zeros(6, 4, 64, device=K.DEVICE)[:, :, ::2]),
        ValueError,
        r"q must have a contiguous last dimension",
    ),
    (
        "head-dim-48",
        lambda a: {
            **a,
            "q": torch.zeros(6, 4, 48, device=K.DEVICE),
            "key_cache": torch.zeros(9, 16, 2, 48, device=K.DEVICE),
            "value_cache": torch.zeros(9, 16, 2, 48, device=K.DEVICE),
        },
        ValueError,
        r"q has head_dim 48; .*powers of two",
    ),
    (
        "gqa-not-multiple",
        _set("q", lambda a: torch.zeros(6, 3, 32, device=K.DEVICE)),
        ValueError,
        r"q has 3 heads, which must be a multiple of key_cache's 2",
    ),
    ("value-cache-shape", _set("value_cache", lambda a: a["value_cache"][:, :8]), ValueError, r"value_cache must have the shape"),
    ("cu-int64", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long()), ValueError, r"cu_seqlens_q has dtype int64"),
    ("seq-lens-int64", _set("seq_lens", lambda a: a["seq_lens"].long()), ValueError, r"seq_lens has dtype int64"),
    ("cu-length", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:2]), ValueError, r"cu_seqlens_q must have num_seqs \+ 1 = 3 entries"),
    ("cu-first", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"] + 1), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    (
        "cu-decreasing",
        _set("cu_seqlens_q", lambda a: torch.tensor([0, 7, 6], dtype=torch.int32, device=K.DEVICE)),
        ValueError,
        r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[2\] = 6 < cu_seqlens_q\[1\] = 7",
    ),
    (
        "cu-total",
        _set("cu_seqlens_q", lambda a: torch.tensor([0, 1, 5], dtype=torch.int32, device=K.DEVICE)),
        ValueError,
        r"cu_seqlens_q\[-1\] must equal the number of query tokens in q \(6\)",
    ),
    (
        "seq-len-negative",
        lambda a: {
            **a,
            "q": a["q"][:1],
            "cu_seqlens_q": torch.tensor([0, 1, 1], dtype=torch.int32, device=K.DEVICE),
            "seq_lens": torch.tensor([21, -3], dtype=torch.int32, device=K.DEVICE),
        },
        ValueError,
        r"seq_lens\[1\] = -3 is negative",
    ),
    (
        "seq-len-short",
        _set("seq_lens", lambda a: torch.tensor([21, 4], dtype=torch.int32, device=K.DEVICE)),
        ValueError,
        r"seq_lens\[1\] = 4 is shorter than the sequence's 5 query tokens",
    ),
    ("table-rows", _set("block_table", lambda a: a["block_table"][:1]), ValueError, r"block_table must have one row per sequence"),
    (
        "table-columns",
        _set("block_table", lambda a: a["block_table"][:, :1].contiguous()),
        ValueError,
        r"block_table has 1 columns but sequence 0 .* needs 2",
    ),
    (
        "table-id-too-big",
        _set("block_table", lambda a: a["block_table"].index_fill(1, torch.tensor([1]), 99)),
        ValueError,
        r"block_table\[0, 1\] = 99 is not a valid block id.*\[0, num_blocks = \d+\)",
    ),
    (
        "table-id-negative",
        _set("block_table", lambda a: a["block_table"].index_fill(1, torch.tensor([0]), -1)),
        ValueError,
        r"block_table\[0, 0\] = -1 is not a valid block id",
    ),
    (
        "table-not-contiguous",
        _set("block_table", lambda a: a["block_table"].t().contiguous().t()),
        ValueError,
        r"block_table must be contiguous",
    ),
    ("table-other-device", _set("block_table", lambda a: a["block_table"].to("meta")), ValueError, r"block_table is on meta"),
]


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in UA_BAD])
def test_unified_attention_rejects(mutate, exc, match) -> None:
    with pytest.raises(exc, match=match):
        K.unified_attention(**mutate(_ua_args()))


def test_padding_columns_and_pages_before_the_window_may_hold_anything() -> None:
    """Only the columns a sequence reads are checked (vLLM pads with the null block)."""
    a = _ua_args()
    a["block_table"][:, -2:] = 12345  # padding columns: never read
    K.unified_attention(**a)
    a = _ua_args()
    a["sliding_window"] = 2  # seq 0: query at 20 sees 19..20: page 0 unused
    a["block_table"][0, 0] = -7
    K.unified_attention(**a)


# ----------------------------------------------------------------------------------------
# Mode selection (kernels/_env.py)
# ----------------------------------------------------------------------------------------


def test_mode_and_device() -> None:
    assert K.DEVICE == ("cuda" if HAS_CUDA else "cpu")
    if not HAS_CUDA:
        assert K.INTERPRET and os.environ["TRITON_INTERPRET"] == "1"


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.skipif(HAS_CUDA, reason="the mismatch under test is triton compiled-mode on a CPU-only machine")
def test_triton_imported_first_in_compiled_mode_is_refused() -> None:
    res = _run_python("""
        import triton  # without TRITON_INTERPRET: tl.max & co. are built as compiled functions
        try:
            import kvlab.kernels
        except RuntimeError as e:
            print("REFUSED:", e)
    """)
    assert "REFUSED:" in res.stdout, res.stderr
    assert "import kvlab.kernels before" in res.stdout and "TRITON_INTERPRET=1" in res.stdout


_CROSS_COMPILE = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
torch.cuda.is_available = lambda: True          # make kvlab.kernels choose compiled mode
import kvlab.kernels as K
assert not K.INTERPRET
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from kvlab.kernels.attention import _unified_attention_kernel, _merge_splits_kernel
from kvlab.kernels.cache_ops import _reshape_and_cache_kernel

def build(fn, types, consts, **options):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # What the launcher infers at run time: 16-byte aligned pointers, strides % 16 == 0.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n.startswith("stride_")}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)

ptr = lambda dt: {n: "*" + dt for n in ("q_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}
meta = {n: "*i32" for n in ("cu_seqlens_q_ptr", "seq_lens_ptr", "block_table_ptr", "tile_seq_ptr",
                            "tile_q_start_ptr")}
parts = {n: "*fp32" for n in ("part_out_ptr", "part_m_ptr", "part_l_ptr")}
common = dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_N=64, DOT_PRECISION="tf32")
# the benchmark's decode tile (GQA 4, split KV, fp16) ...
decode = build(_unified_attention_kernel, {**ptr("fp16"), **meta, **parts, "qk_scale": "fp32"},
               dict(common, HEADS_PER_KV=4, BLOCK_M=16, BLOCK_Q=4, NUM_SPLITS=8, USE_WINDOW=False,
                    DOT_DTYPE=tl.float16), num_warps=4, num_stages=2)
# ... and a windowed prefill tile with GQA 5 in bf16, unsplit
build(_unified_attention_kernel, {**ptr("bf16"), **meta, **parts, "qk_scale": "fp32"},
      dict(common, HEADS_PER_KV=5, BLOCK_M=64, BLOCK_Q=12, NUM_SPLITS=1, USE_WINDOW=True,
           DOT_DTYPE=tl.bfloat16), num_warps=8, num_stages=2)
build(_merge_splits_kernel, {**parts, "out_ptr": "*fp16"},
      dict(NUM_Q_HEADS=32, HEAD_DIM=128, NUM_SPLITS=8, SPLITS_POW2=8, BLOCK_R=4), num_warps=4)
build(_reshape_and_cache_kernel, {"key_ptr": "*fp16", "value_ptr": "*fp16", "key_cache_ptr": "*fp16",
                                  "value_cache_ptr": "*fp16", "slot_mapping_ptr": "*i64"},
      dict(BLOCK_SIZE=16, NUM_HEADS=8, HEAD_DIM=128, BLOCK_T=8, BLOCK_HD=1024), num_warps=4)
ptx = decode.asm["ptx"]
print("CP_ASYNC" if "cp.async" in ptx else "NO_CP_ASYNC", "MMA" if "mma.sync" in ptx else "NO_MMA")
"""


def _ptxas_available() -> bool:
    import triton  # safe: kvlab.kernels (imported above) already fixed the mode

    return (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU machine the cuda variants compile for real")
@pytest.mark.skipif(not _ptxas_available(), reason="this triton wheel ships no ptxas")
def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """CI has no GPU, so nothing else would notice a kernel that only breaks when compiled.

    Compiles (frontend, TTGIR, PTX, ptxas) the decode tile, a windowed GQA-5 prefill tile,
    the split merge and reshape_and_cache for an H100/H200 (sm_90), and checks that K/V
    reach shared memory with 16-byte asynchronous copies (cp.async) and the dots use
    tensor cores (mma): the two things decode bandwidth depends on.
    """
    res = _run_python(_CROSS_COMPILE)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "CP_ASYNC MMA" in res.stdout, res.stdout


def test_kernels_import_nothing_else_from_kvlab() -> None:
    """The engine core must stay importable without torch/triton, and vice versa."""
    root = pathlib.Path(K.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("kvlab"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(n.name.startswith("kvlab") for n in node.names), path.name
