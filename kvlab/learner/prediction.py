"""Predict, then reveal: the answer stays hidden until the learner has committed to a guess.

Every "predict, then run" prompt of the course is two cells::

    guess = predict("How many blocks will r2 get?", kind="number")   # a small form: input + "Lock in"

    with guess.reveal():             # runs now; what it prints appears only once guess is locked
        print(len(blocks))
        guess.result = len(blocks)   # optional: then prediction and result are compared

Why: a learner who reads the answer before thinking learns much less than one who guessed
first and was wrong. The stored notebooks show every answer (CI checks them), and even a
working copy with cleared outputs would show the answer the moment "Run all" reaches it;
so the answer cell runs as usual but its output is captured in a hidden area that opens
when the prediction is locked -- "Run all" first, predict later works too.

Plain mode: where no one can type a prediction -- CI (nbval), ``scripts/run_notebooks.py``
executing the stored originals, a script -- ``predict`` prints the question as one line
and ``reveal()`` lets the body print as if it were not there, so the cells marked
``# NBVAL_CHECK_OUTPUT`` still check the lesson's claims. :func:`interactive` decides:
``KVLAB_PREDICT=plain`` / ``=widget`` forces a mode; otherwise a Jupyter kernel whose
current cell was sent by a front end that can answer ``input()`` (JupyterLab, Notebook,
VS Code) is interactive, and one driven by nbclient or nbval (which send
``allow_stdin=False``) is not.

Each locked prediction, and the result it was compared with, is recorded in the learner's
local store (:mod:`kvlab.learner.store`). That record also survives a kernel restart: when a
lesson runs again, a question the learner already locked in (same lesson, same question) comes
back locked, with the earlier prediction and its answer open -- a restart is not a reason to
guess again, nor to be made to. "Predict again" unlocks it for a fresh guess.
"""

from __future__ import annotations

import html
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from kvlab.learner.store import store
from kvlab.utils.checks import check_number
from kvlab.utils.notebook_display import display_with_still

KINDS = ("number", "choice", "text")
_HIDDEN_UNTIL_LOCKED = "<span style='color:#555'>The answer below stays hidden until you lock in a prediction.</span>"
ASKED: list[Prediction] = []  # this kernel's prompts, newest last (tests read their results)
_MODE_ENV = "KVLAB_PREDICT"


def interactive() -> bool:
    """Whether a learner can type a prediction here (see the module docstring)."""
    env = os.environ.get(_MODE_ENV, "").strip().lower()
    if env in ("plain", "off", "0", "no", "false"):
        return False
    if env in ("widget", "on", "1", "yes", "true"):
        return True
    if env:
        raise ValueError(f"{_MODE_ENV}={env!r}: use 'plain' or 'widget' (or leave it unset)")
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - kvlab[lab] installs IPython
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    return bool(kernel is not None and getattr(kernel, "_allow_stdin", False))


def _lesson() -> str:
    """The notebook this kernel serves, when the Jupyter server says (JPY_SESSION_NAME)."""
    name = os.environ.get("JPY_SESSION_NAME", "")
    return os.path.splitext(os.path.basename(name))[0] if name else ""


def parse_number(text: str) -> float:
    """'1,533', '97.3 %', ' 42 ' -> a float; ValueError with a short reason otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"expected text, got {type(text).__name__}")
    t = re.sub(r"[\s,_]", "", text).removesuffix("%")
    if not t:
        raise ValueError("type a number")
    try:
        x = float(t)
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a number") from None
    if not math.isfinite(x):
        raise ValueError("type a finite number")
    return x


def _fmt(x: Any) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _md(text: str) -> str:
    """Escape, keeping `code` spans (the lessons' questions name variables)."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


class Prediction:
    """One question: the form (or a printed line), the locked value, its reveal areas."""

    def __init__(
        self,
        question: str,
        kind: str = "text",
        choices: Sequence[str] | None = None,
        *,
        tol: float = 0.0,
        rel_tol: float = 0.0,
        id: str | None = None,
        show: bool | None = None,
    ) -> None:
        if not isinstance(question, str):
            raise TypeError(f"question must be a non-empty str, got {type(question).__name__} {question!r}")
        if not question.strip():
            raise ValueError(f"question must be a non-empty str, got {question!r}")
        if choices is not None and kind == "text":
            kind = "choice"
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if kind == "choice":
            if isinstance(choices, str) or not isinstance(choices, Sequence) or len(choices) < 2:
                raise ValueError("choices must be a list of at least 2 options for kind='choice'")
            choices = [str(c) for c in choices]
            if len(set(choices)) != len(choices):
                raise ValueError(f"choices must be distinct, got {choices}")
        elif choices is not None:
            raise ValueError(f"choices are only for kind='choice', not kind={kind!r}")
        tol = check_number("tol", tol, 0)  # numpy numbers too; TypeError for a str, ValueError below 0
        rel_tol = check_number("rel_tol", rel_tol, 0)
        if (tol or rel_tol) and kind != "number":
            raise ValueError("tol and rel_tol are for kind='number'")
        if id is not None and not isinstance(id, str):
            raise TypeError(f"id must be None or a non-empty str, got {type(id).__name__} {id!r}")
        if id == "":
            raise ValueError(f"id must be None or a non-empty str, got {id!r}")
        self.question = question.strip()
        self.answer_kind = kind
        self.choices = list(choices) if choices else None
        self.tol, self.rel_tol = float(tol), float(rel_tol)
        self.key = id or self.question
        self.lesson = _lesson()
        self.uid = f"{self.lesson}::{self.key}::{time.time_ns()}"
        self.value: Any = None  # the locked prediction
        self.locked = False
        self.locked_at = ""
        self.result: Any = None  # set inside ``with p.reveal():`` to compare
        self._reveals: list[_Reveal] = []
        self._interactive = interactive() if show is None else show
        self.restored = False  # locked from the learner's record (a kernel restart), not in this run
        ASKED.append(self)
        del ASKED[:-200]
        self._widgets: dict[str, Any] = {}
        if self._interactive:
            self._restore()
            # With a still: a lesson saved with its predictions shows the question, not
            # "Error displaying widget", once the form's model is gone.
            q = f"✎ Predict: {self.question}"
            display_with_still(
                self._form(),
                {
                    "text/html": f"<div><b>✎ Predict:</b> {_md(self.question)}<br><span style='color:#777'>(run the lesson to answer here)</span></div>",
                    "text/plain": q,
                },
            )
        else:
            line = f"✎ Predict: {self.question}"
            if self.choices:
                line += "  [" + " / ".join(self.choices) + "]"
            print(line)

    # -- locking ------------------------------------------------------------------------------
    def validate(self, value: Any) -> Any:
        """The prediction as it will be stored; ValueError if it cannot be one."""
        if self.answer_kind == "number":
            if isinstance(value, bool):
                raise ValueError("a number, not True/False")
            if isinstance(value, str):
                return parse_number(value)
            try:
                x = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"a number, not {type(value).__name__}") from None
            if not math.isfinite(x):
                raise ValueError("type a finite number")
            return x
        if self.answer_kind == "choice":
            assert self.choices is not None  # kind "choice" always has them (checked in __init__)
            if value not in self.choices:
                raise ValueError(f"choose one of {self.choices}")
            return value
        if not isinstance(value, str) or not value.strip():
            raise ValueError("write your prediction first")
        return value.strip()

    def lock(self, value: Any) -> None:
        """Commit to ``value`` (the form's button calls this). Opens every reveal area."""
        if self.locked:
            raise RuntimeError(f'already locked in: {_fmt(self.value)} (press "Predict again" to start over)')
        self.value = self.validate(value)
        self.locked = True
        self.locked_at = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._record()
        self._lock_form()
        for r in self._reveals:
            r.open()

    def unlock(self) -> None:
        """Start over: the form opens for a new prediction and the answers hide again until it
        is locked (the earlier prediction stays in the record; the new one is added)."""
        if not self.locked:
            return
        self.value, self.locked, self.restored = None, False, False
        self.uid = f"{self.lesson}::{self.key}::{time.time_ns()}"
        for r in self._reveals:
            r.close()
        if self._widgets:
            f, b, s, again = (self._widgets[k] for k in ("field", "button", "status", "again"))
            f.disabled, again.layout.display = False, "none"
            b.description, b.button_style, b.icon = "Lock in", "primary", "lock"
            s.value = _HIDDEN_UNTIL_LOCKED
            self._validate_field()

    def _restore(self) -> None:
        """Come back locked if the learner's record already holds this question's lock (the
        newest one), e.g. after a kernel restart. Only with a known lesson: the same question
        text in two lessons stays two questions. A record that no longer fits the question
        (a choice the lesson no longer offers) is ignored."""
        if not self.lesson:
            return
        try:
            records = store().predictions()
        except Exception:  # noqa: BLE001 - the record is best effort; the form still works
            return
        for rec in reversed(records):
            if rec.get("lesson") == self.lesson and rec.get("key") == self.key and rec.get("kind") == self.answer_kind:
                try:
                    self.value = self.validate(rec.get("prediction"))
                except (ValueError, TypeError):
                    return
                self.locked, self.restored, self.uid = True, True, str(rec["uid"])
                self.locked_at = str(rec.get("locked_at") or "")
                return

    def matched(self) -> bool | None:
        """Whether the locked prediction matches ``result`` (None: nothing to compare)."""
        if not self.locked or self.result is None or self.answer_kind == "text":
            return None
        if self.answer_kind == "choice":
            return self.value == str(self.result)
        try:
            r = float(self.result)
        except (TypeError, ValueError):
            return None
        return abs(self.value - r) <= max(self.tol, self.rel_tol * abs(r))

    def summary(self) -> str:
        """One line: prediction beside result (plain text)."""
        if not self.locked:
            return "no prediction locked in yet"
        s = f"your prediction: {_fmt(self.value)}"
        if self.result is not None:
            s += f" · result: {_fmt(self.result)}"
        m = self.matched()
        if m is True:
            s += " · ✔ right"
        elif m is False:
            s += " · ✘ not this time" + (f" (off by {_fmt(abs(self.value - float(self.result)))})" if self.answer_kind == "number" else "")
        return s

    # -- revealing ----------------------------------------------------------------------------
    def reveal(self) -> _Reveal:
        """``with p.reveal(): ...`` -- the body runs now; its output waits for the lock."""
        r = _Reveal(self)
        self._reveals.append(r)
        return r

    # -- internals ----------------------------------------------------------------------------
    def _check_result(self) -> None:
        """A lesson's ``result`` must be comparable with a prediction of this kind: a number
        for ``"number"``, one of the choices for ``"choice"`` -- a lesson author's mistake
        fails loudly (in CI too), not as a silent "✘" for every learner."""
        r = self.result
        if r is None or self.answer_kind == "text":
            return
        if self.answer_kind == "choice":
            assert self.choices is not None  # kind "choice" always has them (checked in __init__)
            if str(r) not in self.choices:
                raise ValueError(f"result {r!r} is not one of the choices {self.choices} (question: {self.question!r})")
        if self.answer_kind == "number":
            try:
                ok = math.isfinite(float(r)) and not isinstance(r, bool)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"result {r!r} is not a number (question: {self.question!r})")

    def _record(self) -> None:
        store().record_prediction(
            {
                "uid": self.uid,
                "lesson": self.lesson,
                "key": self.key,
                "question": self.question,
                "kind": self.answer_kind,
                "prediction": self.value,
                "locked_at": self.locked_at,
                **({"result": _jsonable(self.result), "matched": self.matched()} if self.result is not None else {}),
            }
        )

    def _form(self) -> Any:
        import ipywidgets as w

        title = w.HTML(f"<b>✎ Predict:</b> {_md(self.question)}")
        if self.answer_kind == "number":
            field = w.Text(placeholder="a number", layout=w.Layout(width="160px"))
        elif self.answer_kind == "choice":
            field = w.RadioButtons(options=self.choices, value=None, layout=w.Layout(width="auto"))
        else:
            field = w.Textarea(placeholder="your prediction, in a few words", rows=2, layout=w.Layout(width="100%", max_width="560px"))
        button = w.Button(
            description="Lock in",
            button_style="primary",
            disabled=True,
            icon="lock",
            tooltip="commit to your prediction; the answer below opens",
        )
        status = w.HTML(_HIDDEN_UNTIL_LOCKED)

        again = w.Button(
            description="Predict again",
            icon="undo",
            layout=w.Layout(display="none"),
            tooltip="unlock: the answer hides again until you lock in a new prediction",
        )

        def clicked(_: Any = None) -> None:
            try:
                self.lock(field.value)
            except (ValueError, TypeError, RuntimeError) as e:
                status.value = f"<span style='color:#a00'>{html.escape(str(e))}</span>"

        field.observe(lambda _: self._validate_field(), names="value")
        button.on_click(clicked)
        again.on_click(lambda _: self.unlock())
        self._widgets = {"field": field, "button": button, "status": status, "again": again}
        if self.locked:  # restored from the record
            field.value = self.value if self.answer_kind == "choice" else _fmt(self.value)
            self._lock_form()
        row = w.HBox([field, button, again], layout=w.Layout(align_items="center", flex_flow="row wrap"))
        return w.VBox(
            [title, row, status], layout=w.Layout(border="1px solid #c8c8c8", padding="6px 10px", margin="4px 0", max_width="100%")
        )

    def _validate_field(self) -> None:
        """Enable "Lock in" only for a value that can be locked; say why a number is not one."""
        field, button, status = self._widgets["field"], self._widgets["button"], self._widgets["status"]
        if self.locked:
            return
        try:
            self.validate(field.value)
        except (ValueError, TypeError) as e:
            button.disabled = True
            if self.answer_kind == "number" and str(field.value or "").strip():
                status.value = f"<span style='color:#a00'>{html.escape(str(e))}</span>"
            return
        button.disabled = False
        status.value = "<span style='color:#555'>Lock it in when you are sure.</span>"

    def _lock_form(self) -> None:
        if not self._widgets:
            return
        f, b, s = self._widgets["field"], self._widgets["button"], self._widgets["status"]
        f.disabled = True
        b.disabled = True
        b.description = "Locked"
        b.button_style = "success"
        self._widgets["again"].layout.display = None
        when = ""
        if self.restored:
            when = (f" on {html.escape(self.locked_at.replace('T', ' '))}" if self.locked_at else "") + " (from your record)"
        s.value = f"<span style='color:#1b5e20'>Locked in{when}: <b>{html.escape(_fmt(self.value))}</b>. The answer is open below.</span>"


def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in x):
        return list(x)
    try:
        return float(x)  # numpy scalars
    except (TypeError, ValueError):
        return repr(x)


class _Reveal:
    """The hidden answer area of one ``with p.reveal():`` block."""

    def __init__(self, p: Prediction) -> None:
        self.p = p
        self.done = False
        self._box: Any = None
        self._out: Any = None
        self._header: Any = None
        self._waiting: Any = None

    def __enter__(self) -> _Reveal:
        if not self.p._interactive:
            return self
        import ipywidgets as w

        self._out = w.Output()
        self._header = w.HTML()
        self._waiting = w.HTML(
            "<span style='color:#777'><i class='fa fa-lock'></i> The answer is ready: lock in your prediction above to see it.</span>"
        )
        self._box = w.VBox([self._waiting])
        display_with_still(
            self._box,
            {
                "text/html": "<span style='color:#777'>The answer appears here when the lesson runs and a prediction is locked in.</span>",
                "text/plain": "",
            },
        )
        self._out.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._out is not None:
            self._out.__exit__(exc_type, exc, tb)
        self.done = True
        if exc_type is None:
            self.p._check_result()
        if self.p.locked or (exc_type is not None and self._box is not None):
            self.open()
        if self.p.locked and self.p.result is not None:
            self.p._record()  # the result arrived after the lock

    @property
    def visible(self) -> bool:
        return self._box is None or self._box.children[-1] is self._out

    def open(self) -> None:
        if self._box is None or not self.done:
            return  # plain mode, or the body has not finished: __exit__ opens it
        colours: dict[bool | None, str] = {True: "#1b5e20", False: "#b00020"}
        colour = colours.get(self.p.matched(), "#333")
        text = html.escape(self.p.summary()) if self.p.locked else "no prediction locked in"
        self._header.value = f"<div style='border-left:4px solid {colour};padding:2px 8px;color:{colour}'>{text}</div>"
        self._box.children = (self._header, self._out)

    def close(self) -> None:
        """Hide the answer again (the prediction was unlocked)."""
        if self._box is not None and self.done:
            self._box.children = (self._waiting,)


def predict(
    question: str,
    kind: str = "text",
    choices: Sequence[str] | None = None,
    *,
    tol: float = 0.0,
    rel_tol: float = 0.0,
    id: str | None = None,
) -> Prediction:
    """Ask for a prediction before the next cell's answer is shown (see the module docstring).

    ``kind``: ``"number"`` (compared with ``result`` within ``tol`` absolute or ``rel_tol``
    relative), ``"choice"`` (one of ``choices``; giving ``choices`` implies it) or ``"text"``
    (a sentence, shown beside the result). ``id``: a stable name for the record (default:
    the question).
    """
    return Prediction(question, kind, choices, tol=tol, rel_tol=rel_tol, id=id)
