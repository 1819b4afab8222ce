"""``kvlab.export_html``: one self-contained HTML replay (the browser test opens it offline)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("plotly")

import kvlab  # noqa: E402
from kvlab import Request  # noqa: E402
from kvlab.engine.llm_engine import build_engine  # noqa: E402
from kvlab.scenarios import shared_prefix  # noqa: E402
from kvlab.show import show  # noqa: E402
from kvlab.timeline import Timeline  # noqa: E402


def _data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    raw = re.search(r"<script type='application/json' id='kv-data'>(.*?)</script>", text, re.S).group(1)
    return json.loads(raw.replace("<\\/", "</"))


def test_export_holds_every_step_of_every_view_and_nothing_from_the_network(tmp_path) -> None:
    path = kvlab.export_html(shared_prefix(), tmp_path / "story.html")
    text = path.read_text(encoding="utf-8")
    assert "Plotly.react" in text and "plotly.js v" in text.lower() or "plotly" in text[:200000]
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=", text)  # nothing fetched
    d = _data(path)
    assert d["views"] == ["pool", "free", "table", "hash", "timeline", "kernel"]
    assert d["steps"] == list(range(9)) and len(d["frames"]) == 9 and all(len(f) == 6 for f in d["frames"])
    titles = [d["layouts"][d["frames"][k][0][0]]["title"]["text"] for k in range(9)]
    assert all(f"step {k}" in t for k, t in enumerate(titles))  # the pool's title follows the step
    assert "req1 prefix hit" in d["status"][2] and "hit/touch [1, 2, 3]" in d["events"][2]
    # Deduplicated: the timeline's series traces are stored once for all nine steps.
    tl_traces = {tuple(f[4][1]) for f in d["frames"]}
    assert len(tl_traces) == 1
    assert ["req1 prefix hit", 2] in d["named"] and "kvlabReplay.mount" in text  # the "jump to" menu, drawn by the page


def test_export_from_an_engine_a_timeline_or_a_player(tmp_path) -> None:
    e = build_engine(num_blocks=12, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=3))
    e.run()
    d = _data(kvlab.export_html(e, tmp_path / "engine.html", views=("pool", "table")))
    assert d["views"] == ["pool", "table"] and d["steps"] == [0, 1, 2, 3]
    assert _data(kvlab.export_html(Timeline(e.events), tmp_path / "tl.html"))["steps"] == [0, 1, 2, 3]
    p = show(shared_prefix(), views=("pool",), start=4)
    d = _data(kvlab.export_html(p, tmp_path / "player.html"))
    assert d["start"] == d["steps"].index(4) and p.step == 4  # the player is left where it was
    d = _data(kvlab.export_html(shared_prefix(), tmp_path / "few.html", views=("pool",), max_steps=3))
    assert d["steps"][0] == 0 and d["steps"][-1] == 8 and 2 in d["steps"]  # named steps are kept


def test_export_errors_name_the_argument(tmp_path) -> None:
    with pytest.raises(ValueError, match="must end in .html"):
        kvlab.export_html(shared_prefix(), tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvlab.export_html(shared_prefix(), tmp_path / "missing" / "x.html")
    with pytest.raises(TypeError, match="apply to a new Player"):
        kvlab.export_html(show(shared_prefix(), views=("pool",)), tmp_path / "x.html", views=("table",))
    with pytest.raises(ValueError, match="no event log"):
        kvlab.export_html(build_engine(num_blocks=4, block_size=4, event_log=None), tmp_path / "x.html")
