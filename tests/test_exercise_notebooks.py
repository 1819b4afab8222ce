"""The exercise notebooks: one source (solutions/), generated exercises/, and what a learner
sees when running each of them top to bottom."""
from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kvlab.exercises import EXERCISES
from kvlab.exercises.build import STUB, build, render, strip_source

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_exercises_are_generated_from_solutions_without_drift():
    assert SOLUTIONS, "no solution notebooks"
    drift = build(ROOT, check_only=True)
    assert drift == [], f"exercises/ drifted from solutions/ (run `make exercises`): {drift}"


def test_every_registered_exercise_appears_in_a_solution_notebook():
    text = "".join(p.read_text() for p in SOLUTIONS)
    missing = [eid for eid in EXERCISES if f'check(\\"{eid}\\"' not in text]
    assert missing == []


def test_strip_source_replaces_regions_at_their_indentation():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    assert strip_source(src) == f"def f(x):\n    {STUB}"
    cls = "class Q:\n    ### BEGIN SOLUTION\n    def a(self): pass\n    ### END SOLUTION"
    assert strip_source(cls) == f"class Q:\n    def __init__(self, *args, **kwargs):\n        {STUB}"
    with pytest.raises(ValueError, match="without END"):
        strip_source("### BEGIN SOLUTION\nx = 1")
    with pytest.raises(ValueError, match="without BEGIN"):
        strip_source("x = 1\n### END SOLUTION")


def test_generated_exercise_contains_no_solution_code():
    for sol in SOLUTIONS:
        ex = render(sol)
        assert "### BEGIN SOLUTION" not in ex and "### END SOLUTION" not in ex
        assert '"outputs": []' in ex or "outputs" not in ex


def _run(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def _check_outputs(nb: nbformat.NotebookNode) -> list[str]:
    texts = []
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("check("):
            texts.append("".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs))
    return texts


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    return [o.get("ename", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]


@pytest.mark.notebook
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_notebook_passes_every_check_quickly(path):
    t = time.perf_counter()
    nb = _run(path)
    assert _errors(nb) == []
    outs = _check_outputs(nb)
    assert outs and all(o.startswith("✔ PASS") for o in outs), outs
    assert time.perf_counter() - t < 120


@pytest.mark.notebook
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_exercise_notebook_runs_with_stubs_and_says_not_implemented(path):
    nb = _run(ROOT / "exercises" / path.name)
    assert _errors(nb) == [], "an exercise notebook must run top to bottom with its stubs"
    outs = _check_outputs(nb)
    assert outs and all("not implemented yet" in o and "Traceback" not in o for o in outs), outs
