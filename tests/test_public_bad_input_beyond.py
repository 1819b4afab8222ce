"""The public doors beyond the core, fed bad input: a TypeError/ValueError that names the
argument (and what is allowed), raised before anything changes -- the same rule, and the
same rigour, as tests/test_public_bad_input.py, for the surfaces the later lessons added:
KV events on the wire (lessons 08-10), routing (lesson 11), the offload tiers, connectors,
encoder cache and disaggregated prefill (lessons 12-14) and the learner's own loop
(predictions, the progress file, ``kvlab.show`` / ``export_html``).

Each case runs in a world with state everywhere -- a CacheIndex and a KVStream holding
batches, a recording on disk, replicas with indexes and loads and policies part-way
through a trace, a CPU tier and a file tier holding (and pinning) blocks, an encoder cache
holding images, the learner's progress file and this kernel's predictions -- and the full
fingerprint of all of it must be exactly what it was after the refused call. The number of
open file descriptors and of threads is in the fingerprint too: a refused constructor must
not leave a socket, a file or a publisher thread behind. ``subprocess.Popen`` and the
Fleet's Subscriber are replaced by traps: a refused Fleet or DisaggregatedPrefill must be
refused before any process starts (and before any socket opens).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import warnings
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

import kvlab
import kvlab.routing.fleet as fleet_mod
from kvlab import Request
from kvlab import MultiModalFeature as MMF
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.encoder_cache_manager import EncoderCacheManager, compute_encoder_budget
from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.engine.llm_engine import build_engine
from kvlab.entrypoints.disagg_prefill import DisaggregatedPrefill
from kvlab.entrypoints.kv_server import KVServer, _engine_config
from kvlab.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    KVEventBatch,
    KVEventsConfig,
    Recorder,
    Subscriber,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    read_recording,
)
from kvlab.kv_offload.base import make_offload_key
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.staged import StagedTieringManager
from kvlab.learner import prediction as prediction_mod
from kvlab.learner import predict
from kvlab.learner.store import Store, store
from kvlab.routing.fleet import Fleet
from kvlab.routing.policies import KVAware, LeastLoaded, ReplicaState, RoundRobin, make_policy, prompt_block_hashes
from kvlab.eventlog.events import EventLog
from kvlab.timeline.kv_stream import KVStream


def stored(*hashes, parent=None, medium="GPU", **kw):
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[7] * (2 * len(hashes)),
        block_size=2,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **kw,
    )


def removed(*hashes, medium="GPU"):
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(*events, ts=1.0):
    return KVEventBatch(ts=ts, events=list(events))


def key(i: int) -> bytes:
    return make_offload_key(bytes([i]) * 32, 0)


def world(tmp) -> SimpleNamespace:
    w = SimpleNamespace(tmp=tmp)
    zmq.Context.instance()  # the process-wide context exists before the fd count is taken
    # -- KV events: an index, a stream with a gap, a recording on disk
    w.idx = CacheIndex().apply(batch(stored(1, 2), stored(2), removed(9)))
    w.stream = KVStream(
        [(0, batch(stored(1, 2))), (1, encode_batch(batch(stored(3, parent=2)))), (3, batch(removed(1)))], checkpoint_every=2
    )
    w.rec_path = str(tmp / "run.kvev")
    w.stream.save(w.rec_path, topic="kv")
    w.good = batch(stored(5))
    # -- routing: three replicas part-way through a trace, policies with memory
    w.reps = [ReplicaState(f"r{i}") for i in range(3)]
    w.reps[1].index.apply(batch(stored(10, 11)))
    w.reps[2].load, w.reps[0].num_routed = 2, 3
    w.rr, w.kva = RoundRobin(), KVAware(1.0)
    w.rr.choose(None, [10], w.reps)
    w.kva.choose(None, [10, 11], w.reps)
    # -- beyond the pool: a CPU tier (one block pinned, one being written) over a file tier
    w.cpu = CPUOffloadingManager(3)
    w.cpu.complete_store(w.cpu.prepare_store([key(1), key(2)]).keys_to_store)
    w.cpu.prepare_store([key(3)])
    w.cpu.prepare_load([key(1)])
    w.fs_dir = tmp / "tier"
    w.tier = StagedTieringManager(CPUOffloadingManager(2), StagedFileSystemTier(4, str(w.fs_dir)))
    plan = w.tier.prepare_store([key(4), key(5)])
    w.tier.complete_store(plan)
    for p in plan.cascade_paths:  # the worker would have written them
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "wb").close()
    w.tier.primary.remove([key(4)], "test: gone from CPU, still on disk")
    w.ecm_log = EventLog()
    w.ecm = EncoderCacheManager(10, w.ecm_log)
    w.img = Request("img", list(range(16)), mm_features=[MMF("cat", 0, 4), MMF("dog", 6, 8)])
    w.plain = Request("plain", [1, 2, 3])
    assert w.ecm.can_allocate(w.img, 0, 10, 0)
    w.ecm.allocate(w.img, 0)
    w.pd = DisaggregatedPrefill(str(tmp / "pd"))
    w.pd_sent: list[bytes] = []
    w.pd.children = {r: _FakeChild(w.pd_sent) for r in ("prefill", "decode")}
    # -- the learner: a progress file with a pass, and this kernel's predictions
    w.home = tmp / "home"
    store().record_pass("touch")
    w.guess = predict("How many blocks?", kind="choice", choices=["1", "2"])
    return w


class _FakeChild:
    """Stands in for an engine process of DisaggregatedPrefill: anything sent is recorded."""

    def __init__(self, sent: list) -> None:
        self.proc = SimpleNamespace(stdin=SimpleNamespace(write=sent.append, flush=lambda: None), poll=lambda: 0)


def _files(root) -> tuple:
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out.append((os.path.relpath(p, root), fh.read()))
        out.append((os.path.relpath(dirpath, root), None))
    return tuple(out)


def _lru(m) -> tuple:
    return (
        tuple((k, c.chunk_id, c.ref_cnt) for k, c in m._policy.items()),
        tuple(m._free_list),
        m._num_allocated_chunks,
        tuple((tuple(e.keys), e.medium, e.removed, tuple(e.slots), e.reason) for e in m.events or ()),
    )


def state(w) -> tuple:
    s = w.stream
    return (
        # KV events
        tuple(sorted(w.idx._copies.items(), key=repr)),
        w.idx.num_events,
        w.idx.num_unknown_removals,
        len(s),
        asdict(s.series),
        tuple(sorted(s._head.items(), key=repr)),
        len(s._checkpoints),
        tuple(s._payloads),
        s.num_unknown_removals,
        s.name,
        s.checkpoint_every,
        # routing
        tuple((r.name, r.load, r.num_routed, tuple(sorted(r.index._copies.items(), key=repr))) for r in w.reps),
        w.rr._next,
        tuple(w.kva.last_scores),
        w.kva.load_weight,
        # beyond the pool
        _lru(w.cpu),
        _lru(w.tier.primary),
        _lru(w.tier.secondary),
        tuple(sorted((h, tuple(sorted(v))) for h, v in w.ecm.cached.items())),
        tuple(sorted(w.ecm.num_embeds_by_hash.items())),
        tuple(sorted((r, tuple(sorted(v))) for r, v in w.ecm.request_cached_ids.items())),
        tuple(sorted((r, tuple(sorted(v.items()))) for r, v in w.ecm.request_hash_refs.items())),
        tuple(w.ecm.freeable.items()),
        tuple(w.ecm.freed),
        w.ecm.num_free_slots,
        w.ecm.num_freeable_slots,
        len(w.ecm_log),
        tuple(w.pd_sent),
        w.pd.children.keys(),
        # the learner, and every file of the world (recording, tier files, progress file)
        len(prediction_mod.ASKED),
        id(prediction_mod.ASKED[-1]),
        w.guess.locked,
        w.guess.value,
        _files(w.tmp),
        # nothing left open: sockets, files, publisher threads
        len(os.listdir("/proc/self/fd")),
        threading.active_count(),
    )


class Staged:
    """A case whose bad call needs a (legitimate) call before it: the state is taken after
    ``setup``; ``after`` checks what a fingerprint cannot see (e.g. the next seq)."""

    def __init__(self, setup, bad, after=None, teardown=None) -> None:
        self.setup, self.bad, self.after, self.teardown = setup, bad, after, teardown


# --- staged worlds ------------------------------------------------------------------------------------
def _pub_setup(w, **kw):
    w.pub = ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", buffer_steps=8, **kw)
    w.pub.publish(batch(stored(1)))
    assert w.pub.flush(5.0)


def _pub_state(w):
    with w.pub._buffer_lock:
        buf = [s for s, _ in w.pub._buffer]
    return (w.pub.num_published, w.pub.num_sent, buf)


def _pub_next_seq_is_1(w):
    """No seq was consumed: the next good batch is seq 1, right after the setup's seq 0."""
    assert _pub_state(w) == (1, 1, [0])
    w.pub.publish(batch(stored(2)))
    assert w.pub.flush(5.0) and _pub_state(w) == (2, 2, [0, 1])


def _pub_down(w):
    w.pub.shutdown()


def pub_case(bad, **kw):
    return Staged(lambda w: _pub_setup(w, **kw), bad, _pub_next_seq_is_1, _pub_down)


def _corrupt_progress(w, text):
    (w.home / "progress.json").write_text(text)


E_WIRE, E_ROUTE, E_BEYOND, E_LEARN = "kv events", "routing", "beyond the pool", "learner"
BAD_STORED = stored(3)
BAD_STORED.block_hashes = None  # a struct takes any value; the wire schema does not
ARRAY_ONLY = stored(4, locality="LOCAL")  # a field vLLM <= 0.23 (array events) did not have

CASES = [
    # --- KV events: the wire format -------------------------------------------------------------------
    (E_WIRE, "encode_batch(a list)", lambda w: encode_batch([AllBlocksCleared()]), TypeError, "batch must be a KVEventBatch, got list"),
    (E_WIRE, "encode_batch ts str", lambda w: encode_batch(KVEventBatch(ts="now", events=[])), TypeError, "batch.ts must be a number"),
    (
        E_WIRE,
        "encode_batch events None",
        lambda w: encode_batch(KVEventBatch(ts=1.0, events=None)),
        TypeError,
        "batch.events must be a list",
    ),
    (E_WIRE, "encode_batch event str", lambda w: encode_batch(batch(AllBlocksCleared(), "x")), TypeError, r"batch.events\[1\] is a str"),
    (
        E_WIRE,
        "encode_batch array_like 'yes'",
        lambda w: encode_batch(w.good, array_like="yes"),
        TypeError,
        "array_like must be True or False",
    ),
    (
        E_WIRE,
        "encode_batch array form of a later field",
        lambda w: encode_batch(batch(ARRAY_ONLY), array_like=True),
        ValueError,
        r"BlockStored.locality did not exist while events were arrays",
    ),
    (E_WIRE, "decode_batch str", lambda w: decode_batch("93"), TypeError, "payload must be bytes, got str"),
    (
        E_WIRE,
        "decode_batch not msgpack",
        lambda w: decode_batch(b"\xc1"),
        ValueError,
        "payload is not a KV event batch: it is not valid msgpack",
    ),
    (E_WIRE, "decode_batch truncated", lambda w: decode_batch(b"\x93"), ValueError, "payload is not a KV event batch"),
    (
        E_WIRE,
        "decode_batch empty array",
        lambda w: decode_batch(b"\x90"),
        ValueError,
        "payload is not a KV event batch of vLLM's wire format",
    ),
    (
        E_WIRE,
        "CacheIndex.apply(5)",
        lambda w: w.idx.apply(5),
        TypeError,
        "batch must be a KVEventBatch, its msgpack payload or a list of events, got int",
    ),
    (E_WIRE, "CacheIndex.apply(None)", lambda w: w.idx.apply(None), TypeError, "got NoneType"),
    (E_WIRE, "CacheIndex.apply a str", lambda w: w.idx.apply("BlockStored"), TypeError, "got str"),
    (E_WIRE, "CacheIndex.apply good then bad event", lambda w: w.idx.apply([stored(40), 3]), TypeError, r"events\[1\] is a int"),
    (
        E_WIRE,
        "CacheIndex.apply hashes None after a good event",
        lambda w: w.idx.apply(batch(stored(41), BAD_STORED)),
        ValueError,
        r"batch is not a valid KV event batch: Expected `array`, got `None` - at `batch.events\[1\].block_hashes`",
    ),
    (
        E_WIRE,
        "CacheIndex.apply unhashable hash",
        lambda w: w.idx.apply([stored(42), removed([1])]),
        ValueError,
        r"batch.events\[1\].block_hashes\[0\]",
    ),
    (
        E_WIRE,
        "CacheIndex.apply ts str",
        lambda w: w.idx.apply(KVEventBatch(ts="x", events=[stored(43)])),
        TypeError,
        "batch.ts must be a number",
    ),
    (E_WIRE, "CacheIndex.apply bad payload", lambda w: w.idx.apply(b"\xc1"), ValueError, "not valid msgpack"),
    # --- KV events: publisher and subscriber (sockets only for accepted arguments) ------------------
    (
        E_WIRE,
        "ZmqEventPublisher endpoint int",
        lambda w: ZmqEventPublisher(endpoint=5557),
        TypeError,
        "endpoint must be a ZeroMQ address like 'tcp://\\*:5557', got int",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher endpoint no scheme",
        lambda w: ZmqEventPublisher(endpoint="127.0.0.1:5557"),
        ValueError,
        "endpoint must be a ZeroMQ address",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher replay_endpoint bytes",
        lambda w: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", replay_endpoint=b"tcp://x:1"),
        TypeError,
        "replay_endpoint must be None or a ZeroMQ address",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher buffer_steps 0",
        lambda w: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", buffer_steps=0),
        ValueError,
        "buffer_steps=0 is out of range",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher hwm str",
        lambda w: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", hwm="100"),
        TypeError,
        "hwm must be an int",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher max_queue_size 0",
        lambda w: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", max_queue_size=0),
        ValueError,
        "max_queue_size",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher rank -1",
        lambda w: ZmqEventPublisher(-1, endpoint="tcp://127.0.0.1:0"),
        ValueError,
        "data_parallel_rank=-1",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher topic bytes",
        lambda w: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", topic=b"kv"),
        TypeError,
        "topic must be a str",
    ),
    (
        E_WIRE,
        "ZmqEventPublisher array_like 'no'",
        lambda w: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", array_like="no"),
        TypeError,
        "array_like must be True or False",
    ),
    (E_WIRE, "publish(a dict) takes no seq", pub_case(lambda w: w.pub.publish({"ts": 0})), TypeError, "batch must be a KVEventBatch"),
    (
        E_WIRE,
        "publish(event str) takes no seq",
        pub_case(lambda w: w.pub.publish(batch(stored(2), "x"))),
        TypeError,
        r"batch.events\[1\] is a str",
    ),
    (
        E_WIRE,
        "publish(hashes None) takes no seq",
        pub_case(lambda w: w.pub.publish(batch(BAD_STORED))),
        ValueError,
        r"batch.events\[0\].block_hashes",
    ),
    (
        E_WIRE,
        "publish(hash 2**70) takes no seq",
        pub_case(lambda w: w.pub.publish(batch(removed(2**70)))),
        ValueError,
        "batch cannot be encoded",
    ),
    (
        E_WIRE,
        "publish(later field, array publisher) takes no seq",
        pub_case(lambda w: w.pub.publish(batch(ARRAY_ONLY)), array_like=True),
        ValueError,
        "locality did not exist while events were arrays",
    ),
    (E_WIRE, "Subscriber endpoint int", lambda w: Subscriber(5557), TypeError, "endpoint must be a ZeroMQ address"),
    (E_WIRE, "Subscriber connect to *", lambda w: Subscriber("tcp://*:5557"), ValueError, "a subscriber cannot connect to '\\*'"),
    (E_WIRE, "Subscriber bind 'yes'", lambda w: Subscriber("tcp://127.0.0.1:0", bind="yes"), TypeError, "bind must be True or False"),
    (E_WIRE, "Subscriber hwm -1", lambda w: Subscriber("tcp://127.0.0.1:5557", hwm=-1), ValueError, "hwm=-1 is out of range"),
    (
        E_WIRE,
        "Subscriber replay_timeout_s 0",
        lambda w: Subscriber("tcp://127.0.0.1:5557", replay_timeout_s=0),
        ValueError,
        "replay_timeout_s",
    ),
    (
        E_WIRE,
        "Subscriber record_to int (no socket left open)",
        lambda w: Subscriber("tcp://127.0.0.1:0", bind=True, record_to=5),
        TypeError,
        "record_to must be None, a file path or a Recorder, got int",
    ),
    (E_WIRE, "KVEventsConfig hwm str", lambda w: KVEventsConfig(hwm="x"), TypeError, "hwm must be an int"),
    (
        E_WIRE,
        "KVEventsConfig publisher kafka",
        lambda w: KVEventsConfig(publisher="kafka"),
        ValueError,
        "publisher must be None, 'null' or 'zmq'",
    ),
    (
        E_WIRE,
        "KVEventsConfig enable 'yes'",
        lambda w: KVEventsConfig(enable_kv_cache_events="yes"),
        TypeError,
        "enable_kv_cache_events must be True or False",
    ),
    (
        E_WIRE,
        "KVEventsConfig endpoint no scheme",
        lambda w: KVEventsConfig(endpoint="localhost:5557"),
        ValueError,
        "endpoint must be a ZeroMQ address",
    ),
    (E_WIRE, "KVEventsConfig.from_cli unknown key", lambda w: KVEventsConfig.from_cli('{"hmw": 5}'), ValueError, r"unknown keys \['hmw'\]"),
    # --- KV events: streams and recordings ------------------------------------------------------------
    (
        E_WIRE,
        "KVStream.append seq not after the last",
        lambda w: w.stream.append(3, w.good),
        ValueError,
        "seq 3 does not follow the last batch's seq 3",
    ),
    (
        E_WIRE,
        "KVStream.append seq -1",
        lambda w: w.stream.append(-1, w.good),
        ValueError,
        "seq=-1 is out of range; seq must be an int >= 0",
    ),
    (E_WIRE, "KVStream.append seq str", lambda w: w.stream.append("9", w.good), TypeError, "seq must be an int >= 0, got str"),
    (E_WIRE, "KVStream.append seq float", lambda w: w.stream.append(9.0, w.good), TypeError, "seq must be an int"),
    (
        E_WIRE,
        "KVStream.append batch dict",
        lambda w: w.stream.append(9, {"ts": 1}),
        TypeError,
        "batch must be a KVEventBatch or its msgpack payload",
    ),
    (E_WIRE, "KVStream.append bad payload", lambda w: w.stream.append(9, b"\x93\x01"), ValueError, "payload is not a KV event batch"),
    (
        E_WIRE,
        "KVStream.append good then bad event (at a checkpoint)",
        lambda w: w.stream.append(4, batch(stored(50), BAD_STORED)),
        ValueError,
        r"batch.events\[1\].block_hashes",
    ),
    (
        E_WIRE,
        "KVStream.append token_ids None",
        lambda w: w.stream.append(
            4,
            batch(
                BlockStored(
                    block_hashes=[51], parent_block_hash=None, token_ids=None, block_size=2, lora_id=None, medium="GPU", lora_name=None
                )
            ),
        ),
        ValueError,
        r"batch.events\[0\].token_ids",
    ),
    (E_WIRE, "KVStream checkpoint_every 0", lambda w: KVStream(checkpoint_every=0), ValueError, "checkpoint_every=0 is out of range"),
    (E_WIRE, "KVStream name int", lambda w: KVStream(name=5), TypeError, "name must be a str"),
    (E_WIRE, "KVStream.at(str)", lambda w: w.stream.at("0"), TypeError, "index must be an int, got str"),
    (E_WIRE, "KVStream.at(-2)", lambda w: w.stream.at(-2), ValueError, r"index=-2 is out of range; this stream has batches 0..2"),
    (E_WIRE, "KVStream.load(5)", lambda w: KVStream.load(5), TypeError, "source must be a recording's path or a Recording, got int"),
    (E_WIRE, "read_recording(5)", lambda w: read_recording(5), TypeError, "path must be a file path, got int"),
    (E_WIRE, "read_recording strict 'no'", lambda w: read_recording(w.rec_path, strict="no"), TypeError, "strict must be True or False"),
    (
        E_WIRE,
        "read_recording not a recording",
        lambda w: read_recording(str(w.tmp / "home" / "progress.json")),
        ValueError,
        "not a KV-event recording",
    ),
    (
        E_WIRE,
        "read_recording header a list",
        Staged(lambda w: (w.tmp / "h.kvev").write_bytes(b"KVEVREC1\x00\x00\x00\x01\x90"), lambda w: read_recording(str(w.tmp / "h.kvev"))),
        ValueError,
        "the recording header is corrupt",
    ),
    (
        E_WIRE,
        "read_recording truncated",
        Staged(
            lambda w: (w.tmp / "t.kvev").write_bytes(open(w.rec_path, "rb").read()[:-3]), lambda w: read_recording(str(w.tmp / "t.kvev"))
        ),
        ValueError,
        r"truncated in record 2 .* 2 complete batches",
    ),
    (
        E_WIRE,
        "Recorder.append seq str",
        Staged(
            lambda w: setattr(w, "rec", Recorder(str(w.tmp / "r.kvev"))),
            lambda w: w.rec.append("x", b"kv", encode_batch(w.good)),
            teardown=lambda w: w.rec.close(),
        ),
        TypeError,
        "seq must be an int >= 0, got str",
    ),
    (
        E_WIRE,
        "Recorder.append payload str",
        Staged(
            lambda w: setattr(w, "rec", Recorder(str(w.tmp / "r.kvev"))),
            lambda w: w.rec.append(0, b"kv", "payload"),
            teardown=lambda w: w.rec.close(),
        ),
        TypeError,
        "payload must be bytes",
    ),
    # --- routing ------------------------------------------------------------------------------------
    (E_ROUTE, "KVAware load_weight -1", lambda w: KVAware(load_weight=-1), ValueError, "load_weight=-1 is out of range"),
    (E_ROUTE, "KVAware load_weight str", lambda w: KVAware(load_weight="1"), TypeError, "load_weight must be a finite number"),
    (E_ROUTE, "KVAware load_weight nan", lambda w: KVAware(load_weight=float("nan")), ValueError, "load_weight=nan"),
    (E_ROUTE, "KVAware group_idx str", lambda w: KVAware(group_idx="0"), TypeError, "group_idx must be None or an int"),
    (E_ROUTE, "KVAware medium int", lambda w: KVAware(medium=0), TypeError, "medium must be None or a str"),
    (E_ROUTE, "KVAware.choose no replicas", lambda w: w.kva.choose(None, [10], []), ValueError, "replicas must not be empty"),
    (
        E_ROUTE,
        "KVAware.choose replicas of ints",
        lambda w: w.kva.choose(None, [10], [1, 2]),
        TypeError,
        r"replicas\[0\] must be a ReplicaState, got int",
    ),
    (
        E_ROUTE,
        "KVAware.choose block_hashes None",
        lambda w: w.kva.choose(None, None, w.reps),
        TypeError,
        "block_hashes must be a list of block hashes",
    ),
    (
        E_ROUTE,
        "KVAware.choose one replica, not a list",
        lambda w: w.kva.choose(None, [10], w.reps[0]),
        TypeError,
        "replicas must be a list of ReplicaState",
    ),
    (E_ROUTE, "RoundRobin.choose no replicas (turn kept)", lambda w: w.rr.choose(None, [], []), ValueError, "replicas must not be empty"),
    (
        E_ROUTE,
        "RoundRobin.choose a bad replica (turn kept)",
        lambda w: w.rr.choose(None, [], [*w.reps, "r3"]),
        TypeError,
        r"replicas\[3\] must be a ReplicaState",
    ),
    (E_ROUTE, "LeastLoaded.choose no replicas", lambda w: LeastLoaded().choose(None, [], []), ValueError, "replicas must not be empty"),
    (
        E_ROUTE,
        "LeastLoaded.choose dicts",
        lambda w: LeastLoaded().choose(None, [], [{"load": 0}]),
        TypeError,
        r"replicas\[0\] must be a ReplicaState, got dict",
    ),
    (E_ROUTE, "make_policy unknown name", lambda w: make_policy("random"), ValueError, "policy='random' is unknown; choose one of"),
    (E_ROUTE, "make_policy int", lambda w: make_policy(5), TypeError, "policy must be a name or an object with .name and .choose"),
    (E_ROUTE, "prompt_block_hashes block_size 0", lambda w: prompt_block_hashes([1, 2], 0), ValueError, "block_size=0 is out of range"),
    (
        E_ROUTE,
        "prompt_block_hashes hash md5",
        lambda w: prompt_block_hashes([1, 2], 1, hash_algo="md5"),
        ValueError,
        "unknown hash_algo 'md5'",
    ),
    (E_ROUTE, "prompt_block_hashes tokens str", lambda w: prompt_block_hashes("ab", 1), TypeError, r"prompt_token_ids\[0\]"),
    (
        E_ROUTE,
        "prompt_block_hashes use_int 'x'",
        lambda w: prompt_block_hashes([1, 2], 1, use_int="x"),
        TypeError,
        "use_int must be True or False",
    ),
    (E_ROUTE, "prompt_block_hashes salt bytes", lambda w: prompt_block_hashes([1, 2], 1, cache_salt=b"t"), TypeError, "cache_salt"),
    (
        E_ROUTE,
        "Fleet num_replicas 0",
        lambda w: Fleet(0),
        ValueError,
        "num_replicas=0 is out of range; num_replicas must be an int in 1..16",
    ),
    (E_ROUTE, "Fleet engine int", lambda w: Fleet(2, engine=5), TypeError, "engine must be None or a dict of engine settings, got int"),
    (
        E_ROUTE,
        "Fleet engine unknown key",
        lambda w: Fleet(2, engine={"num_blok": 8}),
        ValueError,
        r"engine config has unknown keys \['num_blok'\]",
    ),
    (
        E_ROUTE,
        "Fleet engine num_blocks str",
        lambda w: Fleet(2, engine={"num_blocks": "8"}),
        TypeError,
        r"engine\['num_blocks'\] must be an int",
    ),
    (
        E_ROUTE,
        "Fleet engine block_size 0",
        lambda w: Fleet(2, engine={"block_size": 0}),
        ValueError,
        r"engine\['block_size'\]=0 is out of range",
    ),
    (
        E_ROUTE,
        "Fleet engine hash md5",
        lambda w: Fleet(2, engine={"hash_algo": "md5"}),
        ValueError,
        r"engine\['hash_algo'\] must be one of",
    ),
    (
        E_ROUTE,
        "Fleet engine cost_model field",
        lambda w: Fleet(2, engine={"cost_model": {"prefil_s": 1}}),
        TypeError,
        r"engine\['cost_model'\]",
    ),
    (E_ROUTE, "Fleet buffer_steps 0", lambda w: Fleet(2, buffer_steps=0), ValueError, "buffer_steps=0 is out of range"),
    (E_ROUTE, "Fleet start_timeout_s -1", lambda w: Fleet(2, start_timeout_s=-1), ValueError, "start_timeout_s=-1 is out of range"),
    (E_ROUTE, "Fleet sync_timeout_s 0", lambda w: Fleet(2, sync_timeout_s=0), ValueError, "sync_timeout_s=0 is out of range"),
    (E_ROUTE, "Fleet env of ints", lambda w: Fleet(2, env={"PYTHONHASHSEED": 0}), TypeError, "env must be None or a dict of str to str"),
    (E_ROUTE, "Fleet keep_streams 1", lambda w: Fleet(2, keep_streams=1), TypeError, "keep_streams must be True or False"),
    (
        E_ROUTE,
        "KVServer.start engine max_num_seqs 0",
        lambda w: KVServer.start(engine={"max_num_seqs": 0}),
        ValueError,
        r"engine\['max_num_seqs'\]=0",
    ),
    # --- beyond the pool: connector configs ---------------------------------------------------------
    (E_BEYOND, "KVTransferConfig connector int", lambda w: KVTransferConfig(5), TypeError, "kv_connector must be a connector name, got 5"),
    (
        E_BEYOND,
        "KVTransferConfig role 'both'",
        lambda w: KVTransferConfig("OffloadingConnector", kv_role="both"),
        ValueError,
        r"kv_role must be one of \('kv_producer', 'kv_consumer', 'kv_both'\)",
    ),
    (
        E_BEYOND,
        "KVTransferConfig extra config list",
        lambda w: KVTransferConfig("OffloadingConnector", kv_connector_extra_config=[]),
        TypeError,
        "kv_connector_extra_config must be a dict",
    ),
    (
        E_BEYOND,
        "KVTransferConfig failure policy",
        lambda w: KVTransferConfig("OffloadingConnector", kv_load_failure_policy="retry"),
        ValueError,
        "kv_load_failure_policy must be 'recompute' or 'fail'",
    ),
    (
        E_BEYOND,
        "build_engine kv_transfer_config dict",
        lambda w: build_engine(kv_transfer_config={"kv_connector": "OffloadingConnector"}),
        TypeError,
        "kv_transfer_config must be a KVTransferConfig, got dict",
    ),
    (
        E_BEYOND,
        "build_engine unknown connector",
        lambda w: build_engine(kv_transfer_config=KVTransferConfig("Nixl")),
        ValueError,
        "unknown kv_connector 'Nixl'",
    ),
    (
        E_BEYOND,
        "build_engine unknown extra config",
        lambda w: build_engine(kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"cpu_blocks": 8})),
        ValueError,
        r"unknown extra config \['cpu_blocks'\]",
    ),
    (
        E_BEYOND,
        "build_engine num_cpu_blocks 0",
        lambda w: build_engine(kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 0})),
        ValueError,
        "num_cpu_blocks=0 is out of range",
    ),
    (
        E_BEYOND,
        "build_engine storage_path int (no folder made)",
        lambda w: build_engine(kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"storage_path": 5})),
        TypeError,
        "storage_path must be None or a directory path",
    ),
    (
        E_BEYOND,
        "build_engine num_storage_blocks str",
        lambda w: build_engine(
            kv_transfer_config=KVTransferConfig(
                "OffloadingConnector", kv_connector_extra_config={"storage_path": str(w.tmp / "new"), "num_storage_blocks": "8"}
            )
        ),
        TypeError,
        "num_storage_blocks must be an int",
    ),
    (
        E_BEYOND,
        "build_engine ExampleConnector without a path",
        lambda w: build_engine(kv_transfer_config=KVTransferConfig("ExampleConnector")),
        TypeError,
        "shared_storage_path",
    ),
    (
        E_BEYOND,
        "KVConnectorFactory role str",
        lambda w: KVConnectorFactory.create_connector(KVTransferConfig("OffloadingConnector"), "scheduler", 16),
        TypeError,
        "role must be a KVConnectorRole",
    ),
    (
        E_BEYOND,
        "KVConnectorFactory block_size 0",
        lambda w: KVConnectorFactory.create_connector(KVTransferConfig("OffloadingConnector"), KVConnectorRole.SCHEDULER, 0),
        ValueError,
        "block_size=0 is out of range",
    ),
    (
        E_BEYOND,
        "KVConnectorFactory config dict",
        lambda w: KVConnectorFactory.create_connector({}, KVConnectorRole.WORKER, 16),
        TypeError,
        "config must be a KVTransferConfig, got dict",
    ),
    # --- beyond the pool: the offload tiers' books -------------------------------------------------
    (E_BEYOND, "CPUOffloadingManager num_chunks -1", lambda w: CPUOffloadingManager(-1), ValueError, "num_chunks=-1 is out of range"),
    (E_BEYOND, "CPUOffloadingManager num_chunks str", lambda w: CPUOffloadingManager("4"), TypeError, "num_chunks must be an int"),
    (E_BEYOND, "StagedFileSystemTier root_dir int", lambda w: StagedFileSystemTier(4, 5), TypeError, "root_dir must be a directory path"),
    (E_BEYOND, "StagedFileSystemTier root_dir empty", lambda w: StagedFileSystemTier(4, ""), ValueError, "root_dir must not be empty"),
    (E_BEYOND, "StagedFileSystemTier num_blocks -1", lambda w: StagedFileSystemTier(-1, str(w.fs_dir)), ValueError, "num_blocks=-1"),
    (
        E_BEYOND,
        "StagedTieringManager primary int",
        lambda w: StagedTieringManager(5),
        TypeError,
        "primary must be a CPUOffloadingManager",
    ),
    (
        E_BEYOND,
        "StagedTieringManager secondary CPU tier",
        lambda w: StagedTieringManager(w.cpu, CPUOffloadingManager(2)),
        TypeError,
        "secondary must be None or a StagedFileSystemTier",
    ),
    (E_BEYOND, "cpu lookup(str)", lambda w: w.cpu.lookup("k1"), TypeError, "key must be an offload key"),
    (E_BEYOND, "cpu prepare_store(one key, not a list)", lambda w: w.cpu.prepare_store(key(7)), TypeError, "wrap a single key in a list"),
    (E_BEYOND, "cpu prepare_store strs", lambda w: w.cpu.prepare_store([key(7), "k8"]), TypeError, r"keys\[1\] must be an offload key"),
    (
        E_BEYOND,
        "cpu prepare_store protected str",
        lambda w: w.cpu.prepare_store([key(7)], protected="k1"),
        TypeError,
        "protected must be a list of offload keys",
    ),
    (
        E_BEYOND,
        "cpu prepare_load missing after a readable one",
        lambda w: w.cpu.prepare_load([key(2), key(9)]),
        ValueError,
        r"keys\[1\] \(block 0909.*not readable in the CPU tier \(not stored\)",
    ),
    (E_BEYOND, "cpu prepare_load a block being written", lambda w: w.cpu.prepare_load([key(3)]), ValueError, "still being written"),
    (E_BEYOND, "cpu prepare_load str", lambda w: w.cpu.prepare_load(["k"]), TypeError, r"keys\[0\] must be an offload key"),
    (
        E_BEYOND,
        "cpu complete_store success 'no'",
        lambda w: w.cpu.complete_store([key(3)], success="no"),
        TypeError,
        "success must be True or False",
    ),
    (E_BEYOND, "cpu complete_load int keys", lambda w: w.cpu.complete_load([1]), TypeError, r"keys\[0\] must be an offload key"),
    (E_BEYOND, "cpu touch None", lambda w: w.cpu.touch(None), TypeError, "keys must be a list of offload keys, got NoneType"),
    (E_BEYOND, "cpu remove reason None", lambda w: w.cpu.remove([key(2)], None), TypeError, "reason must be a str"),
    (
        E_BEYOND,
        "tiers prepare_load bad medium after a good one",
        lambda w: w.tier.prepare_load([key(5), key(4)], ["CPU", "GPU"]),
        ValueError,
        r"media\[1\] = 'GPU' is not one of this manager's tiers",
    ),
    (
        E_BEYOND,
        "tiers prepare_load missing after a good one",
        lambda w: w.tier.prepare_load([key(5), key(9)], ["CPU", "CPU"]),
        ValueError,
        r"keys\[1\] .* not readable in the CPU tier",
    ),
    (
        E_BEYOND,
        "tiers prepare_load disk block claimed on CPU",
        lambda w: w.tier.prepare_load([key(5), key(4)], ["CPU", "CPU"]),
        ValueError,
        r"keys\[1\]",
    ),
    (E_BEYOND, "tiers prepare_load lengths differ", lambda w: w.tier.prepare_load([key(5)], []), ValueError, "1 keys but 0 media"),
    (E_BEYOND, "tiers prepare_load media str", lambda w: w.tier.prepare_load([key(5)], "CPU"), TypeError, "media must be a list"),
    (E_BEYOND, "tiers prepare_store str", lambda w: w.tier.prepare_store("abc"), TypeError, "keys must be a list of offload keys"),
    # --- beyond the pool: the encoder cache ---------------------------------------------------------
    (E_BEYOND, "EncoderCacheManager cache_size -1", lambda w: EncoderCacheManager(-1), ValueError, "cache_size=-1 is out of range"),
    (
        E_BEYOND,
        "ecm allocate input_id 5",
        lambda w: w.ecm.allocate(w.img, 5),
        ValueError,
        r"input_id=5 is out of range; input_id must be an int in 0..1 \(request 'img' has 2 items\)",
    ),
    (E_BEYOND, "ecm allocate input_id str", lambda w: w.ecm.allocate(w.img, "1"), TypeError, "input_id must be an int"),
    (E_BEYOND, "ecm allocate request None", lambda w: w.ecm.allocate(None, 0), TypeError, "request must be a kvlab.Request, got NoneType"),
    (
        E_BEYOND,
        "ecm allocate a text-only request",
        lambda w: w.ecm.allocate(w.plain, 0),
        ValueError,
        "request 'plain' has no multimodal items",
    ),
    (
        E_BEYOND,
        "ecm allocate without room",
        Staged(
            lambda w: setattr(w, "big", Request("big", list(range(16)), mm_features=[MMF("cow", 0, 12)])),
            lambda w: w.ecm.allocate(w.big, 0),
        ),
        ValueError,
        r"needs 12 embeddings but only 6 slots are free; ask can_allocate\(\) first",
    ),
    (
        E_BEYOND,
        "ecm allocate same image, other size",
        Staged(
            lambda w: setattr(w, "cat2", Request("cat2", list(range(8)), mm_features=[MMF("cat", 0, 3)])),
            lambda w: w.ecm.allocate(w.cat2, 0),
        ),
        ValueError,
        "item 'cat' has 3 embeddings in request 'cat2' but 4 in the cache",
    ),
    (
        E_BEYOND,
        "ecm can_allocate budget str",
        lambda w: w.ecm.can_allocate(w.img, 1, "10", 0),
        TypeError,
        "encoder_compute_budget must be an int",
    ),
    (
        E_BEYOND,
        "ecm can_allocate scheduled -1",
        lambda w: w.ecm.can_allocate(w.img, 1, 10, -1),
        ValueError,
        "num_embeds_to_schedule=-1 is out of range",
    ),
    (E_BEYOND, "ecm can_allocate input_id 9", lambda w: w.ecm.can_allocate(w.img, 9, 10, 0), ValueError, "input_id=9 is out of range"),
    (
        E_BEYOND,
        "ecm check_and_update_cache bool id",
        lambda w: w.ecm.check_and_update_cache(w.img, True),
        TypeError,
        "input_id must be an int.*bool",
    ),
    (E_BEYOND, "ecm free_encoder_input id 9", lambda w: w.ecm.free_encoder_input(w.img, 9), ValueError, "input_id=9 is out of range"),
    (
        E_BEYOND,
        "ecm free_encoder_input request id str",
        lambda w: w.ecm.free_encoder_input("img", 0),
        TypeError,
        "request must be a kvlab.Request, got str",
    ),
    (E_BEYOND, "ecm free(str)", lambda w: w.ecm.free("img"), TypeError, "request must be a kvlab.Request"),
    (
        E_BEYOND,
        "compute_encoder_budget str",
        lambda w: compute_encoder_budget("64", None, None),
        TypeError,
        "max_num_batched_tokens must be an int",
    ),
    (
        E_BEYOND,
        "compute_encoder_budget 0 tokens",
        lambda w: compute_encoder_budget(0, None, None),
        ValueError,
        "max_num_batched_tokens=0 is out of range",
    ),
    (
        E_BEYOND,
        "compute_encoder_budget budget 2.5",
        lambda w: compute_encoder_budget(64, 2.5, None),
        TypeError,
        "max_num_encoder_input_tokens must be None or an int",
    ),
    (E_BEYOND, "compute_encoder_budget cache -1", lambda w: compute_encoder_budget(64, None, -1), ValueError, "encoder_cache_size=-1"),
    # --- beyond the pool: disaggregated prefill (refused before any process starts or message is sent)
    (
        E_BEYOND,
        "DisaggregatedPrefill storage_dir int",
        lambda w: DisaggregatedPrefill(5),
        TypeError,
        "storage_dir must be a directory path",
    ),
    (
        E_BEYOND,
        "DisaggregatedPrefill num_blocks str",
        lambda w: DisaggregatedPrefill(str(w.tmp / "pd2"), num_blocks="32"),
        TypeError,
        "num_blocks must be an int",
    ),
    (
        E_BEYOND,
        "DisaggregatedPrefill block_size 0",
        lambda w: DisaggregatedPrefill(str(w.tmp / "pd2"), block_size=0),
        ValueError,
        "block_size=0 is out of range",
    ),
    (
        E_BEYOND,
        "DisaggregatedPrefill model_seed -1",
        lambda w: DisaggregatedPrefill(str(w.tmp / "pd2"), model_seed=-1),
        ValueError,
        "model_seed=-1",
    ),
    (
        E_BEYOND,
        "DisaggregatedPrefill timeout_s True",
        lambda w: DisaggregatedPrefill(str(w.tmp / "pd2"), timeout_s=True),
        TypeError,
        "timeout_s must be a finite number",
    ),
    (
        E_BEYOND,
        "DisaggregatedPrefill timeout_s 601",
        lambda w: DisaggregatedPrefill(str(w.tmp / "pd2"), timeout_s=601),
        ValueError,
        r"timeout_s must be in \(0, 600\]",
    ),
    (E_BEYOND, "pd.generate a str", lambda w: w.pd.generate("hello", 4), TypeError, "prompts must be a list of prompts"),
    (
        E_BEYOND,
        "pd.generate a bad token in the 2nd prompt",
        lambda w: w.pd.generate([[1, 2], [3, "4"]], 4),
        TypeError,
        r"prompts\[1\]\[1\] must be an int",
    ),
    (E_BEYOND, "pd.generate an empty prompt", lambda w: w.pd.generate([[1, 2], []], 4), ValueError, r"prompts\[1\] must not be empty"),
    (E_BEYOND, "pd.generate max_tokens 0", lambda w: w.pd.generate([[1, 2]], 0), ValueError, "max_tokens=0 is out of range"),
    # --- the learner's loop ---------------------------------------------------------------------------
    (E_LEARN, "predict kind 'int'", lambda w: predict("q?", kind="int"), ValueError, "kind must be one of number, choice, text; got 'int'"),
    (E_LEARN, "predict question int", lambda w: predict(5), TypeError, "question must be a non-empty str, got int"),
    (E_LEARN, "predict question blank", lambda w: predict("  "), ValueError, "question must be a non-empty str"),
    (E_LEARN, "predict one choice", lambda w: predict("q?", choices=["a"]), ValueError, "choices must be a list of at least 2 options"),
    (E_LEARN, "predict choices a str", lambda w: predict("q?", choices="ab"), ValueError, "choices must be a list"),
    (E_LEARN, "predict choices repeated", lambda w: predict("q?", choices=["a", "a"]), ValueError, "choices must be distinct"),
    (
        E_LEARN,
        "predict choices for a number",
        lambda w: predict("q?", kind="number", choices=["1", "2"]),
        ValueError,
        "choices are only for kind='choice'",
    ),
    (E_LEARN, "predict tol str", lambda w: predict("q?", kind="number", tol="1"), TypeError, "tol must be a finite number >= 0, got str"),
    (E_LEARN, "predict tol -1", lambda w: predict("q?", kind="number", tol=-1), ValueError, "tol=-1 is out of range"),
    (E_LEARN, "predict rel_tol for text", lambda w: predict("q?", rel_tol=0.1), ValueError, "tol and rel_tol are for kind='number'"),
    (E_LEARN, "predict id int", lambda w: predict("q?", id=5), TypeError, "id must be None or a non-empty str, got int"),
    (E_LEARN, "lock a choice not offered", lambda w: w.guess.lock("3"), ValueError, r"choose one of \['1', '2'\]"),
    (E_LEARN, "lock None", lambda w: w.guess.lock(None), ValueError, "choose one of"),
    (E_LEARN, "Store(5)", lambda w: Store(5), TypeError, "path must be a file path, got int"),
    (E_LEARN, "record_pass(None)", lambda w: store().record_pass(None), TypeError, "exercise_id must be a non-empty str, got NoneType"),
    (E_LEARN, "record_prediction list", lambda w: store().record_prediction(["uid"]), TypeError, "entry must be a dict with a str 'uid'"),
    (
        E_LEARN,
        "record_prediction no uid",
        lambda w: store().record_prediction({"prediction": 1}),
        ValueError,
        "entry must be a dict with a str 'uid'",
    ),
    (E_LEARN, "kvlab.show(5)", lambda w: kvlab.show(5), TypeError, "source must be a Timeline, an EventLog or a list of events, got int"),
    (E_LEARN, "kvlab.show(None)", lambda w: kvlab.show(None), TypeError, "got NoneType"),
    (E_LEARN, "kvlab.show(a dict)", lambda w: kvlab.show({"events": []}), TypeError, "got dict"),
    (
        E_LEARN,
        "kvlab.show(missing file)",
        lambda w: kvlab.show(str(w.tmp / "nope.json")),
        FileNotFoundError,
        "source: no saved event log at",
    ),
    (E_LEARN, "export_html(5, path) writes nothing", lambda w: kvlab.export_html(5, str(w.tmp / "out.html")), TypeError, "got int"),
    (
        E_LEARN,
        "export_html(log, path int)",
        lambda w: kvlab.export_html(w.ecm_log, 5),
        TypeError,
        "path must be a file path ending in .html, got int",
    ),
    (
        E_LEARN,
        "export_html max_steps 0",
        lambda w: kvlab.export_html(w.ecm_log, str(w.tmp / "out.html"), max_steps=0),
        ValueError,
        "max_steps=0 is out of range; max_steps must be None or an int >= 2",
    ),
    (
        E_LEARN,
        "export_html a Player with options",
        lambda w: kvlab.export_html(kvlab.show(w.ecm_log), str(w.tmp / "out.html"), title="x"),
        TypeError,
        r"options \['title'\] apply to a new Player",
    ),
]


@pytest.fixture
def traps(monkeypatch, tmp_path):
    """No process may start and no Fleet socket may open during a refused call; the
    learner's record lives in this test's own folder."""
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path / "home"))

    def no_process(*a, **k):
        raise AssertionError(f"a process was started for a refused call: {a[:1]}")

    def no_subscriber(*a, **k):
        raise AssertionError("the Fleet opened a router socket for a refused call")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(fleet_mod, "Subscriber", no_subscriber)
    return tmp_path


@pytest.mark.parametrize("door, case, call, exc, match", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input_names_the_argument_and_changes_nothing(door, case, call, exc, match, traps):
    w = world(traps)
    staged = call if isinstance(call, Staged) else None
    try:
        if staged is not None:
            staged.setup(w)
            call = staged.bad
        before = state(w)
        pub_before = _pub_state(w) if hasattr(w, "pub") else None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused call must not fall back to warning
            with pytest.raises(exc, match=match):
                call(w)
        assert state(w) == before, f"{case}: the refused call changed the state"
        if pub_before is not None:
            assert _pub_state(w) == pub_before
        if staged is not None and staged.after is not None:
            staged.after(w)
    finally:
        if staged is not None and staged.teardown is not None:
            staged.teardown(w)
    w.cpu.check_invariants()
    w.tier.check_invariants()
    w.ecm.check_invariants()


DOORS = (E_WIRE, E_ROUTE, E_BEYOND, E_LEARN)


def test_the_table_covers_every_public_door():
    doors: dict[str, int] = {}
    for door, *_ in CASES:
        doors[door] = doors.get(door, 0) + 1
    assert set(doors) == set(DOORS), doors
    assert sum(doors.values()) >= 60, doors
    assert all(doors[d] >= 15 for d in DOORS), doors


def test_numpy_ints_are_ints_beyond_the_pool(tmp_path):
    i = np.int64
    s = KVStream(checkpoint_every=i(2))
    s.append(i(0), batch(stored(1)))
    s.append(np.uint32(2), encode_batch(batch(stored(2, parent=1))))
    assert s.series.seq == [0, 2] and all(type(x) is int for x in s.series.seq) and s.at(i(1)).num_blocks == 2
    with Recorder(str(tmp_path / "n.kvev")) as rec:
        rec.append(i(4), "kv", encode_batch(batch(stored(3))), received_at=np.float32(2.0))
    (r,) = read_recording(str(tmp_path / "n.kvev")).records
    assert r.seq == 4 and type(r.seq) is int
    kva = KVAware(load_weight=np.float32(0.5), group_idx=i(0))
    reps = [ReplicaState("a"), ReplicaState("b")]
    reps[1].index.apply(batch(stored(7, 8, group_idx=0)))
    assert kva.name == "kv_aware+load(0.5)" and kva.group_idx == 0 and kva.choose(None, [7, 8], reps) == 1
    assert prompt_block_hashes(np.array([1, 2, 3, 4]), i(2)) == prompt_block_hashes([1, 2, 3, 4], 2)
    cfg = _engine_config({"num_blocks": i(64), "block_size": np.int32(8), "step_delay_s": np.float64(0.0)})
    assert cfg["num_blocks"] == 64 and type(cfg["num_blocks"]) is int and json.loads(json.dumps(cfg))["block_size"] == 8
    cpu = CPUOffloadingManager(i(2))
    assert cpu.num_blocks == 2 and type(cpu.num_blocks) is int
    ecm = EncoderCacheManager(i(8))
    img = Request("img", list(range(8)), mm_features=[MMF("cat", 0, 4)])
    assert ecm.can_allocate(img, i(0), i(8), np.int32(0))
    ecm.allocate(img, i(0))
    assert ecm.get_cached_input_ids(img) == {0} and all(type(x) is int for x in ecm.get_cached_input_ids(img))
    ecm.free_encoder_input(img, np.uint8(0))
    assert ecm.freeable == {"cat": 4}
    budget = compute_encoder_budget(i(64), i(16), None, max_tokens_per_item=i(20))
    assert budget == (20, 64) and all(type(x) is int for x in budget)
    pd = DisaggregatedPrefill(str(tmp_path / "pd"), num_blocks=i(16), block_size=np.int32(8), model_seed=i(1), timeout_s=np.float32(5))
    assert (pd.num_blocks, pd.block_size, pd.model_seed) == (16, 8, 1) and type(pd.num_blocks) is int
    p = predict("q?", kind="number", tol=i(1))
    assert p.tol == 1.0


def _check_passes(tmp_path, monkeypatch):
    from kvlab.exercises import check

    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    return check("free_order", lambda blocks: blocks[::-1])


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        json.dumps({"version": 1, "passed": {"touch": "yes"}, "predictions": []}),
        json.dumps({"version": 1, "passed": {"touch": {"count": "x"}}, "predictions": []}),
        json.dumps({"version": 1, "passed": {}, "predictions": [5]}),
        json.dumps({"version": 1, "passed": {}, "predictions": [{"prediction": 3}]}),
        "",
    ],
)
def test_a_corrupt_progress_file_never_breaks_a_check_and_is_kept(text, tmp_path, monkeypatch):
    """The decision for a corrupt ``progress.json``: a safe fallback, never a crash -- the
    file is moved aside whole (``progress.json.bad-<time>``, byte for byte), a warning says
    where, a new record starts, and the learner's check still passes and is recorded.
    Entries that would make a later read or write fail half-way count as corrupt too."""
    (tmp_path / "progress.json").write_text(text)
    with pytest.warns(UserWarning, match="was not valid .* moved to"):
        res = _check_passes(tmp_path, monkeypatch)
    assert res.passed
    (bad,) = tmp_path.glob("progress.json.bad-*")
    assert bad.read_text() == text
    assert list(store().passed()) == ["free_order"] and store().passed()["free_order"]["count"] == 1


def test_two_corrupt_files_in_one_second_are_both_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    for text in ("{first", "{second", "{third"):
        (tmp_path / "progress.json").write_text(text)
        with pytest.warns(UserWarning, match="was not valid"):
            assert store().passed() == {}
    assert sorted(p.read_text() for p in tmp_path.glob("progress.json.bad-*")) == ["{first", "{second", "{third"]
