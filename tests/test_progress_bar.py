"""Progress bars in a notebook leave a line of text, not a widget whose model will be gone."""

from __future__ import annotations

import IPython.display
import pytest
from tqdm.notebook import tqdm as notebook_tqdm

from kvlab import Request
from kvlab.engine.llm_engine import build_engine
from kvlab.utils import progress
from kvlab.utils.progress import final_line


def test_final_line_says_how_far_it_got() -> None:
    assert final_line("generate", 2, 2) == "generate: 2/2 done"
    assert final_line("requests", 3, 5) == "requests: stopped at 3/5"
    assert final_line("steps", 37, None) == "steps: 37 done"


class _Handle:
    def __init__(self, log: list) -> None:
        self.log = log

    def update(self, obj, raw=False, **kw) -> None:
        self.log.append(("update", obj, raw))


@pytest.fixture
def in_notebook(monkeypatch):
    """tqdm.auto as a Jupyter kernel picks it, and every display call recorded."""
    log: list = []

    def display(obj, raw=False, display_id=None, **kw):
        log.append(("display", obj, display_id))
        return _Handle(log) if display_id else None

    monkeypatch.setattr(progress, "_notebook_bar_class", lambda: notebook_tqdm)
    monkeypatch.setattr(IPython.display, "display", display)
    return log


def test_a_notebook_bar_is_replaced_by_its_final_line(in_notebook) -> None:
    e = build_engine(num_blocks=16, block_size=4)
    for i in range(3):
        e.add_request(Request(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=2))
    e.run(progress=True)
    (kind, widget, display_id), update = in_notebook
    assert kind == "display" and display_id is True and type(widget).__name__ == "TqdmHBox"
    steps = e.scheduler.step_count
    assert update == ("update", {"text/plain": f"steps: {steps} done"}, True)


def test_an_interrupted_run_leaves_where_it_stopped(in_notebook, monkeypatch) -> None:
    e = build_engine(num_blocks=16, block_size=4)
    reqs = [Request(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=3, arrival_time=float(i)) for i in range(3)]
    calls = {"n": 0}
    real_step = e.step

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(e, "step", step)
    with pytest.raises(KeyboardInterrupt):
        e.run_trace(reqs, progress=True)
    assert in_notebook[-1] == ("update", {"text/plain": "requests: stopped at 0/3"}, True)
