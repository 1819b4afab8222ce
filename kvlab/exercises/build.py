"""Generate ``exercises/`` from ``solutions/``: one source of truth for every exercise.

In a solution notebook, each answer sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` lines. The generated exercise keeps everything else and replaces each
region with a stub that raises ``NotImplementedError`` (at the marker's indentation), so
the notebook still runs top to bottom and every ``check()`` reports "not implemented
yet". Cells tagged ``solution-only`` are dropped; all outputs are cleared.

Exercises where the idea is taught: the cells of one exercise (its task, hints, code and
check) carry the tag ``exercise:<id>`` in the solution notebook. Its first markdown cell
gets the exercise's level line (``★★☆ · about 15 min``, from ``registry.LEVELS``), and the
same generated cells -- stubs, never solutions -- are copied into every lesson notebook
that holds a block of cells tagged ``exercise:<id>``: ``build`` replaces each such block by
the current one (a cell whose source did not change keeps its stored output). So a lesson
and ``exercises/`` always show the same exercise, and ``check`` reports either one
drifting from ``solutions/``.
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


TAG = "exercise:"


def exercise_id(cell: nbformat.NotebookNode) -> str | None:
    """The exercise a cell belongs to (its ``exercise:<id>`` tag), or None."""
    for t in cell.get("metadata", {}).get("tags", []):
        if t.startswith(TAG):
            return t[len(TAG) :]
    return None


def level_line(eid: str) -> str:
    from kvlab.exercises.registry import EXERCISES

    if eid not in EXERCISES:
        raise ValueError(f"a cell is tagged {TAG}{eid}, but no exercise {eid!r} is registered")
    return f'*{EXERCISES[eid].level} · `check("{eid}", ...)` below says what differs*'


def exercise_notebook(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = copy.deepcopy(solution)
    cells = []
    seen: set[str] = set()
    for cell in nb.cells:
        if "solution-only" in cell.get("metadata", {}).get("tags", []):
            continue
        if cell.cell_type == "code":
            cell.source = strip_source(cell.source)
            cell.outputs = []
            cell.execution_count = None
        eid = exercise_id(cell)
        if eid and eid not in seen and cell.cell_type == "markdown":
            head, _, rest = cell.source.partition("\n")
            cell.source = f"{head}\n\n{level_line(eid)}\n{rest}" if rest else f"{head}\n\n{level_line(eid)}"
        if eid:
            seen.add(eid)
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


def exercise_blocks(root: Path = ROOT) -> dict[str, list[nbformat.NotebookNode]]:
    """exercise id -> its generated cells (stubs), from every solution notebook."""
    blocks: dict[str, list[nbformat.NotebookNode]] = {}
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        for cell in exercise_notebook(nbformat.read(sol, as_version=4)).cells:
            eid = exercise_id(cell)
            if eid:
                blocks.setdefault(eid, []).append(cell)
    return blocks


def sync_lesson(nb: nbformat.NotebookNode, blocks: dict[str, list[nbformat.NotebookNode]]) -> bool:
    """Replace each run of cells tagged ``exercise:<id>`` by the current block; True if changed."""
    out: list[nbformat.NotebookNode] = []
    cells = nb.cells
    i = changed = 0
    while i < len(cells):
        eid = exercise_id(cells[i])
        if eid is None:
            out.append(cells[i])
            i += 1
            continue
        j = i
        while j < len(cells) and exercise_id(cells[j]) == eid:
            j += 1
        if eid not in blocks:
            raise ValueError(f"a lesson holds cells tagged {TAG}{eid}, but no solution notebook defines that exercise")
        old = cells[i:j]
        for k, new in enumerate(blocks[eid]):
            cell = copy.deepcopy(new)
            prev = old[k] if k < len(old) else None
            if prev is not None and prev.cell_type == cell.cell_type and prev.source == cell.source:
                if cell.cell_type == "code":  # unchanged: keep what the lesson stored
                    cell.outputs, cell.execution_count = prev.get("outputs", []), prev.get("execution_count")
                cell.id = prev.get("id", cell.get("id"))
            else:
                changed = True
            out.append(cell)
        changed = changed or len(old) != len(blocks[eid])
        i = j
    nb.cells = out
    return bool(changed)


def _nb_text(nb: nbformat.NotebookNode) -> str:
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def readme(root: Path = ROOT) -> str:
    """exercises/README.md: the collected set, in course order, with where each one is taught."""
    from kvlab.exercises.registry import EXERCISES, LEVELS

    lessons = {p.stem: p.name for p in (root / "notebooks").glob("*.ipynb")}
    where: dict[str, str] = {}
    for stem, name in sorted(lessons.items()):
        text = (root / "notebooks" / name).read_text(encoding="utf-8")
        for eid in EXERCISES:
            if f'"{TAG}{eid}"' in text:
                where.setdefault(eid, stem)
    rows = []
    for eid in sorted(EXERCISES, key=lambda e: (where.get(e, EXERCISES[e].lesson), list(LEVELS).index(e))):
        ex = EXERCISES[eid]
        lesson = where.get(eid, ex.lesson)
        link = f"[{lesson[:2]}](../notebooks/{lessons[lesson]})" if lesson in lessons else lesson[:2]
        rows.append(f"| {link} | `{eid}` — {ex.title} | {ex.level} | [{ex.notebook}]({ex.notebook}.ipynb) |")
    return "\n".join(
        [
            "# exercises/ — every exercise of the course, collected",
            "",
            "GENERATED from `solutions/` by `python -m kvlab.exercises build` (`make exercises`): never edit by hand.",
            "Each exercise also sits in the lesson that teaches its idea — the same cells, the same `check()` — so",
            "do it there or here. Lesson 00 shows which ones you have passed (kept in `~/.kvlab`, or `$KVLAB_HOME`).",
            "",
            "| lesson | exercise | level | notebook |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )


def build(root: Path = ROOT, check_only: bool = False) -> list[str]:
    """Write (or, with ``check_only``, compare) every exercise notebook and every lesson's
    exercise cells; return the names that drifted."""
    drift = []
    (root / "exercises").mkdir(exist_ok=True)
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        target = root / "exercises" / sol.name
        text = render(sol)
        if not target.exists() or target.read_text() != text:
            drift.append(sol.name)
            if not check_only:
                target.write_text(text)
    target = root / "exercises" / "README.md"
    text = readme(root)
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        drift.append("exercises/README.md")
        if not check_only:
            target.write_text(text, encoding="utf-8")
    blocks = exercise_blocks(root)
    for lesson in sorted((root / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(lesson, as_version=4)
        if sync_lesson(nb, blocks):
            drift.append(f"notebooks/{lesson.name}")
            if not check_only:
                lesson.write_text(_nb_text(nb))
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
        print(f"updated {len(drift)} file(s)" + (f": {', '.join(drift)}" if drift else " (all up to date)"))
    return 0
