"""One block per file: how the storage tier writes and checks its files (vLLM:
``vllm/v1/kv_offload/tiering/fs/io.py``; lesson 12).

A file holds one block's KV for every layer, behind a small header: a magic string, the
block's offload key, the payload size and its SHA-256. Reading checks all four, so a file
that was truncated, overwritten by another block, or flipped on disk is refused with a
:class:`TierFileError` naming the file -- the connector then treats the block as a miss and
recomputes it. Writes go to ``<path>.tmp`` first and are renamed into place (``os.replace``
is atomic), as vLLM's file-system tier does: a reader never sees half a file.
"""
from __future__ import annotations

import hashlib
import os
import struct

MAGIC = b"KVLABKV1"
_HEAD = struct.Struct("<8sH")  # magic, key length
_TAIL = struct.Struct("<Q32s")  # payload length, sha256 of the payload


class TierFileError(OSError):
    """A storage-tier file is missing or does not hold the block it should."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"KV tier file {path}: {reason}")
        self.path = path
        self.reason = reason


def write_block_file(path: str, key: bytes, payload: bytes | memoryview) -> int:
    """Write one block atomically; returns the bytes written."""
    data = bytes(payload)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(MAGIC, len(key)))
        f.write(key)
        f.write(_TAIL.pack(len(data), hashlib.sha256(data).digest()))
        f.write(data)
    os.replace(tmp, path)
    return _HEAD.size + len(key) + _TAIL.size + len(data)


def read_block_file(path: str, key: bytes, nbytes: int) -> bytes:
    """The payload of ``path`` if it holds block ``key`` with ``nbytes`` intact bytes;
    otherwise :class:`TierFileError` saying what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TierFileError(path, "missing (deleted behind the tier's back?)") from None
    if len(raw) < _HEAD.size or raw[:8] != MAGIC:
        raise TierFileError(path, "not a kvlab block file (bad magic)")
    _, klen = _HEAD.unpack_from(raw, 0)
    at = _HEAD.size
    if raw[at:at + klen] != key:
        raise TierFileError(path, "holds another block (key mismatch)")
    at += klen
    if len(raw) < at + _TAIL.size:
        raise TierFileError(path, "truncated header")
    length, digest = _TAIL.unpack_from(raw, at)
    at += _TAIL.size
    payload = raw[at:]
    if length != nbytes or len(payload) != nbytes:
        raise TierFileError(path, f"holds {len(payload)} payload bytes, expected {nbytes} (truncated or from another model)")
    if hashlib.sha256(payload).digest() != digest:
        raise TierFileError(path, "checksum mismatch (corrupt)")
    return payload


def delete_block_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
