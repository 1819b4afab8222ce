"""The course text a learner reads: no references to material the learner does not have, and
no number in the prose that contradicts the checked output it talks about.

1. Notebooks (markdown and code), the exercise folders, the lesson READMEs and the strings of
   the learner-facing packages (lessons, exercises and their checkers, the prediction widget,
   the views, the benchmarks' printouts) must not cite the course's private sources (numbered
   seed documents, a facts file, a design document), the project's own issue tracker, or kvlab's
   own history ("kvlab before it followed ...").
2. A markdown cell that explains the output of the ``# NBVAL_CHECK_OUTPUT`` cell above it (no
   other markdown in between) must quote what that cell prints: a count with a thousands
   separator or a percentage of the same shape as a printed one (same digit count, or same
   decimals for a percentage) and within 10 % of it, but equal to no printed number, is a stale
   copy of the output. Sentences that name another source (the paper, a PR, an issue, a blog)
   quote that source, not the output, and are left out.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
PACKAGES = ("kvlab/lessons", "kvlab/exercises", "kvlab/learner", "kvlab/viz", "kvlab/bench")

FORBIDDEN = [
    (re.compile(r"\bseeds? \d{3}\b", re.I), "a numbered seed document"),
    (re.compile(r"\b(?:a|the|one|this) seed (?:says|describes|claims|puts|tells|writes)\b", re.I), "a seed document"),
    (re.compile(r"shared/seeds|\.\./shared/"), "the course's private shared folder"),
    (re.compile(r"\bFACTS(?:\.md)?\b"), "the private facts file"),
    (re.compile(r"\bDESIGN(?:\.md)?\b"), "the private design document"),
    (re.compile(r"\bissues? \d+\b", re.I), "the project's own issue tracker (vLLM's issues are cited as '#NNNN')"),
    (re.compile(r"\bkvlab (?:before|until) it followed\b|\bkvlab before\b|\bkvlab (?:used to|previously)\b", re.I), "kvlab's own history"),
    (re.compile(r"\b(?:earlier|older|previous|old|former) (?:versions? of )?kvlab\b", re.I), "kvlab's own history"),
    (re.compile(r"\bproduct card\b", re.I), "the project's private brief"),
]


def _source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _notebooks() -> list[Path]:
    return sorted(p for d in NOTEBOOK_DIRS if (ROOT / d).is_dir() for p in (ROOT / d).glob("*.ipynb"))


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def forbidden_references(text: str) -> list[str]:
    """What ``text`` cites that a learner does not have: one line per hit."""
    hits = []
    for pattern, what in FORBIDDEN:
        for m in pattern.finditer(text):
            hits.append(f"{m.group(0)!r} ({what})")
    return hits


def notebook_references(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for i, cell in enumerate(nb["cells"]):
        for hit in forbidden_references(_source(cell)):
            out.append(f"{_where(path)} cell {i} ({cell['cell_type']}): {hit}")
    return out


def module_references(path: Path) -> list[str]:
    """Every string constant of a module (docstrings, messages, widget text, f-string parts)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for hit in forbidden_references(node.value):
                out.append(f"{_where(path)} line {node.lineno}: {hit}")
    # comments a learner reads beside the code
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if "#" in line:
            for hit in forbidden_references(line[line.index("#") :]):
                out.append(f"{_where(path)} line {n} (comment): {hit}")
    return out


@pytest.mark.parametrize("path", _notebooks(), ids=_where)
def test_notebooks_cite_nothing_the_learner_lacks(path):
    hits = notebook_references(path)
    assert not hits, "learner-facing text cites material the learner does not have:\n" + "\n".join(hits)


def test_readmes_and_packages_cite_nothing_the_learner_lacks():
    hits = []
    for d in NOTEBOOK_DIRS:
        readme = ROOT / d / "README.md"
        if readme.is_file():
            for n, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), 1):
                hits += [f"{_where(readme)} line {n}: {h}" for h in forbidden_references(line)]
    for pkg in PACKAGES:
        for py in sorted((ROOT / pkg).rglob("*.py")):
            hits += module_references(py)
    assert not hits, "learner-facing text cites material the learner does not have:\n" + "\n".join(hits)


def test_the_scan_finds_each_kind_of_reference():
    planted = (
        "As seed 001 says",
        "A seed says so",
        "(FACTS.md)",
        "see DESIGN.md",
        "issue 23 item 4",
        "kvlab before it followed vLLM 0.33",
        "earlier kvlab counted",
        "../../shared/FACTS.md",
    )
    for text in planted:
        assert forbidden_references(text), text
    fine = (
        "vLLM issue #53395",
        "Issue #25780 reported it",
        "vLLM PR #57336",
        "TinyLlama(seed=0)",
        "the hash of a fixed seed",
        "seeded traces",
        "facts about the step",
        "the design document's example",
    )
    for text in fine:
        assert not forbidden_references(text), text


# --- numbers quoted beside checked outputs ---------------------------------------------------
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_PERCENT = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*%")
_NUMBER = re.compile(r"(?<![\d.])\d[\d,]*(?:\.\d+)?")
CHECK = "# NBVAL_CHECK_OUTPUT"


def _output_text(cell: dict) -> str:
    parts = []
    for o in cell.get("outputs", []):
        parts.append("".join(o.get("text", "")))
        parts.append("".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _printed_numbers(text: str) -> tuple[set[int], set[str]]:
    """Integers printed (``5,376``, ``5376``, ``5376.0``) and percentages (``66.7%``, ``66.7 %``)."""
    ints = set()
    for m in _NUMBER.finditer(text):
        raw = m.group(0).rstrip(",").replace(",", "")
        if re.fullmatch(r"\d+(?:\.0+)?", raw):
            ints.add(int(float(raw)))
    pcts = {m.group(1) for m in _PERCENT.finditer(text)}
    return ints, pcts


def _close(a: float, b: float) -> bool:
    return a != b and abs(a - b) <= 0.1 * max(abs(a), abs(b))


def stale_numbers(markdown: str, output: str) -> list[str]:
    """Numbers quoted in ``markdown`` that look like a stale copy of one printed in ``output``."""
    ints, pcts = _printed_numbers(output)
    out = []
    for m in _THOUSANDS.finditer(markdown):
        q = int(m.group(0).replace(",", ""))
        if q in ints:
            continue
        near = sorted(p for p in ints if len(str(p)) == len(str(q)) and _close(p, q))
        if near:
            out.append(f"quotes {m.group(0)}, the output prints {near[0]:,}")
    for m in _PERCENT.finditer(markdown):
        q = m.group(1)
        if q in pcts:
            continue
        decimals = len(q.partition(".")[2])
        near = sorted(p for p in pcts if len(p.partition(".")[2]) == decimals and _close(float(p), float(q)))
        if near:
            out.append(f"quotes {q} %, the output prints {near[0]} %")
    return out


_OTHER_SOURCE = re.compile(r"\bpaper\b|\bPR #|\bissue #|\bKwon\b|\bblog\b|\breported\b|\bmeasured\b", re.I)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(*`\"])|\n\s*\n|\n\s*(?:[*-]|\d+\.)\s")


def _own_sentences(markdown: str) -> str:
    """The sentences of ``markdown`` that name no other source than the output."""
    return "\n".join(s for s in _SENTENCE_END.split(markdown) if not _OTHER_SOURCE.search(s))


def _checked_cell_above(cells: list[dict], i: int) -> int | None:
    """The checked code cell whose output markdown cell ``i`` explains: the nearest one above,
    with only code cells (the reveal's pictures, say) in between."""
    j = i - 1
    while j >= 0 and cells[j]["cell_type"] == "code":
        if _source(cells[j]).lstrip().startswith(CHECK):
            return j
        j -= 1
    return None


def quoted_number_mismatches(nb: dict, name: str) -> list[str]:
    cells = nb["cells"]
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        j = _checked_cell_above(cells, i)
        if j is None:
            continue
        for problem in stale_numbers(_own_sentences(_source(cell)), _output_text(cells[j])):
            out.append(f"{name} cell {i} (markdown) explaining checked cell {j}: {problem}")
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=_where)
def test_prose_quotes_the_checked_output(path):
    problems = quoted_number_mismatches(json.loads(path.read_text(encoding="utf-8")), _where(path))
    assert not problems, "the prose and the checked output disagree:\n" + "\n".join(problems)


def test_a_stale_quote_is_caught():
    """Lesson 08a once quoted its Prometheus counters from an older run."""
    output = (
        'vllm:prefix_cache_queries_total{model_name="kvlab-tiny"} 7533.0\n'
        'vllm:prefix_cache_hits_total{model_name="kvlab-tiny"} 5376.0\n'
        "vllm:kv_cache_usage_perc = 0.667  ->  66.7%\n"
    )
    stale = "The counters say that 5,632 of the 7,887 prompt tokens looked up were hits; usage 66.9 %."
    assert len(stale_numbers(stale, output)) == 3
    assert stale_numbers("The counters say that 5,376 of the 7,533 tokens were hits; usage 66.7 %.", output) == []
    # a quoted figure from elsewhere (the paper, another run) far from every printed one is not a copy
    assert stale_numbers("The paper: 20.4 % and 1,024 tokens.", output) == []
