"""Nothing in the course is wider than JupyterLab's output area at 1280 px (OUTPUT_WIDTH).

A wider figure or widget is cut off there: the learner sees two thirds of a picture and no
scroll bar. The saved lessons are what a learner opens first, so their outputs are checked as
saved (``make test`` re-runs them, and ``scripts/run_notebooks.py`` saves them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.utils.notebook_display import OUTPUT_WIDTH

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_PX = re.compile(r"\bwidth:\s*(\d+)px")


def too_wide(nb: dict) -> list[str]:
    """Every saved output of ``nb`` wider than OUTPUT_WIDTH: a plotly figure's layout width,
    or a fixed ``width: Npx`` in HTML."""
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            fig = data.get("application/vnd.plotly.v1+json")
            if fig and (fig.get("layout", {}).get("width") or 0) > OUTPUT_WIDTH:
                out.append(f"cell {i}: a figure {fig['layout']['width']} px wide")
            html = data.get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            out += [f"cell {i}: HTML {w} px wide" for w in _PX.findall(html) if int(w) > OUTPUT_WIDTH]
    return out


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_saved_output_fits_the_output_area(path: Path) -> None:
    assert too_wide(json.loads(path.read_text())) == []


def test_the_scan_finds_a_wide_figure_and_wide_html() -> None:
    nb = {
        "cells": [
            {"outputs": [{"data": {"application/vnd.plotly.v1+json": {"layout": {"width": 860}}}}]},
            {"outputs": [{"data": {"text/html": ["<div style='width: 948px'>", "</div>"]}}]},
            {"outputs": [{"data": {"application/vnd.plotly.v1+json": {"layout": {"width": OUTPUT_WIDTH}}}}]},
        ]
    }
    assert too_wide(nb) == ["cell 0: a figure 860 px wide", "cell 1: HTML 948 px wide"]


def test_the_player_and_its_still_fit() -> None:
    from kvlab import show
    from kvlab.scenarios import shared_prefix

    p = show(shared_prefix())
    assert p.widget.layout.width == "100%" and p.widget.header["width"] + 8 <= OUTPUT_WIDTH  # the page fits it to the area
    assert p.still()["layout"]["width"] <= OUTPUT_WIDTH
