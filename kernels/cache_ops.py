"""``reshape_and_cache``: scatter this step's K/V rows into their slots in the paged cache.

The model computes K and V for the new tokens as dense ``[num_tokens, H, D]`` tensors. The
paged cache instead stores tokens in fixed-size blocks scattered over one big pool, and
the scheduler has already decided where each token goes: ``slot_mapping[i] = block_id *
block_size + offset``. This kernel is the bridge: one program copies a chunk of tokens,
each to its own slot. A negative slot means "no room for this token" (e.g. padding) and
is skipped, so the cache keeps whatever was there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._env import INTERPRET
from .validate import validate_reshape_and_cache

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, H, D], last dim contiguous
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, H, D], dense inside a block
    slot_mapping_ptr,  # [num_tokens] int64; negative = skip
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_vc_block,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (fixed per engine)
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_HD: tl.constexpr,  # next power of two >= NUM_HEADS * HEAD_DIM
):
    pid = tl.program_id(0)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token indices
    tok_ok = tok < num_tokens
    # Where does each token go? Padding tokens carry slot -1 and are masked out below.
    slot = tl.load(slot_mapping_ptr + tok, mask=tok_ok, other=-1)
    keep = tok_ok & (slot >= 0)
    block_id = tl.where(keep, slot // BLOCK_SIZE, 0)
    offset = tl.where(keep, slot % BLOCK_SIZE, 0)

    # One row of the tile = one token's H*D values, flattened; the flat index splits back
    # into (head, channel) so non-contiguous key/value views (e.g. slices of a fused QKV
    # output) can be read through their own strides.
    hd = tl.arange(0, BLOCK_HD)
    head = hd // HEAD_DIM
    chan = hd % HEAD_DIM
    hd_ok = hd < NUM_HEADS * HEAD_DIM
    mask = keep[:, None] & hd_ok[None, :]

    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64[:, None] * stride_k_tok + head[None, :] * stride_k_head + chan[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + tok64[:, None] * stride_v_tok + head[None, :] * stride_v_head + chan[None, :], mask=mask, other=0.0)

    # Inside a block the cache is dense: token `offset` starts NUM_HEADS*HEAD_DIM elements
    # after token `offset - 1`, so the flat index `hd` is exactly the in-token offset.
    in_block = offset[:, None] * (NUM_HEADS * HEAD_DIM) + hd[None, :]
    blk64 = block_id.to(tl.int64)[:, None]  # int64: a large pool overflows int32 offsets
    tl.store(key_cache_ptr + blk64 * stride_kc_block + in_block, k, mask=mask)
    tl.store(value_cache_ptr + blk64 * stride_vc_block + in_block, v, mask=mask)


def _tokens_per_program(num_tokens: int, block_hd: int) -> int:
    """Meta-parameter choice on the host (no autotuning: it does not run in the interpreter).

    Interpreter: cost is per program and per op, barely per element, so take many tokens
    per program (few programs). GPU: keep a tile around 8K elements so registers suffice
    while there are still plenty of programs to fill the machine. Powers of two both
    (``tl.arange`` needs them; ``block_hd`` is one).
    """
    if INTERPRET:
        return min(128, triton.next_power_of_2(max(num_tokens, 1)))
    return max(1, min(64, 8192 // block_hd))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[i]`` / ``value[i]`` into slot ``slot_mapping[i]`` of the caches, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, last dim contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; any
            block stride (``kv[:, 0]`` views are fine), dense inside a block; same dtype
            as ``key``.
        slot_mapping: int64 ``[num_tokens]``, ``block_id * block_size + offset``; negative
            entries are skipped.
    """
    validate_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_hd = triton.next_power_of_2(num_heads * head_dim)
    block_t = _tokens_per_program(num_tokens, block_hd)
    grid = (triton.cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        value_cache.stride(0),
        BLOCK_SIZE=key_cache.shape[1],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )
