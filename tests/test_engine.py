"""The engine loop: simulated executor, cost model, generate, run_trace, per-request metrics."""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, Request, Scheduler
from kvlab.engine.cost_model import CostModel
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.timeline import Timeline

# Powers of two, so every sum below is exact in floating point.
COST = CostModel(step_overhead_s=0.5, prefill_s_per_token=0.25, decode_s_per_token=0.125, kv_read_s_per_token=0.0625)
COST_NO_KV = CostModel(step_overhead_s=0.5, prefill_s_per_token=0.25, decode_s_per_token=0.125, kv_read_s_per_token=0.0)


def reference_output(executor: SimulatedExecutor, prompt: list[int], n: int) -> list[int]:
    """What any correct schedule must produce: token k is next_token(prompt + outputs[:k])."""
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(executor.next_token(ctx))
    return ctx[len(prompt) :]


def test_simulated_executor_is_a_function_of_the_context():
    e1, e2 = SimulatedExecutor(), SimulatedExecutor()
    ctx = [5, 6, 7, 8, 9]
    assert e1.next_token(ctx) == e2.next_token(list(ctx)) == e1.next_token(ctx)
    assert 0 <= e1.next_token(ctx) < 32000
    # Length is part of the context: same last tokens, different length, (here) different token.
    assert e1.next_token([1] + ctx) != e1.next_token(ctx)
    # Two engines, same prompts: the same outputs.
    prompts = [list(range(10, 30)), list(range(100, 107))]
    o1 = build_engine(num_blocks=32, event_log=None).generate(prompts, max_tokens=6)
    o2 = build_engine(num_blocks=32, event_log=None).generate(prompts, max_tokens=6)
    assert o1 == o2 == [reference_output(e1, p, 6) for p in prompts]


def test_generate_returns_outputs_in_prompt_order():
    # The first prompt is long and chunked (8 tokens a step), so it finishes *after* the
    # second, which is admitted beside it in step 1.
    eng = build_engine(num_blocks=64, block_size=16, event_log=None, long_prefill_token_threshold=8)
    prompts = [list(range(1000, 1100)), list(range(5, 9))]
    outs = eng.generate(prompts, max_tokens=3)
    ex = SimulatedExecutor()
    assert outs == [reference_output(ex, p, 3) for p in prompts]
    assert eng.metrics["gen-2"].finished_time < eng.metrics["gen-1"].finished_time
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_string_prompt_without_tokenizer_raises():
    eng = build_engine(num_blocks=8, event_log=None)
    with pytest.raises(TypeError, match="tokenizer"):
        eng.generate(["hello"])


def test_ttft_and_tpot_from_the_cost_model():
    eng = build_engine(num_blocks=16, block_size=16, cost_model=COST)
    eng.generate([list(range(10))], max_tokens=3)
    m = eng.metrics["gen-1"]
    # Step 1, prefill 10, context 10:  0.5 + 10*0.25  + 10*0.0625 = 3.625   (first token)
    # Step 2, decode 1,  context 11:   0.5 + 0.125    + 11*0.0625 = 1.3125  -> 4.9375
    # Step 3, decode 1,  context 12:   0.5 + 0.125    + 12*0.0625 = 1.375   -> 6.3125 (done)
    assert m.arrival_time == 0.0 and m.first_scheduled_time == 0.0
    assert m.first_token_time == 3.625 and m.ttft == 3.625
    assert m.finished_time == 6.3125 and m.e2e_latency == 6.3125
    assert m.tpot == (6.3125 - 3.625) / 2 == 1.34375
    assert (m.num_output_tokens, m.num_preemptions, m.num_cached_tokens, m.prefill_tokens_computed) == (3, 0, 0, 10)
    # The per-step series come from the event log's StepFinished records (the one channel).
    s = Timeline(eng.events).series
    assert s.num_prefill_tokens == [10, 0, 0] and s.num_decode_tokens == [0, 1, 1]
    assert s.time == [3.625, 4.9375, 6.3125] and s.num_scheduled_tokens == [10, 1, 1]


def test_run_trace_respects_arrival_times():
    eng = build_engine(num_blocks=32, block_size=16, cost_model=COST_NO_KV)
    a = Request("a", list(range(100, 104)), max_tokens=4, arrival_time=0.0)
    b = Request("b", list(range(200, 202)), max_tokens=1, arrival_time=1.0)
    c = Request("c", list(range(300, 303)), max_tokens=2, arrival_time=100.0)
    eng.run_trace([c, b, a])  # any order: the engine sorts by arrival
    ma, mb, mc = (eng.metrics[k] for k in "abc")
    # t=0: a alone.   step 1: prefill 4            0.5 + 1.0          -> 1.5
    # b arrived at 1.0 <= 1.5: added.   step 2: a decode + b prefill 2: 0.5+0.125+0.5 -> 2.625
    # (b done: 1 token).  steps 3, 4: a decodes (0.625 each) -> 3.25, 3.875 (a done: 4 tokens).
    # Idle: the clock jumps to c's arrival, 100.  step 5: prefill 3 -> 101.25; step 6 -> 101.875.
    assert (ma.first_token_time, ma.finished_time, ma.ttft) == (1.5, 3.875, 1.5)
    assert (mb.arrival_time, mb.first_scheduled_time, mb.finished_time) == (1.0, 1.5, 2.625)
    assert mb.ttft == 1.625
    assert (mc.arrival_time, mc.first_scheduled_time, mc.first_token_time, mc.finished_time) == (100.0, 100.0, 101.25, 101.875)
    assert mc.tpot == 0.625
    s = Timeline(eng.events).series
    assert s.step == [1, 2, 3, 4, 5, 6] and s.time == [1.5, 2.625, 3.25, 3.875, 101.25, 101.875] == sorted(s.time)
    assert eng.clock == 101.875
    assert sorted(eng.finished) == ["a", "b", "c"]


def test_prefix_hit_reduces_prefill_tokens():
    # Block size 16. Both prompts start with the same 40 tokens: two full shared blocks (32
    # tokens); the third block mixes shared and private tokens, so it cannot hit.
    eng = build_engine(num_blocks=32, block_size=16, event_log=None, cost_model=COST_NO_KV)
    shared = list(range(500, 540))
    p1, p2 = shared + list(range(1000, 1005)), shared + list(range(2000, 2007))
    eng.generate([p1], max_tokens=4)
    eng.generate([p2], max_tokens=4)
    m1, m2 = eng.metrics["gen-1"], eng.metrics["gen-2"]
    assert (m1.num_cached_tokens, m1.prefill_tokens_computed) == (0, 45)
    assert (m2.num_cached_tokens, m2.prefill_tokens_computed) == (32, 47 - 32)
    # TTFT follows: 0.5 + 45*0.25 = 11.75 vs 0.5 + 15*0.25 = 4.25.
    assert m1.ttft == 11.75 and m2.ttft == 4.25
    s = eng.scheduler.make_stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (45 + 47, 32)


def test_prefix_hit_within_one_step():
    # Blocks are cached when allocated, so the second request admitted in the *same* step
    # already hits the first one's two full shared blocks (as in vLLM).
    eng = build_engine(num_blocks=32, block_size=16, event_log=None)
    shared = list(range(500, 540))
    outs = eng.generate([shared + [1], shared + [2, 3]], max_tokens=2)
    m1, m2 = eng.metrics["gen-1"], eng.metrics["gen-2"]
    assert (m1.num_cached_tokens, m2.num_cached_tokens) == (0, 32)
    assert (m1.prefill_tokens_computed, m2.prefill_tokens_computed) == (41, 42 - 32)
    ex = SimulatedExecutor()
    assert outs == [reference_output(ex, shared + [1], 2), reference_output(ex, shared + [2, 3], 2)]


def test_engine_resumes_a_request_that_preempted_itself():
    """Priority policy: V (worst priority) needs a block and is its own victim; the running
    loop goes on with A (vLLM 0.33), and V resumes once A is done: every output is right."""
    eng = build_engine(num_blocks=5, block_size=4, policy="priority", max_num_batched_tokens=64)
    v = Request("V", list(range(100, 103)), max_tokens=10, priority=5, arrival_time=0.0)
    a = Request("A", list(range(200, 201)), max_tokens=10, priority=0, arrival_time=1.0)
    eng.add_request(v)
    eng.step()
    eng.add_request(a)
    eng.run()  # step 7: V preempts itself, A runs (see test_scheduler)
    (h7,) = [h for h in Timeline(eng.events).series.rows() if h["step"] == 7]
    assert (h7["num_scheduled_tokens"], h7["num_preemptions"]) == (1, 1)
    ex = SimulatedExecutor()
    assert v.output_token_ids == reference_output(ex, v.prompt_token_ids, 10)
    assert a.output_token_ids == reference_output(ex, a.prompt_token_ids, 10)
    assert eng.metrics["V"].num_preemptions == 1
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_engine_rejects_a_scheduler_on_another_manager():
    m1, m2 = KVCacheManager(num_blocks=4, block_size=4), KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="kv_cache_manager"):
        LLMEngine(m1, Scheduler(m2), SimulatedExecutor())
