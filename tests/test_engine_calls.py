"""The engine's calls as a learner uses them: the log they record into, generate's ids and
its all-or-nothing admission, aborts, and a Request whose hash function raises."""

from __future__ import annotations

import pytest

from kvlab import Request, RequestStatus
from kvlab.core.kv_cache_utils import get_request_block_hasher
from kvlab.engine.llm_engine import build_engine
from kvlab.eventlog.events import EventLog
from kvlab.utils import hashing


def test_build_engine_records_into_the_log_it_is_given_even_an_empty_one():
    log = EventLog()
    assert len(log) == 0
    eng = build_engine(num_blocks=8, block_size=4, event_log=log)
    assert eng.events is log and len(log) >= 2  # pool and scheduler created
    eng.generate([[1, 2, 3]], max_tokens=2)
    assert any(e.kind == "step_finished" for e in log)
    assert build_engine(num_blocks=8, event_log=None).events is None
    assert build_engine(num_blocks=8, event_log=False).events is None


def test_generated_ids_never_collide_with_the_users():
    eng = build_engine(num_blocks=32, block_size=4)
    eng.add_request(Request("gen-1", [9, 9, 9], max_tokens=5))  # a user's id that looks generated
    eng.add_request(Request("gen-3", [8, 8], max_tokens=5))
    outs = eng.generate([[1, 2], [3, 4], [5, 6]], max_tokens=2)
    assert len(outs) == 3 and all(len(o) == 2 for o in outs)
    assert sorted(eng.finished) == ["gen-1", "gen-2", "gen-3", "gen-4", "gen-5"]
    assert eng.finished["gen-1"].prompt_token_ids == [9, 9, 9]  # the user's request, not overwritten
    assert eng.finished["gen-2"].prompt_token_ids == [1, 2] and eng.finished["gen-4"].prompt_token_ids == [3, 4]
    assert eng.generate([[7]], max_tokens=1) and "gen-6" in eng.finished  # and the next call goes on counting


def test_generate_is_all_or_nothing():
    eng = build_engine(num_blocks=8, block_size=4)
    n_events = len(eng.events)
    with pytest.raises(ValueError, match="'gen-2' can never fit"):
        eng.generate([[1, 2, 3], list(range(100))], max_tokens=4)
    assert not eng.has_unfinished_requests() and len(eng.events) == n_events and eng.metrics == {}
    assert eng.generate([[1, 2, 3]], max_tokens=2) and list(eng.finished) == ["gen-1"]  # no id was used up


def test_abort_request_finishes_frees_and_records():
    eng = build_engine(num_blocks=16, block_size=4, max_num_seqs=1)
    a, b = Request("a", [1, 2, 3, 4, 5], max_tokens=8), Request("b", [6, 7], max_tokens=8)
    eng.add_request(a), eng.add_request(b)
    eng.step()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    eng.abort_request(["a", "b", "unknown"])
    assert (a.status, a.finish_reason, b.status) == (RequestStatus.FINISHED_ABORTED, "abort", RequestStatus.FINISHED_ABORTED)
    assert eng.finished == {"a": a, "b": b} and eng.metrics["a"].finished_time == eng.clock
    assert not eng.has_unfinished_requests() and eng.kv_cache_manager.block_pool.get_num_free_blocks() == 15
    eng.scheduler.check_invariants()


class Flaky:
    """A hash function that raises on its n-th call (a learner's, with a bug)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, obj):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("bug in my hash")
        return hashing.sha256(obj)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_hash_function_that_raises_once_leaves_the_request_whole(n):
    """vLLM computes a request's block hashes as its tokens arrive; a hasher that raises
    half way must not leave tokens whose full blocks have no hash ("request 'r0' has 0 block
    hashes, needs 1" on every later run)."""
    fn = Flaky(n)
    hasher = get_request_block_hasher(2, fn, extra_keys_fn=lambda r, s, e: None)
    r = Request("r0", [1, 2, 3])
    try:
        r.bind_block_hasher(hasher)
    except RuntimeError:
        assert r.block_hasher is None and r.block_hashes == []  # unbound, as before
        r.bind_block_hasher(hasher)
    assert len(r.block_hashes) == 1
    for tok in range(10, 22):
        before = (list(r.all_token_ids), list(r.output_token_ids), bytes(r.token_bytes), list(r.block_hashes))
        try:
            r.append_output_token_ids(tok)
        except RuntimeError:
            after = (list(r.all_token_ids), list(r.output_token_ids), bytes(r.token_bytes), list(r.block_hashes))
            assert after == before  # all or nothing
            r.append_output_token_ids(tok)
        assert len(r.block_hashes) == r.num_tokens // 2
    assert fn.calls >= n


def _storm(eng) -> None:
    for i in range(6):
        eng.add_request(Request(f"r{i}", [1, 2, 3, 4] * 2 + [10 + i] * (3 + i), max_tokens=4 + i, arrival_time=float(i)))


def test_an_unguarded_run_takes_no_undo_point_and_gives_the_same_run():
    """``unguarded(engine)``: a private engine's calls take no checkpoint (the cost of the
    undo is gone) and the run is the same run -- outputs, block ids, the whole event log."""
    from kvlab.core import transaction

    guarded, free = build_engine(num_blocks=12, block_size=4), build_engine(num_blocks=12, block_size=4)
    taken = []
    real = transaction.checkpoint_scheduler

    def counting(sched):
        taken.append(sched)
        return real(sched)

    transaction.checkpoint_scheduler, saved = counting, real
    try:
        _storm(guarded)
        guarded.run()
        n_guarded = len(taken)
        with transaction.unguarded(free) as nocp:
            assert free.scheduler._txn is nocp and free.kv_cache_manager._txn is nocp
            _storm(free)
            free.run()
        assert len(taken) == n_guarded > 0  # the unguarded run took none
    finally:
        transaction.checkpoint_scheduler = saved
    assert free.scheduler._txn is None and free.kv_cache_manager._txn is None and free._unguarded is None
    assert {k: r.output_token_ids for k, r in free.finished.items()} == {k: r.output_token_ids for k, r in guarded.finished.items()}
    assert [e.to_dict() for e in free.events] == [e.to_dict() for e in guarded.events]
    free.generate([[5, 6, 7]], max_tokens=2)  # guarded again after the block


def test_a_failure_in_an_unguarded_run_leaves_the_engine_refused_not_half_undone():
    from kvlab.core.transaction import unguarded
    from kvlab.engine.llm_engine import EngineInterruptedError

    eng = build_engine(num_blocks=12, block_size=4)
    _storm(eng)

    def boom(event) -> None:
        if event.kind == "step_finished" and event.step == 3:
            raise RuntimeError("a subscriber failed")

    eng.events.subscribe(boom)
    with pytest.raises(RuntimeError, match="a subscriber failed"):
        with unguarded(eng):
            eng.run()
    with pytest.raises(EngineInterruptedError, match=r"without undo points .* RuntimeError: a subscriber failed .* build a new engine"):
        eng.step()
    with pytest.raises(RuntimeError, match="no state to go back to; build a new engine"):
        eng.restore()
    with pytest.raises(EngineInterruptedError):
        eng.add_request(Request("late", [1, 2], max_tokens=1))


def test_unguarded_refuses_an_engine_already_inside_a_block():
    from kvlab.core.transaction import unguarded

    eng = build_engine(num_blocks=8, block_size=4)
    with unguarded(eng):
        with pytest.raises(RuntimeError, match="inside a call or an unguarded block already"):
            with unguarded(eng):
                pass
        assert eng._unguarded is not None  # the outer block goes on
    assert eng._unguarded is None
