"""Checkers: hash_chain, extra_keys (lesson 03)."""

from __future__ import annotations

import random
from typing import Any

from kvlab.core import kv_cache_utils
from kvlab.exercises.registry import call, register, returns, same, wrong_kind
from kvlab.exercises.result import CheckResult, failed, passed
from kvlab.request import MultiModalFeature, Request
from kvlab.utils import hashing


def _short(v: Any, n: int = 90) -> str:
    s = repr(v)
    if isinstance(v, bytes):
        s = f"<{len(v)} bytes {v.hex()[:12]}…>"
    return s if len(s) <= n else s[: n - 1] + "…"


def _describe_obj(obj: Any) -> str:
    if isinstance(obj, tuple) and len(obj) == 3:
        p, t, x = obj
        return f"({_short(p, 30)}, {type(t).__name__} of {len(t) if hasattr(t, '__len__') else '?'} tokens, {_short(x, 30)})"
    return _short(obj)


@register(
    "hash_chain",
    "Chained block hash",
    "hash_block_tokens(hash_fn, parent_hash_or_None, token_ids, extra_keys_or_None) -> bytes",
    "03_prefix_caching",
    [
        "The hash of a block is hash_fn of ONE tuple: (parent, tokens, extra_keys).",
        "The first block has no parent: use kvlab.core.kv_cache_utils.NONE_HASH instead of None, so every chain starts from the same root.",
        "Convert the tokens to a tuple: lists and tuples serialise differently, and two requests must agree byte for byte.",
    ],
    notebook="ex_hashing",
)
def check_hash_chain(fn: Any) -> CheckResult:
    eid = "hash_chain"
    seen: list[Any] = []

    def spy(obj: Any) -> bytes:
        seen.append(obj)
        return hashing.sha256(obj)

    rng = random.Random(3)
    t1 = [rng.randrange(1000) for _ in range(16)]
    t2 = [rng.randrange(1000) for _ in range(16)]
    none = kv_cache_utils.NONE_HASH
    cases = [
        ("first block (no parent)", None, t1, None),
        ("second block, chained to the first", kv_cache_utils.hash_block_tokens(hashing.sha256, None, t1), t2, None),
        ("a block with a LoRA adapter", None, t1, ("adapter-a",)),
        ("a block with an image and a salt", b"p" * 32, t2, (("img-a", 3), "tenant-secret")),
    ]
    for name, parent, toks, extra in cases:
        seen.clear()
        got = call(fn, spy, parent, list(toks), extra, where=f"hashing the {name}")
        want_obj = (parent or none, tuple(toks), extra)
        want = hashing.sha256(want_obj)
        bad = wrong_kind(eid, got, want, name, "the block hash")
        if bad is not None:
            return bad
        if same(got, want):
            continue
        idea = "a block hash is hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))"
        if not seen:
            idea = "call the hash_fn you were given (the checker passes its own); do not pick an algorithm yourself"
        else:
            obj = seen[-1]
            if isinstance(obj, tuple) and len(obj) == 3:
                p, t, x = obj
                if p is None or (parent is None and p != none):
                    idea = "the first block's parent must be NONE_HASH (kvlab.core.kv_cache_utils.NONE_HASH), not None or b''"
                elif parent is not None and p != parent:
                    idea = "unchained: the parent hash must go in, so one hash names the whole prefix, not just its 16 tokens"
                elif not isinstance(t, tuple):
                    idea = "pass the tokens as a tuple: a list serialises differently, so equal prefixes would not match"
                elif x != extra:
                    idea = "the extra keys (LoRA, image, salt) belong in the hash, or two adapters would share KV"
            elif isinstance(obj, tuple) and all(isinstance(v, int) for v in obj):
                idea = "unchained: you hashed only the block's own tokens; the parent hash and the extra keys must go in too"
        return failed(
            eid,
            f"wrong hash for the {name}",
            case=name,
            inputs=f"parent={_short(parent, 30)}, tokens={_short(toks, 50)}, extra_keys={extra!r}",
            expected=f"hash_fn{_describe_obj(want_obj)} = {_short(want)}",
            got=f"{_short(got)}" + (f", after calling hash_fn{_describe_obj(seen[-1])}" if seen else ""),
            idea=idea,
        )
    # The chain property, stated on the learner's own function.
    a = call(fn, hashing.sha256, None, t1, None, where="hashing block 1")
    b1 = call(fn, hashing.sha256, a, t2, None, where="hashing block 2 after prefix A")
    b2 = call(fn, hashing.sha256, call(fn, hashing.sha256, None, t2, None, where="hashing"), t2, None, where="hashing")
    if same(b1, b2):
        return failed(eid, "the same tokens after two different beginnings got the same hash", idea="chain the parent hash")
    return passed(eid, "every case matches vLLM's chained hash; equal tokens after different prefixes hash differently.")


def _untag(key: Any) -> Any:
    """A tagged key as vLLM < 0.31 wrote it: the LoRA name, (identifier, offset), the salt."""
    if isinstance(key, tuple) and key and key[0] == "mm":
        return key[1:]
    if isinstance(key, tuple) and key and key[0] in ("lora", "cache_salt"):
        return key[1]
    return key


def _reference_extra_keys(req: Request, start: int, end: int) -> tuple | None:
    return kv_cache_utils.generate_block_hash_extra_keys(req, start, end)


@register(
    "extra_keys",
    "Extra keys: LoRA, images, cache_salt",
    "block_extra_keys(request, start, end) -> tuple | None",
    "06_identity_and_privacy",
    [
        "Order: the LoRA key first, then each image overlapping [start, end), then the salt.",
        "Every key is a tagged tuple: ('lora', name, path), ('mm', identifier, offset), ('cache_salt', salt).",
        "An image is ('mm', identifier, offset - start): where its placeholder begins relative to THIS block (may be negative).",
        "The salt goes only into the block that starts at token 0; the chain carries it to every later block.",
        "Return None (not an empty tuple) when there is nothing to add.",
    ],
    notebook="ex_hashing",
)
def check_extra_keys(fn: Any) -> CheckResult:
    eid = "extra_keys"
    toks = list(range(100, 148))
    img = MultiModalFeature("img-a", offset=11, length=10)
    img2 = MultiModalFeature("img-b", offset=30, length=4)
    reqs = {
        "plain": Request("x0", toks),
        "salted": Request("x1", toks, cache_salt="s3cr3t"),
        "lora": Request("x2", toks, lora_name="sql-adapter"),
        "image spanning blocks 0-1": Request("x3", toks, mm_features=[img]),
        "everything": Request("x4", toks, lora_name="sql-adapter", cache_salt="s3cr3t", mm_features=[img, img2]),
    }
    for name, req in reqs.items():
        for start in (0, 16, 32):
            end = start + 16
            want = _reference_extra_keys(req, start, end)
            got = call(fn, req, start, end, where=f"computing extra keys of block [{start}, {end}) ({name})")
            if same(got, want):
                continue
            if got is not None and not isinstance(got, tuple):
                return failed(
                    eid,
                    f"extra keys must be a tuple or None, got {type(got).__name__} {got!r:.60}",
                    case=name,
                    expected=repr(want),
                    got=repr(got),
                    idea="return a tuple of keys, or None when the block has none",
                )
            idea = "('lora', name, path) every block, images as ('mm', identifier, offset - start), ('cache_salt', salt) in the first block only"
            keys = list(got) if isinstance(got, tuple) else []
            salt_key = ("cache_salt", req.cache_salt)
            lora_key = ("lora", req.lora_name, req.lora_path)
            if want is None and got == ():
                idea = "return None when a block has no extra keys (vLLM hashes None, not an empty tuple)"
            elif want is not None and keys and len(keys) == len(want) and all(_untag(w) == g for w, g in zip(want, keys)):
                idea = "untagged keys (vLLM before 0.31): tag each key with its kind -- ('lora', ...), ('mm', ...), ('cache_salt', ...) -- so a LoRA name can never be taken for a salt"
            elif req.cache_salt and start > 0 and salt_key in keys:
                idea = "the salt belongs to the FIRST block only; the chain carries it to the rest"
            elif req.cache_salt and start == 0 and salt_key not in keys:
                idea = "the first block must carry ('cache_salt', salt), or two tenants share blocks (a timing side channel)"
            elif req.lora_name and lora_key not in keys:
                idea = "every block depends on the adapter: ('lora', name, path) goes into every block"
            elif (
                req.mm_features
                and start
                and any(isinstance(k, tuple) and len(k) == 3 and k[0] == "mm" and k[2] == img.offset for k in keys)
            ):
                idea = "the image offset is relative to the block start: offset - start (negative when it began earlier)"
            elif keys and want and set(map(repr, keys)) == set(map(repr, want)):
                idea = "right keys, wrong order: LoRA, then images, then the salt"
            return failed(
                eid,
                f"wrong extra keys for block [{start}, {end}) of the {name} request",
                case=name,
                inputs=f"lora={req.lora_name!r}, salt={req.cache_salt!r}, images={[(f.identifier, f.offset, f.length) for f in req.mm_features]}",
                expected=repr(want),
                got=repr(got),
                idea=idea,
            )
    # In the engine: the learner's function is the requests' extra-keys function (their
    # block hasher's), and tenant isolation must hold.
    from kvlab.core.kv_cache_manager import KVCacheManager

    def extra_keys(req: Request, start: int, end: int) -> tuple | None:
        keys = call(fn, req, start, end, where=f"computing extra keys of block [{start}, {end}) inside the engine")
        return None if keys is None else returns(keys, tuple, "block_extra_keys")

    hasher = kv_cache_utils.get_request_block_hasher(16, hashing.sha256, extra_keys_fn=extra_keys)
    mgr = KVCacheManager(num_blocks=16, block_size=16)
    a = Request("tenant-a", toks, cache_salt="a-secret", block_hasher=hasher)
    hits, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, len(toks) - n, n, hits)
    b = Request("tenant-b", toks, cache_salt="b-secret", block_hasher=hasher)
    _, hit = mgr.get_computed_blocks(b)
    c = Request("tenant-a2", toks, cache_salt="a-secret", block_hasher=hasher)
    _, hit_same = mgr.get_computed_blocks(c)
    if hit or hit_same != 32:
        return failed(eid, f"in the engine: other tenant hit {hit} tokens (want 0), same tenant hit {hit_same} (want 32)")
    return passed(
        eid, "every block's extra keys match; in the engine, salted tenants share nothing and one tenant still hits its own prefix."
    )
