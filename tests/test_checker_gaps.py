"""Issue 20, item 4 ("every verdict right"): wrong answers the checkers used to accept, and
right answers (or honest mistakes) they used to misjudge. Each mutant below passed -- or
got a misleading message from -- the checker before this issue; every test names the
message it gets now. Correct answers for every exercise stay in tests/test_exercises.py."""

from __future__ import annotations

import numpy as np
import pytest

import kvlab.kernels  # noqa: F401, I001  (first: it picks the Triton mode before triton is imported)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.exercises import check
from kvlab.kv_cache_interface import MambaSpec


# --- touch: the null block reaches touch on a sliding-window hit -----------------------------------
def touch_no_null_skip(pool, blocks):
    """vLLM's touch without `and not block.is_null`: the null block (ref_cnt 0) is 'removed'."""
    for b in blocks:
        if b.ref_cnt == 0:
            pool.free_block_queue.remove(b)
        b.ref_cnt += 1


def touch_stops_at_null(pool, blocks):
    """Stops at the null block instead of skipping it: a window hit's real blocks come after it."""
    for b in blocks:
        if b.is_null:
            break
        if b.ref_cnt == 0:
            pool.free_block_queue.remove(b)
        b.ref_cnt += 1


def touch_vllm(pool, blocks):
    """vLLM's own: the null block's ref_cnt is counted too (vLLM does not maintain it)."""
    for b in blocks:
        if b.ref_cnt == 0 and not b.is_null:
            pool.free_block_queue.remove(b)
        b.ref_cnt += 1


def test_touch_that_removes_the_null_block_is_refused():
    res = check("touch", touch_no_null_skip)
    assert not res and not res.not_implemented
    assert res.message == "your touch took the null block (block 0) off the free queue, but the null block is never on it", str(res)
    assert res.case.startswith("a sliding window of 32 tokens alone")
    assert "block.is_null" in res.idea and "skip it" in res.idea
    assert "which is not in the free queue" in res.got


def test_touch_that_stops_at_the_null_block_is_refused():
    res = check("touch", touch_stops_at_null)
    assert not res
    assert res.message == "after your touch, block 4 has ref_cnt 0", str(res)
    assert "do not stop at it" in res.idea and "continue" in res.idea


def test_touch_counting_the_null_block_as_vllm_does_passes():
    assert check("touch", touch_vllm)


# --- stale_hash: the return value -------------------------------------------------------------------
def evict_returns_false(pool, block):
    """Evicts exactly right, but says nothing was evicted."""
    key = block.cache_key
    if key is None:
        return False
    pool.cached_block_hash_to_block.pop(key, block.block_id)
    block.reset_hash()
    return False


def evict_always_true(pool, block):
    """Evicts exactly right, but says True for a block that had no hash."""
    key = block.cache_key
    if key is not None:
        pool.cached_block_hash_to_block.pop(key, block.block_id)
        block.reset_hash()
    return True


def test_eviction_that_returns_false_after_removing_is_refused():
    res = check("stale_hash", evict_returns_false)
    assert not res
    assert res.message == "your eviction removed block 2's hash from the map but returned False", str(res)
    assert res.expected == "True (a hash was removed)" and res.got == "False"
    assert "BlockRemoved" in res.idea and "counts an eviction" in res.idea


def test_eviction_that_returns_true_without_a_hash_is_refused():
    res = check("stale_hash", evict_always_true)
    assert not res
    assert res.message == "your eviction returned True for block 1, which has no hash: nothing was removed", str(res)
    assert res.expected == "False (no hash, nothing removed)" and res.got == "True"
    assert "BlockRemoved" in res.idea


# --- unified_block_sizes: a Mamba page can be the largest ---------------------------------------------
def unified_mamba_left_out(specs):
    """The largest ATTENTION page wins: the Mamba page is left out of the maximum."""
    pages = [s.page_size_bytes for s in specs]
    top = max(p for s, p in zip(specs, pages) if not isinstance(s, MambaSpec))
    return [s.block_size if isinstance(s, MambaSpec) else s.block_size * top // p for s, p in zip(specs, pages)]


def unified_first_page_wins(specs):
    """The first group's page is taken as the target (it happened to be the largest)."""
    pages = [s.page_size_bytes for s in specs]
    return [s.block_size if isinstance(s, MambaSpec) else max(1, s.block_size * pages[0] // p) for s, p in zip(specs, pages)]


def test_unified_sizes_leaving_mamba_out_of_the_max_are_refused():
    res = check("unified_block_sizes", unified_mamba_left_out)
    assert not res
    assert res.message == "wrong block sizes: a Mamba state larger than the attention pages", str(res)
    assert res.expected == "[160, 80, 16]" and res.got == "[32, 16, 16]"
    assert "the Mamba page is a page too" in res.idea and "40,960" in res.idea


def test_unified_sizes_taking_the_first_page_are_refused():
    res = check("unified_block_sizes", unified_first_page_wins)
    assert not res
    assert res.message == "wrong block sizes: a Mamba state larger than the attention pages", str(res)
    assert res.got == "[16, 8, 16]" and "pages must all fit the LARGEST page" in res.idea  # it shrank the full-attention block


def test_unified_sizes_unchanged_hear_that_they_are_unchanged():
    res = check("unified_block_sizes", lambda specs: [s.block_size for s in specs])
    assert not res
    assert res.idea.startswith("you returned the block sizes unchanged, but the pages differ (65,536 and 32,768 bytes)"), res.idea


# --- allocate_capacity: never negative ---------------------------------------------------------------
@pytest.mark.parametrize(
    "fn",
    [
        lambda n, bs, held, refs: -(-n // bs) - held - len(refs) + refs.count(0),  # no clamp (vLLM: max(num_new_blocks, 0))
        lambda n, bs, held, refs: ((-(-n // bs) - held - len(refs)) or 0) + refs.count(0),  # `or 0` keeps a negative
    ],
    ids=["no clamp", "or 0"],
)
def test_capacity_that_goes_negative_is_refused(fn):
    res = check("allocate_capacity", fn)
    assert not res
    assert res.message == "wrong count: the request already holds more blocks than it needs", str(res)
    assert res.expected == "0" and res.got == "-1"
    assert "never negative" in res.idea and "max(" in res.idea


# --- router_block_keys: vLLM's default sha256 pickles the key -----------------------------------------
MASK64 = (1 << 64) - 1


def _keys_with(make_key):
    def fn(hash_fn, none_hash, token_ids, block_size, first_extra):
        keys, parent = [], none_hash
        for b in range(len(token_ids) // block_size):
            parent = hash_fn(make_key(parent, token_ids[b * block_size : (b + 1) * block_size], first_extra if b == 0 else None))
            keys.append(int.from_bytes(parent, "big") & MASK64)
        return keys

    return fn


@pytest.mark.parametrize(
    "name,make_key",
    [
        ("tokens as a list", lambda p, toks, x: (p, list(toks), x)),
        ("extra keys as a list", lambda p, toks, x: (p, tuple(toks), None if x is None else list(x))),
        ("the key as a list", lambda p, toks, x: [p, tuple(toks), x]),
    ],
)
def test_router_keys_built_from_lists_are_refused(name, make_key):
    res = check("router_block_keys", _keys_with(make_key))
    assert not res, name
    assert res.message == "wrong keys for a salted prompt, hashed with vLLM's default sha256 (pickle)", str(res)
    assert "pickle" in res.idea and "sha256_cbor" in res.idea and "tuple" in res.idea


# --- encoder_inputs ----------------------------------------------------------------------------------
def _enc(*, abs_cut=False, at_end=False, carry_on=False, stop_at_cached=False, as_list=False):
    def fn(items, num_computed_tokens, num_new_tokens, is_cached, fits):
        picked, names = [], set()
        end = num_computed_tokens + num_new_tokens
        for i, (name, off, n) in enumerate(items):
            if off > end if at_end else off >= end:
                break
            if off + n <= num_computed_tokens:
                continue
            if name in names:
                continue
            if is_cached(i):
                if stop_at_cached:
                    break
                continue
            if not fits(i):
                num_new_tokens = (off if abs_cut else off - num_computed_tokens) if num_computed_tokens < off else 0
                if carry_on:
                    continue
                break
            picked.append(i)
            names.add(name)
        return [picked, num_new_tokens] if as_list else (picked, num_new_tokens)

    return fn


@pytest.mark.parametrize(
    "kw,case,idea",
    [
        (
            {"abs_cut": True},
            "4 tokens computed: no room for an image at offset 12",
            "offset - num_computed_tokens = 8, not at the offset 12",
        ),
        ({"at_end": True}, "an image starts exactly where the chunk ends", "an image starting AT the end"),
        ({"carry_on": True}, "no room for the first image; a smaller one after it would fit", "stop there"),
        ({"stop_at_cached": True}, "a cached image, then one to encode", "do not stop"),
    ],
)
def test_encoder_inputs_mistakes_that_passed_are_refused(kw, case, idea):
    res = check("encoder_inputs", _enc(**kw))
    assert not res
    assert res.message == f"wrong decision: {case}", str(res)
    assert idea in res.idea, res.idea


def test_encoder_inputs_accepts_a_list_of_two():
    res = check("encoder_inputs", _enc(as_list=True))
    assert res, str(res)


def test_encoder_inputs_refuses_a_bare_list_with_a_clear_message():
    res = check("encoder_inputs", lambda items, c, n, is_cached, fits: [])
    assert not res and res.message == "return (chosen, num_new_tokens), two values -- got []", str(res)


# --- token_slots: a numpy array is an answer ----------------------------------------------------------
def slots_numpy(block_ids, start, end, block_size):
    p = np.arange(start, end)
    return np.asarray(block_ids)[p // block_size] * block_size + p % block_size


def test_token_slots_accepts_a_numpy_array():
    res = check("token_slots", slots_numpy)
    assert res, str(res)


def test_token_slots_numpy_array_with_wrong_values_gets_the_teaching_message():
    res = check("token_slots", lambda ids, a, b, bs: np.asarray([ids[p // bs] + p % bs for p in range(a, b)]))
    assert not res and res.message == "wrong slots: a whole prompt from token 0", str(res)
    assert "multiply the block id" in res.idea


def test_token_slots_refuses_floats_with_a_message_about_the_kind():
    res = check("token_slots", lambda ids, a, b, bs: [float(ids[p // bs] * bs + p % bs) for p in range(a, b)])
    assert not res and "ints" in res.message and "float" in res.message, str(res)


# --- paged_attention_kernel: the softmax scale -------------------------------------------------------
@triton.jit
def step_no_scale(
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
    s = tl.where(inside, tl.sum(k * q[None, :], axis=1), float("-inf"))  # forgot * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def step_scale_twice(
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
    k = tl.load(k_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32) * scale  # scaled here ...
    v = tl.load(v_cache_ptr + base, mask=inside[:, None], other=0.0).to(tl.float32)
    s = tl.where(inside, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))  # ... and again here
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


def test_kernel_without_the_softmax_scale_hears_that_the_scale_is_missing():
    res = check("paged_attention_kernel", step_no_scale)
    assert not res and not res.not_implemented
    assert res.idea.startswith("the softmax scale is missing"), str(res)
    assert "mask" not in res.idea


def test_kernel_with_the_scale_applied_twice_hears_so():
    res = check("paged_attention_kernel", step_scale_twice)
    assert not res
    assert res.idea.startswith("the softmax scale is applied twice"), str(res)
