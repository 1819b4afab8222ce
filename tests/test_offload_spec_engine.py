"""vLLM 0.33's spec-built offloading halves run by kvlab's engine.

Both halves of ``OffloadingConnector`` are built with vLLM's call, ``(vllm_config, role,
kv_cache_config)``, from one config naming ``CPUOffloadingSpec``; the scheduler half goes to
kvlab's ``Scheduler``, the worker half to a ``ModelRunner`` with the tiny real model. The
story: request A's 13-token prompt is computed and its three whole blocks stored to the CPU
tier (one store job, copied one step later); the GPU prefix cache is reset; request B with
the same prompt loads those 12 tokens from the CPU tier (one asynchronous load job) instead
of recomputing them, and -- the loaded bytes being A's -- generates A's tokens.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler
from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.staged_scheduler import StagedOffloadingConnectorScheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from kvlab.engine.llm_engine import LLMEngine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.request import Request
from kvlab.worker.model import TinyLlama, TinyLlamaConfig
from kvlab.worker.model_runner import ModelRunner

BS, NUM_BLOCKS = 4, 12
PROMPT = [40 + (7 * i) % 50 for i in range(13)]  # three whole blocks and one token
SPEC_EXTRA = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 16 * 1024}  # 4 chunks of 4096 bytes


def kv_cache_config() -> KVCacheConfig:
    """The tiny model's one full-attention group, its layers named as kvlab's runner names them."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=(), kv_cache_groups=(KVCacheGroupSpec(("layers.0", "layers.1"), spec),))


def vllm_config(extra: dict[str, Any]) -> SimpleNamespace:
    parallel = SimpleNamespace(
        tensor_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1, pipeline_parallel_size=1,
        world_size=1, distributed_executor_backend="uni", nnodes_within_dp=1, rank=0, data_parallel_index=0,
        data_parallel_size=1, data_parallel_rank_local=None, cp_kv_cache_interleave_size=1,
    )  # fmt: skip
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        cache_config=SimpleNamespace(
            block_size=BS,
            enable_prefix_caching=True,
            prefix_match_unit=None,
            cache_dtype="auto",
            prefix_cache_retention_interval=None,
            kv_cache_layout=None,
        ),  # fmt: skip
        model_config=SimpleNamespace(model="tiny", dtype="float32", max_model_len=256, use_mla=False, get_total_num_kv_heads=lambda: 2),
        parallel_config=parallel,
        kv_events_config=None,
        use_v2_model_runner=False,
        speculative_config=None,
        kv_transfer_config=KVTransferConfig(
            "OffloadingConnector", kv_connector_extra_config=dict(extra), engine_id=f"kvlab-spec-engine-{uuid.uuid4().hex[:12]}"
        ),
    )


def hybrid_kv_cache_config() -> KVCacheConfig:
    """Layer 0 full attention, layer 1 a window of 8 tokens: two groups in one pool."""
    kw: dict[str, Any] = dict(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float32)
    groups = (
        KVCacheGroupSpec(("layers.0",), FullAttentionSpec(**kw)),
        KVCacheGroupSpec(("layers.1",), SlidingWindowSpec(**kw, sliding_window=8)),
    )
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=(), kv_cache_groups=groups)


def build(hybrid: bool = False) -> tuple[LLMEngine, OffloadingConnector, OffloadingConnector, list[tuple]]:
    """The engine, both connector halves, and the jobs the worker was handed (in order)."""
    torch.set_num_threads(1)
    # A hybrid chunk key is per group: A's 3 blocks take 6 chunks (16 here), not 3.
    vc = vllm_config({**SPEC_EXTRA, "cpu_bytes_to_use": 64 * 1024} if hybrid else SPEC_EXTRA)
    kc = hybrid_kv_cache_config() if hybrid else kv_cache_config()
    sched_conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kc)
    worker_conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kc)
    assert isinstance(sched_conn, OffloadingConnector) and isinstance(worker_conn, OffloadingConnector)
    mgr = KVCacheManager(kc, max_model_len=256, hash_block_size=BS)
    sched = Scheduler(mgr, connector=sched_conn, kv_transfer_config=vc.kv_transfer_config)
    window: dict[str, Any] = dict(sliding_window=8, sliding_window_layers=(1,)) if hybrid else {}
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, **window), seed=0)
    runner = ModelRunner(model, device="cpu", backend="reference", kv_connector=worker_conn)
    jobs: list[tuple] = []
    bind = worker_conn.bind_connector_metadata

    def spy(meta: Any) -> None:
        for job_id, job in meta.load_jobs.items():
            jobs.append(("load", job_id, job.req_id, [int(b) for b in job.src_spec.block_ids], [int(b) for b in job.dst_spec.block_ids]))
        for job_id, job in meta.store_jobs.items():
            jobs.append(("store", job_id, job.req_id, [int(b) for b in job.src_spec.block_ids], [int(b) for b in job.dst_spec.block_ids]))
        bind(meta)

    worker_conn.bind_connector_metadata = spy  # type: ignore[method-assign]
    return LLMEngine(mgr, sched, runner), sched_conn, worker_conn, jobs


def test_vllms_call_builds_the_spec_halves_and_kvlabs_call_the_staged_ones() -> None:
    vc, kc = vllm_config(SPEC_EXTRA), kv_cache_config()
    sched_conn = OffloadingConnector(vc, KVConnectorRole.SCHEDULER, kc)
    worker_conn = OffloadingConnector(vc, KVConnectorRole.WORKER, kc)
    assert (type(sched_conn.scheduler), type(worker_conn.worker)) == (OffloadingConnectorScheduler, OffloadingConnectorWorker)
    assert (type(sched_conn.spec).__name__, sched_conn.spec.num_chunks, sched_conn.spec.kv_bytes_per_chunk) == (
        "CPUOffloadingSpec",
        4,
        4096,
    )
    # vLLM's call without a spec key: kvlab's staged tiers, as before; kvlab's call: always staged.
    staged = OffloadingConnector(vllm_config({"num_cpu_blocks": 8}), KVConnectorRole.SCHEDULER, kc)
    assert (type(staged.scheduler), staged.spec, staged.num_cpu_blocks, staged.block_size) == (
        StagedOffloadingConnectorScheduler,
        None,
        8,
        BS,
    )
    assert type(OffloadingConnector(KVConnectorRole.SCHEDULER, BS, {"num_cpu_blocks": 8}).scheduler) is StagedOffloadingConnectorScheduler


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: OffloadingConnector(vllm_config({**SPEC_EXTRA, "num_cpu_blocks": 8}), KVConnectorRole.SCHEDULER, kv_cache_config()),
            ValueError,
            r"mixes an offloading spec's keys \['cpu_bytes_to_use', 'spec_name'\] with kvlab's staged tiers' keys \['num_cpu_blocks'\]",
        ),
        (
            lambda: OffloadingConnector(KVConnectorRole.SCHEDULER, BS, {"cpu_bytes_to_use": 1024}),
            ValueError,
            r"extra config \['cpu_bytes_to_use'\] names an offloading spec, which vLLM's call builds",
        ),
        (
            lambda: OffloadingConnector(vllm_config(SPEC_EXTRA), KVConnectorRole.SCHEDULER, None),
            TypeError,
            "kv_cache_config must be a KVCacheConfig",
        ),
        (lambda: OffloadingConnector(vllm_config(SPEC_EXTRA), "scheduler", kv_cache_config()), TypeError, "role must be a KVConnectorRole"),
    ],
)
def test_bad_calls_are_refused_by_name(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_b_loads_as_prefix_from_the_cpu_tier_and_generates_as_tokens() -> None:
    eng, sched_conn, worker_conn, jobs = build()
    runner = eng.executor
    assert isinstance(runner, ModelRunner)
    eng.add_request(Request("A", PROMPT, max_tokens=4))
    eng.run()
    # A's three whole blocks (GPU 1-3) went to CPU chunks 0-2 in one job.
    assert jobs == [("store", 0, "A", [1, 2, 3], [0, 1, 2])]
    assert eng.reset_prefix_cache() is True  # the GPU pool forgets A's prefix; the CPU tier keeps it
    eng.add_request(Request("B", PROMPT, max_tokens=4))
    eng.run()
    assert jobs[1:] == [("load", 1, "B", [0, 1, 2], [5, 6, 7])]
    for layer, kv in enumerate(runner.kv_caches):  # the loaded blocks hold exactly A's KV
        assert torch.equal(kv[[5, 6, 7]], kv[[1, 2, 3]]), f"layer {layer}"
    assert eng.finished["B"].num_cached_tokens == 12
    assert eng.finished["A"].output_token_ids == eng.finished["B"].output_token_ids == [125, 101, 86, 119]
    stats = eng.scheduler.connector_prefix_cache_stats
    assert stats is not None and (stats.hits, stats.hits_by_source) == (12, {CacheHitSource.HOST: 12})
    half = sched_conn.scheduler
    # As in vLLM, the half hears of B's finish at the next schedule(), then forgets it.
    assert (half._jobs, list(half._req_status), sched_conn._ledger.undone) == ({}, ["B"], set())
    eng.step()
    assert half._req_status == {}


def test_a_hybrid_model_stores_both_groups_and_loads_only_what_the_window_reads() -> None:
    """Full attention (layer 0) beside a window of 8 tokens (layer 1): A stores its three
    blocks of each group in one job (group sizes 3 + 3); B loads the full group's three
    chunks but only the window group's last two -- the 8 tokens its window still reads."""
    eng, _, _, jobs = build(hybrid=True)
    runner = eng.executor
    assert isinstance(runner, ModelRunner)
    eng.add_request(Request("A", PROMPT, max_tokens=4))
    eng.run()
    assert eng.reset_prefix_cache() is True
    eng.add_request(Request("B", PROMPT, max_tokens=4))
    eng.run()
    assert jobs == [("store", 0, "A", [1, 2, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5]), ("load", 1, "B", [0, 1, 2, 4, 5], [9, 10, 11, 12, 13])]
    full, window = runner.kv_caches
    assert torch.equal(full[[9, 10, 11]], full[[1, 2, 3]]) and torch.equal(window[[12, 13]], window[[6, 7]])
    assert eng.finished["A"].output_token_ids == eng.finished["B"].output_token_ids == [125, 101, 97, 87]
    stats = eng.scheduler.connector_prefix_cache_stats
    assert stats is not None and stats.hits_by_source == {CacheHitSource.HOST: 12}


def test_the_simulated_executor_is_refused_it_has_no_kv_tensors() -> None:
    vc, kc = vllm_config(SPEC_EXTRA), kv_cache_config()
    worker_conn = OffloadingConnector(vc, KVConnectorRole.WORKER, kc)
    with pytest.raises(ValueError, match=r"copies the KV tensors of layers \['layers.0', 'layers.1'\], but the executor registered \[\]"):
        SimulatedExecutor(kv_connector=worker_conn)
    assert worker_conn.worker.worker is None  # nothing half registered


def test_an_undone_step_leaves_no_stale_job() -> None:
    """A's first step issues store job 0 and the worker queues it; the step is then undone
    (the scheduler's update raises). The step again issues the store as job 1 -- job 0's
    late report is dropped, not credited to a job that reused its id -- and B still loads."""
    eng, sched_conn, _, jobs = build()
    update = eng.scheduler.update_from_output
    calls = {"n": 0}

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("interrupted")
        return update(*args, **kwargs)

    eng.scheduler.update_from_output = fail_once  # type: ignore[method-assign]
    eng.add_request(Request("A", PROMPT, max_tokens=4))
    with pytest.raises(RuntimeError, match="interrupted"):
        eng.step()
    eng.run()
    assert jobs == [("store", 0, "A", [1, 2, 3], [0, 1, 2]), ("store", 1, "A", [1, 2, 3], [0, 1, 2])]
    assert sched_conn._ledger.undone == {0}
    eng.reset_prefix_cache()
    eng.add_request(Request("B", PROMPT, max_tokens=4))
    eng.run()
    assert jobs[2:] == [("load", 2, "B", [0, 1, 2], [5, 6, 7])]
    assert eng.finished["B"].output_token_ids == [125, 101, 86, 119]
    assert (sched_conn.scheduler._jobs, list(sched_conn.scheduler._req_status)) == ({}, ["B"])  # B forgotten next schedule()


def test_a_completion_an_undone_step_applied_is_applied_again() -> None:
    """The step whose report completes store job 0 is undone after the half applied it:
    the worker will not report job 0 again, so the connector applies it from its ledger --
    else job 0 would stay in flight and the engine would step forever."""
    eng, sched_conn, _, jobs = build()
    apply = sched_conn.update_connector_output
    seen = {"done": False}

    def fail_after_completion(output: Any) -> None:
        apply(output)
        meta = output.kv_connector_worker_meta
        if not seen["done"] and meta is not None and 0 in meta.completed_jobs:
            seen["done"] = True
            raise RuntimeError("interrupted after the completion")

    sched_conn.update_connector_output = fail_after_completion  # type: ignore[method-assign]
    eng.add_request(Request("A", PROMPT, max_tokens=4))
    with pytest.raises(RuntimeError, match="interrupted after the completion"):
        eng.run()
    assert 0 in sched_conn.scheduler._jobs  # undone: in flight again in the books
    eng.run()
    assert (jobs, sched_conn.scheduler._jobs, sched_conn._ledger.completions) == ([("store", 0, "A", [1, 2, 3], [0, 1, 2])], {}, {0: 1})
    eng.reset_prefix_cache()
    eng.add_request(Request("B", PROMPT, max_tokens=4))
    eng.run()
    assert eng.finished["B"].output_token_ids == [125, 101, 86, 119]


def test_a_spec_built_child_of_a_multiconnector_runs_the_same_story() -> None:
    """The same story with the offloading connector as a MultiConnector's only child: one
    step after A finishes, its store is still in flight and the child's half still holds A,
    whom the scheduler forgot -- the step's undo point must share that request, not copy it
    (the MultiConnector passes on its children's ``undo_shared_objects``)."""
    from kvlab.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    vc = vllm_config(SPEC_EXTRA)
    child = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": dict(SPEC_EXTRA)}
    vc.kv_transfer_config = KVTransferConfig(
        "MultiConnector", kv_connector_extra_config={"connectors": [child]}, engine_id="kvlab-multi-spec"
    )
    kc = kv_cache_config()
    sched_conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kc)
    worker_conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kc)
    assert isinstance(sched_conn, MultiConnector) and isinstance(worker_conn, MultiConnector)
    (offload,) = sched_conn.sub_connectors
    assert isinstance(offload, OffloadingConnector) and offload.spec is not None
    mgr = KVCacheManager(kc, max_model_len=256, hash_block_size=BS)
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)
    eng = LLMEngine(
        mgr, Scheduler(mgr, connector=sched_conn), ModelRunner(model, device="cpu", backend="reference", kv_connector=worker_conn)
    )
    eng.add_request(Request("A", PROMPT, max_tokens=4))
    eng.run()
    assert [s.req.request_id for s in offload.scheduler._req_status.values()] == ["A"]  # held past A's finish
    assert sched_conn.undo_shared_objects() == [offload.scheduler._req_status["A"].req]
    assert eng.reset_prefix_cache() is True
    eng.add_request(Request("B", PROMPT, max_tokens=4))
    eng.run()
    assert eng.finished["B"].num_cached_tokens == 12
    assert eng.finished["A"].output_token_ids == eng.finished["B"].output_token_ids == [125, 101, 86, 119]
    assert eng.scheduler.connector_prefix_cache_stats.hits_by_source == {CacheHitSource.HOST: 12}


def test_a_backend_whose_books_cannot_be_copied_is_refused_at_binding() -> None:
    """vLLM's tiering backend polls its tiers from a thread and holds a lock: kvlab's engine
    could not undo an interrupted step over it, so binding refuses it and names the way out."""
    vc = vllm_config({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 * 1024, "secondary_tiers": []})
    kc = kv_cache_config()
    conn = OffloadingConnector(vc, KVConnectorRole.SCHEDULER, kc)
    try:
        with pytest.raises(
            ValueError, match=r"TieringOffloadingSpec keeps books kvlab's engine cannot copy .*Run it with CPUOffloadingSpec"
        ):
            Scheduler(KVCacheManager(kc, max_model_len=256, hash_block_size=BS), connector=conn)
    finally:
        conn.shutdown()  # its tier-poll thread
