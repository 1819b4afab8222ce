"""The exercise registry and ``check()``: run a learner's code against the real engine."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.exercises.answers import describe, same, type_problem
from kvlab.exercises.result import CheckFailed, CheckResult, LearnerError, WrongAnswerKind, failed, not_implemented
from kvlab.exercises.sandbox import CheckTimeout, kvlab_state_restored, time_limit

#: Seconds a check may run (the learner's code included) before it is stopped. Correct
#: code needs well under a second for most checks (the free-queue speed test: ~1 s).
DEFAULT_TIME_LIMIT_S = 20.0


@dataclass
class Exercise:
    id: str
    title: str
    signature: str
    lesson: str  # the lesson notebook that teaches the idea
    hints: list[str]
    checker: Callable[[Any], CheckResult]
    notebook: str = ""  # solutions/<notebook>.ipynb
    tags: list[str] = field(default_factory=list)
    time_limit_s: float = DEFAULT_TIME_LIMIT_S

    @property
    def difficulty(self) -> int:
        """1 (★) to 3 (★★★)."""
        return LEVELS[self.id][0]

    @property
    def minutes(self) -> int:
        return LEVELS[self.id][1]

    @property
    def level(self) -> str:
        """'★★☆ · about 15 min': how the lessons announce the exercise."""
        return "★" * self.difficulty + "☆" * (3 - self.difficulty) + f" · about {self.minutes} min"


EXERCISES: dict[str, Exercise] = {}

# How hard and how long, as each lesson announces an exercise (★ to ★★★, minutes for a learner who
# has just read the lesson). One table, so the lessons, exercises/ and lesson 00's progress agree.
LEVELS: dict[str, tuple[int, int]] = {
    "kv_bytes": (1, 5),
    "slot_mapping": (1, 10),
    "paged_attention_kernel": (3, 40),
    "hash_chain": (1, 10),
    "longest_hit": (1, 10),
    "extra_keys": (2, 20),
    "free_queue": (2, 25),
    "free_order": (1, 5),
    "touch": (1, 10),
    "stale_hash": (2, 15),
    "preempt_victim": (1, 10),
    "allocate_capacity": (2, 15),
    "sliding_window_hit": (2, 20),
    "group_block_hash": (2, 15),
    "unified_block_sizes": (2, 20),
    "bug_hunt": (2, 30),
    "bug_fix": (2, 15),
    "block_manager": (3, 60),
    "stream_gaps": (1, 10),
    "index_copies": (2, 15),
    "router_block_keys": (2, 20),
    "tier_hits": (2, 20),
    "promotion_scan": (2, 15),
    "num_matched_tokens": (1, 10),
    "token_slots": (1, 10),
    "encoder_inputs": (2, 25),
}


def register(
    id: str, title: str, signature: str, lesson: str, hints: list[str], notebook: str = "", time_limit_s: float = DEFAULT_TIME_LIMIT_S
) -> Callable:
    def deco(fn: Callable[[Any], CheckResult]) -> Callable[[Any], CheckResult]:
        EXERCISES[id] = Exercise(id, title, signature, lesson, hints, fn, notebook, time_limit_s=time_limit_s)
        return fn

    return deco


def wrong_kind(eid: str, got: Any, want: Any, case: str, what: str = "your answer", **kw: Any) -> CheckResult | None:
    """A failed result when ``got`` is not even the right kind of answer (None -- a missing
    return --, a str for an int, ...); None when its kind fits ``want``."""
    problem = type_problem(got, want)
    if problem is None:
        return None
    return failed(eid, f"{what} is not the right kind of value: {problem}", case=case, expected=describe(want), got=describe(got), **kw)


def returns(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is a ``kind`` -- learner code called from inside the engine --, else
    stop the check with a message about the kind (not a crash deep in the engine)."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        hint = " — a missing return?" if value is None else ""
        raise WrongAnswerKind(f"{what} must return {names}, got {type(value).__name__} {describe(value)}{hint}")
    return value


__all__ = ["EXERCISES", "Exercise", "register", "call", "check", "hints", "same", "wrong_kind", "returns"]


def call(fn: Callable, *args: Any, where: str) -> Any:
    """Call learner code: NotImplementedError (and a wrong kind of answer) passes through,
    anything else is summarised."""
    try:
        return fn(*args)
    except (NotImplementedError, WrongAnswerKind):
        raise
    except Exception as e:  # noqa: BLE001 - any learner bug becomes a teaching message
        raise LearnerError(e, where) from e


def check(exercise_id: str, learner_obj: Any) -> CheckResult:
    """Check the learner's function/class for ``exercise_id``; truthy when it passes.

    ``.message`` explains the first case that failed: inputs, expected, got, and which
    idea it violates.

    Every check runs under a limit of CPU time (``Exercise.time_limit_s``: "your code used
    more than N s of CPU time -- an endless loop?"; see :mod:`kvlab.exercises.sandbox`), and kvlab's modules and classes are put back as they
    were afterwards, so one submission never changes the next check (see
    :mod:`kvlab.exercises.sandbox`).
    """
    if not isinstance(exercise_id, str):
        raise TypeError(f"exercise_id must be a str, got {type(exercise_id).__name__} {exercise_id!r}")
    try:
        ex = EXERCISES[exercise_id]
    except KeyError:
        raise ValueError(f"unknown exercise_id {exercise_id!r}; choose one of {', '.join(sorted(EXERCISES))}") from None
    result = _run(ex, learner_obj)
    if result.passed:
        from kvlab.learner.store import store

        store().record_pass(exercise_id)  # lesson 00 lists what the learner has passed
    return result


#: Exercises whose function answers with a value that is never None: a None from them is a
#: forgotten ``return``, said so at once (not "wrong answer", nor a crash deep in the engine).
RETURNS_A_VALUE = frozenset(
    {
        "tier_hits",
        "num_matched_tokens",
        "token_slots",
        "encoder_inputs",
        "group_block_hash",
        "unified_block_sizes",
        "router_block_keys",
        "stream_gaps",
    }
)


def _never_none(fn: Callable, exercise_id: str) -> Callable:
    name = getattr(fn, "__name__", "your function")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = fn(*args, **kwargs)
        if value is None:
            raise WrongAnswerKind(f"{name} returned nothing: got None — a missing return? ({exercise_id} answers with a value)")
        return value

    return wrapper


def _run(ex: Exercise, learner_obj: Any) -> CheckResult:
    """One check, sandboxed: a time limit, kvlab's module state put back afterwards, and every
    way the learner's code can go wrong turned into a result that says which."""
    exercise_id = ex.id
    if learner_obj is None:
        return failed(
            exercise_id,
            "got None instead of your code — did you run the cell that defines it, and pass the function (or class) itself?",
            idea=f"check({exercise_id!r}, your_function): the name, without calling it",
        )
    if exercise_id in RETURNS_A_VALUE and inspect.isfunction(learner_obj):
        learner_obj = _never_none(learner_obj, exercise_id)
    with kvlab_state_restored():
        try:
            with time_limit(ex.time_limit_s) as limit:
                return ex.checker(learner_obj)
        except CheckTimeout:
            return failed(
                exercise_id,
                limit.message(),
                idea="look for a loop whose condition never changes (a queue that never advances, a `while` without a step); the check was stopped",
            )
        except NotImplementedError:
            return not_implemented(exercise_id)
        except CheckFailed as e:
            return e.result
        except WrongAnswerKind as e:
            return failed(exercise_id, str(e), idea="return the value the signature names")
        except LearnerError as e:
            return failed(exercise_id, f"your code raised an error: {e}", idea="fix the error first; the message names the line")
        except Exception as e:  # noqa: BLE001 - the engine caught an inconsistency the learner's code caused
            # A method of a learner's class that forgets its ``return`` hands the engine a None,
            # and the engine trips over it later ("'NoneType' object has no attribute ...").
            none = " — one of your methods returned None: a missing return?" if "NoneType" in str(e) else ""
            return failed(
                exercise_id,
                f"with your code plugged in, the engine stopped: {type(e).__name__}: {e}{none}",
                idea=ex.hints[-1],
            )


@dataclass
class HintsNote:
    """What a hints cell shows where nobody can press a button (CI, a stored notebook): the
    number of hints, none of their text -- a reader of the stored lesson is not handed them."""

    exercise_id: str
    count: int

    def __repr__(self) -> str:
        return f"{self.count} hints for {self.exercise_id}: run this cell in JupyterLab to open them one at a time"

    def _repr_html_(self) -> str:
        return f"<i>{self.count} hints for <code>{self.exercise_id}</code>: run this cell in JupyterLab to open them one at a time</i>"


def hints(exercise_id: str) -> Any:
    """Hints revealed one at a time: a button per hint. Where no one can press it (CI, the
    stored notebooks -- the same test as ``predict``'s), a note with their number."""
    if exercise_id not in EXERCISES:
        raise ValueError(f"unknown exercise_id {exercise_id!r}; choose one of {', '.join(sorted(EXERCISES))}")
    ex = EXERCISES[exercise_id]
    from kvlab.learner.prediction import interactive

    if not interactive():
        return HintsNote(exercise_id, len(ex.hints))
    try:
        import ipywidgets as w
    except ImportError:  # pragma: no cover
        return "\n".join(f"hint {i + 1}: {h}" for i, h in enumerate(ex.hints))
    note = HintsNote(exercise_id, len(ex.hints))

    class HintsBox(w.VBox):
        """Displayed with a still (the note): a lesson saved with its hints cell open shows
        the note, not "Error displaying widget", once the buttons' model is gone."""

        def _ipython_display_(self) -> None:
            from kvlab.utils.notebook_display import display_with_still

            display_with_still(self, {"text/html": note._repr_html_(), "text/plain": repr(note)})

    out = HintsBox()
    shown: list[Any] = []

    def reveal(_: Any = None) -> None:
        i = len(shown)
        if i < len(ex.hints):
            shown.append(w.HTML(f"<b>Hint {i + 1}.</b> {ex.hints[i]}"))
        button.description = f"Show hint {len(shown) + 1}" if len(shown) < len(ex.hints) else "No more hints"
        button.disabled = len(shown) >= len(ex.hints)
        out.children = (*shown, button)

    button = w.Button(description="Show hint 1", button_style="info")
    button.on_click(reveal)
    out.children = (button,)
    return out
