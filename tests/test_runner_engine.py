"""End to end: LLMEngine (real scheduler + KV-cache manager) with the ModelRunner as its
executor, running the tiny model through the Triton kernels (interpreted on CPU).

Whatever the engine does with memory — prefix caching, preemption by recompute, chunked
prefill, sliding-window groups — the greedy tokens must equal the dense forward's.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.worker.model import TinyLlama, TinyLlamaConfig
from kvlab.worker.model_runner import ModelRunner

# Tiny ops: one thread is much faster than two fighting over 2 shared cores.
torch.set_num_threads(1)

BS = 4
SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
# Two prompts share 4 full blocks of 4 ("Paged attention,"), so caching has hits.
PROMPTS = [list(b"Paged attention, "), list(b"Paged attention: blocks"), list(b"KV!")]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(SMALL, seed=0)


@pytest.fixture(scope="module")
def dense(model: TinyLlama) -> list[list[int]]:
    return [model.generate_dense(p, MAX_TOKENS) for p in PROMPTS]


def make_engine(
    model: TinyLlama,
    num_blocks: int = 64,
    block_size: int = BS,
    enable_caching: bool = True,
    kv_cache_groups: list | None = None,
    **sched_kwargs,
) -> tuple[LLMEngine, ModelRunner]:
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, kv_cache_groups=kv_cache_groups, enable_caching=enable_caching)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, kv_cache_groups=kv_cache_groups)
    return LLMEngine(mgr, Scheduler(mgr, **sched_kwargs), runner), runner


@pytest.mark.parametrize("enable_caching", [True, False])
def test_engine_matches_dense_with_and_without_prefix_caching(model: TinyLlama, dense: list[list[int]], enable_caching: bool) -> None:
    engine, runner = make_engine(model, enable_caching=enable_caching)
    assert engine.generate(PROMPTS, max_tokens=MAX_TOKENS) == dense
    # Every token went through the model once (except each request's last sampled one),
    # minus the prefix-cache hits: PROMPTS[1] reuses PROMPTS[0]'s 3 full blocks
    # ("Paged attention" differs from there on), even though both arrive in one step.
    hits = sum(m.num_cached_tokens for m in engine.metrics.values())
    assert hits == (3 * BS if enable_caching else 0)
    assert runner.num_tokens_computed == sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS) - hits


def test_engine_matches_dense_under_preemption(model: TinyLlama) -> None:
    # Two 8-token prompts fill 2 blocks each of a 5-block pool; each needs a third block
    # at its first decode, so the later one is preempted, freed, and recomputed later.
    prompts = [list(b"Blocks!!"), list(b"in pool.")]
    engine, runner = make_engine(model, num_blocks=6, enable_caching=False)
    assert engine.generate(prompts, max_tokens=MAX_TOKENS) == [model.generate_dense(p, MAX_TOKENS) for p in prompts]
    assert engine.scheduler.num_preemptions > 0
    # Recompute costs work: more tokens went through the model than without preemption.
    assert runner.num_tokens_computed > sum(len(p) + MAX_TOKENS - 1 for p in prompts)


def test_engine_matches_dense_with_chunked_prefill(model: TinyLlama, dense: list[list[int]]) -> None:
    engine, runner = make_engine(model, max_num_batched_tokens=10, enable_chunked_prefill=True, enable_caching=False)
    runner.keep_history = True
    assert engine.generate(PROMPTS[:2], max_tokens=MAX_TOKENS) == dense[:2]
    # The 17- and 23-token prompts were fed in chunks of at most 10 tokens a step, and the
    # steps that ended mid-prompt sampled nothing for that request.
    assert all(rec.num_tokens <= 10 for rec in runner.history)
    assert runner.history[0].num_scheduled_tokens == [10] and runner.history[0].sampled == {}
    assert len(runner.history) > MAX_TOKENS + 2


def test_shared_prefix_is_not_recomputed() -> None:
    # One layer is enough here (the point is what reaches the kernels) and halves the cost
    # of the 512-token prefill under the interpreter.
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)
    prefix = [32 + (7 * i) % 90 for i in range(512)]  # 32 full blocks of 16
    p0, p1 = prefix + list(b"first"), prefix + list(b"second!")
    engine, runner = make_engine(model, num_blocks=40, block_size=16)
    assert engine.generate([p0], max_tokens=1) == [model.generate_dense(p0, 1)]
    before = runner.num_tokens_computed
    assert engine.generate([p1], max_tokens=2) == [model.generate_dense(p1, 2)]
    # p1's prefill fed the kernels only its 7 uncached tokens, starting at position 512,
    # then one decode token.
    assert runner.num_tokens_computed - before == len(p1) - 512 + 1
    assert engine.metrics["gen-2"].num_cached_tokens == 512


def test_engine_with_sliding_window_group(dense: list[list[int]]) -> None:
    cfg = TinyLlamaConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, sliding_window=8, sliding_window_layers=(1,)
    )
    hybrid = TinyLlama(cfg, seed=0)
    groups = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)]
    engine, runner = make_engine(hybrid, num_blocks=40, kv_cache_groups=groups)
    runner.keep_history = True
    prompts = PROMPTS[:2]
    assert engine.generate(prompts, max_tokens=7) == [hybrid.generate_dense(p, 7) for p in prompts]
    # PROMPTS[1]'s prefix hit arrives with the null block where the window group no longer
    # needs a block (padding zeros only ever trail a row, so a 0 before a real id is null).
    rows = [row for rec in runner.history for row in rec.block_tables[1]]
    assert any(0 in row[:i] for row in rows for i, b in enumerate(row) if b)


# -- one plan: the engine sizes the runner from its manager ---------------------------------------
def test_a_runner_built_without_a_size_takes_the_managers_plan(model: TinyLlama, dense: list[list[int]]) -> None:
    cfg = TinyLlamaConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, sliding_window=8, sliding_window_layers=(1,)
    )
    hybrid = TinyLlama(cfg, seed=0)
    mgr = KVCacheManager(num_blocks=40, block_size=BS, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)])
    plan = mgr.kv_cache_config
    assert plan.num_blocks == 40 and [g.kv_cache_spec.block_size for g in plan.kv_cache_groups] == [BS, BS]
    runner = ModelRunner(hybrid)
    assert not runner.kv_cache_allocated and runner.kv_caches == []
    with pytest.raises(RuntimeError, match="no KV cache yet"):
        runner.execute_model(Scheduler(mgr).schedule())
    engine = LLMEngine(mgr, Scheduler(mgr), runner)
    assert runner.kv_cache_allocated and (runner.num_blocks, runner.block_size, runner.group_windows) == (40, BS, (None, 8))
    assert [tuple(t.shape[:3]) for t in runner.kv_caches] == [(40, 2, BS)] * 2
    prompts = PROMPTS[:2]
    assert engine.generate(prompts, max_tokens=7) == [hybrid.generate_dense(p, 7) for p in prompts]
    with pytest.raises(RuntimeError, match="already allocated"):
        runner.initialize_kv_cache(plan)


def test_a_runner_sized_by_hand_must_agree_with_the_manager(model: TinyLlama) -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    small = ModelRunner(model, num_blocks=8, block_size=BS)
    with pytest.raises(ValueError, match=r"executor holds 8 blocks of 4 tokens, but the kv_cache_manager's pool has 16 blocks of 4"):
        LLMEngine(mgr, Scheduler(mgr), small)
    with pytest.raises(ValueError, match="num_blocks and block_size go together"):
        ModelRunner(model, num_blocks=8)
    with pytest.raises(ValueError, match="kv_cache_groups come with num_blocks and block_size"):
        ModelRunner(model, kv_cache_groups=[FullAttentionSpec()])
    runner = ModelRunner(model)
    with pytest.raises(TypeError, match="kv_cache_config must be a KVCacheConfig"):
        runner.initialize_kv_cache(mgr)  # type: ignore[arg-type]  # the classic slip: the manager, not its plan
    hybrid_plan = KVCacheManager(
        num_blocks=16, block_size=BS, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)]
    ).kv_cache_config
    with pytest.raises(ValueError, match="do not match the model"):
        runner.initialize_kv_cache(hybrid_plan)  # this model has no sliding-window layers
    assert not runner.kv_cache_allocated  # all or nothing: still no cache, and a good plan still works
    runner.initialize_kv_cache(mgr.kv_cache_config)
    assert (runner.num_blocks, runner.block_size) == (16, BS)
