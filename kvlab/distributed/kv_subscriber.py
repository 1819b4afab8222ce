"""Read a KV-event stream -- kvlab's or a real vLLM server's -- and never lose track (lesson 10).

vLLM ships a subscriber only as an example (``examples/features/kv_events/
kv_events_subscriber.py``); KV-aware routers (llm-d, Dynamo) each write their own. This one
speaks vLLM's protocol exactly (see :mod:`kvlab.distributed.kv_publisher`) and handles what
a long-running consumer meets:

* **a gap** -- seq jumps from n to n + k: PUB/SUB dropped k batches (a slow consumer passed
  the high-water mark, or it connected late). It is logged, recorded in :attr:`gaps`, and,
  when a replay endpoint is known, the missing batches are asked for (``[b"", n + 1]`` on a
  DEALER socket) and delivered in order before batch n + k. What the publisher no longer
  buffers is lost for good: the :class:`Gap` says how many batches came back.
* **a malformed or truncated message** (not three frames, a seq that is not 8 bytes, a
  payload that is not a KV event batch) -- logged and counted in :attr:`stats`, never raised
  into the consumer's loop; the seq it should have carried shows up as a gap, so the replay
  socket gets a chance to supply a good copy.
* **a wrong topic** (SUB filters by prefix: ``"kv"`` also receives ``"kv-other"``) -- counted
  and skipped; only the exact topic is accepted (``topic=""`` accepts every topic). A replayed
  batch is held to the same rule: it must carry the topic of the gap it fills.
* **an absurd seq** -- ``END_SEQ`` (-1 as a signed int64: vLLM's end-of-replay marker) or a
  jump of more than :data:`MAX_SEQ_JUMP` batches past the expected seq is a corrupt frame,
  not a loss: counted as malformed and skipped, so one bad frame cannot make every later
  batch look like a duplicate. A genuine jump that large (a subscriber joining a server that
  has run for years) is accepted once the next batch confirms it (seq + 1), and the skipped
  batch is asked for as part of the gap.
* **a dead peer** -- every wait is bounded: :meth:`receive` returns when no batch arrives for
  ``timeout_s``, a replay that gets no answer gives up after ``replay_timeout_s`` (its socket
  is rebuilt, so a late answer can never be mistaken for the next one's).
* **a restarted publisher** (seq back to 0) -- logged; ``stats["restarts"]`` counts it.

``catch_up=True`` asks the replay socket for everything from seq 0 when the first batch
received is not seq 0: a router that starts after the engine still learns every block the
engine stored (as far back as the publisher's buffer reaches). That catch-up is logged at INFO
(the subscriber asked for it) and, when the replay returns every batch, it is not a gap: ``gaps``
lists the losses -- batches missed after the first one received (a WARNING each), and a
catch-up the publisher's buffer could not complete.

Bind or connect: a vLLM server with the default ``tcp://*:5557`` binds, so the subscriber
connects (``bind=False``, the default). A server given ``tcp://host:port`` connects to its
consumer, which must then ``bind=True`` to that address (vLLM's rule, ``is_bind_endpoint``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvlab.distributed.kv_events import KVEventBatch, decode_batch
from kvlab.distributed.kv_publisher import END_SEQ, _bind, _check_endpoint
from kvlab.distributed.kv_recording import Recorder
from kvlab.utils.checks import check_int, check_number, check_optional_int

logger = logging.getLogger("kvlab.kv_events")

MAX_SEQ_JUMP = 1 << 32
"""The most batches a seq may run ahead of the expected one (last + 1; 0 before the first):
4,294,967,296 -- 50 days of 1,000 batches a second, years at a real server's step rate.
Beyond it a seq frame is taken for corrupt unless the next batch follows it."""
_SIGNED_LIMIT = 1 << 63  # seqs are int64: END_SEQ and every "negative" seq lie beyond


@dataclass(frozen=True, slots=True)
class Gap:
    """Batches ``expected .. received - 1`` did not arrive live; ``recovered`` of them came
    back from the replay socket (``complete`` when all did)."""

    expected: int
    received: int
    recovered: int
    topic: bytes = b""

    @property
    def missing(self) -> int:
        return self.received - self.expected

    @property
    def complete(self) -> bool:
        return self.recovered == self.missing


class Subscriber:
    """``Subscriber(endpoint, topic="", *, replay_endpoint=None, bind=False, catch_up=False,
    hwm=100_000, replay_timeout_s=2.0, record_to=None)``; read with :meth:`receive`.

    ``record_to`` (a path or a :class:`~kvlab.distributed.kv_recording.Recorder`) writes every
    accepted batch -- live or replayed -- to a recording, in delivery order.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        *,
        replay_endpoint: str | None = None,
        bind: bool = False,
        catch_up: bool = False,
        hwm: int = 100_000,
        replay_timeout_s: float = 2.0,
        record_to: str | os.PathLike | Recorder | None = None,
    ) -> None:
        # Every argument is checked before a socket opens (or a recording file is created).
        _check_endpoint("endpoint", endpoint, "tcp://127.0.0.1:5557")
        for name, flag in (("bind", bind), ("catch_up", catch_up)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if "*" in endpoint and not bind:
            raise ValueError(
                f"endpoint={endpoint!r}: a subscriber cannot connect to '*'; connect to the server's host (tcp://127.0.0.1:5557) or pass bind=True"
            )
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint, "tcp://127.0.0.1:5558", optional=True)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if record_to is not None and not isinstance(record_to, (str, os.PathLike, Recorder)):
            raise TypeError(f"record_to must be None, a file path or a Recorder, got {type(record_to).__name__}")
        hwm = check_int("hwm", hwm, 0, why=" (0 = no limit)")
        self.replay_timeout_s = check_number("replay_timeout_s", replay_timeout_s, 0, strict=True)
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self.replay_endpoint = replay_endpoint
        self.catch_up = bool(catch_up)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
            if bind:
                endpoint = _bind(sock, endpoint)
            else:
                sock.connect(endpoint)
        except Exception:
            sock.close(linger=0)
            raise
        self._sub: zmq.Socket | None = sock
        self.endpoint = endpoint
        self.bind = bool(bind)
        self._replay: zmq.Socket | None = None
        self._owns_recorder = False
        self.recorder: Recorder | None = None
        if record_to is not None:
            if isinstance(record_to, Recorder):
                self.recorder = record_to
            else:
                try:
                    self.recorder = Recorder(record_to, endpoint=endpoint, topic=topic)
                except BaseException:  # a path that is no file (a FIFO, a folder): no socket left open
                    self.close()
                    raise
                self._owns_recorder = True
        self._last: dict[bytes, int] = {}
        self._suspect: dict[bytes, int] = {}  # per topic: the last seq skipped as an absurd jump
        self._pending: deque[tuple[int, KVEventBatch]] = deque()  # accepted, not yet yielded
        self.last_topic: bytes | None = None
        self.gaps: list[Gap] = []
        self.stats: dict[str, int] = dict(
            received=0, replayed=0, duplicates=0, malformed=0, wrong_topic=0, lost=0, restarts=0, replay_timeouts=0
        )

    # -- state --------------------------------------------------------------------------------
    @property
    def last_seq(self) -> int | None:
        """The last seq delivered (of the one topic seen; of the subscribed topic otherwise)."""
        if self._topic_bytes in self._last:
            return self._last[self._topic_bytes]
        if len(self._last) == 1:
            return next(iter(self._last.values()))
        return None

    @property
    def closed(self) -> bool:
        return self._sub is None

    def __repr__(self) -> str:
        how = "bound to" if self.bind else "connected to"
        return (
            f"Subscriber({how} {self.endpoint!r}, topic={self.topic!r}, replay={self.replay_endpoint!r}, "
            f"last_seq={self.last_seq}, gaps={len(self.gaps)})"
        )

    # -- reading --------------------------------------------------------------------------------
    def receive(
        self, timeout_s: float = 5.0, *, max_batches: int | None = None, until_seq: int | None = None
    ) -> Iterator[tuple[int, KVEventBatch]]:
        """Yield ``(seq, batch)`` in sequence order, gaps refilled from the replay socket.

        Stops when no message arrives for ``timeout_s`` seconds, after ``max_batches``
        batches, or once ``until_seq`` has been delivered -- whichever comes first. Give
        ``until_seq`` when you know how far the publisher got (a lock-step router asks its
        engines): if the last batches never arrive, they are asked for from the replay
        socket before giving up. The generator never blocks longer than ``timeout_s`` per
        wait (plus ``replay_timeout_s`` for a replay).
        """
        timeout_s = check_number("timeout_s", timeout_s, 0)
        max_batches = check_optional_int("max_batches", max_batches, 0)
        until_seq = check_optional_int("until_seq", until_seq, -1)
        if self._sub is None:
            raise ValueError("this Subscriber is closed")
        n = 0
        pending = self._pending
        while True:
            if max_batches is not None and n >= max_batches:
                return
            if pending:  # popped before the yield: a consumer that stops early loses nothing
                n += 1
                yield pending.popleft()
                continue
            if until_seq is not None and (self.last_seq is not None and self.last_seq >= until_seq):
                return
            if not self._sub.poll(int(timeout_s * 1000)):
                if until_seq is not None and self.replay_endpoint and not pending:
                    # The publisher said (out of band) it sent up to `until_seq`, but the tail
                    # never arrived: a dropped last batch is a gap nothing later would reveal.
                    last = self.last_seq
                    start = last + 1 if last is not None else (0 if self.catch_up else None)
                    if start is not None and start <= until_seq:
                        topic = self.last_topic if self.last_topic is not None else (self._topic_bytes or None)
                        pending.extend(self._fill_gap(topic, start, until_seq + 1, tail=True))
                        if pending:
                            continue
                return
            pending.extend(self._accept(self._sub.recv_multipart(zmq.NOBLOCK)))

    def poll(self, timeout_s: float = 1.0) -> list[tuple[int, KVEventBatch]]:
        """Everything that arrives within ``timeout_s`` (at least one wait), as a list."""
        timeout_s = check_number("timeout_s", timeout_s, 0)
        out: list[tuple[int, KVEventBatch]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            got = list(self.receive(left, max_batches=1))
            out += got
            if not got or left <= 0:
                return out

    def _accept(self, frames: list[bytes]) -> list[tuple[int, KVEventBatch]]:
        """One PUB message -> the batches to deliver (refilled gap first), in order."""
        if len(frames) != 3:
            self._malformed(f"a message of {len(frames)} frames (expected 3: topic, seq, payload)")
            return []
        topic, seq_b, payload = frames
        if self._topic_bytes and topic != self._topic_bytes:
            self.stats["wrong_topic"] += 1
            logger.warning("KV events: skipped a batch on topic %r (subscribed to %r)", topic, self.topic)
            return []
        if len(seq_b) != 8:
            self._malformed(f"a seq frame of {len(seq_b)} bytes (expected 8, big-endian)")
            return []
        seq = int.from_bytes(seq_b, "big")
        last = self._last.get(topic)
        if self._absurd(topic, seq, 0 if last is None else last + 1):
            return []
        if last is not None and seq <= last:
            if seq == 0:
                self.stats["restarts"] += 1
                logger.warning("KV events: topic %r restarted at seq 0 (the publisher restarted; its cache is new)", topic)
                del self._last[topic]
                last = None
            else:
                self.stats["duplicates"] += 1
                return []
        try:
            batch = decode_batch(payload)
        except (ValueError, msgspec.DecodeError) as e:
            self._malformed(f"seq {seq}: payload is not a KV event batch ({e})")
            return []
        out: list[tuple[int, KVEventBatch]] = []
        expected = (0 if self.catch_up else seq) if last is None else last + 1
        if seq > expected:
            out += self._fill_gap(topic, expected, seq)
        self._deliver(topic, seq, payload)
        self.stats["received"] += 1
        out.append((seq, batch))
        return out

    def _absurd(self, topic: bytes, seq: int, expected: int) -> bool:
        """Count and skip a seq no publisher can have reached (see :data:`MAX_SEQ_JUMP`);
        a huge jump that the next batch confirms (seq + 1) is a real one."""
        suspect = self._suspect.pop(topic, None)
        if seq < _SIGNED_LIMIT and (seq - expected <= MAX_SEQ_JUMP or suspect == seq - 1):
            return False
        if seq < _SIGNED_LIMIT:
            self._suspect[topic] = seq
        what = "END_SEQ or a negative int64" if seq >= _SIGNED_LIMIT else f"{seq - expected:,} batches past the expected seq {expected}"
        self._malformed(
            f"a batch on topic {topic!r} with seq {seq} ({what}; at most {MAX_SEQ_JUMP:,} ahead is a loss, beyond that a corrupt seq frame)"
        )
        return True

    def _deliver(self, topic: bytes, seq: int, payload: bytes) -> None:
        self._last[topic] = seq
        self.last_topic = topic
        if self.recorder is not None:
            self.recorder.append(seq, topic, payload)

    def _malformed(self, what: str) -> None:
        self.stats["malformed"] += 1
        logger.error("KV events: dropped %s", what)

    def _fill_gap(self, topic: bytes | None, expected: int, seq: int, tail: bool = False) -> list[tuple[int, KVEventBatch]]:
        """Ask the replay socket for ``expected .. seq - 1`` of ``topic`` (None: not known
        yet -- any topic); ``tail``: seq - 1 is the last batch the publisher reported
        sending, and nothing arrived after ``expected - 1``."""
        missing = seq - expected
        what = f"the publisher sent up to seq {seq - 1}" if tail else f"got {seq}"
        catching_up = self.catch_up and expected == 0 and (topic is None or topic not in self._last)
        if catching_up:
            # Nothing received yet on this topic, and catching up was asked for: the batches
            # sent before this subscriber's subscription took effect (ZeroMQ's "slow joiner")
            # are fetched by design -- news, not a warning.
            logger.info(
                "KV events: catching up on topic %r: seq 0..%d were sent before this subscriber's first batch%s",
                topic,
                seq - 1,
                "; asking the replay socket" if self.replay_endpoint else "; no replay endpoint",
            )
        else:
            logger.warning(
                "KV events: gap on topic %r: expected seq %d, %s (%d batches missing)%s",
                topic,
                expected,
                what,
                missing,
                "; asking the replay socket" if self.replay_endpoint else "; no replay endpoint",
            )
        got = self._request_replay(expected, seq, topic) if self.replay_endpoint else []
        for s, t, payload, _ in got:
            self._deliver(t if t is not None else (topic or b""), s, payload)
        self.stats["replayed"] += len(got)
        self.stats["lost"] += missing - len(got)
        gap = Gap(expected, seq, len(got), topic or b"")
        if not (catching_up and gap.complete):  # a catch-up that got everything lost nothing
            self.gaps.append(gap)
        if gap.complete:
            logger.info("KV events: replay recovered all %d missing batches", missing)
        else:
            logger.warning(
                "KV events: %d of %d missing batches are lost for good (not in the publisher's buffer); "
                "an index built from this stream may be stale",
                missing - len(got),
                missing,
            )
        return [(s, b) for s, _, _, b in got]

    def replay(self, start_seq: int = 0) -> list[tuple[int, KVEventBatch]]:
        """Ask the replay socket for every buffered batch from ``start_seq`` (no delivery
        bookkeeping: a look at what the publisher still holds)."""
        start_seq = check_int("start_seq", start_seq, 0)
        if not self.replay_endpoint:
            raise ValueError("this Subscriber has no replay_endpoint")
        return [(s, b) for s, _, _, b in self._request_replay(start_seq, None, self._topic_bytes or None)]

    def _replay_socket(self) -> zmq.Socket:
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            assert self.replay_endpoint is not None  # asked for only when there is one (_request_replay)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        return self._replay

    def _drop_replay_socket(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def _request_replay(self, start: int, stop: int | None, topic: bytes | None) -> list[tuple[int, bytes | None, bytes, KVEventBatch]]:
        """Batches ``start .. stop - 1`` (all from ``start`` when stop is None) of ``topic``
        (None: any) from the replay socket, in order; reads to the end marker so no stale
        reply is left behind. A reply of another topic is skipped as a live one would be:
        it is another engine's seq, not the one missing here."""
        want = topic
        sock = self._replay_socket()
        got: dict[int, tuple[bytes | None, bytes, KVEventBatch]] = {}
        deadline = time.monotonic() + self.replay_timeout_s
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.Again:
            self.stats["replay_timeouts"] += 1
            self._drop_replay_socket()
            return []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                self.stats["replay_timeouts"] += 1
                logger.warning(
                    "KV events: the replay socket %s did not finish answering within %.1f s (dead peer?)",
                    self.replay_endpoint,
                    self.replay_timeout_s,
                )
                self._drop_replay_socket()
                break
            frames = sock.recv_multipart()
            if not frames or frames[0] != b"":
                self._malformed(f"a replay reply without its empty delimiter frame ({len(frames)} frames)")
                continue
            rest = frames[1:]
            topic = None
            if len(rest) == 3:  # vLLM >= 0.26: [topic, seq, payload]
                topic, seq_b, payload = rest
            elif len(rest) == 2:  # vLLM <= 0.25: [seq, payload]
                seq_b, payload = rest
            else:
                self._malformed(f"a replay reply of {len(frames)} frames")
                continue
            if seq_b == END_SEQ:
                break
            if len(seq_b) != 8:
                self._malformed(f"a replay seq frame of {len(seq_b)} bytes")
                continue
            if topic is not None and want is not None and topic != want:
                self.stats["wrong_topic"] += 1
                logger.warning("KV events: skipped a replayed batch on topic %r (asked for %r)", topic, want)
                continue
            s = int.from_bytes(seq_b, "big")
            if s < start or (stop is not None and s >= stop) or s in got:
                continue
            try:
                got[s] = (topic, payload, decode_batch(payload))
            except (ValueError, msgspec.DecodeError) as e:
                self._malformed(f"replayed seq {s}: payload is not a KV event batch ({e})")
        return [(s, *got[s]) for s in sorted(got)]

    # -- closing --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self._drop_replay_socket()
        if self.recorder is not None and self._owns_recorder:
            self.recorder.close()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # sockets hold file descriptors: a forgotten subscriber lets go
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


__all__ = ["MAX_SEQ_JUMP", "Gap", "Subscriber"]
