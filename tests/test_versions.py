"""The vLLM release kvlab follows is stated once (kvlab/versions.py) and repeated verbatim in
the README and lesson 00."""

from __future__ import annotations

import json
from pathlib import Path

from kvlab import versions

ROOT = Path(__file__).resolve().parents[1]


def test_readme_names_the_release_commit_and_the_whole_table():
    readme = (ROOT / "README.md").read_text()
    assert f"vLLM v{versions.VLLM_RELEASE}" in readme and f"`{versions.VLLM_COMMIT}`" in readme
    assert versions.version_table() in readme


def test_lesson_00_prints_the_same_table():
    nb = json.loads((ROOT / "notebooks" / "00_start_here.ipynb").read_text())
    outputs = "".join(
        "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
    )
    assert versions.VLLM_RELEASE in outputs and versions.VLLM_COMMIT in outputs
    for change in versions.BEHAVIOUR_CHANGES:
        assert change.behaviour in outputs, change.behaviour


def test_every_row_names_a_version_and_a_lesson():
    for c in versions.BEHAVIOUR_CHANGES:
        assert c.changed_in[0].isdigit() and c.lesson[:2].isdigit() and any((ROOT / "notebooks").glob(f"{c.lesson}_*.ipynb"))
