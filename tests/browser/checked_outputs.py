"""The lessons' claims, checked from the browser's own run of each lesson.

Every lesson runs once in ``make test``: in JupyterLab, as a learner runs it (tests/browser/
test_browser.py). That run must also reproduce what the cells marked ``# NBVAL_CHECK_OUTPUT``
stored -- the check nbval makes when it executes a notebook (``--nbval-lax``), with nbval's
own rules: outputs grouped by stream name or mime type, compared in order, the same keys
skipped (metadata, widget model ids, images). Consecutive stream outputs are merged on both
sides first: where a kernel split a cell's printing into two stream outputs depends on when it
flushed, i.e. on the machine's load, not on the lesson.

One difference needs undoing first. In JupyterLab each "predict, then run" answer is captured
by an ipywidgets ``Output`` inside the answer area (it opens when the prediction is locked),
so the cell's own outputs hold the area -- a style rule, its still and the widget -- and the
answer's outputs live in the widget's state. The notebook is saved with widget state
(``saveState``), and :func:`flatten` puts each answer's outputs back where the area stands,
which is where the plain (nbval) run prints them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARKER = "NBVAL_CHECK_OUTPUT"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# The answer area's still (kvlab/learner/prediction.py, _Reveal) and the style rule that
# display_with_still shows before every still (kvlab/utils/notebook_display.py).
REVEAL_STILL = "The answer appears here when the lesson runs"
STYLE_CLASS = "kvlab-still-next"
# nbval's skip list (nbval.plugin.IPyNbFile.skip_compare, images included without --nbdime).
SKIP = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count", WIDGET_VIEW, "image/png", "image/jpeg"}


def _text(value: Any) -> Any:
    return "".join(value) if isinstance(value, list) else value


def _html(out: dict) -> str:
    return _text(out.get("data", {}).get("text/html", "")) or ""


def _model_outputs(model_id: str, state: dict[str, Any], seen: set[str]) -> list[dict]:
    """The outputs of every ``Output`` widget in the tree under ``model_id``, in order."""
    if model_id in seen or model_id not in state:
        return []
    seen.add(model_id)
    model = state[model_id].get("state", {})
    if state[model_id].get("model_name") == "OutputModel":
        return flatten(model.get("outputs", []), state)
    found: list[dict] = []
    for child in model.get("children", []):
        if isinstance(child, str) and child.startswith("IPY_MODEL_"):
            found += _model_outputs(child.removeprefix("IPY_MODEL_"), state, seen)
    return found


def flatten(outputs: list[dict], state: dict[str, Any]) -> list[dict]:
    """``outputs`` with each answer area replaced by the answer's own outputs."""
    out: list[dict] = []
    i = 0
    while i < len(outputs):
        o = outputs[i]
        if REVEAL_STILL in _html(o):
            if out and STYLE_CLASS in _html(out[-1]) and "<style" in _html(out[-1]):
                out.pop()  # the style rule shown before the still
            nxt = outputs[i + 1] if i + 1 < len(outputs) else {}
            view = nxt.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                raise AssertionError(f"an answer area's still without its widget after it: {nxt!r}"[:500])
            out += _model_outputs(view["model_id"], state, set())
            i += 2
            continue
        out.append(o)
        i += 1
    return _coalesce(out)


def _coalesce(outputs: list[dict]) -> list[dict]:
    """Consecutive stream outputs of one name merged, as a notebook file stores them."""
    merged: list[dict] = []
    for o in outputs:
        if (
            o.get("output_type") == "stream"
            and merged
            and merged[-1].get("output_type") == "stream"
            and merged[-1].get("name") == o.get("name")
        ):
            merged[-1] = {**merged[-1], "text": _text(merged[-1]["text"]) + _text(o["text"])}
        else:
            merged.append(o)
    return merged


def _by_key(outputs: list[dict]) -> dict[str, list[Any]]:
    """nbval's view of a cell's outputs: each stream name and mime type, its values in order."""
    keyed: dict[str, list[Any]] = {}
    for o in outputs:
        if o.get("output_type") == "stream":
            keyed.setdefault(o["name"], []).append(_text(o["text"]))
            continue
        for key, value in o.items():
            if key in SKIP:
                continue
            if key == "data":
                for mime, v in value.items():
                    if mime not in SKIP:
                        keyed.setdefault(mime, []).append(_text(v))
            else:
                keyed.setdefault(key, []).append(_text(value))
    return keyed


def checked_cells(nb: dict) -> list[int]:
    """Indices of the code cells marked ``# NBVAL_CHECK_OUTPUT``."""
    return [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and any(line.strip() == f"# {MARKER}" for line in _text(c["source"]).splitlines())
    ]


def mismatches(stored: dict, ran: dict) -> list[str]:
    """What the run of a lesson (``ran``, saved by JupyterLab with widget state) failed to
    reproduce of ``stored``'s checked cells; [] when every claim holds."""
    if len(stored["cells"]) != len(ran["cells"]):
        return [f"the run has {len(ran['cells'])} cells, the lesson {len(stored['cells'])}"]
    state = ran.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    problems: list[str] = []
    for i in checked_cells(stored):
        want = _by_key(_coalesce(stored["cells"][i].get("outputs", [])))
        got = _by_key(flatten(ran["cells"][i].get("outputs", []), state))
        first = _text(stored["cells"][i]["source"]).splitlines()[:2]
        where = f"cell {i} ({' / '.join(first)[:80]})"
        if set(want) != set(got):
            problems.append(f"{where}: output kinds {sorted(got)} where the lesson has {sorted(want)}")
            continue
        for key in want:
            if len(want[key]) != len(got[key]):
                problems.append(f"{where}: {len(got[key])} {key} outputs where the lesson has {len(want[key])}")
            else:
                for w, g in zip(want[key], got[key]):
                    if w != g:
                        problems.append(f"{where}: {key} differs:\n--- the lesson\n{w}\n--- this run\n{g}")
                        break
    return problems


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())
