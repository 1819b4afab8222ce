"""Issue 25: the wire's readers refuse what would crash, hang or silence them.

Deeply nested msgpack, a replayed batch of another topic, an absurd seq, a FIFO or a device
given as a recording, a recording across a publisher restart, a log that claims a huge pool,
``KVServer.configure`` values the server could not step with, and ``export_html`` of a
KV-event stream. Every socket is on loopback (127.0.0.1, OS-chosen ports), every wait is
bounded, and no assertion depends on a duration: the tests wait for states and count.
"""

from __future__ import annotations

import os
import threading

import msgspec
import pytest
import zmq

import kvlab
from kvlab.distributed.kv_events import (
    MAX_EXTRA_KEYS_DEPTH,
    BlockStored,
    CacheIndex,
    KVEventBatch,
    decode_batch,
    encode_batch,
    validate_batch,
)
from kvlab.distributed.kv_publisher import END_SEQ
from kvlab.distributed.kv_recording import Recorder, is_recording, read_recording
from kvlab.distributed.kv_subscriber import MAX_SEQ_JUMP, Gap, Subscriber
from kvlab.timeline.kv_stream import KVStream

pytestmark = pytest.mark.timeout(120)
CTX = zmq.Context.instance()
MARK = "ZZ-NEST-HERE-ZZ"
DEEP = 100_000


def stored(h: int, parent: int | None = None, extra: list | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=list(range(4)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
    )


def payload(i: int) -> bytes:
    return encode_batch(KVEventBatch(ts=float(i), events=[stored(1000 + i)]))


def nested(depth: int) -> bytes:
    """A valid batch whose one ``extra_keys`` entry is ``depth`` arrays deep (msgpack fixarray
    of one element, ``depth`` times, around a nil)."""
    p = encode_batch(KVEventBatch(ts=1.0, events=[stored(7, extra=[[MARK]])]))
    return p.replace(b"\x91" + msgspec.msgpack.encode(MARK), b"\x91" * depth + b"\xc0")


SEQ = [i.to_bytes(8, "big") for i in range(8)]


# --- item 1: deep nesting is a malformed payload, at the one door every reader shares ---------------
def test_deep_nesting_is_a_malformed_payload_not_a_recursion_error():
    too_deep = f"nests deeper than {MAX_EXTRA_KEYS_DEPTH} levels"
    assert MAX_EXTRA_KEYS_DEPTH == 16
    inner = None
    for _ in range(15):
        inner = [inner]
    assert decode_batch(nested(16)).events[0].extra_keys == [(inner,)]  # 16 levels: the entry and 15 lists
    for depth in (17, 900):  # refused by the bound (msgspec itself would decode these)
        with pytest.raises(ValueError, match=r"^payload is not a KV event batch: events\[0\]\.extra_keys\[0\] " + too_deep):
            decode_batch(nested(depth))
    with pytest.raises(ValueError, match="^payload is not a KV event batch: it nests deeper than Python's recursion limit"):
        decode_batch(nested(DEEP))
    # an older server's array-encoded events take the same door
    old = encode_batch(KVEventBatch(ts=1.0, events=[stored(7, extra=[[MARK]])]), array_like=True)
    with pytest.raises(ValueError, match="^payload is not a KV event batch: it nests deeper"):
        decode_batch(old.replace(b"\x91" + msgspec.msgpack.encode(MARK), b"\x91" * DEEP + b"\xc0"))
    # a batch built in Python is refused before it is encoded (msgspec would recurse too)
    deep: list = [None]
    for _ in range(DEEP):
        deep = [deep]
    with pytest.raises(ValueError, match=r"^batch\.events\[0\]\.extra_keys\[0\] " + too_deep):
        validate_batch(KVEventBatch(ts=1.0, events=[stored(7, extra=[deep])]))


def test_deep_nesting_leaves_index_and_stream_unchanged():
    index = CacheIndex().apply(payload(0))
    stream = KVStream([(0, payload(0))])
    for bad in (nested(17), nested(DEEP)):
        with pytest.raises(ValueError, match="not a KV event batch"):
            index.apply(bad)
        with pytest.raises(ValueError, match="not a KV event batch"):
            stream.append(1, bad)
    assert (index.num_events, index.cached_hashes) == (1, {1000})
    assert (len(stream), stream.series.seq, stream.at().num_blocks) == (1, [0], 1)


def test_deep_nesting_in_a_recording(tmp_path):
    path = tmp_path / "deep.kvev"
    with Recorder(path, topic="kv") as rec:
        rec.append(0, "kv", payload(0))
        rec.append(1, "kv", nested(DEEP))
    assert [r.seq for r in read_recording(path)] == [0, 1]  # payloads are decoded lazily
    with pytest.raises(ValueError, match="^payload is not a KV event batch: it nests deeper"):
        KVStream.load(path)
    with pytest.raises(ValueError, match="^payload is not a KV event batch: it nests deeper"):
        kvlab.show(str(path))
    # a header nested 100,000 deep, and a record with a deep trailing element
    header = msgspec.msgpack.encode({"format": [MARK]}).replace(b"\x91" + msgspec.msgpack.encode(MARK), b"\x91" * DEEP + b"\xc0")
    (tmp_path / "hdr.kvev").write_bytes(b"KVEVREC1" + len(header).to_bytes(4, "big") + header)
    with pytest.raises(ValueError, match=r"hdr\.kvev: the recording header is corrupt: it nests deeper than Python's recursion limit"):
        read_recording(tmp_path / "hdr.kvev")
    good = path.read_bytes()[: 8 + 4 + int.from_bytes(path.read_bytes()[8:12], "big")]
    record = msgspec.msgpack.encode([0, b"kv", 1.0, payload(0), [MARK]]).replace(
        b"\x91" + msgspec.msgpack.encode(MARK), b"\x91" * DEEP + b"\xc0"
    )
    (tmp_path / "rec.kvev").write_bytes(good + len(record).to_bytes(4, "big") + record)
    with pytest.raises(ValueError, match=r"rec\.kvev: record 0 is corrupt: it nests deeper"):
        read_recording(tmp_path / "rec.kvev")


# --- a raw publisher and a scripted replay socket -------------------------------------------------------
class RawPub:
    """An XPUB on loopback: it sends whatever frames a test writes, and its subscription
    message says when the subscriber is attached (no frame is sent before that)."""

    def __init__(self, topic: str = "kv", **sub_kw) -> None:
        self.sock = CTX.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.sub = Subscriber(f"tcp://127.0.0.1:{port}", topic=topic, replay_timeout_s=10.0, **sub_kw)
        assert self.sock.poll(10_000), "the subscriber never subscribed"
        assert self.sock.recv() == b"\x01" + topic.encode()

    def send(self, *frames: list[bytes]) -> None:
        for f in frames:
            self.sock.send_multipart(f)

    def close(self) -> None:
        self.sub.close()
        self.sock.close(linger=0)


class ScriptedReplay:
    """A replay socket (ROUTER on loopback) that answers every request with ``replies``
    (frames after the delimiter), then vLLM's end marker. Runs in a thread, bounded."""

    def __init__(self, replies: list[list[bytes]]) -> None:
        self.replies = replies
        self.requests: list[int] = []
        self.sock = CTX.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            client, _, start = self.sock.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            for r in self.replies:
                self.sock.send_multipart([client, b"", *r])
            self.sock.send_multipart([client, b"", b"kv", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close(linger=0)


def test_deep_nesting_live_and_replayed_is_counted_malformed():
    """seq 1 arrives live nested 100,000 deep, seq 3 comes back from the replay socket that
    deep: both are counted as malformed and the subscriber carries on."""
    replay = ScriptedReplay([[b"kv", SEQ[3], nested(DEEP)]])
    pub = RawPub(replay_endpoint=replay.endpoint)
    try:
        pub.send(
            [b"kv", SEQ[0], payload(0)],
            [b"kv", SEQ[1], nested(DEEP)],
            [b"kv", SEQ[2], payload(2)],
            [b"kv", SEQ[4], payload(4)],
            [b"kv", SEQ[5], payload(5)],
        )
        got = [s for s, _ in pub.sub.receive(timeout_s=10.0, until_seq=5)]
    finally:
        pub.close()
        replay.close()
    assert got == [0, 2, 4, 5]
    assert pub.sub.stats["malformed"] == 2  # seq 1 live; seq 3 replayed (the first gap's request skips it unread)
    assert pub.sub.gaps == [Gap(1, 2, 0, b"kv"), Gap(3, 4, 0, b"kv")]
    assert replay.requests == [1, 3]


# --- item 2: a replayed batch of another topic is skipped, as a live one is ----------------------------
def test_replayed_batches_of_another_topic_are_skipped(tmp_path):
    path = tmp_path / "kv.kvev"
    replay = ScriptedReplay([[b"other-engine", SEQ[1], payload(101)], [b"kv", SEQ[2], payload(2)]])
    pub = RawPub(replay_endpoint=replay.endpoint, record_to=path)
    try:
        pub.send([b"kv", SEQ[0], payload(0)], [b"kv-other", SEQ[1], payload(101)], [b"kv", SEQ[3], payload(3)])
        got = [s for s, _ in pub.sub.receive(timeout_s=10.0, until_seq=3)]
    finally:
        pub.close()
        replay.close()
    assert got == [0, 2, 3]
    assert pub.sub.stats["wrong_topic"] == 2 and pub.sub.stats["replayed"] == 1 and pub.sub.stats["lost"] == 1
    assert pub.sub.gaps == [Gap(1, 3, 1, b"kv")] and pub.sub.last_topic == b"kv"
    assert [(r.seq, r.topic) for r in read_recording(path)] == [(0, b"kv"), (2, b"kv"), (3, b"kv")]


# --- item 5: an absurd seq is one bad frame, not the end of the stream ---------------------------------
def test_an_absurd_seq_is_counted_and_skipped():
    pub = RawPub()
    try:
        pub.send(
            [b"kv", SEQ[0], payload(0)],
            [b"kv", END_SEQ, payload(9)],
            [b"kv", SEQ[1], payload(1)],
            [b"kv", (2 + 2**40).to_bytes(8, "big"), payload(9)],
            [b"kv", SEQ[2], payload(2)],
            [b"kv", SEQ[3], payload(3)],
        )
        got = [s for s, _ in pub.sub.receive(timeout_s=10.0, until_seq=3)]
        assert got == [0, 1, 2, 3]
        assert pub.sub.stats["malformed"] == 2 and pub.sub.stats["duplicates"] == 0 and pub.sub.gaps == []
        # A jump that large is real when the next batch follows it: accepted, the gap noted.
        far = 4 + MAX_SEQ_JUMP + 1
        pub.send(
            [b"kv", far.to_bytes(8, "big"), payload(10)],
            [b"kv", (far + 1).to_bytes(8, "big"), payload(11)],
            [b"kv", (far + 2).to_bytes(8, "big"), payload(12)],
        )
        got = [s for s, _ in pub.sub.receive(timeout_s=10.0, until_seq=far + 2)]
    finally:
        pub.close()
    assert got == [far + 1, far + 2]
    assert pub.sub.stats["malformed"] == 3 and pub.sub.gaps == [Gap(4, far + 1, 0, b"kv")]
    assert MAX_SEQ_JUMP == 2**32


# --- item 5: a FIFO or a device is no recording ----------------------------------------------------------
def test_a_fifo_or_a_device_is_refused_not_read(tmp_path):
    fifo = tmp_path / "run.kvev"
    os.mkfifo(fifo)
    msg = r"is not a regular file \(a FIFO, a device or a folder\); a recording is a regular \.kvev file"
    for path in (fifo, "/dev/zero"):
        with pytest.raises(ValueError, match="^path: .*" + msg):
            read_recording(path)
        with pytest.raises(ValueError, match="^path: .*" + msg):
            KVStream.load(path)
        assert not is_recording(path)
        with pytest.raises(ValueError, match=r"^source: .* is not a regular file \(a folder, a FIFO or a device\)"):
            kvlab.show(str(path))
    with pytest.raises(ValueError, match=r"^path: .* is not a regular file .*; a recording is written to a regular \.kvev file"):
        Recorder(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        Subscriber("tcp://127.0.0.1:0", bind=True, record_to=fifo)
    assert fifo.is_fifo()


# --- item 5: a recording across a publisher restart is loadable: one run per start ---------------------
def restarted_recording(path) -> None:
    with Recorder(path, topic="kv") as rec:
        for seq, i in ((0, 0), (1, 1), (2, 2), (0, 10), (1, 11)):
            rec.append(seq, "kv", encode_batch(KVEventBatch(ts=float(i), events=[stored(1000 + i, None if seq == 0 else 999 + i)])))


def test_a_recording_across_a_publisher_restart_loads_as_two_runs(tmp_path):
    path = tmp_path / "restart.kvev"
    restarted_recording(path)
    s = KVStream.load(path)
    assert (len(s), s.series.seq, s.runs) == (5, [0, 1, 2, 0, 1], [0, 3])
    assert s.series.restarts == [False, False, False, True, False] and s.series.missing == [0] * 5
    assert s.series.cached_blocks == [1, 2, 3, 1, 2]  # the new engine's cache starts empty
    assert sorted(k[2] for k in s.at(2).nodes) == [1000, 1001, 1002]
    assert [s.at(i).restarted for i in range(5)] == [False, False, False, True, False]
    assert sorted(k[2] for k in s.at(3).nodes) == [1010] and sorted(k[2] for k in s.at(4).nodes) == [1010, 1011]
    assert (s.index_of(1), s.index_of(1, run=0), s.index_of(2, run=0)) == (4, 1, 2)
    with pytest.raises(ValueError, match="seq 2 is not in this stream"):
        s.index_of(2)
    with pytest.raises(ValueError, match=r"run=2 is out of range; this stream has runs 0\.\.1"):
        s.index_of(0, run=2)
    with pytest.raises(ValueError, match=r"seq 1 does not follow the last batch's seq 1; .*seq 0 alone starts a new run"):
        s.append(1, payload(1))
    assert len(s) == 5
    back = tmp_path / "back.kvev"
    s.save(back, topic="kv")
    assert KVStream.load(back).series.restarts == s.series.restarts
    from kvlab.viz import stream as stream_view

    d = stream_view.series_data(s.series, cursor=4)
    assert d["x"] == [0, 1, 2, 3, 4] and d["restarted_at"] == [3] and d["cursor"] == 4 and "1 publisher restart" in d["title"]


# --- item 5: a log that claims a pool too large to draw is refused before a view is built --------------
def test_show_refuses_a_pool_too_large_to_draw(tmp_path):
    from kvlab import Request, build_engine
    from kvlab.show import MAX_SHOW_BLOCKS
    from kvlab.eventlog.events import EventLog

    e = build_engine(num_blocks=16, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=3))
    e.run()
    text = e.events.to_json().replace('"num_blocks": 16', '"num_blocks": 1048576', 1)
    assert '"num_blocks": 1048576' in text
    path = tmp_path / "huge.json"
    path.write_text(text)
    assert MAX_SHOW_BLOCKS == 65_536 and path.stat().st_size < 8_000
    msg = (
        r"^source: events\[0\]\.num_blocks = 1,048,576 \(PoolCreated\) is more blocks than the views draw "
        r"\(at most MAX_SHOW_BLOCKS = 65,536\); read the run without views"
    )
    log = EventLog.from_json(text)
    for source in (str(path), log, list(log.events), iter(log.events)):
        with pytest.raises(ValueError, match=msg):
            kvlab.show(source)
    with pytest.raises(ValueError, match=msg):
        kvlab.export_html(str(path), tmp_path / "huge.html")
    assert not (tmp_path / "huge.html").exists()
    just_over = EventLog.from_json(e.events.to_json().replace('"num_blocks": 16', '"num_blocks": 65537', 1))
    with pytest.raises(ValueError, match=r"events\[0\]\.num_blocks = 65,537 \(PoolCreated\)"):
        kvlab.show(just_over)


# --- item 3: KVServer.configure checks its values as start() does --------------------------------------
def test_configure_is_checked_and_the_server_survives_a_bad_value():
    from kvlab import Request
    from kvlab.entrypoints.kv_server import KVServer, ServerError

    srv = KVServer.start(
        name="cfg",
        engine=dict(num_blocks=16, block_size=4),
        kv_events_config=dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:1"),
    )
    try:
        bad = [
            (
                dict(step_delay_s=-1),
                ValueError,
                r"engine\['step_delay_s'\]=-1 is out of range; engine\['step_delay_s'\] must be a finite number >= 0",
            ),
            (dict(step_delay_s="fast"), TypeError, r"engine\['step_delay_s'\] must be a finite number >= 0, got str 'fast'"),
            (dict(step_delay_s=float("nan")), ValueError, r"engine\['step_delay_s'\]=nan is out of range"),
            (dict(autostep="yes"), TypeError, r"engine\['autostep'\] must be True or False, got 'yes'"),
            (dict(autostep=True, speed=2), ValueError, r"configure: unknown settings \['speed'\]; allowed: \['autostep', 'step_delay_s'\]"),
        ]
        for settings, exc, msg in bad:
            with pytest.raises(exc, match=msg):  # refused here, nothing sent
                srv.configure(**settings)
            with pytest.raises(ServerError, match=f"cfg: {exc.__name__}: {msg}"):  # and by the server itself
                srv.call("configure", **settings)
        assert srv.alive
        reply = srv.configure()
        assert (reply["autostep"], reply["step_delay_s"]) == (False, 0.0)  # unchanged, all or nothing
        reply = srv.configure(autostep=True, step_delay_s=0.001)
        assert (reply["autostep"], reply["step_delay_s"]) == (True, 0.001)
        srv.add([Request("a", list(range(10)), max_tokens=3)])
        for _ in range(2000):  # bounded: wait for the state, not for a time
            if srv.status()["num_finished"] == 1:
                break
        assert srv.status()["num_finished"] == 1 and srv.alive
    finally:
        srv.stop()


# --- item 4: export_html of a KV-event stream ----------------------------------------------------------
def _export_data(p) -> dict:
    import json
    import re

    raw = re.search(r"<script type='application/json' id='kv-data'>(.*?)</script>", p.read_text(encoding="utf-8"), re.S).group(1)
    return json.loads(raw.replace("<\\/", "</"))


def test_export_html_of_a_recorded_stream(tmp_path):
    pytest.importorskip("plotly")
    from kvlab.viz.stream import StreamPlayer

    path = tmp_path / "run.kvev"
    with Recorder(path, topic="kv") as rec:
        for i in (0, 1, 3, 4):
            rec.append(i, "kv", payload(i))
    out = kvlab.export_html(str(path), tmp_path / "x.html")
    d = _export_data(out)
    assert d["views"] == ["prefixes", "series"] and d["steps"] == [0, 1, 2, 3] and d["unit"] == "batch"
    assert len(d["frames"]) == 4 and all(len(f) == 2 for f in d["frames"]) and d["start"] == 3
    assert d["status"][0] == "<b>batch 0</b> · seq 0 · 1 blocks cached · 1 stored · 0 removed"
    assert d["status"][2] == "<b>batch 2</b> · seq 3 · 3 blocks cached · 1 stored · 0 removed · 1 batch lost before it"
    assert d["events"][0] == "<ul style='font-size:12px;margin:4px 0'><li>BlockStored: 1 block (group 0, GPU)</li></ul>"
    assert "<title>run.kvev · kvlab replay</title>" in out.read_text(encoding="utf-8")
    stream = KVStream.load(path)
    assert _export_data(kvlab.export_html(stream, tmp_path / "s.html"))["steps"] == [0, 1, 2, 3]
    player = StreamPlayer(stream)
    player.go_to(1)
    d = _export_data(kvlab.export_html(player, tmp_path / "p.html", max_steps=2))
    assert d["steps"] == [0, 1, 2, 3] and d["start"] == 1 and player.index == 1  # the player is left where it was
    with pytest.raises(TypeError, match=r"options \['title'\] apply to a new Player"):
        kvlab.export_html(player, tmp_path / "q.html", title="x")
    assert _export_data(kvlab.export_html(KVStream(), tmp_path / "empty.html"))["steps"] == [-1]
    restarted_recording(tmp_path / "restart.kvev")
    d = _export_data(kvlab.export_html(str(tmp_path / "restart.kvev"), tmp_path / "r.html"))
    assert d["steps"] == [0, 1, 2, 3, 4] and d["status"][3].endswith("· the publisher restarted: a new run, from an empty cache")
