"""A selection is drawn by the page, from patches: each view's figure with nothing selected,
plus, per request, what selecting it changes (``View.selection_patch``). These tests hold the
kernel's picture and the page's to the same pixels: for every step of several runs, every
view and every request, the figure the kernel draws with the request selected equals the
figure drawn with nothing selected with that request's patch applied -- as
``static/replay.js`` applies it (``apply_patch`` below is the same rule in Python)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import numpy as np
import plotly.io as pio
import pytest

from kvlab import show
from kvlab.bench.viz import capstone_run
from kvlab.scenarios import SCENARIOS, get_scenario


def apply_patch(fig: dict[str, Any], patch: dict[str, Any] | None) -> dict[str, Any]:
    """replay.js's rule: a whole other figure, or trace properties and layout paths set."""
    if patch is None:
        return fig
    if "figure" in patch:
        return patch["figure"]
    out = copy.deepcopy(fig)
    for i, props in patch.get("traces", {}).items():
        out["data"][int(i)].update(props)
    for path, value in patch.get("layout", {}).items():
        *parents, prop = path.split(".")
        obj = out["layout"]
        for part in parents:
            obj = obj.setdefault(part, {})
        obj[prop] = value
    return out


def plain(obj: Any) -> Any:
    """Typed arrays decoded, numbers as floats: how the browser sees a figure's values."""
    if isinstance(obj, dict):
        if set(obj) >= {"dtype", "bdata"}:
            arr = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
            return plain(arr.tolist())
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, float)):
        return None if obj != obj else float(obj)  # NaN (a gap) is null, as in JSON
    return obj


def figure(view: Any) -> Any:
    return json.loads(pio.to_json(view.still(), validate=False))


def check_player(p: Any, every: int = 1) -> int:
    """Compare at every ``every``-th step; returns how many (view, step, request) were compared."""
    n = 0
    ids = p._request_ids()
    for step in p.timeline.steps[::every]:
        snap = p.timeline.at(step)
        for name, v in p.views.items():
            v.update(snap, None)
            base = figure(v)
            patches = json.loads(pio.to_json(v.selection_patches(snap), validate=False))
            assert plain(figure(v)) == plain(base), f"{name} @ {step}: selection_patches moved the view"
            for rid in ids:
                v.update(snap, rid)
                got, want = plain(figure(v)), plain(apply_patch(base, patches.get(rid)))
                assert got == want, f"{name} @ step {step}, {rid} selected: the page would draw another picture"
                n += 1
            v.update(snap, None)  # and back: nothing of the last selection stays
            assert plain(figure(v)) == plain(base), f"{name} @ {step}: the selection did not go away"
    return n


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_draws_the_same_selection_in_the_page_and_the_kernel(name: str) -> None:
    assert check_player(show(get_scenario(name))) > 0


def test_the_capstone_run_draws_the_same_selection_in_the_page_and_the_kernel() -> None:
    p = show(capstone_run())
    assert len(p._request_ids()) == 21
    assert check_player(p, every=41) == 6 * 21 * len(p.timeline.steps[::41])


def test_a_patch_sets_the_same_properties_whoever_is_selected() -> None:
    p = show(get_scenario("shared_prefix"))
    snap = p.timeline.at(p.named_steps["req1 prefix hit"])
    for name, v in p.views.items():
        v.update(snap, None)
        none = v.selection_patch(snap, None)
        if none is None:  # the kernel view: another figure per request
            assert name == "kernel"
            continue
        keys = {(i, k) for i, props in none.get("traces", {}).items() for k in props} | set(none.get("layout", {}))
        for rid in p._request_ids():
            p_ = v.selection_patch(snap, rid)
            assert {(i, k) for i, props in p_.get("traces", {}).items() for k in props} | set(p_.get("layout", {})) == keys, name
