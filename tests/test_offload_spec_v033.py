"""vLLM 0.33's offloading spec layer on kvlab: ``OffloadingSpecFactory`` (kvlab.kv_offload.factory),
``CPUOffloadingSpec`` (cpu/spec.py) and ``TieringOffloadingSpec`` (tiering/spec.py) -- what they
derive from an ``OffloadingConfig``, what they build, and what they refuse.

The parallel layout is a ``types.SimpleNamespace`` with vLLM's attribute names: a spec reads it
by name, as it would read vLLM's own ``OffloadingParallelConfig``.
"""

from __future__ import annotations

import glob
import mmap
import subprocess
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvlab.kv_offload import config as oc
from kvlab.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    NotASubclassError,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    ReqContext,
    make_offload_key,
)
from kvlab.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from kvlab.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.cpu.policies.arc import ARCCachePolicy
from kvlab.kv_offload.cpu.spec import CPUOffloadingSpec
from kvlab.kv_offload.factory import OffloadingSpecFactory
from kvlab.kv_offload.tiering.async_lookup import AsyncLookupManager, LookupPhase
from kvlab.kv_offload.tiering.base import TIER_LABEL, TieringOffloadingMetrics
from kvlab.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from kvlab.kv_offload.tiering.factory import SecondaryTierFactory
from kvlab.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from kvlab.kv_offload.tiering.spec import TieringOffloadingSpec

PAGE = mmap.PAGESIZE


def parallel(rank: int = 0, world_size: int = 1, **kw: Any) -> SimpleNamespace:
    fields = dict(
        rank=rank,
        world_size=world_size,
        tp_size=world_size,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
    fields.update(kw)
    return SimpleNamespace(**fields)


def make_config(extra: dict[str, Any] | None = None, **kw: Any) -> oc.OffloadingConfig:
    """A config with 16-token blocks on one layer, requests of up to 4096 tokens, 8 bytes a
    block, one block a chunk, 16 pages of host memory and one worker; ``kw`` overrides."""
    extra_config = {"cpu_bytes_to_use": 16 * PAGE, **(extra or {})}
    fields: dict[str, Any] = dict(
        groups=(oc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=8,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=f"kvlab-spec-test-{uuid.uuid4().hex[:12]}",
        model=oc.OffloadingModelConfig("m", "float16", max_model_len=4096),
        cache=oc.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=kw.pop("blocks_per_chunk", 1)),
        parallel=parallel(kw.pop("rank", 0), kw.pop("world_size", 1)),
    )
    fields.update(kw)
    return oc.OffloadingConfig(**fields)


def region_files(engine_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*")


@pytest.fixture(autouse=True)
def restore_registries():
    specs, tiers = dict(OffloadingSpecFactory._registry), dict(SecondaryTierFactory._registry)
    yield
    OffloadingSpecFactory._registry, SecondaryTierFactory._registry = specs, tiers


class MinimalSpec(OffloadingSpec):
    """An out-of-tree spec: what the base class derives, nothing more."""

    def get_manager(self) -> OffloadingManager:
        raise NotImplementedError

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        raise NotImplementedError


NotASpec = CPUOffloadingManager  # a class of kvlab's that is no spec


# -- the factory ------------------------------------------------------------------------------------


def test_factory_resolves_registered_default_and_out_of_tree_specs():
    assert sorted(OffloadingSpecFactory._registry) == ["CPUOffloadingSpec", "TieringOffloadingSpec"]
    assert OffloadingSpecFactory.get_spec_cls({}) is CPUOffloadingSpec
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "TieringOffloadingSpec"}) is TieringOffloadingSpec
    out_of_tree = {"spec_name": "MinimalSpec", "spec_module_path": __name__}
    assert OffloadingSpecFactory.get_spec_cls(out_of_tree).__name__ == "MinimalSpec"
    config = make_config(out_of_tree)
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec).__name__ == "MinimalSpec" and spec.config is config


def test_factory_refusals_name_the_problem_and_leave_the_registry_alone():
    before = dict(OffloadingSpecFactory._registry)
    with pytest.raises(ValueError, match=r"Unsupported spec type: 'Nope'; registered: \['CPUOffloadingSpec', 'TieringOffloadingSpec'\]"):
        OffloadingSpecFactory.get_spec_cls({"spec_name": "Nope"})
    with pytest.raises(ValueError, match=f"Unsupported spec type: module '{__name__}' has no 'Nope'"):
        OffloadingSpecFactory.get_spec_cls({"spec_name": "Nope", "spec_module_path": __name__})
    with pytest.raises(NotASubclassError, match="NotASpec is not an OffloadingSpec subclass") as err:
        OffloadingSpecFactory.get_spec_cls({"spec_name": "NotASpec", "spec_module_path": __name__})
    assert isinstance(err.value, TypeError) and isinstance(err.value, AssertionError)  # vLLM asserts
    with pytest.raises(ValueError, match="Connector 'CPUOffloadingSpec' is already registered"):
        OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "x", "Y")
    with pytest.raises(TypeError, match="module_path must be a non-empty str, got ''"):
        OffloadingSpecFactory.register_spec("Other", "", "Y")
    with pytest.raises(TypeError, match="extra_config must be a dict"):
        OffloadingSpecFactory.get_spec_cls([("spec_name", "CPUOffloadingSpec")])  # type: ignore[arg-type]  # the refusal under test
    with pytest.raises(TypeError, match="config must be an OffloadingConfig .* got SimpleNamespace"):
        OffloadingSpecFactory.create_spec(SimpleNamespace(extra_config={}))  # type: ignore[arg-type]  # the refusal under test
    assert OffloadingSpecFactory._registry == before


def test_a_registered_spec_loads_only_when_asked_for():
    OffloadingSpecFactory.register_spec("Minimal", __name__, "MinimalSpec")
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "Minimal"}).__name__ == "MinimalSpec"
    OffloadingSpecFactory.register_spec("Broken", "kvlab_no_such_module", "X")  # no import yet
    with pytest.raises(ModuleNotFoundError):
        OffloadingSpecFactory.get_spec_cls({"spec_name": "Broken"})


def test_the_base_spec_derives_the_chunk_geometry_and_event_switches():
    groups = (oc.OffloadingGroupConfig(12, ("a",), 0), oc.OffloadingGroupConfig(16, ("b",), 1))
    config = make_config({"self_describing_kv_events": True, "offload_prompt_only": False}, groups=groups, blocks_per_chunk=2)
    spec = MinimalSpec(config)
    assert (spec.tokens_per_block, spec.tokens_per_hash, spec.blocks_per_chunk) == ((12, 16), 16, 2)
    assert (spec.replicated_layout, spec.offload_prompt_only) == (False, False)
    assert (spec.kv_events_config.enable_kv_cache_events, spec.kv_events_config.self_describing_kv_events) == (False, True)
    assert MinimalSpec(make_config()).offload_prompt_only is True
    assert MinimalSpec.build_metric_definitions({}) == {} and MinimalSpec.config_info_keys({}) == ()


# -- the CPU spec -----------------------------------------------------------------------------------


def test_cpu_spec_sizes_a_chunk_from_every_workers_bytes_padded_to_a_page():
    # 16 bytes a block x 2 blocks a chunk x 6 workers = 192 bytes, padded to one page.
    spec = CPUOffloadingSpec(
        make_config({"cpu_bytes_to_use": 3 * PAGE + 5}, worker_kv_bytes_per_block=16, blocks_per_chunk=2, world_size=6)
    )
    assert (spec.cpu_page_size_per_worker, spec.kv_bytes_per_chunk, spec.num_chunks) == (32, PAGE, 3)
    # Two pages' worth a chunk: 2 x PAGE bytes per block, one block a chunk, one worker.
    big = CPUOffloadingSpec(make_config({"cpu_bytes_to_use": 7 * PAGE}, worker_kv_bytes_per_block=2 * PAGE))
    assert (big.cpu_page_size_per_worker, big.kv_bytes_per_chunk, big.num_chunks) == (2 * PAGE, 2 * PAGE, 3)
    empty = CPUOffloadingSpec(make_config(worker_kv_bytes_per_block=0, world_size=4))
    assert (empty.cpu_page_size_per_worker, empty.kv_bytes_per_chunk, empty.num_chunks) == (0, 0, 0)


def test_cpu_spec_keeps_one_copy_per_worker_without_a_shared_region():
    # This machine has no CUDA: the CPU spec keeps private tensors, so a replicated layout
    # cannot share one copy -- four workers take four copies.
    spec = CPUOffloadingSpec(
        make_config({"cpu_bytes_to_use": 8 * PAGE}, worker_kv_bytes_per_block=PAGE, world_size=4, replicated_layout=True)
    )
    assert spec._uses_shared_region() is False
    assert (spec.replicated_layout, spec.kv_bytes_per_chunk, spec.num_chunks) == (False, 4 * PAGE, 2)


def test_cpu_spec_refuses_a_missing_or_bad_cpu_budget():
    config = make_config()
    for bad, error, message in [
        (None, ValueError, "cpu_bytes_to_use must be specified in kv_connector_extra_config .* got None"),
        (0, ValueError, "cpu_bytes_to_use must be specified in kv_connector_extra_config .* got 0"),
        ("lots", TypeError, "cpu_bytes_to_use must be an int >= 1, got str 'lots'"),
        (-4, ValueError, "cpu_bytes_to_use=-4 is out of range"),
    ]:
        extra = {"cpu_bytes_to_use": bad} if bad is not None else {}
        with pytest.raises(error, match=message):
            CPUOffloadingSpec(oc.OffloadingConfig(**{**config.__dict__, "extra_config": extra}))
    with pytest.raises(TypeError, match="config.extra_config must be a dict"):
        CPUOffloadingSpec(oc.OffloadingConfig(**{**config.__dict__, "extra_config": None}))  # type: ignore[arg-type]  # refusal


def test_cpu_spec_builds_its_manager_once_with_the_configured_policy_and_admission():
    spec = CPUOffloadingSpec(make_config({"eviction_policy": "arc", "store_threshold": 2, "max_tracker_size": 7}, blocks_per_chunk=2))
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager) and spec.get_manager() is manager
    assert (manager.num_blocks, manager.store_threshold, manager.max_tracker_size) == (16, 2, 7)
    assert isinstance(manager._policy, ARCCachePolicy) and manager.events is None
    # 16 chunks of 32 tokens; a 4096-token request takes 128 chunks: 16 x 4096 / 128 tokens.
    assert manager.config_info() == [
        {"cpu_num_chunks": 16, "cpu_blocks_per_chunk": 2, "cpu_kv_cache_size_bytes": 16 * PAGE, "cpu_kv_cache_size_tokens": 512}
    ]
    assert CPUOffloadingSpec.config_info_keys({}) == (
        "cpu_num_chunks",
        "cpu_blocks_per_chunk",
        "cpu_kv_cache_size_bytes",
        "cpu_kv_cache_size_tokens",
    )
    events = CPUOffloadingSpec(make_config(enable_kv_cache_events=True)).get_manager()
    assert isinstance(events, CPUOffloadingManager) and events.events == []


def test_cpu_spec_declares_its_metrics_and_the_skip_counter_only_with_a_threshold():
    plain = CPUOffloadingSpec.build_metric_definitions({"store_threshold": 1})
    assert sorted(plain) == sorted(
        [
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
            CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC,
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
            CPUOffloadingMetrics.CPU_ALLOCATION_SIZE,
        ]
    )
    sizes = plain[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE]
    assert isinstance(sizes, OffloadingHistogramMetadata) and sizes.buckets == tuple(4**i for i in range(10))
    with_threshold = CPUOffloadingSpec.build_metric_definitions({"store_threshold": 2})
    assert len(with_threshold) == 5 and isinstance(with_threshold[CPUOffloadingMetrics.STORES_SKIPPED], OffloadingCounterMetadata)


def _caches(num_blocks: int = 4, page: int = 64) -> CanonicalKVCaches:
    tensor = torch.arange(num_blocks * page, dtype=torch.int32).to(torch.int8).view(num_blocks, page)
    return CanonicalKVCaches([CanonicalKVCacheTensor(tensor, page)], [[CanonicalKVCacheRef(0, page)]])


def test_cpu_spec_worker_round_trips_a_block_through_private_host_tensors():
    spec = CPUOffloadingSpec(make_config({"cpu_bytes_to_use": 3 * PAGE}, worker_kv_bytes_per_block=64))
    caches = _caches()
    worker = spec.get_worker(caches)
    assert isinstance(worker, CPUOffloadingWorker) and spec.get_worker(caches) is worker
    assert worker._mmap_region is None  # no CUDA here: private tensors, one row per chunk
    assert [tuple(t.shape) for t in worker._store_handler.dst_tensors] == [(spec.num_chunks, 64)] == [(3 * PAGE // PAGE, 64)]
    gpu = caches.tensors[0].tensor
    original = gpu[2].clone()
    assert worker.submit_store(1, GPULoadStoreSpec([2], (1,), (0,)), CPULoadStoreSpec([1]))
    assert worker.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([0], (1,), (0,)))
    assert sorted((r.job_id, r.success, r.transfer_size) for r in worker.get_finished()) == [(1, True, 64), (2, True, 64)]
    assert torch.equal(gpu[0], original)
    worker.shutdown()


def test_cpu_spec_worker_class_is_loaded_on_first_use_and_may_be_swapped(monkeypatch):
    import kvlab.kv_offload.cpu.spec as cpu_spec

    assert cpu_spec.CPUOffloadingWorker is CPUOffloadingWorker
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cpu_spec, "CPUOffloadingWorker", lambda **kw: calls.append(kw) or "worker")
    spec = CPUOffloadingSpec(make_config(blocks_per_chunk=2))
    assert spec.create_worker(_caches()) == "worker"
    assert [(c["blocks_per_chunk"], c["num_cpu_chunks"], c["mmap_region"]) for c in calls] == [(2, 16, None)]
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        cpu_spec.Nope  # noqa: B018  (the attribute lookup is the test)


def test_spec_modules_load_no_torch_and_no_worker_code():
    code = (
        "import sys; import kvlab.kv_offload.factory as f; import kvlab.kv_offload.tiering.spec, kvlab.kv_offload.cpu.spec; "
        "f.OffloadingSpecFactory.get_spec_cls({'spec_name': 'TieringOffloadingSpec'}); "
        "print(sorted(m for m in ('torch', 'kvlab.kv_offload.cpu.gpu_worker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# -- the tiering spec -------------------------------------------------------------------------------


def test_tiering_spec_builds_a_cpu_tier_on_the_shared_region_and_its_secondary_tiers():
    extra = {"secondary_tiers": [{"type": "example", "custom_param": 3}, {"type": "example"}], "tier_poll_interval_s": 0}
    config = make_config(extra, blocks_per_chunk=2)
    spec = TieringOffloadingSpec(config)
    assert (spec.num_chunks, spec.kv_bytes_per_chunk, spec.cpu_page_size_per_worker) == (16, PAGE, 16)
    manager = spec.get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager) and spec.get_manager() is manager
        assert isinstance(manager.primary_tier, CPUPrimaryTierOffloadingManager) and manager.primary_tier.num_blocks == 16
        assert [type(t) for t in manager.secondary_tiers] == [ExampleSecondaryTierManager] * 2
        assert [t.block_size_bytes for t in manager.secondary_tiers] == [PAGE, PAGE]
        assert spec.get_manager().config_info() == [
            {
                "tier": "0:primary",
                "cpu_num_chunks": 16,
                "cpu_blocks_per_chunk": 2,
                "cpu_kv_cache_size_bytes": 16 * PAGE,
                "cpu_kv_cache_size_tokens": 512,
            },
            {"tier": "1:example", "example_info": 3},
            {"tier": "2:example", "example_info": 0},
        ]
        assert len(region_files(config.engine_id)) == 1  # the scheduler maps the region the workers write
    finally:
        manager.shutdown()
    assert region_files(config.engine_id) == []


def test_tiering_spec_shares_one_copy_when_replicated_on_every_platform():
    spec = TieringOffloadingSpec(
        make_config({"cpu_bytes_to_use": 8 * PAGE}, worker_kv_bytes_per_block=PAGE, world_size=4, replicated_layout=True)
    )
    assert (spec.replicated_layout, spec.cpu_page_size_per_worker, spec.kv_bytes_per_chunk, spec.num_chunks) == (True, PAGE, PAGE, 8)


def test_tiering_spec_merges_backpressure_per_key_into_copies_of_the_tier_configs():
    tiers = [
        {"type": "example", "backpressure": {"high_water_s": 0.5}},
        {"type": "example"},
        {"type": "example", "backpressure": {}},
    ]
    extra = {"secondary_tiers": tiers, "backpressure": {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.1}}
    spec = TieringOffloadingSpec(make_config(extra))
    assert [c.get("backpressure") for c in spec.secondary_tier_configs] == [
        {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.5},
        {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.1},
        {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.1},
    ]
    assert tiers[1] == {"type": "example"} and tiers[2] == {"type": "example", "backpressure": {}}  # the caller's dicts
    alone = TieringOffloadingSpec(make_config({"secondary_tiers": [{"type": "example"}, {"type": "example", "backpressure": {}}]}))
    assert [c.get("backpressure", "none") for c in alone.secondary_tier_configs] == ["none", {}]


def test_tiering_spec_labels_and_metrics_cover_every_tier():
    extra = {"secondary_tiers": [{"type": "example"}]}
    assert TieringOffloadingSpec.config_info_keys(extra) == (
        "cpu_num_chunks",
        "cpu_blocks_per_chunk",
        "cpu_kv_cache_size_bytes",
        "cpu_kv_cache_size_tokens",
        TIER_LABEL,
        "example_info",
    )
    metrics = TieringOffloadingSpec.build_metric_definitions(extra)
    assert len(metrics) == 4 + 19
    assert metrics[TieringOffloadingMetrics.PROMOTION_LATENCY].labelnames == (TIER_LABEL, "result")
    assert metrics[TieringOffloadingMetrics.PROMOTION_ALLOCATION_FAILURES].labelnames == ()


def test_tiering_spec_refusals_leave_no_region_behind():
    with pytest.raises(ValueError, match="secondary_tiers must be a list of tier configurations, got dict"):
        TieringOffloadingSpec(make_config({"secondary_tiers": {"type": "example"}}))
    with pytest.raises(TypeError, match=r"secondary_tiers\[0\] must be a dict with 'type', got str"):
        TieringOffloadingSpec(make_config({"secondary_tiers": ["example"]}))
    with pytest.raises(TypeError, match=r"secondary_tiers\[0\]\['backpressure'\] must be None or a dict, got list"):
        TieringOffloadingSpec(make_config({"secondary_tiers": [{"type": "example", "backpressure": []}]}))
    config = make_config({"store_threshold": 2})
    with pytest.raises(ValueError, match="store_threshold is not supported for TieringOffloadingSpec"):
        TieringOffloadingSpec(config).get_manager()
    assert region_files(config.engine_id) == []
    # A tier that fails to build: the region and the CPU tier built before it are released.
    config = make_config({"secondary_tiers": [{"type": "example"}, {"type": "nope"}]})
    spec = TieringOffloadingSpec(config)
    with pytest.raises(ValueError, match="Unknown secondary tier type: 'nope'"):
        spec.get_manager()
    assert (spec._manager, spec._scheduler_mmap, region_files(config.engine_id)) == (None, None, [])


def test_tiering_spec_worker_writes_its_own_slot_of_the_shared_region():
    spec = TieringOffloadingSpec(make_config({"cpu_bytes_to_use": 4 * PAGE}, worker_kv_bytes_per_block=64, rank=1, world_size=2))
    assert (spec.num_chunks, spec.kv_bytes_per_chunk, spec.cpu_page_size_per_worker) == (4, PAGE, 64)
    caches = _caches()
    worker = spec.get_worker(caches)
    try:
        region = worker._mmap_region
        assert region is not None and (region.rank, region.num_chunks) == (1, 4)
        assert worker.submit_store(1, GPULoadStoreSpec([3], (1,), (0,)), CPULoadStoreSpec([2]))
        rows = np.frombuffer(region.mmap_obj, dtype=np.int8).reshape(4, PAGE)  # type: ignore[arg-type]  # mapped while the worker lives
        assert np.array_equal(rows[2, 64:128], caches.tensors[0].tensor[3].numpy())  # rank 1's slot
        assert int(np.count_nonzero(rows[:, :64])) == 0  # rank 0's slots untouched
        del rows
    finally:
        worker.shutdown()
    assert region_files(spec.config.engine_id) == []


def test_tiering_spec_canonical_layout_needs_certified_mappings():
    config = make_config({"cpu_bytes_to_use": 4 * PAGE}, worker_kv_bytes_per_block=64, canonical_layout=True)
    spec = TieringOffloadingSpec(config)
    with pytest.raises(RuntimeError, match="canonical_layout was requested but some layer's KV layout has no certified canonical mapping"):
        spec.create_worker(_caches())
    assert spec.all_layers_portable is None and region_files(config.engine_id) == []


# -- the pieces vLLM's tests reach through the specs ------------------------------------------------


def test_secondary_tier_takes_any_view_with_row_strides_but_checks_a_memoryview():
    view = SimpleNamespace(strides=(PAGE, 1))
    assert ExampleSecondaryTierManager(None, view, "example").block_size_bytes == PAGE  # type: ignore[arg-type]  # duck view
    with pytest.raises(TypeError, match="2-D memoryview .* got 1-D"):
        ExampleSecondaryTierManager(None, memoryview(bytearray(8)), "example")
    with pytest.raises(TypeError, match="2-D memoryview .* got list"):
        ExampleSecondaryTierManager(None, [b"row"], "example")  # type: ignore[arg-type]  # the refusal under test
    with pytest.raises(AssertionError, match="primary_kv_view.strides cannot be None"):
        ExampleSecondaryTierManager(None, SimpleNamespace(strides=None), "example")  # type: ignore[arg-type]
    with pytest.raises(NotASubclassError, match="unittest.mock.MagicMock is not a SecondaryTierManager subclass"):
        SecondaryTierFactory.get_tier_class({"type": "MagicMock", "module_path": "unittest.mock"})


class _Lookups(AsyncLookupManager):
    """Never asked in this test: the answers are put on the queue by hand."""

    def batch_lookup(self, keys: list[Any], req_context: ReqContext) -> list[bool]:
        return [True] * len(keys)


def test_async_lookup_refuses_a_second_answer_for_one_probe():
    lookups = _Lookups("test")
    key = make_offload_key(b"h" * 8, 0)
    try:
        assert lookups.lookup(key, ReqContext("r")) is None
        state = lookups._lookup_state[key]
        lookups._lookup_batch.clear()  # never sent to the thread: the answers below are the only ones
        state.phase = LookupPhase.IN_FLIGHT
        lookups._pending_results.put([(key, state.generation, True)])
        lookups.drain_results()
        assert (state.result, state.phase.name) == (True, "RESOLVED")
        lookups._pending_results.put([(key, state.generation, False)])
        with pytest.raises(AssertionError, match="a second lookup answer for generation 0 of a key .RESOLVED."):
            lookups.drain_results()
        assert state.result is True
    finally:
        lookups.shutdown()
