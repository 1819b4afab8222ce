"""The exercise registry and ``check()``: run a learner's code against the real engine."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.exercises.result import CheckResult, LearnerError, failed, not_implemented


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


EXERCISES: dict[str, Exercise] = {}


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
    try:
        return ex.checker(learner_obj)
    except NotImplementedError:
        return not_implemented(exercise_id)
    except LearnerError as e:
        return failed(exercise_id, f"your code raised an error: {e}", idea="fix the error first; the message names the line")
    except Exception as e:  # noqa: BLE001 - the engine caught an inconsistency the learner's code caused
        return failed(
            exercise_id,
            f"with your code plugged in, the engine stopped: {type(e).__name__}: {e}",
            idea=ex.hints[-1],
        )


def hints(exercise_id: str) -> Any:
    """Hints revealed one at a time: a button per hint (plain text outside Jupyter)."""
    ex = EXERCISES[exercise_id]
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
