"""HiSparse's runtime (vLLM 0.33): the host pool, write-backs, unpinning, residency updates,
adoption of GPU copies, deferred frees -- with the values vLLM 0.33.0's own code gives for the
same calls (checked by running its HiSparse tests on kvlab: scripts/vllm_tests)."""

from __future__ import annotations

import pytest

from kvlab.core.block_pool import BlockPool
from kvlab.core.hisparse_managers import HiSparseResidentManager, HiSparseSourceManager
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockStored
from kvlab.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
)
from kvlab.request import Request, RequestStatus

BS = 16


def hisparse_manager(num_blocks: int = 32, host_blocks: int = 16, **kw) -> KVCacheManager:
    src = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1)
    groups = (
        KVCacheGroupSpec(("source",), src, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        KVCacheGroupSpec(("indexer",), src, role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(("resident",), HiSparseResidentSpec(block_size=BS, page_size=4 * BS)),
        KVCacheGroupSpec(("hot",), HiSparseHotSpec(block_size=BS, page_size=4 * BS, blocks_per_request=2)),
    )
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=groups, hisparse_host_num_blocks=host_blocks)
    kw.setdefault("max_model_len", 128)
    return KVCacheManager(config, hash_block_size=BS, **kw)


def run_step(m: KVCacheManager, r: Request, n: int) -> None:
    assert m.allocate_slots(r, n) is not None
    m.hisparse.advance_scheduled([(r.request_id, min(r.num_computed_tokens + n, r.num_tokens))])


def complete_transfers(m: KVCacheManager) -> list[int]:
    c = m.hisparse
    ids = [t.transfer_id for t in c.build_offload_command().page_transfers]
    c.update_spills(dict.fromkeys(ids, 1), dict.fromkeys(ids, 1))
    return ids


def test_groups_and_pools():
    m = hisparse_manager()
    c = m.hisparse
    source, indexer, resident, hot = m.coordinator.single_type_managers
    assert isinstance(source, HiSparseSourceManager) and isinstance(resident, HiSparseResidentManager)
    assert source.block_pool is not m.block_pool and source.block_pool.medium == MEDIUM_CPU
    assert (source.block_pool.num_gpu_blocks, m.block_pool.num_gpu_blocks) == (16, 32)
    assert c.host_manager is source and c.gpu_pool is m.block_pool
    assert (c.transition_watermark, c.max_spill_pages, resident.max_admission_blocks_per_request) == (3, 8, 8)
    assert m.kv_cache_config.hisparse_host_num_blocks == 16
    assert m.retained_hit_group_ids == (0,)


def test_write_back_publish_and_copies():
    m = hisparse_manager(enable_caching=True)
    c = m.hisparse
    r = Request("a", list(range(4 * BS)))
    run_step(m, r, 4 * BS)
    # host pages 1-4, indexer 1-4 and resident 5-8 of the GPU pool; no hot buffer yet
    assert m.get_blocks("a").get_block_ids() == ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [])
    host = c.host_manager.block_pool
    assert [b.cache_key for b in c.host_manager.req_to_blocks["a"]] == [None] * 4  # nothing durable yet
    assert complete_transfers(m) == [0, 1, 2, 3]
    assert c.request_states["a"].valid_pages == {0, 1, 2, 3}
    assert c.request_states["a"].ready_prefix_pages == 4
    # published once durable, and each host page indexes its GPU copy
    assert all(b.cache_key is not None for b in c.host_manager.req_to_blocks["a"])
    assert sorted(b.block_id for copies in c.copies.values() for b in copies) == [5, 6, 7, 8]
    assert host.get_num_free_blocks() == 11


def test_unpinned_pages_stay_readable_until_reused():
    m = hisparse_manager()
    c = m.hisparse
    pool = m.block_pool
    r = Request("a", list(range(6 * BS)))
    run_step(m, r, 6 * BS)
    for h in c.hot_managers:
        h.require_hot("a")
    run_step(m, r, 6 * BS)  # allocates the hot buffer
    assert m.get_blocks("a").get_block_ids()[3] == [13, 14]
    assert c.take_residency_updates(["a"])["a"].pages == [0, 1, 2, 3, 4, 5]
    free = pool.get_num_free_blocks()
    complete_transfers(m)
    # the four sealed pages (not the last two) were given back but are still read
    assert pool.get_num_free_blocks() == free + 4
    assert [b.block_id for b in c.resident_managers[0].get_residency_row("a")] == [7, 8, 9, 10, 11, 12]
    # the pool hands out its never-used blocks first, then the oldest unpinned page
    pool.get_new_blocks(free + 1)
    update = c.take_residency_updates(["a"])["a"]
    assert (update.pages, update.block_ids) == ([0], ([0],))
    assert [b.block_id for b in c.resident_managers[0].get_residency_row("a")] == [0, 8, 9, 10, 11, 12]
    # the block table itself stays append-only
    assert m.get_blocks("a").get_block_ids()[2] == [7, 8, 9, 10, 11, 12]


def test_prefix_hit_adopts_the_surviving_gpu_copies():
    m = hisparse_manager(enable_caching=True)
    c = m.hisparse
    a = Request("a", list(range(4 * BS)))
    run_step(m, a, 4 * BS)
    complete_transfers(m)
    m.free(a)
    b = Request("b", list(range(4 * BS)))
    blocks, n = m.get_computed_blocks(b)
    # the host group hits 3 pages (a prompt's last token is always computed); the indexer too
    assert n == 3 * BS and [len(g) for g in blocks.blocks] == [3, 3, 0, 0]
    assert m.allocate_slots(b, BS, 3 * BS, blocks) is not None
    c.advance_scheduled([("b", 4 * BS)])
    # host-only pages (null) until adopted, then read from a's GPU copies
    assert [blk.block_id for blk in c.resident_managers[0].get_residency_row("b")] == [5, 6, 7, 10]
    assert [blk.block_id for blk in m.get_blocks("b").blocks[2]] == [0, 0, 0, 10]


def test_unpin_blocks_refuses_a_free_block():
    pool = BlockPool(4, True)
    b = pool.get_new_blocks(1)[0]
    seen = []
    pool.unpin_blocks([b], seen.append)
    assert (b.ref_cnt, pool.get_num_free_blocks()) == (0, 3)
    with pytest.raises(ValueError, match=r"blocks\[0\] \(block 1\) is not held"):
        pool.unpin_blocks([b], seen.append)
    assert (b.ref_cnt, pool.get_num_free_blocks()) == (0, 3)
    # handed out again: its reader is told, once
    assert [x.block_id for x in pool.get_new_blocks(3)] == [2, 3, 1]
    assert [x.block_id for x in seen] == [1]


def test_freed_blocks_of_both_pools_go_home():
    m = hisparse_manager(16, 16)
    host = m.hisparse.host_manager.block_pool
    host_free, gpu_free = host.get_num_free_blocks(), m.block_pool.get_num_free_blocks()
    r = Request("a", list(range(BS)))
    assert m.allocate_slots(r, BS, delay_cache_blocks=True) is not None
    blocks = m.pop_blocks_for_free(r)
    assert host.get_num_free_blocks() == host_free - 1
    m.block_pool.free_blocks(list(reversed(blocks)))
    assert (host.get_num_free_blocks(), m.block_pool.get_num_free_blocks()) == (host_free, gpu_free)


def test_a_mixed_free_refused_in_the_second_pool_frees_nothing_in_the_first():
    m = hisparse_manager(16, 16)
    host = m.hisparse.host_manager.block_pool
    r = Request("a", list(range(BS)))
    assert m.allocate_slots(r, BS, delay_cache_blocks=True) is not None
    blocks = m.pop_blocks_for_free(r)
    host_block = next(b for b in blocks if host.blocks[b.block_id] is b)
    before = (
        [[b.ref_cnt for b in p.blocks] for p in (m.block_pool, host)],
        [[b.block_id for b in p.free_block_queue.get_all_free_blocks()] for p in (m.block_pool, host)],
    )
    with pytest.raises(ValueError, match=f"block {host_block.block_id} freed more often than it was allocated"):
        m.block_pool.free_blocks(list(reversed(blocks)) + [host_block])
    after = (
        [[b.ref_cnt for b in p.blocks] for p in (m.block_pool, host)],
        [[b.block_id for b in p.free_block_queue.get_all_free_blocks()] for p in (m.block_pool, host)],
    )
    assert after == before


def test_host_events_share_the_gpu_stream_marked_cpu():
    m = hisparse_manager(enable_caching=True, enable_kv_cache_events=True)
    r = Request("a", list(range(2 * BS)))
    run_step(m, r, 2 * BS)
    complete_transfers(m)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [(e.medium, e.block_size, len(e.block_hashes)) for e in stored] == [(MEDIUM_GPU, BS, 2), (MEDIUM_CPU, BS, 2)]


def books(m: KVCacheManager) -> tuple:
    """Everything a HiSparse allocation may change, by value."""
    c = m.hisparse
    pools = (m.block_pool, c.host_manager.block_pool)
    return (
        [[b.ref_cnt for b in p.blocks] for p in pools],
        [[b.block_id for b in p.free_block_queue.get_all_free_blocks()] for p in pools],
        [sorted(p._reuse_watchers) for p in pools],
        dict(c.copies),
        dict(c.request_states),
        [sorted(h.hot_required) for h in c.hot_managers],
        [dict(g.req_to_blocks) for g in m.coordinator.single_type_managers],
    )


def test_a_failed_step_leaves_the_books_as_they_were(monkeypatch):
    m = hisparse_manager(enable_caching=True)
    a = Request("a", list(range(4 * BS)))
    run_step(m, a, 4 * BS)
    complete_transfers(m)
    m.free(a)
    before = books(m)
    b = Request("b", list(range(6 * BS)))
    blocks, n = m.get_computed_blocks(b)

    def fail(*args, **kwargs):
        raise RuntimeError("the learner's code raised")

    monkeypatch.setattr(HiSparseResidentManager, "allocate_new_blocks", fail)
    with pytest.raises(RuntimeError):
        m.allocate_slots(b, 3 * BS, n, blocks)
    assert books(m) == before
    assert all("b" not in g.req_to_blocks for g in m.coordinator.single_type_managers)
    monkeypatch.undo()
    blocks, n = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 3 * BS, n, blocks) is not None


def test_refusals():
    src = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1)
    groups = (KVCacheGroupSpec(("source",), src, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),)
    from kvlab.eventlog.events import EventLog

    log = EventLog()
    with pytest.raises(ValueError, match=r"kv_cache_groups \[0\] hold HiSparse's source K/V.*hisparse_host_num_blocks"):
        KVCacheManager(KVCacheConfig(num_blocks=8, kv_cache_tensors=(), kv_cache_groups=groups), max_model_len=64, event_log=log)
    assert len(log) == 0  # refused before the pool was built: no PoolCreated
    with pytest.raises(ValueError, match="event_log must be None with a HiSparse host pool"):
        hisparse_manager(event_log=log)
    assert len(log) == 0
    plain = (KVCacheGroupSpec(("layer",), src),)
    with pytest.raises(ValueError, match="No HiSparse cache group is configured"):
        KVCacheManager(
            KVCacheConfig(num_blocks=8, kv_cache_tensors=(), kv_cache_groups=plain, hisparse_host_num_blocks=4), max_model_len=64
        )


def test_connector_carries_a_step_and_its_completions():
    from kvlab.core.sched.output import CachedRequestData, SchedulerOutput
    from kvlab.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
        HiSparseConnectorScheduler,
        HiSparseConnectorWorkerMetadata,
    )
    from kvlab.outputs import KVConnectorOutput

    m = hisparse_manager(enable_caching=True)
    r = Request("a", list(range(3 * BS)))
    ids = m.allocate_slots(r, 3 * BS).get_block_ids()
    conn = HiSparseConnectorScheduler(async_speculative=False)
    conn.bind_coordinator(m.hisparse)
    conn.requests["a"] = r
    out = SchedulerOutput.make_empty(step=1)
    out.scheduled_cached_reqs = CachedRequestData(req_ids=["a"], new_block_ids=[ids], num_computed_tokens=[0], new_token_ids=[[]])
    out.num_scheduled_tokens = {"a": 3 * BS}
    meta = conn.build_connector_meta(out)
    assert out.has_sync_kv_loads
    assert [(t.transfer_id, t.host_block_id, t.resident_block_ids) for t in meta.command.page_transfers] == [
        (0, 1, (4,)),
        (1, 2, (5,)),
        (2, 3, (6,)),
    ]
    assert meta.source_block_ids == (1, 2, 3)
    assert [(x.source_starts, x.destination_start, x.num_rows) for x in meta.row_mirrors["a"]] == [
        ((4 * BS,), 1 * BS, BS),
        ((5 * BS,), 2 * BS, BS),
        ((6 * BS,), 3 * BS, BS),
    ]
    assert meta.all_context_pages_resident
    assert (meta.residency_updates["a"].pages, meta.residency_updates["a"].block_ids) == ([0, 1, 2], ([4, 5, 6],))
    # two workers: each reports once; a transfer completes when both did
    one = HiSparseConnectorWorkerMetadata({0: 2, 1: 2, 2: 2}, {0: 1, 1: 1, 2: 1})
    conn.update_connector_output(KVConnectorOutput(worker_meta=one))
    assert m.hisparse.request_states["a"].valid_pages == set()
    conn.update_connector_output(KVConnectorOutput(worker_meta=HiSparseConnectorWorkerMetadata({}, {0: 1, 1: 1, 2: 1})))
    assert m.hisparse.request_states["a"].valid_pages == {0, 1, 2}
    assert not m.hisparse.has_pending_work()
    both = one.aggregate(HiSparseConnectorWorkerMetadata({0: 1}, {5: 1}, (7,)))
    assert (both.enqueued_transfer_counts, both.completed_transfer_counts, both.completed_host_copy_dst_ids) == (
        {0: 3, 1: 2, 2: 2},
        {0: 1, 1: 1, 2: 1, 5: 1},
        (7,),
    )


def test_connector_refuses_the_worker_role_and_a_config_without_host_pool():
    from types import SimpleNamespace

    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
    from kvlab.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnector

    m = hisparse_manager()
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=False), speculative_config=None, num_lookahead_tokens=0, kv_transfer_config=None
    )
    with pytest.raises(ValueError, match="kvlab builds HiSparse's scheduler half only"):
        HiSparseConnector(vllm_config, KVConnectorRole.WORKER, m.kv_cache_config)
    with pytest.raises(ValueError, match="needs a HiSparse host pool"):
        HiSparseConnector(vllm_config, KVConnectorRole.SCHEDULER, KVCacheConfig(num_blocks=8, kv_cache_tensors=(), kv_cache_groups=()))
    conn = HiSparseConnector(vllm_config, KVConnectorRole.SCHEDULER, m.kv_cache_config)
    assert supports_hma(conn) and (conn._vllm_config, conn._kv_cache_config) == (vllm_config, m.kv_cache_config)
    conn.bind_kv_cache_manager(m)
    assert conn.connector_scheduler.coordinator is m.hisparse
    assert (conn.get_num_new_matched_tokens(Request("x", [1, 2]), 0), conn.has_pending_push_work()) == ((0, False), False)


# --- invariants under random traffic ----------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(
    st.tuples(st.sampled_from(["add", "step", "report", "hot", "free", "reuse"]), st.integers(0, 3), st.integers(1, 3)),
    min_size=1,
    max_size=30,
)


def _check_books(m: KVCacheManager) -> None:
    """What must hold after any call: both pools consistent; a GPU page a request reads
    with no reference left is watched (its reader is told before the pool reuses it); the
    ends of a transfer in flight are held."""
    c = m.hisparse
    m.check_invariants()
    watched = m.block_pool._reuse_watchers
    for g in c.resident_managers:
        for rid in g.req_to_blocks:
            for b in g.get_residency_row(rid):
                assert b.is_null or b.ref_cnt > 0 or b.block_id in watched, f"{rid!r} reads block {b.block_id}, unheld and unwatched"
    for p in c.pending_spills.values():
        assert p.host_block.ref_cnt > 0 and all(b.ref_cnt > 0 for b in p.resident_blocks)


@settings(deadline=None)
@given(ops=_OPS, caching=st.booleans())
def test_random_traffic_keeps_the_books_and_leaks_nothing(ops, caching):
    m = hisparse_manager(24, 24, enable_caching=caching)
    c = m.hisparse
    live: dict[str, Request] = {}
    reports: list[int] = []
    n = 0
    for op, k, size in ops:
        rid = sorted(live)[k % len(live)] if live else None
        if op == "add" or rid is None:
            n += 1
            r = Request(f"r{n}", [k] * BS + list(range(n * 100, n * 100 + size * BS)))  # shared first page per k
            blocks, hit = m.get_computed_blocks(r)
            if m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None:
                r.num_computed_tokens = r.num_tokens
                live[r.request_id] = r
                c.advance_scheduled([(r.request_id, r.num_tokens)])
        elif op == "step":
            r = live[rid]
            r.append_output_token_ids(list(range(size)))
            if m.allocate_slots(r, size) is not None:
                r.num_computed_tokens = r.num_tokens
                c.advance_scheduled([(rid, r.num_tokens)])
            else:
                del r._output_token_ids[-size:], r._all_token_ids[-size:]
        elif op == "report":
            reports += [t.transfer_id for t in c.build_offload_command().page_transfers]
            done, reports = reports[:size], reports[size:]
            c.update_spills(dict.fromkeys(done, 1), dict.fromkeys(done, 1))
        elif op == "hot":
            for h in c.hot_managers:
                h.require_hot(rid)
        elif op == "free":
            r = live.pop(rid)
            if k % 2:  # finished (not preempted): its pages in flight are published when they land
                r.status = RequestStatus.FINISHED_STOPPED
            m.free(r)
        elif op == "reuse" and m.block_pool.get_num_free_blocks() >= size:
            m.block_pool.free_blocks(m.block_pool.get_new_blocks(size))
        _check_books(m)
    for r in live.values():
        m.free(r)
    reports += [t.transfer_id for t in c.build_offload_command().page_transfers]
    c.update_spills(dict.fromkeys(reports, 1), dict.fromkeys(reports, 1))
    _check_books(m)
    assert not c.has_pending_work()
    # every block is back: nothing pinned, held or detached is left behind
    assert m.block_pool.get_num_free_blocks() == 23 and c.host_manager.block_pool.get_num_free_blocks() == 23


def test_coordinator_refuses_bad_reports_and_unknown_requests_unchanged():
    m = hisparse_manager()
    c = m.hisparse
    run_step(m, Request("a", list(range(2 * BS))), 2 * BS)
    before = books(m)
    with pytest.raises(ValueError, match=r"requests\[1\]: request 'ghost' holds no HiSparse pages here"):
        c.advance_scheduled([("a", 2 * BS), ("ghost", BS)])
    with pytest.raises(ValueError, match=r"requests\[0\]: token counts must be ints >= 0, got -1"):
        c.advance_scheduled([("a", -1)])
    with pytest.raises(ValueError, match=r"completed_counts\[0\] must be an int >= 1 \(workers\), got 0"):
        c.update_spills({0: 1}, {0: 0})
    with pytest.raises(TypeError, match="enqueued_counts must be a dict"):
        c.update_spills([0], {})
    assert c.take_residency_updates(["ghost"]) == {} and "ghost" not in c.request_states
    assert books(m) == before


def test_reset_forgets_the_host_prefixes_too():
    m = hisparse_manager(enable_caching=True, enable_kv_cache_events=True)
    a = Request("a", list(range(4 * BS)))
    run_step(m, a, 4 * BS)
    complete_transfers(m)
    m.free(a)
    m.take_events()
    assert m.get_computed_blocks(Request("b", list(range(4 * BS))))[1] == 3 * BS
    assert m.reset_prefix_cache()
    assert not m.hisparse.copies
    assert [type(e).__name__ for e in m.take_events()] == ["AllBlocksCleared", "AllBlocksCleared"]  # host pool, GPU pool
    assert m.get_computed_blocks(Request("c", list(range(4 * BS))))[1] == 0


def test_connector_stats_sample_the_host_pool(monkeypatch):
    """vLLM 0.33's HiSparse payload: the host pool's level, its write-backs in flight, and the
    sampled host-block residencies that ended -- in the host pool's own collector, not the GPU's."""
    import time

    from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
    from kvlab.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnector, HiSparseConnectorScheduler

    now = [2 * 10**9]
    monkeypatch.setattr(time, "monotonic_ns", lambda: now[0])  # the collectors' clock (vLLM's too)
    gpu_collector = KVCacheMetricsCollector(sample_rate=1.0)
    m = hisparse_manager(32, 8, enable_caching=True, metrics_collector=gpu_collector)
    sched = HiSparseConnectorScheduler(async_speculative=False)
    assert sched.get_kv_connector_stats() is None  # nothing bound yet
    sched.bind_coordinator(m.hisparse)
    first = sched.get_kv_connector_stats()
    assert (first.data["host_cache_usage_perc"], first.data["pending_page_transfers"]) == ([0.0], [0])
    r = Request("a", list(range(4 * BS)))
    run_step(m, r, 4 * BS)  # host pages 1-4, sampled at t = 2 s
    mid = sched.get_kv_connector_stats()
    # 4 of the host pool's 7 usable blocks (8 less the null block); 4 write-backs not yet done
    assert (mid.data["host_cache_usage_perc"], mid.data["pending_page_transfers"]) == ([4 / 7], [4])
    complete_transfers(m)
    m.free(r)
    gpu_collector.drain_events()
    now[0] = 4 * 10**9
    m.hisparse.host_manager.block_pool.evict_blocks({1})  # a host page's residency ends at t = 4 s
    stats = sched.get_kv_connector_stats()
    assert (stats.data["host_block_lifetime_seconds"], stats.data["host_block_idle_before_evict_seconds"]) == ([2.0], [2.0])
    assert gpu_collector.drain_events() == []  # the GPU pool's collector saw none of it
    merged = HiSparseConnector.build_kv_connector_stats(dict(first.data)).aggregate(mid).aggregate(stats)
    # a level keeps each payload's last observation (the freed pages count as free: 0 again); a count extends
    assert (merged.data["host_cache_usage_perc"], merged.data["host_block_lifetime_seconds"]) == ([0.0, 4 / 7, 0.0], [2.0])
    assert merged.reduce() == {
        "HiSparse hot-buffer hits": 0,
        "HiSparse hot-buffer misses": 0,
        "HiSparse host-to-device bytes": 0,
        "HiSparse host KV cache usage %": 0.0,
    }
    assert (HiSparseConnector.get_required_kvcache_layout(None), sched.get_kv_connector_stats().is_empty()) == ("BLHNC", False)
