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
from kvlab.timeline.events import (
    FORMAT_VERSION,
    BlocksAllocated,
    BlocksFreed,
    EventLog,
    PoolCreated,
    RequestAdded,
)
from kvlab.timeline.schema import MAX_BLOCKS

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
        with pytest.raises(ValueError, match=r"events\[0\] \(pool_created\)\.num_blocks = 1,000,000,000 is more blocks than this reader allows \(max_blocks = 1,048,576\)"):
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
