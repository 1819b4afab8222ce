"""Lesson 00's progress table: every exercise of the course, where it sits, and whether the
learner has passed it (read from the local record, :mod:`kvlab.learner.store`)."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path

from kvlab.exercises.registry import EXERCISES, LEVELS
from kvlab.learner.store import store


@dataclass
class Progress:
    rows: list[tuple[str, str, str, str, bool]]  # lesson, id, title, level, passed
    predictions: int
    right: int
    checked: int
    where: str

    @property
    def num_passed(self) -> int:
        return sum(r[4] for r in self.rows)

    def __str__(self) -> str:
        lines = [
            f"{self.num_passed} of {len(self.rows)} exercises passed · {self.predictions} predictions locked in"
            + (f" ({self.right} of {self.checked} right)" if self.checked else "")
        ]
        for lesson, eid, title, level, ok in self.rows:
            lines.append(f"  {'✔' if ok else '·'} {_num(lesson):<3}  {eid:<22} {level:<22} {title}")
        lines.append(f"(kept in {self.where})")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{'✔' if ok else ''}</td><td>{html.escape(_num(lesson))}</td><td><code>{html.escape(eid)}</code></td>"
            f"<td>{html.escape(title)}</td><td>{html.escape(level)}</td></tr>"
            for lesson, eid, title, level, ok in self.rows
        )
        head = f"<b>{self.num_passed} of {len(self.rows)} exercises passed</b> · {self.predictions} predictions locked in" + (
            f" ({self.right} of {self.checked} right)" if self.checked else ""
        )
        return (
            f"<div>{head}<table style='font-size:12px'><tr><th>passed</th><th>lesson</th><th>exercise</th>"
            f"<th></th><th>level</th></tr>{body}</table><span style='color:#777;font-size:11px'>kept in "
            f"{html.escape(self.where)}</span></div>"
        )


def _num(lesson: str) -> str:
    """'04b_eviction_and_lru' -> '04b'."""
    return lesson.split("_", 1)[0]


def _where(path: Path) -> str:
    """Where the record is, as the learner would type it (the temporary folder of a CI run is
    not worth printing into a stored notebook)."""
    if "KVLAB_HOME" in os.environ:
        return "$KVLAB_HOME/" + path.name
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def show_progress() -> Progress:
    """Which exercises you have passed (✔), lesson by lesson, and how your predictions went."""
    s = store()
    done = s.passed()
    preds = s.predictions()
    checked = [p for p in preds if p.get("matched") is not None]
    order = {eid: i for i, eid in enumerate(LEVELS)}  # LEVELS lists them in course order
    exs = sorted(EXERCISES.values(), key=lambda e: (e.lesson, order[e.id]))
    rows = [(e.lesson, e.id, e.title, e.level, e.id in done) for e in exs]
    return Progress(rows, len(preds), sum(1 for p in checked if p["matched"]), len(checked), _where(s.path))
