"""vLLM 0.33's call shapes for the file-system tier and what surrounds it: the
``OffloadingKVEventsConfig`` gate on the tier's events, ``FileSystemTierManager`` over real
files (blocks written are found and read back byte for byte, the lost publish race), the
``DualQueueThreadPool``'s queues and shutdown, the ``kv_load_tiers`` filter parse and where
it is applied, and the tiering manager's tier-poll thread and request-level cascade.

Every wait is bounded; no assertion is about a duration (they count things)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from offloading_config import offloading_config

from kvlab.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched_mod
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.staged_scheduler import StagedOffloadingConnectorScheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    KV_LOAD_TIERS_KEY,
    _create_req_context,
    _parse_tier_filter,
)
from kvlab.kv_offload import config as oc
from kvlab.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingKVEventsConfig,
    OffloadingMetricMetadata,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.kv_offload.tiering import manager as tiering_manager
from kvlab.kv_offload.tiering.base import TransferJob
from kvlab.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from kvlab.kv_offload.tiering.fs import io as fs_io
from kvlab.kv_offload.tiering.fs import manager as fs_manager
from kvlab.kv_offload.tiering.fs.io import write_block_file
from kvlab.kv_offload.tiering.fs.manager import FileSystemTierManager
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
from kvlab.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from kvlab.kv_offload.tiering.staged import StagedTieringManager

BLOCK = mmap.PAGESIZE  # one chunk's bytes: a page, so O_DIRECT (where it works) accepts it
N_CHUNKS = 4
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
WAIT_S = 30.0


def key(n: int) -> bytes:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def spec(*, engine_events: bool = False) -> SimpleNamespace:
    """What the tier reads of vLLM's ``OffloadingSpec``: its config, blocks per chunk, and
    the KV events switches (0.33's ``OffloadingKVEventsConfig``)."""
    parallel = oc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True)
    return SimpleNamespace(
        config=offloading_config(enable_kv_cache_events=engine_events, parallel=parallel),
        blocks_per_chunk=1,
        kv_events_config=OffloadingKVEventsConfig(enable_kv_cache_events=engine_events, self_describing_kv_events=False),
    )


@pytest.fixture
def chunks():
    """``N_CHUNKS`` page-aligned rows of ``BLOCK`` bytes (O_DIRECT needs aligned buffers)."""
    raw = np.zeros(N_CHUNKS * BLOCK + mmap.PAGESIZE, dtype=np.uint8)
    skip = -raw.ctypes.data % mmap.PAGESIZE
    return raw[skip : skip + N_CHUNKS * BLOCK].reshape(N_CHUNKS, BLOCK)


@pytest.fixture
def tier(chunks, tmp_path):
    t = FileSystemTierManager(spec(), memoryview(chunks), "fs", root_dir=str(tmp_path), n_read_threads=2, n_write_threads=2)
    yield t
    t.shutdown()


def job(job_id: int, keys: list[bytes], chunk_ids: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(job_id, keys, np.array(chunk_ids, dtype=np.int64), promotion, ReqContext("r"))


def finished(t: FileSystemTierManager) -> list[tuple[int, bool]]:
    t.drain_jobs()
    return sorted((r.job_id, r.success) for r in t.get_finished_jobs())


def resolve(t: FileSystemTierManager, keys: list[bytes], ctx: ReqContext) -> list[LookupResult]:
    """Ask, end the step (the batch goes to the lookup thread), wait (bounded) for every
    answer, ask again."""
    first = [t.lookup(k, ctx) for k in keys]
    t.on_schedule_end(END)
    lm = t._lookup_manager
    deadline = time.monotonic() + WAIT_S
    while any(lm._lookup_state[k].phase.name != "RESOLVED" for k in keys):
        assert time.monotonic() < deadline, "the lookup thread did not answer"
        lm.drain_results()
        time.sleep(0.005)
    assert first == [LookupResult.RETRY] * len(keys)  # a fresh key is never answered at once
    return [t.lookup(k, ctx) for k in keys]


# -- OffloadingKVEventsConfig -------------------------------------------------------------------


def test_kv_events_config_is_a_frozen_record_of_the_two_switches() -> None:
    c = OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False)
    assert dataclasses.astuple(c) == (True, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.enable_kv_cache_events = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        OffloadingKVEventsConfig(enable_kv_cache_events=True)  # type: ignore[call-arg]


@pytest.mark.parametrize(("engine_events", "locality", "expected"), [(True, "REMOTE", 1), (False, "LOCAL", 0)])
def test_the_tier_publishes_a_stored_event_only_when_the_engine_publishes_events(
    chunks, tmp_path, caplog, engine_events, locality, expected
) -> None:
    caplog.set_level(logging.WARNING, logger=fs_manager.__name__)
    t = FileSystemTierManager(
        spec(engine_events=engine_events), memoryview(chunks), "fs", root_dir=str(tmp_path), enable_kv_events=True, locality=locality
    )
    try:
        t.submit_store(job(1, [key(1), key(2)], [0, 1]))
        assert finished(t) == [(1, True)]
        events = list(t.take_events())
        assert len(events) == expected
        assert [(e.keys, e.medium, e.removed, e.locality) for e in events] == [([key(1), key(2)], Medium.STORAGE, False, Locality.REMOTE)][
            :expected
        ]
        assert list(t.take_events()) == []  # drained
        # Off for the engine: the tier's own opt-in is refused with one warning naming the tier.
        warned = [r.getMessage() for r in caplog.records if "enable_kv_events" in r.getMessage()]
        assert len(warned) == 1 - expected and all("'fs'" in w for w in warned)
    finally:
        t.shutdown()


def test_metric_definitions_are_frozen_records_whose_kind_is_the_class() -> None:
    gauge = OffloadingGaugeMetadata("chunks pinned", labelnames=("tier",))
    hist = OffloadingHistogramMetadata("delay", buckets=(0.1, 1.0))
    counter = OffloadingCounterMetadata("bytes")
    assert dataclasses.astuple(gauge) == ("chunks pinned", ("tier",), "mostrecent")
    assert dataclasses.astuple(hist) == ("delay", (), (0.1, 1.0))
    assert dataclasses.astuple(counter) == ("bytes", ())
    assert OffloadingHistogramMetadata("d").buckets is None
    assert all(isinstance(m, OffloadingMetricMetadata) for m in (gauge, hist, counter))
    assert not isinstance(counter, OffloadingGaugeMetadata)
    with pytest.raises(dataclasses.FrozenInstanceError):
        gauge.labelnames = ()  # type: ignore[misc]


def test_an_unknown_locality_is_refused_naming_the_enum(chunks, tmp_path) -> None:
    with pytest.raises(ValueError, match="'local' is not a valid Locality"):
        FileSystemTierManager(spec(), memoryview(chunks), "fs", root_dir=str(tmp_path), locality="local")


# -- FileSystemTierManager over real files -------------------------------------------------------


def test_blocks_written_through_the_033_api_are_found_and_read_back_byte_for_byte(tier, chunks) -> None:
    rng = np.random.default_rng(7)
    chunks[:2] = rng.integers(0, 256, size=(2, BLOCK), dtype=np.uint8)
    expected = chunks[:2].copy()
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert finished(tier) == [(1, True)]
    for k, row in zip((key(1), key(2)), expected):
        with open(tier.file_mapper.get_file_name(k), "rb") as f:
            assert f.read() == row.tobytes()  # a raw chunk: exactly its bytes, no header

    ctx = ReqContext("reader")
    assert resolve(tier, [key(1), key(2), key(3)], ctx) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]

    chunks[:] = 0
    tier.submit_load(job(2, [key(2), key(1)], [3, 2], promotion=True))  # into other chunks, crossed
    assert finished(tier) == [(2, True)]
    assert chunks[3].tobytes() == expected[1].tobytes() and chunks[2].tobytes() == expected[0].tobytes()
    assert not chunks[:2].any()  # nothing else was written


def test_a_load_that_stops_at_a_short_file_keeps_the_blocks_before_it(tier, chunks) -> None:
    chunks[:3] = np.arange(3, dtype=np.uint8)[:, None] + 1
    tier.submit_store(job(1, [key(1), key(2), key(3)], [0, 1, 2]))
    assert finished(tier) == [(1, True)]
    ctx = ReqContext("r")
    assert resolve(tier, [key(1), key(2), key(3)], ctx) == [LookupResult.HIT] * 3
    bad = tier.file_mapper.get_file_name(key(2))
    with open(bad, "wb") as f:
        f.write(b"x" * 10)
    tier.submit_load(job(2, [key(1), key(2), key(3)], [3, 2, 1], promotion=True))
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success, result.successful_keys) == (2, False, (key(1),))
    assert result.transfer_bytes == 3 * BLOCK
    assert not os.path.exists(bad)  # a short file is damage: removed
    assert os.path.exists(tier.file_mapper.get_file_name(key(3)))  # never read: left alone
    # The failed key and the one after it are misses for this request now; the first stays a hit.
    assert [tier.lookup(k, ctx) for k in (key(1), key(2), key(3))] == [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]


def test_a_store_that_loses_the_publish_race_succeeds_and_leaves_the_winners_file(tier, chunks, monkeypatch) -> None:
    """Some shared file systems fail the rename with EEXIST when another engine published the
    same block first: the file in place holds these bytes (its name is their hash)."""
    dest = tier.file_mapper.get_file_name(key(1))
    chunks[0] = 5
    tier.submit_store(job(1, [key(1)], [0]))
    assert finished(tier) == [(1, True)]
    real_exists, real_replace = os.path.exists, os.replace
    renames: list[str] = []

    def losing_replace(src: str, dst: str) -> None:
        if dst == dest:
            renames.append(src)
            raise FileExistsError(errno.EEXIST, "File exists", dst)
        real_replace(src, dst)

    monkeypatch.setattr(fs_io.os.path, "exists", lambda p: p != dest and real_exists(p))
    monkeypatch.setattr(fs_io.os, "replace", losing_replace)
    chunks[1] = 9  # other bytes: the loser must not overwrite
    tier.submit_store(job(2, [key(1)], [1]))
    assert finished(tier) == [(2, True)]
    assert len(renames) == 1  # the race was really run
    assert os.listdir(os.path.dirname(dest)) == [os.path.basename(dest)]  # no temporary file left
    with open(dest, "rb") as f:
        assert set(f.read()) == {5}


def test_a_store_that_fails_otherwise_fails_its_job_and_leaves_no_file(tier, chunks, monkeypatch) -> None:
    def full_disk(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    monkeypatch.setattr(fs_io.os, "replace", full_disk)
    tier.submit_store(job(1, [key(1)], [0]))
    assert finished(tier) == [(1, False)]
    dest = tier.file_mapper.get_file_name(key(1))
    assert os.listdir(os.path.dirname(dest)) == []


def test_kvlab_runs_the_python_io_path_and_says_so() -> None:
    """vLLM picks its C extension when built; kvlab has none, and the flags say it."""
    assert (fs_io._HAS_FSIO_C, fs_manager._HAS_BATCH_LOOKUP_C) == (False, False)


# -- DualQueueThreadPool ------------------------------------------------------------------------


def test_the_pool_refuses_bad_jobs_and_jobs_after_shutdown() -> None:
    pool = DualQueueThreadPool(n_read_threads=1, n_write_threads=1)
    try:
        with pytest.raises(ValueError, match=r"job 3: n_tasks=2 but 1 tasks were given \(at least 1\)"):
            pool.enqueue_load(job_id=3, n_tasks=2, tasks=[lambda: None])
        assert (len(pool._load_q), len(pool._store_q)) == (0, 0)  # nothing half-queued
        with pytest.raises(ValueError, match="n_read_threads"):
            DualQueueThreadPool(n_read_threads=0, n_write_threads=1)
    finally:
        pool.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.enqueue_store(job_id=4, n_tasks=1, tasks=[lambda: None])


def test_shutdown_drops_queued_tasks_fails_their_jobs_and_stops_every_thread() -> None:
    pool = DualQueueThreadPool(n_read_threads=1, n_write_threads=1, thread_name_prefix="t033pool")
    gate, started = threading.Event(), threading.Semaphore(0)
    ran: list[int] = []

    def blocker() -> None:
        started.release()
        gate.wait(timeout=WAIT_S)

    try:
        pool.enqueue_store(job_id=1, n_tasks=1, tasks=[blocker])
        pool.enqueue_load(job_id=2, n_tasks=1, tasks=[blocker])
        for _ in range(2):
            assert started.acquire(timeout=WAIT_S)  # both threads are busy now
        for j in range(3, 8):
            pool.enqueue_store(job_id=j, n_tasks=1, tasks=[lambda j=j: ran.append(j)])
        assert (len(pool._load_q), len(pool._store_q)) == (0, 5)
        with pytest.raises(TimeoutError, match=r"0 loads, 5 stores queued"):
            pool.wait_idle(timeout_s=0.05)
        pool.shutdown(wait=False)  # the queued five are dropped while both threads are busy
        assert (len(pool._load_q), len(pool._store_q)) == (0, 0)
        assert sorted(pool.get_finished()) == [(j, False, 0.0) for j in range(3, 8)]
    finally:
        gate.set()
        for t in pool._threads:
            t.join(timeout=WAIT_S)
    assert len(pool._threads) == 2 and not any(t.is_alive() for t in pool._threads)
    assert ran == [] and sorted(r[:2] for r in pool.get_finished()) == [(1, True), (2, True)]  # the running ones ended


# -- kv_load_tiers: the parse, the request's context, where it applies ---------------------------


@pytest.mark.parametrize(
    ("raw", "matchers"),
    [
        ([{"medium": "storage"}], (TierMatcher(Medium.STORAGE),)),
        ([{"medium": "Cpu", "locality": "remote"}], (TierMatcher(Medium.CPU, Locality.REMOTE),)),
        ([{}], (TierMatcher(),)),
        ([{"medium": "cpu"}, {"locality": "LOCAL"}], (TierMatcher(Medium.CPU), TierMatcher(locality=Locality.LOCAL))),
        ([], ()),  # asked for no tier: a deny-all filter, not ALL
    ],
)
def test_parse_tier_filter_valid(raw, matchers, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=sched_mod.__name__)
    f = _parse_tier_filter(raw)
    assert f == TierFilter(matchers) and f is not TierFilter.ALL
    assert caplog.records == []


@pytest.mark.parametrize(
    ("raw", "warning"),
    [
        ("cpu", "kv_load_tiers must be a list of matcher dicts, got str; ignoring it"),
        ([{"medium": "gpu"}], "kv_load_tiers: unknown medium 'gpu' (one of ['CPU', 'STORAGE']); skipping the entry"),
        ([{"locality": 3}], "kv_load_tiers: unknown locality 3 (one of ['LOCAL', 'REMOTE']); skipping the entry"),
        (["cpu"], "kv_load_tiers: entry 'cpu' is not a dict; skipping it"),
    ],
)
def test_parse_tier_filter_falls_back_to_all_tiers_with_a_warning(raw, warning, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=sched_mod.__name__)
    assert _parse_tier_filter(raw) is TierFilter.ALL
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_parse_tier_filter_keeps_the_good_entries_in_order(caplog) -> None:
    caplog.set_level(logging.WARNING, logger=sched_mod.__name__)
    f = _parse_tier_filter([{"medium": "storage"}, None, {"medium": "bogus"}, {"medium": "cpu", "locality": "x"}, {"medium": "cpu"}])
    assert f.matchers == (TierMatcher(Medium.STORAGE), TierMatcher(Medium.CPU))
    assert len(caplog.records) == 3


def test_the_request_context_carries_the_filter_its_params_and_hints() -> None:
    params = {KV_LOAD_TIERS_KEY: [{"medium": "cpu"}], "other": 1}
    ctx = _create_req_context(SimpleNamespace(request_id="r1", kv_transfer_params=params, kv_hints="h"))
    assert (ctx.req_id, ctx.kv_transfer_params, ctx.kv_hints) == ("r1", params, "h")
    assert ctx.load_tier_filter == TierFilter((TierMatcher(Medium.CPU),))
    for absent in (None, {}, {"other": 1}):
        plain = _create_req_context(SimpleNamespace(request_id="r2", kv_transfer_params=absent))
        assert plain.load_tier_filter is TierFilter.ALL and plain.kv_hints is None


@pytest.fixture
def staged(tmp_path):
    """A CPU tier of two slots over a disk of four: b is on disk only (a and c pushed it out
    of the CPU tier), a in both."""
    t = StagedTieringManager(CPUOffloadingManager(2), StagedFileSystemTier(4, str(tmp_path)))
    for name in (b"b", b"a", b"c"):
        plan = t.prepare_store([make_offload_key(name * 32)])
        for p in plan.cascade_paths:
            write_block_file(p, b"", b"")
        t.complete_store(plan)
    return t


@pytest.mark.parametrize(
    ("tiers", "media"),
    [
        (None, ["CPU", "STORAGE"]),
        ([{"medium": "cpu"}], ["CPU"]),  # the disk may not serve: b is a miss
        ([], ["CPU"]),  # no secondary tier at all; the CPU tier always answers (vLLM's rule)
        ([{"medium": "storage"}], ["CPU", "STORAGE"]),
        ([{"medium": "bogus"}], ["CPU", "STORAGE"]),  # nothing usable: as if absent
    ],
)
def test_the_connector_applies_kv_load_tiers_to_the_storage_tier(staged, tiers, media) -> None:
    conn = StagedOffloadingConnectorScheduler(staged, block_size=16)
    params = None if tiers is None else {KV_LOAD_TIERS_KEY: tiers}
    st = conn._state(SimpleNamespace(request_id="r", kv_transfer_params=params, block_hashes=[]))
    assert staged.lookup_chain([make_offload_key(n * 32) for n in (b"a", b"b")], st.req_context) == media


# -- the tiering manager: tier-poll thread and request-level cascade ------------------------------


class _PolledTier(ExampleSecondaryTierManager):
    tolerates_off_thread_polling = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.serves = 0
        self.shutdowns = 0
        self.served = threading.Event()

    def serve_external_requests(self, parent) -> None:
        self.serves += 1
        self.served.set()

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def region(request):
    r = SharedOffloadRegion(f"kvlab_t033_{os.getpid()}_{request.node.name[:30]}", 4, None, 4096, 4096)
    yield r
    r.cleanup()


def _poll_threads() -> int:
    return sum(t.name == "vllm_offload_tier_poll" and t.is_alive() for t in threading.enumerate())


def test_stop_tier_poll_thread_stops_it_and_shutdown_then_tears_the_tiers_down(region) -> None:
    primary = CPUPrimaryTierOffloadingManager(4, region)
    tier = _PolledTier(None, primary.get_kv_memoryview(), "peer")
    before = _poll_threads()
    m = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0.001)
    try:
        assert tier.served.wait(WAIT_S) and _poll_threads() == before + 1
        m._stop_tier_poll_thread()
        assert m._tier_poll_thread is None and _poll_threads() == before
        serves = tier.serves
        with m.lock:
            m.on_schedule_end(END)  # per step still serves
        assert tier.serves == serves + 1
    finally:
        m.shutdown()
    assert tier.shutdowns == 1
    m._stop_tier_poll_thread()  # a second stop has nothing to do


def test_a_wedged_poll_thread_is_torn_down_under_the_lock_or_refused_when_the_caller_holds_it(region, monkeypatch) -> None:
    primary = CPUPrimaryTierOffloadingManager(4, region)
    tier = _PolledTier(None, primary.get_kv_memoryview(), "peer")
    m = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0.001)
    release = threading.Event()
    try:
        m._stop_tier_poll_thread()
        stuck = threading.Thread(target=release.wait, kwargs={"timeout": WAIT_S}, daemon=True)
        stuck.start()
        m._tier_poll_thread = stuck
        monkeypatch.setattr(tiering_manager, "_TIER_POLL_JOIN_TIMEOUT_S", 0.05)
        with m.lock, pytest.raises(RuntimeError, match="call shutdown\\(\\) without holding manager.lock"):
            m.shutdown()
        assert tier.shutdowns == 0  # refused: nothing torn down
        m.shutdown()
        assert tier.shutdowns == 1 and m.lock.acquire(timeout=WAIT_S)
        m.lock.release()
    finally:
        release.set()
        stuck.join(timeout=WAIT_S)


class _WholeRequestTier(ExampleSecondaryTierManager):
    def on_new_request(self, req_context):
        return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)


class _RefusingTier(_WholeRequestTier):
    def submit_store(self, job_metadata):
        raise OSError("tier is read-only")


def test_the_request_level_cascade_sends_held_blocks_parks_pending_ones_and_refuses_retry(region, monkeypatch) -> None:
    primary = CPUPrimaryTierOffloadingManager(4, region)
    whole = _WholeRequestTier(None, primary.get_kv_memoryview(), "whole")
    m = TieringOffloadingManager(primary, [whole], tier_poll_interval_s=0)
    a, b = ReqContext("a"), ReqContext("b")
    m.on_new_request(a)
    m.prepare_store([key(1), key(2)], a)
    m.complete_store([key(1)], a, True)  # 1 readable; 2 still being written
    assert m.on_new_request(b).policy is OffloadPolicy.REQUEST_LEVEL
    jobs = len(m._jobs)
    m._cascade_existing_chunks_to_request_level_tiers([key(1), key(2), key(3)], b, {0})
    assert len(m._jobs) == jobs + 1 and [j.transfer_job.keys for j in m._jobs.values()][-1] == [key(1)]
    assert m._req_state["b"].pending_cascade_keys == [key(2)]  # 3 is nowhere: dropped

    monkeypatch.setattr(m.primary_tier, "lookup", lambda k, c: LookupResult.RETRY)
    with pytest.raises(AssertionError, match="primary tier answered RETRY"):
        m._cascade_existing_chunks_to_request_level_tiers([key(1)], b, {0})
    m.shutdown()


def test_a_tier_refusing_the_cascade_raises_without_an_errors_list(region) -> None:
    primary = CPUPrimaryTierOffloadingManager(4, region)
    m = TieringOffloadingManager(primary, [_RefusingTier(None, primary.get_kv_memoryview(), "ro")], tier_poll_interval_s=0)
    a = ReqContext("a")
    m.on_new_request(a)
    m.prepare_store([key(1)], a)
    with pytest.raises(OSError, match="read-only"):
        m.complete_store([key(1)], a, True)
    errors: list[Exception] = []
    m._cascade_existing_chunks_to_request_level_tiers([key(1)], a, {0}, errors)
    assert [str(e) for e in errors] == ["tier is read-only"]
    with pytest.raises(OSError, match="read-only"):
        m._cascade_existing_chunks_to_request_level_tiers([key(1)], a, {0})
    m.shutdown()
