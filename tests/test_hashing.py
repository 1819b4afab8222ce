"""Block hashing: hash functions, the block encoding, NONE_HASH, extra keys, the chain."""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import subprocess
import sys

import cbor2
import pytest
import xxhash as _xxhash

from kvlab import (
    KVCacheManager,
    MultiModalFeature,
    Request,
    get_hash_fn_by_name,
    hash_block_tokens,
)
from kvlab.core import kv_cache_utils
from kvlab.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    get_request_block_hasher,
)
from kvlab.utils import hashing
from kvlab.utils.hashing import HASH_ALGOS, encode

PARENT = bytes(range(32))  # a fixed parent, so values do not depend on this process's NONE_HASH
BLOCK = (PARENT, tuple(range(16)), None)

EXPECTED_LENGTHS = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16, "weak16": 2}


def test_every_algo_is_listed_and_has_its_digest_length():
    assert set(HASH_ALGOS) == set(EXPECTED_LENGTHS)
    for name, length in EXPECTED_LENGTHS.items():
        fn = get_hash_fn_by_name(name)
        out = fn(BLOCK)
        assert type(out) is bytes and len(out) == length, name
        assert fn(BLOCK) == out, f"{name} is not deterministic"
        assert fn((PARENT, tuple(range(1, 17)), None)) != out, f"{name} ignores the tokens"


def test_hash_functions_match_their_definitions():
    extra = ("lora-a", ("img", 3), "salt")
    for obj in (BLOCK, (PARENT, (5, 6), extra), "not a block", (1, 2, 3)):
        body = encode(obj)
        assert hashing.sha256(obj) == hashlib.sha256(body).digest()
        assert hashing.xxhash(obj) == _xxhash.xxh3_128_digest(body)
        assert hashing.weak16(obj) == hashlib.sha256(body).digest()[:2]
        # vLLM's sha256_cbor exactly: reproducible across languages.
        assert hashing.sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
        assert hashing.xxhash_cbor(obj) == _xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))
    # Anything that is not a block key is pickled, as vLLM does for every input.
    assert encode("not a block") == pickle.dumps("not a block", protocol=pickle.HIGHEST_PROTOCOL)
    assert encode((PARENT, [1, 2], None)) == pickle.dumps((PARENT, [1, 2], None), protocol=pickle.HIGHEST_PROTOCOL)


def test_block_encoding_is_canonical_bytes():
    body = encode((b"\xaa\xbb", (1, -1), None))
    # tag, parent length, token count, parent, tokens (int32 little-endian: -1 is ff ff ff ff)
    assert (
        body == b"\x01kvlab-block\x00" + b"\x02\x00\x00\x00" + b"\x02\x00\x00\x00" + b"\xaa\xbb" + b"\x01\x00\x00\x00" + b"\xff\xff\xff\xff"
    )
    with_extra = encode((b"\xaa\xbb", (1, -1), ("x",)))
    assert with_extra == body + pickle.dumps(("x",), protocol=pickle.HIGHEST_PROTOCOL)


TRICKY = [
    # parent bytes vs token count: a longer parent must not absorb the count
    (b"ab", (1, 7), None),
    (b"ab\x02\x00\x00\x00", (7,), None),
    (b"ab\x02\x00\x00\x00\x01\x00\x00\x00", (), None),
    # token count
    (PARENT, (), None),
    (PARENT, (0,), None),
    (PARENT, (0, 0), None),
    # tokens split differently between parent-less blocks
    (PARENT, (1, 2, 3), None),
    (PARENT, (1, 2), None),
    (PARENT, (1, 2, 3, 0), None),
    (PARENT, (256,), None),
    (PARENT, (0, 1), None),
    # extra keys: None vs () vs a value, nesting
    (PARENT, (1, 2, 3), ()),
    (PARENT, (1, 2, 3), ("a",)),
    (PARENT, (1, 2, 3), (("a",),)),
    (PARENT, (1, 2, 3), ("a", "b")),
    (PARENT, (1, 2, 3), ("ab",)),
    (PARENT, (1, 2, 3), (("img", 0),)),
    (PARENT, (1, 2, 3), (("img", -16),)),
    # empty parent
    (b"", (1, 2, 3), None),
]


def test_block_encoding_is_injective_on_tricky_cases():
    bodies = [encode(o) for o in TRICKY]
    assert len(set(bodies)) == len(TRICKY)
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        fn = get_hash_fn_by_name(name)
        assert len({fn(o) for o in TRICKY}) == len(TRICKY), name


def test_hash_block_tokens_chains_on_parent():
    fn = get_hash_fn_by_name("sha256")
    toks = list(range(16))
    h0 = hash_block_tokens(fn, None, toks)
    assert h0 == fn((kv_cache_utils.NONE_HASH, tuple(toks), None))
    assert hash_block_tokens(fn, b"", toks) == h0  # empty parent = root
    assert hash_block_tokens(fn, None, tuple(toks)) == h0  # list or tuple
    assert hash_block_tokens(fn, bytearray(kv_cache_utils.NONE_HASH), toks) == fn((bytearray(kv_cache_utils.NONE_HASH), tuple(toks), None))
    h1 = hash_block_tokens(fn, h0, toks)
    assert h1 == fn((h0, tuple(toks), None)) and h1 != h0  # same tokens, other position
    assert hash_block_tokens(fn, None, toks, ("lora",)) == fn((kv_cache_utils.NONE_HASH, tuple(toks), ("lora",))) != h0


def test_get_hash_fn_by_name_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"hash_algo 'md5'.*sha256"):
        get_hash_fn_by_name("md5")
    with pytest.raises(TypeError, match="hash_algo"):
        get_hash_fn_by_name(None)  # type: ignore[arg-type]


def _none_hash_in_subprocess(seed: str | None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = "import kvlab.core.kv_cache_utils as h; print(h.NONE_HASH.hex())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_none_hash_comes_from_pythonhashseed():
    a, b = _none_hash_in_subprocess("1234"), _none_hash_in_subprocess("1234")
    assert a == b == hashing.sha256("1234").hex()
    assert _none_hash_in_subprocess("99") != a
    # vLLM >= 0.29: without PYTHONHASHSEED the root is sha256("vllm-none-hash") in every process
    # (pickled, as vLLM's sha256 does for a str): the same in two processes, a known value.
    c, d = _none_hash_in_subprocess(None), _none_hash_in_subprocess(None)
    assert c == d == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"


def test_init_none_hash_uses_the_given_function(monkeypatch):
    saved = kv_cache_utils.NONE_HASH
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "7")
        assert kv_cache_utils.init_none_hash(hashing.sha256_cbor) == hashing.sha256_cbor("7") == kv_cache_utils.NONE_HASH
        monkeypatch.delenv("PYTHONHASHSEED")
        assert kv_cache_utils.init_none_hash(hashing.sha256_cbor) == hashing.sha256_cbor("vllm-none-hash")
        # The non-cryptographic hashes keep a random root: a public one would let an attacker
        # precompute collisions (vLLM #12621).
        x, y = kv_cache_utils.init_none_hash(hashing.xxhash), kv_cache_utils.init_none_hash(hashing.xxhash)
        assert x != y and len(x) == 16
        # vLLM <= 0.28's rule on request: a random 32-byte root for every function.
        x, y = kv_cache_utils.init_none_hash(random_root=True), kv_cache_utils.init_none_hash(random_root=True)
        assert x != y and len(x) == 32
        assert kv_cache_utils.none_hash_for(hashing.sha256_cbor) == y  # one root for all, as then
        with pytest.raises(TypeError, match="random_root"):
            kv_cache_utils.init_none_hash(random_root=1)  # type: ignore[arg-type]
    finally:
        kv_cache_utils.init_none_hash()
    assert kv_cache_utils.NONE_HASH == saved


# --- extra keys ------------------------------------------------------------------------------
def test_extra_keys_salt_only_in_first_block():
    req = Request("r", list(range(40)), cache_salt="tenant-a")
    assert generate_block_hash_extra_keys(req, 0, 16) == (("cache_salt", "tenant-a"),)
    assert generate_block_hash_extra_keys(req, 16, 32) is None
    assert generate_block_hash_extra_keys(Request("p", [1] * 16), 0, 16) is None


def test_extra_keys_lora_in_every_block_and_vllm_order():
    img = MultiModalFeature(identifier="img-a", offset=11, length=10)
    req = Request("r", list(range(48)), lora_name="sql", lora_path="/adapters/sql", cache_salt="s", mm_features=[img])
    lora = ("lora", "sql", "/adapters/sql")  # vLLM >= 0.31 tags every key; the path goes in too
    assert generate_block_hash_extra_keys(req, 0, 16) == (lora, ("mm", "img-a", 11), ("cache_salt", "s"))
    assert generate_block_hash_extra_keys(req, 16, 32) == (lora, ("mm", "img-a", -5))
    assert generate_block_hash_extra_keys(req, 32, 48) == (lora,)
    # a LoRA name equal to a salt cannot be confused with it any more
    assert generate_block_hash_extra_keys(Request("q", [1] * 16, lora_name="x"), 0, 16) != generate_block_hash_extra_keys(
        Request("q", [1] * 16, cache_salt="x"), 0, 16
    )


def test_extra_keys_multimodal_overlap_boundaries():
    # a: [0, 16) exactly one block; b: [16, 20); c: [20, 36) spans blocks 1 and 2.
    feats = [MultiModalFeature("c", 20, 16), MultiModalFeature("a", 0, 16), MultiModalFeature("b", 16, 4)]
    req = Request("r", list(range(48)), mm_features=feats)
    assert [f.identifier for f in req.mm_features] == ["a", "b", "c"]  # sorted by offset
    assert generate_block_hash_extra_keys(req, 0, 16) == (("mm", "a", 0),)  # b starts exactly at 16: not here
    assert generate_block_hash_extra_keys(req, 16, 32) == (("mm", "b", 0), ("mm", "c", 4))  # a ended at 16: not here
    assert generate_block_hash_extra_keys(req, 32, 48) == (("mm", "c", -12),)


# --- the request block hasher ----------------------------------------------------------------
def _chain(fn, tokens, bs, extras=None):
    out, parent = [], None
    for i in range(len(tokens) // bs):
        extra = extras(i) if extras else None
        parent = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], extra)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_request_block_hashes_are_the_chain(algo):
    fn = get_hash_fn_by_name(algo)
    toks = [7 * i % 50 for i in range(37)]
    req = Request("r", toks, cache_salt="s", lora_name="l")
    assert req.block_hashes == []  # unbound until a manager sees it
    hasher = get_request_block_hasher(16, fn)
    req.bind_block_hasher(hasher)
    lora = ("lora", "l", None)
    want = _chain(fn, toks, 16, lambda i: (lora, ("cache_salt", "s")) if i == 0 else (lora,))
    assert req.block_hashes == want and len(want) == 2
    req.append_output_token_ids([1] * 10)  # 47 tokens: still 2 full blocks
    assert req.block_hashes == want
    req.append_output_token_ids(3)  # 48: the third block fills now
    full = want + [hash_block_tokens(fn, want[-1], (toks + [1] * 10 + [3])[32:48], (lora,))]
    assert req.block_hashes == full


def test_block_hash_bytes_are_pinned():
    """The encoding is a contract (caches, saved logs and KV events compare hashes): the bytes
    are tag + (parent length, token count) + parent + tokens as int32 LE (+ pickled extras)."""
    h = hash_block_tokens(hashing.sha256, b"\x00" * 32, list(range(16)))
    assert h.hex() == "c50e23022b8cc4c48d0aaea11e3277dcba233eff18e1822c431347e00f242338"
    body = b"\x01kvlab-block\x00" + (32).to_bytes(4, "little") + (16).to_bytes(4, "little") + b"\x00" * 32
    assert h == hashlib.sha256(body + b"".join(t.to_bytes(4, "little") for t in range(16))).digest()
    extra = ("lora-a", ("img", -3), "salt")
    h2 = hash_block_tokens(hashing.sha256, h, [-1] * 16, extra)  # vLLM's placeholder id
    assert h2.hex() == "8b459401ac4134939005a990fa5e3be927feb5227875082648488bee724c2eea"


@pytest.mark.parametrize("bs", [1, 4, 16, 33])
@pytest.mark.parametrize("algo", ["sha256", "xxhash", "weak16"])
def test_request_hasher_fast_path_equals_the_definition(bs, algo):
    """The sha256 fast path (pre-packed tokens, header state copied) must give exactly
    hash_fn((parent or NONE_HASH, tuple(tokens), extra)) for every block, as tokens arrive
    one by one and in bursts, with and without extra keys."""
    import random

    fn = get_hash_fn_by_name(algo)
    rng = random.Random(bs)
    for kw in ({}, {"cache_salt": "s"}, {"lora_name": "l"}, {"mm_features": [MultiModalFeature("img", 3, 5)]}):
        toks = [rng.randrange(-(2**31), 2**31) for _ in range(3 * bs + 1 + 8)]
        req = Request("r", toks[: bs + 1 + 8], block_hasher=get_request_block_hasher(bs, fn), **kw)
        for t in toks[bs + 1 + 8 :]:
            req.append_output_token_ids(t)
        req.append_output_token_ids(toks[:bs])  # a burst
        all_toks = req.all_token_ids
        assert bytes(req.token_bytes) == b"".join(t.to_bytes(4, "little", signed=True) for t in all_toks)
        want, parent = [], kv_cache_utils.none_hash_for(fn)  # each function has its root (vLLM 0.29)
        for i in range(len(all_toks) // bs):
            extra = generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs)
            parent = fn((parent, tuple(all_toks[i * bs : (i + 1) * bs]), extra))
            want.append(parent)
        assert req.block_hashes == want, kw
        # and all of them in one call (a fresh request: the tight loop over many blocks)
        whole = Request("w", all_toks, block_hasher=get_request_block_hasher(bs, fn), **kw)
        assert whole.block_hashes == want, kw


def test_a_custom_extra_keys_fn_is_called_for_every_block():
    calls = []

    def extra(req, start, end):
        calls.append((start, end))
        return ("tenant-x",)

    hasher = get_request_block_hasher(4, hashing.sha256, extra_keys_fn=extra)
    req = Request("r", list(range(10)), block_hasher=hasher)
    assert calls == [(0, 4), (4, 8)] and req.block_hashes[0] == hash_block_tokens(hashing.sha256, None, [0, 1, 2, 3], ("tenant-x",))
    # A manager with the same block size and hash function keeps the request's own hasher.
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.get_computed_blocks(req)
    assert req.block_hasher is hasher
    req.append_output_token_ids([1, 2])
    assert calls[-1] == (8, 12) and len(req.block_hashes) == 3


def test_request_is_bound_to_one_hasher():
    req = Request("r", list(range(20)))
    KVCacheManager(num_blocks=4, block_size=16).get_computed_blocks(req)
    KVCacheManager(num_blocks=4, block_size=16).get_computed_blocks(req)  # same settings: fine
    with pytest.raises(ValueError, match="already hashed"):
        KVCacheManager(num_blocks=4, block_size=8).get_computed_blocks(req)
    with pytest.raises(ValueError, match="already hashed"):
        KVCacheManager(num_blocks=4, block_size=16, hash_algo="xxhash").get_computed_blocks(req)


def test_weak16_collisions_give_wrong_hits():
    """weak16 exists to show what a collision does: another prompt's blocks are returned."""
    fn = get_hash_fn_by_name("weak16")
    seen: dict[bytes, list[int]] = {}
    for a, b in itertools.product(range(200), range(200)):
        block = [a, b] + [0] * 14
        h = hash_block_tokens(fn, None, block)
        if h in seen:
            first, second = seen[h], block
            break
        seen[h] = block
    else:  # pragma: no cover - 40,000 draws from 65,536 values always collide
        pytest.fail("no weak16 collision found")
    mgr = KVCacheManager(num_blocks=6, block_size=16, hash_algo="weak16")
    r0 = Request("r0", first + [5])
    hits, n = mgr.get_computed_blocks(r0)
    mgr.allocate_slots(r0, 17, n, hits)
    r1 = Request("r1", second + [5])
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 16 and hits.get_block_ids() == ([1],)  # r1's first block "is" r0's: wrong context
    # the same pair of prompts under sha256 does not share anything
    safe = KVCacheManager(num_blocks=6, block_size=16)
    s0 = Request("r0", first + [5])
    assert safe.get_computed_blocks(s0)[1] == 0
    safe.allocate_slots(s0, 17)
    assert safe.get_computed_blocks(Request("r1", second + [5]))[1] == 0


def test_lookahead_flag_reads_as_zero_or_one_token():
    """vLLM's tests pass a bool as num_hash_lookahead_tokens; True is one lookahead token."""
    from kvlab.core.kv_cache_utils import get_request_block_hasher

    fn = get_hash_fn_by_name("sha256")
    assert get_request_block_hasher(4, fn, True).num_hash_lookahead_tokens == 1
    assert get_request_block_hasher(4, fn, False).num_hash_lookahead_tokens == 0
    a = Request("a", list(range(9)), block_hasher=get_request_block_hasher(4, fn, True))
    b = Request("b", list(range(9)), block_hasher=get_request_block_hasher(4, fn, 1))
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    with pytest.raises(TypeError, match=r"num_hash_lookahead_tokens must be an int >= 0, got float 1.0"):
        get_request_block_hasher(4, fn, 1.0)
