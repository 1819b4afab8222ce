"""Events emitted by the core: exact kinds, ids and order for vLLM's scenario; JSON round trip."""

from __future__ import annotations

from kvlab import (
    EventLog,
    FullAttentionSpec,
    KVCacheManager,
    MultiModalFeature,
    Request,
    SlidingWindowSpec,
)
from kvlab.eventlog.events import (
    BlockCached,
    BlockEvicted,
    BlocksFreed,
    BlocksSkipped,
    CacheReset,
    PrefixLookup,
)


def run(mgr, req):
    hits, n = mgr.get_computed_blocks(req)
    out = mgr.allocate_slots(req, req.num_tokens - n, n, hits)
    req.num_computed_tokens = req.num_tokens
    return out


def brief(e):
    """The part of an event that names blocks: kind + ids (hashes are checked separately)."""
    d = e.to_dict()
    keep = ("request_id", "group", "block_ids", "block_id", "to_head", "to_tail", "hit_block_ids", "num_hit_tokens", "positions", "success")
    return (d["kind"],) + tuple((k, d[k]) for k in keep if k in d)


def scenario(common):
    log = EventLog()
    mgr = KVCacheManager(num_blocks=11, block_size=16, event_log=log)
    reqs = {}
    for rid, tail in (("r0", [3] * 7), ("r1", [4] * 5)):
        reqs[rid] = Request(rid, common + tail)
        run(mgr, reqs[rid])
    mgr.free(reqs["r0"])
    mgr.free(reqs["r1"])
    reqs["r2"] = Request("r2", common + [5] * 6)
    run(mgr, reqs["r2"])
    mgr.free(reqs["r2"])
    reqs["r3"] = Request("r3", [99] * 160)
    run(mgr, reqs["r3"])
    return log, mgr, reqs


def test_scenario_event_sequence(common_prefix):
    log, mgr, reqs = scenario(common_prefix)
    expected = [
        ("pool_created",),
        ("prefix_lookup", ("request_id", "r0"), ("hit_block_ids", [[]]), ("num_hit_tokens", 0)),
        ("blocks_allocated", ("request_id", "r0"), ("group", 0), ("block_ids", [1, 2, 3, 4])),
        ("block_cached", ("request_id", "r0"), ("group", 0), ("block_id", 1)),
        ("block_cached", ("request_id", "r0"), ("group", 0), ("block_id", 2)),
        ("block_cached", ("request_id", "r0"), ("group", 0), ("block_id", 3)),
        ("prefix_lookup", ("request_id", "r1"), ("hit_block_ids", [[1, 2, 3]]), ("num_hit_tokens", 48)),
        ("blocks_touched", ("request_id", "r1"), ("group", 0), ("block_ids", [1, 2, 3])),
        ("blocks_allocated", ("request_id", "r1"), ("group", 0), ("block_ids", [5])),
        ("blocks_freed", ("request_id", "r0"), ("group", 0), ("block_ids", [4, 3, 2, 1]), ("to_head", [4]), ("to_tail", [])),
        ("blocks_freed", ("request_id", "r1"), ("group", 0), ("block_ids", [5, 3, 2, 1]), ("to_head", [5]), ("to_tail", [3, 2, 1])),
        ("prefix_lookup", ("request_id", "r2"), ("hit_block_ids", [[1, 2, 3]]), ("num_hit_tokens", 48)),
        ("blocks_touched", ("request_id", "r2"), ("group", 0), ("block_ids", [1, 2, 3])),
        ("blocks_allocated", ("request_id", "r2"), ("group", 0), ("block_ids", [5])),
        ("blocks_freed", ("request_id", "r2"), ("group", 0), ("block_ids", [5, 3, 2, 1]), ("to_head", [5]), ("to_tail", [3, 2, 1])),
        ("prefix_lookup", ("request_id", "r3"), ("hit_block_ids", [[]]), ("num_hit_tokens", 0)),
        ("block_evicted", ("group", 0), ("block_id", 3)),
        ("block_evicted", ("group", 0), ("block_id", 2)),
        ("block_evicted", ("group", 0), ("block_id", 1)),
        ("blocks_allocated", ("request_id", "r3"), ("group", 0), ("block_ids", [5, 4, 6, 7, 8, 9, 10, 3, 2, 1])),
    ] + [("block_cached", ("request_id", "r3"), ("group", 0), ("block_id", b)) for b in [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]
    assert [brief(e) for e in log] == expected
    assert [e.seq for e in log] == list(range(len(expected)))


def test_scenario_event_hashes_and_payloads(common_prefix):
    log, mgr, reqs = scenario(common_prefix)
    r0 = reqs["r0"]
    created = log[0]
    assert (created.num_blocks, created.block_size, created.groups, created.hash_algo) == (
        11,
        16,
        [{"type": "full", "block_size": 16}],
        "sha256",
    )
    cached = [e for e in log.of_type(BlockCached) if e.request_id == "r0"]
    assert [e.block_hash for e in cached] == r0.block_hashes
    assert [e.parent_hash for e in cached] == [None] + r0.block_hashes[:2]
    assert [e.token_ids for e in cached] == [[0] * 16, [1] * 16, [2] * 16] and all(e.extra_keys is None for e in cached)
    lookups = log.of_type(PrefixLookup)
    assert lookups[1].block_hashes == reqs["r1"].block_hashes and lookups[1].max_hit_tokens == 52
    evicted = log.of_type(BlockEvicted)
    assert [e.block_hash for e in evicted] == r0.block_hashes[::-1]  # the common prefix, tail first


def test_extra_keys_in_cached_events():
    log = EventLog()
    mgr = KVCacheManager(num_blocks=11, block_size=16, event_log=log)
    req = Request("r", list(range(33)), lora_name="l", cache_salt="s", mm_features=[MultiModalFeature("img", 11, 10)])
    run(mgr, req)
    assert [e.extra_keys for e in log.of_type(BlockCached)] == [
        (("lora", "l", None), ("mm", "img", 11), ("cache_salt", "s")),
        (("lora", "l", None), ("mm", "img", -5)),
    ]


def test_sliding_window_events():
    log = EventLog()
    mgr = KVCacheManager(
        num_blocks=11, block_size=16, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=32)], event_log=log
    )
    req = Request("r", list(range(50)))
    run(mgr, req)
    start = len(log)
    req.append_output_token_ids(1)
    mgr.allocate_slots(req, 1)
    tail = [brief(e) for e in log.events[start:]]
    assert tail == [
        ("blocks_skipped", ("request_id", "r"), ("group", 1), ("block_ids", [5]), ("positions", [0])),
        ("blocks_freed", ("request_id", "r"), ("group", 1), ("block_ids", [5]), ("to_head", []), ("to_tail", [5])),
    ]
    assert log.events[-1].reason == "window"
    mgr.free(req)
    freed = log.of_type(BlocksFreed)[-2:]
    assert [(e.group, e.to_head, e.to_tail, e.reason) for e in freed] == [(0, [4], [3, 2, 1], "request"), (1, [8], [7, 6], "request")]
    assert log.of_type(BlocksSkipped)[0].step == 0


def test_reset_events():
    log = EventLog()
    mgr = KVCacheManager(num_blocks=5, block_size=4, event_log=log)
    req = Request("r", [1, 2, 3, 4, 5])
    run(mgr, req)
    mgr.reset_prefix_cache()
    mgr.free(req)
    mgr.reset_prefix_cache()
    assert [e.success for e in log.of_type(CacheReset)] == [False, True]


def test_event_log_json_round_trip(common_prefix, tmp_path):
    log, mgr, reqs = scenario(common_prefix)
    log.step = 3
    text = log.to_json()
    back = EventLog.from_json(text)
    assert back.events == log.events and back.step == 3
    assert isinstance(back[16].block_hash, bytes) and back[16].block_hash == reqs["r0"].block_hashes[2]
    path = tmp_path / "log.json"
    log.save(str(path))
    assert EventLog.load(str(path)).to_json() == text


def test_json_round_trip_with_extra_keys_is_stable():
    log = EventLog()
    mgr = KVCacheManager(num_blocks=11, block_size=16, event_log=log)
    run(mgr, Request("r", list(range(20)), cache_salt="s", mm_features=[MultiModalFeature("img", 0, 3)]))
    text = log.to_json()
    back = EventLog.from_json(text)
    assert back.to_json() == text and [e.kind for e in back] == [e.kind for e in log]
    assert [e.to_dict() for e in back] == [e.to_dict() for e in log]


def test_subscribers_see_every_event():
    log = EventLog()
    seen = []
    log.subscribe(seen.append)
    mgr = KVCacheManager(num_blocks=5, block_size=4, event_log=log)
    run(mgr, Request("r", [1, 2, 3, 4, 5]))
    assert seen == log.events and len(seen) == 4
