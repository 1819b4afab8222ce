"""Generate ``exercises/`` from ``solutions/``: one source of truth for every exercise.

In a solution notebook, each answer sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` lines. The generated exercise keeps everything else and replaces each
region with a stub that raises ``NotImplementedError`` (at the marker's indentation), so
the notebook still runs top to bottom and every ``check()`` reports "not implemented
yet". Cells tagged ``solution-only`` are dropped; all outputs are cleared.
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here — run the hints cell above if you are stuck")'
ROOT = Path(__file__).resolve().parents[2]


def strip_source(src: str) -> str:
    out: list[str] = []
    inside = False
    for line in src.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError("nested ### BEGIN SOLUTION")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            prev = next((x.strip() for x in reversed(out) if x.strip()), "")
            if prev.startswith("class ") and prev.endswith(":"):
                # A class body: the learner writes the methods; the stub refuses construction.
                out.append(indent + "def __init__(self, *args, **kwargs):")
                out.append(indent + "    " + STUB)
            else:
                out.append(indent + STUB)
        elif stripped.startswith(END):
            if not inside:
                raise ValueError("### END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without END")
    return "\n".join(out)


def exercise_notebook(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = copy.deepcopy(solution)
    cells = []
    for cell in nb.cells:
        if "solution-only" in cell.get("metadata", {}).get("tags", []):
            continue
        if cell.cell_type == "code":
            cell.source = strip_source(cell.source)
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
        cells.append(cell)
    nb.cells = cells
    nb.metadata.pop("widgets", None)
    for md in nb.cells:
        if md.cell_type == "markdown":
            md.source = re.sub(r"\(\.\./solutions/", "(../exercises/", md.source)
    return nb


def render(solution_path: Path) -> str:
    nb = nbformat.read(solution_path, as_version=4)
    return nbformat.writes(exercise_notebook(nb)) + "\n"


def build(root: Path = ROOT, check_only: bool = False) -> list[str]:
    """Write (or, with ``check_only``, compare) every exercise; return the drifted names."""
    drift = []
    (root / "exercises").mkdir(exist_ok=True)
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        target = root / "exercises" / sol.name
        text = render(sol)
        if not target.exists() or target.read_text() != text:
            drift.append(sol.name)
            if not check_only:
                target.write_text(text)
    return drift


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("build", "check"):
        print("usage: python -m kvlab.exercises build | check", file=sys.stderr)
        return 2
    drift = build(check_only=args[0] == "check")
    if args[0] == "check":
        if drift:
            print("exercises/ differs from what solutions/ generates:", ", ".join(drift))
            return 1
        print("exercises/ is up to date")
    else:
        print(f"wrote {len(drift)} exercise notebook(s)" + (f": {', '.join(drift)}" if drift else " (all up to date)"))
    return 0
