"""Exercises: break it and fix it. ``check(exercise_id, learner_obj) -> CheckResult``.

Each checker plugs the learner's code into the real engine (their free queue inside the
``BlockPool``, their victim choice inside the ``Scheduler`` …), replays vLLM's documented
scenarios and random cases, and explains the first case that failed.
"""

from kvlab.exercises import (  # noqa: F401  (register)
    checks_beyond_pool,
    checks_bug_hunt,
    checks_capstone,
    checks_hashing,
    checks_hybrid,
    checks_kernels,
    checks_lookup,
    checks_pool,
    checks_routing,
    checks_sched,
)
from kvlab.exercises.progress import show_progress
from kvlab.exercises.registry import EXERCISES, Exercise, check, hints
from kvlab.exercises.result import CheckResult

__all__ = ["EXERCISES", "CheckResult", "Exercise", "check", "hints", "show_progress"]
