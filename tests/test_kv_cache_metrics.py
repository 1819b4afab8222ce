"""KVCacheMetricsCollector: vLLM's sampled block residency (vllm/v1/core/kv_cache_metrics.py),
driven by a clock we control."""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, KVCacheMetricsCollector, Request, Timeline, build_engine
from kvlab.metrics.stats import KVCacheEvictionEvent


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def lookup_and_allocate(mgr, req):
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    req.num_computed_tokens = req.num_tokens


def test_lifetime_idle_and_reuse_gaps_of_one_block():
    clock = Clock()
    col = KVCacheMetricsCollector(sample_rate=1.0, clock=clock)
    mgr = KVCacheManager(num_blocks=3, block_size=4, metrics_collector=col)
    a = Request("a", [1, 2, 3, 4, 5])  # block 1 full (cached), block 2 partial
    lookup_and_allocate(mgr, a)  # t=0: blocks 1, 2 born
    mgr.free(a)
    for t, rid in [(2.0, "b"), (5.0, "c"), (6.5, "d")]:  # three prefix hits on block 1
        clock.t = t
        r = Request(rid, [1, 2, 3, 4, 9])
        lookup_and_allocate(mgr, r)
        mgr.free(r)
    clock.t = 10.0
    lookup_and_allocate(mgr, Request("e", list(range(20, 28))))  # needs both blocks: pops 2, then 1
    E = KVCacheEvictionEvent
    assert col.drain_events() == [
        # block 2 (the partial one, no hash) goes back to the queue head after every request
        # and is the next allocation: each reuse ends one residency, idle since its birth.
        E(lifetime_seconds=2.0, idle_seconds=2.0, reuse_gaps_seconds=()),
        E(lifetime_seconds=3.0, idle_seconds=3.0, reuse_gaps_seconds=()),
        E(lifetime_seconds=1.5, idle_seconds=1.5, reuse_gaps_seconds=()),
        E(lifetime_seconds=3.5, idle_seconds=3.5, reuse_gaps_seconds=()),
        # block 1: born at 0, hit at 2, 5 and 6.5, evicted at 10
        E(lifetime_seconds=10.0, idle_seconds=3.5, reuse_gaps_seconds=(3.0, 1.5)),
    ]
    assert col.drain_events() == []


def test_only_the_last_four_accesses_are_kept():
    clock = Clock()
    col = KVCacheMetricsCollector(sample_rate=1.0, clock=clock)
    mgr = KVCacheManager(num_blocks=3, block_size=2, metrics_collector=col)
    a = Request("a", [7, 7, 1])  # block 1 = [7, 7] gets cached
    lookup_and_allocate(mgr, a)
    mgr.free(a)
    for k, t in enumerate([1, 3, 6, 10, 15, 21]):  # six prefix hits on block 1
        clock.t = t
        r = Request(f"h{k}", [7, 7, 2])
        lookup_and_allocate(mgr, r)
        mgr.free(r)
    col.on_block_evicted(mgr.block_pool.blocks[1])
    ev = col.drain_events()[-1]
    assert ev.reuse_gaps_seconds == (4.0, 5.0, 6.0)  # the ring keeps accesses 6, 10, 15, 21
    assert ev.idle_seconds == 0.0 and ev.lifetime_seconds == 21.0


def test_sampling_is_seeded_and_reset_forgets_everything():
    def sampled(seed):
        col = KVCacheMetricsCollector(sample_rate=0.3, clock=lambda: 0.0, seed=seed)
        mgr = KVCacheManager(num_blocks=41, block_size=1, metrics_collector=col)
        lookup_and_allocate(mgr, Request("r", list(range(40))))
        return sorted(col.block_metrics), col, mgr

    a, col, mgr = sampled(0)
    assert a == sampled(0)[0] != sampled(1)[0]
    assert 5 <= len(a) <= 20  # about 30 % of 40
    mgr.free(mgr._requests["r"])
    assert mgr.reset_prefix_cache() and col.block_metrics == {} and col.drain_events() == []


def test_with_caching_off_nothing_is_ever_evicted():
    col = KVCacheMetricsCollector(sample_rate=1.0, clock=lambda: 1.0)
    mgr = KVCacheManager(num_blocks=3, block_size=2, enable_caching=False, metrics_collector=col)
    for rid in "abc":
        r = Request(rid, [1, 2, 3, 4])
        lookup_and_allocate(mgr, r)
        mgr.free(r)
    # vLLM's pool only ends residencies on the caching path; a new allocation restarts them
    assert col.drain_events() == [] and sorted(col.block_metrics) == [1, 2]


def test_bad_arguments():
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1.0\]"):
            KVCacheMetricsCollector(sample_rate=bad)  # type: ignore[arg-type]
    # vLLM 0.33 asserts the range, so its callers catch an AssertionError; the same error is both.
    with pytest.raises(AssertionError, match=r"^sample_rate must be in \(0, 1.0\], got 1.5$"):
        KVCacheMetricsCollector(sample_rate=1.5)
    with pytest.raises(TypeError, match="clock must be a callable"):
        KVCacheMetricsCollector(clock=3.0)  # type: ignore[arg-type]


def test_the_engine_feeds_its_simulated_clock():
    col = KVCacheMetricsCollector(sample_rate=1.0)
    eng = build_engine(num_blocks=9, block_size=4, manager_kwargs={"metrics_collector": col})
    assert col.clock is not None and col.clock() == eng.clock == 0.0
    for i in range(6):
        eng.add_request(Request(f"r{i}", [i] * 12, max_tokens=3))
    eng.run()
    evs = eng.kv_cache_eviction_events
    assert evs and all(0 < e.lifetime_seconds <= eng.clock and e.idle_seconds <= e.lifetime_seconds for e in evs)
    # residencies are measured in simulated seconds: each one is a sum of step times
    step_times = {round(t, 9) for t in Timeline(eng.events).series.time}
    assert any(round(e.lifetime_seconds, 9) in step_times for e in evs)


def test_evict_blocks_ends_the_residency_of_every_block_it_names(monkeypatch):
    """vLLM 0.33 ends a sampled residency for each block ``evict_blocks`` names -- held or
    free, cached or not -- and reads ``time.monotonic_ns`` when no clock is given."""
    import time

    now = [1 * 10**9]
    monkeypatch.setattr(time, "monotonic_ns", lambda: now[0])
    col = KVCacheMetricsCollector(sample_rate=1.0)
    mgr = KVCacheManager(num_blocks=4, block_size=4, metrics_collector=col)
    a = Request("a", [1, 2, 3, 4, 5])  # block 1 full (cached, held), block 2 partial (held, no hash)
    lookup_and_allocate(mgr, a)
    now[0] = 4 * 10**9
    assert mgr.block_pool.evict_blocks({1, 2}) == [1]  # only block 1 had an entry to drop
    E = KVCacheEvictionEvent
    assert col.drain_events() == [E(3.0, 3.0, ()), E(3.0, 3.0, ())]
    assert mgr.block_pool.evict_blocks({1}) == [] and col.drain_events() == []  # that residency is over
