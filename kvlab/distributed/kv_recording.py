"""A KV-event stream on disk: record what a subscriber received, read it back (lesson 10).

A recording keeps the bytes exactly as they came off the wire -- topic, sequence number,
the time they arrived, the msgpack payload -- so a stream captured from a real vLLM server
replays into the same views (``kvlab.timeline.KVStream``) as a live one, on a laptop with
no server, and decodes with the same ``decode_batch``.

The file format (``.kvev``), kvlab's own and small on purpose::

    b"KVEVREC1"                        8-byte magic
    u32 length + msgpack header        {"format": "kvlab.kv_events.recording", "version": 1,
                                        "endpoint": ..., "topic": ..., "created": unix time}
    u32 length + msgpack record, ...   [seq, topic (bytes), received_at (unix time), payload (bytes)]

Lengths are 4-byte big-endian. Each record is written and flushed as it arrives, so a
recording that was interrupted (the kernel stopped, the disk filled) is still readable up
to its last complete record: :func:`read_recording` refuses a truncated file with a message
saying how many batches are complete, and ``strict=False`` returns them.

A recording is a regular file: a FIFO would block the reader until someone writes to it, and
``/dev/zero`` would feed it gigabytes, so both are refused before a byte is read, and a read
never takes more than the size the file had when it was opened.

A publisher that restarts begins again at seq 0; a subscriber records that seq 0 after the
old run's last batch, so one recording can hold several runs. Each seq 0 after the first
record starts a new run segment (``KVStream`` replays it as a fresh, empty cache).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from kvlab.distributed.kv_events import KVEventBatch, decode_batch
from kvlab.utils.checks import check_int, check_number

MAGIC = b"KVEVREC1"
FORMAT = "kvlab.kv_events.recording"
VERSION = 1
_MAX_RECORD = 1 << 30  # a length beyond 1 GiB is a corrupt file, not a batch


class RecordedBatch(msgspec.Struct, array_like=True, frozen=True):
    """One batch as it arrived: ``seq``, ``topic`` (bytes), ``received_at`` (unix time) and
    the msgpack ``payload``; :meth:`batch` decodes it."""

    seq: int
    topic: bytes
    received_at: float
    payload: bytes

    def batch(self) -> KVEventBatch:
        return decode_batch(self.payload)


_enc = msgspec.msgpack.Encoder()
_rec_dec = msgspec.msgpack.Decoder(RecordedBatch)
_hdr_dec = msgspec.msgpack.Decoder(dict)


@dataclass
class Recording:
    """A recording read back: its ``header`` (endpoint, topic, created), the ``records`` in
    file order, and ``truncated`` (only with ``strict=False``: the file ended mid-record)."""

    path: str
    header: dict[str, Any]
    records: list[RecordedBatch] = field(default_factory=list)
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[RecordedBatch]:
        return iter(self.records)

    def batches(self) -> Iterator[tuple[int, KVEventBatch]]:
        """``(seq, batch)`` pairs, like ``Subscriber.receive``."""
        for r in self.records:
            yield r.seq, r.batch()


def _open_regular(path: str | os.PathLike) -> tuple[BinaryIO, int]:
    """``path`` opened for reading, and its size -- refused unless it is a regular file.

    ``O_NONBLOCK`` first: opening a FIFO for reading blocks until a writer appears, and the
    check must come before any wait. ``fstat`` then looks at what was actually opened (no
    race with a rename between a ``stat`` and the ``open``)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(
                f"path: {os.fspath(path)!r} is not a regular file (a FIFO, a device or a folder); a recording is a regular .kvev file"
            )
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def is_recording(path: str | os.PathLike) -> bool:
    """True when ``path`` is a regular file that starts with the recording magic."""
    try:
        f, _ = _open_regular(path)
    except (OSError, ValueError):
        return False
    with f:
        return f.read(len(MAGIC)) == MAGIC


class Recorder:
    """Append received batches to a recording file (created or overwritten).

    ``Subscriber(..., record_to=path)`` makes one and feeds it every batch it accepts;
    use it directly to record from anywhere: ``rec.append(seq, topic, payload)``.
    """

    def __init__(self, path: str | os.PathLike, *, endpoint: str = "", topic: str = "") -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path, got {type(path).__name__}")
        self.path = os.fspath(path)
        self.num_records = 0
        header = {"format": FORMAT, "version": VERSION, "endpoint": str(endpoint), "topic": str(topic), "created": time.time()}
        # Not open(path, "wb"): a FIFO would block until a reader appears, and a device or a
        # folder is no place for a recording. Checked before anything is truncated; fstat
        # checks again what was opened (O_NONBLOCK: a FIFO swapped in meanwhile cannot block).
        not_regular = (
            f"path: {self.path!r} is not a regular file (a FIFO, a device or a folder); a recording is written to a regular .kvev file"
        )
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                raise ValueError(not_regular)
        except FileNotFoundError:
            pass
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(not_regular)
            os.ftruncate(fd, 0)
            if hasattr(os, "set_blocking"):
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        f: BinaryIO = os.fdopen(fd, "wb")
        try:
            f.write(MAGIC)
            self._frame(f, _enc.encode(header))
            f.flush()
        except BaseException:
            f.close()
            raise
        self._f: BinaryIO | None = f

    @staticmethod
    def _frame(f: BinaryIO, body: bytes) -> None:
        f.write(len(body).to_bytes(4, "big") + body)

    def append(self, seq: int, topic: bytes | str, payload: bytes, received_at: float | None = None) -> None:
        if self._f is None:
            raise ValueError(f"the recorder of {self.path!r} is closed")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        seq = check_int("seq", seq, 0)
        if not isinstance(topic, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"topic must be a str or bytes, got {type(topic).__name__}")
        if received_at is not None:
            received_at = check_number("received_at", received_at)
        t = topic.encode() if isinstance(topic, str) else bytes(topic)
        rec = RecordedBatch(seq, t, time.time() if received_at is None else float(received_at), bytes(payload))
        self._frame(self._f, _enc.encode(rec))
        self._f.flush()
        self.num_records += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder({self.path!r}, {self.num_records} batches{', closed' if self._f is None else ''})"


def read_recording(path: str | os.PathLike, *, strict: bool = True) -> Recording:
    """Read a whole recording. A file that is not a recording, a bad header or a corrupt
    record raises ``ValueError`` naming the record; a file cut in the middle of its last
    record raises too unless ``strict=False`` (then the complete records are returned and
    ``truncated`` is True). Payloads are decoded lazily (``RecordedBatch.batch``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path, got {type(path).__name__} {path!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    p = Path(path)
    f, size = _open_regular(p)
    with f:
        data = f.read(size)  # at most the size it had when opened: a growing file cannot feed it forever
    if not data.startswith(MAGIC):
        raise ValueError(f"{p}: not a KV-event recording (it does not start with {MAGIC!r})")
    off = len(MAGIC)

    def frame(i: int, what: str) -> bytes | None:
        nonlocal off
        if off == len(data):
            return None
        if off + 4 > len(data):
            raise _Truncated(i, what)
        n = int.from_bytes(data[off : off + 4], "big")
        if n > _MAX_RECORD:
            raise ValueError(f"{p}: {what} {i} claims {n} bytes; the file is corrupt")
        if off + 4 + n > len(data):
            raise _Truncated(i, what)
        body = data[off + 4 : off + 4 + n]
        off += 4 + n
        return body

    try:
        raw = frame(0, "header")
    except _Truncated:
        raise ValueError(f"{p}: recording truncated inside its header") from None
    if raw is None:
        raise ValueError(f"{p}: recording has no header")
    try:
        header = _hdr_dec.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"{p}: the recording header is corrupt: {e}") from None
    except RecursionError:
        raise ValueError(
            f"{p}: the recording header is corrupt: it nests deeper than Python's recursion limit "
            "(a header is one map of names, numbers and strings)"
        ) from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(
            f"{p}: recording format {header.get('format')!r} version {header.get('version')!r}; "
            f"this kvlab reads {FORMAT!r} version {VERSION}"
        )
    rec = Recording(os.fspath(p), header)
    i = 0
    while True:
        try:
            body = frame(i, "record")
        except _Truncated:
            if strict:
                raise ValueError(
                    f"{p}: recording truncated in record {i} (the file ends mid-record); "
                    f"{i} complete batches before it -- read_recording(path, strict=False) returns them"
                ) from None
            rec.truncated = True
            break
        if body is None:
            break
        try:
            rec.records.append(_rec_dec.decode(body))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"{p}: record {i} is corrupt: {e}") from None
        except RecursionError:
            raise ValueError(
                f"{p}: record {i} is corrupt: it nests deeper than Python's recursion limit "
                "(a record is [seq, topic, received_at, payload])"
            ) from None
        i += 1
    return rec


class _Truncated(Exception):
    def __init__(self, index: int, what: str) -> None:
        super().__init__(f"{what} {index} truncated")


__all__ = ["Recorder", "RecordedBatch", "Recording", "is_recording", "read_recording"]
