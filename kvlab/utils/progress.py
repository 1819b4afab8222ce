"""Progress bars that leave a line of text behind, not a dead widget.

Why: in JupyterLab, ``tqdm.auto`` draws an ipywidgets bar. Once the notebook is saved and
reopened, the bar's model is gone and the output reads "Error displaying widget: model not
found" -- in lesson 00 that was the first thing a learner saw. So in a notebook the bar is
displayed under a display id, and when it closes (done, or stopped by an interrupt or an
error) that output is replaced in place by one plain-text line saying how far it got. Outside
a notebook it is tqdm's usual text bar on stderr.
"""

from __future__ import annotations

from typing import Any


def _notebook_bar_class() -> Any:
    """tqdm's widget bar if ``tqdm.auto`` picks it here (a Jupyter kernel with ipywidgets)."""
    from tqdm.auto import tqdm as auto

    try:
        from tqdm.notebook import tqdm as notebook
    except ImportError:  # pragma: no cover  (tqdm always ships it)
        return None
    return notebook if isinstance(auto, type) and issubclass(auto, notebook) else None


def final_line(desc: str, n: int, total: int | None) -> str:
    """The text a finished (or stopped) bar leaves: ``"generate: 2/2 done"``,
    ``"requests: stopped at 3/5"``, ``"steps: 37 done"``."""
    if total is not None and n < total:
        return f"{desc}: stopped at {n}/{total}"
    return f"{desc}: {n}/{total} done" if total is not None else f"{desc}: {n} done"


class _NotebookBar:
    """A tqdm widget bar whose output becomes :func:`final_line` when it closes."""

    def __init__(self, cls: Any, total: int | None, desc: str) -> None:
        from IPython.display import display

        self._bar = cls(total=total, desc=desc, display=False)
        self._desc, self._total = desc, total
        self._handle = display(self._bar.container, display_id=True)
        self._closed = False

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        n = int(self._bar.n)
        self._bar.close()
        if self._handle is not None:
            self._handle.update({"text/plain": final_line(self._desc, n, self._total)}, raw=True)


def progress_bar(total: int | None, desc: str) -> Any:
    """A bar with ``update(n)`` and ``close()``: tqdm's widget in a notebook (replaced by a
    line of text when it closes), tqdm's text bar elsewhere."""
    cls = _notebook_bar_class()
    if cls is not None:
        return _NotebookBar(cls, total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc)
