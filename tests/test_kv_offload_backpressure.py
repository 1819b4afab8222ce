"""vLLM 0.33's back-pressure on a secondary tier: detectors, policies, the factory, and how
the tiering manager and the offloading connector use them.

Every expected value below was first produced by vLLM 0.33.0's own
``vllm/v1/kv_offload/tiering/backpressure.py`` driven by the same calls (its
``time.monotonic`` replaced by the same fake clock); a differential run of 1,000 random call
sequences (94,902 calls) found the two equal after every call, state included. Time is a
fake clock here: no verdict depends on how fast the machine runs.
"""

from __future__ import annotations

import pytest

from kvlab.kv_offload.base import make_offload_key
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.tiering import backpressure as bp
from kvlab.kv_offload.tiering.factory import create_backpressure_detector
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.staged import StagedTieringManager

MIB = 1 << 20


class FakeClock:
    def __init__(self, t: float = 50.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ema(high: float = 0.01, low: float = 0.002, **kw: object) -> tuple[bp.EMABackpressureDetector, FakeClock]:
    clock = FakeClock()
    return bp.EMABackpressureDetector(high, low, clock=clock, **kw), clock  # type: ignore[arg-type]


def test_warm_up_samples_seed_the_average_and_never_signal_pressure():
    d, _ = ema(warmup_completions=3)
    for elapsed in (0.02, 0.03, 0.04):  # 1 MiB each: 0.02..0.04 s/MiB, all above the high mark
        d.on_store_completed(elapsed, MIB)
    assert (d.store_latency_ema, d.is_under_pressure()) == (pytest.approx(0.03), False)
    d.on_store_completed(0.03, 2 * MIB)  # 0.015 s/MiB: 0.15 * 0.015 + 0.85 * 0.03
    assert (d.store_latency_ema, d.is_under_pressure()) == (pytest.approx(0.02775), True)


def test_throttled_policy_drops_a_share_that_grows_with_the_overshoot():
    d, _ = ema(warmup_completions=0)
    d.on_store_completed(0.1, MIB)  # no warm-up: 0.15 * 0.1 = 0.015, half above the high mark
    assert d.store_latency_ema == pytest.approx(0.015)
    # drop rate = 0.5 / ramp 2.0 = a quarter (0.2499... in floats): the fifth decision drops
    assert [d.should_store(2) for _ in range(8)] == [True, True, True, True, False, True, True, True]
    assert d.policy.pop_stores_dropped() == (1, 2)
    assert d.policy.pop_stores_dropped() == (0, 0)


def test_drop_store_policy_drops_every_store_under_pressure():
    d, _ = ema(warmup_completions=0, policy=bp.DropStorePolicy())
    d.on_store_completed(0.1, MIB)
    assert [d.should_store(3) for _ in range(3)] == [False, False, False]
    assert d.policy.pop_stores_dropped() == (3, 9)


def test_silence_decays_the_average_then_a_cooldown_lets_every_second_store_through():
    d, clock = ema(warmup_completions=0, alpha=1.0)
    d.on_store_completed(0.04, MIB)  # alpha 1: the average is the sample
    seen = []
    for dt in (4.0, 4.0, 2.0):  # half-life 2 s
        clock.t += dt
        seen.append((d.is_under_pressure(), d.store_latency_ema))
    assert seen == [(True, pytest.approx(0.01)), (True, pytest.approx(0.0025)), (False, pytest.approx(0.00125))]
    assert [d.should_store(1) for _ in range(4)] == [True, False, True, False]  # 1 s cooldown
    clock.t += 1.0
    assert [d.should_store(1) for _ in range(3)] == [True, True, True]


def test_three_failed_stores_in_a_row_put_a_disk_tier_under_pressure():
    cfg = bp.EMABackpressureDetector.default_config("fs")
    d = bp.EMABackpressureDetector(**cfg, clock=FakeClock())
    trips = []
    for _ in range(3):
        d.on_store_failed()
        trips.append(d.is_under_pressure())
    assert trips == [False, False, True]
    assert d.store_latency_ema == pytest.approx(0.04)  # 4 x the high mark: every store dropped
    assert d.should_store(5) is False
    assert d.stats == {"store_latency_ema": pytest.approx(0.04), "consecutive_store_failures": 3}
    assert d.policy.pop_stores_dropped() == (1, 5)
    d.on_store_completed(0.001, MIB)  # a success ends the streak
    assert d.stats["consecutive_store_failures"] == 0


def test_failures_are_ignored_without_a_threshold():
    d, _ = ema()
    for _ in range(10):
        d.on_store_failed()
    assert d.is_under_pressure() is False


def test_ten_fast_stores_in_a_row_make_a_tier_healthy():
    d, _ = ema(warmup_completions=0)
    healthy = []
    for _ in range(11):
        d.on_store_completed(0.001, MIB)
        healthy.append(d.is_healthy())
    assert healthy == [False] * 9 + [True, True]


def test_update_measures_from_submission_on_the_detectors_clock_and_ignores_empty_jobs():
    d, clock = ema(warmup_completions=0, alpha=1.0)
    d.update(clock.t - 0.05, 0)
    assert d.store_latency_ema == 0.0
    d.update(clock.t - 0.05, 2 * MIB)
    assert d.store_latency_ema == pytest.approx(0.025)
    d.reset()
    assert (d.store_latency_ema, d.is_under_pressure(), d.stats["consecutive_store_failures"]) == (0.0, False, 0)


def test_default_water_marks_by_tier_type_and_locality():
    cfg = bp.EMABackpressureDetector.default_config
    assert cfg("fs") == {"high_water_s": 0.01, "low_water_s": 0.002, "failure_threshold": 3}
    assert cfg("fs", locality="remote") == {"high_water_s": 0.05, "low_water_s": 0.01, "failure_threshold": 3}
    assert cfg("obj") == {"high_water_s": 0.05, "low_water_s": 0.01, "failure_threshold": 3}
    assert cfg("p2p") == {"high_water_s": 0.01, "low_water_s": 0.002}


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"alpha": 0.0}, ValueError, r"alpha must be in \(0, 1\], got 0.0"),
        ({"alpha": 1.5}, ValueError, r"alpha must be in \(0, 1\]"),
        ({"low_water_s": 0.02}, ValueError, r"low_water_s \(0.02\) must be <= high_water_s \(0.01\)"),
        ({"failure_threshold": 0}, ValueError, "failure_threshold must be >= 1, got 0"),
        ({"failure_threshold": 1.5}, TypeError, "failure_threshold must be an int"),
        ({"warmup_completions": -1}, ValueError, "warmup_completions=-1 is out of range"),
        ({"high_water_s": "fast"}, TypeError, "high_water_s must be a finite number"),
        ({"policy": "DropStorePolicy"}, TypeError, "policy must be None or a BackpressurePolicy"),
        ({"clock": 3.0}, TypeError, "clock must be None or a function"),
    ],
)
def test_bad_detector_arguments_are_refused_by_name(kwargs, exc, match):
    args = {"high_water_s": 0.01, "low_water_s": 0.002, **kwargs}
    with pytest.raises(exc, match=match):
        bp.EMABackpressureDetector(**args)


def test_throttled_policy_needs_the_ema_detector_and_a_positive_ramp():
    class Always(bp.BackpressureDetector):
        def on_store_completed(self, elapsed_s, num_bytes):
            pass

        def is_under_pressure(self):
            return True

        def reset(self):
            pass

    with pytest.raises(TypeError, match="ThrottledDropPolicy needs an EMABackpressureDetector, got Always"):
        Always().should_store(1)
    assert Always(policy=bp.DropStorePolicy()).should_store(1) is False
    with pytest.raises(ValueError, match="ramp_factor"):
        bp.ThrottledDropPolicy(ramp_factor=0)


# -- the factory -------------------------------------------------------------------------------


def test_the_factory_fills_the_tier_types_defaults_and_keeps_what_the_config_sets():
    d = create_backpressure_detector({"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.02}, "fs")
    assert isinstance(d, bp.EMABackpressureDetector) and isinstance(d.policy, bp.ThrottledDropPolicy)
    assert (d.high_water_s, d.low_water_s, d._failure_threshold) == (0.02, 0.002, 3)
    d = create_backpressure_detector(
        {"backpressure_cls": "kvlab.kv_offload.tiering.backpressure.EMABackpressureDetector", "policy_cls": "DropStorePolicy"},
        "obj",
    )
    assert isinstance(d.policy, bp.DropStorePolicy) and (d.high_water_s, d.low_water_s) == (0.05, 0.01)
    assert create_backpressure_detector(None, "fs") is None


@pytest.mark.parametrize(
    ("config", "exc", "match"),
    [
        ({}, ValueError, "backpressure config must include 'backpressure_cls'"),
        ({"backpressure_cls": "NoSuchDetector"}, ValueError, "has no class 'NoSuchDetector'"),
        ({"backpressure_cls": "DropStorePolicy"}, TypeError, "is not a BackpressureDetector"),
        (
            {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "EMABackpressureDetector"},
            TypeError,
            "is not a BackpressurePolicy",
        ),
        ({"backpressure_cls": "EMABackpressureDetector", "low_water_s": 1.0}, ValueError, "must be <= high_water_s"),
        ("EMABackpressureDetector", TypeError, "backpressure must be None or a dict"),
    ],
)
def test_the_factory_refuses_bad_configs_by_name(config, exc, match):
    with pytest.raises(exc, match=match):
        create_backpressure_detector(config, "fs")


# -- the tiering manager -----------------------------------------------------------------------


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [make_offload_key(bytes([i]) * 32, 0) for i in range(start, start + n)]


def _tiers(tmp_path, detector):
    fs = StagedFileSystemTier(8, str(tmp_path), block_size=4, backpressure_detector=detector)
    return StagedTieringManager(CPUOffloadingManager(8, enable_events=True), fs)


def test_a_pressured_disk_tier_gets_no_cascade_and_the_blocks_stay_in_the_cpu_tier(tmp_path):
    d, _ = ema(warmup_completions=0, policy=bp.DropStorePolicy())
    d.on_store_completed(0.1, MIB)  # under pressure
    mgr = _tiers(tmp_path, d)
    plan = mgr.prepare_store(_keys(3))
    assert plan is not None
    assert (len(plan.keys), plan.cascade_keys, plan.cascade_dropped, plan.cascade_submit_time) == (3, [], 3, None)
    mgr.complete_store(plan)
    assert [mgr.where(k) for k in _keys(3)] == ["CPU", "CPU", "CPU"]
    assert d.policy.pop_stores_dropped() == (1, 3)


def test_the_tiering_metrics_report_the_disk_tiers_pressure_and_drops(tmp_path):
    """vLLM 0.33's tiering metrics, labelled by tier: the detector's average seconds per MiB,
    and the stores and blocks its policy dropped since the last call."""
    d, _ = ema(warmup_completions=0, policy=bp.DropStorePolicy())
    d.on_store_completed(0.1, MIB)  # under pressure
    mgr = _tiers(tmp_path, d)
    mgr.complete_store(mgr.prepare_store(_keys(3)))
    data = mgr.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_backpressure_store_latency_ema"] == {("1:fs",): d.store_latency_ema}
    assert data["vllm:kv_offload_tiering_backpressure_stores_dropped"] == {("1:fs",): 1}
    assert data["vllm:kv_offload_tiering_backpressure_blocks_dropped"] == {("1:fs",): 3}
    assert "vllm:kv_offload_tiering_backpressure_stores_dropped" not in mgr.get_stats().data["data"]  # popped
    assert mgr.config_info() == [{"tier": "0:primary"}, {"tier": "1:fs"}]


def test_a_cascade_feeds_its_time_since_submission_to_the_detector(tmp_path):
    d, clock = ema(warmup_completions=0, alpha=1.0)
    mgr = _tiers(tmp_path, d)
    plan = mgr.prepare_store(_keys(2))
    assert (len(plan.cascade_keys), plan.cascade_submit_time) == (2, 50.0)
    clock.t += 0.05
    mgr.complete_store(plan, cascade_bytes=2 * MIB)
    assert d.store_latency_ema == pytest.approx(0.025)  # 0.05 s for 2 MiB
    # A failed cascade counts against the tier; a plan whose GPU copy failed says nothing.
    d2 = bp.EMABackpressureDetector(0.01, 0.002, failure_threshold=1, clock=clock)
    mgr2 = _tiers(tmp_path / "b", d2)
    failed = mgr2.prepare_store(_keys(2))
    mgr2.complete_store(failed, success=False)
    assert d2.stats["consecutive_store_failures"] == 0
    plan2 = mgr2.prepare_store(_keys(2, start=10))
    mgr2.complete_store(plan2, cascade_success=False)
    assert (d2.stats["consecutive_store_failures"], d2.is_under_pressure()) == (1, True)
    mgr2.reset_cache()
    assert (d2.is_under_pressure(), mgr2.where(_keys(2, start=10)[0])) == (False, None)


def test_the_fs_tier_refuses_a_detector_of_the_wrong_type(tmp_path):
    with pytest.raises(TypeError, match="backpressure_detector must be None or a BackpressureDetector, got dict"):
        StagedFileSystemTier(4, str(tmp_path), backpressure_detector={"backpressure_cls": "EMABackpressureDetector"})  # type: ignore[arg-type]


# -- the offloading connector ------------------------------------------------------------------


def test_the_connector_builds_the_disk_tiers_detector_and_a_pressured_disk_misses_bs_files(tmp_path):
    from kvlab import Request
    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.engine.llm_engine import build_engine

    extra = dict(
        num_cpu_blocks=8,
        storage_path=str(tmp_path),
        num_storage_blocks=12,
        backpressure={"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy", "failure_threshold": 1},
    )
    eng = build_engine(
        num_blocks=8, block_size=4, kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra)
    )
    tiers = eng.scheduler.connector.manager
    d = tiers.secondary.bp_detector
    assert isinstance(d, bp.EMABackpressureDetector) and (d.high_water_s, d.low_water_s) == (0.01, 0.002)
    d._clock = FakeClock()  # frozen: no idle decay, so the pressure below stays
    eng.add_request(Request("A", list(range(100, 109)), max_tokens=1))
    eng.run()
    assert len(tiers.secondary) == 2  # A's two full blocks reached the disk
    d.on_store_failed()  # one failure is this tier's threshold: pressure
    eng.add_request(Request("B", list(range(200, 217)), max_tokens=1))
    merged = type(eng.scheduler.connector).build_kv_connector_stats()
    while eng.has_unfinished_requests():
        eng.step()
        merged.aggregate(eng.scheduler.kv_connector_stats)
    assert (len(tiers.primary), len(tiers.secondary)) == (6, 2)  # B's 4 blocks: CPU only
    # the drops reach the step's metrics (which take them from the policy's counters)
    dropped = merged.data["data"]
    assert (
        dropped["vllm:kv_offload_tiering_backpressure_stores_dropped"],
        dropped["vllm:kv_offload_tiering_backpressure_blocks_dropped"],
    ) == (
        {("1:fs",): 1},
        {("1:fs",): 4},
    )
    assert d.policy.pop_stores_dropped() == (0, 0)


@pytest.mark.parametrize(
    ("extra", "exc", "match"),
    [
        ({"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}, ValueError, "backpressure applies to the disk tier"),
        ({"storage_path": "{tmp}", "backpressure": {"policy_cls": "DropStorePolicy"}}, ValueError, "must include 'backpressure_cls'"),
    ],
)
def test_the_connector_refuses_a_backpressure_config_it_cannot_use(tmp_path, extra, exc, match):
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    extra = {k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in extra.items()}
    with pytest.raises(exc, match=match):
        OffloadingConnector(KVConnectorRole.SCHEDULER, 4, extra)
    assert not any(tmp_path.iterdir())  # refused before any tier was made
