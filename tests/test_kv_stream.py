"""A KV-event stream as data (``KVStream``), recordings on disk, and the views that draw
them: snapshots equal to the engine's pool, any batch in any order, a recorded stream that
replays into exactly the same pictures (issue 14)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.core import kv_cache_utils
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.distributed.kv_recording import MAGIC, Recorder, is_recording, read_recording
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheIndex, KVEventBatch, encode_batch
from kvlab.request import Request
from kvlab.timeline.kv_stream import KVStream, StreamSnapshot
from kvlab.viz import prefix_index, routing, stream as stream_view


def st_(hashes, parent, *, bs=2, group=0, medium="GPU"):
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[h % 100 for h in hashes for _ in range(bs)],
        block_size=bs,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
    )


def rm(*hashes, group=0):
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=group)


def story() -> KVStream:
    """seq 0: chain 1-2-3; seq 1: branch 2-4 and a duplicate of 3; seq 3 (2 lost): remove 3
    once (a copy stays) and 4; seq 4: an orphan 9 (parent 8 never seen); seq 5: cleared."""
    return KVStream(
        [
            (0, KVEventBatch(ts=0.5, events=[st_([1, 2, 3], None)])),
            (1, KVEventBatch(ts=1.0, events=[st_([4], 2), st_([3], 2)])),
            (3, KVEventBatch(ts=2.0, events=[rm(3), rm(4)])),
            (4, KVEventBatch(ts=2.5, events=[st_([9], 8)])),
            (5, KVEventBatch(ts=3.0, events=[AllBlocksCleared(), st_([7], None)])),
        ],
        name="story",
        checkpoint_every=2,
    )


def keys(snap: StreamSnapshot) -> dict[int, int]:
    return {k[2]: n.copies for k, n in snap.nodes.items()}


def test_snapshots_follow_the_story_batch_by_batch():
    s = story()
    assert len(s) == 5 and s.series.seq == [0, 1, 3, 4, 5] and s.series.missing == [0, 0, 1, 1, 1]
    assert s.series.cached_blocks == [3, 4, 3, 4, 1] and s.series.stored_blocks == [3, 2, 0, 1, 1]
    assert s.series.removed_blocks == [0, 0, 2, 0, 0] and s.series.cleared == [False, False, False, False, True]
    a = s.at(0)
    assert keys(a) == {1: 1, 2: 1, 3: 1} and a.stored == (("GPU", 0, 1), ("GPU", 0, 2), ("GPU", 0, 3))
    assert [n.parent_hash for n in a.nodes.values()] == [None, 1, 2]
    assert a.nodes[("GPU", 0, 2)].token_ids == (2, 2)
    b = s.at(1)
    assert keys(b) == {1: 1, 2: 1, 3: 2, 4: 1} and set(b.stored) == {("GPU", 0, 4), ("GPU", 0, 3)}
    c = s.at(2)
    assert keys(c) == {1: 1, 2: 1, 3: 1} and [n.block_hash for n in c.removed] == [4] and c.missing == 1 and c.seq == 3
    d = s.at(3)
    assert d.is_orphan(("GPU", 0, 9)) and not d.is_orphan(("GPU", 0, 2))
    e = s.at(4)
    assert keys(e) == {7: 1} and e.cleared and e.stored == (("GPU", 0, 7),)
    assert s.at(-1).nodes == {} and s.at(-1).seq is None
    # a router's walk: leading hashes only
    assert b.hit_blocks([1, 2, 4, 5]) == 3 and b.hit_blocks([5, 1, 2]) == 0 and b.hit_blocks([1, 2], group_idx=1) == 0


def test_any_batch_in_any_order_equals_sequential_replay():
    rng = random.Random(0)
    mgr = KVCacheManager(num_blocks=12, block_size=2, enable_kv_cache_events=True)
    batches, running = [], []
    for n in range(120):
        r = Request(f"r{n}", [rng.randrange(3)] * 4 + [rng.randrange(50) for _ in range(rng.randrange(1, 8))])
        hits, k = mgr.get_computed_blocks(r)
        if mgr.allocate_slots(r, r.num_tokens - k, k, hits) is not None:
            r.num_computed_tokens = r.num_tokens
            running.append(r)
        if len(running) > 3 or (running and rng.random() < 0.3):
            mgr.free(running.pop(0))
        ev = mgr.take_events()
        if ev:
            batches.append((len(batches), KVEventBatch(ts=float(n), events=ev)))
    seq_stream = KVStream(batches, checkpoint_every=7)
    want = [dict(seq_stream.at(i).nodes) for i in range(len(seq_stream))]
    jumpy = KVStream(batches, checkpoint_every=7)
    for i in rng.sample(range(len(batches)), len(batches)) + [len(batches) - 1, 0, 5, 4]:
        assert dict(jumpy.at(i).nodes) == want[i]
    # a snapshot taken earlier is not changed by later jumps
    early = jumpy.at(3)
    jumpy.at(len(batches) - 1)
    assert dict(early.nodes) == want[3]


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "free", "reset"]), st.integers(0, 3), st.integers(1, 12)), min_size=1, max_size=25)


@given(ops, st.booleans())
def test_the_stream_rebuilds_the_pools_map_and_agrees_with_cache_index(seq, use_int):
    mgr = KVCacheManager(
        num_blocks=9,
        block_size=2,
        kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=3)],
        enable_kv_cache_events=True,
        kv_events_use_int_block_hashes=use_int,
    )
    stream, index, running = KVStream(checkpoint_every=3), CacheIndex(), []
    for n, (op, variant, length) in enumerate(seq):
        if op == "add":
            r = Request(f"r{n}", [variant] * 3 + list(range(length)))
            hits, k = mgr.get_computed_blocks(r)
            if mgr.allocate_slots(r, r.num_tokens - k, k, hits) is not None:
                r.num_computed_tokens = r.num_tokens
                running.append(r)
        elif op == "free" and running:
            mgr.free(running.pop(variant % len(running)))
        else:
            mgr.reset_prefix_cache()
        payload = encode_batch(KVEventBatch(ts=float(n), events=mgr.take_events()))
        stream.append(n, payload)
        index.apply(payload)
        snap = stream.at()
        expect = {}
        for key, blocks in mgr.block_pool.cached_block_hash_to_block.items():
            expect[
                (kv_cache_utils.get_group_id(key), kv_cache_utils.maybe_convert_block_hash(kv_cache_utils.get_block_hash(key), use_int))
            ] = len(blocks)
        assert {(k[1], k[2]): node.copies for k, node in snap.nodes.items()} == expect
        assert {(g, h): c for (_, g, h), c in index._copies.items()} == expect
        assert snap.num_blocks == stream.series.cached_blocks[-1]


def test_append_is_all_or_nothing():
    s = story()
    before = (len(s), list(s.series.seq))
    with pytest.raises(ValueError, match="does not follow"):
        s.append(5, KVEventBatch(ts=0.0, events=[]))
    with pytest.raises(ValueError, match="seq=-1 is out of range; seq must be an int >= 0"):
        s.append(-1, KVEventBatch(ts=0.0, events=[]))
    with pytest.raises(TypeError, match="seq must be an int"):
        s.append("9", KVEventBatch(ts=0.0, events=[]))
    with pytest.raises(TypeError, match=r"events\[0\] is a str"):
        s.append(9, KVEventBatch(ts=0.0, events=["x"]))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="KVEventBatch or its msgpack payload"):
        s.append(9, {"ts": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a KV event batch"):
        s.append(9, b"\x93\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x81\xa4type\xa3Bad\xc0")
    assert (len(s), s.series.seq) == before
    with pytest.raises(ValueError, match="out of range"):
        s.at(5)
    with pytest.raises(ValueError, match="not in this stream"):
        s.index_of(2)
    assert s.index_of(3) == 2


# --- recordings ------------------------------------------------------------------------------------
def test_a_recorded_stream_replays_into_the_same_views(tmp_path):
    s = story()
    path = tmp_path / "story.kvev"
    s.save(path, topic="kv@test")
    assert is_recording(path) and not is_recording(tmp_path / "nothing")
    back = KVStream.load(path)
    assert back.series == s.series and back.name == "story.kvev"
    for i in range(len(s)):
        a, b = s.at(i), back.at(i)
        assert dict(a.nodes) == dict(b.nodes) and a.stored == b.stored and a.removed == b.removed
        da = prefix_index.figure_data(a, probe=[1, 2, 4])
        db = prefix_index.figure_data(b, probe=[1, 2, 4])
        assert {k: v for k, v in da.items() if k != "title"} == {k: v for k, v in db.items() if k != "title"}
    assert stream_view.series_data(s.series, 2) == stream_view.series_data(back.series, 2)
    rec = read_recording(path)
    assert rec.header["topic"] == "kv@test" and [r.topic for r in rec] == [b"kv@test"] * 5


def test_bad_recordings_say_what_is_wrong(tmp_path):
    good = tmp_path / "good.kvev"
    with Recorder(good, topic="kv") as rec:
        for i in range(3):
            rec.append(i, "kv", encode_batch(KVEventBatch(ts=float(i), events=[st_([i + 1], None)])))
    data = good.read_bytes()
    cut = tmp_path / "cut.kvev"
    cut.write_bytes(data[:-5])
    with pytest.raises(ValueError, match=r"truncated in record 2 .* 2 complete batches"):
        read_recording(cut)
    partial = read_recording(cut, strict=False)
    assert partial.truncated and [r.seq for r in partial] == [0, 1]
    assert len(KVStream.load(cut, strict=False)) == 2
    (tmp_path / "other.bin").write_bytes(b"hello world")
    with pytest.raises(ValueError, match="not a KV-event recording"):
        read_recording(tmp_path / "other.bin")
    (tmp_path / "hdr.kvev").write_bytes(MAGIC + b"\x00\x00")
    with pytest.raises(ValueError, match="truncated inside its header"):
        read_recording(tmp_path / "hdr.kvev")
    bad = bytearray(data)
    hdr_len = int.from_bytes(bad[8:12], "big")
    first = 12 + hdr_len
    bad[first + 4] = 0xC1  # msgpack's never-used byte, where record 0 starts
    (tmp_path / "bad.kvev").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="record 0 is corrupt"):
        read_recording(tmp_path / "bad.kvev")
    with pytest.raises(ValueError, match="is closed"):
        rec.append(3, "kv", b"")


# --- the views, as data ----------------------------------------------------------------------------
def test_prefix_forest_layout_changes_and_probe_walk():
    s = story()
    d = prefix_index.figure_data(s.at(1), probe=[1, 2, 5, 6])
    pos = {n["hash"]: (n["depth"], n["row"]) for n in d["nodes"]}
    assert pos == {1: (0, 0.5), 2: (1, 0.5), 3: (2, 0.0), 4: (2, 1.0)}
    assert {n["hash"]: n["copies"] for n in d["nodes"]}[3] == 2
    assert sorted(d["edges"]) == [(1, 2), (2, 3), (2, 4)]
    assert {n["hash"] for n in d["nodes"] if n["stored"]} == {3, 4}
    assert d["probe"] == dict(hits=[1, 2], miss=5, num_hit_blocks=2, ghost=(2.0, 0.95))
    assert {n["hash"]: n["probe"] for n in d["nodes"]} == {1: "hit", 2: "hit", 3: None, 4: None}
    assert d["counts"] == dict(blocks=4, chains=2, stored=2, removed=0, orphans=0, hidden=0)
    assert "+2 stored" in d["summary"] and "probe: 2 of 4 blocks cached" in d["summary"]
    # batch seq 3 removed 4 (a ghost where it was) and one copy of 3 (still drawn)
    r = prefix_index.figure_data(s.at(2))
    assert [(g["hash"], g["depth"]) for g in r["removed"]] == [(4, 2)] and r["counts"]["removed"] == 1
    assert "1 batches lost before this one" in r["summary"]
    o = prefix_index.figure_data(s.at(3))
    assert [n["hash"] for n in o["nodes"] if n["orphan"]] == [9] and o["counts"]["orphans"] == 1
    c = prefix_index.figure_data(s.at(4))
    assert [n["hash"] for n in c["nodes"]] == [7] and "AllBlocksCleared" in c["summary"]
    with pytest.raises(TypeError, match="StreamSnapshot"):
        prefix_index.figure_data(s)  # type: ignore[arg-type]


def test_prefix_forest_caps_what_it_draws_and_filters_groups():
    s = KVStream([(0, KVEventBatch(ts=0.0, events=[st_(range(1, 41), None), st_([100, 101], None, group=1)]))])
    d = prefix_index.figure_data(s.at(), max_nodes=10)
    assert d["counts"]["blocks"] == 10 and d["counts"]["hidden"] == 30 and "(30 older not drawn)" in d["title"]
    assert [n["hash"] for n in prefix_index.figure_data(s.at(), group_idx=1)["nodes"]] == [100, 101]
    assert len(prefix_index.figure_data(s.at(), group_idx=None)["nodes"]) == 42
    v = prefix_index.PrefixIndexView()
    v.update(s.at(), probe=[1, 2, 3])
    assert len(v.figure.data[2].x) == 40 and list(v.figure.data[5].x) == [-0.45, 0, 1, 2]  # the walk: a stub, then the hits


def test_series_bins_long_streams():
    s = story()
    d = stream_view.series_data(s.series, cursor=1)
    assert d["bar_x"] == [0, 1, 3, 4, 5] and d["stored"] == [3, 2, 0, 1, 1] and d["removed"] == [0, 0, -2, 0, 0]
    assert d["lost_at"] == [3] and d["cleared_at"] == [5] and d["cursor"] == 1
    b = stream_view.series_data(s.series, max_bars=2)
    assert b["bin"] == 3 and b["stored"] == [5, 2] and b["removed"] == [-2, 0] and b["bar_x"] == [1, 5]
    p = stream_view.StreamPlayer(s, probe=[7])
    p.go_to(1)
    assert p.prefixes.last_data["counts"]["blocks"] == 4 and p.series.last_data["cursor"] == 1
    with pytest.raises(TypeError, match="KVStream"):
        stream_view.StreamPlayer(s.at())  # type: ignore[arg-type]


def test_routing_figure_data_groups_by_trace_and_policy():
    rows = [
        dict(trace="t1", policy="round_robin", hit_rate=0.5, ttft_mean=0.2, ttft_p90=0.5, prefill_per_replica=[10, 30], imbalance=1.5),
        dict(trace="t1", policy="kv_aware+load(2)", hit_rate=0.8, ttft_mean=0.1, ttft_p90=0.2, prefill_per_replica=[20, 20], imbalance=1.0),
        dict(trace="t2", policy="round_robin", hit_rate=0.25, ttft_mean=0.05, ttft_p90=0.06, prefill_per_replica=[0, 0], imbalance=1.0),
    ]
    d = routing.figure_data(rows)
    assert d["traces"] == ["t1", "t2"] and d["policies"] == ["round_robin", "kv_aware+load(2)"]
    # Hatchings tell policies apart (every colour keeps its one meaning; sky blue is "cached").
    assert d["patterns"] == {"round_robin": "/", "kv_aware+load(2)": "."}
    assert routing.figure_data([dict(rows[0], policy="kv_aware")])["patterns"] == {"kv_aware": "x"}
    assert d["cells"][("t1", "round_robin")] == dict(
        hit_rate=50.0, ttft_mean_ms=200.0, ttft_p90_ms=500.0, prefill_share=[25.0, 75.0], imbalance=1.5
    )
    assert d["cells"][("t2", "round_robin")]["prefill_share"] == [0.0, 0.0]
    fig = routing.routing_figure(rows)
    bars = [t for t in fig.data if t.type == "bar" and t.xaxis == "x3"]
    assert [list(t.base) for t in bars] == [[0, 0, 0], [25.0, 50.0, 0.0]]


def test_show_opens_streams_and_recordings_in_the_stream_player(tmp_path):
    from kvlab.show import show

    s = story()
    p = show(s, probe=[1, 2])
    assert isinstance(p, stream_view.StreamPlayer) and p.index == 4
    s.save(tmp_path / "s.kvev")
    q = show(tmp_path / "s.kvev")
    assert isinstance(q, stream_view.StreamPlayer) and len(q.stream) == 5
    assert q.prefixes.last_data["nodes"] == p.prefixes.last_data["nodes"]


def test_the_stream_player_draws_in_the_page_batch_by_batch():
    """A StreamPlayer is one page widget too: its batches are the steps, its views stack."""
    p = stream_view.StreamPlayer(story(), follow=True)
    sent = []
    p.widget.send = lambda content, buffers=None: sent.append(content)
    h = p.widget.header
    assert (h["unit"], h["columns"], h["steps"], h["views"], h["requests"]) == ("batch", 1, [0, 1, 2, 3, 4], ["prefixes", "series"], None)
    p.widget._on_msg(p.widget, {"type": "need", "view": "a", "steps": [2, 1], "version": h["version"]}, [])
    first, rest = sent
    assert first["steps"] == [2] and rest["steps"] == [1] and len(first["frames"][0]) == 2
    assert first["status"][0].startswith("<b>batch 2</b> · seq 3") and "1 batch lost before it" in first["status"][0]
    assert "BlockRemoved: 1 block (group 0, GPU)" in first["events"][0] and p.index == 4  # packing left it at the newest batch
    p.widget.step = 1  # a step taken in the page
    assert p.index == 1
    p.stream.append(6, KVEventBatch(ts=3.5, events=[st_([11], None)]))
    p.refresh()  # following: the page gets the new batch and goes there
    assert p.widget.header["steps"] == [0, 1, 2, 3, 4, 5] and p.widget.header["version"] > h["version"] and p.widget.step == 5
