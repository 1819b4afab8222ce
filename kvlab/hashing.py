"""Block hashing: how a full block of tokens becomes a prefix-cache key (lesson 03).

A block's hash is ``hash_fn((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))``.
Because the parent's hash is an input, one hash names the *whole prefix* up to and
including this block, not just its own 16 tokens: the same tokens after a different
beginning get a different key. Extra keys carry what token ids alone cannot: the LoRA
adapter (every block), the multimodal items overlapping the block, and the tenant's
``cache_salt`` (first block only -- the chain carries it to every later block).

vLLM: ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``,
``generate_block_hash_extra_keys``, ``get_request_block_hasher``) and
``vllm/utils/hashing.py`` (``get_hash_fn_by_name``).

Serialisation. vLLM's ``sha256`` pickles the tuple, which costs about twice the SHA-256
itself. kvlab's hash functions recognise the block-key shape ``(bytes, tuple[int, ...],
extra)`` and serialise it canonically instead (a tag, the parent's length and the token
count, then the parent bytes, the tokens as little-endian uint32, then the pickled extra
keys when present). The encoding is injective, so the hash is still a faithful function
of (parent, tokens, extra keys); any other object is pickled, as in vLLM. Token ids must
fit in 32 bits (``Request`` checks).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash as _xxhash

BlockHash = bytes
HashFn = Callable[[Any], bytes]

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_BLOCK_TAG = b"\x01kvlab-block\x00"  # never the first bytes of a pickle (those are b"\x80")
_sha256 = hashlib.sha256


class _BlockFormat(struct.Struct):
    """Packs one block key in a single call: header, parent, tokens (uint32 little-endian).

    The header is the tag, the parent's length and the token count: with both lengths
    up front, parents of different lengths (NONE_HASH is 32 bytes, an xxhash parent 16, a
    weak16 parent 2) cannot shift bytes into the tokens, so the encoding stays injective.
    """

    __slots__ = ("header",)


_FORMATS: dict[tuple[int, int], _BlockFormat] = {}


def _block_format(parent_len: int, num_tokens: int) -> _BlockFormat:
    f = _FORMATS.get((parent_len, num_tokens))
    if f is None:
        header = _BLOCK_TAG + struct.pack("<II", parent_len, num_tokens)
        f = _FORMATS[(parent_len, num_tokens)] = _BlockFormat(f"<{len(header)}s{parent_len}s{num_tokens}I")
        f.header = header
    return f


def encode(obj: Any) -> bytes:
    """The exact bytes a kvlab hash function digests for ``obj``."""
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is bytes and type(obj[1]) is tuple:
        parent, tokens, extra = obj
        f = _block_format(len(parent), len(tokens))
        body = f.pack(f.header, parent, *tokens)
        if extra is None:
            return body
        return body + pickle.dumps(extra, protocol=_PICKLE_PROTOCOL)
    return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)


def sha256(obj: Any) -> bytes:
    """SHA-256 of the canonical encoding (32 bytes). vLLM's default since v0.11."""
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is bytes and type(obj[1]) is tuple and obj[2] is None:
        # Inlined fast path of `encode` for the common case: no extra keys.
        parent, tokens = obj[0], obj[1]
        f = _FORMATS.get((len(parent), len(tokens))) or _block_format(len(parent), len(tokens))
        return _sha256(f.pack(f.header, parent, *tokens)).digest()
    return _sha256(encode(obj)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 over canonical CBOR: reproducible across languages (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash(obj: Any) -> bytes:
    """xxHash3-128 of the canonical encoding: fast, NOT cryptographic (16 bytes)."""
    return _xxhash.xxh3_128_digest(encode(obj))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def weak16(obj: Any) -> bytes:
    """UNSAFE teaching hash: only 16 bits, so collisions are easy to find on purpose.

    Lesson 06 uses it to show what a collision does: a lookup returns *another prompt's*
    blocks and the model answers from the wrong context. Never use it for anything else.
    """
    return hashlib.sha256(encode(obj)).digest()[:2]


_HASH_FNS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
    "weak16": weak16,
}
UNSAFE_HASH_ALGOS = frozenset({"weak16"})
HASH_ALGOS = tuple(_HASH_FNS)


def get_hash_fn_by_name(name: str) -> HashFn:
    """Return the hash function called ``name`` (one of ``HASH_ALGOS``)."""
    if not isinstance(name, str):
        raise TypeError(f"hash_algo must be a str, got {type(name).__name__}")
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown hash_algo {name!r}; choose one of {', '.join(HASH_ALGOS)}") from None


# --- NONE_HASH: the "parent" of every first block -----------------------------------------
#
# Why random by default: if the root of every chain were a public constant, anyone could
# precompute the hash of any prefix offline and, with a weak hash, craft collisions against
# it. A per-process random root makes chains unpredictable from outside. Why PYTHONHASHSEED
# when set: reproducibility -- tests, notebooks and multi-process deployments that must
# agree on hashes set it and then get the same root everywhere.
NONE_HASH: BlockHash = b""


def init_none_hash(hash_fn: HashFn = sha256) -> BlockHash:
    global NONE_HASH
    seed = os.environ.get("PYTHONHASHSEED")
    NONE_HASH = os.urandom(32) if seed is None else hash_fn(seed)
    return NONE_HASH


init_none_hash()


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block, chained to its parent: ``hash_fn((parent, tokens, extra))``."""
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    if hash_fn is sha256 and extra_keys is None and type(parent_block_hash) is bytes:
        # The default, inlined: the same bytes as sha256((parent, tuple(tokens), None)),
        # without building the tuple or making a second call (see `kvlab.bench core`).
        f = _FORMATS.get((len(parent_block_hash), len(curr_block_token_ids))) or _block_format(
            len(parent_block_hash), len(curr_block_token_ids)
        )
        return _sha256(f.pack(f.header, parent_block_hash, *curr_block_token_ids)).digest()
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int) -> tuple[Any, ...] | None:
    """Extra keys for the block covering tokens ``[start, end)``, in vLLM's order.

    LoRA name (every block, since the adapter changes every K and V), then each multimodal
    item overlapping the block as ``(identifier, offset - start)`` (the image, and where in
    the block its placeholder begins), then ``cache_salt`` (first block only).
    """
    keys: list[Any] = []
    if request.lora_name is not None:
        keys.append(request.lora_name)
    for f in request.mm_features:
        if f.offset >= end_token_idx:
            break  # features are sorted by offset
        if f.offset + f.length > start_token_idx:
            keys.append((f.identifier, f.offset - start_token_idx))
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def get_request_block_hasher(block_size: int, hash_fn: HashFn) -> Callable[[Any], list[BlockHash]]:
    """A function computing the hashes of a request's *new* full blocks (incremental)."""

    def request_block_hasher(request: Any) -> list[BlockHash]:
        hashes = request.block_hashes
        start = len(hashes) * block_size
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        parent = hashes[-1] if hashes else NONE_HASH
        simple = request.lora_name is None and not request.mm_features
        new: list[BlockHash] = []
        while start + block_size <= num_tokens:
            end = start + block_size
            extra = None if simple and (start or request.cache_salt is None) else generate_block_hash_extra_keys(request, start, end)
            parent = hash_block_tokens(hash_fn, parent, tokens[start:end], extra)
            new.append(parent)
            start = end
        return new

    return request_block_hasher
