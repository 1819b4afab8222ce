"""Learner code cannot hang a check, fool it, or change kvlab for the next one.

* every check has a limit of CPU time: an endless loop -- pure Python, in a ``try/except
  Exception``, after cancelling every interval timer, a
  Triton kernel under the interpreter, in the main thread or another -- is stopped and
  reported as "your code used more than N s of CPU time — an endless loop?"; a sleep that
  never ends hits the wall-clock ceiling; slow-but-correct code on a busy machine passes;
* answers are compared by type and value: an object that claims to equal everything fails,
  a forgotten ``return`` says "got None — a missing return?";
* module constants and classes a submission reassigns are put back; the next check (even
  of a correct solution) is unaffected.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import kvlab.kernels  # noqa: F401, I001  (before triton: chooses the interpreter)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.core import kv_cache_utils  # noqa: E402
from kvlab.core.block_pool import BlockPool  # noqa: E402
from kvlab.exercises import EXERCISES, check  # noqa: E402
from kvlab.exercises import sandbox  # noqa: E402
from kvlab.exercises.sandbox import CheckTimeout, time_limit  # noqa: E402
from test_exercises import QueueOk  # noqa: E402

LIMIT = 1.0  # seconds of CPU time
WALL = 4.0  # the wall-clock ceiling, in limits (kvlab's default is 10)


@pytest.fixture
def short_limits(monkeypatch):
    for ex in EXERCISES.values():
        monkeypatch.setattr(ex, "time_limit_s", LIMIT)
    monkeypatch.setattr(sandbox, "WALL_FACTOR", WALL)


def loop_forever(*args):
    while True:
        pass


def loop_swallowing_exceptions(*args):
    while True:
        try:
            while True:
                pass
        except Exception:  # noqa: BLE001 - what a learner writes
            pass


def sleep_forever(*args):
    time.sleep(3600)


@triton.jit
def step_loops(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    start,
    seq_len,
    m_i,
    l_i,
    acc,
    scale,
    stride_block,
    stride_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    i = 0
    while i >= 0:
        i += 1
    return m_i, l_i, acc


def kv_ok(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def loop_after_cancelling_timers(*args):
    import signal

    for which in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):
        signal.setitimer(which, 0)
    while True:
        pass


CPU_MESSAGE = f"your code used more than {LIMIT:g} s of CPU time — an endless loop?"
WALL_MESSAGE = (
    f"your code waited more than {LIMIT * WALL:g} s without finishing, computing nothing — "
    "a sleep, or a wait for something that never comes?"
)


@pytest.mark.parametrize(
    "eid, learner, message",
    [
        ("longest_hit", loop_forever, CPU_MESSAGE),
        ("kv_bytes", loop_swallowing_exceptions, CPU_MESSAGE),
        ("kv_bytes", loop_after_cancelling_timers, CPU_MESSAGE),
        ("sliding_window_hit", sleep_forever, WALL_MESSAGE),
        ("paged_attention_kernel", step_loops, CPU_MESSAGE),
    ],
    ids=["pure-python", "except-Exception", "setitimer-0", "sleep", "triton-interpreter"],
)
def test_an_endless_loop_is_stopped_and_named(short_limits, eid, learner, message):
    res = check(eid, learner)  # returns at all: the runaway was stopped, whatever it caught
    assert not res and res.message == message, res.message
    assert check("kv_bytes", kv_ok)  # the next check is unaffected


def test_the_limit_is_cpu_time_not_wall_time(short_limits):
    """Code that takes longer than the limit on the clock but computes little -- what correct
    code looks like on a machine busy with other jobs -- passes."""
    slept = []

    def slow_but_correct(*args):
        if not slept:  # once: longer than the CPU limit on the clock, well under the ceiling
            slept.append(time.sleep(LIMIT * 1.5))
        return kv_ok(*args)

    res = check("kv_bytes", slow_but_correct)
    assert res and slept == [None], str(res)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
    reason="needs Linux's CPU affinity and per-thread schedstat",
)
def test_an_endless_loop_on_a_crowded_cpu_is_still_an_endless_loop():
    """Eight CPU-bound processes share this process's one CPU, so the loop gets at most a ninth
    of it: 0.3 s of CPU take 2.7 s or more on the clock, past a 1.2 s ceiling on the clock. The
    ceiling counts only waiting, and the loop never waits (it queues for the CPU): the verdict
    is the CPU limit's, as on an idle machine."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = f"import os; os.sched_setaffinity(0, {{{cpu}}}); print(flush=True)\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", hog], stdout=subprocess.PIPE) for _ in range(8)]
    try:
        for h in hogs:
            h.stdout.readline()  # pinned and spinning
        os.sched_setaffinity(0, {cpu})
        with pytest.raises(CheckTimeout):
            with time_limit(0.3, wall_s=1.2) as limit:
                loop_forever()
        assert limit.reason == "cpu", limit.message()
        assert limit.message() == "your code used more than 0.3 s of CPU time — an endless loop?"
    finally:
        os.sched_setaffinity(0, before)
        for h in hogs:
            h.kill()
            h.wait()


def test_an_endless_loop_in_another_thread_is_stopped_too(short_limits):
    out = []
    th = threading.Thread(target=lambda: out.append(check("longest_hit", loop_forever)))
    th.start()
    th.join(600)  # a bound on the wait, not a verdict: it returns as soon as the check does
    assert not th.is_alive(), "the runaway thread was not stopped"
    assert out[0].message == CPU_MESSAGE


def test_the_time_limit_leaves_an_outer_timer_alone():
    import signal

    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 600.0)
        with time_limit(2.0):
            pass
        with pytest.raises(CheckTimeout):
            with time_limit(0.2):
                while True:
                    pass
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0  # still armed: never touched
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert fired == []


class EqualsEverything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


@pytest.mark.parametrize("eid", ["longest_hit", "kv_bytes", "sliding_window_hit", "allocate_capacity", "hash_chain", "slot_mapping"])
def test_an_answer_that_equals_everything_fails(eid):
    res = check(eid, lambda *a: EqualsEverything())
    assert not res and "not the right kind of value" in res.message and "EqualsEverything" in res.message


@pytest.mark.parametrize(
    "eid",
    [
        "longest_hit",
        "kv_bytes",
        "sliding_window_hit",
        "allocate_capacity",
        "hash_chain",
        "slot_mapping",
        "free_order",
        "preempt_victim",
        # the course's exercises beyond the pool: None was "wrong answer" or "the engine stopped: TypeError"
        "tier_hits",
        "num_matched_tokens",
        "token_slots",
        "encoder_inputs",
        "group_block_hash",
        "unified_block_sizes",
        "router_block_keys",
        "stream_gaps",
    ],
)
def test_a_missing_return_is_named(eid):
    res = check(eid, lambda *a: None)
    assert not res and "got None — a missing return?" in res.message, str(res)


def test_wrong_kinds_are_named():
    assert "expected an int, got str '819200'" in check("kv_bytes", lambda *a: "819200").message
    assert "expected bytes, got str" in check("hash_chain", lambda *a: "abc").message
    res = check("stale_hash", lambda pool, block: None)
    assert "evict_cached_block must return bool, got NoneType None — a missing return?" in res.message
    import numpy as np

    assert check("kv_bytes", lambda l, h, d, b: np.int64(2 * l * h * d * b))  # numpy ints are ints
    assert "got None instead of your code" in check("kv_bytes", None).message


def test_a_submission_that_changes_kvlab_is_undone():
    root = kv_cache_utils.NONE_HASH
    touch = BlockPool.touch

    def vandal(hash_fn, parent, tokens, extra):
        kv_cache_utils.NONE_HASH = b"mine"
        BlockPool.touch = lambda self, blocks: None
        return hash_fn((parent or kv_cache_utils.NONE_HASH, tuple(tokens), extra))

    assert not check("hash_chain", vandal)
    assert kv_cache_utils.NONE_HASH is root and BlockPool.touch is touch

    def good(hash_fn, parent, tokens, extra):
        return hash_fn((parent or kv_cache_utils.NONE_HASH, tuple(tokens), extra))

    assert check("hash_chain", good)  # the next check sees kvlab as it was


def test_check_arguments():
    with pytest.raises(TypeError, match="exercise_id must be a str"):
        check(3, kv_ok)
    with pytest.raises(ValueError, match="unknown exercise_id 'nope'"):
        check("nope", kv_ok)


# --- a forgotten return in a learner's CLASS: named, not a crash deep in the pool ----------------
class _FreeQueueForgetsReturn:
    """A dict-backed free queue whose popleft() forgets its return."""

    def __init__(self, blocks):
        self.d = dict.fromkeys(blocks)

    @property
    def num_free_blocks(self):
        return len(self.d)

    def popleft(self):
        b = next(iter(self.d))
        del self.d[b]  # ... and no `return b`

    def remove(self, b):
        del self.d[b]

    def append(self, b):
        self.d[b] = None

    def get_all_free_blocks(self):
        return list(self.d)


def test_a_class_method_that_forgets_its_return_is_named():
    res = check("free_queue", _FreeQueueForgetsReturn)
    assert not res and res.message.startswith("popleft() must return the head block — got None: a missing return?"), str(res)

    from kvlab.exercises.checks_pool import queue_class_for
    from kvlab.exercises.result import WrongAnswerKind
    from kvlab.core.kv_cache_utils import KVCacheBlock

    q = queue_class_for(_FreeQueueForgetsReturn)([KVCacheBlock(0), KVCacheBlock(1)])
    with pytest.raises(WrongAnswerKind, match=r"FreeQueue.popleft\(\) must return KVCacheBlock, got NoneType None — a missing return\?"):
        q.popleft()  # the pool's own call names it too

    from kvlab.exercises.bug_hunt import OneBlockPerHash
    from kvlab.core.kv_cache_utils import KVCacheBlock as Blk

    class FixedButSilent(OneBlockPerHash):
        def insert(self, key, block):
            v = self._cache.get(key)
            if v is None:
                self._cache[key] = block
            elif isinstance(v, Blk):
                self._cache[key] = {v.block_id: v, block.block_id: block}
            else:
                v[block.block_id] = block

        def pop(self, key, block_id):
            v = self._cache.get(key)
            if isinstance(v, Blk):
                if v.block_id == block_id:
                    del self._cache[key]
                return None
            if v is not None and block_id in v:
                v.pop(block_id)  # ... and no `return`
                if len(v) == 1:
                    self._cache[key] = next(iter(v.values()))

    res = check("bug_fix", FixedButSilent)
    assert not res and "pop(k, 4) must return the removed block — got None: a missing return?" in res.message, str(res)


def test_an_engine_crash_on_none_points_at_a_missing_return():
    from kvlab.exercises.registry import EXERCISES as REG, Exercise

    def checker(obj):
        return obj().block_id  # the engine uses what the learner's method gave back

    REG["_none_probe"] = Exercise("_none_probe", "probe", "f()", "00_start_here", ["hint"], checker, "")
    try:
        res = check("_none_probe", lambda: None)
    finally:
        del REG["_none_probe"]
    assert not res and res.message.endswith("one of your methods returned None: a missing return?"), res.message
    other = check("kv_bytes", _divides_by_zero).message
    assert "ZeroDivisionError" in other and "None" not in other  # other crashes are not told so


def _divides_by_zero(*args):
    return 1 / 0


@pytest.mark.timeout(300, method="thread")
def test_a_timeout_in_another_thread_leaves_no_pending_flag_behind(short_limits):
    """The watchdog's exception into another thread is drained, not cleared: clearing left
    CPython 3.11's "pending" flag up, and the next check that counts work under a trace
    function (free_queue) spun forever at a function entry."""
    out = []
    th = threading.Thread(target=lambda: out.append(check("longest_hit", loop_forever)))
    th.start()
    th.join(600)
    assert out[0].message == CPU_MESSAGE
    res = check("free_queue", QueueOk)
    assert res and "2.0 and 2.0 counted steps per call" in res.message, str(res)
