"""The CPU tier's LRU keeps vLLM 0.33's lazy heap (issue 22): stale entries are skipped by
``evict`` and compacted away, a large re-ranking rebuilds the heap at once. Every heap length
below was read off vLLM 0.33.0's ``LRUCachePolicy`` under the same calls."""

from __future__ import annotations

import random

import pytest

from kvlab.kv_offload.base import ReqContext, make_offload_key
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.cpu.policies.lru import LRUCachePolicy

CTX = ReqContext(req_id="", kv_transfer_params=None)


def _k(i: int) -> bytes:
    return make_offload_key(str(i).encode().ljust(32, b"."), 0)


def _tier(num_chunks: int, keys: list[bytes]) -> tuple[CPUOffloadingManager, LRUCachePolicy]:
    m = CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru", enable_events=False)
    assert m.prepare_store(keys, CTX) is not None
    m.complete_store(keys, CTX)
    policy = m._policy
    assert isinstance(policy, LRUCachePolicy)
    return m, policy


def test_pin_cycles_leave_stale_entries_until_the_heap_is_compacted():
    m, policy = _tier(1, [_k(1)])
    assert len(policy._heap) == 1
    lens = []
    for _ in range(128):
        m.prepare_load([_k(1)], CTX)
        m.complete_load([_k(1)], CTX)
        lens.append(len(policy._heap))
    # one stale entry per unpinning; at 64 entries (the floor) it is rebuilt to the one key
    assert lens[:3] == [2, 3, 4]
    assert lens[60:65] == [62, 63, 1, 2, 3]
    assert lens[-3:] == [1, 2, 3]
    m.check_invariants()
    evicted = policy.evict(1, set())
    assert evicted is not None and [key for key, _ in evicted] == [_k(1)]
    # the other two entries were equal to the one taken; the loop stopped before them
    assert len(policy._heap) == 2 and len(policy) == 0
    policy.check_invariants()


def test_evict_skips_stale_entries_and_compacts_past_twice_the_evictable_keys():
    keys = [_k(i) for i in range(4)]
    m, policy = _tier(4, keys)
    for i in range(100):
        m.prepare_load([keys[i % 4]], CTX)
        m.complete_load([keys[i % 4]], CTX)
    assert len(policy._heap) == 44  # rebuilt to 4 at the 60th unpinning, 40 pushed since
    m.touch([keys[0], keys[1]], CTX)  # keys 0 and 1 become the newest, in that order
    assert len(policy._heap) == 46
    evicted = policy.evict(2, set())
    assert evicted is not None and [key for key, _ in evicted] == [keys[2], keys[3]]
    assert len(policy._heap) == 12  # the stale entries popped on the way are gone
    policy.check_invariants()


def test_a_large_reranking_rebuilds_the_heap_and_a_failed_evict_changes_nothing():
    keys = [_k(i) for i in range(100)]
    _, policy = _tier(100, keys)
    assert len(policy._heap) == 100
    policy.touch(keys[:30], CTX)  # fewer than 64: pushed one by one
    assert len(policy._heap) == 130
    policy.touch(keys, CTX)  # 64 or more: one rebuild
    assert len(policy._heap) == 100
    before = (list(policy._heap), dict(policy._ranks), set(policy._evictable))
    assert policy.evict(3, set(keys[:98])) is None  # only two unprotected
    assert (sorted(policy._heap), policy._ranks, policy._evictable) == (sorted(before[0]), before[1], before[2])
    evicted = policy.evict(2, set(keys[:98]))
    assert evicted is not None and [key for key, _ in evicted] == [keys[99], keys[98]]  # touch ranks the first key newest
    assert len(policy._heap) == 98
    policy.check_invariants()


def test_evict_order_is_the_rank_order_under_random_pins_touches_and_stores():
    """The lazy heap changes how the line is kept, not who leaves: every eviction takes the
    unprotected, unpinned keys of lowest ``(rank, key)`` -- checked against a full sort."""
    rng = random.Random(7)
    m = CPUOffloadingManager(num_chunks=12, cache_policy="lru", enable_events=False)
    policy = m._policy
    assert isinstance(policy, LRUCachePolicy)
    pinned: list[bytes] = []
    evictions = 0
    for step in range(600):
        present = [k for k, c in policy.items() if c.ref_cnt >= 0]
        op = rng.random()
        if op < 0.3:
            want = [_k(rng.randrange(40)) for _ in range(rng.randint(1, 3))]
            want = list(dict.fromkeys(want))
            protected = set(want)
            expected_order = sorted((policy._ranks[k], k) for k in policy._evictable if k not in protected)
            out = m.prepare_store(want, CTX)
            if out is not None:
                evictions += len(out.evicted_keys)
                assert list(out.evicted_keys) == [k for _, k in expected_order[: len(out.evicted_keys)]]
                m.complete_store(out.keys_to_store, CTX)
        elif op < 0.55 and present:
            key = rng.choice(present)
            m.prepare_load([key], CTX)
            pinned.append(key)
        elif op < 0.8 and pinned:
            m.complete_load([pinned.pop(rng.randrange(len(pinned)))], CTX)
        elif present:
            m.touch(rng.sample(present, min(len(present), rng.randint(1, 4))), CTX)
        m.check_invariants()
        assert len(policy._heap) < max(64, 2 * len(policy._evictable)) + 1, step
    assert evictions > 50  # the workload did evict, many times


def test_check_invariants_names_an_evictable_key_missing_from_the_heap():
    keys = [_k(i) for i in range(3)]
    m, policy = _tier(3, keys)
    policy._heap = [e for e in policy._heap if e[1] != keys[1]]
    with pytest.raises(AssertionError, match="without a current heap entry"):
        m.check_invariants()
