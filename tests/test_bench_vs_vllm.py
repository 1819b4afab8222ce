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
