"""vLLM's KV-event transport over ZeroMQ: the publisher's frames, the replay socket, and a
subscriber that survives gaps, bad frames, wrong topics and dead peers (issue 14).

Every socket binds loopback (127.0.0.1, OS-chosen ports) or an ipc path in a temp dir, and
every wait is bounded. A publisher whose endpoint is a plain host address *connects* (vLLM's
rule), so these tests bind the subscriber and let the publisher dial in.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest
import zmq

from kvlab import kv_events
from kvlab.distributed.kv_publisher import END_SEQ, KVEventsConfig, ZmqEventPublisher, is_bind_endpoint, offset_endpoint_port
from kvlab.distributed.kv_recording import read_recording
from kvlab.kv_events import BlockStored, KVEventBatch, Subscriber, decode_batch, encode_batch

pytestmark = pytest.mark.timeout(120)
CTX = zmq.Context.instance()


def stored(h: int, parent: int | None = None, n: int = 1) -> BlockStored:
    return BlockStored(
        block_hashes=[h + i for i in range(n)],
        parent_block_hash=parent,
        token_ids=list(range(16 * n)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[stored(1000 + i, None if i == 0 else 999 + i)])


class Lossy(ZmqEventPublisher):
    """A publisher whose network loses some batches: they are buffered for replay but never
    reach the PUB socket (what a full high-water mark does, deterministically)."""

    drop: set[int] = set()

    def _send(self, seq: int, payload: bytes) -> None:
        if seq not in self.drop:
            super()._send(seq, payload)


def connected_pair(topic: str = "kv", *, cls: type = ZmqEventPublisher, catch_up: bool = True, **pub_kw):
    sub = Subscriber("tcp://127.0.0.1:0", topic=topic, bind=True, catch_up=catch_up, replay_timeout_s=5.0)
    pub = cls(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0", topic=topic, **pub_kw)
    sub.replay_endpoint = pub.replay_endpoint
    sub.poll(0.05)  # a bound SUB attaches the publisher's connection inside a call
    return pub, sub


def publish_all(pub: ZmqEventPublisher, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        pub.publish(batch(i))
    assert pub.flush(10.0)


# --- vLLM's rules -----------------------------------------------------------------------------------
def test_bind_or_connect_follows_vllm():
    for ep in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert is_bind_endpoint(ep), ep
    for ep in ("tcp://127.0.0.1:5557", "tcp://router-host:5557", "tcp://10.0.0.2:0"):
        assert not is_bind_endpoint(ep), ep
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError, match="inproc' or 'tcp"):
        offset_endpoint_port("ipc:///tmp/x", 1)


def test_kv_events_config_reads_vllms_cli_json():
    c = KVEventsConfig.from_cli('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}')
    assert (c.publisher, c.endpoint, c.topic, c.buffer_steps, c.hwm, c.max_queue_size, c.replay_endpoint) == (
        "zmq",
        "tcp://127.0.0.1:5557",
        "kv-events",
        10_000,
        100_000,
        100_000,
        None,
    )
    assert KVEventsConfig().publisher == "null"
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_cli('{"enable_kv_cache_events": true, "port": 5}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.from_cli("{enable}")
    assert isinstance(kv_events.EventPublisherFactory.create(KVEventsConfig()), kv_events.NullEventPublisher)


def test_publisher_sends_three_frames_topic_seq_payload(tmp_path):
    """[topic, 8-byte big-endian seq from 0, payload]: the payload is exactly encode_batch's
    bytes, and the topic frame is sent even when empty. An ipc endpoint binds (vLLM's rule)."""
    for topic in ("", "kv-events"):
        ep = f"ipc://{tmp_path}/pub-{topic or 'empty'}"
        with ZmqEventPublisher(endpoint=ep, topic=topic) as pub:
            assert pub.binds and pub.endpoint == ep
            raw = CTX.socket(zmq.SUB)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.SUBSCRIBE, b"")
            raw.connect(ep)
            time.sleep(0.2)
            raw.poll(10)
            sent = [batch(i) for i in range(3)]
            for b in sent:
                pub.publish(b)
            assert pub.flush(5.0)
            got = [raw.recv_multipart() for _ in range(3) if raw.poll(5000)]
            raw.close()
        assert [len(f) for f in got] == [3, 3, 3]
        assert [f[0] for f in got] == [topic.encode()] * 3
        assert [f[1] for f in got] == [i.to_bytes(8, "big") for i in range(3)]
        assert [f[2] for f in got] == [encode_batch(b) for b in sent]
        assert all(decode_batch(f[2]).data_parallel_rank == 0 for f in got)  # the publisher fills its DP rank


def test_get_publisher_config_reports_the_endpoints_as_bound(tmp_path):
    """vLLM 0.33's ``get_publisher_config`` (and the scheduler's
    ``get_kv_event_publisher_config``): compared with vLLM 0.33.0's ZmqEventPublisher for the
    same arguments, field by field -- the DP rank shifts a tcp port and suffixes an inproc name."""
    ep = f"ipc://{tmp_path}/cfg"
    with ZmqEventPublisher(endpoint=ep, topic="kv", buffer_steps=5, hwm=7, max_queue_size=9) as pub:
        assert pub.get_publisher_config() == KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=ep, buffer_steps=5, hwm=7, max_queue_size=9, topic="kv"
        )
    with ZmqEventPublisher(data_parallel_rank=3, endpoint="inproc://kv-cfg", replay_endpoint="tcp://127.0.0.1:0") as pub:
        cfg = pub.get_publisher_config()
        assert cfg.endpoint == "inproc://kv-cfg_dp3"
        host, _, port = cfg.replay_endpoint.rpartition(":")
        assert host == "tcp://127.0.0.1" and int(port) > 0  # the port it got (vLLM 0.33 says ":0" here)
    assert kv_events.NullEventPublisher().get_publisher_config() is None

    from kvlab.engine.llm_engine import build_engine

    assert build_engine(num_blocks=8, block_size=4).scheduler.get_kv_event_publisher_config() is None
    with ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/eng") as pub:
        eng = build_engine(num_blocks=8, block_size=4, manager_kwargs=dict(enable_kv_cache_events=True), kv_event_publisher=pub)
        assert eng.scheduler.get_kv_event_publisher_config() == pub.get_publisher_config()


class _Sample(msgspec.Struct, tag=True, array_like=True):
    """An event of another kind, as vLLM's own publisher tests send."""

    id: int
    value: str


class _SampleBatch(kv_events.EventBatch):
    events: list[_Sample]


def test_the_publisher_sends_batches_of_other_event_types_too(tmp_path):
    """vLLM's publisher sends any ``EventBatch``; a subscriber of that type reads it back
    (the KV-event checks apply to KV-event batches only)."""
    ep = f"ipc://{tmp_path}/other"
    with ZmqEventPublisher(endpoint=ep) as pub:
        raw = CTX.socket(zmq.SUB)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(ep)
        time.sleep(0.2)
        sent = _SampleBatch(ts=1.5, events=[_Sample(i, f"test-{i}") for i in range(3)])
        pub.publish(sent)
        with pytest.raises(ValueError, match=r"batch \(_SampleBatch\) cannot be sent"):
            pub.publish(_SampleBatch(ts=2.0, events=[_Sample("x", 1)]))  # type: ignore[arg-type]
        assert pub.flush(5.0) and pub.num_published == 1
        frames = raw.recv_multipart() if raw.poll(5000) else []
        raw.close()
    got = msgspec.msgpack.Decoder(_SampleBatch).decode(frames[2])
    assert got == _SampleBatch(ts=1.5, events=[_Sample(i, f"test-{i}") for i in range(3)], data_parallel_rank=0)


def test_replay_socket_answers_from_start_seq_then_end_marker():
    with ZmqEventPublisher(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:0", topic="t", buffer_steps=4) as pub:
        assert not pub.binds  # a host address: the PUB socket connects (nobody listens: fine)
        publish_all(pub, 6)
        d = CTX.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = []
        while d.poll(5000):
            f = d.recv_multipart()
            replies.append(f)
            if f[2] == END_SEQ:
                break
        # bad requests are ignored (logged) and the socket keeps serving
        d.send_multipart([b"", b"\x01\x02"])
        d.send_multipart([b"", (5).to_bytes(8, "big")])
        again = [d.recv_multipart() for _ in range(2) if d.poll(5000)]
        d.close()
    assert END_SEQ == b"\xff" * 8
    # the buffer keeps the last 4 batches (2..5); seqs >= 3 come back, then the end marker
    assert [(f[0], f[1], int.from_bytes(f[2], "big"), decode_batch(f[3]).ts) for f in replies[:-1]] == [
        (b"", b"t", 3, 3.0),
        (b"", b"t", 4, 4.0),
        (b"", b"t", 5, 5.0),
    ]
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert [int.from_bytes(again[0][2], "big"), again[1]] == [5, [b"", b"", END_SEQ, b""]]


def test_publish_checks_the_batch_before_queueing_it():
    with ZmqEventPublisher(endpoint="tcp://127.0.0.1:1") as pub:
        with pytest.raises(TypeError, match=r"batch.events\[1\] is a str"):
            pub.publish(KVEventBatch(ts=0.0, events=[stored(1), "oops"]))  # type: ignore[list-item]
        with pytest.raises(TypeError, match="batch must be a KVEventBatch"):
            pub.publish({"ts": 0})  # type: ignore[arg-type]
        assert pub.num_published == 0 and pub.flush(1.0)
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(batch(0))
    pub.shutdown()  # twice: a no-op
    with pytest.raises(ValueError, match="endpoint must be a ZeroMQ address"):
        ZmqEventPublisher(endpoint="localhost:5557")
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher(endpoint="tcp://127.0.0.1:1", buffer_steps=0)


# --- the subscriber --------------------------------------------------------------------------------
def test_loopback_stream_with_gaps_recovered_through_the_replay_socket(caplog):
    """The issue's check: batches 0, 3, 4 and 7 never reach the SUB socket; the subscriber
    sees each gap, logs it, asks the replay socket, and delivers 0..9 in order, bytes intact."""
    Lossy.drop = {0, 3, 4, 7}
    pub, sub = connected_pair(cls=Lossy)
    try:
        with caplog.at_level(logging.INFO, logger="kvlab.kv_events"):
            publish_all(pub, 10)
            got = list(sub.receive(timeout_s=2.0, until_seq=9))
    finally:
        pub.shutdown()
        sub.close()
    assert [s for s, _ in got] == list(range(10))
    assert [b.ts for _, b in got] == [float(i) for i in range(10)]
    # Batch 0 came back by catching up (the subscriber had received nothing yet): not a gap.
    assert [(g.expected, g.received, g.recovered, g.complete) for g in sub.gaps] == [(3, 5, 2, True), (7, 8, 1, True)]
    assert sub.stats["received"] == 6 and sub.stats["replayed"] == 4 and sub.stats["lost"] == 0
    assert pub.num_replay_requests == 3
    # Batch 0 lost before anything arrived is catching up (asked for): news, not a warning; the
    # two gaps in the middle of the stream are warnings.
    assert [(r.levelname, r.message.split(":")[1].strip()) for r in caplog.records if "recovered" not in r.message] == [
        ("INFO", "catching up on topic b'kv'"),
        ("WARNING", "gap on topic b'kv'"),
        ("WARNING", "gap on topic b'kv'"),
    ]
    assert sum("recovered all" in r.message for r in caplog.records) == 3


def test_a_lost_tail_is_asked_for_when_the_publisher_says_how_far_it_got():
    """Nothing after the last dropped batch reveals the gap; ``until_seq`` (the engine's
    published count, known out of band) does."""
    Lossy.drop = {8, 9}
    pub, sub = connected_pair(cls=Lossy)
    try:
        publish_all(pub, 10)
        got = [s for s, _ in sub.receive(timeout_s=0.5, until_seq=9)]
    finally:
        pub.shutdown()
        sub.close()
    assert got == list(range(10)) and sub.gaps[-1].expected == 8 and sub.gaps[-1].complete


def test_real_high_water_mark_drops_are_recovered():
    """A slow consumer: tiny high-water marks, big batches, nobody reading while 400 are
    published -- ZeroMQ drops batches silently; seq numbers and the replay socket get every
    one of them back."""
    sub = Subscriber("tcp://127.0.0.1:0", topic="kv", bind=True, catch_up=True, hwm=4, replay_timeout_s=10.0)
    pub = ZmqEventPublisher(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="kv", hwm=4)
    sub.replay_endpoint = pub.replay_endpoint
    try:
        sub.poll(0.05)
        big = [stored(10_000 * i, None, n=40) for i in range(8)]  # ~40 kB per batch
        for i in range(400):
            pub.publish(KVEventBatch(ts=float(i), events=big))
        assert pub.flush(30.0)
        seqs = [s for s, _ in sub.receive(timeout_s=1.0, until_seq=399)]
    finally:
        pub.shutdown()
        sub.close()
    assert seqs == list(range(400))
    assert sub.gaps and all(g.complete for g in sub.gaps) and sub.stats["replayed"] > 0


def test_bad_frames_and_wrong_topics_are_logged_skipped_and_refilled(caplog):
    """A hand-driven PUB: a 2-frame message, a 4-byte seq, a payload that is not a batch, and
    a batch on another topic that the prefix filter lets through. None reaches the consumer,
    none stops it; the batch whose payload was bad comes back from the replay socket."""
    sub = Subscriber("tcp://127.0.0.1:0", topic="kv", bind=True, replay_timeout_s=5.0)
    pub = CTX.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(sub.endpoint)
    router = CTX.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    sub.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    good = [encode_batch(batch(i)) for i in range(3)]
    requests: list[int] = []

    def replay_server() -> None:  # a publisher's replay socket, by hand: one request
        if router.poll(10_000):
            client, _, start = router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            router.send_multipart([client, b"", b"kv", (1).to_bytes(8, "big"), good[1]])
            router.send_multipart([client, b"", b"", END_SEQ, b""])

    server = threading.Thread(target=replay_server)
    server.start()
    try:
        sub.poll(0.1)
        time.sleep(0.1)
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), good[0]])
        pub.send_multipart([b"kv", (1).to_bytes(8, "big")])  # truncated: no payload
        pub.send_multipart([b"kv", b"\x00\x01", good[1]])  # seq of 2 bytes
        pub.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\x93\xcb"])  # payload cut short
        pub.send_multipart([b"kv-other", (1).to_bytes(8, "big"), good[1]])  # wrong topic (prefix match)
        pub.send_multipart([b"kv", (2).to_bytes(8, "big"), good[2]])
        with caplog.at_level(logging.INFO, logger="kvlab.kv_events"):
            got = list(sub.receive(timeout_s=2.0, until_seq=2))
    finally:
        server.join(timeout=15)
        pub.close()
        router.close()
        sub.close()
    assert requests == [1]  # the seq whose only copy was malformed was asked for
    assert [s for s, _ in got] == [0, 1, 2]
    assert sub.stats["malformed"] == 3 and sub.stats["wrong_topic"] == 1 and sub.stats["replayed"] == 1
    assert sub.gaps[0].complete
    text = caplog.text
    assert "2 frames" in text and "seq frame of 2 bytes" in text and "not a KV event batch" in text and "kv-other" in text


def test_dead_peers_never_hang_the_consumer():
    """No publisher at all; then a replay endpoint nobody answers: every wait ends."""
    sub = Subscriber("tcp://127.0.0.1:0", bind=True, replay_timeout_s=0.3)
    assert list(sub.receive(timeout_s=0.2)) == []
    # a dead replay peer: the gap is logged, the replay request times out, the socket is rebuilt
    dead = CTX.socket(zmq.ROUTER)
    dead.bind("tcp://127.0.0.1:0")
    sub.replay_endpoint = dead.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = CTX.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(sub.endpoint)
    try:
        sub.poll(0.1)
        time.sleep(0.1)
        pub.send_multipart([b"", (0).to_bytes(8, "big"), encode_batch(batch(0))])
        pub.send_multipart([b"", (5).to_bytes(8, "big"), encode_batch(batch(5))])
        got = [s for s, _ in sub.receive(timeout_s=1.0)]
    finally:
        pub.close()
        dead.close(linger=0)
        sub.close()
    assert got == [0, 5]
    g = sub.gaps[0]
    assert (g.expected, g.received, g.recovered, g.complete, g.missing) == (1, 5, 0, False, 4)
    assert sub.stats["replay_timeouts"] == 1 and sub.stats["lost"] == 4
    with pytest.raises(ValueError, match="closed"):
        list(sub.receive(0.1))


def test_a_publisher_that_dies_mid_stream_ends_receive_and_keeps_what_arrived():
    pub, sub = connected_pair()
    try:
        publish_all(pub, 3)
        first = [s for s, _ in sub.receive(timeout_s=2.0, until_seq=2)]
        pub.shutdown()  # the peer goes away
        assert list(sub.receive(timeout_s=0.3)) == []
        assert first == [0, 1, 2] and sub.last_seq == 2
    finally:
        sub.close()


def test_old_servers_array_events_and_replies_without_topic_are_read():
    """vLLM <= 0.23 encoded events as arrays; <= 0.25 answered replays without the topic frame."""
    Lossy.drop = {1, 2}
    pub, sub = connected_pair(cls=Lossy, array_like=True, replay_topic_frame=False)
    try:
        publish_all(pub, 4)
        got = list(sub.receive(timeout_s=2.0, until_seq=3))
    finally:
        pub.shutdown()
        sub.close()
    assert [s for s, _ in got] == [0, 1, 2, 3] and sub.gaps[0].complete
    assert got[1][1].events[0].block_hashes == [1001]


def test_a_restarted_publisher_and_a_late_joiner():
    """A late subscriber with catch_up gets the publisher's whole buffer; a publisher that
    restarts (seq back to 0) is logged and counted, not taken for duplicates."""
    sub = Subscriber("tcp://127.0.0.1:0", topic="kv", bind=True, catch_up=True, replay_timeout_s=5.0)
    pub = ZmqEventPublisher(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="kv")
    sub.replay_endpoint = pub.replay_endpoint
    try:
        publish_all(pub, 5)  # before the subscriber ever looked: all dropped by PUB/SUB
        sub.poll(0.05)
        publish_all(pub, 1, start=5)
        assert [s for s, _ in sub.receive(timeout_s=2.0, until_seq=5)] == list(range(6))
        pub.shutdown()
        pub = ZmqEventPublisher(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="kv")
        sub.replay_endpoint = pub.replay_endpoint
        sub.poll(0.1)
        publish_all(pub, 2)
        assert [s for s, _ in sub.receive(timeout_s=2.0, max_batches=2)] == [0, 1]
    finally:
        pub.shutdown()
        sub.close()
    assert sub.stats["restarts"] == 1


def test_subscriber_argument_errors():
    with pytest.raises(ValueError, match="cannot connect to"):
        Subscriber("tcp://*:5557")
    with pytest.raises(ValueError, match="ZeroMQ address"):
        Subscriber("127.0.0.1:5557")
    with pytest.raises(TypeError, match="topic must be a str"):
        Subscriber("tcp://127.0.0.1:5557", topic=b"kv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replay_timeout_s"):
        Subscriber("tcp://127.0.0.1:5557", replay_timeout_s=0)
    with Subscriber("tcp://127.0.0.1:5557") as s:  # connecting to nobody is fine
        with pytest.raises(ValueError, match="no replay_endpoint"):
            s.replay()
        with pytest.raises(ValueError, match="timeout_s"):
            list(s.receive(timeout_s=-1))


def test_subscriber_records_what_it_delivers(tmp_path):
    Lossy.drop = {2}
    path = tmp_path / "run.kvev"
    sub = Subscriber("tcp://127.0.0.1:0", topic="kv", bind=True, record_to=path, replay_timeout_s=5.0)
    pub = Lossy(endpoint=sub.endpoint, replay_endpoint="tcp://127.0.0.1:0", topic="kv")
    sub.replay_endpoint = pub.replay_endpoint
    try:
        sub.poll(0.05)
        publish_all(pub, 5)
        live = [(s, encode_batch(b)) for s, b in sub.receive(timeout_s=2.0, until_seq=4)]
    finally:
        pub.shutdown()
        sub.close()
    rec = read_recording(path)
    assert [(r.seq, r.topic, r.payload) for r in rec] == [(s, b"kv", p) for s, p in live]
    assert rec.header["topic"] == "kv" and rec.header["endpoint"] == sub.endpoint
    assert [s for s, _ in rec.batches()] == [0, 1, 2, 3, 4]
    assert isinstance(msgspec.msgpack.decode(rec.records[0].payload), list)
