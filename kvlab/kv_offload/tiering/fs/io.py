"""One block per file: how the storage tier writes and checks its files (vLLM:
``vllm/v1/kv_offload/tiering/fs/io.py``; lesson 12).

A file holds one block's KV for every layer, behind a small header: a magic string, the
block's offload key, the payload size and its SHA-256. Reading checks all four, so a file
that was truncated, overwritten by another block, or flipped on disk is refused with a
:class:`TierFileError` naming the file -- the connector then treats the block as a miss and
recomputes it. Writes go to ``<path>.tmp`` first and are renamed into place (``os.replace``
is atomic), as vLLM's file-system tier does: a reader never sees half a file.

The folder may be shared (another engine, another user): the tier neither writes through
nor reads through a symlink, and reads only regular files, never more bytes than a block
file holds -- a link, a FIFO or a device in a tier file's place is a bad file, not a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
import threading

MAGIC = b"KVLABKV1"
_HEAD = struct.Struct("<8sH")  # magic, key length
_TAIL = struct.Struct("<Q32s")  # payload length, sha256 of the payload
# Not every OS has these flags (Windows lacks O_NOFOLLOW and O_NONBLOCK): 0 leaves them out.
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)


class TierFileError(OSError):
    """A storage-tier file is missing or does not hold the block it should."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"KV tier file {path}: {reason}")
        self.path = path
        self.reason = reason


def write_block_file(path: str, key: bytes, payload: bytes | memoryview) -> int:
    """Write one block atomically; returns the bytes written.

    The temporary file is created fresh (``O_CREAT | O_EXCL | O_NOFOLLOW``): a symlink
    planted at ``<path>.tmp`` would otherwise make the tier write through it, to a file
    outside its folder. A stale regular ``.tmp`` (a write that died) is removed first;
    anything else there is refused (:class:`TierFileError`: the store fails, a future miss).
    """
    data = bytes(payload)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    if os.path.islink(folder):  # the tier's own subfolder: a link would lead writes outside
        raise TierFileError(path, f"its folder {folder} is a symlink; refusing to write through it")
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(tmp).st_mode):
            os.remove(tmp)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY, 0o644)
    except FileExistsError:
        raise TierFileError(path, f"{tmp} exists and is not a regular file (a symlink?); refusing to write through it") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEAD.pack(MAGIC, len(key)))
            f.write(key)
            f.write(_TAIL.pack(len(data), hashlib.sha256(data).digest()))
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # ours (O_EXCL made it): no half file is left behind
        raise
    return _HEAD.size + len(key) + _TAIL.size + len(data)


def read_block_file(path: str, key: bytes, nbytes: int) -> bytes:
    """The payload of ``path`` if it holds block ``key`` with ``nbytes`` intact bytes;
    otherwise :class:`TierFileError` saying what is wrong.

    Only a regular file is read, and only as many bytes as a block file has: a FIFO put in
    its place would block the step for ever, ``/dev/zero`` (or a link to it) would be read
    until memory runs out. So the file is opened without following a link and without
    waiting (``O_NOFOLLOW | O_NONBLOCK``), and checked with ``fstat`` before any read."""
    size = _HEAD.size + len(key) + _TAIL.size + nbytes
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_BINARY)
    except FileNotFoundError:
        raise TierFileError(path, "missing (deleted behind the tier's back?)") from None
    except OSError as e:
        if os.path.islink(path):
            raise TierFileError(path, "is a symlink, not a regular file") from None
        raise TierFileError(path, f"cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TierFileError(path, f"is not a regular file ({_kind(st.st_mode)})")
        raw = f.read(size + 1)  # never more than a block file holds (and one byte to see it is longer)
    if len(raw) < _HEAD.size or raw[:8] != MAGIC:
        raise TierFileError(path, "not a kvlab block file (bad magic)")
    _, klen = _HEAD.unpack_from(raw, 0)
    at = _HEAD.size
    if raw[at : at + klen] != key:
        raise TierFileError(path, "holds another block (key mismatch)")
    at += klen
    if len(raw) < at + _TAIL.size:
        raise TierFileError(path, "truncated header")
    length, digest = _TAIL.unpack_from(raw, at)
    at += _TAIL.size
    payload = raw[at:]
    if length != nbytes or len(payload) != nbytes:
        held = max(st.st_size, len(raw)) - at
        raise TierFileError(path, f"holds {held} payload bytes, expected {nbytes} (truncated or from another model)")
    if hashlib.sha256(payload).digest() != digest:
        raise TierFileError(path, "checksum mismatch (corrupt)")
    return payload


def is_regular_file(path: str) -> bool:
    """True when ``path`` is a regular file itself (not a link, a FIFO, a device): the only
    kind the tier reads."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"mode {stat.filemode(mode)}"


def delete_block_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# -- vLLM 0.33's raw block files (the asynchronous tier, ``fs/manager.py``) --------------------------
# A file is exactly one chunk's bytes, as vLLM's file-system tier writes it, so a folder written by
# one can be read by the other. There is no header to check: the file's name is the block's hash,
# and a file of the wrong size is the only damage a read can see (it is removed, vLLM's rule).

O_DIRECT = getattr(os, "O_DIRECT", 0)
# vLLM moves batches through a C extension (``vllm.fs_io_C``) when it is built, and falls back to
# Python. kvlab has only the Python path; the flag is here, False, so code and tests that ask which
# path runs get the true answer.
_HAS_FSIO_C = False


def probe_o_direct(directory: str) -> bool:
    """Whether ``O_DIRECT`` (no page cache) works in ``directory``: one aligned page is written
    and removed. Some file systems refuse it (overlayfs under a container's /tmp, tmpfs, some
    NFS mounts); the tier then uses buffered I/O rather than failing every block."""
    if not O_DIRECT:
        return False
    import mmap

    path = os.path.join(directory, f".o_direct_probe_{os.getpid()}_{threading.get_ident()}")
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | O_DIRECT | _O_NOFOLLOW, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.remove(path)


def _byte_slices(view: memoryview, offsets: list[int], block_size: int) -> list[memoryview]:
    flat = view.cast("B")
    for offset in offsets:
        if offset < 0 or offset + block_size > len(flat):
            raise ValueError(f"block offset {offset} (block_size {block_size}) is out of bounds for a buffer of {len(flat)} bytes")
    return [flat[o : o + block_size] for o in offsets]


def batch_store_block(paths: list[str], view: memoryview, offsets: list[int], block_size: int, use_o_direct: bool = True) -> None:
    """Write ``view``'s bytes ``[offset, offset + block_size)`` to each path (skipping a path
    that exists: same name, same block): a temporary file renamed into place, so no reader
    sees half a block. Stops at the first error.

    Another engine sharing the folder may publish the same block between the existence
    check and the rename; some shared file systems then fail the rename with EEXIST rather
    than replace. The name is the block's content hash, so the file in place already holds
    these bytes: the store is done, and the temporary file is removed."""
    if len(paths) != len(offsets):
        raise ValueError(f"{len(paths)} paths but {len(offsets)} offsets")
    direct = O_DIRECT if use_o_direct else 0
    for path, data in zip(paths, _byte_slices(view, offsets, block_size)):
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}_{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | direct | _O_NOFOLLOW, 0o644)
            try:
                if os.write(fd, data) != block_size:
                    raise OSError(f"short write to {tmp}")
            finally:
                os.close(fd)
            try:
                os.replace(tmp, path)
            except FileExistsError:  # lost the race to another writer of the same block
                os.remove(tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise


class BatchLoadError(OSError):
    """A batched read stopped at a block; ``num_succeeded`` blocks before it arrived."""

    def __init__(self, message: str, num_succeeded: int) -> None:
        super().__init__(message)
        self.num_succeeded = num_succeeded


def batch_load_block(paths: list[str], view: memoryview, offsets: list[int], block_size: int, use_o_direct: bool = True) -> None:
    """Read each path into ``view`` at its offset, in order. A file shorter than a block is
    damaged and removed; any failure raises :class:`BatchLoadError` with the number of
    blocks read before it (those stay usable)."""
    if len(paths) != len(offsets):
        raise ValueError(f"{len(paths)} paths but {len(offsets)} offsets")
    direct = O_DIRECT if use_o_direct else 0
    for i, (path, dest) in enumerate(zip(paths, _byte_slices(view, offsets, block_size))):
        try:
            fd = os.open(path, os.O_RDONLY | direct | _O_NOFOLLOW | _O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{path} is not a regular file")
                got = os.readv(fd, [dest])
            finally:
                os.close(fd)
            if got < block_size:
                with contextlib.suppress(OSError):
                    os.remove(path)
                raise OSError(f"short read from {path}: {got} of {block_size} bytes")
        except OSError as exc:
            raise BatchLoadError(f"block {i} of {len(paths)}: {exc}", i) from exc
