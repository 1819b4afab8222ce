"""Property tests across mixed KV-cache groups: any mix of full attention, MLA, windows,
chunked local attention and Mamba states, of one or several block sizes.

After every step: ``check_invariants()`` (every ref count = the tables holding the block, the
free queue, the hash map), each table covers its request's computed tokens, a full-attention
table holds no null block, a hit is a multiple of the scheduler block size below the
request's length and every group's hit covers it exactly, a refused allocation of a new
request changes nothing, and the event log replays to the live pool.
"""

from __future__ import annotations


from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab import (
    ChunkedLocalAttentionSpec,
    EventLog,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    MLAAttentionSpec,
    Request,
    SlidingWindowSpec,
)
from kvlab.timeline.snapshot import live_snapshot
from kvlab.timeline.state import ReplayState

LAYOUTS = {
    "windows": [FullAttentionSpec(), SlidingWindowSpec(sliding_window=3), SlidingWindowSpec(sliding_window=9)],
    "window of one": [FullAttentionSpec(), SlidingWindowSpec(sliding_window=1)],
    "chunked": [FullAttentionSpec(), ChunkedLocalAttentionSpec(attention_chunk_size=8)],
    "mla+window": [MLAAttentionSpec(), SlidingWindowSpec(sliding_window=6)],
    "mamba": [FullAttentionSpec(), MambaSpec()],
    "block sizes": [FullAttentionSpec(), SlidingWindowSpec(sliding_window=3), SlidingWindowSpec(sliding_window=20, block_size=12)],
    "everything": [
        FullAttentionSpec(),
        SlidingWindowSpec(sliding_window=5),
        ChunkedLocalAttentionSpec(attention_chunk_size=8),
        MambaSpec(),
    ],
    "windows only": [SlidingWindowSpec(sliding_window=6), SlidingWindowSpec(sliding_window=2)],
    # Blocks of 8 hashed every 4 tokens (prefix_match_unit): hits may end inside a block, whose
    # copy the request then writes (vLLM 0.33's copy-on-write).
    "mamba, hits inside blocks": [FullAttentionSpec(block_size=8), MambaSpec(block_size=8)],
}
PREFIX_MATCH_UNIT = {"mamba, hits inside blocks": 4}
BASES = [[(7 * i + k) % 50 for i in range(60)] for k in range(3)]


class MixedGroupsMachine(RuleBasedStateMachine):
    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        num_blocks=st.integers(12, 48),
        eagle=st.booleans(),
        caching=st.booleans(),
        in_flight=st.sampled_from([None, 8]),
    )
    def setup(self, layout, num_blocks, eagle, caching, in_flight):
        if layout in ("chunked", "everything"):
            eagle = False  # vLLM refuses EAGLE with chunked local attention
        self.log = EventLog()
        self.mgr = KVCacheManager(
            num_blocks=num_blocks,
            block_size=4,
            kv_cache_groups=LAYOUTS[layout],
            enable_caching=caching,
            use_eagle=eagle,
            max_in_flight_tokens=in_flight,
            event_log=self.log,
            prefix_match_unit=PREFIX_MATCH_UNIT.get(layout) if caching else None,
        )
        self.running: dict[str, Request] = {}
        self.n = 0
        self.replayed = ReplayState()  # the log replayed so far: each check applies only the new events
        self.num_replayed = 0

    def state(self):
        pool = self.mgr.block_pool
        return (
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [b.ref_cnt for b in pool.blocks],
            [b.cache_key for b in pool.blocks],
        )

    @rule(
        base=st.integers(0, 2),
        length=st.integers(1, 60),
        tail=st.lists(st.integers(50, 60), max_size=6),
        chunk=st.integers(1, 64),
        ext=st.integers(0, 20),
        lookahead=st.sampled_from([0, 0, 3]),
        gate=st.booleans(),
    )
    def admit(self, base, length, tail, chunk, ext, lookahead, gate):
        self.n += 1
        r = Request(f"r{self.n}", BASES[base][:length] + tail)
        before = self.state()
        hits, n = self.mgr.get_computed_blocks(r)
        assert self.state() == before, "a lookup changes nothing"
        m = self.mgr
        partial = m.coordinator.enable_partial_hash_hits
        if n:
            assert n % (m.hash_block_size if partial else m.scheduler_block_size) == 0 and n <= r.num_tokens - 1
        for spec, g in zip(m.kv_cache_groups, hits.blocks):
            assert len(g) == -(-n // spec.block_size) if partial else len(g) * spec.block_size == n or (not n and not g)
        ext = min(ext, r.num_tokens - n - 1)
        chunk = min(chunk, r.num_tokens - n - ext)
        out = m.allocate_slots(
            r, chunk, n, hits, num_lookahead_tokens=lookahead, num_external_computed_tokens=ext, full_sequence_must_fit=gate
        )
        if out is None:
            assert self.state() == before, "a refused allocation changes nothing"
            return
        r.num_computed_tokens = n + ext + chunk
        self.running[r.request_id] = r

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 16), token=st.integers(0, 60))
    def step(self, data, chunk, token):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running[rid]
        if r.num_computed_tokens >= r.num_tokens:
            r.append_output_token_ids([token])
        chunk = min(chunk, r.num_tokens - r.num_computed_tokens)
        if self.mgr.allocate_slots(r, chunk) is None:
            self.mgr.free(r)  # preempted
            del self.running[rid]
        else:
            r.num_computed_tokens += chunk

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.mgr.free(self.running.pop(rid))

    @rule()
    def new_step(self):
        """What a scheduler does at a step: the copies go to the runner, their blocks are let go."""
        copies, retained = self.mgr.take_kv_cache_block_copies()
        assert len(retained) == 2 * len(copies)
        self.mgr.block_pool.free_blocks(retained, reason="copied")
        self.mgr.new_step_starts()

    @invariant()
    def consistent(self):
        m = self.mgr
        m.check_invariants()
        for r in self.running.values():
            for spec, table in zip(m.kv_cache_groups, m.get_block_ids(r.request_id)):
                assert len(table) * spec.block_size >= r.num_computed_tokens
                if isinstance(spec, FullAttentionSpec):
                    assert 0 not in table
        events = self.log.events
        if len(events) < self.num_replayed:  # cut back (nothing here does; then replay afresh)
            self.replayed, self.num_replayed = ReplayState(), 0
        for e in events[self.num_replayed :]:
            self.replayed.apply(e)
        self.num_replayed = len(events)
        snap, live = self.replayed.snapshot(), live_snapshot(m)
        assert snap.free_queue == live["free_queue"]
        assert [b.ref_cnt for b in snap.blocks] == live["ref_cnt"]
        assert [b.block_hash for b in snap.blocks] == live["hashes"]


TestMixedGroups = MixedGroupsMachine.TestCase
