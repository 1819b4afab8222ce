"""Property tests: random request traffic against a small pool, checked after every step.

A Hypothesis state machine plays scheduler: it adds requests (prefixes drawn from a few
shared ones, so hits happen; salts and LoRA names sometimes), admits them with a prefix
lookup and a chunk of their prompt, continues prefills, decodes (appends a token, asks for
a slot, sometimes with lookahead slots), preempts when a running request cannot grow,
finishes requests and resets the cache. The pool is small, so allocations fail and cached
blocks get evicted. Layouts: one full-attention group, one sliding-window group, and the
hybrid ones (full + sliding window, two full groups, SW + full + SW).

After every step: ``check_invariants()`` plus a model kept here, independent of the code
under test -- every ref count, and the free queue in exact eviction order (hits leave it,
allocations pop its head group by group, frees put uncached blocks at the head and cached
ones at the tail, a table tail first, sliding-window drops highest position first). Per
operation: a lookup changes nothing and returns the longest valid hit (recomputed by brute
force from the map), never the last token; an allocation fails exactly when the blocks it
needs exceed the free ones, and then changes nothing; a successful one leaves
cdiv(slots, block_size) blocks in every table; every computed full block carries the
request's hash for that position and every other block none.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvlab import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec

ALPHABET = st.integers(0, 3)  # few distinct tokens: prompts and decoded text collide often
MAX_TOKENS = 24
LOOKAHEAD = st.sampled_from([0, 0, 0, 0, 1, 3])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CoreMachine(RuleBasedStateMachine):
    LAYOUTS: tuple[str, ...] = ()

    @initialize(
        data=st.data(),
        block_size=st.sampled_from([2, 4, 4]),
        num_blocks=st.integers(4, 16),  # per group
        window=st.integers(2, 9),
        hash_algo=st.sampled_from(["sha256", "sha256", "xxhash"]),
        prefixes=st.lists(st.lists(ALPHABET, min_size=2, max_size=16), min_size=1, max_size=3),
    )
    def setup(self, data, block_size, num_blocks, window, hash_algo, prefixes):
        name = data.draw(st.sampled_from(self.LAYOUTS), label="layout")
        sw = SlidingWindowSpec(sliding_window=window)
        groups = {
            "full": [FullAttentionSpec()],
            "sw": [sw],
            "full+full": [FullAttentionSpec(), FullAttentionSpec()],
            "full+sw": [FullAttentionSpec(), sw],
            "sw+full+sw": [sw, FullAttentionSpec(), sw],
        }[name]
        self.bs = block_size
        self.window = window
        num_blocks *= len(groups)
        self.mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, kv_cache_groups=groups, hash_algo=hash_algo)
        self.coord = self.mgr.coordinator
        self.is_sw = [isinstance(g, SlidingWindowSpec) for g in groups]
        self.suffixes = [gid.to_bytes(4, "big") for gid in range(len(groups))]
        self.prefixes = prefixes
        self.history: list[tuple[list[int], str | None, str | None]] = []  # finished requests' text
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.n = 0
        self.stats = [0, 0, 0, 0]  # queries, hits, preempted queries, preempted hits
        self.reset_pending = False
        self.prev_computed: dict[str, int] = {}  # num_computed_tokens seen by the last allocate_slots
        self.slots: dict[str, int] = {}  # tokens the request's tables have room for
        self.pad: dict[str, int] = {}  # null blocks the prefix hit put on the left (sliding window)
        # the model: free queue (head first) and ref counts
        self.q: list[int] = list(range(1, num_blocks))
        self.refs = [0] * num_blocks

    # -- the model ----------------------------------------------------------------------------
    def model_touch(self, hits) -> None:
        for blocks in hits:
            for b in blocks:
                if b.is_null:
                    continue
                if self.refs[b.block_id] == 0:
                    self.q.remove(b.block_id)
                self.refs[b.block_id] += 1

    def model_alloc(self, new_blocks) -> None:
        for blocks in new_blocks:  # group by group, each from the head
            got = [b.block_id for b in blocks]
            assert got == self.q[: len(got)], (got, self.q)
            del self.q[: len(got)]
            for bid in got:
                self.refs[bid] += 1

    def model_free(self, ordered) -> None:
        head, tail = [], []
        for b in ordered:
            if b.is_null:
                continue
            assert self.refs[b.block_id] > 0
            self.refs[b.block_id] -= 1
            if self.refs[b.block_id] == 0:
                (tail if b.block_hash is not None else head).append(b.block_id)
        self.q = head + self.q + tail

    def state(self):
        pool = self.mgr.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            sorted((k, tuple(b.block_id for b in v)) for k, v in pool.cached_block_hash_to_block.items()),
            [{r: [b.block_id for b in t] for r, t in m.req_to_blocks.items()} for m in self.coord.single_type_managers],
            [dict(m.num_cached_block) for m in self.coord.single_type_managers],
        )

    def cached(self, req: Request, i: int, gids) -> bool:
        m = self.mgr.block_pool.cached_block_hash_to_block
        return all(req.block_hashes[i] + self.suffixes[g] in m for g in gids)

    def expected_hit_blocks(self, req: Request) -> int:
        """Brute force: full groups need every block from 0; SW groups need the last
        cdiv(W - 1, bs) blocks before the hit end (all of them, if the hit is shorter)."""
        full = [g for g, s in enumerate(self.is_sw) if not s]
        sw = [g for g, s in enumerate(self.is_sw) if s]
        limit = (req.num_tokens - 1) // self.bs
        if full:
            f = 0
            while f < limit and self.cached(req, f, full):
                f += 1
            limit = f
        if not sw:
            return limit
        need = cdiv(self.window - 1, self.bs)
        for length in range(limit, 0, -1):
            if all(self.cached(req, i, sw) for i in range(max(0, length - need), length)):
                return length
        return 0

    def pick(self, data, pool: list):
        return pool[data.draw(st.integers(0, len(pool) - 1), label="which")]

    def check_table(self, req: Request) -> None:
        rid = req.request_id
        tables = self.coord.get_blocks(rid)
        num_full = req.num_computed_tokens // self.bs
        skipped = max(0, self.prev_computed[rid] - self.window + 1) // self.bs
        for g, table in enumerate(tables):
            assert len(table) == cdiv(self.slots[rid], self.bs), (g, len(table), self.slots[rid])
            nulls = [b.is_null for b in table]
            if self.is_sw[g]:
                k = nulls.count(True)
                assert nulls == [True] * k + [False] * (len(table) - k), "nulls must form a prefix"
                # exactly the blocks no query can read any more (or the hit's padding) are null
                assert k == max(self.pad[rid], skipped), (k, self.pad[rid], skipped)
            else:
                assert not any(nulls)
            for i, b in enumerate(table):
                if b.is_null:
                    continue
                if i < num_full:
                    assert b.block_hash == req.block_hashes[i] and b.cache_key == req.block_hashes[i] + self.suffixes[g]
                else:
                    assert b.block_hash is None, "only computed full blocks are cached"

    def preempt(self, req: Request) -> None:
        for table in self.coord.get_blocks(req.request_id):
            self.model_free(list(reversed(table)))
        self.mgr.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.insert(0, req)

    # -- rules --------------------------------------------------------------------------------
    @precondition(lambda self: len(self.waiting) + len(self.running) < 5)
    @rule(
        data=st.data(),
        salt=st.sampled_from([None] * 8 + ["s1", "s2"]),
        lora=st.sampled_from([None] * 9 + ["l1"]),
        suffix=st.lists(ALPHABET, max_size=6),
        follow_up=st.booleans(),
    )
    def add_request(self, data, salt, lora, suffix, follow_up):
        """A prompt from one of the shared prefixes, or (like the next turn of a chat) the
        whole text of an earlier request, generated tokens included, plus a few tokens."""
        if follow_up and self.history:
            prefix, salt, lora = self.pick(data, self.history)
        else:
            prefix = self.pick(data, self.prefixes)
        cut = data.draw(st.integers(0, len(prefix)), label="prefix length")
        tokens = (prefix[:cut] + suffix) or [0]
        self.n += 1
        self.waiting.append(Request(f"r{self.n}", tokens, cache_salt=salt, lora_name=lora))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), lookahead=LOOKAHEAD)
    def admit(self, data, lookahead):
        req = self.pick(data, self.waiting)
        before = self.state()
        hits, n = self.mgr.get_computed_blocks(req)
        assert self.state() == before, "a lookup must not change the pool"
        self.mgr.record_prefix_cache_stats(req, n)  # the test is the scheduler: it records
        pre = req.num_preemptions > 0
        self.stats[2 * pre] += req.num_tokens
        self.stats[2 * pre + 1] += n
        assert len(req.block_hashes) == req.num_tokens // self.bs
        assert n <= req.num_tokens - 1 and n % self.bs == 0
        assert n == self.expected_hit_blocks(req) * self.bs
        for g, blocks in enumerate(hits.blocks):
            assert len(blocks) == n // self.bs
            for i, b in enumerate(blocks):
                if b.is_null:
                    assert self.is_sw[g]
                else:
                    assert b.block_hash == req.block_hashes[i] and b.cache_key == req.block_hashes[i] + self.suffixes[g]
        chunk = data.draw(st.integers(1, req.num_tokens - n), label="chunk")
        free = self.mgr.block_pool.get_num_free_blocks()
        slots = n + chunk + lookahead
        need = sum(
            cdiv(slots, self.bs) - len(blocks) + sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null) for blocks in hits.blocks
        )
        new = self.mgr.allocate_slots(req, chunk, n, hits, num_lookahead_tokens=lookahead)
        if new is None:
            assert need > free
            assert self.state() == before, "a failed allocation must change nothing"
            return
        assert need <= free and self.mgr.block_pool.get_num_free_blocks() == free - need
        self.model_touch(hits.blocks)
        self.model_alloc(new.blocks)
        rid = req.request_id
        req.num_computed_tokens = n + chunk
        self.prev_computed[rid] = 0
        self.slots[rid] = slots
        self.pad[rid] = max((sum(b.is_null for b in blocks) for blocks in hits.blocks), default=0)
        self.waiting.remove(req)
        self.running.append(req)
        for g, blocks in enumerate(hits.blocks):  # the hits are the head of the table
            assert self.coord.get_blocks(rid)[g][: len(blocks)] == blocks

    @precondition(lambda self: self.running)
    @rule(data=st.data(), lookahead=LOOKAHEAD)
    def advance(self, data, lookahead):
        """Next prefill chunk, or one decode step (sample a token, then ask for its slot)."""
        req = self.pick(data, self.running)
        if req.num_computed_tokens < req.num_tokens:
            chunk = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens), label="chunk")
        else:
            req.append_output_token_ids(data.draw(ALPHABET, label="token"))
            chunk = 1
        assert len(req.block_hashes) == req.num_tokens // self.bs
        rid = req.request_id
        # Blocks that left the window are freed even if the allocation then fails (as in
        # vLLM). Do that first, so the snapshot below isolates what the allocation does.
        tables = [list(t) for t in self.coord.get_blocks(rid)]
        self.coord.remove_skipped_blocks(rid, req.num_computed_tokens)
        for old, now in zip(tables, self.coord.get_blocks(rid)):
            self.model_free([a for a, b in reversed(list(zip(old, now))) if b.is_null and not a.is_null])
        self.prev_computed[rid] = req.num_computed_tokens
        before = self.state()
        free = self.mgr.block_pool.get_num_free_blocks()
        total = req.num_computed_tokens + chunk
        need = sum(max(0, cdiv(total + lookahead, self.bs) - len(t)) for t in self.coord.get_blocks(rid))
        new = self.mgr.allocate_slots(req, chunk, num_lookahead_tokens=lookahead)
        if new is None:
            assert need > free
            assert self.state() == before, "a failed allocation must change nothing"
            self.preempt(req)  # by recompute: all blocks freed, back to the head of the queue
            return
        assert need <= free and self.mgr.block_pool.get_num_free_blocks() == free - need
        self.model_alloc(new.blocks)
        req.num_computed_tokens = total
        self.slots[rid] = max(self.slots[rid], total + lookahead)
        if req.num_tokens >= MAX_TOKENS:
            self.finish_request(req)

    def finish_request(self, req: Request) -> None:
        for table in self.coord.get_blocks(req.request_id):
            self.model_free(list(reversed(table)))
        self.mgr.free(req)
        assert all(not t for t in self.coord.get_blocks(req.request_id))
        self.running.remove(req)
        self.history = self.history[-4:] + [(list(req.all_token_ids), req.cache_salt, req.lora_name)]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_request(self.pick(data, self.running))

    @rule(data=st.data(), dice=st.integers(0, 3))
    def pressure(self, data, dice):
        """A request with a never-seen prompt takes k blocks per group, then finishes:
        the k oldest free blocks are evicted, which leaves gaps in cached chains."""
        groups = len(self.is_sw)
        if dice or self.mgr.block_pool.get_num_free_blocks() < groups:
            return
        k = data.draw(st.integers(1, self.mgr.block_pool.get_num_free_blocks() // groups), label="blocks")
        self.n += 1
        req = Request(f"p{self.n}", [100 + self.n] * (k * self.bs))  # a token no other prompt has
        hits, n = self.mgr.get_computed_blocks(req)
        self.mgr.record_prefix_cache_stats(req, n)
        self.stats[0] += req.num_tokens
        self.stats[1] += n
        assert n == 0
        new = self.mgr.allocate_slots(req, req.num_tokens)
        self.model_alloc(new.blocks)
        for table in self.coord.get_blocks(req.request_id):
            self.model_free(list(reversed(table)))
        self.mgr.free(req)

    @rule(dice=st.integers(0, 15))
    def housekeeping(self, dice):
        """Rarely a cache reset (it wipes every hit the other rules worked for); sometimes
        the stats are collected; sometimes the oldest waiting request is dropped (too big)."""
        if dice == 0:
            before = self.state()
            ok = self.mgr.reset_prefix_cache()
            assert ok == (not self.running)
            if ok:
                self.reset_pending = True
                assert len(self.mgr.block_pool.cached_block_hash_to_block) == 0
                assert all(b.block_hash is None for b in self.mgr.block_pool.blocks)
            else:
                assert self.state() == before
        elif dice < 8:
            s = self.mgr.make_prefix_cache_stats()
            assert [s.queries, s.hits, s.preempted_queries, s.preempted_hits] == self.stats
            assert s.reset == self.reset_pending
            self.stats = [0, 0, 0, 0]
            self.reset_pending = False
        elif dice < 11 and self.waiting:
            self.waiting.pop(0)

    # -- after every step ---------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.mgr.check_invariants()
        pool = self.mgr.block_pool
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == self.q
        assert [b.ref_cnt for b in pool.blocks[1:]] == self.refs[1:]
        held = pool.num_gpu_blocks - 1 - len(self.q)
        assert abs(self.mgr.usage - held / (pool.num_gpu_blocks - 1)) < 1e-12
        for r in self.running:
            self.check_table(r)
        for r in self.waiting:
            assert all(not t for t in self.coord.get_blocks(r.request_id))


class FullAttentionMachine(CoreMachine):
    LAYOUTS = ("full",)


class SlidingWindowMachine(CoreMachine):
    LAYOUTS = ("sw",)


class HybridMachine(CoreMachine):
    LAYOUTS = ("full+sw", "sw+full+sw", "full+full")


TestFullAttention = FullAttentionMachine.TestCase
TestSlidingWindow = SlidingWindowMachine.TestCase
TestHybrid = HybridMachine.TestCase
