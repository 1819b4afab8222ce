"""vLLM's KV-event publisher: PUB socket + ROUTER replay socket (lesson 10).

vLLM: ``ZmqEventPublisher`` in ``vllm/distributed/kv_events.py`` (v0.33.0), created by the
scheduler from ``--kv-events-config``. Once per engine step the scheduler takes the step's
KV cache events from its ``KVCacheManager`` and hands them over as one ``KVEventBatch``;
a background thread encodes each batch with msgspec and sends it as **three frames**::

    [topic, seq, payload]      topic: UTF-8 bytes, sent even when empty (b"")
                               seq:   8-byte big-endian counter, 0, 1, 2, ... per publisher
                               payload: the msgpack batch (``kv_events.encode_batch``)

PUB/SUB drops messages when a subscriber is slow (its queue passes the high-water mark) or
not connected yet, and it never says so. The sequence number lets a subscriber *see* the
hole, and the optional **replay socket** (a ROUTER) lets it fill it: the publisher keeps the
last ``buffer_steps`` payloads; a request ``[b"", start_seq]`` (8-byte big-endian) is
answered with every buffered ``[b"", topic, seq, payload]`` with ``seq >= start_seq``, then
the end marker ``[b"", b"", b"\\xff" * 8, b""]``. (vLLM <= 0.25 sent replies without the
topic frame, ``[b"", seq, payload]``; :class:`~kvlab.distributed.kv_subscriber.Subscriber`
reads both.)

**Bind or connect** (vLLM's rule, ``_is_bind_endpoint``): the PUB socket *binds* when the
endpoint holds ``*`` or ``::`` or is ``ipc://`` / ``inproc://``, and *connects* otherwise --
``tcp://*:5557`` (the default) listens on every interface and subscribers connect to it;
``tcp://router-host:5557`` makes the engine dial out to a consumer that binds, which is how
one router collects the streams of many engines. The replay socket always binds.

kvlab's differences, each on purpose:

* ``publish`` checks the batch in the caller's thread (a ``TypeError`` naming the bad
  event, before anything is queued); vLLM would fail in its thread after taking a seq, and
  its subscribers would see a gap no replay can fill.
* a bound ``tcp://host:0`` endpoint reports the port the OS chose (``.endpoint``,
  ``.replay_endpoint``), so tests and notebooks bind free loopback ports; vLLM resolves
  only ``tcp://*:0``.
* ``flush(timeout_s)`` waits until every batch published so far has been sent (a
  lock-step simulation needs it), and ``num_published`` counts ``publish`` calls.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from itertools import count
from typing import Any, overload

import msgspec
import zmq

from kvlab.distributed import kv_events
from kvlab.distributed.kv_events import EventBatch, KVEventBatch, validate_batch
from kvlab.utils.checks import check_int, check_number

logger = logging.getLogger("kvlab.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay sequence frame: eight 0xff bytes."""


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard (``*``, ``::``) and ``ipc://`` / ``inproc://`` endpoints,
    connect to every other one."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _check_endpoint(name: str, endpoint: object, example: str, optional: bool = False) -> None:
    what = f"{name} must be {'None or ' if optional else ''}a ZeroMQ address like {example!r}"
    if not isinstance(endpoint, str):
        raise TypeError(f"{what}, got {type(endpoint).__name__} {endpoint!r}")
    if "://" not in endpoint:
        raise ValueError(f"{what}, got {endpoint!r}")


@overload
def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str: ...
@overload
def offset_endpoint_port(endpoint: None, data_parallel_rank: int) -> None: ...
@overload
def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None: ...
def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``r``: a tcp port + r, an inproc name + ``_dp{r}``
    (rank 0 and port 0 unchanged) -- vLLM gives each DP rank its own publisher."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        return endpoint if int(port) == 0 else f"{head}:{int(port) + data_parallel_rank}"
    raise ValueError(f"endpoint={endpoint!r} is not valid: it must contain 'inproc' or 'tcp'")


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; return the endpoint actually bound (the OS's port for ``:0``)."""
    if endpoint == "tcp://*:0":
        # this node's address, looked up on kv_events at call time as vLLM's publisher does
        ip = kv_events.get_ip()
        if ip in ("0.0.0.0", "::"):
            raise ValueError("endpoint tcp://*:0 needs a node IP; set VLLM_HOST_IP (or bind tcp://127.0.0.1:0)")
        endpoint = f"tcp://[{ip}]:0" if ":" in ip else f"tcp://{ip}:0"
        if ":" in ip:
            sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind {endpoint!r}: {e}") from None
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


_other_encoder = msgspec.msgpack.Encoder()


def _validate_other_batch(batch: EventBatch) -> bytes:
    """The payload of an ``EventBatch`` subclass that does not carry KV events (vLLM's
    publisher sends any batch; its tests send batches of their own event type): encoded by
    msgspec and decoded again as its own class, so what a subscriber of that type could not
    read is refused here."""
    try:
        payload = _other_encoder.encode(batch)
        msgspec.msgpack.Decoder(type(batch)).decode(payload)
    except (TypeError, OverflowError, msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"batch ({type(batch).__name__}) cannot be sent: {e}") from None
    return payload


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``), same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "null" or "zmq"; None -> "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        # Checked here, not when a server starts from it: a bad field is named at once.
        if not isinstance(self.enable_kv_cache_events, bool):
            raise TypeError(f"enable_kv_cache_events must be True or False, got {self.enable_kv_cache_events!r}")
        if self.publisher not in (None, "null", "zmq"):
            raise ValueError(f"publisher must be None, 'null' or 'zmq', got {self.publisher!r}")
        _check_endpoint("endpoint", self.endpoint, "tcp://*:5557")
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint, "tcp://*:5558", optional=True)
        self.buffer_steps = check_int("buffer_steps", self.buffer_steps, 1)
        self.hwm = check_int("hwm", self.hwm, 0, why=" (0 = no limit)")
        self.max_queue_size = check_int("max_queue_size", self.max_queue_size, 1)
        if not isinstance(self.topic, str):
            raise TypeError(f"topic must be a str, got {type(self.topic).__name__}")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @classmethod
    def from_cli(cls, text: str) -> "KVEventsConfig":
        """Parse the JSON given to ``vllm serve --kv-events-config '{...}'``."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"--kv-events-config has unknown keys {sorted(unknown)}; allowed: {sorted(cls.__dataclass_fields__)}")
        return cls(**raw)


class EventPublisher:
    """What the scheduler calls: ``publish(batch)`` once per step, ``shutdown()`` at exit."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    def publish(self, events: EventBatch) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def shutdown(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def get_publisher_config(self) -> KVEventsConfig | None:
        """The configuration this publisher runs with, as resolved (None: it has none)."""
        return None


class NullEventPublisher(EventPublisher):
    """Events off (vLLM's default): publishing does nothing."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """vLLM's PUB/ROUTER publisher with an in-memory replay buffer (see the module docstring).

    ``ZmqEventPublisher(data_parallel_rank, endpoint="tcp://*:5557", replay_endpoint=None,
    buffer_steps=10_000, hwm=100_000, max_queue_size=100_000, topic="")`` -- vLLM's
    signature and defaults. kvlab adds ``array_like=True`` (encode events as vLLM <= 0.23
    did) and ``replay_topic_frame=False`` (replies as vLLM <= 0.25 sent them), so a lesson
    can play an older server.
    """

    #: vLLM 0.33 keeps the data-parallel endpoint rule on the class too.
    offset_endpoint_port = staticmethod(offset_endpoint_port)

    SHUTDOWN_TIMEOUT: float = 1.0
    END_SEQ = END_SEQ

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        array_like: bool = False,
        replay_topic_frame: bool = True,
    ) -> None:
        data_parallel_rank = check_int("data_parallel_rank", data_parallel_rank, 0)
        buffer_steps = check_int("buffer_steps", buffer_steps, 1)
        hwm = check_int("hwm", hwm, 0, why=" (0 = no limit)")
        max_queue_size = check_int("max_queue_size", max_queue_size, 1)
        _check_endpoint("endpoint", endpoint, "tcp://*:5557")
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint, "tcp://*:5558", optional=True)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, flag in (("array_like", array_like), ("replay_topic_frame", replay_topic_frame)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        super().__init__(data_parallel_rank)
        self._event_queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self.endpoint: str = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint: str | None = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        # ZeroMQ frees room in a pipe only every hwm/2 messages: twice the buffer lets a
        # whole replay plus its end marker always fit (vLLM 0.33's choice).
        self._replay_hwm = 2 * (buffer_steps + 1)
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._array_like = bool(array_like)
        self._replay_topic_frame = bool(replay_topic_frame)
        self.binds = is_bind_endpoint(self.endpoint)
        self._socket_setup()
        self._seq_gen = count()
        self.num_published = 0  # publish() calls accepted
        self.num_sent = 0  # batches the thread has sent (the next seq)
        self.num_replay_requests = 0
        self._sent_cv = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._publisher_thread, daemon=True, name="zmq-publisher")
        self._thread.start()

    # -- the caller's side ----------------------------------------------------------------
    def get_publisher_config(self) -> KVEventsConfig:
        """vLLM 0.33's resolved ``--kv-events-config``: the endpoints as bound -- shifted by
        the data-parallel rank, the OS's port in place of ``:0`` -- so that a router, or a
        second server, can be told where this one publishes. (vLLM 0.33 puts the OS's port in
        for ``tcp://*:0`` only and reports ``tcp://127.0.0.1:0`` as given; kvlab binds such
        loopback addresses and reports the port it got.)"""
        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
            max_queue_size=self.max_queue_size,
            topic=self.topic,
        )

    def publish(self, events: EventBatch) -> None:
        """Queue one batch (blocks while ``max_queue_size`` batches wait, as vLLM's does)."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        # Every field, and the encoding this publisher uses, is checked here, in the caller's
        # thread: a batch the thread could not send would cost a seq -- a gap no replay fills.
        # The check encodes the batch (stamped with this publisher's rank): the thread sends
        # those bytes as they are.
        stamped = events
        if isinstance(events, EventBatch) and events.data_parallel_rank is None:
            stamped = msgspec.structs.replace(events, data_parallel_rank=self._data_parallel_rank)
        if isinstance(stamped, EventBatch) and not isinstance(stamped, KVEventBatch):
            payload = _validate_other_batch(stamped)  # another kind of events (vLLM's publisher sends any)
        else:
            payload = validate_batch(stamped, array_like=self._array_like)
        events.data_parallel_rank = stamped.data_parallel_rank
        self._event_queue.put(payload)
        self.num_published += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch published so far has been sent; False on timeout."""
        timeout_s = check_number("timeout_s", timeout_s, 0)
        deadline = time.monotonic() + timeout_s
        target = self.num_published
        with self._sent_cv:
            while self.num_sent < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return self.num_sent >= target
                self._sent_cv.wait(min(left, 0.1))
        return True

    def shutdown(self) -> None:
        """Stop the thread (at most ~SHUTDOWN_TIMEOUT s per wait) and close the sockets."""
        if not self._running and not self._thread.is_alive():
            return
        self._running = False
        try:
            self._event_queue.put_nowait(None)
        except queue.Full:
            pass
        start = time.monotonic()
        while not self._event_queue.empty() and time.monotonic() - start < self.SHUTDOWN_TIMEOUT:
            time.sleep(0.02)
        if not self._event_queue.empty():
            logger.warning(
                "KV-event publisher: %d batches still queued after %.1f s; dropped", self._event_queue.qsize(), self.SHUTDOWN_TIMEOUT
            )
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        mode = "binds" if self.binds else "connects to"
        return (
            f"ZmqEventPublisher({mode} {self.endpoint!r}, replay={self.replay_endpoint!r}, topic={self.topic!r}, "
            f"sent={self.num_sent}, buffered={len(self._buffer)})"
        )

    # -- sockets and the thread -------------------------------------------------------------
    def _socket_setup(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self.hwm)
        try:
            if self.binds:
                self.endpoint = _bind(pub, self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                rep = self._ctx.socket(zmq.ROUTER)
                rep.setsockopt(zmq.LINGER, 0)
                rep.setsockopt(zmq.SNDHWM, self._replay_hwm)
                try:
                    self.replay_endpoint = _bind(rep, self.replay_endpoint)
                except Exception:
                    rep.close(linger=0)
                    raise
                self._replay = rep
        except Exception:
            pub.close(linger=0)
            raise
        self._pub = pub

    def _send(self, seq: int, payload: bytes) -> None:
        """One batch on the PUB socket: ``[topic, seq, payload]``."""
        assert self._pub is not None
        self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))

    def _publisher_thread(self) -> None:
        while self._running or self._event_queue.qsize() > 0:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._service_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    logger.exception("KV-event publisher: replay request failed")
            try:
                payload = self._event_queue.get(timeout=0.05)  # encoded by publish()
            except queue.Empty:
                continue
            if payload is None:
                break
            try:
                seq = next(self._seq_gen)
                self._send(seq, payload)
                with self._buffer_lock:
                    self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - back off instead of spinning on a broken socket
                logger.exception("KV-event publisher: sending a batch failed")
                time.sleep(0.1)
            finally:
                with self._sent_cv:
                    self.num_sent += 1
                    self._sent_cv.notify_all()

    def _service_replay(self) -> None:
        """Answer one replay request: every buffered batch from ``start_seq``, then END_SEQ."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV-event publisher: invalid replay request (%d frames); expected [b'', start_seq(8 bytes)]", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        self.num_replay_requests += 1
        with self._buffer_lock:
            todo = [(s, p) for s, p in self._buffer if s >= start_seq]
        for s, p in todo:
            if self._replay_topic_frame:
                self._replay.send_multipart((client_id, b"", self._topic_bytes, s.to_bytes(8, "big"), p))
            else:
                self._replay.send_multipart((client_id, b"", s.to_bytes(8, "big"), p))
        if self._replay_topic_frame:
            self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
        else:
            self._replay.send_multipart((client_id, b"", END_SEQ, b""))


class EventPublisherFactory:
    """``create(config)``: the publisher a ``KVEventsConfig`` asks for (Null when events are off)."""

    _registry: dict[str, Any] = {"null": NullEventPublisher, "zmq": ZmqEventPublisher}

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher()
        kwargs = asdict(config)
        kind = kwargs.pop("publisher")
        kwargs.pop("enable_kv_cache_events")
        try:
            ctor = cls._registry[kind]
        except KeyError:
            raise ValueError(f"Unknown event publisher {kind!r}; choose one of {sorted(cls._registry)}") from None
        return ctor(data_parallel_rank=data_parallel_rank, **kwargs)


__all__ = [
    "END_SEQ",
    "EventPublisher",
    "EventPublisherFactory",
    "KVEventsConfig",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "is_bind_endpoint",
    "offset_endpoint_port",
]
