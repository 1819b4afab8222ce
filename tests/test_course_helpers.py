"""kvlab.lessons helpers added for the course's shorter lessons, and the write-safety scan."""

from __future__ import annotations

import copy

import pytest

import kvlab.kernels  # noqa: F401, I001  (first: it picks the Triton mode)
from kvlab import KVCacheManager, LLMEngine, Scheduler, Timeline
from kvlab.lessons.write_safety import scan_writes
from kvlab.eventlog.events import EventLog


@pytest.fixture(scope="module")
def shared_run():
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.model_runner import ModelRunner
    from kvlab.worker.tokenizer import ByteTokenizer

    log = EventLog()
    mgr = KVCacheManager(num_blocks=12, block_size=4, event_log=log)
    runner = ModelRunner(TinyLlama(seed=0), num_blocks=12, block_size=4, event_log=log)
    eng = LLMEngine(mgr, Scheduler(mgr, max_num_batched_tokens=32), runner, tokenizer=ByteTokenizer())
    eng.generate(["The cache is the pool: "], max_tokens=6)
    eng.generate(["The cache is the pool: blocks", "The cache is the pool: "], max_tokens=8)
    return log, eng


def test_every_write_lands_in_a_private_unfinished_or_fresh_block(shared_run):
    log, eng = shared_run
    scan = scan_writes(Timeline(log))
    assert scan.safe and scan.writes == scan.to_fresh + scan.to_private > 40
    assert scan.shared_blocks and scan.shared_blocks <= scan.hit_blocks  # blocks were shared (by hits) ...
    assert eng.scheduler.num_preemptions >= 1  # ... and a preemption freed and reused blocks, all checked


def test_a_planted_write_into_a_shared_block_is_caught(shared_run):
    log, _ = shared_run
    tl = Timeline(log)
    scan = scan_writes(tl)
    shared = min(scan.shared_blocks)
    events = copy.deepcopy(list(log))
    last = max(i for i, e in enumerate(events) if e.kind == "attention_batch")
    batch = events[last]
    batch.slot_mappings = [[shared * batch.block_size] + list(m[1:]) for m in batch.slot_mappings]
    bad = scan_writes(Timeline(events))
    assert not bad.safe and bad.violations[0][2] == shared
    assert "already complete and cached" in bad.violations[0][3] or "not in its block table" in bad.violations[0][3]
    assert "written while shared or cached: [" in bad.summary()


def test_lesson_figures_are_plain_data_in_figures_out():
    import plotly.graph_objects as go

    from kvlab.lessons.prefix_caching import ttft_figure
    from kvlab.lessons.privacy import timing_attack_figure

    f = ttft_figure({"a": (["r0", "r1"], [0.1, 0.2], [0.1, 0.05])})
    assert isinstance(f, go.Figure) and [t.name for t in f.data] == ["caching off", "caching on"]
    g = timing_attack_figure(([True, False], [0.010, 0.014]), {"no salt": ([0, 1], [0, 1], 0.9)})
    assert [t.name for t in g.data][-2:] == ["no salt (AUC 0.90)", "coin flip"]


def test_why_blocks_chart_shows_each_runs_preemptions():
    from kvlab.bench.memory import CAPACITY_TOKENS, PAPER_SHARES
    from kvlab.lessons.why_blocks import waste_figure
    from kvlab.workloads.memory_sim import compare
    from kvlab.workloads.traces import sharegpt_like

    results = compare(sharegpt_like(60, seed=0, rate=10.0), CAPACITY_TOKENS // 4, block_sizes=(16,))
    fig = waste_figure(results, PAPER_SHARES)
    text = [t for t in fig.data if t.type == "scatter"][0].text
    assert list(text) == [f"{r.num_preemptions:,} preempted" for r in results]


def test_eviction_metrics_and_preemption_figures_from_plain_data():
    import plotly.graph_objects as go

    from kvlab.engine.llm_engine import build_engine
    from kvlab.lessons.eviction import erosion_figure, hit_rate_figure, pool_kinds_figure
    from kvlab.lessons.metrics import (
        gains_figure,
        gauges_figure,
        hit_rate_windows_figure,
        idle_histogram_figure,
        occupancy_figure,
        pool_sweep_figure,
    )
    from kvlab.lessons.preemption import budget_figure
    from kvlab.scenarios import shared_prefix

    story = shared_prefix()
    snap = story.at("both freed")
    figs = [
        hit_rate_figure([64, 128], {"tail first": [0.5, 0.7], "head first": [0.3, 0.7]}, "t"),
        pool_kinds_figure({"a": snap, "b": snap}, {b.block_hash for b in snap.blocks if b.block_hash}),
        erosion_figure([0, 4], [1024, 0], [11.7, 134.5]),
        gauges_figure(Timeline(story.log).series.rows()),
        hit_rate_windows_figure([0.9] * 30, [0.9] * 30, change_at=15),
        occupancy_figure([1, 2], {16: [0.06, 0.12]}),
        pool_sweep_figure([64, 128], [3, 0], [100.0, 20.0]),
        gains_figure({36: 1.05, 791: 0.05}, "g"),
        idle_histogram_figure({64: [0.1, 0.5], 192: [1.0, 2.0]}),
    ]
    eng = build_engine(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    from kvlab import Request

    eng.add_request(Request("a", list(range(20)), max_tokens=2))
    eng.run()
    figs.append(budget_figure({"run": eng.events}, budget=8, colors={"a": "#0072b2"}))
    assert all(isinstance(f, go.Figure) and f.data for f in figs)
    kinds = figs[1].data[0].z  # the pool's cells: the document's blocks (hashed) are kind 3
    assert any(3 in row for row in kinds)
    assert [t.name for t in figs[-1].data][:1] == ["a"] and list(figs[-1].data[0].y) == [8, 8, 4, 1]


def test_beyond_pool_helpers_of_lessons_12_to_14(tmp_path):
    """The helpers that keep lessons 12-14's cells short answer what the lessons' predictions
    are checked against: where A's blocks sit after C, the first load, a corrupted file, the
    hand-off lines and the encoder-cache bars."""
    from kvlab.lessons.beyond_pool import (
        OFFLOAD_STORY,
        encoder_runs_figure,
        first_load,
        flip_last_byte,
        offload_engine,
        printable,
        run_one_by_one,
        tier_files,
        tiers_holding,
    )

    eng = offload_engine(str(tmp_path / "story"))
    run_one_by_one(eng, OFFLOAD_STORY[:3])
    assert tiers_holding(eng, "A") == "only on disk"  # B's and C's stores pushed A out of the 5-block CPU tier
    assert tiers_holding(eng, "C") == "in the CPU tier and on disk"
    run_one_by_one(eng, OFFLOAD_STORY[3:4])
    load = first_load(eng.events, "A2")
    assert (load.media, load.block_ids) == (["STORAGE", "STORAGE"], [4, 3])
    files = tier_files(str(tmp_path / "story"))
    assert len(files) == 9
    before = open(files[0], "rb").read()
    flip_last_byte(files[0])
    after = open(files[0], "rb").read()
    assert after[:-1] == before[:-1] and after[-1] == before[-1] ^ 0xFF
    assert all(32 <= t < 122 for _, p in printable(OFFLOAD_STORY) for t in p)
    fig = encoder_runs_figure({1: (1472, 0.04), 3: (1024, 0.037), 6: (384, 0.03)})
    assert list(fig.data[0].y) == [1472, 1024, 384] and list(fig.data[0].text) == ["23 runs", "16 runs", "6 runs"]


# -- lessons 12 and 13: vLLM's config records and connector registry, in miniature ------------------
def test_vllm_offload_configs_size_the_cpu_tier_in_bytes_as_vllm_does():
    from kvlab.lessons.beyond_pool import offload_config, vllm_offload_configs

    recs = vllm_offload_configs(offload_config("/kv", num_cpu_blocks=4), block_bytes=6_000, page_bytes=4096)
    tiering = recs["vLLM 0.33, offloading connector"]["kv_connector_extra_config"]
    assert tiering == {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 4 * 8192,  # 6,000 B padded to 2 pages
        "secondary_tiers": [{"type": "fs", "root_dir": "/kv"}],
    }
    simple = recs["vLLM 0.33, simple CPU connector"]["kv_connector_extra_config"]
    assert simple == {"cpu_bytes_to_use": 24_000, "num_cpu_blocks": 4}  # no padding, one tier


def test_connector_registry_resolves_names_lazily_and_the_module_path_wins():
    from kvlab.lessons.beyond_pool import VLLM_KV_CONNECTORS, ConnectorRegistry

    reg = ConnectorRegistry(VLLM_KV_CONNECTORS)
    assert len(reg.names) == 17 and "NixlConnector" in reg.names  # nothing imported yet (vllm is not installed)
    reg.register_connector("Mine", "collections", "OrderedDict")
    from collections import OrderedDict

    assert reg.get_connector_class("Mine") is OrderedDict
    assert reg.get_connector_class("Counter", kv_connector_module_path="collections").__name__ == "Counter"  # unregistered
    with pytest.raises(ValueError, match="already registered"):
        reg.register_connector("Mine", "collections", "deque")
    with pytest.raises(ValueError, match="Unsupported connector type: Nope"):
        reg.get_connector_class("Nope")
    with pytest.raises(ValueError, match="cannot be an empty string"):
        reg.get_connector_class("Mine", kv_connector_module_path="")
