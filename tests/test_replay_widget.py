"""The Player's page side, driven as the browser drives it: the messages it sends the kernel
(``need``, ``select``, ``run``, ``plotly``, a step taken in the page) and what comes back."""

from __future__ import annotations

import pytest

from kvlab import Request, show
from kvlab.engine.llm_engine import build_engine
from kvlab.scenarios import shared_prefix
from kvlab.viz.frames import FramePacker


@pytest.fixture
def player():
    p = show(shared_prefix(), start=0)
    p.sent = []
    p.widget.send = lambda content, buffers=None: p.sent.append(content)
    return p


def ask(p, msg):
    p.widget._on_msg(p.widget, msg, [])


def test_the_page_gets_the_step_it_shows_first_then_its_window(player) -> None:
    v = player.widget.header["version"]
    ask(player, {"type": "need", "view": "a", "steps": [3, 4, 2, 99, "x"], "version": v})
    first, rest = player.sent
    assert (first["type"], first["view"], first["version"], first["steps"]) == ("frames", "a", v, [3])
    assert rest["steps"] == [4, 2]  # unknown steps are dropped
    # Tables grow in order: the second chunk's entries start where the first one's ended.
    assert (first["t0"], first["l0"], first["s0"]) == (0, 0, 0)
    assert (rest["t0"], rest["l0"], rest["s0"]) == (len(first["traces"]), len(first["layouts"]), len(first["strings"]))
    layouts = first["layouts"] + rest["layouts"]
    assert layouts[first["frames"][0][0][0]]["title"]["text"].startswith("Block pool · step 3")
    assert "req1 prefix hit" in rest["status"][1] and len(first["frames"][0]) == 6
    # Packing moved the views, not the player: they show its step again afterwards.
    assert player.step == 0 and "step 0" in player.views["pool"].figure.layout.title.text


def test_a_stale_or_foreign_message_changes_nothing(player) -> None:
    ask(player, {"type": "need", "view": "a", "steps": [1], "version": 99})
    ask(player, {"type": "nope"})
    ask(player, "not a dict")
    assert player.sent == [] and player.step == 0


def test_a_step_taken_in_the_page_moves_the_kernels_player(player) -> None:
    player.widget.step = 4  # what the page's Step/slider/jump sets
    assert player.step == 4 and player.slider.value == 4 and "step 4" in player.views["pool"].figure.layout.title.text
    player.widget.step = 42  # out of range: ignored
    assert player.step == 4
    player.go_to(6)  # and the other way: the kernel moves the page
    assert player.widget.step == 6


def test_a_selection_starts_a_new_version(player) -> None:
    v = player.widget.header["version"]
    ask(player, {"type": "select", "request": "req1"})
    h = player.widget.header
    assert player.selected_request == "req1" and h["selected"] == "req1" and h["version"] == v + 1
    ask(player, {"type": "need", "view": "a", "steps": [2], "version": v})  # asked before the change
    assert player.sent == []
    ask(player, {"type": "select", "request": None})
    assert player.selected_request is None and player.widget.header["version"] == v + 2


def test_plotly_travels_once_as_a_message(player) -> None:
    ask(player, {"type": "plotly"})
    (msg,) = player.sent
    assert msg["type"] == "plotly" and "plotly.js" in msg["source"][:200] and len(msg["source"]) > 1_000_000


def test_run_step_in_the_page_runs_the_engine_and_grows_the_steps() -> None:
    e = build_engine(num_blocks=12, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=3))
    p = show(e)
    v, steps = p.widget.header["version"], p.widget.header["steps"]
    p.widget._on_msg(p.widget, {"type": "run"}, [])
    h = p.widget.header
    assert h["steps"] == steps + [steps[-1] + 1] and h["version"] > v and p.step == steps[-1] + 1 == p.widget.step
    assert h["can_run"] is True and h["requests"] == ["a"]


def test_the_packer_stores_each_part_once() -> None:
    figs = {
        0: [{"layout": {"title": "L"}, "data": [{"x": [1], "text": ["a", "b"]}]}],
        1: [{"layout": {"title": "L"}, "data": [{"x": [1], "text": ["a", "b"]}, {"x": [2], "text": ["b", "c"]}]}],
    }
    pk = FramePacker(lambda s: (figs[s], f"status {s}", ""))
    a, b = pk.pack([0]), pk.pack([1])
    assert a["traces"] == [{"x": [1], "text": {"__s": [0, 1]}}] and a["strings"] == ["a", "b"] and a["frames"] == [[[0, [0]]]]
    assert b["traces"] == [{"x": [2], "text": {"__s": [1, 2]}}] and b["strings"] == ["c"] and b["layouts"] == []
    assert b["frames"] == [[[0, [0, 1]]]] and (b["t0"], b["l0"], b["s0"]) == (1, 1, 2) and b["status"] == ["status 1"]
