"""vLLM 0.33's MultiConnector (``kv_connector/v1/multi_connector.py``): a request's load comes
from the first child connector that offers its tokens, every child sees every other hook
with its own metadata and report, a request two children still send is freed only when both
are done, and each child class keeps its own stats. The expected numbers of the stats and the
hold-back of ``finished_sending`` were first read off vLLM 0.33's own classes."""

from __future__ import annotations

import filecmp
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import kvlab.kernels  # noqa: F401,I001 - sets TRITON_INTERPRET before triton is imported
from kvlab import FullAttentionSpec, KVCacheManager, Request, Scheduler, SimulatedExecutor
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole, SupportsHMA, supports_hma
from kvlab.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector, ExampleWorkerReport
from kvlab.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorPromMetrics
from kvlab.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorPromMetrics,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
)
from kvlab.distributed.kv_transfer.kv_connector.v1.nixl import NixlKVConnectorStats
from kvlab.engine.llm_engine import LLMEngine
from kvlab.eventlog.events import EventLog, KVTransfer
from kvlab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from kvlab.outputs import KVConnectorOutput
from kvlab.worker.model import TinyLlama
from kvlab.worker.model_runner import ModelRunner
from kvlab.worker.tokenizer import ByteTokenizer
from scheduler_side_connector import SchedulerSideConnector

BS = 16
LOG: list[str] = []


def telemetry(xfer_us: float, post_us: float, nbytes: int, descs: int) -> SimpleNamespace:
    """What NIXL reports about one transfer (``nixlXferTelemetry``'s fields)."""
    return SimpleNamespace(xferDuration=xfer_us, postDuration=post_us, totalBytes=nbytes, descCount=descs)


class MultiTestChild(SchedulerSideConnector):
    """A child built as vLLM builds one. From its extra config: ``name`` (in the shared LOG),
    ``offer`` (tokens it supplies), ``sends``/``params`` (its request_finished answer) and
    ``xfer`` (one transfer's telemetry it reports as NIXL stats)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.name = extra["name"]
        self.offer = extra.get("offer", 0)
        self.sends, self.params = extra.get("sends", False), extra.get("params")
        self.xfer = extra.get("xfer")
        self.report = extra.get("report", True)
        self.source, self.push, self.frees, self.reset = (
            extra.get("source"),
            extra.get("push", False),
            extra.get("frees", False),
            extra.get("reset"),
        )
        self.finished_sending: set[str] = set()

    def on_new_request(self, request):
        LOG.append(f"{self.name}.on_new_request({request.request_id})")

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        if self.source is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {CacheHitSource(self.source): num_external_tokens}

    def has_pending_push_work(self):
        return self.push

    def has_pending_block_frees(self):
        return self.frees

    def reset_cache(self):
        LOG.append(f"{self.name}.reset_cache")
        return self.reset

    def handle_preemptions(self, kv_connector_metadata):
        LOG.append(f"{self.name}.handle_preemptions({kv_connector_metadata.owner})")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        LOG.append(f"{self.name}.get_num_new_matched_tokens({request.request_id}, {num_computed_tokens})")
        return self.offer, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        LOG.append(f"{self.name}.update_state_after_alloc({request.request_id}, {blocks.get_block_ids()[0]}, {num_external_tokens})")

    def build_connector_meta(self, scheduler_output):
        LOG.append(f"{self.name}.build_connector_meta(step {scheduler_output.step})")
        meta = KVConnectorMetadata()
        meta.owner = self.name  # type: ignore[attr-defined]
        return meta

    def request_finished(self, request, block_ids):
        LOG.append(f"{self.name}.request_finished({request.request_id}, {block_ids})")
        return self.sends, self.params

    def bind_connector_metadata(self, connector_metadata):
        LOG.append(f"{self.name}.bind_connector_metadata({connector_metadata.owner})")
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, **kwargs):
        LOG.append(f"{self.name}.start_load_kv")

    def wait_for_save(self, skip_req_ids=frozenset()):
        LOG.append(f"{self.name}.wait_for_save")

    def build_connector_worker_meta(self):
        return ExampleWorkerReport(num_stored_tokens={"FILE": 1}) if self.report else None

    def update_connector_output(self, connector_output):
        meta = connector_output.kv_connector_worker_meta
        errors = getattr(connector_output, "errors", "no errors field")
        LOG.append(f"{self.name}.update_connector_output({meta and meta.num_stored_tokens}, {errors})")

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        results.finished_sending, self.finished_sending = self.finished_sending, set()
        return results

    def get_kv_connector_stats(self):
        if self.xfer is None:
            return None
        stats = NixlKVConnectorStats()
        stats.record_transfer(telemetry(*self.xfer))
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return NixlKVConnectorStats(data=data) if data is not None else NixlKVConnectorStats()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return vllm_config.kv_transfer_config.kv_connector_extra_config.get("layout")


class MultiTestHMAChild(MultiTestChild, SupportsHMA):
    def request_finished_all_groups(self, request, block_ids):
        LOG.append(f"{self.name}.request_finished_all_groups({request.request_id}, {block_ids})")
        return False, None


KVConnectorFactory.register_connector("MultiTestChild", __name__, "MultiTestChild")
KVConnectorFactory.register_connector("MultiTestHMAChild", __name__, "MultiTestHMAChild")


def child(name: str, cls: str = "MultiTestChild", **extra) -> dict:
    return {"kv_connector": cls, "kv_role": "kv_both", "kv_connector_extra_config": {"name": name, **extra}}


def vllm_config(*children: dict, hma_off: bool = True) -> SimpleNamespace:
    transfer = KVTransferConfig("MultiConnector", kv_connector_extra_config={"connectors": list(children)})
    return SimpleNamespace(kv_transfer_config=transfer, scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=hma_off))


def kv_cache_config(num_blocks: int = 8) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=(KVCacheGroupSpec(("layer",), FullAttentionSpec(block_size=BS)),)
    )


def multi(*children: dict, role: KVConnectorRole = KVConnectorRole.SCHEDULER, hma_off: bool = True) -> MultiConnector:
    return MultiConnector(vllm_config(*children, hma_off=hma_off), role, kv_cache_config())


def simulated_engine(*children: dict) -> LLMEngine:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    worker = multi(*children, role=KVConnectorRole.WORKER)
    return LLMEngine(mgr, Scheduler(mgr, connector=multi(*children)), SimulatedExecutor(kv_connector=worker))


# -- which child serves a load; every child sees every hook ---------------------------------------------
def test_every_child_sees_each_hook_and_the_first_with_tokens_serves_the_load() -> None:
    LOG.clear()
    eng = simulated_engine(child("A"), child("B", offer=16, xfer=(10_000, 1_000, 2**20, 4)))
    eng.add_request(Request("r", list(range(40)), max_tokens=1))
    out = eng.step().scheduler_output
    assert out.num_scheduled_tokens == {"r": 24}  # B supplied 16 of the 40 prompt tokens
    assert LOG == [
        "A.on_new_request(r)",
        "B.on_new_request(r)",
        "A.get_num_new_matched_tokens(r, 0)",
        "B.get_num_new_matched_tokens(r, 0)",
        "A.update_state_after_alloc(r, [1, 2, 3], 0)",  # A gets the blocks, nothing to load
        "B.update_state_after_alloc(r, [1, 2, 3], 16)",
        "A.build_connector_meta(step 1)",
        "B.build_connector_meta(step 1)",
        "A.handle_preemptions(A)",
        "B.handle_preemptions(B)",
        "A.bind_connector_metadata(A)",  # each worker child gets its own part
        "B.bind_connector_metadata(B)",
        "A.start_load_kv",
        "B.start_load_kv",
        "A.wait_for_save",
        "B.wait_for_save",
        "A.request_finished(r, [1, 2, 3])",
        "B.request_finished(r, [1, 2, 3])",
        "A.update_connector_output({'FILE': 1}, {})",  # each sees its own worker report
        "B.update_connector_output({'FILE': 1}, {})",
    ]
    assert isinstance(out.kv_connector_metadata, MultiKVConnectorMetadata)
    assert [m.owner for m in out.kv_connector_metadata.metadata] == ["A", "B"]
    # The scheduler half's stats, by child class (A keeps none).
    payload = eng.scheduler.kv_connector_stats.to_dict()
    assert list(payload) == ["MultiTestChild"]
    assert {k: v for k, v in payload["MultiTestChild"].items() if v} == {
        "transfer_duration": [0.01],
        "post_duration": [0.001],
        "bytes_transferred": [2**20],
        "num_descriptors": [4],
    }


@pytest.mark.parametrize(("offers", "scheduled", "external"), [((0, 16), 24, [0, 16]), ((16, 32), 24, [16, 0]), ((0, 0), 40, [0, 0])])
def test_the_first_child_offering_tokens_is_chosen(offers, scheduled, external) -> None:
    LOG.clear()
    eng = simulated_engine(child("A", offer=offers[0]), child("B", offer=offers[1]))
    eng.add_request(Request("r", list(range(40)), max_tokens=1))
    assert eng.step().scheduler_output.num_scheduled_tokens == {"r": scheduled}
    assert [line for line in LOG if "update_state_after_alloc" in line] == [
        f"A.update_state_after_alloc(r, [1, 2, 3], {external[0]})",
        f"B.update_state_after_alloc(r, [1, 2, 3], {external[1]})",
    ]


def test_hit_sources_come_from_the_serving_child_and_pending_work_from_any() -> None:
    """vLLM 0.33's MultiConnector: the child that loaded splits the hit by tier; any child
    with blocks to give back or work to push holds the scheduler; a cache reset asks every
    child and is done only if none said False."""
    eng = simulated_engine(child("A", source="disk"), child("B", offer=16, source="host"))
    eng.add_request(Request("r", list(range(40)), max_tokens=1))
    eng.step()
    assert eng.scheduler.connector_prefix_cache_stats.hits_by_source == {CacheHitSource.HOST: 16}  # B's, not A's
    conn = multi(child("A"), child("B", push=True, frees=True))
    assert (conn.has_pending_push_work(), conn.has_pending_block_frees()) == (True, True)
    assert (multi(child("A"), child("B")).has_pending_push_work(), multi(child("A")).has_pending_block_frees()) == (False, False)
    unknown = multi(child("A"), child("B"))
    unknown.on_new_request(Request("q", [1, 2, 3], max_tokens=1))  # no load chosen: the base's default
    assert unknown.get_external_cache_hit_sources(Request("q", [1, 2, 3], max_tokens=1), 2) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 2}
    LOG.clear()
    assert multi(child("A", reset=False), child("B", reset=True)).reset_cache() is False
    assert LOG == ["A.reset_cache", "B.reset_cache"]  # B is reset even though A could not be
    assert multi(child("A"), child("B", reset=True)).reset_cache() is True  # None counts as done


def test_a_child_that_cannot_tell_yet_holds_the_request_back() -> None:
    conn = multi(child("A", offer=16), child("B", offer=None))
    request = Request("r", list(range(40)), max_tokens=1)
    assert conn.get_num_new_matched_tokens(request, 0) == (None, False)
    conn._connectors[1].offer = 0
    assert conn.get_num_new_matched_tokens(request, 0) == (16, False)


# -- a request two children send is freed once both are done -------------------------------------------
def test_blocks_are_released_after_the_last_sender_reports() -> None:
    children = (child("A", sends=True, params={"a": 1}), child("B", sends=True, params={"b": 2}), child("C"))
    sched, worker = multi(*children), multi(*children, role=KVConnectorRole.WORKER)
    assert sched.request_finished(Request("r", list(range(40)), max_tokens=1), [1, 2, 3]) == (True, {"a": 1, "b": 2})
    meta = sched.build_connector_meta(SimpleNamespace(step=1))
    assert meta.extra_async_saves == {"r": 1}  # two senders: one beyond the first
    assert sched.build_connector_meta(SimpleNamespace(step=2)).extra_async_saves is None  # sent once
    worker.bind_connector_metadata(meta)
    assert worker.has_connector_metadata()
    a, b, _ = worker.sub_connectors
    a.finished_sending = {"r"}
    assert worker.get_finished(set()) == (None, None)  # A is done, B still sends
    b.finished_sending = {"r"}
    assert worker.get_finished(set()) == ({"r"}, None)


def test_clashing_transfer_params_are_an_error() -> None:
    conn = multi(child("A", params={"folder": "x"}), child("B", params={"folder": "y"}))
    with pytest.raises(RuntimeError, match=r"Key clash in kv_transfer_params from multiple connectors: \{'folder'\}"):
        conn.request_finished(Request("r", [1, 2], max_tokens=1), [1])


# -- the hybrid allocator (SupportsHMA) -------------------------------------------------------------------
def test_hma_is_honoured_only_when_every_child_supports_it() -> None:
    assert supports_hma(MultiConnector)
    request = Request("r", list(range(40)), max_tokens=1)
    LOG.clear()
    both = multi(child("A", "MultiTestHMAChild"), child("B", "MultiTestHMAChild"), hma_off=False)
    assert both._all_support_hma is True
    assert both.request_finished_all_groups(request, ([1, 2], [3])) == (False, None)
    assert LOG == ["A.request_finished_all_groups(r, ([1, 2], [3]))", "B.request_finished_all_groups(r, ([1, 2], [3]))"]
    LOG.clear()
    mixed = multi(child("A", "MultiTestHMAChild"), child("B"))
    assert mixed._all_support_hma is False
    assert mixed.request_finished_all_groups(request, ([1, 2],)) == (False, None)
    assert LOG == ["A.request_finished(r, [1, 2])", "B.request_finished(r, [1, 2])"]
    with pytest.raises(ValueError, match="has 2 KV-cache groups, but not every child connector supports HMA"):
        mixed.request_finished_all_groups(request, ([1, 2], [3]))
    with pytest.raises(ValueError, match="HMA\\) is on, but not every child connector supports it"):
        multi(child("A", "MultiTestHMAChild"), child("B"), hma_off=False)


# -- worker reports ------------------------------------------------------------------------------------------
def test_worker_reports_are_kept_per_child_and_merged_for_the_executor() -> None:
    r1 = ExampleWorkerReport(errors={"x": "layers.1.kv: missing"}, num_loaded_tokens={"FILE": 40}, num_stored_tokens={"FILE": 8})
    r2 = ExampleWorkerReport(errors={"x": "bad magic"}, num_stored_tokens={"FILE": 8, "CPU": 4})
    meta = MultiKVConnectorWorkerMetadata(metadata=(r1, None, r2))
    # what kvlab's executor reads off a report: the children's, merged
    assert meta.num_loaded_tokens == {"FILE": 40}
    assert meta.num_stored_tokens == {"FILE": 16, "CPU": 4}
    assert meta.errors == {"x": "layers.1.kv: missing; bad magic"}
    with pytest.raises(ValueError, match="cannot merge reports of 2 and 3 connectors"):
        MultiKVConnectorWorkerMetadata(metadata=(None, None)).aggregate(meta)

    LOG.clear()
    conn = multi(child("A"), child("B"))
    output = KVConnectorOutput(worker_meta=MultiKVConnectorWorkerMetadata(metadata=(r1, None)), errors={"x": "merged"})
    conn.update_connector_output(output)
    assert LOG == ["A.update_connector_output({'FILE': 8}, {'x': 'layers.1.kv: missing'})", "B.update_connector_output(None, {})"]
    assert output.worker_meta.metadata == (r1, None) and output.errors == {"x": "merged"}  # given back as it came
    with pytest.raises(TypeError, match="worker_meta must be a MultiKVConnectorWorkerMetadata or None, got ExampleWorkerReport"):
        conn.update_connector_output(KVConnectorOutput(worker_meta=r1))
    # vLLM's own record (``vllm.v1.outputs.KVConnectorOutput``): the report under vLLM's name, no errors field.
    LOG.clear()
    vllm_output = SimpleNamespace(finished_sending=None, finished_recving=set(), kv_connector_worker_meta=meta)
    conn3 = multi(child("A"), child("B"), child("C"))
    conn3.update_connector_output(vllm_output)  # type: ignore[arg-type]
    assert LOG == [
        "A.update_connector_output({'FILE': 8}, no errors field)",
        "B.update_connector_output(None, no errors field)",
        "C.update_connector_output({'FILE': 8, 'CPU': 4}, no errors field)",
    ]
    assert vllm_output.kv_connector_worker_meta is meta and not hasattr(vllm_output, "errors")


class Numbers:
    """A child's worker report that merges by adding its sets (as HiSparse's reports do)."""

    def __init__(self, ids: set[int]) -> None:
        self.ids = ids

    def aggregate(self, other: Numbers) -> Numbers:
        return Numbers(self.ids | other.ids)


def test_worker_metadata_is_none_when_no_child_reports_and_merges_child_by_child() -> None:
    assert multi(child("A", report=False), child("B", report=False), role=KVConnectorRole.WORKER).build_connector_worker_meta() is None
    report = multi(child("A", report=False), child("B"), role=KVConnectorRole.WORKER).build_connector_worker_meta()
    assert report is not None and report.metadata[0] is None and report.metadata[1].num_stored_tokens == {"FILE": 1}
    one = MultiKVConnectorWorkerMetadata(metadata=(Numbers({1}), None, Numbers({5})))
    two = MultiKVConnectorWorkerMetadata(metadata=(Numbers({2}), Numbers({3}), None))
    merged = one.aggregate(two).metadata
    assert [m.ids for m in merged] == [{1, 2}, {3}, {5}]


# -- stats ------------------------------------------------------------------------------------------------------
def nixl(xfer, post, nbytes, descs, **failures) -> NixlKVConnectorStats:
    stats = NixlKVConnectorStats()
    for x, p, b, d in zip(xfer, post, nbytes, descs):
        stats.record_transfer(telemetry(x * 1e6, p * 1e6, b, d))
    for key, n in failures.items():
        stats.data[key] += [1] * n
    return stats


def test_nixl_stats_reduce_as_vllm() -> None:
    stats = nixl([0.010, 0.030, 0.020], [0.001, 0.002, 0.004], [3 * 2**20, 2**20, 2 * 2**20], [12, 7, 9], num_failed_handshakes=1)
    assert stats.reduce() == {
        "Num successful transfers": 3,
        "Avg xfer time (ms)": 20.0,
        "P90 xfer time (ms)": 28.0,
        "Avg post time (ms)": 2.333,
        "P90 post time (ms)": 3.6,
        "Avg MB per transfer": 2.0,
        "Throughput (MB/s)": 100.0,
        "Avg number of descriptors": 9.3,
        "Num failed transfers": 1,
        "Num KV expired reqs": 0,
        "Num notifs after expiry": 0,
    }
    failures_only = nixl([], [], [], [], num_kv_expired_reqs=2, num_failed_notifications=1)
    assert not failures_only.is_empty()  # an interval of failures is still logged
    assert failures_only.reduce() == {
        "Num successful transfers": 0,
        "Avg xfer time (ms)": 0,
        "P90 xfer time (ms)": 0,
        "Avg post time (ms)": 0,
        "P90 post time (ms)": 0,
        "Avg MB per transfer": 0,
        "Throughput (MB/s)": 0,
        "Avg number of descriptors": 0,
        "Num failed transfers": 1,
        "Num KV expired reqs": 2,
        "Num notifs after expiry": 0,
    }
    assert NixlKVConnectorStats().is_empty()
    sent = stats.clone_and_reset()
    assert sent.num_successful_transfers == 3 and stats.is_empty() and stats.data["transfer_duration"] == []
    stats.data["transfer_duration"].append(1.0)
    with pytest.raises(ValueError, match="one entry per transfer"):
        stats.reduce()


def test_stats_are_kept_per_child_class_and_rebuilt_by_name() -> None:
    conn = multi(child("A", xfer=(10_000, 1_000, 2**20, 4)), child("B"), child("C", xfer=(30_000, 3_000, 3 * 2**20, 6)))
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, MultiKVConnectorStats) and list(stats.data) == ["MultiTestChild"]  # A and C: one class
    assert stats["MultiTestChild"].data["transfer_duration"] == [0.01, 0.03]
    assert multi(child("B")).get_kv_connector_stats() is None
    # across processes the payload is plain data: the class registered under each name rebuilds it
    rebuilt = MultiConnector.build_kv_connector_stats(stats.to_dict())
    assert isinstance(rebuilt["MultiTestChild"], NixlKVConnectorStats) and rebuilt.to_dict() == stats.to_dict()
    assert MultiConnector.build_kv_connector_stats({"ExampleConnector": {"x": [1]}}).data == {}  # keeps no stats: left out
    with pytest.raises(ValueError, match="Connector 'Nope' is not registered."):
        MultiConnector.build_kv_connector_stats({"Nope": {}})
    # the frontend's log line, for a MultiConnector: one interval of two payloads
    logging = KVConnectorLogging(vllm_config(child("A")).kv_transfer_config)
    logging.observe(MultiConnector.build_kv_connector_stats({"MultiTestChild": nixl([0.010], [0.001], [2**20], [4])}).to_dict())
    logging.observe({"MultiTestChild": nixl([0.030], [0.003], [3 * 2**20], [6]).to_dict()})
    lines: list[tuple] = []
    logging.log(log_fn=lambda *args: lines.append(args))
    assert lines == [
        (
            "KV Transfer metrics: %s",
            "MultiTestChild={'Num successful transfers': 2, 'Avg xfer time (ms)': 20.0, 'P90 xfer time (ms)': 28.0, "
            "'Avg post time (ms)': 2.0, 'P90 post time (ms)': 2.8, 'Avg MB per transfer': 2.0, 'Throughput (MB/s)': 100.0, "
            "'Avg number of descriptors': 5.0, 'Num failed transfers': 0, 'Num KV expired reqs': 0, 'Num notifs after expiry': 0}",
        )
    ]
    assert logging.transfer_stats_accumulator is None


def test_multi_stats_aggregate_reset_and_refuse_a_mismatch() -> None:
    first = MultiKVConnectorStats(data={"NixlConnector": nixl([0.010], [0.001], [2**20], [4])})
    second = MultiKVConnectorStats(data={"NixlConnector": nixl([0.030], [0.003], [2**20], [4]), "Other": nixl([], [], [], [])})
    assert first.aggregate(second) is first
    assert first["NixlConnector"].data["transfer_duration"] == [0.01, 0.03] and first["Other"] is second["Other"]
    assert not first.is_empty() and MultiKVConnectorStats().is_empty()
    first.reset()
    assert first.is_empty() and first["NixlConnector"].data["transfer_duration"] == []
    with pytest.raises(TypeError, match="other must be a MultiKVConnectorStats, got NixlKVConnectorStats"):
        first.aggregate(nixl([], [], [], []))
    with pytest.raises(TypeError, match="cannot aggregate NixlConnector's MultiKVConnectorStats into its NixlKVConnectorStats"):
        first.aggregate(MultiKVConnectorStats(data={"NixlConnector": MultiKVConnectorStats()}))


def test_prom_metrics_go_to_each_child_class_once() -> None:
    from prometheus_client import Counter, Gauge, Histogram

    observed: list[tuple] = []

    class ChildMetrics(KVConnectorPromMetrics):
        def observe(self, transfer_stats_data, engine_idx=0):
            observed.append((transfer_stats_data, engine_idx))

    built: list[str] = []

    def build(cls, vllm_config, *args):
        built.append(vllm_config.kv_transfer_config.kv_connector_extra_config["name"])
        return ChildMetrics(vllm_config, *args)

    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    original = MultiTestChild.build_prom_metrics
    MultiTestChild.build_prom_metrics = classmethod(build)  # type: ignore[method-assign,assignment]
    try:
        metrics = MultiConnector.build_prom_metrics(
            vllm_config(child("A"), child("B"), child("C", "ExampleConnector")), types, ["e"], {0: ["0"]}
        )
    finally:
        MultiTestChild.build_prom_metrics = original  # type: ignore[method-assign]
    assert built == ["A"] and isinstance(metrics, MultiKVConnectorPromMetrics)
    metrics.observe({"MultiTestChild": {"transfer_duration": [1.5]}, "ExampleConnector": {"x": [1]}}, engine_idx=0)
    assert observed == [({"transfer_duration": [1.5]}, 0)]


# -- configuration ------------------------------------------------------------------------------------------------
def test_the_children_must_agree_on_the_cache_layout() -> None:
    assert MultiConnector.get_required_kvcache_layout(vllm_config(child("A"), child("B", layout="HND"))) == "HND"
    assert MultiConnector.get_required_kvcache_layout(vllm_config(child("A"))) is None
    with pytest.raises(ValueError, match=r"KV cache layout mismatch: the child connectors need \['HND', 'NHD'\]"):
        MultiConnector.get_required_kvcache_layout(vllm_config(child("A", layout="NHD"), child("B", layout="HND")))


def test_built_by_the_factory_from_vllms_call_only(tmp_path) -> None:
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    config = vllm_config(example, child("A", "MultiTestHMAChild"))
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert type(conn) is MultiConnector and [type(c) for c in conn.sub_connectors] == [ExampleConnector, MultiTestHMAChild]
    assert conn.sub_connectors[0].kv_role == "kv_consumer" and conn.sub_connectors[0].block_size == BS
    engine_ids = {c._kv_transfer_config.engine_id for c in conn.sub_connectors[1:]} | {config.kv_transfer_config.engine_id}
    assert len(engine_ids) == 1  # the children serve the parent's engine
    assert conn.supports_divergent_local_hybrid_hits is False
    with pytest.raises(TypeError, match=r"MultiConnector is built from vLLM's call"):
        KVConnectorFactory.create_connector(config.kv_transfer_config, KVConnectorRole.SCHEDULER, BS)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: MultiConnector(None, KVConnectorRole.SCHEDULER, None), TypeError, r"MultiConnector\(vllm_config, role, kv_cache_config\)"),
        (
            lambda: MultiConnector(SimpleNamespace(kv_transfer_config=KVTransferConfig("MultiConnector")), KVConnectorRole.SCHEDULER, None),
            ValueError,
            r"kv_connector_extra_config=\{'connectors': \[",
        ),
        (
            lambda: multi({"kv_connector": "MultiTestChild", "kv_connector_module_path": "tests"}),
            TypeError,
            r"kv_connector_extra_config\['connectors'\]\[0\]: .*kv_connector_module_path.*KVTransferConfig's fields \['engine_id', ",
        ),
        (lambda: multi({"kv_connector": "Nope"}), ValueError, "unknown kv_connector 'Nope'"),
        (
            lambda: multi(child("A")).get_loaded_kv_cache_group_ids(Request("r", [1], max_tokens=1)),
            RuntimeError,
            "no child connector serves request 'r'",
        ),
        (
            lambda: multi(child("A"), role=KVConnectorRole.WORKER).bind_connector_metadata(KVConnectorMetadata()),
            TypeError,
            "connector_metadata must be a MultiKVConnectorMetadata, got KVConnectorMetadata",
        ),
        (
            lambda: multi(child("A"), role=KVConnectorRole.WORKER).bind_connector_metadata(MultiKVConnectorMetadata(metadata=())),
            ValueError,
            "holds 0 parts for 1 connectors",
        ),
    ],
)
def test_bad_input_is_refused_by_name(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call()


def test_shutdown_reaches_every_child_and_raises_the_failure() -> None:
    conn = multi(child("A"), child("B"))
    calls = []

    def broken():
        calls.append("A")
        raise OSError("disk gone")

    conn._connectors[0].shutdown = broken  # type: ignore[method-assign]
    conn._connectors[1].shutdown = lambda: calls.append("B")  # type: ignore[method-assign]
    with pytest.raises(OSError, match="disk gone"):
        conn.shutdown()
    assert calls == ["A", "B"]


# -- two ExampleConnectors through a real model (vLLM's test_multi_example_connector_consistency) -------------
TOK = ByteTokenizer()
PROMPT = TOK.encode("Two connectors save the same prompt; one of them loads it. ")


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    torch.set_num_threads(1)
    return TinyLlama(seed=0)


class NamedExampleConnector(ExampleConnector):
    """kvlab's ExampleConnector built as vLLM builds a connector, its ``kv_transfer_params``
    kept under its directory's name. Two plain ExampleConnectors that both save answer with
    the same keys, which a MultiConnector refuses (see below); vLLM's own test wraps its
    example connector likewise (``TestExampleConnector``)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        ktc = vllm_config.kv_transfer_config
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        super().__init__(role, block_size, ktc.kv_connector_extra_config, kv_role=ktc.kv_role)

    def request_finished(self, request, block_ids):
        sends, params = super().request_finished(request, block_ids)
        return sends, {os.path.basename(self.storage_path): params}


KVConnectorFactory.register_connector("NamedExampleConnector", __name__, "NamedExampleConnector")


def test_two_saving_example_connectors_clash_on_their_transfer_params(tmp_path) -> None:
    children = [{"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / d)}} for d in "ab"]
    with pytest.raises(RuntimeError, match="Key clash in kv_transfer_params from multiple connectors"):
        multi(*children).request_finished(Request("r", [1, 2, 3], max_tokens=1), [1])


def example_engine(model, dirs) -> LLMEngine:
    children = [
        {"kv_connector": "NamedExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(d)}}
        for d in dirs
    ]
    config = vllm_config(*children)
    kvc = KVCacheConfig(
        num_blocks=32, kv_cache_tensors=(), kv_cache_groups=(KVCacheGroupSpec(("layers.0", "layers.1"), FullAttentionSpec(block_size=BS)),)
    )
    mgr = KVCacheManager(num_blocks=32, block_size=BS, event_log=EventLog())
    runner = ModelRunner(
        model, num_blocks=32, block_size=BS, device="cpu", kv_connector=MultiConnector(config, KVConnectorRole.WORKER, kvc)
    )
    sched = Scheduler(mgr, connector=MultiConnector(config, KVConnectorRole.SCHEDULER, kvc), kv_transfer_config=config.kv_transfer_config)
    return LLMEngine(mgr, sched, runner)


def test_two_example_connectors_save_alike_and_the_first_with_the_prompt_loads_it(model, tmp_path) -> None:
    s1, s2 = tmp_path / "storage_1", tmp_path / "storage_2"
    first = example_engine(model, [s1, s2])
    first.add_request(Request("r", PROMPT, max_tokens=1))
    first.run()
    params = first.finished["r"].kv_transfer_params
    assert sorted(params) == ["storage_1", "storage_2"] and params["storage_1"]["folder"] == params["storage_2"]["folder"]
    (folder,) = os.listdir(s1)
    assert os.listdir(s2) == [folder]
    assert not filecmp.dircmp(s1 / folder, s2 / folder).diff_files  # byte for byte the same KV
    assert sorted(os.listdir(s1 / folder)) == ["layers.0.kv", "layers.1.kv", "meta.json"]
    n = len(PROMPT)

    def load_from(dirs) -> list[str]:
        eng = example_engine(model, dirs)
        eng.add_request(Request("r", PROMPT, max_tokens=4))
        eng.run()
        assert eng.finished["r"].output_token_ids == model.generate_dense(PROMPT, 4)
        assert eng.executor.num_tokens_computed == 1 + 3  # the prompt's last token, then 3 decode steps
        loads = [e for e in eng.events if isinstance(e, KVTransfer) and e.direction == "load"]
        assert [(e.request_id, e.num_tokens) for e in loads] == [("r", n - 1)]
        return [os.path.dirname(p) for p in loads[0].paths]

    assert load_from([s1, s2]) == [str(s1)]  # both hold it: the first serves
    shutil.rmtree(s1 / folder)
    assert load_from([s1, s2]) == [str(s2)]  # only the second holds it now
    assert os.listdir(s1) == [folder]  # ... and the first saved it again (save to all)
