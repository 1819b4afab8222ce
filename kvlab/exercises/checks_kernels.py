"""Checkers: slot_mapping and paged_attention_kernel (lesson 02), run through the real
kernels -- the Triton interpreter on CPU.

The decode kernel below is complete except for ONE step of its loop over the KV blocks,
which the learner writes as a ``@triton.jit`` function::

    @triton.jit
    def decode_block_step(q, k_cache_ptr, v_cache_ptr, block_table_ptr, start, seq_len,
                          m_i, l_i, acc, scale, stride_block, stride_tok,
                          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        ...
        return m_i, l_i, acc

For the block covering positions ``start … start + BLOCK_SIZE - 1`` of one sequence and
one head it must: look up the physical block in the block table, load K and V with a
mask for positions ``>= seq_len``, compute the scores, and fold them into the running
softmax (max ``m_i``, denominator ``l_i``, un-normalised output ``acc``).

The checker watches the learner's kernel: under the interpreter it records every slot
the kernel loads from the K and V caches (``kvlab.kernels.trace``). When a case fails,
``result.show()`` draws those loads against the slots the block table says should be read
(the kernel view of lesson 02): a forgotten mask shows loads in empty slots, a forgotten
block-table lookup shows loads in blocks that are not the sequence's -- block 0 included.

This module holds what each exercise is (title, signature, hints); the checks, which need
torch and Triton, are in :mod:`kvlab.exercises.kernel_harness`, imported when one runs.
"""

from __future__ import annotations

from typing import Any

from kvlab.exercises.registry import register
from kvlab.exercises.result import CheckResult


@register(
    "paged_attention_kernel",
    "The decode kernel's block loop",
    "@triton.jit decode_block_step(q, k_cache_ptr, v_cache_ptr, block_table_ptr, start, seq_len, m_i, l_i, acc, scale, stride_block, stride_tok, BLOCK_SIZE, HEAD_DIM) -> (m_i, l_i, acc)",
    "02_block_pool_and_tables",
    [
        "Block-table lookup: block_id = tl.load(block_table_ptr + start // BLOCK_SIZE); positions offs = tl.arange(0, BLOCK_SIZE), valid = start + offs < seq_len.",
        "Load K and V as [BLOCK_SIZE, HEAD_DIM] tiles at block_id * stride_block + offs[:, None] * stride_tok + d[None, :], masked by valid[:, None] (other=0.0); then .to(tl.float32).",
        "scores = tl.sum(k * q[None, :], axis=1) * scale, and tl.where(valid, scores, -inf): padding must get zero weight.",
        "Online softmax: m_new = max(m_i, max(scores)); alpha = exp(m_i - m_new); p = exp(scores - m_new); l_i = l_i * alpha + sum(p); acc = acc * alpha + sum(p[:, None] * v, axis=0).",
    ],
    notebook="ex_kernels",
)
def check_paged_attention_kernel(step: Any) -> CheckResult:
    from kvlab.exercises import kernel_harness  # torch + Triton: imported when a kernel check runs

    return kernel_harness.check_paged_attention_kernel(step)


@register(
    "slot_mapping",
    "Where each new token's K/V goes",
    "slot_mapping(block_table, start_pos, num_tokens, block_size) -> list[int]",
    "02_block_pool_and_tables",
    [
        "Token at position p lives in logical block p // block_size, at offset p % block_size.",
        "The block table turns the logical block into a physical one: slot = block_table[p // block_size] * block_size + p % block_size.",
        "The new tokens are positions start_pos … start_pos + num_tokens - 1 (start_pos = tokens already computed).",
    ],
    notebook="ex_kernels",
)
def check_slot_mapping(fn: Any) -> CheckResult:
    from kvlab.exercises import kernel_harness  # torch + Triton: imported when a kernel check runs

    return kernel_harness.check_slot_mapping(fn)
