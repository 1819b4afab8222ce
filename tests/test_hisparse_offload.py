"""The offloading connector under HiSparse (vLLM 0.33): it keeps the indexer group alone in
its tiers (the source K/V already lives in the host pool) and never loads past the host
pool's own cached prefix -- with the values vLLM 0.33.0's code gives for the same calls
(its ``test_connector_completes_partial_prefix_without_importing_missing_host_kv`` and
``test_hisparse_indexer_offload_is_capped_by_missing_host_prefix`` pass on kvlab:
scripts/vllm_tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvlab.distributed.kv_events import BlockStored
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import LoadResult, OffloadingWorkerMetadata
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupRole, KVCacheGroupSpec
from kvlab.kv_offload.base import get_offload_group_idx, make_offload_key
from kvlab.lessons.beyond_pool import hisparse_offload_and_finish
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.outputs import KVConnectorOutput
from kvlab.request import Request
from test_hisparse_runtime import BS, hisparse_manager, run_step


def _step_output(new: dict[str, tuple[list[int], ...]], scheduled: dict[str, int]) -> SimpleNamespace:
    """The parts of a SchedulerOutput the connector reads, for requests scheduled anew."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=ids) for rid, ids in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(),
    )


def _connector(m: KVCacheManager, num_cpu_blocks: int = 8) -> OffloadingConnector:
    conn = OffloadingConnector(KVConnectorRole.SCHEDULER, BS, {"num_cpu_blocks": num_cpu_blocks})
    conn.bind_kv_cache_manager(m)
    return conn


def test_the_connector_offloads_the_indexer_group_alone():
    m = hisparse_manager(enable_caching=True, enable_kv_cache_events=True)
    assert get_offloading_group_ids(m.kv_cache_config) == (1,)
    conn = _connector(m)
    assert (conn.scheduler.group_id, conn._bounding_group_ids) == (1, (0,))
    a = Request("a", list(range(4 * BS)))
    m.get_computed_blocks(a)
    conn.get_num_new_matched_tokens(a, 0)
    run_step(m, a, 4 * BS)
    conn.update_state_after_alloc(a, m.get_blocks("a"), 0)
    assert m.get_block_ids("a")[:2] == ([1, 2, 3, 4], [1, 2, 3, 4])  # host pool, GPU pool
    meta = conn.build_connector_meta(_step_output({"a": m.get_block_ids("a")}, {"a": 4 * BS}))
    (store,) = meta.stores
    assert store.gpu_block_ids == [1, 2, 3, 4]  # the indexer's GPU blocks
    assert {get_offload_group_idx(k) for k in store.plan.keys} == {1}
    assert [k[:-4] for k in store.plan.keys] == a.block_hashes[:4]
    assert conn.take_events() == []  # announced once readable: when the worker reports the store
    conn.update_connector_output(KVConnectorOutput(worker_meta=OffloadingWorkerMetadata(stores={store.job_id: (True, False, "")})))
    # vLLM 0.33's placeholder events: one per key, naming the indexer group
    events = conn.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    assert [(e.medium, e.group_idx, e.block_size) for e in events] == [("CPU", 1, 0)] * 4


@pytest.mark.parametrize(
    "evict_indexer_page, evict_host_page, local, external, load_pages",
    [
        (1, None, 16, 32, [1, 2]),  # the host pool holds pages 0-2 of the 63 tokens looked up
        (3, None, 48, 0, []),  # nothing past the host pool's prefix to load
        (0, 2, 0, 32, [0, 1]),  # the CPU tier holds page 2's indexer keys, the host pool lost its K/V
        (1, 2, 16, 16, [1]),
    ],
)
def test_loads_stop_at_the_host_pools_prefix(evict_indexer_page, evict_host_page, local, external, load_pages):
    m = hisparse_manager(enable_caching=True)
    conn = _connector(m)
    tokens = list(range(4 * BS))
    host, indexer = hisparse_offload_and_finish(m, conn, tokens, "a")
    m.block_pool.evict_blocks({indexer[evict_indexer_page]})
    if evict_host_page is not None:
        m.hisparse.host_manager.block_pool.evict_blocks({host[evict_host_page]})
    b = Request("b", tokens)
    blocks, num_local = m.get_computed_blocks(b)
    assert num_local == local
    host_prefix = 48 if evict_host_page is None else evict_host_page * BS
    assert conn._max_loadable_tokens(b, num_local) == host_prefix - local
    assert conn.get_num_new_matched_tokens(b, num_local) == (external, False)
    assert m.allocate_slots(b, 4 * BS - num_local - external, num_local, blocks, num_external_computed_tokens=external) is not None
    conn.update_state_after_alloc(b, m.get_blocks("b"), external)
    meta = conn.build_connector_meta(_step_output({"b": m.get_block_ids("b")}, {"b": 4 * BS - num_local - external}))
    b_indexer = m.get_block_ids("b")[1]
    assert [job.gpu_block_ids for job in meta.loads] == ([[b_indexer[p] for p in load_pages]] if load_pages else [])
    assert [[it.key[:-4] for it in job.items] for job in meta.loads] == ([[b.block_hashes[p] for p in load_pages]] if load_pages else [])


def test_no_load_without_the_host_pools_first_page():
    m = hisparse_manager(enable_caching=True)
    conn = _connector(m)
    tokens = list(range(4 * BS))
    host, indexer = hisparse_offload_and_finish(m, conn, tokens, "a")
    m.block_pool.evict_blocks({indexer[1]})
    m.hisparse.host_manager.block_pool.evict_blocks({host[0]})
    c = Request("c", tokens)
    _, num_local = m.get_computed_blocks(c)
    # The CPU tier still holds the indexer pages 1-3, but no host K/V: nothing may load.
    assert (num_local, conn._max_loadable_tokens(c, num_local)) == (0, 0)
    assert conn.get_num_new_matched_tokens(c, 0) == (0, False)
    assert len(conn.manager.primary.entries()) == 4


def test_the_connector_refuses_what_it_cannot_serve_and_stays_unbound():
    two = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1)
    config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(("source",), two, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
            KVCacheGroupSpec(("indexer",), two, role=KVCacheGroupRole.HISPARSE_INDEXER),
            KVCacheGroupSpec(("indexer2",), two, role=KVCacheGroupRole.HISPARSE_INDEXER),
        ),
        hisparse_host_num_blocks=16,
    )
    m = KVCacheManager(config, hash_block_size=BS, max_model_len=128, enable_caching=True)
    conn = OffloadingConnector(KVConnectorRole.SCHEDULER, BS, {"num_cpu_blocks": 8})
    with pytest.raises(ValueError, match="stores the indexer group alone; this config has 2 HISPARSE_INDEXER groups"):
        conn.bind_kv_cache_manager(m)
    assert (conn._kv_cache_manager, conn._kv_cache_config) == (None, None)
    with pytest.raises(ValueError, match="built for block_size=8, the KV-cache manager's group 1 uses 16"):
        OffloadingConnector(KVConnectorRole.SCHEDULER, 8).bind_kv_cache_manager(hisparse_manager(enable_caching=True))
    with pytest.raises(ValueError, match="enable_caching=True"):
        _connector(hisparse_manager(enable_caching=False))
    worker = OffloadingConnector(KVConnectorRole.WORKER, BS)
    with pytest.raises(RuntimeError, match="scheduler-side hook, but this connector was built with role=WORKER"):
        worker.get_num_new_matched_tokens(Request("w", [1, 2, 3]), 0)


def test_tier_removals_name_the_group():
    m = hisparse_manager(enable_caching=True, enable_kv_cache_events=True)
    conn = _connector(m, num_cpu_blocks=4)
    hisparse_offload_and_finish(m, conn, list(range(4 * BS)), "a")
    conn.take_events()
    d = Request("d", list(range(1000, 1000 + 2 * BS)))  # two new blocks evict two of a's four
    m.get_computed_blocks(d)
    conn.get_num_new_matched_tokens(d, 0)
    run_step(m, d, 2 * BS)
    conn.update_state_after_alloc(d, m.get_blocks("d"), 0)
    conn.build_connector_meta(_step_output({"d": m.get_block_ids("d")}, {"d": 2 * BS}))
    events = conn.take_events()
    assert [(type(e).__name__, e.group_idx, len(e.block_hashes)) for e in events] == [
        ("BlockRemoved", 1, 2),
    ]


_ROUNDS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 4), st.sets(st.integers(0, 3), max_size=2), st.sets(st.integers(0, 3), max_size=2)),
    min_size=1,
    max_size=8,
)


@settings(deadline=None, max_examples=60)
@given(rounds=_ROUNDS)
def test_random_rounds_load_only_what_both_pools_can_back(rounds):
    """Requests come and go on shared prefixes, both pools lose random cached pages between
    them. Every load the connector plans is a run of indexer keys the CPU tier holds, right
    after the local hit, never past the host pool's own prefix; both books stay consistent."""
    m = hisparse_manager(24, 24, enable_caching=True)
    conn = _connector(m, num_cpu_blocks=6)
    gpu, host = m.block_pool, m.hisparse.host_manager.block_pool
    for n, (prefix, pages, lose_indexer, lose_host) in enumerate(rounds):
        r = Request(f"r{n}", list(range(prefix * 1000, prefix * 1000 + pages * BS)) + [n])  # pages full + 1 token
        blocks, local = m.get_computed_blocks(r)
        _, hits = m.coordinator.find_longest_cache_hit_per_group(r.block_hashes, r.num_tokens - 1)
        in_tier = {k for k, _ in conn.manager.primary.entries()}
        held = 0  # the run of indexer keys the CPU tier holds right after the local hit
        while local // BS + held < (r.num_tokens - 1) // BS and make_offload_key(r.block_hashes[local // BS + held], 1) in in_tier:
            held += 1
        external, is_async = conn.get_num_new_matched_tokens(r, local)
        # as far as the tier holds the run, and never past the host pool's own prefix
        assert (external, is_async) == (min(held, max(0, hits[0] // BS - local // BS)) * BS, False)
        if held * BS > external:
            event("the host pool's prefix cut a load short")
        if m.allocate_slots(r, r.num_tokens - local - external, local, blocks, num_external_computed_tokens=external) is None:
            conn.request_finished(r, [])
            continue
        conn.update_state_after_alloc(r, m.get_blocks(r.request_id), external)
        meta = conn.build_connector_meta(
            _step_output({r.request_id: m.get_block_ids(r.request_id)}, {r.request_id: r.num_tokens - local - external})
        )
        first, count = local // BS, external // BS
        assert [[it.key for it in job.items] for job in meta.loads] == (
            [[make_offload_key(h, 1) for h in r.block_hashes[first : first + count]]] if count else []
        )
        assert [job.gpu_block_ids for job in meta.loads] == ([m.get_block_ids(r.request_id)[1][first : first + count]] if count else [])
        r.num_computed_tokens = r.num_tokens
        m.hisparse.advance_scheduled([(r.request_id, r.num_tokens)])
        done = [t.transfer_id for t in m.hisparse.build_offload_command().page_transfers]
        m.hisparse.update_spills(dict.fromkeys(done, 1), dict.fromkeys(done, 1))  # the host copies landed
        conn.update_connector_output(
            KVConnectorOutput(
                worker_meta=OffloadingWorkerMetadata(
                    loads={job.job_id: LoadResult(len(job.items)) for job in meta.loads},
                    stores={job.job_id: (True, False, "") for job in meta.stores},
                )
            )
        )
        indexer_ids, host_ids = m.get_block_ids(r.request_id)[1], m.get_block_ids(r.request_id)[0]
        m.free(r)
        conn.request_finished(r, [])
        gpu.evict_blocks({indexer_ids[p] for p in lose_indexer if p < len(indexer_ids)})
        host.evict_blocks({host_ids[p] for p in lose_host if p < len(host_ids)})
        m.check_invariants()
        conn.scheduler.check_invariants()
