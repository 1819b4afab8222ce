"""Run an engine to the end, checking after every step that its invariants hold and that its
event log replays to the live pool (free queue, ref counts, hashes; the block tables too
when asked) -- the property the pictures rest on."""

from __future__ import annotations

from kvlab.engine.llm_engine import LLMEngine
from kvlab.timeline.snapshot import live_snapshot
from kvlab.timeline.state import ReplayState


def run_replaying(eng: LLMEngine, max_steps: int = 400, tables: bool = False) -> None:
    replayed, done = ReplayState(), 0
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        eng.step()
        eng.scheduler.check_invariants()
        events = eng.events.events
        for e in events[done:]:
            replayed.apply(e)
        done = len(events)
        snap, live = replayed.snapshot(), live_snapshot(eng.kv_cache_manager, eng.scheduler if tables else None)
        assert snap.free_queue == live["free_queue"]
        assert [b.ref_cnt for b in snap.blocks] == live["ref_cnt"]
        assert [b.block_hash for b in snap.blocks] == live["hashes"]
        if tables:
            assert {rid: snap.requests[rid].block_table for rid in live["tables"]} == live["tables"]
    assert not eng.has_unfinished_requests(), "the run does not finish"
    num_blocks = eng.kv_cache_manager.num_blocks
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1, "a block leaked"
