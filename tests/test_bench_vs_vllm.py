"""`python -m kvlab.bench vs-vllm`: it measures what its rows say, and without vLLM it says
how to get it (the comparison itself needs vLLM 0.33, which is not a dependency)."""

from __future__ import annotations

import pytest

from kvlab.bench import vs_vllm
from kvlab.bench.vs_vllm import PROMPT, RUN, _cycle, _hashing, _manager, _Side, _touch


def test_without_vllm_it_prints_how_to_get_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(vs_vllm, "load_vllm", lambda: (None, "ModuleNotFoundError: No module named 'vllm'"))
    vs_vllm.main([])
    out = capsys.readouterr().out
    assert "No module named 'vllm'" in out
    assert "pip download vllm==0.33.0 --no-deps" in out and "KVLAB_VLLM_PATH=" in out


@pytest.mark.parametrize(("kind", "hit"), [("miss", 0), ("hit", PROMPT - 16), ("hit held", PROMPT - 16)])
def test_the_manager_rows_miss_or_hit_as_their_labels_say(kind: str, hit: int) -> None:
    side = _Side("kvlab", None)
    one = _manager(side, kind, rounds=3)
    assert one.target.block_pool.num_gpu_blocks == 1024
    seen = []
    real = side.lookup

    def spy(mgr, req):
        blocks, n = real(mgr, req)
        seen.append((n, mgr.block_pool.get_num_free_blocks()))
        return blocks, n

    side.lookup = spy  # type: ignore[method-assign]  # a spy on the row's own lookups
    for _ in range(3):
        assert one() > 0
    assert [n for n, _ in seen] == [hit] * 3
    if kind == "hit held":  # the warm request still holds its 16 blocks: they are not free
        assert all(free == 1023 - 16 for _, free in seen)


def test_the_pool_rows_evict_touch_and_hash_what_they_say() -> None:
    side = _Side("kvlab", None)
    cycle = _cycle(side, rounds=2)
    pool = cycle.target
    before = pool.num_evicted_blocks
    cycle()
    assert pool.num_evicted_blocks - before == RUN  # every allocated block evicted a cached one
    for held in (True, False):
        touch = _touch(side, held=held)
        tpool, blocks = touch.target
        touch()
        touch()  # repeatable: the blocks are given back after each timing
        assert [b.ref_cnt for b in blocks] == [1 if held else 0] * RUN
        assert tpool.get_num_free_blocks() == (RUN if held else 2 * RUN)
        tpool.check_invariants()
    h = _hashing(side, rounds=1)
    h()
    assert len(h.target) == RUN and len(set(h.target)) == RUN


def test_the_scheduler_row_runs_every_request_to_the_end_through_preemptions_and_hits() -> None:
    """The scheduler row's claims, on kvlab's side: 200 requests with shared prefixes, each
    to its 16 tokens, in a pool small enough that it preempts; the prefixes hit; every step
    ran inside the scheduler's transaction (the queue and map are kvlab's own again after)."""
    from kvlab.bench.vs_vllm import SCHED_REQUESTS, _scheduler, scheduler_prompts

    prompts = scheduler_prompts()
    assert len(prompts) == SCHED_REQUESTS and all(64 <= len(p) <= 256 for p in prompts)
    assert prompts[0][:32] == prompts[8][:32] != prompts[1][:32]  # request i starts with prefix i % 8
    one = _scheduler(_Side("kvlab", None))
    per_step = one()
    run = one.target
    assert per_step > 0 and run.preempted > 0
    sched = run.scheduler
    assert not sched.has_unfinished_requests() and sched._txn is None
    assert (sched.prefix_cache_hits, sched.prefix_cache_queries) == (13_440, 34_514)  # the shared prefixes hit
    # Deterministic, and the same as vLLM 0.33's own scheduler on this input (checked side by
    # side: every step's scheduled tokens and preemptions agree).
    assert (run.steps, run.preempted, sum(run.scheduled)) == (97, 16, 25_466)
    sched.kv_cache_manager.block_pool.check_invariants()
