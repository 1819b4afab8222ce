"""``reset_prefix_cache`` (vLLM 0.33's ``Scheduler.reset_prefix_cache`` and
``reset_connector_cache``): refused while a request holds blocks, unless every running
request is preempted first; the connector's tiers emptied on request; all or nothing."""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, Request, SimulatedExecutor
from kvlab.core.sched.scheduler import Scheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from kvlab.engine.llm_engine import LLMEngine
from kvlab.eventlog.events import EventLog
from scheduler_side_connector import SchedulerSideConnector

BS = 4


def _engine(connector=None, worker=None) -> tuple[LLMEngine, KVCacheManager, EventLog]:
    log = EventLog()
    mgr = KVCacheManager(num_blocks=12, block_size=BS, event_log=log)
    return LLMEngine(mgr, Scheduler(mgr, connector=connector), SimulatedExecutor(kv_connector=worker)), mgr, log


def _offload_engine() -> tuple[LLMEngine, KVCacheManager, EventLog, OffloadingConnector]:
    conn = OffloadingConnector(KVConnectorRole.SCHEDULER, BS, {"num_cpu_blocks": 8})
    eng, mgr, log = _engine(conn, OffloadingConnector(KVConnectorRole.WORKER, BS, {"num_cpu_blocks": 8}))
    return eng, mgr, log, conn


def _hit(mgr: KVCacheManager, tokens: list[int]) -> int:
    return mgr.get_computed_blocks(Request("probe", tokens, max_tokens=1))[1]


def test_refused_while_a_request_holds_blocks_and_nothing_changes() -> None:
    eng, mgr, _ = _engine()
    eng.add_request(Request("a", list(range(13)), max_tokens=3))
    eng.step()
    assert eng.reset_prefix_cache() is False
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4],) and _hit(mgr, list(range(13))) == 12  # still cached
    eng.run()
    assert eng.reset_prefix_cache() is True  # nothing holds a block now
    assert _hit(mgr, list(range(13))) == 0


def test_preempting_every_running_request_first_then_they_recompute() -> None:
    eng, mgr, log = _engine()
    eng.add_request(Request("a", list(range(13)), max_tokens=3))
    eng.add_request(Request("b", list(range(100, 109)), max_tokens=3))
    eng.step()
    assert eng.reset_prefix_cache(reset_running_requests=True) is True
    preempted = [(e.request_id, e.num_computed_tokens_lost) for e in log if e.kind == "request_preempted"]
    assert preempted == [("b", 9), ("a", 13)]  # newest first, each back to the head of the queue
    assert [r.request_id for r in eng.scheduler.waiting] == ["a", "b"]
    assert (mgr.block_pool.get_num_free_blocks(), _hit(mgr, list(range(13)))) == (11, 0)
    eng.run()
    assert sorted(eng.finished) == ["a", "b"] and eng.finished["a"].num_preemptions == 1


def test_the_connectors_tiers_are_emptied_only_when_asked() -> None:
    eng, mgr, _, conn = _offload_engine()
    eng.add_request(Request("a", list(range(13)), max_tokens=2))
    eng.run()
    tier = conn.scheduler.manager.primary
    assert len(tier.entries()) == 3  # the prompt's three whole blocks were stored
    assert eng.reset_prefix_cache() is True and len(tier.entries()) == 3  # the GPU cache only
    assert eng.reset_prefix_cache(reset_connector=True) is True and tier.entries() == []
    assert eng.scheduler.connector_prefix_cache_stats.reset is True
    eng.add_request(Request("b", list(range(13)), max_tokens=2))
    eng.run()
    assert eng.scheduler.connector_prefix_cache_stats.hits == 0  # nothing left to load: recomputed, stored again
    assert len(tier.entries()) == 3


def test_a_connector_that_cannot_reset_now_makes_the_call_false() -> None:
    class NotNow(SchedulerSideConnector):
        def reset_cache(self):
            return False

    eng, mgr, _ = _engine(NotNow(KVConnectorRole.SCHEDULER))
    eng.add_request(Request("a", list(range(13)), max_tokens=2))
    eng.run()
    assert eng.reset_prefix_cache(reset_connector=True) is False  # the GPU cache was reset all the same
    assert _hit(mgr, list(range(13))) == 0 and eng.scheduler.connector_prefix_cache_stats.reset is False


def test_bad_arguments_and_a_raising_connector_leave_everything_as_it_was() -> None:
    class Broken(SchedulerSideConnector):
        def reset_cache(self):
            raise OSError("tier offline")

    eng, mgr, log = _engine(Broken(KVConnectorRole.SCHEDULER))
    eng.add_request(Request("a", list(range(13)), max_tokens=3))
    eng.step()
    with pytest.raises(TypeError, match="reset_running_requests must be a bool"):
        eng.reset_prefix_cache(reset_running_requests="yes")  # type: ignore[arg-type]
    with pytest.raises(OSError, match="tier offline"):
        eng.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    # undone: a still runs with its blocks, its prefix still cached, no preemption logged
    assert [r.request_id for r in eng.scheduler.running] == ["a"] and mgr.get_block_ids("a") == ([1, 2, 3, 4],)
    assert _hit(mgr, list(range(13))) == 12 and not [e for e in log if e.kind == "request_preempted"]
    eng.run()
    assert eng.finished["a"].num_preemptions == 0
