"""Two holes in the all-or-nothing engine calls, each found by a learner's kind of mistake (a
log subscriber that raises), each closed: an undone call leaves no request behind in no queue,
and no field of a request -- including one a connector sets -- keeps a value from the undone
step."""

from __future__ import annotations

import pytest

from kvlab import KVCacheManager, Request, Scheduler
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.eventlog.events import EventLog

from scheduler_side_connector import SchedulerSideConnector
from state_fingerprint import comparable, engine_fingerprint, request_fingerprint


def _raise_on(kind: str, nth: int = 1):
    seen = {"n": 0}

    def subscriber(event) -> None:
        if event.kind == kind:
            seen["n"] += 1
            if seen["n"] == nth:
                raise RuntimeError(f"a subscriber failed on {kind} #{nth}")

    return subscriber


def test_generate_whose_second_add_fails_leaves_no_request_in_no_queue() -> None:
    eng = build_engine(num_blocks=16, block_size=4)
    before = engine_fingerprint(eng)
    boom = _raise_on("request_added", nth=2)
    eng.events.subscribe(boom)
    with pytest.raises(RuntimeError, match="request_added #2"):
        eng.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9]], max_tokens=2)
    eng.events.unsubscribe(boom)
    # the first prompt was queued before the second failed: it must be gone again, and so
    # must its claim on the id (before the fix: in `requests`, in no queue, id refused forever)
    assert dict(eng.scheduler.requests) == {} and engine_fingerprint(eng) == before
    eng.scheduler.check_invariants()
    assert eng.generate([[1, 2, 3, 4, 5]], max_tokens=2) == [[*eng.finished["gen-1"].output_token_ids]]
    eng.add_request(Request("gen-1-again", [1, 2, 3], max_tokens=1))


def test_the_invariant_names_a_request_that_is_in_no_queue() -> None:
    eng = build_engine(num_blocks=16, block_size=4)
    r = Request("lost", [1, 2, 3], max_tokens=1)
    eng.scheduler.requests["lost"] = r  # what the hole left behind
    with pytest.raises(AssertionError, match=r"requests in no queue: \['lost'\]"):
        eng.scheduler.check_invariants()


class HandsOff(SchedulerSideConnector):
    """A producer: every finished request gets transfer parameters (where its KV went)."""

    def request_finished(self, request, block_ids):
        return False, {"saved_to": f"/kv/{request.request_id}", "blocks": list(block_ids)}


def test_an_undone_step_takes_back_the_kv_transfer_params_it_set() -> None:
    log = EventLog()
    mgr = KVCacheManager(num_blocks=16, block_size=4, event_log=log)
    eng = LLMEngine(mgr, Scheduler(mgr, connector=HandsOff(KVConnectorRole.SCHEDULER)), SimulatedExecutor())
    r = Request("r", [1, 2, 3, 4, 5, 6], max_tokens=2)
    eng.add_request(r)
    eng.step()  # prefill + first token
    before, r_before = engine_fingerprint(eng), request_fingerprint(r)
    boom = _raise_on("request_finished")  # after request_finished() handed back the params
    log.subscribe(boom)
    with pytest.raises(RuntimeError, match="request_finished #1"):
        eng.step()
    log.unsubscribe(boom)
    assert r.kv_transfer_params is None and request_fingerprint(r) == r_before
    assert comparable(engine_fingerprint(eng)) == comparable(before)
    eng.step()
    assert eng.finished["r"].kv_transfer_params == {"saved_to": "/kv/r", "blocks": [1, 2]}


def test_block_level_load_failures_with_two_groups_are_refused_as_in_vllm() -> None:
    """vLLM 0.33 raises when a connector reports invalid_block_ids for a model with more than
    one KV-cache group (block ids alone cannot say which group's table lost them); kvlab once
    handled group 0 only, silently. Refused before anything changes."""
    from kvlab import FullAttentionSpec, SlidingWindowSpec
    from kvlab.outputs import KVConnectorOutput
    from state_fingerprint import scheduler_fingerprint

    mgr = KVCacheManager(num_blocks=16, block_size=4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)])
    sched = Scheduler(mgr, connector=HandsOff(KVConnectorRole.SCHEDULER))
    sched.add_request(Request("r", [1, 2, 3, 4, 5, 6], max_tokens=2))
    out = sched.schedule()
    before = scheduler_fingerprint(sched)
    with pytest.raises(RuntimeError, match=r"invalid_block_ids \[1\]: block-level load failures are not supported with 2 KV-cache groups"):
        sched.update_from_output(out, {"r": [7]}, kv_connector_output=KVConnectorOutput(invalid_block_ids={1}))
    assert scheduler_fingerprint(sched) == before
    sched.update_from_output(out, {"r": [7]}, kv_connector_output=KVConnectorOutput())  # then the real output
    assert sched.requests["r"].output_token_ids == [7]


def test_a_steps_checkpoint_keeps_full_attention_tables_by_length_and_undoes_growth_and_frees() -> None:
    """A decode step must not cost more for a request holding 2,048 blocks than for one holding
    16: the checkpoint keeps a full-attention table as (the list itself, its length), copies
    none, and an undo cuts each table back and puts back the ones the step freed. A window's
    table (changed in place: blocks become the null block) is copied."""
    from kvlab.core.transaction import engine_call
    from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    eng = build_engine(num_blocks=40, block_size=4, max_num_seqs=4)
    eng.add_request(Request("a", list(range(1, 30)), max_tokens=12))
    eng.add_request(Request("b", list(range(40, 47)), max_tokens=6))
    for _ in range(3):
        eng.step()
    group = eng.kv_cache_manager.coordinator.single_type_managers[0]
    tables = dict(group.req_to_blocks)
    lengths = {rid: len(t) for rid, t in tables.items()}
    assert lengths == {"a": 8, "b": 3}
    before = engine_fingerprint(eng)
    with pytest.raises(RuntimeError, match="stop here"):
        with engine_call(eng, "step") as cp:
            group_save = cp.sched.manager.managers[0]  # type: ignore[union-attr]
            saved, saved_lengths = group_save.tables, group_save.lengths
            assert saved is not None and saved_lengths is not None
            assert {rid: (t is tables[rid], n) for (rid, t), n in zip(saved.items(), saved_lengths)} == {"a": (True, 8), "b": (True, 3)}
            for _ in range(4):  # "a" grows by a block, "b" finishes: its table is freed
                eng._step(cp)
            assert "b" not in group.req_to_blocks and len(group.req_to_blocks["a"]) == 9
            raise RuntimeError("stop here")
    assert group.req_to_blocks == tables and all(group.req_to_blocks[rid] is tables[rid] for rid in tables)
    assert {rid: len(t) for rid, t in group.req_to_blocks.items()} == lengths
    # The executor saw the undone steps, so the next one sends every request in full:
    assert eng.scheduler._num_sent_blocks == {}
    eng.scheduler._num_sent_blocks = {"a": (8,), "b": (3,)}  # as before, for the comparison of everything else
    assert engine_fingerprint(eng) == before

    hybrid = KVCacheManager(num_blocks=16, block_size=4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)])
    hybrid.allocate_slots(Request("h", list(range(1, 14))), 13)
    from kvlab.core.transaction import checkpoint_manager, release_manager

    cp = checkpoint_manager(hybrid)
    full, window = cp.managers
    assert full.tables is not None and full.lengths == [4] and "req_to_blocks" not in full.attrs
    assert full.tables["h"] is hybrid.coordinator.single_type_managers[0].req_to_blocks["h"]
    assert window.tables is None and window.attrs["req_to_blocks"]["h"] == hybrid.coordinator.single_type_managers[1].req_to_blocks["h"]
    assert window.attrs["req_to_blocks"]["h"] is not hybrid.coordinator.single_type_managers[1].req_to_blocks["h"]
    release_manager(hybrid, cp)


def test_a_requests_saved_state_is_every_field_it_holds_declared_or_not() -> None:
    """A Request declares its fields (``__slots__``: saving them every step must not turn its
    attribute storage into a dict); an attribute a learner or a connector adds lives in its
    ``__dict__``. The saved state covers both, and a slot never set stays unset."""
    from kvlab.core.transaction import request_state, set_request_state
    from kvlab.utils.state import get_fields, set_fields

    r = Request("x", [1, 2, 3, 4, 5], max_tokens=4)
    r.note = "a learner's"  # type: ignore[attr-defined]  # an attribute the class does not declare
    before = request_fingerprint(r)
    names = {name for name, _ in before}
    assert {"num_computed_tokens", "kv_transfer_params", "status", "_owner", "note"} <= names
    assert len(names) == len(Request.__slots__)  # every declared field but __dict__, plus "note"
    state = request_state(r)
    r.num_computed_tokens, r.kv_transfer_params, r.note = 3, {"remote": 1}, "changed"  # type: ignore[attr-defined]
    r.added_later = 5  # type: ignore[attr-defined]
    r.append_output_token_ids([9, 10])
    assert request_fingerprint(r) != before
    set_request_state(r, state)
    assert request_fingerprint(r) == before and not hasattr(r, "added_later")

    class Slotted:
        __slots__ = ("a", "b")

    s = Slotted()
    s.a = 1
    saved = get_fields(s)
    s.a, s.b = 2, 3
    set_fields(s, saved)
    assert s.a == 1 and not hasattr(s, "b")


def test_the_full_attention_managers_attributes_are_each_named_state_or_fixed() -> None:
    """The step's checkpoint saves kvlab's own full-attention manager by name (reading its
    ``__dict__`` would slow every later read of it): every attribute a real manager has must
    be either state the checkpoint saves or fixed at construction -- a new one fails here
    until it is named."""
    from kvlab.core.single_type_kv_cache_manager import FullAttentionManager
    from kvlab.core.transaction import _FULL_ATTENTION_FIXED, _FULL_ATTENTION_RARE, _FULL_ATTENTION_STATE, _TABLES

    for mgr in (KVCacheManager(num_blocks=16, block_size=4), KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)):
        m = mgr.coordinator.single_type_managers[0]
        assert type(m) is FullAttentionManager
        assert set(vars(m)) == set(_TABLES) | set(_FULL_ATTENTION_STATE) | set(_FULL_ATTENTION_RARE) | _FULL_ATTENTION_FIXED
