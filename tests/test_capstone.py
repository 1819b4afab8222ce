"""Mutation tests for the capstone (a whole block manager) and the bug hunt."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from kvlab.exercises import check


class ManagerOk:
    """A correct manager, written differently from the solution notebook's: a doubly linked
    free list over arrays, and a map hash -> list of block ids."""

    def __init__(self, num_blocks):
        n = num_blocks
        self.ref = [0] * n
        self.hash = [None] * n
        self.prev = [None] * (n + 2)
        self.next = [None] * (n + 2)
        self.H, self.T = n, n + 1  # sentinels
        self.next[self.H], self.prev[self.T] = self.T, self.H
        self.num_free_blocks = 0
        self.map = {}
        for b in range(1, n):
            self._insert_before(self.T, b)

    def _insert_before(self, at, b):
        p = self.prev[at]
        self.next[p], self.prev[b], self.next[b], self.prev[at] = b, p, at, b
        self.num_free_blocks += 1

    def _unlink(self, b):
        p, q = self.prev[b], self.next[b]
        self.next[p], self.prev[q] = q, p
        self.prev[b] = self.next[b] = None
        self.num_free_blocks -= 1

    def free_block_ids(self):
        out, b = [], self.next[self.H]
        while b != self.T:
            out.append(b)
            b = self.next[b]
        return out

    def allocate(self, n):
        out = []
        for _ in range(n):
            b = self.next[self.H]
            self._unlink(b)
            h = self.hash[b]
            if h is not None:
                self.map[h].remove(b)
                if not self.map[h]:
                    del self.map[h]
                self.hash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                self._unlink(b)
            self.ref[b] += 1

    def free(self, ids):
        first = self.next[self.H]
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self._insert_before(first, b)  # keeps the given order at the head
                else:
                    self._insert_before(self.T, b)

    def cache(self, b, h):
        self.hash[b] = h
        self.map.setdefault(h, []).append(b)

    def lookup(self, h):
        ids = self.map.get(h)
        return ids[0] if ids else None


class _Od(ManagerOk):
    """Base for the wrong answers: an OrderedDict queue, easy to break one rule at a time."""

    def __init__(self, num_blocks):
        self.ref = [0] * num_blocks
        self.hash = [None] * num_blocks
        self.q = OrderedDict.fromkeys(range(1, num_blocks))
        self.map = {}

    @property
    def num_free_blocks(self):
        return len(self.q)

    def free_block_ids(self):
        return list(self.q)

    def evict(self, b):
        h = self.hash[b]
        if h is not None:
            del self.map[h][b]
            if not self.map[h]:
                del self.map[h]
            self.hash[b] = None

    def allocate(self, n):
        out = []
        for _ in range(n):
            b, _ = self.q.popitem(last=False)
            self.evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                del self.q[b]
            self.ref[b] += 1

    def free(self, ids):
        head = []
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    head.append(b)
                else:
                    self.q[b] = None
        for b in reversed(head):
            self.q[b] = None
            self.q.move_to_end(b, last=False)

    def cache(self, b, h):
        self.hash[b] = h
        self.map.setdefault(h, {})[b] = None

    def lookup(self, h):
        d = self.map.get(h)
        return next(iter(d)) if d else None


class LIFO(_Od):
    def allocate(self, n):
        out = []
        for _ in range(n):
            b, _ = self.q.popitem(last=True)
            self.evict(b)
            self.ref[b] = 1
            out.append(b)
        return out


class NoEvict(_Od):
    def evict(self, b):
        pass


class ForgetsHashOnly(_Od):
    """Drops the map entry, keeps the block's hash: a later free puts it at the tail."""

    def evict(self, b):
        h = self.hash[b]
        if h is not None and b in self.map.get(h, {}):
            del self.map[h][b]
            if not self.map[h]:
                del self.map[h]


class Overwrites(_Od):
    def cache(self, b, h):
        self.hash[b] = h
        self.map[h] = {b: None}  # the older copy is forgotten


class EvictsAllCopies(_Od):
    def evict(self, b):
        h = self.hash[b]
        if h is not None:
            self.map.pop(h, None)
            self.hash[b] = None


class AllToTail(_Od):
    """vLLM <= 0.22: every freed block appended."""

    def free(self, ids):
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.q[b] = None


class PrependsOneByOne(_Od):
    """Hashless blocks prepended one at a time: their order comes out reversed."""

    def free(self, ids):
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.q[b] = None
                if self.hash[b] is None:
                    self.q.move_to_end(b, last=False)


class TouchNoRemove(_Od):
    def touch(self, ids):
        for b in ids:
            self.ref[b] += 1


class IgnoresRefCount(_Od):
    def free(self, ids):
        for b in ids:
            self.ref[b] = max(0, self.ref[b] - 1)
        head = [b for b in ids if self.hash[b] is None]
        for b in ids:
            if self.hash[b] is not None:
                self.q[b] = None
        for b in reversed(head):
            self.q[b] = None
            self.q.move_to_end(b, last=False)


class NewestDuplicate(_Od):
    def lookup(self, h):
        d = self.map.get(h)
        return next(reversed(d)) if d else None


class ListQueue(_Od):
    """Right order, but a Python list: remove() searches."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.q = list(range(1, num_blocks))

    def free_block_ids(self):
        return list(self.q)

    def allocate(self, n):
        out = []
        for _ in range(n):
            b = self.q.pop(0)
            self.evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                self.q.remove(b)
            self.ref[b] += 1

    def free(self, ids):
        head = []
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    head.append(b)
                else:
                    self.q.append(b)
        self.q[:0] = head


class NullHandedOut(_Od):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.q = OrderedDict.fromkeys(range(num_blocks))


class NoReturn(_Od):
    def allocate(self, n):
        super().allocate(n)


WRONG = {
    "pops the tail (LIFO)": (LIFO, "pops the head of the free queue"),
    "never evicts (stale hash)": (NoEvict, "its old hash must leave the map"),
    "drops the entry but keeps the hash": (ForgetsHashOnly, "without a hash go to the HEAD"),
    "duplicate overwritten": (Overwrites, "keep both -- duplicates"),
    "eviction drops every copy": (EvictsAllCopies, "remove by (hash, block id)"),
    "every freed block to the tail (vLLM <= 0.22)": (AllToTail, "without a hash go to the HEAD"),
    "hashless blocks prepended one by one": (PrependsOneByOne, "in the order given"),
    "touch leaves the block on the queue": (TouchNoRemove, "takes it off BEFORE counting it"),
    "free ignores the ref count": (IgnoresRefCount, "ref_cnt reaches 0"),
    "lookup returns the newest duplicate": (NewestDuplicate, "cached first"),
    "a list as the queue (O(n) remove)": (ListQueue, "not O(1)"),
    "hands out the null block": (NullHandedOut, "null block"),
    "allocate forgets to return": (NoReturn, "a missing return?"),
}


def test_capstone_accepts_two_different_correct_managers():
    res = check("block_manager", ManagerOk)
    assert res, str(res)
    assert "48 preemptions" in res.message and "same event log" in res.message


@pytest.mark.parametrize("name", sorted(WRONG))
def test_capstone_rejects_classic_mistakes_with_the_rule(name):
    cls, words = WRONG[name]
    res = check("block_manager", cls)
    assert not res and not res.not_implemented, f"{name} passed"
    assert words in str(res), str(res)


def test_capstone_says_where_it_diverged():
    res = check("block_manager", AllToTail)
    assert res.case.startswith("vLLM's prefill story (test_prefill) · free([4, 3, 2, 1]) of req0"), res.case
    assert res.expected == "[4, 6, 7, 8, 9, 10] (head first)" and res.got == "[6, 7, 8, 9, 10, 4]"
    res = check("block_manager", NewestDuplicate)
    assert res.case.startswith("duplicate blocks"), res.case


def test_capstone_wants_the_class():
    res = check("block_manager", ManagerOk(4))
    assert not res and "pass the class itself" in res.message


def test_capstone_replay_is_the_learners_run():
    res = check("block_manager", ManagerOk)
    from kvlab.exercises.checks_capstone import run_storm

    assert res.extra["storm_log"].to_json() == run_storm().events.to_json()


# --- the bug hunt -------------------------------------------------------------------------------
from kvlab.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from kvlab.exercises.bug_hunt import INCIDENTS, SUSPECTS, OneBlockPerHash, incident, suspect_code  # noqa: E402

RIGHT = {1: "stale_hash", 2: "full_hit_crash", 3: "duplicate_overwritten"}


def test_bug_hunt_accepts_the_right_diagnosis_only():
    assert check("bug_hunt", dict(RIGHT))
    wrong = 0
    for n in RIGHT:
        for name in SUSPECTS:
            if name == RIGHT[n]:
                continue
            res = check("bug_hunt", {**RIGHT, n: name})
            assert not res and res.case == f"incident {n}" and res.idea, (n, name, str(res))
            wrong += 1
    assert wrong == 12  # every wrong name of every incident is refused, each with what rules it out


@pytest.mark.parametrize(
    "answers,words",
    [
        ([1, 2, 3], "must be a dict"),
        ({1: "stale_hash", 2: "full_hit_crash"}, "no answer for incident 3"),
        ({**RIGHT, 2: "crash"}, "is not a suspect"),
    ],
)
def test_bug_hunt_refuses_malformed_answers(answers, words):
    res = check("bug_hunt", answers)
    assert not res and words in res.message


def test_incidents_show_their_symptoms_and_replay():
    from kvlab.viz.player import Player

    one, two, three = (incident(n) for n in (1, 2, 3))
    assert one.facts["c_cached_tokens"] == 8 and "BlockEvicted" not in {type(e).__name__ for e in one.log if e.step == 2}
    assert two.error.startswith("RuntimeError: the engine made no progress")
    assert three.facts["c_cached_tokens"] == 4
    for inc in (one, two, three):
        p = inc.show()
        assert isinstance(p, Player) and p.step == inc.named_steps[inc.start]
        for s in range(p.timeline.last_step + 1):
            p.go_to(s)  # every step draws
    assert "self._cache[key] = block" in suspect_code("duplicate_overwritten")
    assert suspect_code("forward_free_order").endswith("not planted in any incident")
    with pytest.raises(ValueError, match="number must be one of"):
        incident(4)
    assert set(RIGHT.values()) == {truth for _, truth in INCIDENTS.values()}


class MapOk(OneBlockPerHash):
    """Always a dict once inserted through insert(); bare blocks (the pool's fast path) handled."""

    def insert(self, key, block):
        v = self._cache.get(key)
        d = {} if v is None else ({v.block_id: v} if isinstance(v, KVCacheBlock) else v)
        d[block.block_id] = block
        self._cache[key] = d

    def pop(self, key, block_id):
        v = self._cache.get(key)
        if v is None:
            return None
        if isinstance(v, KVCacheBlock):
            if v.block_id != block_id:
                return None
            del self._cache[key]
            return v
        blk = v.pop(block_id, None)
        if not v:
            del self._cache[key]
        return blk


class MapNewestFirst(MapOk):
    def insert(self, key, block):
        v = self._cache.get(key)
        d = {} if v is None else ({v.block_id: v} if isinstance(v, KVCacheBlock) else v)
        self._cache[key] = {block.block_id: block, **d}


class MapPopsAll(MapOk):
    def pop(self, key, block_id):
        v = self._cache.pop(key, None)
        return v if isinstance(v, KVCacheBlock) else (None if v is None else v.get(block_id))


class MapSkipsDuplicates(MapOk):
    """kvcached #401's variant: the second block is simply not recorded."""

    def insert(self, key, block):
        self._cache.setdefault(key, block)


class MapKeepsEmptyKeys(MapOk):
    def pop(self, key, block_id):
        v = self._cache.get(key)
        if isinstance(v, KVCacheBlock):
            if v.block_id == block_id:
                self._cache[key] = {}
                return v
            return None
        return None if v is None else v.pop(block_id, None)


class MapPopReturnsNothing(MapOk):
    def pop(self, key, block_id):
        super().pop(key, block_id)


FIX_WRONG = {
    "no fix at all": (OneBlockPerHash, "expected [1, 4]"),
    "newest copy first": (MapNewestFirst, "oldest first"),
    "pop drops every copy": (MapPopsAll, "other blocks under the key stay"),
    "skips duplicates (kvcached #401)": (MapSkipsDuplicates, "keep every block"),
    "keeps empty keys": (MapKeepsEmptyKeys, "must leave the map"),
    "pop returns nothing": (MapPopReturnsNothing, "must return the removed block"),
}


def test_bug_fix_accepts_a_different_correct_map():
    res = check("bug_fix", MapOk)
    assert res, str(res)


@pytest.mark.parametrize("name", sorted(FIX_WRONG))
def test_bug_fix_rejects_wrong_fixes(name):
    cls, words = FIX_WRONG[name]
    res = check("bug_fix", cls)
    assert not res and words in str(res), str(res)


@pytest.mark.parametrize("eid", ["block_manager", "bug_fix", "bug_hunt"])
def test_stubs_are_reported_as_not_implemented(eid):
    class Stub:
        def __init__(self, *a):
            raise NotImplementedError

        def insert(self, *a):
            raise NotImplementedError

    def stub():
        raise NotImplementedError

    res = check(eid, stub if eid == "bug_hunt" else Stub)
    assert not res and res.not_implemented, str(res)


def test_capstone_and_fix_run_inside_the_core():
    """The learner's calls come from kvlab/core (the pool's seam), nothing patched."""
    import inspect

    calls = []

    class Spy(ManagerOk):
        def allocate(self, n):
            calls.append(any("/kvlab/core/" in f.filename.replace("\\", "/") for f in inspect.stack()[1:]))
            return super().allocate(n)

    assert check("block_manager", Spy) and len(calls) > 10 and all(calls[:10])  # the scale test calls it directly after
    from kvlab.core.block_pool import BlockHashToBlockMap, BlockPool

    assert (
        BlockPool.get_new_blocks.__module__ == "kvlab.core.block_pool" and BlockHashToBlockMap.insert.__module__ == "kvlab.core.block_pool"
    )
