"""Saved files are read strictly; what they claim is checked before memory is sized by it;
cache salts can be left out; request ids never become markup in the views.
(The one-line bad-file cases are in tests/test_public_bad_input.py.)"""

from __future__ import annotations

import json
import re
import tracemalloc

import pytest

from kvlab import Request
from kvlab.engine.llm_engine import build_engine
from kvlab.timeline import Snapshot, Timeline, replay
from kvlab.eventlog.events import (
    FORMAT_VERSION,
    BlocksAllocated,
    BlockCached,
    BlocksFreed,
    EventLog,
    PoolCreated,
    RequestAdded,
)
from kvlab.eventlog.schema import MAX_BLOCKS

SALTS = ("tenant-a-SECRET-1", "tenant-b-SECRET-2")


def salted_run() -> EventLog:
    eng = build_engine(num_blocks=24, block_size=4, max_num_batched_tokens=32)
    for i, salt in enumerate(SALTS * 2):
        eng.add_request(Request(f"r{i}", list(range(13)), max_tokens=3, cache_salt=salt, arrival_time=float(i)))
    eng.run()
    assert eng.events is not None
    return eng.events


def test_a_saved_log_reads_back_to_the_same_events_and_snapshots(tmp_path):
    log = salted_run()
    path = tmp_path / "run.json"
    log.save(str(path))
    back = EventLog.load(str(path))
    assert [e.to_dict() for e in back] == [e.to_dict() for e in log] and back.step == log.step
    snap = replay(log)
    assert replay(back).pretty_print() == snap.pretty_print()
    assert Snapshot.from_json(snap.to_json()).to_json() == snap.to_json()
    assert json.loads(snap.to_json())["version"] == 1 and json.loads(log.to_json())["version"] == FORMAT_VERSION


def test_cache_salts_can_be_redacted_when_saving(tmp_path):
    log = salted_run()
    assert all(s in log.to_json() for s in SALTS)  # a salt is in plain text by default...
    text = log.to_json(redact_salts=True)
    assert not any(s in text for s in SALTS)  # ... and nowhere when redacted
    back = EventLog.from_json(text)
    added = [e for e in back if isinstance(e, RequestAdded)]
    assert [e.cache_salt for e in added] == ["<salt 1>", "<salt 2>", "<salt 1>", "<salt 2>"]  # who shares: kept
    keys = [e.extra_keys for e in back if e.kind == "block_cached" and e.extra_keys]
    assert keys and all("<salt" in repr(k) for k in keys)
    assert replay(back).pretty_print() == replay(log).pretty_print()  # the picture is the same
    path = tmp_path / "shared.json"
    log.save(str(path), redact_salts=True)
    assert not any(s in path.read_text() for s in SALTS)
    snap = replay(log)
    assert not any(s in snap.to_json(redact_salts=True) for s in SALTS)
    assert any(s in snap.to_json() for s in SALTS)


def _tiny_log(num_blocks: int) -> str:
    log = EventLog()
    log.emit(PoolCreated(num_blocks=num_blocks, block_size=16, groups=[{"type": "full", "block_size": 16}]))
    for i in range(25):  # padding: a small file with a huge claim
        log.emit(RequestAdded(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], max_tokens=4))
    return log.to_json()


def test_a_small_file_claiming_a_billion_blocks_is_refused_before_anything_is_allocated():
    text = _tiny_log(10**9)
    assert len(text) < 5_200
    tracemalloc.start()
    try:
        with pytest.raises(
            ValueError,
            match=r"events\[0\] \(pool_created\)\.num_blocks = 1,000,000,000 is more blocks than this reader allows \(max_blocks = 1,048,576\)",
        ):
            EventLog.from_json(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak  # bytes: nothing was sized by the claim
    # An in-memory log says the same when replayed; the limit can be raised on purpose.
    log = EventLog()
    log.emit(PoolCreated(num_blocks=10**9, block_size=16, groups=[]))
    with pytest.raises(ValueError, match="more blocks than this reader allows"):
        replay(log)
    with pytest.raises(ValueError, match="more blocks than this reader allows"):
        Timeline(log)
    big = EventLog.from_json(_tiny_log(MAX_BLOCKS + 5), max_blocks=MAX_BLOCKS + 5)
    assert replay(big, max_blocks=MAX_BLOCKS + 5).num_blocks == MAX_BLOCKS + 5


def test_a_log_that_cannot_have_happened_is_refused_at_the_first_bad_event():
    log = EventLog()
    log.emit(PoolCreated(num_blocks=6, block_size=4, groups=[{"type": "full", "block_size": 4}]))
    log.emit(BlocksAllocated(request_id=None, group=0, block_ids=[1]))
    log.emit(BlocksFreed(request_id=None, group=0, block_ids=[1], to_head=[1], to_tail=[]))
    replay(log)  # fine so far
    log.emit(BlocksFreed(request_id=None, group=0, block_ids=[3], to_head=[3], to_tail=[]))  # nobody holds 3
    with pytest.raises(ValueError, match=r"event 3 \(BlocksFreed, step 0\) cannot be replayed: block 3 is freed but no table holds it"):
        replay(log)
    with pytest.raises(ValueError, match="block 3 is freed but no table holds it"):
        Timeline(EventLog.from_json(log.to_json()))
    bad_id = EventLog()
    bad_id.emit(PoolCreated(num_blocks=6, block_size=4, groups=[{"type": "full", "block_size": 4}]))
    bad_id.emit(BlocksAllocated(request_id=None, group=0, block_ids=[-1]))  # would index from the end
    with pytest.raises(ValueError, match=r"block id -1 is not a block of the pool \(0\.\.5\)"):
        replay(bad_id)


def test_request_ids_never_become_markup_in_the_views():
    pytest.importorskip("plotly")
    from kvlab.show import show

    evil = ["<img src=x onerror=alert(1)>", "<i>tilt</i><br>", "a&b<script>x</script>"]
    eng = build_engine(num_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    for i, rid in enumerate(evil):
        eng.add_request(Request(rid, [7, 7, 7, 7, 7, 1 + i], max_tokens=3, arrival_time=float(i)))
    player = show(eng)
    seen = []

    def strings(x):
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from strings(v)

    while eng.has_unfinished_requests():
        eng.step()
        for rid in evil:
            player.selected_request = rid
            for view in player.views.values():
                for s in strings(view.figure.to_dict()):
                    assert not re.search(r"<img|<i>|<script|&b<", s), f"{type(view).__name__}: {s!r}"
                    seen.append(s)
    assert any("&lt;img src=x onerror=alert(1)&gt;" in s for s in seen)  # shown, as text


def _every_kind_of_run(tmp_path) -> list[EventLog]:
    """Runs that between them emit nearly every event kind, with the values that do not
    survive a naive JSON round trip: extra hash keys are tuples (LoRA, image, salt)."""
    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from kvlab.request import MultiModalFeature as MM

    enc = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=12, max_num_encoder_input_tokens=8, encoder_cache_size=16)
    for i, (img, off, salt) in enumerate([("img-a", 4, "s1"), ("img-a", 2, None), ("img-b", 2, "s2"), ("img-c", 6, None)]):
        enc.add_request(
            Request(
                f"e{i}",
                list(range(100 * i + 100, 100 * i + 118)),
                max_tokens=2,
                mm_features=[MM(img, offset=off, length=8)],
                cache_salt=salt,
                lora_name="l1" if i % 2 else None,
            )
        )
    enc.run()
    cfg = KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config=dict(num_cpu_blocks=4, storage_path=str(tmp_path / "tiers"), num_storage_blocks=12)
    )
    off = build_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64, kv_transfer_config=cfg)
    for rid, p in [("A", range(100, 109)), ("B", range(200, 217)), ("C", range(300, 313)), ("A2", range(100, 110))]:
        off.add_request(Request(rid, list(p), max_tokens=2))
        off.run()
    hyb = build_engine(
        num_blocks=12,
        block_size=4,
        max_num_batched_tokens=16,
        manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=6)]),
    )
    for i in range(4):
        hyb.add_request(Request(f"h{i}", [7] * 8 + list(range(i, i + 9)), max_tokens=6, arrival_time=float(i)))
    hyb.run()
    assert hyb.kv_cache_manager.reset_prefix_cache()
    tight = build_engine(num_blocks=10, block_size=4, max_num_batched_tokens=32)  # preempts
    for i in range(4):
        tight.add_request(Request(f"t{i}", [5] * 4 + [i] * 4, max_tokens=12, arrival_time=float(i)))
    tight.run()
    return [enc.events, off.events, hyb.events, tight.events]


def test_every_event_kind_reads_back_equal_to_the_live_event(tmp_path):
    """Not just the same JSON: the very same events (a tuple stays a tuple), so a loaded run's
    snapshots equal the live run's, at every step."""
    logs = _every_kind_of_run(tmp_path)
    seen = {e.kind for log in logs for e in log}
    assert {
        "block_cached",
        "blocks_skipped",
        "request_preempted",
        "cache_reset",
        "kv_transfer",
        "offload_evicted",
        "encoder_input_scheduled",
        "encoder_cache_evicted",
    } <= seen, sorted(seen)
    tuples = [e.extra_keys for e in logs[0] if isinstance(e, BlockCached) and e.extra_keys]
    assert (("lora", "l1", None), ("cache_salt", "s2")) not in tuples and any(("cache_salt", "s1") in k for k in tuples)
    assert all(type(k) is tuple and all(type(x) is tuple for x in k) for k in tuples)
    for log in logs:
        back = EventLog.from_json(log.to_json())
        assert list(back) == list(log)
        tl, tl_back = Timeline(log), Timeline(back)
        for s in range(tl.last_step + 1):
            snap = tl.at(s)
            assert tl_back.at(s) == snap
            assert Snapshot.from_json(snap.to_json()) == snap


def test_extra_keys_in_a_file_must_be_a_list():
    log = salted_run()
    d = json.loads(log.to_json())
    i = next(i for i, e in enumerate(d["events"]) if e["kind"] == "block_cached")
    d["events"][i]["extra_keys"] = "cache_salt"
    with pytest.raises(
        ValueError, match=rf"events\[{i}\] \(block_cached\)\.extra_keys must be null or a list \(the block's extra hash keys\), got str"
    ):
        EventLog.from_json(json.dumps(d))
