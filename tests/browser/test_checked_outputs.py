"""checked_outputs: a lesson's checked cells compared with JupyterLab's saved run of it.

No browser here: the saved notebooks are built by hand in the shape JupyterLab writes them
(an answer area as three outputs, the answer's outputs in an Output widget's state)."""

from __future__ import annotations

import copy

import checked_outputs as co

STYLE = {
    "output_type": "display_data",
    "metadata": {},
    "data": {
        "text/html": ["<style>.jp-OutputArea-child:has(> .jp-OutputArea-output > .kvlab-still-next) {display:none}</style>"],
        "text/plain": [""],
    },
}
STILL = {
    "output_type": "display_data",
    "metadata": {},
    "data": {
        "text/html": ["<span style='color:#777'>The answer appears here when the lesson runs and a prediction is locked in.</span>"],
        "text/plain": [""],
    },
}


def _view(model_id: str) -> dict:
    return {
        "output_type": "display_data",
        "metadata": {},
        "data": {co.WIDGET_VIEW: {"model_id": model_id, "version_major": 2, "version_minor": 0}, "text/plain": [""]},
    }


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _cell(source: str, outputs: list[dict]) -> dict:
    return {"cell_type": "code", "source": source, "metadata": {}, "outputs": outputs, "execution_count": 1}


def _state(answer_outputs: list[dict]) -> dict:
    """An answer area after the lock: a VBox of (header HTML, Output)."""
    return {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_head", "IPY_MODEL_out"]}},
        "head": {"model_name": "HTMLModel", "state": {"value": "<div>✔ you predicted 3</div>"}},
        "out": {"model_name": "OutputModel", "state": {"outputs": answer_outputs}},
    }


def _pair(stored_answer: list[dict], ran_answer: list[dict], extra: list[dict] | None = None) -> tuple[dict, dict]:
    """A lesson whose checked cell prints through a reveal (plain mode in the stored file),
    and its run in JupyterLab (the same print captured by the answer area's Output)."""
    src = "# NBVAL_CHECK_OUTPUT\nwith guess.reveal():\n    print(n)\n"
    stored = {"cells": [_cell("guess = predict('n?')", []), _cell(src, stored_answer)], "metadata": {}}
    ran = {
        "cells": [
            _cell("guess = predict('n?')", []),
            _cell(src.replace("# NBVAL_CHECK_OUTPUT\n", ""), [STYLE, STILL, _view("box")] + (extra or [])),
        ],
        "metadata": {"widgets": {co.WIDGET_STATE: {"state": _state(ran_answer)}}},
    }
    return stored, ran


def test_an_answer_behind_its_lock_is_compared_with_the_plain_run() -> None:
    stored, ran = _pair([_stream("blocks: 3\n")], [_stream("blocks: 3\n")])
    assert co.checked_cells(stored) == [1]
    assert co.flatten(ran["cells"][1]["outputs"], ran["metadata"]["widgets"][co.WIDGET_STATE]["state"]) == [_stream("blocks: 3\n")]
    assert co.mismatches(stored, ran) == []


def test_a_different_answer_is_reported_with_both_texts() -> None:
    stored, ran = _pair([_stream("blocks: 3\n")], [_stream("blocks: 4\n")])
    (problem,) = co.mismatches(stored, ran)
    assert problem.startswith("cell 1 (") and "stdout differs" in problem
    assert "blocks: 3" in problem and "blocks: 4" in problem


def test_a_missing_answer_or_an_extra_output_kind_is_reported() -> None:
    stored, ran = _pair([_stream("blocks: 3\n")], [])
    assert co.mismatches(stored, ran) == [
        "cell 1 (# NBVAL_CHECK_OUTPUT / with guess.reveal():): output kinds [] where the lesson has ['stdout']"
    ]
    stored, ran = _pair([_stream("blocks: 3\n")], [_stream("blocks: 3\n"), _stream("oops\n", "stderr")])
    assert co.mismatches(stored, ran) == [
        "cell 1 (# NBVAL_CHECK_OUTPUT / with guess.reveal():): output kinds ['stderr', 'stdout'] where the lesson has ['stdout']"
    ]


def test_a_split_print_is_one_print_and_order_of_displays_counts() -> None:
    # Where a kernel flushed between two prints depends on the machine's load: not a difference.
    stored, ran = _pair([_stream("a\n"), _stream("b\n")], [_stream("a\nb\n")])
    assert co.mismatches(stored, ran) == []
    table = {"output_type": "display_data", "metadata": {}, "data": {"text/plain": ["x"], "text/html": ["<b>x</b>"]}}
    other = copy.deepcopy(table)
    other["data"]["text/html"] = ["<b>y</b>"]
    stored, ran = _pair([table], [other])
    (problem,) = co.mismatches(stored, ran)
    assert "text/html differs" in problem


def test_outputs_outside_answer_areas_and_unchecked_cells() -> None:
    stored, ran = _pair([_stream("blocks: 3\n"), _stream("after\n")], [_stream("blocks: 3\n")], extra=[_stream("after\n")])
    assert co.mismatches(stored, ran) == []
    ran["cells"][0]["outputs"] = [_stream("anything\n")]  # not a checked cell
    assert co.mismatches(stored, ran) == []
    ran["cells"].append(_cell("1", []))
    assert co.mismatches(stored, ran) == ["the run has 3 cells, the lesson 2"]


def test_model_ids_and_images_are_not_compared_as_nbval_does_not() -> None:
    img = {"output_type": "display_data", "metadata": {}, "data": {"image/png": "AAAA", "text/plain": ["<Figure>"]}}
    img2 = copy.deepcopy(img)
    img2["data"]["image/png"] = "BBBB"
    stored, ran = _pair([img], [img2])
    assert co.mismatches(stored, ran) == []
