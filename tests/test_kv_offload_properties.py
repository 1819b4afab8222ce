"""Properties of the offload tiers under random workloads and random faults (lesson 12).

Whatever the workload, the CPU tier's cache policy (LRU or ARC) and admission threshold,
whichever copies fail and whichever files go bad between requests:

* every request produces the tokens it produces without tiers (the simulated model's next
  token is a function of the context, so any wrong or missing KV shows up as a bug here
  only if the engine mis-counts; the last test below runs the real tiny model, so there the
  bytes count too);
* after every step, the pool, the scheduler and the tiers pass their invariants and no tier
  block stays pinned (nothing leaks);
* the tiers rebuilt from the event log equal the live ones.
"""

from __future__ import annotations

import os
import random
import tempfile

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlab import Request
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.engine.llm_engine import build_engine
from kvlab.timeline import Timeline
from kvlab.eventlog.events import KVLoadFailed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    cpu=st.integers(2, 12),
    disk=st.sampled_from([0, 8, 24, 48]),
    p_fail=st.sampled_from([0.0, 0.05, 0.3]),
    prompt_only=st.booleans(),
    bs=st.sampled_from([2, 4]),
    policy=st.sampled_from(["lru", "arc"]),
    threshold=st.sampled_from([0, 2]),
)
def test_random_workloads_and_faults_keep_outputs_and_leak_nothing(seed, cpu, disk, p_fail, prompt_only, bs, policy, threshold) -> None:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(bs, 5 * bs))] for _ in range(6)]
    reqs = []
    for i in range(rng.randint(8, 16)):
        prompt = prefixes[rng.randrange(6)] + [rng.randrange(1000) for _ in range(rng.randint(0, 2 * bs))]
        reqs.append((f"r{i}", prompt, rng.randint(1, 4)))
    with tempfile.TemporaryDirectory() as d:
        extra = dict(num_cpu_blocks=cpu, offload_prompt_only=prompt_only, eviction_policy=policy, store_threshold=threshold)
        if disk:
            extra.update(storage_path=d, num_storage_blocks=disk)
        eng = build_engine(
            num_blocks=10,
            block_size=bs,
            max_num_batched_tokens=3 * bs,
            max_num_seqs=3,
            kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra),
        )
        plain = build_engine(num_blocks=10, block_size=bs, max_num_batched_tokens=3 * bs, max_num_seqs=3)
        fault_rng = random.Random(seed + 1)

        def maybe_fail(direction, key, gpu_block):
            if fault_rng.random() < p_fail:
                raise OSError(f"injected {direction} failure")

        eng.executor.kv_connector.worker.before_block_copy = maybe_fail
        conn = eng.scheduler.connector.scheduler
        mgr = conn.manager
        live = []
        for k, (rid, prompt, mt) in enumerate(reqs):
            for e in (eng, plain):
                e.add_request(Request(rid, prompt, max_tokens=mt))
            if k % 3 == 2 or k == len(reqs) - 1:
                while eng.has_unfinished_requests():
                    eng.step()
                    eng.scheduler.check_invariants()
                    conn.check_invariants()
                    live.append(
                        (
                            eng.scheduler.step_count,
                            [h[:-4].hex() for h, _ in mgr.primary.entries()],
                            [h[:-4].hex() for h, _ in mgr.secondary.entries()] if mgr.secondary else None,
                        )
                    )
                plain.run()
                if disk and fault_rng.random() < 0.5:  # a file goes bad behind the tier's back
                    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs)
                    if files:
                        victim = fault_rng.choice(files)
                        if fault_rng.random() < 0.5:
                            os.remove(victim)
                        else:
                            with open(victim, "r+b") as f:
                                f.seek(0, os.SEEK_END)
                                if f.tell():
                                    f.seek(-1, os.SEEK_END)
                                    last = f.read(1)
                                    f.seek(-1, os.SEEK_END)
                                    f.write(bytes([last[0] ^ 1]))
        for rid, _, _ in reqs:
            assert eng.finished[rid].output_token_ids == plain.finished[rid].output_token_ids, rid
        assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == 9
        assert not any(t.pinned() for t in mgr.tiers)
        if p_fail == 0.0:
            assert not any(isinstance(e, KVLoadFailed) and "injected" in e.reason for e in eng.events)
        tl = Timeline(eng.events)
        for step, cpu_live, disk_live in live:
            snap = tl.at(step)
            assert snap.tiers["CPU"].hashes == cpu_live
            if disk_live is not None:
                assert snap.tiers["STORAGE"].hashes == disk_live


# Four random runs besides the one that found a bug: each runs the real model under the Triton
# interpreter twice (~15 s of a core); the runs without bytes above cover many more workloads.
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), p_fail=st.sampled_from([0.3, 0.6]), cpu=st.integers(4, 8))
@example(seed=248, p_fail=0.6, cpu=4)  # found by this test: it caught the unwritten promotions
def test_real_kv_after_random_transfer_faults_gives_the_tokens_of_a_run_without_tiers(seed, p_fail, cpu) -> None:
    """The same with the real tiny model, so the bytes count: loads and stores fail at
    random, a request retries what did not arrive, and every request still samples what it
    samples without tiers. (This is how a promotion left unwritten by a failed load job, yet
    marked readable, would show: a later load from the CPU tier hands the model another
    block's keys and values.)"""
    import torch

    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32, 120) for _ in range(rng.randint(8, 16))] for _ in range(2)]
    reqs = [
        (f"r{i}", rng.choice(prefixes) + [rng.randrange(32, 120) for _ in range(rng.randint(1, 6))], rng.randint(1, 3)) for i in range(12)
    ]
    cfg = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    outputs = []
    with tempfile.TemporaryDirectory() as d:
        for tiers in (True, False):
            runner = ModelRunner(TinyLlama(cfg, seed=0), num_blocks=8, block_size=4, device="cpu")
            extra = dict(num_cpu_blocks=cpu, storage_path=d, num_storage_blocks=32)
            eng = build_engine(
                num_blocks=8,
                block_size=4,
                max_num_batched_tokens=64,
                executor=runner,
                kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra) if tiers else None,
            )
            if tiers:
                fault_rng = random.Random(seed + 1)

                def maybe_fail(direction, key, gpu_block):
                    if direction == "load" and fault_rng.random() < p_fail:
                        raise OSError("injected load failure")

                eng.executor.kv_connector.worker.before_block_copy = maybe_fail
            for rid, prompt, mt in reqs:
                eng.add_request(Request(rid, prompt, max_tokens=mt))
                eng.run()
                if tiers:
                    eng.scheduler.connector.scheduler.check_invariants()
            outputs.append({rid: eng.finished[rid].output_token_ids for rid, _, _ in reqs})
    assert outputs[0] == outputs[1]
