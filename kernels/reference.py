"""Pure-torch references for the Triton kernels: slow, obvious, and the ground truth.

Every kernel test compares against these functions, so they are written to be read, not
to be fast: one Python loop over sequences, an explicit gather of each sequence's K/V
through its block table, and a dense causal softmax in float32. If a reference and a
kernel disagree, the reference is the one a learner should be able to check by hand.

Same signatures as the kernels (``reshape_and_cache`` / ``unified_attention``).
"""

from __future__ import annotations

import torch

__all__ = ["reshape_and_cache_ref", "unified_attention_ref"]


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``i``'s K/V into slot ``slot_mapping[i]`` of the paged caches, in place.

    ``slot = block_id * block_size + offset``; a negative slot means "this token has no
    place in the cache" (padding) and is skipped, so the cache keeps its old contents.
    """
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_id, offset = slots // block_size, slots % block_size
    key_cache[block_id, offset] = key[keep]
    value_cache[block_id, offset] = value[keep]


def _gather_tokens(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int, lo: int, hi: int) -> torch.Tensor:
    """Tokens ``lo..hi-1`` of one sequence, gathered page by page: ``[hi - lo, H, D]``.

    Only the pages that hold those tokens are touched: with a sliding window the pages
    before the window may hold a placeholder id (vLLM puts its null block there).
    """
    first_page = lo // block_size
    n_pages = -(-hi // block_size)
    pages = cache[block_ids[first_page:n_pages].long()]  # [pages, block_size, H, D]
    tokens = pages.reshape(-1, *cache.shape[2:])
    start = lo - first_page * block_size
    return tokens[start : start + hi - lo]


def unified_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed prefill/decode batch, computed densely.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``; they are the
    LAST ``q_len`` positions of a sequence of ``seq_lens[s]`` tokens (the earlier ones are
    cached context: a prefix-cache hit or earlier chunks). The query at absolute position
    ``p`` sees keys ``0..p``, or ``p-W+1..p`` with ``sliding_window=W``.
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    num_q_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_size = key_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # Keys before the window of the FIRST query are needed by no query at all.
        lo = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        k = _gather_tokens(key_cache, block_table[s], block_size, lo, seq_len).float()
        v = _gather_tokens(value_cache, block_table[s], block_size, lo, seq_len).float()
        # GQA: q head h reads kv head h // group.
        k = k.repeat_interleave(group, dim=1)  # [n_keys, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * softmax_scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(lo, seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
