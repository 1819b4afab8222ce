"""vLLM 0.33's asynchronous tier interface: ``TieringOffloadingManager`` over a
``CPUPrimaryTierOffloadingManager`` and ``SecondaryTierManager``s. The scenario's values
were produced by vLLM 0.33.0's own classes first (the same script, run on both)."""

from __future__ import annotations

import os
import threading

import pytest

from kvlab.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvlab.kv_offload.tiering.base import JobResult, SecondaryTierManager
from kvlab.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from kvlab.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from kvlab.metrics.cache_hit_source import CacheHitSource
from offload_tiers import answered, tier_spec

K = {n: make_offload_key(n.encode() * 32, 0) for n in "ABCD"}
NAME = {v: k for k, v in K.items()}


class SlowDisk(SecondaryTierManager):
    """A disk whose lookups take one poll to answer (RETRY) and whose jobs end at the next poll."""

    medium = Medium.STORAGE

    def __init__(self, view: memoryview) -> None:
        super().__init__(None, view, "disk")
        self.files: set[bytes] = set()
        self.asked: set[bytes] = set()
        self.known: set[bytes] = set()
        self.queue: list = []

    def lookup(self, key, req_context):
        if key in self.files:
            return LookupResult.HIT
        if key in self.known:
            return LookupResult.MISS
        self.asked.add(key)
        return LookupResult.RETRY

    def submit_store(self, job_metadata):
        self.queue.append(job_metadata)

    def submit_load(self, job_metadata):
        self.queue.append(job_metadata)

    def get_finished_jobs(self):
        self.known |= self.asked
        self.asked = set()
        out = []
        for job in self.queue:
            if not job.is_promotion:
                self.files |= set(job.keys)
            out.append(JobResult(job.job_id, True, transfer_bytes=4096 * len(job.keys)))
        self.queue = []
        return out

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def drain_jobs(self):
        return

    def has_pending_work(self):
        return bool(self.queue)


@pytest.fixture
def region(request):
    r = SharedOffloadRegion(f"kvlab_test_{os.getpid()}_{request.node.name[:40]}", 2, None, 4096, 4096)
    yield r
    r.cleanup()


def build(region, *, poll_s=0.0):
    primary = CPUPrimaryTierOffloadingManager(2, region, enable_events=True)
    view = primary.get_kv_memoryview()
    disk = SlowDisk(view)
    example = ExampleSecondaryTierManager(None, view, "example", custom_param=7)
    return TieringOffloadingManager(primary, [disk, example], tier_poll_interval_s=poll_s), disk, example


def test_a_block_evicted_from_the_cpu_tier_is_promoted_back_from_disk_as_vllm_does(region):
    m, disk, example = build(region)
    ctx = {r: ReqContext(r) for r in ("r1", "r2", "r3")}

    def look(r, *names):
        return [m.lookup(K[n], ctx[r]).name for n in names]

    def events():
        return [(str(e.medium), e.removed, sorted(NAME[k] for k in e.keys)) for e in m.take_events()]

    def end(*new):
        m.on_schedule_end(ScheduleEndContext(list(new), []))

    assert m.on_new_request(ctx["r1"]).policy is OffloadPolicy.CHUNK_LEVEL
    assert look("r1", "A", "B") == ["RETRY", "RETRY"]  # the disk is still finding out
    out = m.prepare_store([K["A"], K["B"]], ctx["r1"])
    assert (out.keys_to_store, out.store_spec.chunk_ids.tolist(), out.evicted_keys) == ([K["A"], K["B"]], [0, 1], [])
    m.complete_store([K["A"], K["B"]], ctx["r1"], True)
    # One cascade job per tier: the disk's waits for a poll, the example tier's is done.
    assert [(j.job_id, j.is_promotion, [NAME[k] for k in j.keys], j.chunk_ids.tolist()) for j in disk.queue] == [
        (0, False, ["A", "B"], [0, 1])
    ]
    assert sorted(NAME[k] for k in example.chunks) == ["A", "B"] and m.has_pending_work()
    end("r1")
    assert events() == [("CPU", False, ["A", "B"])]

    m.on_new_request(ctx["r2"])
    out = m.prepare_store([K["C"]], ctx["r2"])  # polls first: the cascades ended, A and B are unpinned
    assert (out.keys_to_store, out.store_spec.chunk_ids.tolist(), out.evicted_keys) == ([K["C"]], [0], [K["A"]])
    m.complete_store([K["C"]], ctx["r2"], True)
    assert [(j.job_id, [NAME[k] for k in j.keys]) for j in disk.queue] == [(2, ["C"])]
    m.on_request_finished(ctx["r1"])
    end("r2")
    assert events() == [("CPU", True, ["A"]), ("CPU", False, ["C"])]

    m.on_new_request(ctx["r3"])
    # A is only on disk now: a CPU chunk is reserved and the promotion waits for the step's end.
    assert look("r3", "A", "B", "C", "D") == ["HIT_PENDING", "HIT", "HIT_PENDING", "RETRY"]
    assert m.get_load_source(K["A"], ctx["r3"]) is CacheHitSource.DISK
    end("r3")
    assert [(j.job_id, j.is_promotion, [NAME[k] for k in j.keys], j.chunk_ids.tolist()) for j in disk.queue] == [
        (4, True, ["A", "C"], [0, 1])
    ]
    assert look("r3", "A", "C", "D") == ["HIT", "HIT", "MISS"]
    assert m.get_load_source(K["A"], ctx["r3"]) is CacheHitSource.DISK  # read from host memory, reported as a disk hit
    assert m.prepare_load([K["A"]], ctx["r3"]).chunk_ids.tolist() == [0]
    m.complete_load([K["A"]], ctx["r3"])
    end()
    assert events() == [("CPU", True, ["C"]), ("CPU", True, ["B"]), ("CPU", False, ["A", "C"])]

    data = m.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_chunk_queries"] == {("0:primary",): 6, ("2:example",): 3, ("1:disk",): 2}
    assert data["vllm:kv_offload_tiering_chunk_hits"] == {("1:disk",): 2, ("0:primary",): 1}
    assert data["vllm:kv_offload_tiering_read_bytes"] == {("1:disk",): 8192}
    assert data["vllm:kv_offload_tiering_write_bytes"] == {("1:disk",): 12288, ("2:example",): 12288}
    assert data["vllm:kv_offload_cpu_allocation_size"] == {(): [2, 1, 1, 1]}
    assert m.config_info() == [{"tier": "0:primary"}, {"tier": "1:disk"}, {"example_info": 7, "tier": "2:example"}]

    m.reset_cache()
    assert look("r3", "B") == ["MISS"]  # promotions held: a worker may still write a freed chunk
    m.on_reset_flushed()
    assert look("r3", "B") == ["HIT_PENDING"]
    m.shutdown()


def test_a_partial_promotion_makes_only_the_keys_that_arrived_readable(region):
    m, disk, _ = build(region)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    disk.files = {K["A"], K["B"]}
    assert [m.lookup(K[n], ctx).name for n in "AB"] == ["HIT_PENDING", "HIT_PENDING"]
    m.on_schedule_end(ScheduleEndContext(["r"], []))
    (job,) = disk.queue
    disk.queue = []
    disk.get_finished_jobs = lambda: [JobResult(job.job_id, False, successful_keys=[K["B"]])]
    assert m.lookup(K["A"], ctx) is LookupResult.HIT_PENDING  # poll: A's chunk is freed, then A promoted again
    assert m.lookup(K["B"], ctx) is LookupResult.HIT
    assert m.get_load_source(K["B"], ctx) is CacheHitSource.DISK
    data = m.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_promotion_job_failures"] == {("1:disk",): 1}
    assert data["vllm:kv_offload_tiering_read_bytes"] == {("1:disk",): 4096}  # the key that made it


def test_a_request_level_tier_also_gets_the_blocks_the_cpu_tier_already_had(region):
    class Whole(ExampleSecondaryTierManager):
        def on_new_request(self, req_context):
            return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)

    primary = CPUPrimaryTierOffloadingManager(2, region)
    whole = Whole(None, primary.get_kv_memoryview(), "whole")
    m = TieringOffloadingManager(primary, [whole], tier_poll_interval_s=0)
    a, b = ReqContext("a"), ReqContext("b")
    m.on_new_request(a)
    m.prepare_store([K["A"]], a)
    assert m.on_new_request(b).policy is OffloadPolicy.REQUEST_LEVEL
    out = m.prepare_store([K["A"], K["B"]], b)
    # A is still being written for a: parked for b's cascade; B is new.
    assert out.keys_to_store == [K["B"]] and m._req_state["b"].pending_cascade_keys == [K["A"]]
    m.on_request_finished(b)
    assert sorted(m._req_state) == ["a", "b"]  # b waits: a cascade may still be submitted for it
    m.complete_store([K["A"]], a, True)
    m.complete_store([K["B"]], b, True)
    assert sorted(whole.chunks) == [K["A"], K["B"]] and sorted(m._jobs) == [0, 1]
    m.on_schedule_end(ScheduleEndContext([], []))  # the parked A is readable now: job 2 sends it for b
    # This step's prepare_store already polled, so the end of the step does not poll again.
    assert sorted(m._req_state) == ["a"] and sorted(m._jobs) == [0, 1, 2] and m.has_pending_work()
    m.on_schedule_end(ScheduleEndContext([], []))
    assert m._jobs == {} and not m.has_pending_work()


def test_a_tier_serving_a_peer_goes_through_the_parent_and_never_asks_itself(region):
    served = threading.Event()

    class Peer(ExampleSecondaryTierManager):
        tolerates_off_thread_polling = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ready = False  # the test says when the peer's request arrives
            self.answers: list = []
            self.asked_self = 0

        def lookup(self, key, req_context):
            self.asked_self += 1
            return super().lookup(key, req_context)

        def serve_external_requests(self, parent):
            if not self.ready or served.is_set():
                return
            ctx = ReqContext("peer-1")
            parent.on_new_request(ctx)
            self.answers = [parent.lookup(K[n], ctx).name for n in "AB"]
            job = parent.create_store_job([K[n] for n, a in zip("AB", self.answers) if a == "HIT"], ctx)
            self.sent = (job.job_id, [NAME[k] for k in job.keys], job.chunk_ids.tolist())
            self.completed_jobs.append(JobResult(job.job_id, True))
            parent.on_request_finished(ctx)
            served.set()

    primary = CPUPrimaryTierOffloadingManager(2, region)
    peer = Peer(None, primary.get_kv_memoryview(), "p2p")
    m = TieringOffloadingManager(primary, [peer], tier_poll_interval_s=0.001)
    assert isinstance(m.lock, type(threading.Lock()))
    ctx = ReqContext("local")
    with m.lock:
        m.on_new_request(ctx)
        m.prepare_store([K["A"]], ctx)
        m.complete_store([K["A"]], ctx, True)  # job 0: the cascade to the peer tier itself
        peer.asked_self = 0
        peer.ready = True
    assert served.wait(timeout=60), "the tier-poll thread never served the peer"  # bounded wait; the verdict is below
    with m.lock:
        assert peer.answers == ["HIT", "MISS"] and peer.asked_self == 0  # the parent skips the asking tier
        assert peer.sent == (1, ["A"], [0])
    m.shutdown()
    assert m._tier_poll_thread is None


def test_bad_calls_are_refused_and_change_nothing(region):
    primary = CPUPrimaryTierOffloadingManager(2, region)
    with pytest.raises(TypeError, match="primary_tier must be a CPUPrimaryTierOffloadingManager"):
        TieringOffloadingManager(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"secondary_tiers\[0\] must be a SecondaryTierManager"):
        TieringOffloadingManager(primary, [object()])  # type: ignore[list-item]
    m = TieringOffloadingManager(primary, [], tier_poll_interval_s=0)
    with pytest.raises(KeyError, match="request 'ghost' is not known; call on_new_request first"):
        m.prepare_store([K["A"]], ReqContext("ghost"))
    assert len(primary) == 0
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    with pytest.raises(RuntimeError, match="request 'r' has no store in flight"):
        m.complete_store([K["A"]], ctx, True)
    with pytest.raises(ValueError, match="num_chunks=3 but the region has 2 rows"):
        CPUPrimaryTierOffloadingManager(3, region)


def test_the_shared_region_is_one_file_the_second_opener_joins(tmp_path):
    name = f"kvlab_region_{os.getpid()}"
    first = SharedOffloadRegion(name, 3, 0, 8192, 4096)
    second = SharedOffloadRegion(name, 3, 1, 8192, 4096)
    try:
        a, b = first.create_kv_memoryview(), second.create_kv_memoryview()
        assert (a.shape, a.strides) == ((3, 8192), (8192, 1))
        a[2, 4096] = 42  # rank 1's first byte of chunk 2, written through the first mapping
        assert b[2, 4096] == 42
        assert list(second.iter_worker_slot_ranges()) == [(4096, 4096), (12288, 4096), (20480, 4096)]
        a.release()
        b.release()
    finally:
        second.cleanup()
        first.cleanup()
    assert not os.path.exists(first.mmap_path)  # the creator removes it
    with pytest.raises(ValueError, match="kv_bytes_per_chunk=5000 must be a multiple of the page size"):
        SharedOffloadRegion(name, 1, None, 5000, 4096)
    barrier_calls = []
    r = SharedOffloadRegion(name, 1, None, 4096, 4096, barrier=lambda: barrier_calls.append(1))
    assert barrier_calls == [1] and not os.path.exists(r.mmap_path)  # unlinked once all mapped
    r.cleanup()


def test_cache_hit_sources_report_the_farthest_tier():
    assert CacheHitSource.outermost([CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.DEVICE]) is CacheHitSource.DISK
    assert CacheHitSource.outermost([CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED]) is CacheHitSource.EXTERNAL_UNSPECIFIED
    assert SlowDisk.cache_hit_source is CacheHitSource.DISK and ExampleSecondaryTierManager.cache_hit_source is CacheHitSource.HOST


def test_the_tier_factory_builds_a_registered_or_an_out_of_tree_tier_with_its_detector(region):
    from kvlab.kv_offload.tiering.backpressure import EMABackpressureDetector
    from kvlab.kv_offload.tiering.factory import SecondaryTierFactory

    view = region.create_kv_memoryview()
    config = {"type": "example", "custom_param": 5, "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}
    tier = SecondaryTierFactory.create_secondary_tier(config, view, None)
    assert isinstance(tier, ExampleSecondaryTierManager) and tier.tier_type == "example"
    assert tier.config_info() == {"example_info": 5} and isinstance(tier.bp_detector, EMABackpressureDetector)
    assert config["type"] == "example" and "backpressure" in config  # the caller's dict is not consumed
    out_of_tree = {"type": "ExampleSecondaryTierManager", "module_path": "kvlab.kv_offload.tiering.example.manager"}
    assert SecondaryTierFactory.get_tier_class(out_of_tree) is ExampleSecondaryTierManager
    with pytest.raises(ValueError, match=r"Unknown secondary tier type: 'nope'. Supported types: \['example', 'fs', 'p2p', 'obj'\]"):
        SecondaryTierFactory.get_tier_class({"type": "nope"})
    with pytest.raises(ValueError, match="must include 'type'"):
        SecondaryTierFactory.get_tier_class({})
    with pytest.raises(TypeError, match="CPUOffloadingManager is not a SecondaryTierManager subclass"):
        SecondaryTierFactory.get_tier_class({"type": "CPUOffloadingManager", "module_path": "kvlab.kv_offload.cpu.manager"})
    with pytest.raises(ValueError, match="'example' is already registered"):
        SecondaryTierFactory.register_tier("example", "x", "Y")
    view.release()


# -- the asynchronous file tier: real files, real threads ----------------------------------------
def test_the_file_tier_writes_raw_chunks_and_promotes_them_back_in_later_steps(region, tmp_path):
    import numpy as np

    from kvlab.kv_offload.tiering.fs.manager import FileSystemTierManager

    primary = CPUPrimaryTierOffloadingManager(2, region, enable_events=True)
    view = primary.get_kv_memoryview()
    rows = np.asarray(view)
    fs = FileSystemTierManager(tier_spec(), view, "fs", root_dir=str(tmp_path), n_read_threads=1, n_write_threads=1, enable_kv_events=True)
    m = TieringOffloadingManager(primary, [fs], tier_poll_interval_s=0)
    w, r = ReqContext("writer"), ReqContext("reader")
    m.on_new_request(w)
    for name in "ABC":  # C evicts A from the 2-chunk CPU tier once A's cascade reported
        out = m.prepare_store([K[name]], w)
        rows[out.store_spec.chunk_ids[0]] = ord(name)  # what the worker's GPU -> CPU copy would leave
        m.complete_store([K[name]], w, True)
        fs.drain_jobs()
        m.on_schedule_end(ScheduleEndContext([], []))
    path = fs.file_mapper.get_file_name(K["A"])
    assert open(path, "rb").read() == bytes([ord("A")]) * 4096  # the chunk's bytes, nothing else: vLLM's format
    # A store's event comes when the manager collects the finished job: C's at the next poll.
    assert [(Medium(e.medium).value, [NAME[k] for k in e.keys]) for e in fs.take_events()] == [("STORAGE", ["A"]), ("STORAGE", ["B"])]
    m.on_request_finished(w)

    m.on_new_request(r)
    assert m.lookup(K["A"], r) is LookupResult.RETRY  # the file check runs on the lookup thread
    m.on_schedule_end(ScheduleEndContext(["reader"], []))
    answered(fs)
    assert m.lookup(K["A"], r) is LookupResult.HIT_PENDING  # found on disk: a CPU chunk is reserved
    m.on_schedule_end(ScheduleEndContext([], []))  # the promotion job is submitted
    fs.drain_jobs()
    assert m.lookup(K["A"], r) is LookupResult.HIT
    (chunk,) = m.prepare_load([K["A"]], r).chunk_ids.tolist()
    assert rows[chunk].tobytes() == bytes([ord("A")]) * 4096 and m.get_load_source(K["A"], r) is CacheHitSource.DISK
    m.complete_load([K["A"]], r)
    m.shutdown()


def test_a_damaged_file_fails_its_promotion_is_removed_and_then_reads_as_a_miss(region, tmp_path):
    import numpy as np

    from kvlab.kv_offload.tiering.fs.manager import FileSystemTierManager

    primary = CPUPrimaryTierOffloadingManager(2, region)
    view = primary.get_kv_memoryview()
    fs = FileSystemTierManager(tier_spec(), view, "fs", root_dir=str(tmp_path), n_read_threads=1, n_write_threads=1)
    m = TieringOffloadingManager(primary, [fs], tier_poll_interval_s=0)
    w, r = ReqContext("writer"), ReqContext("reader")
    m.on_new_request(w)
    for name in "ABC":
        out = m.prepare_store([K[name]], w)
        np.asarray(view)[out.store_spec.chunk_ids[0]] = ord(name)
        m.complete_store([K[name]], w, True)
        fs.drain_jobs()
        m.on_schedule_end(ScheduleEndContext([], []))
    path = fs.file_mapper.get_file_name(K["A"])
    with open(path, "r+b") as f:
        f.truncate(100)  # a short file: the only damage a raw block file can show
    m.on_new_request(r)
    m.lookup(K["A"], r)
    m.on_schedule_end(ScheduleEndContext(["reader"], []))
    answered(fs)
    assert m.lookup(K["A"], r) is LookupResult.HIT_PENDING
    m.on_schedule_end(ScheduleEndContext([], []))
    fs.drain_jobs()
    assert m.lookup(K["A"], r) is LookupResult.MISS  # marked a miss: no second promotion of a bad file
    assert not os.path.exists(path)
    assert m.get_stats().data["data"]["vllm:kv_offload_tiering_promotion_job_failures"] == {("1:fs",): 1}
    m.shutdown()


def test_the_file_tier_refuses_a_spec_without_its_config_before_it_starts_a_thread(region, tmp_path):
    from kvlab.kv_offload.tiering.fs.manager import FileSystemTierManager

    view = region.create_kv_memoryview()

    def tier_threads():
        return {t.name for t in threading.enumerate() if t.name.startswith(("kvlab_kv_py_fs", "kvlab_offloading_lookup"))}

    before = tier_threads()
    with pytest.raises(TypeError, match=r"offloading_spec must have config \(an OffloadingConfig\)"):
        FileSystemTierManager(None, view, "fs", root_dir=str(tmp_path))
    with pytest.raises(TypeError, match="root_dir must be a directory path, got int"):
        FileSystemTierManager(tier_spec(), view, "fs", root_dir=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="root_dir must not be empty: the tier's folder would land at the disk's root"):
        FileSystemTierManager(tier_spec(), view, "fs", root_dir="")
    assert tier_threads() == before and list(tmp_path.iterdir()) == []
    view.release()


# -- invariants under random use ------------------------------------------------------------------
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(
    st.tuples(st.sampled_from(["new", "lookup", "store", "complete", "unload", "finish", "end", "reset"]), st.integers(0, 2**16)),
    min_size=1,
    max_size=60,
)


class _HalfWhole(ExampleSecondaryTierManager):
    """Wants every block (prefix hits too) of the odd-numbered requests."""

    def on_new_request(self, req_context):
        whole = int(req_context.req_id[1:]) % 2 == 1
        return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL if whole else OffloadPolicy.CHUNK_LEVEL)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
@example(ops=[("new", 0), ("new", 0), ("store", 0), ("store", 1)])  # r1 wants K0, which r0 is still writing
def test_pins_and_pending_chunks_always_match_the_work_in_flight_and_nothing_leaks(ops):
    region = SharedOffloadRegion(f"kvlab_prop_{os.getpid()}_{threading.get_ident()}", 3, None, 4096, 4096)
    try:
        _drive_randomly(region, ops)
    finally:  # a failing example (hypothesis tries many) must not leave its file in /dev/shm
        region.cleanup()


def _drive_randomly(region, ops):
    primary = CPUPrimaryTierOffloadingManager(3, region)
    view = primary.get_kv_memoryview()
    disk = SlowDisk(view)
    example = _HalfWhole(None, view, "example")
    m = TieringOffloadingManager(primary, [disk, example], tier_poll_interval_s=0)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(6)]
    ctxs: dict[str, ReqContext] = {}
    loads: list[tuple[str, list[bytes]]] = []
    stores: list[tuple[str, list[bytes]]] = []
    held = False

    def check():
        primary.check_invariants()
        pins: dict[bytes, int] = {}
        for _, ks in loads:
            for k in ks:
                pins[k] = pins.get(k, 0) + 1
        for meta in m._jobs.values():
            if not meta.transfer_job.is_promotion:
                for k in meta.transfer_job.keys:
                    pins[k] = pins.get(k, 0) + 1
        writing = {k for _, ks in stores for k in ks}
        writing |= {k for by_req in m._pending_load_submissions.values() for e in by_req.values() for k in e.keys}
        writing |= {k for meta in m._jobs.values() if meta.transfer_job.is_promotion for k in meta.transfer_job.keys}
        for k, chunk in primary._policy.items():
            if chunk.ref_cnt < 0:
                assert k in writing, "a chunk is being written that no store or promotion covers"
            else:
                assert chunk.ref_cnt == pins.get(k, 0), f"ref_cnt {chunk.ref_cnt}, pins {pins.get(k, 0)}"

    for op, n in ops:
        live = [r for r in ctxs if r in m._req_state and not m._req_state[r].is_finished]
        if op == "new" or not live:
            rid = f"r{len(ctxs)}"
            ctxs[rid] = ReqContext(rid)
            m.on_new_request(ctxs[rid])
        elif op == "lookup":
            rid = live[n % len(live)]
            chain = [keys[(n >> 3) % 6], keys[(n >> 6) % 6], keys[(n >> 9) % 6]]
            hits, deferred = [], False
            for k in dict.fromkeys(chain):
                res = m.lookup(k, ctxs[rid])
                if res is LookupResult.MISS:
                    break
                deferred |= res is not LookupResult.HIT
                hits.append(k)
            if hits and not deferred:
                m.prepare_load(hits, ctxs[rid])
                loads.append((rid, hits))
        elif op == "store":
            rid = live[n % len(live)]
            out = m.prepare_store(list(dict.fromkeys([keys[n % 6], keys[(n >> 4) % 6]])), ctxs[rid])
            if out is not None and out.keys_to_store:
                stores.append((rid, list(out.keys_to_store)))
        elif op == "complete" and stores:
            rid, ks = stores.pop(n % len(stores))
            m.complete_store(ks, ctxs[rid], n % 5 != 0)
        elif op == "unload" and loads:
            rid, ks = loads.pop(n % len(loads))
            m.complete_load(ks, ctxs[rid])
        elif op == "finish":
            rid = live[n % len(live)]
            for r, ks in [x for x in loads if x[0] == rid]:
                m.complete_load(ks, ctxs[r])
            loads = [x for x in loads if x[0] != rid]
            m.on_request_finished(ctxs[rid])
        elif op == "end":
            m.on_schedule_end(ScheduleEndContext([], []))
            if held:
                m.on_reset_flushed()
                held = False
        elif op == "reset" and not loads:
            for r, ks in stores:
                m.complete_store(ks, ctxs[r], False)
            stores = []
            m.reset_cache()
            held = True
        check()

    for r, ks in loads:
        m.complete_load(ks, ctxs[r])
    for r, ks in stores:
        m.complete_store(ks, ctxs[r], True)
    loads, stores = [], []
    for r in list(m._req_state):
        if not m._req_state[r].is_finished:
            m.on_request_finished(ctxs[r])
    for _ in range(3):  # collect every job: the disk reports at the next poll
        m.on_schedule_end(ScheduleEndContext([], []))
    check()
    assert m._jobs == {} and m._req_state == {} and not m.has_pending_work()
    assert all(chunk.ref_cnt == 0 for _, chunk in primary._policy.items())
    m._metrics.assert_idle()
    view.release()
    m.shutdown()


class _Flaky(ExampleSecondaryTierManager):
    """A tier as a learner might write it: submit_* raise while ``broken`` is set."""

    broken = True
    whole = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ends = 0

    def submit_store(self, job_metadata):
        if self.broken:
            raise RuntimeError("disk on fire")
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata):
        if self.broken:
            raise RuntimeError("disk on fire")
        super().submit_load(job_metadata)

    def on_new_request(self, req_context):
        return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL if self.whole else OffloadPolicy.CHUNK_LEVEL)

    def on_schedule_end(self, context):
        self.ends += 1


def test_a_tier_that_raises_leaves_no_chunk_pinned_or_reserved_and_the_error_surfaces(region):
    primary = CPUPrimaryTierOffloadingManager(2, region)
    view = primary.get_kv_memoryview()
    flaky, example = _Flaky(None, view, "flaky"), ExampleSecondaryTierManager(None, view, "example")
    m = TieringOffloadingManager(primary, [flaky, example], tier_poll_interval_s=0)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_store([K["A"]], ctx)
    with pytest.raises(RuntimeError, match="disk on fire"):
        m.complete_store([K["A"]], ctx, True)
    # The raising tier's cascade ended as a failed job; the example tier still got its copy.
    assert primary._policy.get(K["A"]).ref_cnt == 1 and list(m._jobs) == [1] and K["A"] in example.chunks
    m.on_schedule_end(ScheduleEndContext(["r"], []))
    m.on_schedule_end(ScheduleEndContext([], []))
    assert primary._policy.get(K["A"]).ref_cnt == 0 and m._jobs == {}
    primary.check_invariants()

    # A promotion the tier refuses: its reserved chunk is freed, the rest of the step's end still runs.
    flaky.chunks[K["B"]] = True
    assert m.lookup(K["B"], ctx) is LookupResult.HIT_PENDING
    with pytest.raises(RuntimeError, match="disk on fire"):
        m.on_schedule_end(ScheduleEndContext([], []))
    assert flaky.ends == 3 and m._jobs == {} and primary._policy.get(K["B"]) is None
    data = m.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_promotion_job_failures"] == {("1:flaky",): 1}
    assert data["vllm:kv_offload_tiering_cascade_job_failures"] == {("1:flaky",): 1}
    flaky.broken = False
    assert m.lookup(K["B"], ctx) is LookupResult.HIT_PENDING  # promoted again, now it works
    m.on_schedule_end(ScheduleEndContext([], []))
    assert m.lookup(K["B"], ctx) is LookupResult.HIT
    primary.check_invariants()


def test_a_request_level_cascade_that_raises_hands_back_the_stores_chunks(region):
    primary = CPUPrimaryTierOffloadingManager(2, region)
    flaky = _Flaky(None, primary.get_kv_memoryview(), "flaky")
    flaky.whole = True
    m = TieringOffloadingManager(primary, [flaky], tier_poll_interval_s=0)
    a, b = ReqContext("a"), ReqContext("b")
    m.on_new_request(a)
    flaky.broken = False
    m.prepare_store([K["A"]], a)
    m.complete_store([K["A"]], a, True)
    flaky.broken = True
    m.on_new_request(b)
    with pytest.raises(RuntimeError, match="disk on fire"):
        m.prepare_store([K["A"], K["B"]], b)  # A is present: cascaded for b at once, and the tier raises
    assert primary._policy.get(K["B"]) is None and m._req_state["b"].pending_primary_stores == 0
    assert m._req_state["b"].pending_cascade_keys == [] and [k for k, _ in primary._policy.items()] == [K["A"]]
    m.on_request_finished(b)
    assert "b" not in m._req_state  # nothing owed: it finalizes at once
    primary.check_invariants()


def test_a_peer_tier_that_keeps_failing_does_not_stop_the_engine_or_flood_the_log(region, caplog, monkeypatch):
    import types

    import kvlab.kv_offload.tiering.manager as manager_module

    # The thread's clock stands still: the log gate (one traceback a second) is then exact,
    # whatever the machine's speed.
    monkeypatch.setattr(manager_module, "time", types.SimpleNamespace(monotonic=lambda: 1000.0))
    rounds = threading.Event()

    class Broken(ExampleSecondaryTierManager):
        tolerates_off_thread_polling = True
        calls = 0

        def serve_external_requests(self, parent):
            Broken.calls += 1
            if Broken.calls >= 50:
                rounds.set()
            raise RuntimeError("peer socket closed")

    primary = CPUPrimaryTierOffloadingManager(2, region)
    m = TieringOffloadingManager(primary, [Broken(None, primary.get_kv_memoryview(), "p2p")], tier_poll_interval_s=0.0001)
    with caplog.at_level("ERROR", logger="kvlab.kv_offload.tiering.manager"):
        assert rounds.wait(timeout=60), "the tier-poll thread stopped polling"
        m.shutdown()
    failures = [r for r in caplog.records if "tier-poll round failed" in r.getMessage()]
    assert len(failures) == 1 and Broken.calls >= 50  # 50 failed rounds within one second of the clock: one traceback
    ctx = ReqContext("r")  # the scheduler's calls never saw the peer's trouble
    m.on_new_request(ctx)
    assert m.lookup(K["A"], ctx) is LookupResult.MISS


def test_the_primary_tier_takes_any_region_that_hands_out_its_rows_as_vllms_tests_do():
    import numpy as np

    class Rows:  # what vLLM's own tiering tests pass: an object with create_kv_memoryview()
        def __init__(self, view):
            self.view = view
            self.cleaned = False

        def create_kv_memoryview(self):
            return self.view

        def cleanup(self):
            self.cleaned = True

    region = Rows(memoryview(np.zeros((5, 16), dtype=np.int8)))
    primary = CPUPrimaryTierOffloadingManager(num_chunks=5, mmap_region=region)
    m = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[ExampleSecondaryTierManager(None, region.view, "example")])
    ctx = ReqContext("test")
    m.on_new_request(ctx)
    m.prepare_store([K["A"]], ctx)
    m.complete_store([K["A"]], ctx, success=True)
    assert primary._policy.get(K["A"]).ref_cnt == 1  # pinned by its cascade
    m.shutdown()
    assert region.cleaned
    with pytest.raises(TypeError, match="must return a 2-D memoryview"):
        CPUPrimaryTierOffloadingManager(5, Rows(memoryview(bytearray(80))))
    with pytest.raises(TypeError, match="or have create_kv_memoryview"):
        CPUPrimaryTierOffloadingManager(5, object())  # type: ignore[arg-type]
