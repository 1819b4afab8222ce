"""The exercise registry and ``check()``: run a learner's code against the real engine."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.exercises.result import CheckFailed, CheckResult, LearnerError, failed, not_implemented


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
    "kv_bytes": (1, 5), "slot_mapping": (1, 10), "paged_attention_kernel": (3, 40),
    "hash_chain": (1, 10), "longest_hit": (1, 10), "extra_keys": (2, 20),
    "free_queue": (2, 25), "free_order": (1, 5), "touch": (1, 10), "stale_hash": (2, 15),
    "preempt_victim": (1, 10), "allocate_capacity": (2, 15),
    "sliding_window_hit": (2, 20), "group_block_hash": (2, 15), "unified_block_sizes": (2, 20),
    "bug_hunt": (2, 30), "bug_fix": (2, 15), "block_manager": (3, 60),
    "stream_gaps": (1, 10), "index_copies": (2, 15), "router_block_keys": (2, 20),
    "tier_hits": (2, 20), "num_matched_tokens": (1, 10), "token_slots": (1, 10), "encoder_inputs": (2, 25),
}


def register(id: str, title: str, signature: str, lesson: str, hints: list[str], notebook: str = "") -> Callable:
    def deco(fn: Callable[[Any], CheckResult]) -> Callable[[Any], CheckResult]:
        EXERCISES[id] = Exercise(id, title, signature, lesson, hints, fn, notebook)
        return fn

    return deco


def call(fn: Callable, *args: Any, where: str) -> Any:
    """Call learner code: NotImplementedError passes through, anything else is summarised."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any learner bug becomes a teaching message
        raise LearnerError(e, where) from e


def check(exercise_id: str, learner_obj: Any) -> CheckResult:
    """Check the learner's function/class for ``exercise_id``; truthy when it passes.

    ``.message`` explains the first case that failed: inputs, expected, got, and which
    idea it violates.
    """
    try:
        ex = EXERCISES[exercise_id]
    except KeyError:
        raise ValueError(f"unknown exercise_id {exercise_id!r}; choose one of {', '.join(sorted(EXERCISES))}") from None
    result = _run(ex, learner_obj)
    if result.passed:
        from kvlab.learner.store import store

        store().record_pass(exercise_id)  # lesson 00 lists what the learner has passed
    return result


def _run(ex: Exercise, learner_obj: Any) -> CheckResult:
    exercise_id = ex.id
    try:
        return ex.checker(learner_obj)
    except NotImplementedError:
        return not_implemented(exercise_id)
    except CheckFailed as e:
        return e.result
    except LearnerError as e:
        return failed(exercise_id, f"your code raised an error: {e}", idea="fix the error first; the message names the line")
    except Exception as e:  # noqa: BLE001 - the engine caught an inconsistency the learner's code caused
        return failed(
            exercise_id,
            f"with your code plugged in, the engine stopped: {type(e).__name__}: {e}",
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
    out = w.VBox()
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
