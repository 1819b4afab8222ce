"""vLLM 0.33's way of building the scheduler: from the engine config, the KV-cache manager and
the connector built on the way (``kvlab.engine.vllm_config``), and a connector written for
vLLM -- ``(vllm_config, role, kv_cache_config)`` -- built as vLLM builds it. vLLM's own
HiSparse admission tests (``test_hisparse_async_admission_requires_full_prompt_host_pages``,
``test_hisparse_admitted_async_loads_can_finish_with_nothing_running``) build their scheduler
this way and pass on kvlab (scripts/vllm_tests). kvlab's environment has no vLLM, so these
tests hand over configs with vLLM's attribute names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlab import FullAttentionSpec, Request
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.sched.output import CachedRequestData
from kvlab.core.sched.scheduler import Scheduler
from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from kvlab.engine.vllm_config import scheduler_kwargs_from_vllm_config
from kvlab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from kvlab.request import RequestStatus
from scheduler_side_connector import SchedulerSideConnector

BS = 16


class VllmShapedConnector(SchedulerSideConnector):
    """A connector written for vLLM: built from the engine config, its settings read from
    ``self._kv_transfer_config``; every request gets ``matched`` tokens, loaded asynchronously."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.matched = self._kv_transfer_config.kv_connector_extra_config["matched_tokens"]

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.matched, True


class HMAConnector(VllmShapedConnector, SupportsHMA):
    def request_finished_all_groups(self, request, block_ids):
        return False, None


KVConnectorFactory.register_connector("TestVllmShaped", __name__, "VllmShapedConnector")
KVConnectorFactory.register_connector("TestVllmShapedHMA", __name__, "HMAConnector")


def vllm_config(*, connector: str | None = None, hma_off: bool = True, **sched) -> SimpleNamespace:
    transfer = None
    if connector is not None:
        transfer = KVTransferConfig(connector, kv_connector_extra_config={"matched_tokens": BS})
    sched = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_num_scheduled_tokens": None,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
        "policy": "fcfs",
        "scheduler_reserve_full_isl": True,
        "disable_hybrid_kv_cache_manager": hma_off,
        **sched,
    }
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(**sched),
        model_config=SimpleNamespace(max_model_len=256),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        kv_events_config=None,
        kv_transfer_config=transfer,
        lora_config=None,
        speculative_config=None,
    )


def kv_cache_config(num_blocks: int = 32) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=(KVCacheGroupSpec(("layer",), FullAttentionSpec(block_size=BS)),)
    )


def test_the_scheduler_is_built_from_vllms_config():
    sched = Scheduler(**scheduler_kwargs_from_vllm_config(vllm_config(max_num_scheduled_tokens=48), kv_cache_config(), BS))
    mgr = sched.kv_cache_manager
    assert (mgr.block_pool.num_gpu_blocks, mgr.enable_caching, mgr.hash_block_size) == (32, True, BS)
    assert (sched.max_num_scheduled_tokens, sched.max_num_running_reqs, sched.max_model_len) == (48, 8, 256)
    assert (sched.policy, sched.scheduler_reserve_full_isl, sched.connector) == ("fcfs", True, None)
    sched.add_request(Request("a", list(range(40))))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 40}
    assert out.scheduled_cached_reqs.resumed_req_ids == set()  # a resumed request comes whole, among the new


def test_a_vllm_shaped_connector_is_built_as_vllm_builds_it():
    config = vllm_config(connector="TestVllmShaped")
    sched = Scheduler(**scheduler_kwargs_from_vllm_config(config, kv_cache_config(), BS))
    conn = sched.connector
    assert type(conn) is VllmShapedConnector
    assert (conn.role, conn._vllm_config, conn._kv_transfer_config, conn.matched) == (
        KVConnectorRole.SCHEDULER,
        config,
        config.kv_transfer_config,
        BS,
    )
    assert conn._kv_cache_manager is sched.kv_cache_manager  # bound, as vLLM's scheduler binds it
    r = Request("a", list(range(48)))
    sched.add_request(r)
    sched.schedule()
    # vLLM's _inflight_prefills: the requests themselves
    assert (r.status, r.num_computed_tokens, sched._inflight_prefills) == (RequestStatus.WAITING_FOR_REMOTE_KVS, BS, {r})


def test_hma_is_refused_for_a_connector_without_it_as_vllm_does():
    assert (KVConnectorFactory.supports_hma_config(KVTransferConfig("TestVllmShaped")),) == (False,)
    assert KVConnectorFactory.supports_hma_config(KVTransferConfig("TestVllmShapedHMA"))
    with pytest.raises(ValueError, match="Connector VllmShapedConnector does not support HMA but HMA is enabled"):
        scheduler_kwargs_from_vllm_config(vllm_config(connector="TestVllmShaped", hma_off=False), kv_cache_config(), BS)
    kwargs = scheduler_kwargs_from_vllm_config(vllm_config(connector="TestVllmShapedHMA", hma_off=False), kv_cache_config(), BS)
    assert type(kwargs["connector"]) is HMAConnector


def test_kvlabs_own_connector_from_vllms_config_takes_the_groups_block_size():
    config = vllm_config(connector="OffloadingConnector")
    config.kv_transfer_config = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 4})
    conn = Scheduler(**scheduler_kwargs_from_vllm_config(config, kv_cache_config(), BS)).connector
    assert isinstance(conn, OffloadingConnector) and (conn.block_size, conn.num_cpu_blocks) == (BS, 4)
    # and kvlab's own call is unchanged
    assert KVConnectorFactory.create_connector(KVTransferConfig("OffloadingConnector"), KVConnectorRole.SCHEDULER, 8).block_size == 8


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: scheduler_kwargs_from_vllm_config({}, kv_cache_config(), BS), TypeError, "vllm_config must be a VllmConfig"),
        (
            lambda: scheduler_kwargs_from_vllm_config(
                SimpleNamespace(**{**vars(vllm_config()), "speculative_config": object()}), kv_cache_config(), BS
            ),
            ValueError,
            "schedules no draft tokens",
        ),
        (lambda: scheduler_kwargs_from_vllm_config(vllm_config(), kv_cache_config(), 0), ValueError, "block_size=0"),
        (lambda: KVConnectorFactory.get_connector_class(KVTransferConfig("Nope")), ValueError, "unknown kv_connector 'Nope'"),
        (lambda: VllmShapedConnector({}, KVConnectorRole.SCHEDULER, None), TypeError, "vllm_config must be a VllmConfig"),
        (lambda: SchedulerSideConnector("scheduler"), TypeError, "role must be a KVConnectorRole"),
        (
            lambda: KVConnectorFactory.create_connector(KVTransferConfig("HiSparseConnector"), KVConnectorRole.SCHEDULER, BS),
            TypeError,
            r"HiSparseConnector is built from vLLM's call, create_connector\(vllm_config, role, kv_cache_config\)",
        ),
    ],
)
def test_bad_configs_are_refused_by_name(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_hisparse_connector_from_vllms_config():
    from test_hisparse_runtime import hisparse_manager

    from kvlab.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnector

    m = hisparse_manager()
    config = vllm_config(hma_off=False)
    config.kv_transfer_config = KVTransferConfig("HiSparseConnector")
    config.scheduler_config.async_scheduling = False
    config.num_lookahead_tokens = 0
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, m.kv_cache_config)
    assert type(conn) is HiSparseConnector and KVConnectorFactory.supports_hma_config(config.kv_transfer_config)


def test_cached_request_data_has_vllms_resumed_ids():
    assert CachedRequestData().resumed_req_ids == set()


def test_binding_offers_the_gpu_pool_and_layouts_are_vllms():
    class PoolWatcher(SchedulerSideConnector):
        pools: list = []

        def bind_gpu_block_pool(self, gpu_block_pool):
            self.pools.append(gpu_block_pool)

    conn = PoolWatcher(KVConnectorRole.SCHEDULER)
    sched = Scheduler(**scheduler_kwargs_from_vllm_config(vllm_config(), kv_cache_config(), BS))
    conn.bind_kv_cache_manager(sched.kv_cache_manager)
    assert conn.pools == [sched.kv_cache_manager.block_pool]
    hisparse = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=object()))
    assert [
        SchedulerSideConnector.get_required_kvcache_layout(vllm_config()),
        OffloadingConnector.get_required_kvcache_layout(vllm_config()),
        OffloadingConnector.get_required_kvcache_layout(hisparse),
    ] == [None, "LBHNC", "BLHNC"]
