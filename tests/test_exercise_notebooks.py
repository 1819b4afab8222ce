"""The exercise notebooks: one source (solutions/), generated exercises/, and what a learner
sees when running each of them top to bottom."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from kvlab.exercises import EXERCISES
from kvlab.exercises.build import STUB, build, render, strip_source
from notebook_run import execute

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


def test_each_lesson_exercise_is_the_generated_one():
    """A lesson's exercise cells are copied from solutions/ (stubs only) by `make exercises`;
    the drift test above fails when they differ. Here: the copy mechanism itself."""
    from kvlab.exercises.build import exercise_blocks, exercise_id, sync_lesson

    from kvlab.exercises.registry import LEVELS

    blocks = exercise_blocks(ROOT)
    assert set(blocks) == set(EXERCISES), "every exercise is a tagged block in a solution notebook"
    assert set(LEVELS) == set(EXERCISES), "every exercise has a difficulty and a time (registry.LEVELS)"
    first = blocks["free_order"][0]
    assert first.cell_type == "markdown" and "★☆☆ · about 5 min" in first.source
    assert not any("### BEGIN SOLUTION" in c.source for b in blocks.values() for c in b)
    lesson = nbformat.v4.new_notebook()
    stale = nbformat.v4.new_code_cell("old stub")
    stale.metadata["tags"] = ["exercise:free_order"]
    lesson.cells = [nbformat.v4.new_markdown_cell("# a lesson"), stale, nbformat.v4.new_code_cell("after")]
    assert sync_lesson(lesson, blocks)
    assert [exercise_id(c) for c in lesson.cells] == [None] + ["exercise:free_order"[9:]] * len(blocks["free_order"]) + [None]
    assert [c.source for c in lesson.cells[1:-1]] == [c.source for c in blocks["free_order"]]
    lesson.cells[3].outputs = [nbformat.v4.new_output("stream", text="kept")]
    assert not sync_lesson(lesson, blocks) and lesson.cells[3].outputs[0].text == "kept"  # unchanged source keeps its output
    orphan = nbformat.v4.new_markdown_cell("x")
    orphan.metadata["tags"] = ["exercise:nope"]
    lesson.cells.append(orphan)
    with pytest.raises(ValueError, match="no solution notebook defines"):
        sync_lesson(lesson, blocks)


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
    execute(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
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
def test_solution_notebook_passes_every_check(path):
    nb = _run(path)
    assert _errors(nb) == []
    outs = _check_outputs(nb)
    assert outs and all(o.startswith("✔ PASS") for o in outs), outs


@pytest.mark.notebook
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_exercise_notebook_runs_with_stubs_and_says_not_implemented(path):
    nb = _run(ROOT / "exercises" / path.name)
    assert _errors(nb) == [], "an exercise notebook must run top to bottom with its stubs"
    outs = _check_outputs(nb)
    assert outs and all("not implemented yet" in o and "Traceback" not in o for o in outs), outs


def test_every_exercise_sits_in_its_lesson_once_and_the_course_map_says_so():
    """Exercises where the idea is taught: each registered exercise is placed (its tagged cells)
    in exactly one lesson, the one its registry entry names, and notebooks/README.md's course
    map lists it in that lesson's row."""
    import re

    placed: dict[str, list[str]] = {}
    for lesson in sorted((ROOT / "notebooks").glob("*.ipynb")):
        tags = {t for c in nbformat.read(lesson, as_version=4).cells for t in c.metadata.get("tags", [])}
        for eid in EXERCISES:
            if f"exercise:{eid}" in tags:
                placed.setdefault(eid, []).append(lesson.stem)
    assert {eid: len(v) for eid, v in placed.items() if len(v) != 1} == {}
    assert sorted(set(EXERCISES) - set(placed)) == []
    assert {eid: v[0] for eid, v in placed.items() if v[0] != EXERCISES[eid].lesson} == {}
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\d\d[a-z]?) \|.*$", (ROOT / "notebooks" / "README.md").read_text(), re.M)}
    for eid, (lesson,) in placed.items():
        assert f"`{eid}`" in rows[lesson.split("_")[0]], (eid, lesson)
