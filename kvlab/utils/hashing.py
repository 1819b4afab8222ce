"""Hash functions for block keys, by name (lesson 03, 06).

vLLM: ``vllm/utils/hashing.py`` (``sha256``, ``sha256_cbor``, ``xxhash``,
``get_hash_fn_by_name``). What gets hashed -- the chained block key -- is built in
``kvlab.core.kv_cache_utils``.

Serialisation. vLLM's ``sha256`` pickles the tuple, which costs about twice the SHA-256
itself. kvlab's hash functions recognise the block-key shape ``(bytes, tuple[int, ...],
extra)`` and serialise it canonically instead (a tag, the parent's length and the token
count, then the parent bytes, the tokens as little-endian int32, then the pickled extra
keys when present). The encoding is injective, so the hash is still a faithful function
of (parent, tokens, extra keys); any other object is pickled, as in vLLM. Token ids must
be int32 (``Request`` checks): vLLM's ``input_ids`` are an int32 tensor, and its
schedulers write -1 as the placeholder of a token not known yet, so negative ids occur.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable
from typing import Any

import cbor2
import xxhash as _xxhash

BlockHash = bytes
HashFn = Callable[[Any], bytes]

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_BLOCK_TAG = b"\x01kvlab-block\x00"  # never the first bytes of a pickle (those are b"\x80")
_sha256 = hashlib.sha256

#: The token ids kvlab accepts: int32, as vLLM's ``input_ids`` tensors hold them. Negative
#: ids are legal -- vLLM writes -1 for a placeholder (a speculative token not sampled yet)
#: and its tests fill prompts with -1 / -2 -- so the packed layout is signed.
MIN_TOKEN_ID = -(2**31)
MAX_TOKEN_ID = 2**31 - 1
TOKEN_ID_WHY = " (token ids are int32)"


class _BlockFormat(struct.Struct):
    """Packs one block key in a single call: header, parent, tokens (int32 little-endian).

    The header is the tag, the parent's length and the token count: with both lengths
    up front, parents of different lengths (NONE_HASH is 32 bytes, an xxhash parent 16, a
    weak16 parent 2) cannot shift bytes into the tokens, so the encoding stays injective.
    """

    __slots__ = ("header",)
    header: bytes  # the slot: set once, by _block_format


_FORMATS: dict[tuple[int, int], _BlockFormat] = {}


def _block_format(parent_len: int, num_tokens: int) -> _BlockFormat:
    f = _FORMATS.get((parent_len, num_tokens))
    if f is None:
        header = _BLOCK_TAG + struct.pack("<II", parent_len, num_tokens)
        f = _FORMATS[(parent_len, num_tokens)] = _BlockFormat(f"<{len(header)}s{parent_len}s{num_tokens}i")
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
    """SHA-256 of kvlab's canonical encoding (32 bytes); kvlab's default, as ``sha256`` is
    vLLM's default (since v0.10.2). Same SHA-256, different serialisation: vLLM pickles the
    block tuple, so these digests are NOT vLLM's bytes -- use ``sha256_cbor`` for that."""
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is bytes and type(obj[1]) is tuple and obj[2] is None:
        # Inlined fast path of `encode` for the common case: no extra keys.
        parent, tokens = obj[0], obj[1]
        f = _FORMATS.get((len(parent), len(tokens))) or _block_format(len(parent), len(tokens))
        return _sha256(f.pack(f.header, parent, *tokens)).digest()
    return _sha256(encode(obj)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 over canonical CBOR: vLLM's ``sha256_cbor`` byte for byte, reproducible in
    any language. With NONE_HASH derived the same way (``kv_cache_utils.none_hash_for``) a
    block's hash equals vLLM's, so a KV-event consumer can recompute it (lesson 08)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash(obj: Any) -> bytes:
    """xxHash3-128 of the canonical encoding: fast, NOT cryptographic (16 bytes)."""
    return _xxhash.xxh3_128_digest(encode(obj))


def xxhash_cbor(obj: Any) -> bytes:
    """xxHash3-128 over canonical CBOR: vLLM's ``xxhash_cbor`` byte for byte."""
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
# Hash functions whose digests are vLLM's own bytes for the same input. kvlab's "sha256" and
# "xxhash" digest a canonical encoding instead of vLLM's pickle (faster, same guarantees).
VLLM_IDENTICAL_HASH_ALGOS = frozenset({"sha256_cbor", "xxhash_cbor"})
HASH_ALGOS = tuple(_HASH_FNS)


def get_hash_fn_by_name(name: str) -> HashFn:
    """Return the hash function called ``name`` (one of ``HASH_ALGOS``)."""
    if not isinstance(name, str):
        raise TypeError(f"hash_algo must be a str, got {type(name).__name__}")
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown hash_algo {name!r}; choose one of {', '.join(HASH_ALGOS)}") from None
