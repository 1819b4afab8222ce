"""KV offload tiers (lesson 12): the tiers' books, the offloading connector in the engine,
real tensor copies and real files, and what happens when a transfer fails.

The engine scenarios use a 6-block pool (5 usable blocks of 4 tokens), a CPU tier of 5
blocks and a storage tier of 12: A (9 tokens), B (17), C (13) push each other out of the
GPU pool and the CPU tier; A2 = A + 1 token then finds A's prefix only on disk, C2 = C + 3
tokens finds part of C in the GPU pool and the next block in the CPU tier, B2 = B's first
13 tokens finds B on disk. Every block id, slot and tier below was checked by hand against
vLLM 0.33's LRU, which ranks blocks by request (see the lesson).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from kvlab import Request
from kvlab.distributed.kv_events import BlockStored
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from kvlab.engine.llm_engine import build_engine
from kvlab.kv_offload.base import Locality, LookupResult, Medium, ReqContext, TierFilter, TierMatcher, make_offload_key
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.file_mapper import FileMapper
from kvlab.kv_offload.cpu.policies.arc import ARCCachePolicy
from kvlab.kv_offload.cpu.policies.factory import CachePolicyFactory
from kvlab.kv_offload.cpu.policies.lru import LRUCachePolicy
from kvlab.kv_offload.tiering.fs.io import TierFileError, read_block_file, write_block_file
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.kv_offload.tiering.staged import StagedTieringManager
from kvlab.timeline import Timeline
from kvlab.eventlog.events import KVLoadFailed, KVTransfer, OffloadEvicted
from kvlab.metrics.cache_hit_source import CacheHitSource

A = list(range(100, 109))
B = list(range(200, 217))
C = list(range(300, 313))
STORY = [("A", A), ("B", B), ("C", C), ("A2", A + [109]), ("C2", C + [313, 314, 315]), ("B2", B[:13])]


def _k(name: str) -> bytes:
    return make_offload_key(name.encode().ljust(32, b"."))


def _config(tmp_path, **extra):
    cfg = dict(num_cpu_blocks=5, storage_path=str(tmp_path / "kv"), num_storage_blocks=12)
    cfg.update(extra)
    return KVTransferConfig("OffloadingConnector", kv_connector_extra_config=cfg)


def _engine(tmp_path, executor=None, policy="recompute", manager_kwargs=None, **extra):
    cfg = KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config=_config(tmp_path, **extra).kv_connector_extra_config, kv_load_failure_policy=policy
    )
    return build_engine(
        num_blocks=6, block_size=4, max_num_batched_tokens=64, executor=executor, kv_transfer_config=cfg, manager_kwargs=manager_kwargs
    )


def _run_story(eng, story=STORY, max_tokens=1):
    for rid, prompt in story:
        eng.add_request(Request(rid, prompt, max_tokens=max_tokens))
        eng.run()
        eng.scheduler.check_invariants()
        eng.scheduler.connector.scheduler.check_invariants()


def _transfers(eng):
    return [(e.step, e.direction, e.request_id, e.media, e.block_ids, e.chunk_ids) for e in eng.events if isinstance(e, KVTransfer)]


# -- the books ------------------------------------------------------------------------------------
def _names(keys) -> str:
    return "".join(k[:1].decode() for k in keys)


def _req(rid: str, *names: str) -> ReqContext:
    """A request whose scheduler recorded each key's end-token position (block size 4)."""
    ctx = ReqContext(rid)
    for i, c in enumerate(names):
        ctx.set_offload_key_position(_k(c), 4 * (i + 1))
    return ctx


def test_cpu_tier_ranks_by_request_tail_first_pins_and_failed_stores() -> None:
    # Each value below was first given by vLLM 0.33's CPUOffloadingManager on the same calls.
    m = CPUOffloadingManager(3, enable_events=True)
    r1 = _req("r1", "a", "b", "c")
    m.on_new_request(r1)
    out = m.prepare_store([_k("a"), _k("b"), _k("c")], r1)
    assert out.slots == [0, 1, 2] and list(out.store_spec.block_ids) == [0, 1, 2] and out.evicted_keys == []
    assert m.lookup(_k("a"), r1) is LookupResult.HIT_PENDING  # being written, not readable yet
    m.complete_store([_k("a"), _k("b"), _k("c")], r1)
    assert _names(k for k, _ in m.entries()) == "cba"  # one request: its tail goes first
    m.on_request_finished(r1)
    assert _names(k for k, _ in m.entries()) == "cba"  # re-ranked tail first: the head is the newest
    r2 = _req("r2", "a", "d", "e")
    m.on_new_request(r2)
    assert list(m.prepare_load([_k("a")], r2).block_ids) == [0]  # pinned, and lifted to r2's rank
    out = m.prepare_store([_k("a"), _k("d")], r2)
    assert (_names(out.keys_to_store), out.slots, _names(out.evicted_keys)) == ("d", [2], "c")
    assert m.prepare_store([_k("e"), _k("f")], r2) is None  # a pinned, d pending: only b is evictable
    assert _names(k for k, _ in m.entries()) == "bda"  # nothing changed
    m.complete_store([_k("d")], r2, success=False)  # a failed store frees its chunk
    out = m.prepare_store([_k("e")], r2)
    assert _k("d") not in m and out.slots == [2] and out.evicted_keys == []
    m.complete_store([_k("e")], r2)
    m.complete_load([_k("a")], r2)
    assert m.pinned() == {} and _names(k for k, _ in m.entries()) == "bea"
    events = [(_names(e.keys), e.removed, e.metadata_only) for e in m.take_events()]
    assert events == [("abc", False, False), ("c", True, False), ("d", True, True), ("e", False, False)]
    m.check_invariants()


def test_a_tier_sized_to_nothing_refuses_every_store_and_reports_zero_use() -> None:
    """vLLM 0.33 builds a CPU tier of 0 chunks when the configured bytes hold no chunk: it is
    a known size (0), every store is refused, and its usage gauges read 0.0 (the refused
    store still counts in the allocation-size histogram, as vLLM counts it before evicting)."""
    m = CPUOffloadingManager(0)
    r = _req("r", "a")
    m.on_new_request(r)
    assert m.num_blocks == 0 and m.prepare_store([_k("a")], r) is None and _k("a") not in m
    assert m.get_stats().reduce() == {
        "vllm:kv_offload_cpu_cache_usage_perc": 0.0,
        "vllm:kv_offload_cpu_cache_write_usage_perc": 0.0,
        "vllm:kv_offload_cpu_cache_read_usage_perc": 0.0,
        "vllm:kv_offload_cpu_allocation_size_count": 1,
        "vllm:kv_offload_cpu_allocation_size_sum": 1,
    }
    m.check_invariants()


def test_arc_moves_reused_chunks_to_t2_and_learns_from_its_ghosts() -> None:
    # vLLM 0.33's ARCCachePolicy gave the same lists on the same calls.
    m = CPUOffloadingManager(2, cache_policy="arc")

    def arc() -> tuple:
        p = m._policy
        return _names(p.t1), _names(p.t2), _names(p.b1), _names(p.b2), p.target_t1_size

    def run(rid: str, *names: str, load: bool = False) -> str:
        ctx = _req(rid, *names)
        m.on_new_request(ctx)
        keys = [_k(c) for c in names]
        evicted = ""
        if load:
            m.prepare_load(keys, ctx)
            m.complete_load(keys, ctx)
        else:
            out = m.prepare_store(keys, ctx)
            m.complete_store(out.keys_to_store, ctx)
            evicted = _names(out.evicted_keys)
        m.on_request_finished(ctx)
        return evicted

    run("r1", "a", "b")
    assert arc() == ("ba", "", "", "", 0.0)  # stored once: T1, the head most recent
    run("r2", "a", load=True)
    assert arc() == ("b", "a", "", "", 0.0)  # reused by another request: T2
    assert run("r3", "c") == "b" and arc() == ("c", "a", "b", "", 0.0)  # T1 gives way; b's ghost in B1
    assert run("r4", "b") == "c" and arc() == ("b", "a", "c", "", 1.0)  # a B1 ghost wanted again: T1's target grows


def test_cache_policies_by_name_and_bad_names() -> None:
    assert CachePolicyFactory.get_cache_policy_cls("lru") is LRUCachePolicy
    assert CachePolicyFactory.get_cache_policy_cls("arc") is ARCCachePolicy
    assert CachePolicyFactory.get_cache_policy_cls("ARCCachePolicy", "kvlab.kv_offload.cpu.policies.arc") is ARCCachePolicy
    with pytest.raises(ValueError, match=r"Unknown cache policy: 'fifo'. Supported: \['lru', 'arc'\]"):
        CPUOffloadingManager(4, cache_policy="fifo")
    with pytest.raises(ValueError, match="Cache policy 'lru' is already registered"):
        CachePolicyFactory.register_cache_policy("lru", "x", "y")
    with pytest.raises(TypeError, match="is not a CachePolicy subclass"):
        CachePolicyFactory.get_cache_policy_cls("ChunkStatus", "kvlab.kv_offload.cpu.policies.base")


def test_store_threshold_admits_a_block_on_its_second_offer() -> None:
    m = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2)
    ctx = ReqContext("r")
    assert m.prepare_store([_k("a"), _k("b")], ctx).keys_to_store == []  # first offers: counted only
    assert m.stores_skipped_in_current_batch == 2
    assert _names(m.prepare_store([_k("a"), _k("c")], ctx).keys_to_store) == "a"  # a's second offer
    assert list(m.counts.items()) == [(_k("a"), 2), (_k("c"), 1)]  # the tracker of 2 forgot b


def test_tier_filters_match_medium_and_locality() -> None:
    cpu_only = TierFilter((TierMatcher(Medium.CPU),))
    assert cpu_only.allows(Medium.CPU, Locality.LOCAL) and not cpu_only.allows(Medium.STORAGE, None)
    assert cpu_only.allows(None, None)  # an unknown medium is not excluded
    assert TierFilter.ALL.allows(Medium.STORAGE, Locality.REMOTE) and not TierFilter().allows(Medium.CPU, None)
    assert TierMatcher(locality=Locality.REMOTE).matches("CPU", Locality.REMOTE)


def test_tiering_cascades_to_disk_and_promotes_through_the_cpu(tmp_path) -> None:
    t = StagedTieringManager(CPUOffloadingManager(2, enable_events=True), StagedFileSystemTier(4, str(tmp_path)))
    plan = t.prepare_store([_k("a"), _k("b")])
    assert plan.cpu_slots == [0, 1] and plan.cascade_slots == [0, 1]
    h = _k("a")[:-4].hex()  # the folder digest: vLLM 0.33's FileMapper for the same fields
    assert plan.cascade_paths[0] == f"{tmp_path}/kvlab_6cf1c7c311c9_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"
    for p in plan.cascade_paths:
        write_block_file(p, b"", b"")
    t.complete_store(plan)
    plan = t.prepare_store([_k("c")])  # the CPU tier is full: a leaves it, but stays on disk
    assert plan.cpu_slots == [0] and [e.keys for e in t.primary.take_events() if e.removed] == [[_k("a")]]
    for p in plan.cascade_paths:
        write_block_file(p, b"", b"")
    t.complete_store(plan)
    assert t.lookup_chain([_k("a"), _k("b"), _k("z")]) == ["STORAGE", "CPU"]
    assert t.lookup_chain([_k("a"), _k("b"), _k("c")]) == []  # a could only pass by evicting b or c: both wanted
    items = t.prepare_load([_k("a"), _k("b")], ["STORAGE", "CPU"])
    # a needs a CPU slot to come through: c is evictable, b is protected by the same load
    assert [(it.medium, it.cpu_slot) for it in items] == [("STORAGE", 0), ("CPU", 1)]
    assert t.primary.pinned() == {_k("a"): -1, _k("b"): 1}
    t.complete_load(items)
    assert t.primary.pinned() == {} and t.secondary.pinned() == {}
    # a, promoted, was stored last; reading b changes no rank until its request finishes
    assert [k for k, _ in t.primary.entries()] == [_k("b"), _k("a")]
    t.check_invariants()


def test_a_promotion_needs_a_cpu_slot(tmp_path) -> None:
    """... and the tiering metrics count the one that found none (vLLM 0.33's counter)."""
    t = StagedTieringManager(CPUOffloadingManager(1), StagedFileSystemTier(4, str(tmp_path)), chunk_size_bytes=64)
    for name in ("a", "b"):
        plan = t.prepare_store([_k(name)])
        for p in plan.cascade_paths:
            write_block_file(p, b"", b"")
        t.complete_store(plan)
    t.primary.prepare_load([_k("b")])  # b pinned in the only CPU slot
    assert t.lookup_chain([_k("a")]) == []  # a is on disk, but cannot pass through the CPU
    d = t.get_stats().data["data"]
    assert d["vllm:kv_offload_tiering_promotion_allocation_failures"] == {(): 1}
    assert d["vllm:kv_offload_tiering_write_bytes"] == {("1:fs",): 128}  # two cascades of one 64-byte chunk
    assert d["vllm:kv_offload_tiering_chunk_queries"] == {("0:primary",): 1, ("1:fs",): 1}
    with pytest.raises(ValueError, match="chunk_size_bytes must be"):
        t.chunk_size_bytes = -1


def test_tier_files_are_checked_and_name_the_file(tmp_path) -> None:
    path = str(tmp_path / "x.bin")
    write_block_file(path, _k("a"), b"0123456789")
    assert read_block_file(path, _k("a"), 10) == b"0123456789"
    with pytest.raises(TierFileError, match=r"x\.bin: holds another block"):
        read_block_file(path, _k("b"), 10)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1
    open(path, "wb").write(bytes(raw))
    with pytest.raises(TierFileError, match=r"x\.bin: checksum mismatch"):
        read_block_file(path, _k("a"), 10)
    with pytest.raises(TierFileError, match=r"x\.bin: holds 10 payload bytes, expected 12"):
        write_block_file(path, _k("a"), b"0123456789") and read_block_file(path, _k("a"), 12)
    os.remove(path)
    with pytest.raises(TierFileError, match=r"x\.bin: missing"):
        read_block_file(path, _k("a"), 10)
    assert not os.path.exists(path + ".tmp")


# -- the connector in the engine --------------------------------------------------------------------
def test_story_stores_loads_and_tiers_exactly(tmp_path) -> None:
    eng = _engine(tmp_path)
    _run_story(eng)
    m = eng.metrics
    assert [(r, m[r].num_cached_tokens, m[r].prefill_tokens_computed) for r, _ in STORY] == [
        ("A", 0, 9),
        ("B", 0, 17),
        ("C", 0, 13),
        ("A2", 8, 2),
        ("C2", 12, 4),
        ("B2", 12, 1),
    ]
    assert _transfers(eng) == [
        (1, "store", "A", ["CPU", "CPU"], [1, 2], [0, 1]),
        (1, "store", "A", ["STORAGE", "STORAGE"], [], [0, 1]),
        (2, "store", "B", ["CPU"] * 4, [3, 4, 5, 2], [2, 3, 4, 1]),  # fresh slots first, then A's tail's slot
        (2, "store", "B", ["STORAGE"] * 4, [], [2, 3, 4, 5]),
        (3, "store", "C", ["CPU"] * 3, [1, 2, 5], [4, 1, 0]),  # freed slots, the last freed first
        (3, "store", "C", ["STORAGE"] * 3, [], [6, 7, 8]),
        (4, "load", "A2", ["STORAGE", "STORAGE"], [4, 3], [3, 2]),  # A left the CPU tier: disk, via CPU slots
        (5, "load", "C2", ["CPU"], [5], [0]),  # C's first 8 tokens still in the GPU pool, the third block in CPU
        (5, "store", "C2", ["CPU"], [3], [1]),
        (5, "store", "C2", ["STORAGE"], [], [9]),
        (6, "load", "B2", ["STORAGE"] * 3, [4, 3, 5], [4, 2, 3]),
    ]
    evicted = [(e.step, e.medium, e.chunk_ids, e.reason) for e in eng.events if isinstance(e, OffloadEvicted)]
    assert evicted == [
        (2, "CPU", [1], "lru"),  # A's tail, not its head (vLLM 0.33 ranks a request's blocks tail first)
        (3, "CPU", [0, 1, 4], "lru"),  # A's head (the older request), then B's tail end
        (4, "CPU", [3, 2], "lru"),  # B's two blocks left, for A2's promotions
        (5, "CPU", [1], "lru"),
        (6, "CPU", [4, 2, 3], "lru"),
    ]
    conn = eng.scheduler.connector
    assert conn.scheduler.num_hit_tokens == {"CPU": 4, "STORAGE": 20}
    stats = eng.scheduler.connector_prefix_cache_stats
    assert (stats.queries, stats.hits) == (9 + 17 + 13 + 10 + 8 + 13, 8 + 4 + 12)
    # the same hits by the tier each block was found in (vLLM 0.33's split): A2's 8 and B2's 12 from
    # the disk, C2's 4 from host memory -- a disk block counts as disk though it passes a CPU slot
    assert stats.hits_by_source == {CacheHitSource.DISK: 20, CacheHitSource.HOST: 4}
    prom = eng.scheduler.make_stats().to_prometheus()
    assert [line for line in prom.splitlines() if line.startswith(("vllm:external", "vllm:prompt_tokens_cached"))] == [
        'vllm:external_prefix_cache_queries_total{model_name="kvlab-tiny"} 70.0',
        'vllm:external_prefix_cache_hits_total{model_name="kvlab-tiny"} 24.0',
        'vllm:prompt_tokens_cached_by_source_total{model_name="kvlab-tiny",source="device"} 8.0',  # C2's first two blocks
        'vllm:prompt_tokens_cached_by_source_total{model_name="kvlab-tiny",source="host"} 4.0',
        'vllm:prompt_tokens_cached_by_source_total{model_name="kvlab-tiny",source="p2p"} 0.0',
        'vllm:prompt_tokens_cached_by_source_total{model_name="kvlab-tiny",source="disk"} 20.0',
        'vllm:prompt_tokens_cached_by_source_total{model_name="kvlab-tiny",source="external_unspecified"} 0.0',
    ]
    # every stored block is a real file, named by its hash
    files = sorted(f for _, _, fs in os.walk(tmp_path / "kv") for f in fs)
    assert len(files) == 11 and files.count("config.json") == 1  # 10 blocks and what the folder holds
    assert all(f.endswith(".bin") and len(f) == 64 + 4 for f in files if f != "config.json")


def test_replayed_tiers_equal_the_live_ones_at_every_step(tmp_path) -> None:
    rng = random.Random(3)
    cfg = _config(tmp_path, num_cpu_blocks=5, num_storage_blocks=9)
    eng = build_engine(num_blocks=10, block_size=4, max_num_batched_tokens=16, kv_transfer_config=cfg)
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    mgr = eng.scheduler.connector.manager
    live = []
    for i in range(30):
        eng.add_request(
            Request(
                f"r{i}", prefixes[rng.randrange(5)] + [rng.randrange(1000) for _ in range(rng.randint(1, 6))], max_tokens=rng.randint(1, 6)
            )
        )
        while eng.has_unfinished_requests():
            eng.step()
            live.append(
                (
                    eng.scheduler.step_count,
                    [k[:-4].hex() for k, _ in mgr.primary.entries()],
                    [k[:-4].hex() for k, _ in mgr.secondary.entries()],
                )
            )
    tl = Timeline(eng.events)
    for step, cpu, disk in live:
        snap = tl.at(step)
        assert snap.tiers["CPU"].hashes == cpu and snap.tiers["STORAGE"].hashes == disk, f"step {step}"
    assert eng.scheduler.connector.scheduler.num_hit_tokens["STORAGE"] > 0


def test_offloading_kv_events_carry_the_medium(tmp_path) -> None:
    quiet = _engine(tmp_path / "off")  # KV events off (the default): the tiers queue none either,
    _run_story(quiet, STORY[:2])  # or the queue would grow with every store, for ever
    assert quiet.scheduler.connector.scheduler._kv_events == [] and quiet.scheduler.connector.take_events() == []
    eng = _engine(tmp_path, manager_kwargs={"enable_kv_cache_events": True})
    _run_story(eng, STORY[:2])
    evs = eng.scheduler.connector.take_events()
    # vLLM 0.33's placeholder payloads: one BlockStored per stored key, one BlockRemoved per
    # removal (per group); no tokens, no parent, block_size 0, the key's group, LOCAL tiers.
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in evs] == (
        [("BlockStored", "CPU", 1)] * 2
        + [("BlockStored", "STORAGE", 1)] * 2
        + [("BlockRemoved", "CPU", 1)]  # B needs one slot more than the 5-block tier has free
        + [("BlockStored", "CPU", 1)] * 4
        + [("BlockStored", "STORAGE", 1)] * 4
    )
    stored = [e for e in evs if isinstance(e, BlockStored)]
    assert {(e.block_size, e.token_ids == [], e.parent_block_hash, e.lora_id, e.group_idx) for e in stored} == {(0, True, None, None, 0)}
    removed = [e for e in evs if not isinstance(e, BlockStored)]
    assert [(e.group_idx, e.block_hashes[0] in {s.block_hashes[0] for s in stored[:2]}) for e in removed] == [(0, True)]
    assert all(isinstance(h, int) for e in evs for h in e.block_hashes)  # vLLM's default: 64-bit ints
    assert eng.scheduler.connector.take_events() == []


def test_offload_prompt_only_false_also_offloads_generated_blocks(tmp_path) -> None:
    eng = _engine(tmp_path, offload_prompt_only=False)
    eng.add_request(Request("A", A, max_tokens=6))  # 9 + 6 - 1 = 14 tokens computed: 3 full blocks
    eng.run()
    stored = [e.block_ids for e in eng.events if isinstance(e, KVTransfer) and e.media[:1] == ["CPU"]]
    assert stored == [[1, 2], [3]]


# -- real tensors -------------------------------------------------------------------------------------
def _tiny_runner(num_blocks):
    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)
    return model, ModelRunner(model, num_blocks=num_blocks, block_size=4, device="cpu")


def test_real_copies_round_trip_exactly_through_cpu_and_disk(tmp_path) -> None:
    torch.set_num_threads(1)
    _, runner = _tiny_runner(6)
    eng = _engine(tmp_path, executor=runner)
    story = [(r, [t % 90 + 32 for t in p]) for r, p in STORY]
    eng.add_request(Request("A", story[0][1], max_tokens=1))
    eng.run()
    saved = [kv[[1, 2]].clone() for kv in runner.kv_caches]  # A's two full blocks, every layer
    for rid, p in story[1:4]:  # B, C, then A2 loads A's blocks from disk into GPU blocks 4 and 3
        eng.add_request(Request(rid, p, max_tokens=1))
        eng.run()
    loads = [e for e in eng.events if isinstance(e, KVTransfer) and e.direction == "load"]
    assert [(e.request_id, e.media, e.block_ids) for e in loads] == [("A2", ["STORAGE", "STORAGE"], [4, 3])]
    for layer, kv in enumerate(runner.kv_caches):
        assert torch.equal(kv[[4, 3]], saved[layer]), f"layer {layer}: the loaded KV differs from the stored KV"
    buf = eng.executor.kv_connector.worker.buffer
    assert buf.block_nbytes == 2 * 2 * 4 * 2 * 16 * 4  # layers x (k, v) x block_size x kv heads x head_dim x fp32
    slot = loads[0].chunk_ids[0]  # A's first block passed through this CPU slot on its way to GPU block 4
    assert torch.equal(buf.tensor[slot], torch.stack([kv[4] for kv in runner.kv_caches]))


def test_greedy_outputs_identical_with_and_without_offload(tmp_path) -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    docs = [[rng.randrange(32, 120) for _ in range(12)] for _ in range(3)]
    prompts = [docs[i % 3] + [40 + i] for i in range(6)]

    def run(cfg):
        model, runner = _tiny_runner(10)
        eng = build_engine(num_blocks=10, block_size=4, executor=runner, kv_transfer_config=cfg)
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"r{i}", p, max_tokens=4))
            eng.run()
        return model, eng, [eng.finished[f"r{i}"].output_token_ids for i in range(len(prompts))]

    model, plain, want = run(None)
    _, off, got = run(_config(tmp_path, num_cpu_blocks=4, num_storage_blocks=16))
    assert got == want == [model.generate_dense(p, 4) for p in prompts]
    assert off.scheduler.connector.scheduler.num_hit_tokens == {"CPU": 0, "STORAGE": 24}
    assert (plain.executor.num_tokens_computed, off.executor.num_tokens_computed) == (84, 60)


# -- faults -------------------------------------------------------------------------------------------
def _corrupt(path: str) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF
    open(path, "wb").write(bytes(raw))


def test_a_corrupt_file_is_named_treated_as_a_miss_and_recomputed(tmp_path) -> None:
    eng = _engine(tmp_path)
    _run_story(eng, STORY[:3])
    a_paths = [e.paths for e in eng.events if isinstance(e, KVTransfer) and e.request_id == "A" and e.media[0] == "STORAGE"][0]
    _corrupt(a_paths[1])  # A's second block
    free_before = eng.kv_cache_manager.block_pool.get_num_free_blocks()
    eng.add_request(Request("A2", A + [109], max_tokens=3))
    res = eng.step()
    failed = [e for e in eng.events if isinstance(e, KVLoadFailed)]
    assert [(e.step, e.request_id, e.block_ids, e.recompute, e.num_computed_tokens) for e in failed] == [(4, "A2", [3], True, 4)]
    dropped = [e for e in eng.events if isinstance(e, OffloadEvicted) and e.reason != "lru"]
    assert [(e.medium, e.reason.split(":")[0]) for e in dropped] == [("CPU", "TierFileError"), ("STORAGE", "TierFileError")]
    # (the CPU slot it was read into is given back; the disk entry goes)
    assert a_paths[1] in dropped[1].reason and "checksum mismatch" in dropped[1].reason
    assert res.scheduler_output.num_scheduled_tokens == {"A2": 2}
    # vLLM 0.33: A2 stays running, its computed tokens cut back to the bad block; the good
    # first block stays its own, and it computes the other 6 tokens next step, in place.
    assert [r.request_id for r in eng.scheduler.running] == ["A2"] and eng.scheduler.requests["A2"].num_computed_tokens == 4
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == free_before - 3
    res = eng.step()
    assert res.scheduler_output.num_scheduled_tokens == {"A2": 6}
    eng.run()
    plain = build_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for rid, p in STORY[:3] + [("A2", A + [109])]:
        plain.add_request(Request(rid, p, max_tokens=3 if rid == "A2" else 1))
        plain.run()
    assert eng.finished["A2"].output_token_ids == plain.finished["A2"].output_token_ids
    eng.scheduler.check_invariants()
    eng.scheduler.connector.scheduler.check_invariants()


def test_a_missing_file_is_a_miss_at_lookup(tmp_path) -> None:
    eng = _engine(tmp_path)
    _run_story(eng, STORY[:3])
    a_paths = [e.paths for e in eng.events if isinstance(e, KVTransfer) and e.request_id == "A" and e.media[0] == "STORAGE"][0]
    os.remove(a_paths[0])
    _run_story(eng, STORY[3:4])
    assert eng.metrics["A2"].num_cached_tokens == 0  # the chain starts with the missing block: nothing to load
    dropped = [e for e in eng.events if isinstance(e, OffloadEvicted) and e.reason.startswith("file missing")]
    assert len(dropped) == 1 and dropped[0].medium == "STORAGE" and a_paths[0] in dropped[0].reason
    assert not any(isinstance(e, KVLoadFailed) for e in eng.events)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_transfer_that_fails_mid_way_falls_back_and_leaks_nothing(tmp_path, policy) -> None:
    torch.set_num_threads(1)
    _, runner = _tiny_runner(6)
    eng = _engine(tmp_path, executor=runner, policy=policy)
    story = [(r, [t % 90 + 32 for t in p]) for r, p in STORY]
    _run_story(eng, story[:3])
    worker = eng.executor.kv_connector.worker
    seen = []

    def fail_second(direction, key, gpu_block):
        if direction == "load":
            seen.append(gpu_block)
            if len(seen) == 2:
                raise OSError("link down")

    worker.before_block_copy = fail_second
    eng.add_request(Request("A2", story[3][1], max_tokens=3))
    eng.step()
    worker.before_block_copy = None
    assert seen == [4, 3]
    failed = [(e.request_id, e.block_ids, e.recompute) for e in eng.events if isinstance(e, KVLoadFailed)]
    assert failed == [("A2", [3], policy == "recompute")]
    eng.run()
    eng.scheduler.check_invariants()
    eng.scheduler.connector.scheduler.check_invariants()
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 5
    if policy == "fail":
        assert eng.finished["A2"].finish_reason == "error" and eng.finished["A2"].output_token_ids == []
        return
    _, plain_runner = _tiny_runner(6)
    plain = build_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64, executor=plain_runner)
    for rid, p in story[:4]:
        plain.add_request(Request(rid, p, max_tokens=3 if rid == "A2" else 1))
        plain.run()
    assert eng.finished["A2"].output_token_ids == plain.finished["A2"].output_token_ids
    # the first block loaded fine: A2 computed the other 6 of its 10 prompt tokens (8 were
    # scheduled as loaded, 2 computed in the failed step and dropped)
    assert eng.metrics["A2"].prefill_tokens_computed == 2 + 6


def test_a_load_that_fails_early_leaves_the_blocks_after_it_unread(tmp_path) -> None:
    """A2's two blocks come from disk through CPU slots 3 and 2. The first read fails, so
    the job stops and the second file is never read: its CPU slot must go back unwritten.
    Were it marked readable, a later load from the CPU tier would copy in the bytes the
    slot held before -- here, A3 would sample other tokens than without offloading."""
    torch.set_num_threads(1)
    _, runner = _tiny_runner(6)
    eng = _engine(tmp_path, executor=runner)
    story = [(r, [t % 90 + 32 for t in p]) for r, p in STORY]
    _run_story(eng, story[:3])
    worker = eng.executor.kv_connector.worker

    def fail_first(direction, key, gpu_block):
        if direction == "load":
            raise OSError("link down")

    worker.before_block_copy = fail_first
    eng.add_request(Request("A2", story[3][1], max_tokens=3))
    eng.step()
    worker.before_block_copy = None
    load = [e for e in eng.events if isinstance(e, KVTransfer) and e.direction == "load"][-1]
    assert (load.media, load.chunk_ids) == (["STORAGE", "STORAGE"], [3, 2])
    cpu, disk = eng.scheduler.connector.manager.primary, eng.scheduler.connector.manager.secondary
    first, second = (make_offload_key(h) for h in load.block_hashes)
    assert first not in cpu and second not in cpu  # neither slot holds its block
    assert first not in disk and second in disk  # the failed file goes, the untried one stays
    dropped = [(e.medium, e.chunk_ids, e.reason) for e in eng.events if isinstance(e, OffloadEvicted) and e.reason != "lru"]
    assert dropped == [
        ("CPU", [3], "OSError: link down"),
        ("CPU", [2], "promotion not run: its load job stopped before this block"),
        ("STORAGE", dropped[2][1], "OSError: link down"),
    ]
    eng.run()
    later = [("X", list(range(70, 83))), ("A3", story[0][1] + [60, 61, 62, 63])]
    for rid, p in later:
        eng.add_request(Request(rid, p, max_tokens=3))
        eng.run()
    a3 = [(e.media, e.block_ids) for e in eng.events if isinstance(e, KVTransfer) and e.request_id == "A3" and e.direction == "load"]
    # A3's second block is read from disk: A2 recomputed it after the failed load, and (as in
    # vLLM 0.33) the connector does not store the chunks it had planned to load
    assert a3 == [(["STORAGE"], [3])]
    _, plain_runner = _tiny_runner(6)
    plain = build_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64, executor=plain_runner)
    for rid, p in story[:3] + [("A2", story[3][1])] + later:
        plain.add_request(Request(rid, p, max_tokens=1 if rid in "ABC" else 3))
        plain.run()
    assert eng.finished["A3"].output_token_ids == plain.finished["A3"].output_token_ids == [120, 46, 85]
    eng.scheduler.connector.scheduler.check_invariants()


def test_a_failed_store_only_costs_a_future_miss(tmp_path) -> None:
    eng = _engine(tmp_path)
    worker = eng.executor.kv_connector.worker

    def fail_store(direction, key, gpu_block):
        if direction == "store":
            raise RuntimeError("host memory gone")

    worker.before_block_copy = fail_store
    _run_story(eng, STORY[:1])
    assert len(eng.scheduler.connector.manager.primary) == 0
    reasons = [e.reason for e in eng.events if isinstance(e, OffloadEvicted)]
    assert reasons == ["store failed", "store failed"]


# -- bad input -------------------------------------------------------------------------------------------
def test_bad_configuration_is_refused(tmp_path) -> None:
    from kvlab import FullAttentionSpec, KVCacheManager, Scheduler, SlidingWindowSpec

    with pytest.raises(ValueError, match="unknown extra config"):
        OffloadingConnector(KVConnectorRole.SCHEDULER, 4, {"num_gpu_blocks": 3})
    with pytest.raises(TypeError, match="role must be a KVConnectorRole"):
        OffloadingConnector("scheduler", 4)  # type: ignore[arg-type]
    sched_half = OffloadingConnector(KVConnectorRole.SCHEDULER, 4)
    hybrid = KVCacheManager(num_blocks=20, block_size=4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)])
    with pytest.raises(ValueError, match="one full-attention KV-cache group"):
        Scheduler(hybrid, connector=sched_half)
    with pytest.raises(ValueError, match="enable_caching=True"):
        Scheduler(
            KVCacheManager(num_blocks=20, block_size=4, enable_caching=False), connector=OffloadingConnector(KVConnectorRole.SCHEDULER, 4)
        )
    with pytest.raises(ValueError, match="built for block_size=8"):
        Scheduler(KVCacheManager(num_blocks=20, block_size=4), connector=OffloadingConnector(KVConnectorRole.SCHEDULER, 8))
    with pytest.raises(ValueError, match="role=KVConnectorRole.SCHEDULER"):
        Scheduler(KVCacheManager(num_blocks=20, block_size=4), connector=OffloadingConnector(KVConnectorRole.WORKER, 4))
    with pytest.raises(RuntimeError, match="scheduler-side hook"):
        OffloadingConnector(KVConnectorRole.WORKER, 4).manager
    with pytest.raises(ValueError, match="kv_load_failure_policy must be"):
        KVTransferConfig("OffloadingConnector", kv_load_failure_policy="retry")
    with pytest.raises(ValueError, match="unknown kv_connector 'Nixl'"):
        build_engine(num_blocks=8, block_size=4, kv_transfer_config=KVTransferConfig("Nixl"))
    with pytest.raises(TypeError, match="kv_transfer_config must be a KVTransferConfig"):
        build_engine(num_blocks=8, block_size=4, kv_transfer_config={"kv_connector": "OffloadingConnector"})


def test_a_step_that_never_reports_leaves_no_pin_behind(tmp_path) -> None:
    """An interrupt between the scheduler's decision and the worker's report (the step is
    undone) must not leave tier blocks pinned: the next step expires the unreported jobs."""
    eng = _engine(tmp_path)
    _run_story(eng, STORY[:3])
    conn = eng.scheduler.connector.scheduler
    eng.add_request(Request("A2", A + [109], max_tokens=1))
    out = eng.scheduler.schedule()  # plans A2's load from disk ... and the executor never runs
    assert conn.manager.secondary.pinned() and out.kv_connector_metadata.loads
    cpu_keys = {k for k, _ in conn.manager.primary.entries()}
    conn.build_connector_meta(out)  # the next step's build: the unreported load is expired
    assert not any(t.pinned() for t in conn.manager.tiers)
    # ... and the CPU slots A2's blocks were to be read into go back unwritten
    assert {k for k, _ in conn.manager.primary.entries()} == cpu_keys - {
        it.key for job in out.kv_connector_metadata.loads for it in job.items
    }
    conn.check_invariants()


def test_the_scheduler_publishes_tier_events_beside_the_pools(tmp_path) -> None:
    class Recorder:
        def __init__(self):
            self.batches = []

        def publish(self, batch):
            self.batches.append(batch)

    rec = Recorder()
    cfg = _config(tmp_path)
    eng = build_engine(
        num_blocks=6,
        block_size=4,
        max_num_batched_tokens=64,
        kv_transfer_config=cfg,
        kv_event_publisher=rec,
        manager_kwargs=dict(enable_kv_cache_events=True),
    )
    _run_story(eng, STORY[:2])
    media = [(type(e).__name__, e.medium) for b in rec.batches for e in b.events]
    assert media == [
        ("BlockStored", "GPU"),
        *[("BlockStored", "CPU")] * 2,  # the tiers publish one placeholder per key (vLLM 0.33)
        *[("BlockStored", "STORAGE")] * 2,
        ("BlockRemoved", "GPU"),
        ("BlockRemoved", "GPU"),
        ("BlockStored", "GPU"),
        ("BlockRemoved", "CPU"),
        *[("BlockStored", "CPU")] * 4,
        *[("BlockStored", "STORAGE")] * 4,
    ]


def test_file_mapper_names_files_as_vllm_does(tmp_path) -> None:
    # vLLM 0.33's FileMapper gave these names and digests for the same fields.
    key = make_offload_key(bytes(range(32)), 2)
    m = FileMapper("/kv", model_name="Qwen/Qwen3-8B", tokens_per_hash=16, tp_size=2, rank=1, dtype="bfloat16")
    h = bytes(range(32)).hex()
    assert m.get_file_name(key) == f"{m.base_path}_r1/{h[:3]}/{h[3:5]}_g2/{h}.bin"
    assert m.base_path == "/kv/Qwen_Qwen3-8B_" + "5da0b865f5f1"
    assert m.get_config_file_path() == m.base_path + "/config.json"
    agnostic = FileMapper(
        "/kv", model_name="Qwen/Qwen3-8B", tokens_per_hash=16, tp_size=2, rank=1, dtype="bfloat16", parallel_agnostic=True
    )
    assert (agnostic.rank, agnostic.get_run_config()["tp_size"]) == (0, 1) and "parallel_agnostic" not in agnostic.get_run_config()
    assert agnostic.base_path == "/kv/Qwen_Qwen3-8B_19b32ee2e618"  # another digest: no rank, no split


def _mapper_spec(agnostic: bool = True, **config: Any) -> Any:
    """An offloading spec as FileMapper.from_offloading_spec reads it: a 16-token group of two
    layers of a Qwen3-0.6B, TP 2 at rank 1."""
    from types import SimpleNamespace

    from kvlab.kv_offload import config as oc
    from offloading_config import offloading_config

    return SimpleNamespace(
        config=offloading_config(
            groups=(oc.OffloadingGroupConfig(16, ("l0", "l1"), 0),),
            worker_kv_bytes_per_block=1024,
            model=oc.OffloadingModelConfig("Qwen/Qwen3-0.6B", "bfloat16"),
            parallel=oc.OffloadingParallelConfig(1, 2, 2, 1, 1, 1, 0, 1, None, agnostic),
            **config,
        )
    )


def test_file_mapper_from_an_offloading_config() -> None:
    # vLLM 0.33's FileMapper.from_offloading_spec gave these folders for the same config.
    from types import SimpleNamespace

    shared = FileMapper.from_offloading_spec("/kv", _mapper_spec(True), parallel_agnostic=True)
    assert (shared.base_path, shared.rank) == ("/kv/Qwen_Qwen3-0.6B_3bc1766e1054", 0)  # bytes independent of the split
    own = FileMapper.from_offloading_spec("/kv", _mapper_spec(False), parallel_agnostic=True)
    assert (own.base_path, own.rank) == ("/kv/Qwen_Qwen3-0.6B_c80f1b35e183", 1)  # asked, but the layout does not allow it
    assert shared.get_run_config()["kv_cache_groups"] == [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}]
    with pytest.raises(TypeError, match="offloading_spec.config must be an OffloadingConfig"):
        FileMapper.from_offloading_spec("/kv", SimpleNamespace(config={}))


@pytest.mark.parametrize(
    "layout, fmt, folder",
    [("LBNHC", "v1-nhd", "e0ca40bef323"), ("LBHNC", "v1-hnd", "cd4f98923769"), ("BLNHC", "v1-blnhc", "c1d943fee28e")],
)
def test_file_mapper_gives_canonical_pages_their_own_folder(layout, fmt, folder) -> None:
    # vLLM 0.33's FileMapper (with canonical_format_id) gave these folders for the same config.
    canonical = FileMapper.from_offloading_spec("/kv", _mapper_spec(canonical_layout=True, kv_cache_layout=layout), parallel_agnostic=True)
    assert canonical.get_run_config()["canonical_format"] == fmt
    assert canonical.base_path == f"/kv/Qwen_Qwen3-0.6B_{folder}"
    direct = FileMapper.from_offloading_spec("/kv", _mapper_spec(kv_cache_layout=layout), parallel_agnostic=True)
    assert "canonical_format" not in direct.get_run_config() and direct.base_path == "/kv/Qwen_Qwen3-0.6B_3bc1766e1054"
    with pytest.raises(ValueError, match=r"kv_cache_layout must be one of \('LBHNC', 'LBNHC', .*got 'NHD'"):
        FileMapper.from_offloading_spec("/kv", _mapper_spec(canonical_layout=True, kv_cache_layout="NHD"))
    with pytest.raises(ValueError, match="canonical_layout needs config.kv_cache_layout"):
        FileMapper.from_offloading_spec("/kv", _mapper_spec(canonical_layout=True))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_num_storable_counts_free_and_unpinned_chunks_less_the_protected_ones(policy) -> None:
    m = CPUOffloadingManager(4, cache_policy=policy)
    a, b, c, unknown = (make_offload_key(bytes([i]) * 32, 0) for i in range(4))
    m.complete_store(m.prepare_store([a, b, c]).keys_to_store)
    m.prepare_load([a])  # a is pinned while it loads
    assert (len(m), m.num_storable()) == (3, 3)  # one free chunk + b and c
    assert m.num_storable(protected=[b]) == 2
    assert m.num_storable(protected=[a, unknown, b, b]) == 2  # a pinned anyway, unknown not held
    m.complete_load([a])
    assert m.num_storable(protected=[c]) == 3
    with pytest.raises(TypeError, match="protected"):
        m.num_storable(protected=[1])


def test_the_connector_reports_its_transfers_and_the_tiers_facts(tmp_path) -> None:
    """Bytes and sizes of the worker's transfers reach the scheduler half's payload; the
    tiers' facts ride on the first payload only (vLLM 0.33). Blocks hold 2,048 bytes here."""
    torch.set_num_threads(1)
    _, runner = _tiny_runner(6)
    eng = _engine(tmp_path, executor=runner)
    conn = eng.scheduler.connector
    story = [(r, [t % 90 + 32 for t in p]) for r, p in STORY]
    payloads = []  # per request, its steps' payloads merged (the scheduler takes one each step)
    for rid, p in story[:4]:  # A stores 2 blocks, B 4, C 3; A2 loads A's 2 back from disk
        eng.add_request(Request(rid, p, max_tokens=1))
        merged = type(conn).build_kv_connector_stats()
        while eng.has_unfinished_requests():
            eng.step()
            merged.aggregate(eng.scheduler.kv_connector_stats)
        payloads.append(merged)
    first = payloads[0].data
    # the CPU tier's facts, once the worker's first report gave a block's bytes: 5 x 2,048
    cpu_info = {"cpu_num_chunks": 5, "cpu_blocks_per_chunk": 1, "cpu_kv_cache_size_bytes": 10240, "cpu_kv_cache_size_tokens": "None"}
    assert first["info"] == [{**cpu_info, "tier": "0:primary"}, {"tier": "1:fs"}]
    assert (first["data"]["vllm:kv_offload_store_bytes"], first["data"]["vllm:kv_offload_store_size"]) == ({(): 4096}, {(): [4096]})
    total = payloads[1]
    for p in payloads[2:]:
        total.aggregate(p)
    d = total.data["data"]
    assert total.data["info"] is None  # sent once
    assert (d["vllm:kv_offload_store_bytes"], d["vllm:kv_offload_store_size"]) == ({(): 14336}, {(): [8192, 6144]})
    assert (d["vllm:kv_offload_load_bytes"], d["vllm:kv_offload_load_size"]) == ({(): 4096}, {(): [4096]})
    # the CPU tier's allocations: B's 4 and C's 3 chunks, then one each for A2's two promoted blocks
    assert d["vllm:kv_offload_cpu_allocation_size"] == {(): [4, 3, 1, 1]}
    rebuilt = type(conn).build_kv_connector_stats(total.to_dict())
    assert rebuilt.reduce() == total.reduce()


def test_the_tiering_metrics_follow_the_story(tmp_path) -> None:
    """Per request of the story, the tiering manager's counts (vLLM 0.33's names): A, B and
    C miss in both tiers at their first block and cascade 2, 4 and 3 blocks of 2,048 bytes
    to disk; A2 finds both its blocks only on disk (two chunk queries and hits there) and
    promotes them in one job; C2's next block is in the CPU tier; B2 promotes three."""
    torch.set_num_threads(1)
    _, runner = _tiny_runner(6)
    eng = _engine(tmp_path, executor=runner)
    conn = eng.scheduler.connector
    story = [(r, [t % 90 + 32 for t in p]) for r, p in STORY]
    P, F = ("0:primary",), ("1:fs",)
    views = {}
    for rid, p in story:
        eng.add_request(Request(rid, p, max_tokens=1))
        merged = type(conn).build_kv_connector_stats()
        while eng.has_unfinished_requests():
            eng.step()
            merged.aggregate(eng.scheduler.kv_connector_stats)
        d = merged.data["data"]
        views[rid] = {
            n.removeprefix("vllm:kv_offload_tiering_"): {lab: (len(v) if isinstance(v, list) else v) for lab, v in s.items()}
            for n, s in d.items()
            if n.startswith("vllm:kv_offload_tiering_") and not n.endswith(("_time", "_seconds"))
        }
    idle = {
        "primary_write_usage_perc": {F: 0.0},
        "primary_read_usage_perc": {F: 0.0},
        "active_promotion_jobs": {F: 0},
        "active_cascade_jobs": {F: 0},
    }
    assert views == {
        "A": {**idle, "chunk_queries": {P: 1, F: 1}, "write_bytes": {F: 4096}},
        "B": {**idle, "chunk_queries": {P: 1, F: 1}, "write_bytes": {F: 8192}},
        "C": {**idle, "chunk_queries": {P: 1, F: 1}, "write_bytes": {F: 6144}},
        "A2": {**idle, "chunk_queries": {P: 2, F: 2}, "chunk_hits": {F: 2}, "read_bytes": {F: 4096}},
        "C2": {**idle, "chunk_queries": {P: 1}, "chunk_hits": {P: 1}, "write_bytes": {F: 2048}},
        "B2": {**idle, "chunk_queries": {P: 3, F: 3}, "chunk_hits": {F: 3}, "read_bytes": {F: 6144}},
    }


def test_a_promotion_that_fails_part_way_counts_the_blocks_that_made_it(tmp_path) -> None:
    """A2's promotion of two disk blocks: the second file's read fails, so the job fails
    with one block read (2,048 bytes counted, one failure). Failing the first read instead
    leaves nothing read: a failure and no bytes."""
    torch.set_num_threads(1)
    story = [(r, [t % 90 + 32 for t in p]) for r, p in STORY]
    for fail_at, expected in [(2, {"promotion_job_failures": 1, "read_bytes": 2048}), (1, {"promotion_job_failures": 1})]:
        _, runner = _tiny_runner(6)
        eng = _engine(tmp_path / str(fail_at), executor=runner)
        _run_story(eng, story[:3])
        seen = []

        def fail(direction, key, gpu_block, fail_at=fail_at):
            if direction == "load":
                seen.append(key)
                if len(seen) == fail_at:
                    raise OSError("link down")

        eng.executor.kv_connector.worker.before_block_copy = fail
        eng.add_request(Request("A2", story[3][1], max_tokens=1))
        eng.step()
        d = eng.scheduler.kv_connector_stats.data["data"]
        got = {n.removeprefix("vllm:kv_offload_tiering_"): s[("1:fs",)] for n, s in d.items() if n.endswith(("job_failures", "read_bytes"))}
        assert got == expected
        assert len(d["vllm:kv_offload_tiering_promotion_latency_seconds"][("1:fs", "failure")]) == 1


def test_the_schedulers_stats_carry_the_steps_connector_metrics(tmp_path) -> None:
    """vLLM 0.33's ``SchedulerStats.kv_connector_stats``: the step's payload as plain data --
    here the first step's, with the tiers' facts and A's two stored blocks."""
    torch.set_num_threads(1)
    _, runner = _tiny_runner(6)
    eng = _engine(tmp_path, executor=runner)
    assert eng.scheduler.make_stats().kv_connector_stats is None  # no step yet
    eng.add_request(Request("A", [t % 90 + 32 for t in STORY[0][1]], max_tokens=1))
    eng.step()
    data = eng.scheduler.make_stats().kv_connector_stats
    assert [i["tier"] for i in data["info"]] == ["0:primary", "1:fs"]
    assert data["info"][0]["cpu_kv_cache_size_bytes"] == 10240
    assert data["data"]["vllm:kv_offload_store_bytes"] == {(): 4096}
    assert build_engine(num_blocks=6, block_size=4).scheduler.make_stats().kv_connector_stats is None  # no connector


# -- vLLM 0.33's per-request caps (kv_transfer_params) ------------------------------------------------
def _blocks_moved(eng, rid: str, direction: str) -> int:
    """GPU blocks copied for ``rid`` (a store's cascade to disk names none: it copies CPU chunks)."""
    return sum(len(e.block_ids) for e in eng.events if isinstance(e, KVTransfer) and e.request_id == rid and e.direction == direction)


@pytest.mark.parametrize(
    ("params", "loaded", "warning"),
    [
        (None, 4, None),  # 17 tokens: 4 whole blocks, the last token's block is computed
        ({"max_load_tokens": 6}, 1, None),  # whole blocks within 6 tokens of the local hit
        ({"max_load_tokens": 0}, 0, None),
        ({"max_load_tokens": "6"}, 4, "max_load_tokens must be a non-negative int, got '6'; ignoring"),
        ({"max_load_tokens": True}, 4, "max_load_tokens must be a non-negative int, got True; ignoring"),
    ],
)
def test_max_load_tokens_caps_what_a_request_loads(tmp_path, caplog, params, loaded, warning) -> None:
    eng = _engine(tmp_path, num_cpu_blocks=10)
    _run_story(eng, [("A", B), ("X", C + [316, 317, 318, 319])])  # X takes every GPU block: A's prefix is in the tiers only
    again = Request("A2", B, max_tokens=1)
    again.kv_transfer_params = params
    caplog.set_level("WARNING")
    eng.add_request(again)
    eng.run()
    assert _blocks_moved(eng, "A2", "load") == loaded
    assert [r.getMessage() for r in caplog.records if "max_load_tokens" in r.getMessage()] == ([warning] if warning else [])


@pytest.mark.parametrize(("cap", "stored"), [(None, 4), (8, 2), (9, 2), (0, 0), (-1, 4)])
def test_max_offload_tokens_caps_what_a_request_stores(tmp_path, cap, stored) -> None:
    eng = _engine(tmp_path, num_cpu_blocks=10)
    req = Request("A", B, max_tokens=1)
    req.kv_transfer_params = None if cap is None else {"max_offload_tokens": cap}
    eng.add_request(req)
    eng.run()
    assert _blocks_moved(eng, "A", "store") == stored
