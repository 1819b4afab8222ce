"""Host-side checks run before every kernel launch.

Why so strict: a Triton kernel does not bounds-check. A block id of -1 or a slot past the
end of the cache does not raise, it reads or overwrites somebody else's memory (on a GPU)
or silently reads junk (under the interpreter). The bugs a learner will write in a block
table or a slot mapping would therefore show up as slightly wrong logits many steps later.
These checks turn them into an immediate ``ValueError`` that names the argument, the bad
position and value, and what is allowed.

Cost: every check is a handful of vectorised torch ops on the small metadata tensors, and
all the data-dependent verdicts are gathered into one tensor and read back with a single
``.tolist()``, so a CUDA caller pays one host synchronisation per launch, not one per
check. Only when something is wrong do we spend more effort locating the first culprit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from ._env import INTERPRET

__all__ = ["validate_reshape_and_cache", "validate_unified_attention", "SUPPORTED_DTYPES"]

#: Element types the kernels accept for q, K, V and the caches.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

_MIN_HEAD_DIM = 16  # tl.dot needs every tile dimension >= 16
_MAX_HEAD_DIM = 256  # one [BLOCK_N, head_dim] K tile must fit a GPU's shared memory


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def _require_dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if x.dtype not in allowed:
        raise ValueError(f"{name} has dtype {str(x.dtype).removeprefix('torch.')}; allowed: {_dtype_names(allowed)}")


def _require_contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()); got strides {x.stride()}")


def _require_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.stride()}")


def _require_cache_layout(name: str, cache: torch.Tensor) -> None:
    """[num_blocks, block_size, num_kv_heads, head_dim], any block stride, dense inside a block.

    The runner keeps one ``[num_blocks, 2, block_size, H, D]`` tensor per layer and passes
    ``kv[:, 0]`` / ``kv[:, 1]``: the block stride is then twice a block's size, which is
    fine, but inside a block the tokens, heads and channels must be packed densely because
    the kernels address them as ``block * block_stride + (offset * H + head) * D + d``.
    """
    _require_ndim(name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    for dim, size in zip(("num_blocks", "block_size", "num_kv_heads", "head_dim"), cache.shape):
        if size < 1:
            raise ValueError(f"{name} has {dim} = {size} (shape {tuple(cache.shape)}); every dimension must be >= 1")
    _, block_size, num_heads, head_dim = cache.shape
    dense = (head_dim * num_heads, head_dim, 1)
    actual = cache.stride()[1:]
    # A dimension of size 1 may carry any stride; ignore those.
    ok = all(size == 1 or have == want for size, have, want in zip(cache.shape[1:], actual, dense))
    if not ok:
        raise ValueError(
            f"{name} must be dense inside each block: strides of the last three dims must be "
            f"{dense} for shape {tuple(cache.shape)}, got {actual} (any stride of the block "
            f"dimension is fine, e.g. kv[:, 0] of a [num_blocks, 2, block_size, H, D] tensor)"
        )


def _require_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Both caches laid out as ``[num_blocks, block_size, kv_heads, head_dim]``, equal in
    shape, and in the dtype of ``ref`` (the tensor whose K/V or queries meet them)."""
    _require_cache_layout("key_cache", key_cache)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache must have the shape of key_cache {tuple(key_cache.shape)}, got {tuple(value_cache.shape)}")
    _require_cache_layout("value_cache", value_cache)
    for n, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dtype != ref.dtype:
            raise ValueError(f"{n} has dtype {c.dtype} but {ref_name} has {ref.dtype}; they must match")


def _require_same_device(tensors: dict[str, torch.Tensor]) -> None:
    names = list(tensors)
    first = tensors[names[0]].device
    for n in names[1:]:
        if tensors[n].device != first:
            raise ValueError(f"{n} is on {tensors[n].device} but {names[0]} is on {first}; all kernel arguments must be on the same device")
    if first.type == "meta":
        raise ValueError(f"{names[0]} is a meta tensor (a shape without data); the kernels need tensors with data")
    if not INTERPRET and first.type != "cuda":
        raise ValueError(
            f"{names[0]} is on {first}: compiled Triton kernels need CUDA tensors (or run with TRITON_INTERPRET=1 to use the interpreter)"
        )


def _check_flags(flags: list[torch.Tensor]) -> list[bool]:
    """Read many device-side booleans back with one synchronisation."""
    if not flags:
        return []
    return [bool(f) for f in torch.stack([f.reshape(()) for f in flags]).tolist()]


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    """Position of the first True in ``mask`` (only called once we know there is one)."""
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def validate_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise TypeError/ValueError unless ``reshape_and_cache`` can run safely on these."""
    for n, x in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        _require_tensor(n, x)
    _require_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    if key.shape[1] < 1 or key.shape[2] < 1:
        raise ValueError(f"key has shape {tuple(key.shape)}; num_kv_heads and head_dim must be >= 1")
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    _require_dtype("key", key, SUPPORTED_DTYPES)
    if value.dtype != key.dtype:
        raise ValueError(f"value has dtype {value.dtype} but key has {key.dtype}; they must match")
    _require_last_dim_contiguous("key", key)
    _require_last_dim_contiguous("value", value)
    _require_cache_pair(key_cache, value_cache, "key", key)
    num_tokens, num_heads, head_dim = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    if key_cache.shape[2:] != (num_heads, head_dim):
        raise ValueError(
            f"key_cache holds [num_kv_heads, head_dim] = {tuple(key_cache.shape[2:])} per token but key has {(num_heads, head_dim)}"
        )
    _require_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _require_dtype("slot_mapping", slot_mapping, (torch.int64,))
    _require_contiguous("slot_mapping", slot_mapping)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has {num_tokens} tokens; there must be exactly one slot per token"
        )
    _require_same_device({"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache, "slot_mapping": slot_mapping})
    if num_tokens == 0:
        return

    num_slots = num_blocks * block_size
    too_big = slot_mapping >= num_slots
    # Two tokens written to one slot would race (the winner depends on scheduling). Give
    # every skipped token a distinct negative sentinel so only real slots can collide.
    positions = torch.arange(num_tokens, device=slot_mapping.device)
    keyed = torch.where(slot_mapping >= 0, slot_mapping, -1 - positions)
    sorted_slots, order = torch.sort(keyed)
    dup = sorted_slots[1:] == sorted_slots[:-1]
    bad_big, bad_dup = _check_flags([too_big.any(), dup.any()])
    if bad_big:
        (i,) = _first_index(too_big)
        raise ValueError(
            f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache: slots must be "
            f"< num_blocks * block_size = {num_blocks} * {block_size} = {num_slots} "
            "(or negative to skip the token)"
        )
    if bad_dup:
        (j,) = _first_index(dup)
        a, b = sorted((int(order[j]), int(order[j + 1])))
        raise ValueError(
            f"slot_mapping[{a}] and slot_mapping[{b}] both name slot {int(sorted_slots[j])}; "
            "each slot may receive at most one token per call"
        )


def validate_unified_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None,
) -> None:
    """Raise TypeError/ValueError unless ``unified_attention`` can run safely on these."""
    for n, x in (
        ("q", q),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        _require_tensor(n, x)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number (usually head_dim ** -0.5), got {softmax_scale}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window must be None or an int, got {type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(
                f"sliding_window must be >= 1 (the number of keys a query sees, itself included) or None, got {sliding_window}"
            )

    _require_ndim("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    if q.shape[1] < 1:
        raise ValueError(f"q has shape {tuple(q.shape)}: num_q_heads = 0; a query needs at least one head")
    _require_dtype("q", q, SUPPORTED_DTYPES)
    _require_last_dim_contiguous("q", q)
    _require_cache_pair(key_cache, value_cache, "q", q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"key_cache has head_dim {cache_head_dim} but q has {head_dim}; they must match")
    if head_dim & (head_dim - 1) or not (_MIN_HEAD_DIM <= head_dim <= _MAX_HEAD_DIM):
        raise ValueError(
            f"q has head_dim {head_dim}; the kernel supports powers of two from {_MIN_HEAD_DIM} to {_MAX_HEAD_DIM} (e.g. 32, 64, 128)"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_q_heads} heads, which must be a multiple of key_cache's {num_kv_heads} kv heads (grouped-query attention)"
        )

    _require_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    _require_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    _require_ndim("block_table", block_table, 2, "[num_seqs, max_blocks_per_seq]")
    for n, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_table", block_table)):
        _require_dtype(n, t, (torch.int32,))
        _require_contiguous(n, t)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries (seq_lens has {num_seqs}), got {cu_seqlens_q.shape[0]}"
        )
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must have one row per sequence ({num_seqs}), got {block_table.shape[0]} rows")
    _require_same_device(
        {
            "q": q,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "cu_seqlens_q": cu_seqlens_q,
            "seq_lens": seq_lens,
            "block_table": block_table,
        }
    )
    if num_seqs == 0:
        if num_tokens:
            raise ValueError(f"q has {num_tokens} tokens but there are no sequences (seq_lens is empty)")
        return

    cu = cu_seqlens_q.long()
    lens = seq_lens.long()
    q_lens = cu[1:] - cu[:-1]
    max_blocks = block_table.shape[1]
    pages_needed = (lens + block_size - 1) // block_size
    # First key any query of the sequence can see: 0, or (first query position) - W + 1.
    first_key = torch.zeros_like(lens)
    if sliding_window is not None:
        first_key = (lens - q_lens - sliding_window + 1).clamp(min=0)
    cols = torch.arange(max_blocks, device=block_table.device)
    read = (cols[None, :] >= (first_key // block_size)[:, None]) & (cols[None, :] < pages_needed[:, None])
    bad_block = read & ((block_table < 0) | (block_table >= num_blocks))

    checks = [
        ("first", cu[0] != 0),
        ("monotone", q_lens < 0),
        ("total", cu[-1] != num_tokens),
        ("negative", lens < 0),
        ("seq_len", q_lens > lens),
        ("columns", pages_needed > max_blocks),
        ("block", bad_block),
    ]
    flags = _check_flags([c.any() for _, c in checks])
    failed = {name: mask for (name, mask), bad in zip(checks, flags) if bad}
    if "first" in failed:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    if "monotone" in failed:
        (s,) = _first_index(failed["monotone"])
        raise ValueError(
            f"cu_seqlens_q must be non-decreasing: cu_seqlens_q[{s + 1}] = {int(cu[s + 1])} < cu_seqlens_q[{s}] = {int(cu[s])}"
        )
    if "total" in failed:
        raise ValueError(f"cu_seqlens_q[-1] must equal the number of query tokens in q ({num_tokens}), got {int(cu[-1])}")
    if "negative" in failed:
        (s,) = _first_index(failed["negative"])
        raise ValueError(f"seq_lens[{s}] = {int(lens[s])} is negative; sequence lengths must be >= 0")
    if "seq_len" in failed:
        (s,) = _first_index(failed["seq_len"])
        raise ValueError(
            f"seq_lens[{s}] = {int(lens[s])} is shorter than the sequence's {int(q_lens[s])} query "
            "tokens; seq_lens counts context + new tokens, so it must be >= the query length"
        )
    if "columns" in failed:
        (s,) = _first_index(failed["columns"])
        raise ValueError(
            f"block_table has {max_blocks} columns but sequence {s} (seq_lens[{s}] = "
            f"{int(lens[s])}, block_size {block_size}) needs {int(pages_needed[s])}"
        )
    if "block" in failed:
        s, j = _first_index(failed["block"])
        raise ValueError(
            f"block_table[{s}, {j}] = {int(block_table[s, j])} is not a valid block id: sequence "
            f"{s} reads columns {int(first_key[s]) // block_size}..{int(pages_needed[s]) - 1} and "
            f"each id there must be in [0, num_blocks = {num_blocks})"
        )
