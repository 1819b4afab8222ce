"""``CheckResult``: what a checker says -- passed or not, and the first case that failed."""

from __future__ import annotations

import html
import traceback
from dataclasses import dataclass, field
from typing import Any

from kvlab.exercises.sandbox import is_learner_file
from kvlab.utils.notebook_display import OUTPUT_WIDTH


@dataclass
class CheckResult:
    exercise_id: str
    passed: bool
    message: str
    case: str = ""  # name of the failing case
    inputs: str = ""
    expected: str = ""
    got: str = ""
    idea: str = ""  # the idea the failing case is about
    details: str = ""  # e.g. a text picture of the resulting state
    not_implemented: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.passed

    def show(self, **kwargs: Any) -> Any:
        """Replay the engine run the checker made with your code (a ``kvlab.viz.Player``),
        or -- for a kernel exercise -- draw the slots your kernel loaded against the ones
        the block table says it should read (one kernel view per sequence)."""
        reads = self.extra.get("kernel_reads")
        if reads is not None:
            return _kernel_reads_figure(reads, self.extra.get("case", ""), **kwargs)
        log = self.extra.get("log")
        if log is None:
            raise ValueError(f"the {self.exercise_id} check recorded no engine run to show")
        from kvlab.viz import Player

        return Player(log, **kwargs)

    def __str__(self) -> str:
        if self.passed:
            replay = "\n   (call .show() on this result to replay the run with your code in the Player)" if "log" in self.extra else ""
            return f"✔ PASS {self.exercise_id}: {self.message}{replay}"
        if self.not_implemented:
            return f"… TODO {self.exercise_id}: {self.message}"
        lines = [f"✘ FAIL {self.exercise_id}: {self.message}"]
        for label, v in (("case", self.case), ("inputs", self.inputs), ("expected", self.expected), ("got", self.got), ("idea", self.idea)):
            if v:
                lines.append(f"   {label:<8} {v}")
        if self.details:
            lines.append(self.details)
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colour = "#1b7f3b" if self.passed else ("#8a6d00" if self.not_implemented else "#b00020")
        return f'<pre style="border-left:4px solid {colour};padding:6px 10px;white-space:pre-wrap">{html.escape(str(self))}</pre>'


def _kernel_reads_figure(log: Any, case: str, width: int = OUTPUT_WIDTH) -> Any:
    """A still figure: the kernel view of every sequence of the failing case."""
    import plotly.graph_objects as go

    from kvlab.timeline.timeline import Timeline
    from kvlab.viz.kernel import KernelView
    from kvlab.viz.still import compose

    tl = Timeline(log)
    snap = tl.at(tl.last_step)
    batch = tl.attention_batch(tl.last_step)
    figures = []
    for rid in batch.req_ids if batch is not None else []:
        view = KernelView(tl, width=(width - 8) // 2, height=380)
        view.update(snap, rid)
        figures.append(view.still())
    header = (
        f"<b>your kernel's loads</b>{' · case: ' + html.escape(case) if case else ''}<br>"
        "<span style='font-size:10px;color:#555'>• loaded and expected · ✖ loaded, not expected · ○ expected, not loaded</span>"
    )
    fig = compose(figures, columns=2, header=header, header_px=34)
    return go.Figure(fig)


def passed(exercise_id: str, message: str, extra: dict[str, Any] | None = None, **kw: Any) -> CheckResult:
    return CheckResult(exercise_id, True, message, extra=extra or {}, **kw)


def failed(exercise_id: str, message: str, **kw: Any) -> CheckResult:
    return CheckResult(exercise_id, False, message, **kw)


def not_implemented(exercise_id: str) -> CheckResult:
    return CheckResult(
        exercise_id,
        False,
        "not implemented yet — fill in the cell that raises NotImplementedError, run it, then run this check again.",
        not_implemented=True,
    )


class CheckFailed(Exception):
    """Raised from inside the engine by a checker's wrapper around learner code, the moment a
    rule is broken (e.g. a touched block left on the free queue): ``check()`` returns the
    carried result instead of a later, vaguer symptom."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.message)
        self.result = result


class LearnerError(Exception):
    """The learner's code raised; carries a one-line summary instead of a traceback wall."""

    def __init__(self, exc: BaseException, where: str) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        own = [f for f in frames if is_learner_file(f.filename)]  # not "kvlab" in the path: a checkout may be called so
        loc = f" (line {own[-1].lineno}: {own[-1].line})" if own else ""
        super().__init__(f"{type(exc).__name__}: {exc}{loc} — while {where}")
        self.exc = exc


class WrongAnswerKind(Exception):
    """Learner code called from inside the engine returned the wrong kind of value."""
