"""The offload metrics (vLLM 0.33): the self-describing ``OffloadingConnectorStats`` payload,
the CPU tier's ``get_stats`` and ``config_info``, and the connector's
``get_kv_connector_stats``.

Checked against vLLM 0.33.0's own classes (the unpacked wheel): 300 random sequences of
counter, gauge, histogram, info, aggregate, reduce and reset calls on both payload classes,
and 300 random store workloads on both ``CPUOffloadingManager``s with ``get_stats`` compared
along the way, gave equal payloads throughout. Durations (transfer and lookup seconds) are
recorded but no test reads them: they depend on the machine.
"""

from __future__ import annotations

import pytest

from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from kvlab.kv_offload.base import ReqContext, make_offload_key
from kvlab.kv_offload.config import OffloadingCacheConfig, OffloadingGroupConfig, OffloadingModelConfig
from kvlab.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.metrics.kv_connector_stats import KVConnectorStats
from offloading_config import offloading_config


def _k(i: int) -> bytes:
    return make_offload_key(bytes([i]) * 32)


def test_counters_add_gauges_keep_the_latest_and_histograms_keep_every_sample() -> None:
    a, b = OffloadingConnectorStats(), OffloadingConnectorStats()
    a.increase_counter("c", 2)
    a.set_gauge("g", 0.5)
    a.observe_histogram("h", 10, ("1:fs",))
    b.increase_counter("c", 3)
    b.set_gauge("g", 0.25)
    b.observe_histogram("h", 20, ("1:fs",))
    b.set_info([{"tier": "0:primary"}])
    assert a.aggregate(b) is a
    assert a.data == {
        "types": {"c": "counter", "g": "gauge", "h": "histogram"},
        "data": {"c": {(): 5}, "g": {(): 0.25}, "h": {("1:fs",): [10, 20]}},
        "info": [{"tier": "0:primary"}],
    }
    assert a.reduce() == {"c": 5, "g": 0.25, "h:('1:fs',)_count": 2, "h:('1:fs',)_sum": 30}
    a.aggregate(OffloadingConnectorStats(data={"types": {"c": "counter"}, "data": {"c": {(): 1}}, "info": None}))
    assert (a.data["data"]["c"], a.data["info"]) == ({(): 6}, [{"tier": "0:primary"}])  # a payload without info keeps it
    info_only = OffloadingConnectorStats()
    info_only.set_info([{}])
    assert (OffloadingConnectorStats().is_empty(), info_only.is_empty()) == (True, False)


def test_only_offloading_payloads_merge() -> None:
    with pytest.raises(TypeError, match="can only aggregate an OffloadingConnectorStats, got Other"):

        class Other(KVConnectorStats):
            def is_empty(self) -> bool:
                return False

        OffloadingConnectorStats().aggregate(Other())


def test_the_cpu_tier_reports_how_full_it_is_and_each_allocation() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store([_k(1), _k(2), _k(3)], ctx)
    assert out is not None
    s = m.get_stats().data["data"]  # three of four chunks being written
    assert (s[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC], s[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC]) == ({(): 0.75}, {(): 0.75})
    assert (s[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC], s[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE]) == ({(): 0.0}, {(): [3]})
    m.complete_store([_k(1), _k(2), _k(3)], ctx)
    m.prepare_load([_k(1)], ctx)  # one readable chunk pinned; the other two are evictable: not in use
    s = m.get_stats().data["data"]
    assert (s[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC], s[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC]) == ({(): 0.25}, {(): 0.25})
    assert CPUOffloadingMetrics.CPU_ALLOCATION_SIZE not in s and CPUOffloadingMetrics.STORES_SKIPPED not in s


def test_a_store_threshold_counts_the_stores_it_turned_away() -> None:
    m = CPUOffloadingManager(4, store_threshold=2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_store([_k(1), _k(2)], ctx)  # each offered once: neither admitted yet

    def skipped() -> int:
        return m.get_stats().data["data"][CPUOffloadingMetrics.STORES_SKIPPED][()]

    assert (skipped(), skipped()) == (2, 0)  # the counter restarts at every call
    m.prepare_store([_k(3)], ctx)
    assert skipped() == 1


def test_the_cpu_tier_publishes_its_size() -> None:
    cfg = offloading_config(
        groups=(OffloadingGroupConfig(16, ("l0",), 0), OffloadingGroupConfig(16, ("l1",), 1, sliding_window_size_in_chunks=2)),
        model=OffloadingModelConfig("m", "float16", max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
    )
    info = CPUOffloadingInfo.from_config(cfg, num_chunks=100, kv_bytes_per_chunk=16384)
    # a 1,024-token request takes 16 chunks of the full group and 2 of the window group
    assert CPUOffloadingManager(100, info=info).config_info() == [
        {"cpu_num_chunks": 100, "cpu_blocks_per_chunk": 4, "cpu_kv_cache_size_bytes": 1638400, "cpu_kv_cache_size_tokens": 5688}
    ]
    assert CPUOffloadingInfo(1, 1, 1, None).as_config_info()["cpu_kv_cache_size_tokens"] == "None"
    assert CPUOffloadingInfo.config_info_keys() == (
        "cpu_num_chunks",
        "cpu_blocks_per_chunk",
        "cpu_kv_cache_size_bytes",
        "cpu_kv_cache_size_tokens",
    )
    with pytest.raises(TypeError, match="info must be None or a CPUOffloadingInfo"):
        CPUOffloadingManager(4, info={"cpu_num_chunks": 4})  # type: ignore[arg-type]


# -- the tiering manager's metrics ------------------------------------------------------------------
def _tiering_view(stats) -> dict:
    """Tiering metrics by short name; a histogram (a duration) by its sample count only."""
    d = stats.data["data"]
    return {
        n.removeprefix("vllm:kv_offload_tiering_"): {lab: (len(v) if isinstance(v, list) else v) for lab, v in series.items()}
        for n, series in d.items()
        if n.startswith("vllm:kv_offload_tiering_")
    }


def test_the_tiering_tracker_counts_lookups_once_and_jobs_by_their_keys() -> None:
    """One request's lookups and two jobs, with the values vLLM 0.33's tracker gave for the
    same calls: a key counts once per tier until the request is allocated (RETRYs count
    nothing but start the wait the async delay records); a promotion that failed part-way
    counts a failure and the bytes of the key that made it; a cascade counts every key."""
    import numpy as np

    from kvlab.kv_offload.base import LookupResult
    from kvlab.kv_offload.tiering.base import JobResult, TransferJob
    from kvlab.kv_offload.tiering.staged import JobMetadata
    from kvlab.kv_offload.tiering.metrics import TieringMetricsTracker

    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    P, F = ("0:primary",), ("1:fs",)
    t = TieringMetricsTracker(["fs"], 8, 2048)
    r = ReqContext("r1")
    t.on_new_request(r)
    for key, lab, res in [(a, P, "MISS"), (a, F, "RETRY"), (a, F, "RETRY"), (a, F, "HIT"), (a, P, "MISS"), (b, P, "HIT")]:
        t.on_lookup(r, key, lab, LookupResult[res], 0.001)
    t.on_request_allocated(r)
    t.on_lookup(r, c, P, LookupResult.MISS, 0.001)  # allocated: not counted
    promotion = JobMetadata(TransferJob(1, [a, b], np.array([2, 5]), True, r), 0)
    t.on_job_registered(promotion)
    assert _tiering_view(t.take_stats()) == {
        "primary_write_usage_perc": {F: 0.25},
        "primary_read_usage_perc": {F: 0.0},
        "active_promotion_jobs": {F: 1},
        "active_cascade_jobs": {F: 0},
        "chunk_queries": {P: 2, F: 1},
        "lookup_sync_delay_seconds": {P: 2, F: 1},
        "chunk_hits": {F: 1, P: 1},
        "lookup_async_delay_seconds": {F: 1},
    }
    t.on_job_finished(promotion, JobResult(1, False, [a]))
    cascade = JobMetadata(TransferJob(2, [a, b, c], np.array([2, 5, 6]), False, r), 0)
    t.on_job_registered(cascade)
    t.on_job_finished(cascade, JobResult(2, True, None, 0.5, 999))
    t.on_promotion_allocation_failure()
    idle = {
        "primary_write_usage_perc": {F: 0.0},
        "primary_read_usage_perc": {F: 0.0},
        "active_promotion_jobs": {F: 0},
        "active_cascade_jobs": {F: 0},
    }
    assert _tiering_view(t.take_stats()) == {
        **idle,
        "promotion_job_failures": {F: 1},
        "read_bytes": {F: 2048},
        "promotion_latency_seconds": {(*F, "failure"): 1},
        "write_bytes": {F: 6144},
        "write_time": {F: 0.5},
        "promotion_allocation_failures": {(): 1},
    }
    assert _tiering_view(t.take_stats()) == idle  # the gauges stay; the counts were taken
    with pytest.raises(AssertionError, match="never registered"):
        t.on_job_finished(cascade, JobResult(2, True))


# -- the frontend: Prometheus and the interval log ---------------------------------------------------
def _prom(extra: dict | None = None, engines: int = 1):
    """OffloadPromMetrics over real prometheus_client metrics in a registry of their own."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    registry = CollectorRegistry()
    types = {base: type(base.__name__, (base,), {"__init__": lambda self, *a, _b=base, **kw: _b.__init__(self, *a, registry=registry, **kw)})
             for base in (Gauge, Counter, Histogram)}  # fmt: skip
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra or {}))
    labels = {i: ["m", str(i)] for i in range(engines)}
    return OffloadingConnector.build_prom_metrics(config, types, ["model_name", "engine"], labels), registry


def test_an_engine_run_becomes_prometheus_samples(tmp_path) -> None:
    from kvlab import Request
    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.engine.llm_engine import build_engine

    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    extra = {"num_cpu_blocks": 4, "storage_path": str(tmp_path), "num_storage_blocks": 8}
    prom, registry = _prom(extra)
    tiny = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    cfg = KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra)
    eng = build_engine(num_blocks=8, block_size=4, kv_transfer_config=cfg, executor=ModelRunner(TinyLlama(tiny, seed=0)))
    eng.add_request(Request("A", list(range(100, 109)), max_tokens=1))
    block_bytes = 0
    while eng.has_unfinished_requests():  # a frontend observes every step's payload
        eng.step()
        payload = eng.scheduler.make_stats().kv_connector_stats
        if payload is not None:
            prom.observe(payload)
        block_bytes = block_bytes or eng.scheduler.connector.manager.chunk_size_bytes
    engine = {"model_name": "m", "engine": "0"}
    # the two full blocks of A went to the CPU tier in one store job
    store_bytes = registry.get_sample_value("vllm:kv_offload_store_bytes_total", engine)
    assert (store_bytes, block_bytes > 0) == (2 * block_bytes, True)
    assert registry.get_sample_value("vllm:kv_offload_store_size_count", engine) == 1
    assert registry.get_sample_value("vllm:kv_offload_store_size_sum", engine) == store_bytes
    # kvlab's tiers report as vLLM's tiering spec: one config series per tier, the facts in labels
    series = [s for m in registry.collect() if m.name == "vllm:kv_offload_config_info" for s in m.samples]
    assert [(s.labels["tier"], s.labels["cpu_num_chunks"], s.value) for s in series] == [("0:primary", "4", 1.0), ("1:fs", "", 1.0)]
    # the lookup of A's blocks stopped at the first miss: one chunk asked about, in the CPU tier
    assert registry.get_sample_value("vllm:kv_offload_tiering_chunk_queries_total", {**engine, "tier": "0:primary"}) == 1


def test_prometheus_refuses_what_was_never_declared() -> None:
    prom, _ = _prom()
    with pytest.raises(AssertionError, match="never declared"):
        prom.observe({"types": {"my:metric": "counter"}, "data": {"my:metric": {(): 1}}})
    with pytest.raises(AssertionError, match="Unknown offloading stats key: vllm:kv_offload_load_bytes"):
        prom.observe({"types": {}, "data": {"vllm:kv_offload_load_bytes": {(): 1}}})


def test_the_interval_log_sums_payloads_and_skips_an_info_only_one() -> None:
    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    log = KVConnectorLogging(KVTransferConfig("OffloadingConnector"))
    for n in (10, 32):
        s = OffloadingConnectorStats()
        s.increase_counter("vllm:kv_offload_load_bytes", n)
        log.observe(s.data)
    lines: list[str] = []
    log.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: vllm:kv_offload_load_bytes=42"]
    info_only = OffloadingConnectorStats()
    info_only.set_info([{"cpu_num_chunks": 4}])
    log.observe(info_only.data)
    log.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and log.transfer_stats_accumulator is None
    with pytest.raises(RuntimeError, match="no KV connector is configured"):
        KVConnectorLogging(None).observe({})
