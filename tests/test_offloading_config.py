"""The offloading connector's view of the engine (vLLM 0.33): ``build_offloading_config`` and
the scheduler half's ``SchedulerOffloadConfig``, the tensor-parallel replica count they read,
vLLM's block-size rule for an engine config, the spec -> manager registry, and the events
tracker that gives offloaded chunks self-describing KV events.

The expected values were first produced by vLLM 0.33.0's own functions on the same configs
(``scripts/vllm_tests/differential_offload_config.py`` compares the two on 14 of them).
kvlab's environment has no vLLM, so the engine config is a stand-in with vLLM's names."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvlab.core.kv_cache_planning import kv_cache_groups_tp_replicas
from kvlab.core.kv_cache_utils import resolve_kv_cache_block_sizes
from kvlab.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from kvlab.distributed.kv_events import BlockRemoved, BlockStored
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config, get_sliding_window_size_in_chunks
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventGroupSpec, OffloadingEventsTracker
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig, SchedulerOffloadConfig
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvlab.kv_cache_spec_registry import KVCacheSpecRegistry, register_kv_cache_spec
from kvlab.kv_offload.base import Medium, OffloadingEvent, OffloadingKVEventsConfig, OffloadingSpec, make_offload_key


def vllm_config(extra: dict[str, Any] | None = None, *, tp: int = 1, dcp: int = 1, mla: bool = False, v2: bool = True,
                backend: str = "mp", heads: int = 4, retention: int | None = None) -> SimpleNamespace:  # fmt: skip
    parallel = SimpleNamespace(
        tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=1, pipeline_parallel_size=1,
        world_size=tp, distributed_executor_backend=backend, nnodes_within_dp=1, rank=0, data_parallel_index=0,
        data_parallel_size=1, data_parallel_rank_local=None,
    )  # fmt: skip
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=16,
            enable_prefix_caching=True,
            prefix_match_unit=None,
            cache_dtype="auto",
            prefix_cache_retention_interval=retention,
            kv_cache_layout=None,
        ),  # fmt: skip
        model_config=SimpleNamespace(model="m", dtype="bfloat16", max_model_len=4096, use_mla=mla, get_total_num_kv_heads=lambda: heads),
        parallel_config=parallel,
        kv_events_config=None,
        use_v2_model_runner=v2,
        speculative_config=None,
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=dict(extra or {}), engine_id="e0"),
    )


def full(bs: int = 16, heads: int = 4, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=8, dtype="float32", **kw)


def mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float32", max_tp_shards=1)


def swa(window: int, bs: int = 16, **kw: Any) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=4, head_size=8, dtype="float32", sliding_window=window, **kw)


def mamba() -> MambaSpec:
    return MambaSpec(block_size=16, shapes=((4, 4),), dtypes=("float32",), mamba_cache_mode="align")


def kv_cache_config(*specs: Any, num_blocks: int = 8, tensors: bool = True, tp: int = 1) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    page = max(s.page_size_bytes for s in specs)
    layers = [f"l{i}" for i in range(len(specs))]
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * 3, layers=layers, layer_stride=0, block_stride=page)] if tensors else [],
        kv_cache_groups=groups,
    )
    cfg.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, tp)
    return cfg


class Spec(OffloadingSpec):
    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, *args: Any) -> Any:
        raise NotImplementedError


def scheduler_config(vc: SimpleNamespace, kc: KVCacheConfig) -> SchedulerOffloadConfig:
    return SchedulerOffloadConfig.from_spec(Spec(build_offloading_config(vc, kc)), vc, kc)


# -- build_offloading_config ----------------------------------------------------------------------
def test_a_chunk_of_64_tokens_is_four_16_token_blocks() -> None:
    oc = build_offloading_config(vllm_config({"block_size": 64}), kv_cache_config(full()))
    assert [(g.group_id, g.tokens_per_block, g.layer_names, g.sliding_window_size_in_chunks) for g in oc.groups] == [(0, 16, ("l0",), None)]
    assert (oc.cache.tokens_per_hash, oc.cache.blocks_per_chunk) == (16, 4)
    assert oc.worker_kv_bytes_per_block == 12288  # the backing tensor's 3 pages of 4096 bytes per block
    assert (oc.model.name, oc.model.dtype, oc.model.max_model_len, oc.engine_id) == ("m", "bfloat16", 4096, "e0")
    assert scheduler_config(vllm_config({"block_size": 64}), kv_cache_config(full())).alignment_tokens == 64


def test_every_kind_of_group_gets_its_reach_in_chunks() -> None:
    kc = kv_cache_config(full(), swa(128), ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64), mamba())
    oc = build_offloading_config(vllm_config(), kc)
    # full: all; window 128: 8 chunks of 16; a 64-token local chunk: 4; Mamba: its one state
    assert [(g.group_id, g.sliding_window_size_in_chunks) for g in oc.groups] == [(0, None), (1, 8), (2, 4), (3, 1)]
    sc = scheduler_config(vllm_config(), kc)
    assert [(g.manager_cls, g.requires_cow_source, g.kv_event_group_spec) for g in sc.kv_group_configs] == [
        (FullAttentionManager, False, ("full_attention", None)),
        (SlidingWindowManager, False, ("sliding_window", 128)),
        (ChunkedLocalAttentionManager, False, ("chunked_local_attention", None)),
        (MambaManager, True, ("mamba", None)),
    ]
    # a load ending at token 40 (8 tokens short of a chunk edge) may need one more window chunk
    assert [g.load_window_size_in_chunks(40) for g in sc.kv_group_configs] == [None, 9, 4, 1]
    assert (sc.alignment_tokens, sc.supports_partial_tail, sc.kv_bytes_per_token) == (16, False, 772)


def test_a_window_that_keeps_tokens_below_it_reaches_one_chunk_further() -> None:
    assert get_sliding_window_size_in_chunks(swa(128), 16) == 8
    assert get_sliding_window_size_in_chunks(swa(128, extra_retained_tokens=3), 16) == 9  # 130 tokens back
    assert get_sliding_window_size_in_chunks(full(), 16) is None
    with pytest.raises(TypeError, match="no offload window rule for CircularBufferSpec"):
        get_sliding_window_size_in_chunks(CircularBufferSpec(block_size=4), 16)


def test_a_scratch_ring_is_not_offloaded_and_hisparse_offloads_its_indexer() -> None:
    kc = kv_cache_config(full(), mamba())
    kc.kv_cache_groups.insert(1, KVCacheGroupSpec(["scratch"], CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=8)))
    assert [g.group_id for g in build_offloading_config(vllm_config(), kc).groups] == [0, 2]
    hisparse = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["source"], full(), host_resident=True, role=KVCacheGroupRole.HISPARSE_SOURCE),
            KVCacheGroupSpec(["indexer"], full(), role=KVCacheGroupRole.HISPARSE_INDEXER),
        ],
        hisparse_host_num_blocks=4,
    )
    oc = build_offloading_config(vllm_config(), hisparse)
    assert [(g.group_id, g.layer_names) for g in oc.groups] == [(1, ("indexer",))]
    assert oc.worker_kv_bytes_per_block == full().page_size_bytes  # the indexer's own page


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"block_size": 32, "blocks_per_chunk": 2}, "Specify only one of 'block_size' or 'blocks_per_chunk'"),
        ({"blocks_per_chunk": 0}, "'blocks_per_chunk' must be greater than 0"),
        ({"block_size": 40}, r"must be a multiple of the GPU KV cache block size \(16 tokens\)\. Use 48 instead"),
    ],
)
def test_a_bad_chunk_size_is_refused_by_name(extra: dict[str, int], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        build_offloading_config(vllm_config(extra), kv_cache_config(full()))


def test_a_token_chunk_needs_one_block_size() -> None:
    with pytest.raises(AssertionError, match="all groups must have the same block size"):
        build_offloading_config(vllm_config({"block_size": 64}), kv_cache_config(full(bs=32), swa(64)))
    oc = build_offloading_config(vllm_config({"blocks_per_chunk": 2}), kv_cache_config(full(bs=32), swa(64)))
    assert [(g.tokens_per_block, g.sliding_window_size_in_chunks) for g in oc.groups] == [(32, None), (16, 2)]


def test_without_tensors_a_block_costs_the_offloaded_groups_pages() -> None:
    oc = build_offloading_config(vllm_config(), kv_cache_config(full(), swa(64), tensors=False))
    assert oc.worker_kv_bytes_per_block == 8192


@pytest.mark.parametrize(
    ("kwargs", "replicated", "agnostic"),
    [
        (dict(tp=4, mla=True), True, False),  # MLA's one latent head is the same on every rank: one copy
        (dict(tp=4, mla=True, backend="ray"), False, False),  # the shared host mapping needs local processes
        (dict(v2=False), False, True),  # one full-attention group, heads split: the bytes do not depend on TP
        (dict(v2=False, tp=2, heads=8), False, True),
        (dict(), False, False),  # the V2 model runner's layout is not certified
    ],
)
def test_replicated_and_parallelism_agnostic_layouts(kwargs: dict[str, Any], replicated: bool, agnostic: bool) -> None:
    vc = vllm_config(**kwargs)
    tp = vc.parallel_config.tensor_parallel_size
    kc = kv_cache_config(mla() if kwargs.get("mla") else full(), tp=tp)
    oc = build_offloading_config(vc, kc)
    assert (oc.replicated_layout, oc.parallel.is_parallelism_agnostic) == (replicated, agnostic)


def test_the_canonical_layout_widens_the_gate() -> None:
    canonical = {"canonical_layout": True}
    oc = build_offloading_config(vllm_config(canonical, tp=2, mla=True, heads=1), kv_cache_config(mla(), tp=2))
    assert (oc.canonical_layout, oc.replicated_layout, oc.parallel.is_parallelism_agnostic) == (True, True, True)
    oc = build_offloading_config(vllm_config(canonical, tp=2, heads=8), kv_cache_config(full(), tp=2))
    assert (oc.replicated_layout, oc.parallel.is_parallelism_agnostic) == (False, True)


# -- SchedulerOffloadConfig ------------------------------------------------------------------------
def test_a_retention_interval_must_be_whole_window_chunks() -> None:
    kc = kv_cache_config(full(), swa(100), mamba())
    sc = scheduler_config(vllm_config({"blocks_per_chunk": 2}, retention=64), kc)
    assert (sc.retention_interval, sc.alignment_tokens, sc.blocks_per_chunk, sc.kv_bytes_per_token) == (64, 32, 2, 516)
    assert [g.tokens_per_chunk for g in sc.kv_group_configs] == [32, 32, 32]
    with pytest.raises(ValueError, match=r"prefix_cache_retention_interval \(48\) must be a multiple of tokens_per_chunk \(32\)"):
        scheduler_config(vllm_config({"blocks_per_chunk": 2}, retention=48), kc)
    with pytest.raises(ValueError, match=r"prefix_cache_retention_interval \(-1\) must be non-negative"):
        scheduler_config(vllm_config(retention=-1), kc)


def test_a_model_without_full_attention_aligns_to_its_largest_chunk() -> None:
    sc = scheduler_config(vllm_config(), kv_cache_config(swa(64, bs=16), swa(32, bs=32)))
    assert sc.alignment_tokens == 32


# -- the pieces they read -----------------------------------------------------------------------------
def test_tensor_parallel_replicas() -> None:
    def groups(*specs: Any) -> list[KVCacheGroupSpec]:
        return [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]

    gqa = full(heads=2, max_tp_shards=2)  # 2 KV heads split at most 2 ways
    assert kv_cache_groups_tp_replicas(groups(mla()), 4) == 4
    assert kv_cache_groups_tp_replicas(groups(gqa), 8) == 4
    assert kv_cache_groups_tp_replicas(groups(gqa, mla()), 8) == 4  # every layer: the GCD
    assert kv_cache_groups_tp_replicas(groups(mla(), full()), 4) == 1  # a layer that does not say: 1
    assert kv_cache_groups_tp_replicas(groups(mla()), 4, dcp_size=2) == 1  # DCP spreads the tokens instead
    assert kv_cache_groups_tp_replicas([], 4) == 1


def test_the_engine_block_size_rule() -> None:
    vc = vllm_config()
    assert resolve_kv_cache_block_sizes(kv_cache_config(full()), vc) == (16, 16)
    assert resolve_kv_cache_block_sizes(kv_cache_config(full(bs=64), swa(64, bs=16)), vc) == (64, 16)
    vc.parallel_config.decode_context_parallel_size = 2
    assert resolve_kv_cache_block_sizes(kv_cache_config(full()), vc) == (32, 32)  # a DCP-sharded group: 16 tokens per rank
    assert resolve_kv_cache_block_sizes(kv_cache_config(mamba()), vc) == (16, 16)  # Mamba is not sharded
    vc.cache_config.prefix_match_unit = 8
    with pytest.raises(ValueError, match=r"Invalid prefix_match_unit=8; with a single KV cache group"):
        resolve_kv_cache_block_sizes(kv_cache_config(full()), vc)


def test_the_spec_registry() -> None:
    assert KVCacheSpecRegistry.get_manager_class(mla()) is FullAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(mla()) is FullAttentionSpec
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(swa(8)) is SlidingWindowSpec

    @register_kv_cache_spec(manager_class=SlidingWindowManager, uniform_type_base_spec=SlidingWindowSpec)
    class MyWindowSpec(SlidingWindowSpec):
        pass

    mine = MyWindowSpec(block_size=16, sliding_window=8)
    assert (KVCacheSpecRegistry.get_manager_class(mine), KVCacheSpecRegistry.get_uniform_type_base_spec(mine)) == (
        SlidingWindowManager,
        SlidingWindowSpec,
    )
    KVCacheSpecRegistry.register(MyWindowSpec, SlidingWindowManager, SlidingWindowSpec)  # the same again: fine
    with pytest.raises(AssertionError, match="Conflicting registration for KVCacheSpec : MyWindowSpec"):
        KVCacheSpecRegistry.register(MyWindowSpec, FullAttentionManager, SlidingWindowSpec)
    with pytest.raises(AssertionError, match="must inherit from its declared uniform_type_base_spec FullAttentionSpec"):
        KVCacheSpecRegistry.register(MyWindowSpec, SlidingWindowManager, FullAttentionSpec)
    assert KVCacheSpecRegistry.get_manager_class(full(), role=KVCacheGroupRole.HISPARSE_SOURCE).__name__ == "HiSparseSourceManager"


def test_the_connector_takes_vllm_chunk_keys_but_keeps_one_block_per_chunk() -> None:
    OffloadingConnector(KVConnectorRole.SCHEDULER, 16, {"block_size": 16})
    OffloadingConnector(KVConnectorRole.SCHEDULER, 16, {"blocks_per_chunk": 1})
    with pytest.raises(ValueError, match="kvlab's offloading tiers keep one GPU block per chunk; the extra config asks for 2"):
        OffloadingConnector(KVConnectorRole.SCHEDULER, 16, {"block_size": 32})
    with pytest.raises(TypeError, match="self_describing_kv_events must be a bool"):
        OffloadingConnector(KVConnectorRole.SCHEDULER, 16, {"self_describing_kv_events": "yes"})


# -- the events tracker ---------------------------------------------------------------------------------
def _group(bs: int = 4, per_chunk: int = 1, window: int | None = None) -> GroupOffloadConfig:
    spec = full(bs=bs)
    return GroupOffloadConfig(
        0, bs, bs * per_chunk, per_chunk, OffloadingEventGroupSpec("full_attention", None), window, spec, FullAttentionManager
    )


def _req(num_hashes: int, num_tokens: int) -> SimpleNamespace:
    hashes = [bytes([i]) * 32 for i in range(num_hashes)]
    return SimpleNamespace(request_id="r", block_hashes=hashes, all_token_ids=list(range(1, num_tokens + 1)), lora_request=None)


def _tracker(self_describing: bool = True) -> OffloadingEventsTracker:
    return OffloadingEventsTracker(OffloadingKVEventsConfig(True, self_describing), {0: OffloadingEventGroupSpec("full_attention", None)},
                                   use_int_block_hashes=False)  # fmt: skip


def test_a_stored_chunk_is_published_with_its_blocks_tokens_and_parent() -> None:
    tracker, req = _tracker(), _req(4, 16)
    key = make_offload_key(req.block_hashes[3], 0)
    tracker.record_store(req, _group(per_chunk=2), 1, key)  # chunk 1: blocks 2 and 3
    [stored] = tracker.take_events([OffloadingEvent([key], Medium.CPU, removed=False)])
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (
        req.block_hashes[2:4],
        req.block_hashes[1],
        list(range(9, 17)),
        4,
        "CPU",
    )
    [removed] = tracker.take_events([OffloadingEvent([key], Medium.CPU, removed=True)])
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == req.block_hashes[2:4]  # the same hashes
    assert key not in tracker._pending_event_metadata  # its last residency is gone


def test_without_the_opt_in_the_events_stay_placeholders(caplog: pytest.LogCaptureFixture) -> None:
    tracker, req = _tracker(self_describing=False), _req(1, 4)
    key = make_offload_key(req.block_hashes[0], 0)
    tracker.record_store(req, _group(), 0, key)
    [stored] = tracker.take_events([OffloadingEvent([key], Medium.STORAGE, removed=False)])
    assert (stored.block_hashes, stored.token_ids, stored.block_size, stored.kv_cache_spec_kind, stored.medium) == (
        [req.block_hashes[0]],
        [],
        0,
        None,
        "STORAGE",
    )
    with caplog.at_level(logging.WARNING):
        [stored] = _tracker().take_events([OffloadingEvent([key], Medium.CPU, removed=False)])  # opted in, no payload
    assert (stored.block_size, stored.kv_cache_spec_kind) == (0, "full_attention")  # a placeholder, classified
    assert "no payload for an offload key during BlockStored" in caplog.text


def test_a_removal_before_a_store_in_one_batch_keeps_the_payload_the_store_needs() -> None:
    tracker, req = _tracker(), _req(1, 4)
    key = make_offload_key(req.block_hashes[0], 0)
    tracker.record_store(req, _group(), 0, key)
    removed, stored = tracker.take_events(
        [OffloadingEvent([key], Medium.CPU, removed=True), OffloadingEvent([key], Medium.STORAGE, removed=False, removal_expected=True)]
    )
    assert (removed.block_hashes, stored.token_ids) == ([req.block_hashes[0]], [1, 2, 3, 4])
    assert key in tracker._pending_event_metadata  # the disk tier will announce its removal
    list(tracker.take_events([OffloadingEvent([key], Medium.STORAGE, removed=True)]))
    assert key not in tracker._pending_event_metadata


def test_window_groups_and_failed_reservations_publish_no_payload() -> None:
    tracker, req = _tracker(), _req(1, 4)
    key = make_offload_key(req.block_hashes[0], 0)
    tracker.record_store(req, _group(window=2), 0, key)
    assert tracker._pending_event_metadata == {}
    tracker.record_store(req, _group(), 0, key)
    assert list(tracker.take_events([OffloadingEvent([key], Medium.CPU, removed=True, metadata_only=True)])) == []


def test_the_engine_publishes_self_describing_tier_events(tmp_path: Any) -> None:
    from kvlab import Request, build_engine
    from kvlab.config.kv_transfer import KVTransferConfig

    class Recorder:
        def __init__(self) -> None:
            self.events: list[Any] = []

        def publish(self, batch: Any) -> None:
            self.events += batch.events

    rec = Recorder()
    cfg = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 4, "self_describing_kv_events": True})
    eng = build_engine(num_blocks=6, block_size=4, kv_transfer_config=cfg, kv_event_publisher=rec,
                       manager_kwargs=dict(enable_kv_cache_events=True))  # fmt: skip
    eng.add_request(Request("A", list(range(100, 109)), max_tokens=1))
    eng.run()
    gpu, *cpu = [e for e in rec.events if isinstance(e, BlockStored)]
    assert gpu.medium == "GPU" and [e.medium for e in cpu] == ["CPU", "CPU"]
    # each CPU block is announced as the GPU pool announced it: its hash, parent and tokens
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size) for e in cpu] == [
        ([gpu.block_hashes[0]], None, [100, 101, 102, 103], 4),
        ([gpu.block_hashes[1]], gpu.block_hashes[0], [104, 105, 106, 107], 4),
    ]


# -- completion across workers ----------------------------------------------------------------------
def test_worker_reports_add_up_and_merge() -> None:
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import LoadResult, OffloadingWorkerMetadata

    key = make_offload_key(b"k" * 32, 0)
    rank0 = OffloadingWorkerMetadata(loads={1: LoadResult(3)}, stores={2: (True, True, "")}, cascade_bytes={2: 100})
    rank1 = OffloadingWorkerMetadata(loads={1: LoadResult(2, key, "disk")}, stores={2: (True, False, "full")}, cascade_bytes={2: 100})
    both = rank0.aggregate(rank1)
    assert both.completed_jobs == {1: 2, 2: 2}  # a result reported is that worker's completion
    assert (both.loads[1].num_loaded, both.loads[1].failed_key) == (2, key)  # as far as the slowest rank got
    assert (both.stores[2], both.cascade_bytes[2]) == ((True, False, "full"), 200)  # every rank must have cascaded
    with pytest.raises(TypeError, match="can only aggregate an OffloadingWorkerMetadata"):
        rank0.aggregate({})  # type: ignore[arg-type]


@pytest.mark.parametrize("second_rank_stores", [True, False])
def test_a_store_is_readable_once_every_worker_reported_it(second_rank_stores: bool) -> None:
    from kvlab import Request, build_engine
    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from kvlab.kv_offload.base import LookupResult
    from kvlab.outputs import KVConnectorOutput

    eng = build_engine(num_blocks=8, block_size=4, kv_transfer_config=KVTransferConfig("OffloadingConnector"))
    conn = eng.scheduler.connector.scheduler
    conn.num_workers = 2  # two tensor-parallel ranks copy each block, each its own heads
    eng.add_request(Request("A", list(range(100, 109)), max_tokens=1))
    [store] = eng.scheduler.schedule().kv_connector_metadata.stores
    cpu = conn.manager.primary
    report = OffloadingWorkerMetadata(stores={store.job_id: (True, False, "")})
    conn.update_connector_output(KVConnectorOutput(worker_meta=report))
    assert [cpu.lookup(k) for k in store.plan.keys] == [LookupResult.HIT_PENDING] * 2  # one rank is not enough
    report = OffloadingWorkerMetadata(stores={store.job_id: (second_rank_stores, False, "" if second_rank_stores else "copy failed")})
    conn.update_connector_output(KVConnectorOutput(worker_meta=report))
    expected = LookupResult.HIT if second_rank_stores else LookupResult.MISS
    assert [cpu.lookup(k) for k in store.plan.keys] == [expected] * 2
    assert conn._partial_reports == {} and store.job_id not in conn._jobs
