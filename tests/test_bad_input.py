"""Bad input: a clear ValueError/TypeError naming the argument, raised before any state changes.

Every case runs against a manager that already holds state (a running request, cached
free blocks); afterwards the pool must be exactly as before and pass ``check_invariants``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlab import (
    BlockPool,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    KVCacheManager,
    MultiModalFeature,
    Request,
    SlidingWindowSpec,
)

MMF = MultiModalFeature


class _NotASpec(FullAttentionSpec):
    """A spec subclass kvlab does not know: refused, not silently treated as full attention."""


def world():
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    done = Request("done", list(range(10)))
    mgr.allocate_slots(done, 10)
    mgr.free(done)  # cached blocks now sit in the free queue
    live = Request("live", list(range(6)))
    hits, n = mgr.get_computed_blocks(live)
    mgr.allocate_slots(live, 6 - n, n, hits)
    live.num_computed_tokens = 6
    return SimpleNamespace(mgr=mgr, live=live)


def state(mgr):
    pool = mgr.block_pool
    return (
        pool.get_num_free_blocks(),
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted((k, tuple(b.block_id for b in v)) for k, v in pool.cached_block_hash_to_block.items()),
        [{r: [b.block_id for b in t] for r, t in m.req_to_blocks.items()} for m in mgr.coordinator.single_type_managers],
    )


def _dup_id(w):
    twin = Request("live", [7, 7, 7])  # another request object with a running request's id
    w.mgr.allocate_slots(twin, 3)


def _hits_for_running(w):
    other = Request("x", list(range(9)))
    hits, n = w.mgr.get_computed_blocks(other)
    assert n == 8
    w.mgr.allocate_slots(w.live, 1, n, hits)


def _hits_mismatch(w):
    other = Request("x", list(range(9)))
    hits, n = w.mgr.get_computed_blocks(other)
    w.mgr.allocate_slots(other, 5, n + 1, hits)


def _other_hasher(w):
    KVCacheManager(num_blocks=5, block_size=8).get_computed_blocks(w.live)


CASES = [
    # manager / pool construction
    ("block_size=0", lambda w: KVCacheManager(num_blocks=11, block_size=0), ValueError, r"block_size.*>= 1"),
    ("block_size<0", lambda w: KVCacheManager(num_blocks=11, block_size=-16), ValueError, "block_size"),
    ("block_size float", lambda w: KVCacheManager(num_blocks=11, block_size=16.0), TypeError, "block_size"),
    ("block_size str", lambda w: KVCacheManager(num_blocks=11, block_size="16"), TypeError, "block_size"),
    ("block_size bool", lambda w: KVCacheManager(num_blocks=11, block_size=True), TypeError, "block_size"),
    ("num_blocks=1", lambda w: KVCacheManager(num_blocks=1), ValueError, r"num_blocks.*>= 2"),
    ("num_blocks=0", lambda w: KVCacheManager(num_blocks=0), ValueError, "num_blocks"),
    ("num_blocks float", lambda w: KVCacheManager(num_blocks=10.0), TypeError, "num_blocks"),
    ("pool num_blocks=1", lambda w: BlockPool(1), ValueError, "num_blocks"),
    ("hash_algo unknown", lambda w: KVCacheManager(num_blocks=11, hash_algo="md5"), ValueError, r"hash_algo 'md5'"),
    ("hash_algo None", lambda w: KVCacheManager(num_blocks=11, hash_algo=None), TypeError, "hash_algo"),
    ("sliding_window=0", lambda w: SlidingWindowSpec(sliding_window=0), ValueError, r"sliding_window.*>= 1"),
    ("sliding_window<0", lambda w: SlidingWindowSpec(sliding_window=-32), ValueError, "sliding_window"),
    ("sliding_window float", lambda w: SlidingWindowSpec(sliding_window=32.0), TypeError, "sliding_window"),
    ("no groups", lambda w: KVCacheManager(num_blocks=11, kv_cache_groups=[]), ValueError, "kv_cache_groups"),
    ("group not a spec", lambda w: KVCacheManager(num_blocks=11, kv_cache_groups=["full"]), TypeError, r"kv_cache_groups\[0\]"),
    (
        "group block_size 0",
        lambda w: FullAttentionSpec(block_size=0),
        ValueError,
        r"FullAttentionSpec.block_size must be None or an int >= 1",
    ),
    ("group block_size float", lambda w: SlidingWindowSpec(sliding_window=8, block_size=8.0), TypeError, "block_size"),
    (
        "chunk not a block multiple",
        lambda w: KVCacheManager(
            num_blocks=11, block_size=16, kv_cache_groups=[FullAttentionSpec(), ChunkedLocalAttentionSpec(attention_chunk_size=24)]
        ),
        ValueError,
        r"attention_chunk_size 24.*multiple of block_size 16",
    ),
    ("chunk size 0", lambda w: ChunkedLocalAttentionSpec(attention_chunk_size=0), ValueError, "attention_chunk_size"),
    (
        "chunked local, mixed block sizes",
        lambda w: KVCacheManager(
            num_blocks=11,
            block_size=16,
            kv_cache_groups=[FullAttentionSpec(block_size=32), ChunkedLocalAttentionSpec(attention_chunk_size=64)],
        ),
        ValueError,
        "ChunkedLocalAttentionSpec",
    ),
    (
        "mamba without align, caching on",
        lambda w: KVCacheManager(num_blocks=11, kv_cache_groups=[FullAttentionSpec(), MambaSpec(mamba_cache_mode="none")]),
        ValueError,
        "mamba_cache_mode='align'",
    ),
    ("mamba mode unknown", lambda w: MambaSpec(mamba_cache_mode="all"), ValueError, "mamba_cache_mode"),
    (
        "prefix_match_unit not dividing a block",
        lambda w: KVCacheManager(
            num_blocks=11, block_size=16, kv_cache_groups=[FullAttentionSpec(), MambaSpec(block_size=32)], prefix_match_unit=12
        ),
        ValueError,
        r"Invalid prefix_match_unit=12; prefix-cacheable KV cache group block sizes must be divisible by prefix_match_unit\. Got group block sizes=\[16, 32\]",
    ),
    (
        "prefix_match_unit with one group",
        lambda w: KVCacheManager(num_blocks=11, block_size=16, prefix_match_unit=4),
        ValueError,
        r"with a single KV cache group, prefix-cache hits land on the block size \(16\)\. Unset it or set it to 16",
    ),
    ("prefix_match_unit not an int", lambda w: KVCacheManager(num_blocks=11, prefix_match_unit=0), ValueError, "prefix_match_unit"),
    ("mamba shapes/dtypes", lambda w: MambaSpec(shapes=((4, 4),), dtypes=("bfloat16", "float32")), ValueError, "shapes and dtypes"),
    ("spec dtype unknown", lambda w: FullAttentionSpec(dtype="float64"), ValueError, "dtype"),
    ("mla heads 0", lambda w: MLAAttentionSpec(num_kv_heads=0), ValueError, "num_kv_heads"),
    (
        "spec of another kind",
        lambda w: KVCacheManager(num_blocks=11, kv_cache_groups=[_NotASpec()]),
        TypeError,
        r"kv_cache_groups\[0\] must be one of",
    ),
    ("use_eagle not bool", lambda w: KVCacheManager(num_blocks=11, use_eagle=1), TypeError, "use_eagle"),
    ("max_in_flight_tokens 0", lambda w: KVCacheManager(num_blocks=11, max_in_flight_tokens=0), ValueError, "max_in_flight_tokens"),
    ("max_model_len=0", lambda w: KVCacheManager(num_blocks=11, max_model_len=0), ValueError, "max_model_len"),
    # requests
    (
        "prompt_embeds rows != tokens",
        lambda w: Request("x", [0, 0, 0], prompt_embeds=[[0.5], [0.25]]),
        ValueError,
        "prompt_embeds has 2 rows",
    ),
    ("prompt_embeds not rows", lambda w: Request("x", [0], prompt_embeds=3.5), TypeError, "prompt_embeds"),
    ("lora_path without lora_name", lambda w: Request("x", [1], lora_path="/a"), TypeError, "lora_path"),
    ("prompt str", lambda w: Request("x", "hello"), TypeError, "prompt_token_ids"),
    ("token str", lambda w: Request("x", [1, "2"]), TypeError, r"prompt_token_ids\[1\]"),
    ("token float", lambda w: Request("x", [1, 2.0]), TypeError, r"prompt_token_ids\[1\]"),
    ("token bool", lambda w: Request("x", [True]), TypeError, r"prompt_token_ids\[0\]"),
    ("token None", lambda w: Request("x", [None]), TypeError, r"prompt_token_ids\[0\]"),
    ("token below int32", lambda w: Request("x", [3, -(2**31) - 1]), ValueError, r"prompt_token_ids\[1\]"),
    ("token >= 2**31", lambda w: Request("x", [2**31]), ValueError, r"prompt_token_ids\[0\]"),
    ("output token beyond int32", lambda w: w.live.append_output_token_ids([2**31]), ValueError, r"token_ids\[0\]"),
    ("request_id empty", lambda w: Request("", [1]), TypeError, "request_id"),
    ("request_id int", lambda w: Request(7, [1]), TypeError, "request_id"),
    ("max_tokens=0", lambda w: Request("x", [1], max_tokens=0), ValueError, "max_tokens"),
    ("cache_salt int", lambda w: Request("x", [1], cache_salt=5), TypeError, "cache_salt"),
    ("cache_salt bytes", lambda w: Request("x", [1], cache_salt=b"s"), TypeError, "cache_salt"),
    ("lora_name int", lambda w: Request("x", [1], lora_name=3), TypeError, "lora_name"),
    (
        "mm overlapping",
        lambda w: Request("x", list(range(20)), mm_features=[MMF("a", 2, 5), MMF("b", 6, 3)]),
        ValueError,
        r"mm_features.*overlap",
    ),
    ("mm out of range", lambda w: Request("x", list(range(20)), mm_features=[MMF("a", 15, 6)]), ValueError, r"mm_features.*\[15, 21\)"),
    ("mm negative offset", lambda w: Request("x", list(range(20)), mm_features=[MMF("a", -1, 3)]), ValueError, r"offset.*>= 0"),
    ("mm zero length", lambda w: Request("x", list(range(20)), mm_features=[MMF("a", 3, 0)]), ValueError, r"length.*>= 1"),
    ("mm empty identifier", lambda w: MMF("", 0, 1), TypeError, "identifier"),
    ("mm not a feature", lambda w: Request("x", [1, 2], mm_features=[MMF("a", 0, 1), (0, 1)]), TypeError, r"mm_features\[1\]"),
    # allocation
    ("duplicate request id", _dup_id, ValueError, r"request id 'live'"),
    ("allocate 0 tokens", lambda w: w.mgr.allocate_slots(w.live, 0), ValueError, r"num_new_tokens.*>= 1"),
    ("allocate <0 tokens", lambda w: w.mgr.allocate_slots(w.live, -2), ValueError, "num_new_tokens"),
    ("allocate bool tokens", lambda w: w.mgr.allocate_slots(w.live, True), TypeError, "num_new_tokens"),
    ("lookahead <0", lambda w: w.mgr.allocate_slots(w.live, 1, num_lookahead_tokens=-1), ValueError, "num_lookahead_tokens"),
    ("computed < 0", lambda w: w.mgr.allocate_slots(w.live, 1, -4), ValueError, "num_new_computed_tokens"),
    ("computed != hits", _hits_mismatch, ValueError, "num_new_computed_tokens"),
    ("hits for running", _hits_for_running, ValueError, "already running"),
    ("external for running", lambda w: w.mgr.allocate_slots(w.live, 1, num_external_computed_tokens=4), ValueError, "already running"),
    (
        "external > tokens",
        lambda w: w.mgr.allocate_slots(Request("e", list(range(5))), 1, num_external_computed_tokens=8),
        ValueError,
        "exceed its 5 tokens",
    ),
    (
        "external < 0",
        lambda w: w.mgr.allocate_slots(Request("e", list(range(5))), 1, num_external_computed_tokens=-1),
        ValueError,
        "num_external_computed_tokens",
    ),
    (
        "gate flag not bool",
        lambda w: w.mgr.allocate_slots(Request("e", list(range(5))), 1, full_sequence_must_fit="yes"),
        TypeError,
        "full_sequence_must_fit",
    ),
    ("hits not KVCacheBlocks", lambda w: w.mgr.allocate_slots(Request("e", list(range(5))), 4, 4, [[1]]), TypeError, "new_computed_blocks"),
    ("not a Request", lambda w: w.mgr.allocate_slots(SimpleNamespace(request_id="n"), 1), TypeError, "request"),
    ("hasher of another manager", _other_hasher, ValueError, "already hashed"),
    ("pool get -1 blocks", lambda w: w.mgr.block_pool.get_new_blocks(-1), ValueError, "num_blocks = -1"),
    ("pool get too many", lambda w: w.mgr.block_pool.get_new_blocks(99), ValueError, "num_blocks = 99"),
]


@pytest.mark.parametrize("case, call, exc, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_before_any_change(case, call, exc, match):
    w = world()
    before = state(w.mgr)
    tokens_before = list(w.live.all_token_ids)
    with pytest.raises(exc, match=match):
        call(w)
    assert state(w.mgr) == before
    assert w.live.all_token_ids == tokens_before
    w.mgr.check_invariants()
