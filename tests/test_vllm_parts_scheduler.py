"""vLLM 0.33 scheduler parts kvlab grew for vLLM's own tests (issue 22).

* ``_free_cow_retained_blocks`` and the fence behind it (``defer_block_free``,
  ``sched_step_seq``, ``processed_step_seq``, ``deferred_frees``): the two blocks of a
  copy-on-write copy go back to the pool once the step that runs the copy is processed.
* ``SupportsHMA`` and ``_connector_finished``: a KV producer's connector is offered the
  Mamba states a finishing request saved inside blocks before its blocks are cleaned up,
  then told the request finished (every group's table for a ``SupportsHMA`` connector).
* ``get_computed_blocks_for_connector`` and ``_get_local_prefix_cache_hit``: a connector that
  completes divergent hybrid hits is given full attention's own hit (refused by kvlab's
  scheduler on a Mamba hybrid, where it would matter).
"""

from __future__ import annotations

from collections import deque

import pytest

from kvlab import FullAttentionSpec, KVCacheManager, MambaSpec, Request
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.sched.scheduler import Scheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA, supports_hma
from kvlab.engine.llm_engine import build_engine
from kvlab.eventlog.events import EventLog, PrefixLookup
from kvlab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from scheduler_side_connector import SchedulerSideConnector
from test_hybrid import diverging_mamba_hybrid as _diverging

HYBRID = [FullAttentionSpec(block_size=8), MambaSpec(block_size=8)]


def _cow_scheduler(defer: bool) -> tuple[KVCacheManager, Scheduler]:
    """A Mamba hybrid with partial hits: request a (14 tokens) is prefilled 8 + 4 + 2, and the
    third chunk hands its state saved inside block 4 to a copy, block 5
    (``test_partial_hits``)."""
    m = KVCacheManager(num_blocks=16, kv_cache_groups=HYBRID, max_model_len=64, prefix_match_unit=4)
    sched = Scheduler(m, max_num_batched_tokens=64, max_num_seqs=4)
    sched.defer_block_free = defer
    sched.add_request(Request("a", list(range(14)), max_tokens=2))
    return m, sched


def _refs(m: KVCacheManager) -> tuple[int, int]:
    return m.block_pool.blocks[4].ref_cnt, m.block_pool.blocks[5].ref_cnt


def _free_queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_kvlab_gives_a_copys_blocks_back_in_the_step_that_hands_it_over():
    m, sched = _cow_scheduler(defer=False)
    for n in (8, 4):
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"a": n}
        sched.update_from_output(out, {})
    out = sched.schedule()
    assert out.kv_cache_block_copies is not None and [(c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies] == [(4, 5)]
    assert _refs(m) == (1, 0) and not sched.deferred_frees
    assert (sched.sched_step_seq, sched.processed_step_seq) == (0, 0)  # the fence is not kept
    sched.update_from_output(out, {"a": [7]})
    assert _free_queue(m) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 5]
    sched.check_invariants()


def test_deferring_keeps_a_copys_blocks_until_the_copy_step_is_processed():
    m, sched = _cow_scheduler(defer=True)
    seqs = []
    for n in (8, 4):
        out = sched.schedule()
        seqs.append((sched.sched_step_seq, sched.processed_step_seq))
        sched.update_from_output(out, {})
        seqs.append((sched.sched_step_seq, sched.processed_step_seq))
    assert seqs == [(1, 0), (1, 1), (2, 1), (2, 2)]
    out = sched.schedule()
    # the copy runs in non-empty step 3: its two blocks keep their extra reference till then,
    # stored reversed as vLLM stores them
    assert [(f, [b.block_id for b in blocks]) for f, blocks in sched.deferred_frees] == [(3, [5, 4])]
    assert _refs(m) == (2, 1)
    sched.check_invariants()  # the deferred blocks are counted as held
    with pytest.raises(AssertionError, match="block 4: ref_cnt 2"):
        m.check_invariants()  # the manager alone does not know who holds them
    sched.update_from_output(out, {"a": [7]})
    assert (sched.sched_step_seq, sched.processed_step_seq) == (3, 3)
    assert _refs(m) == (1, 0) and not sched.deferred_frees
    assert _free_queue(m) == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 5]  # as without deferring
    sched.check_invariants()


def test_free_cow_retained_blocks_frees_now_or_waits_for_its_fence():
    """vLLM 0.33's rule, on a real scheduler: freed at once unless deferring and the fence
    step is not processed yet; the drain frees up to the first fence still pending."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(m)
    blocks = m.block_pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    sched._free_cow_retained_blocks(blocks[:2], fence_seq=5)  # not deferring: now
    assert [b.ref_cnt for b in blocks] == [0, 0, 1, 1]
    sched.defer_block_free = True
    sched.processed_step_seq = 2
    sched._free_cow_retained_blocks([blocks[2]], fence_seq=3)
    sched._free_cow_retained_blocks([blocks[3]], fence_seq=4)
    assert sched.deferred_frees == deque([(3, [blocks[2]]), (4, [blocks[3]])])
    sched.processed_step_seq = 3
    sched._drain_deferred_frees()
    assert [b.ref_cnt for b in blocks] == [0, 0, 0, 1] and sched.deferred_frees == deque([(4, [blocks[3]])])
    sched.processed_step_seq = 4
    sched._drain_deferred_frees()
    assert blocks[3].ref_cnt == 0 and not sched.deferred_frees
    (late,) = m.block_pool.get_new_blocks(1)
    sched._free_cow_retained_blocks([late], fence_seq=4)  # its fence is processed: now
    assert late.ref_cnt == 0 and not sched.deferred_frees
    m.block_pool.check_invariants()


# -- SupportsHMA and _connector_finished ----------------------------------------------------------
class _Recorder(SchedulerSideConnector, SupportsHMA):
    """Records what it is told; takes the partial tails it is offered when ``take``."""

    def __init__(self, take: object = True) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.take, self.calls = take, []

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads):
        self.calls.append(("tail", block_ids, partial_tail_offloads))
        return self.take

    def request_finished_all_groups(self, request, block_ids):
        self.calls.append(("all", block_ids))
        return False, {"x": 1}


def _finished_with_a_partial_tail(kv_role: str | None, take: object = True) -> tuple[KVCacheManager, Scheduler, Request]:
    """Hash blocks of 2, Mamba blocks of 4, a 7-token prompt with 6 computed: the state after
    token 6 sits inside its Mamba block 4 (``test_vllm_core_v033``). The connector is put in
    after construction: kvlab refuses a connector with partial hits, and this is the step
    that would hand it those states."""
    config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=2)),
            KVCacheGroupSpec(["mamba"], MambaSpec(block_size=4, shapes=(1, 1), dtypes=("float32",), mamba_cache_mode="align")),
        ],
    )
    m = KVCacheManager(config, max_model_len=8192, enable_caching=True, hash_block_size=2)
    sched = Scheduler(m)
    sched.connector = _Recorder(take)
    sched.vllm_config.kv_transfer_config = None if kv_role is None else KVTransferConfig("ExampleConnector", kv_role=kv_role)
    r = Request("0", [0, 0, 1, 1, 2, 2, 3], max_tokens=8)
    hits, num_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 6, num_hit, hits) is not None
    r.num_computed_tokens = 6
    return m, sched, r


@pytest.mark.parametrize(
    ("kv_role", "take", "delay", "offered"),
    [("kv_producer", True, True, True), ("kv_both", False, False, True), ("kv_consumer", True, False, False), (None, True, False, False)],
)
def test_a_producers_connector_is_offered_the_partial_tail_before_the_cleanup(kv_role, take, delay, offered):
    """vLLM 0.33.0's ``Scheduler._connector_finished`` on its own manager gave the same: the
    tail (group 1, block 4, 6 tokens) offered with both tables, then the finish; the blocks
    kept if the connector took the tail. Not a producer: nothing offered, the tail stays."""
    m, sched, r = _finished_with_a_partial_tail(kv_role, take)
    assert sched._connector_finished(r) == (delay, {"x": 1})
    tables = ([1, 2, 3], [0, 4])
    tail = [("tail", tables, [(1, 4, 6)])] if offered else []
    assert sched.connector.calls == [*tail, ("all", tables)]
    assert m.finalize_partial_tail_offloads(r) == ([] if offered else [(1, 4, 6)])  # offered once


def test_a_connector_that_answers_the_tail_with_no_bool_is_named():
    _, sched, r = _finished_with_a_partial_tail("kv_producer", take=None)
    with pytest.raises(TypeError, match=r"_Recorder.register_finished_partial_tail must return a bool \(keep the blocks\?\), got None"):
        sched._connector_finished(r)


def test_supports_hma_names_the_connectors_that_take_every_groups_table():
    assert supports_hma(_Recorder) and supports_hma(_Recorder())
    assert not supports_hma(SchedulerSideConnector) and not supports_hma(SchedulerSideConnector(KVConnectorRole.SCHEDULER))
    with pytest.raises(TypeError, match="abstract"):

        class Half(SchedulerSideConnector, SupportsHMA):
            pass

        Half(KVConnectorRole.SCHEDULER)


def test_the_engine_hands_the_scheduler_its_kv_transfer_config(tmp_path):
    cfg = KVTransferConfig("ExampleConnector", kv_role="kv_consumer", kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    eng = build_engine(num_blocks=8, block_size=4, kv_transfer_config=cfg)
    assert eng.scheduler.vllm_config.kv_transfer_config is cfg
    assert build_engine(num_blocks=8, block_size=4).scheduler.vllm_config.kv_transfer_config is None
    with pytest.raises(TypeError, match="kv_transfer_config must be None or a KVTransferConfig, got str"):
        Scheduler(KVCacheManager(num_blocks=8, block_size=4), kv_transfer_config="kv_producer")


# -- get_computed_blocks_for_connector, _get_local_prefix_cache_hit --------------------------------
def _found(result) -> tuple:
    blocks, num_local, boundary, diverged = result
    return blocks.get_block_ids(), num_local, boundary, diverged


def test_a_connector_lookup_gives_full_attentions_own_hit_and_says_it_diverged():
    """Every value below is what vLLM 0.33.0's manager gave for the same calls."""
    log = EventLog()
    m, a, b = _diverging(event_log=log)
    assert m.get_computed_blocks(b)[1] == 8  # where every group agrees
    assert _found(m.get_computed_blocks_for_connector(b)) == (([1, 2, 4], [0, 3]), 12, 0, True)
    last = [e for e in log if isinstance(e, PrefixLookup)][-1]
    assert (last.num_hit_tokens, last.hit_block_ids) == (12, [[1, 2, 4], [0, 3]])
    assert _found(m.get_computed_blocks_for_connector(b, 7)) == (([1], []), 4, 0, True)  # no state at 4
    assert _found(m.get_computed_blocks_for_connector(b, 11)) == (([1, 2], [0, 3]), 8, 0, False)
    c = Request("c", list(range(8)) + [77] * 5)
    assert _found(m.get_computed_blocks_for_connector(c)) == (([1, 2], [0, 3]), 8, 0, False)
    # a finished, and full attention's block for tokens 4-7 was evicted: the Mamba state at 8
    # is deeper than full attention's 4, which is not real -- so the answer is
    # get_computed_blocks' (0 tokens; the junction at 4 kept on the request).
    m.free(a)
    m.block_pool.evict_blocks({2})
    assert _found(m.get_computed_blocks_for_connector(b)) == (([], []), 0, 4, False)
    assert b.shared_prefix_boundary == 4
    m.check_invariants()


def test_without_a_mamba_group_the_connector_lookup_is_the_common_one():
    m = KVCacheManager(num_blocks=16, block_size=4)
    a = Request("a", list(range(10)))
    hits, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 10, n, hits)
    b = Request("b", list(range(9)) + [50])
    assert _found(m.get_computed_blocks_for_connector(b)) == (([1, 2],), 8, 0, False)
    assert _found(m.get_computed_blocks_for_connector(b, 5)) == (([1],), 4, 0, False)


@pytest.mark.parametrize(
    ("value", "error", "match"), [(21, ValueError, r"max_cache_hit_length=21 is out of range"), ("3", TypeError, "str")]
)
def test_a_bad_max_cache_hit_length_is_named_before_anything_changes(value, error, match):
    m, _, b = _diverging()
    for lookup in (m.get_computed_blocks, m.get_computed_blocks_for_connector):
        with pytest.raises(error, match=match):
            lookup(b, value)
        assert b._block_hasher is None and b.block_hashes == []  # not even bound to the manager


class _Spy(KVCacheManager):
    lookups: list[str]

    def get_computed_blocks(self, request, max_cache_hit_length=None):
        self.lookups.append("common")
        return super().get_computed_blocks(request, max_cache_hit_length)

    def get_computed_blocks_for_connector(self, request, max_cache_hit_length=None):
        self.lookups.append("connector")
        return super().get_computed_blocks_for_connector(request, max_cache_hit_length)


class _Capable(SchedulerSideConnector):
    supports_divergent_local_hybrid_hits = True


@pytest.mark.parametrize(("connector", "lookup"), [(None, "common"), (SchedulerSideConnector, "common"), (_Capable, "connector")])
def test_the_scheduler_asks_the_connector_lookup_only_for_a_capable_connector(connector, lookup):
    m = _Spy(num_blocks=16, block_size=4)
    m.lookups = []
    sched = Scheduler(m, connector=None if connector is None else connector(KVConnectorRole.SCHEDULER))
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(10)), max_tokens=1))
        out = sched.schedule()
        sched.update_from_output(out, {rid: [1]})
    assert m.lookups == [lookup, lookup]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # b's hit, either way
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3],)  # a's blocks 1 and 2, then its own


def test_a_capable_connector_is_refused_on_a_mamba_hybrid():
    m, _, _ = _diverging()
    with pytest.raises(ValueError, match=r"supports_divergent_local_hybrid_hits=True\) on a Mamba hybrid is not modelled"):
        Scheduler(m, connector=_Capable(KVConnectorRole.SCHEDULER))
    Scheduler(m, connector=SchedulerSideConnector(KVConnectorRole.SCHEDULER))  # one that is not capable runs
