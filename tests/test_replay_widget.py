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


def test_a_selection_is_drawn_by_the_page_and_followed_by_the_kernel(player) -> None:
    v = player.widget.header["version"]
    ask(player, {"type": "need", "view": "a", "steps": [2], "version": v})
    (chunk,) = player.sent
    # Each view's frame names its selection map: per request, what selecting it changes.
    pool_marks = chunk["marks"][chunk["frames"][0][0][2]]
    assert sorted(pool_marks) == ["req0", "req1"]
    assert pool_marks["req1"]["traces"]["1"]["customdata"] == [1, 2, 3, 5]  # req1's blocks at step 2
    kernel_marks = chunk["marks"][chunk["frames"][0][5][2]]  # the kernel view draws req0; req1's reads are another figure
    assert list(kernel_marks) == ["req1"] and list(kernel_marks["req1"]) == ["figure"]
    player.widget.selected = "req1"  # what the page sets when the learner picks req1
    assert player.selected_request == "req1" and player.request_dropdown.value == "req1"
    assert player.widget.header["version"] == v and len(player.sent) == 1  # nothing travels again
    player.select(None)  # and the other way: the kernel clears the page's selection
    assert player.widget.selected == "" and player.widget.header["version"] == v
    player.widget.selected = "nobody"  # not a request of this run: ignored
    assert player.selected_request is None


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
    assert h["fill"] is False  # a live run's steps all change as it grows: fetched around the step shown only


def test_a_recorded_run_lets_the_page_fetch_all_its_steps(player) -> None:
    assert player.widget.header["fill"] is True


def test_the_packer_stores_each_part_once() -> None:
    figs = {
        0: [{"layout": {"title": "L"}, "data": [{"x": [1], "text": ["a", "b"]}]}],
        1: [{"layout": {"title": "L"}, "data": [{"x": [1], "text": ["a", "b"]}, {"x": [2], "text": ["b", "c"]}]}],
    }
    pk = FramePacker(lambda s: (figs[s], f"status {s}", ""))
    a, b = pk.pack([0]), pk.pack([1])
    assert a["traces"] == [{"x": [1], "text": {"__s": [0, 1]}}] and a["strings"] == ["a", "b"] and a["frames"] == [[[0, [0], -1]]]
    assert b["traces"] == [{"x": [2], "text": {"__s": [1, 2]}}] and b["strings"] == ["c"] and b["layouts"] == []
    assert b["frames"] == [[[0, [0, 1], -1]]] and (b["t0"], b["l0"], b["s0"]) == (1, 1, 2) and b["status"] == ["status 1"]


def test_the_packer_stores_each_selection_map_once() -> None:
    mark = {"r": {"traces": {"1": {"x": [0], "y": [0]}}, "layout": {"yaxis.ticktext": ["<b>r</b>"]}}}
    other = {"layout": {"title": "other"}, "data": [{"x": [9]}]}
    figs = {
        0: [{"layout": {"title": "L"}, "data": [{"x": [1]}], "selection": mark}],
        1: [{"layout": {"title": "L"}, "data": [{"x": [1]}], "selection": mark}],
        2: [{"layout": {"title": "L"}, "data": [{"x": [1]}], "selection": {"r": {"figure": other}}}],
    }
    c = FramePacker(lambda s: (figs[s], "", "")).pack([0, 1, 2])
    assert [f[0][2] for f in c["frames"]] == [0, 0, 1] and c["m0"] == 0 and len(c["marks"]) == 2
    assert c["marks"][0]["r"]["layout"]["yaxis.ticktext"] == {"__s": [0]} and c["strings"] == ["<b>r</b>"]
    # A whole other figure is stored as figures are: its layout and traces in their tables.
    li, ts = c["marks"][1]["r"]["figure"]
    assert c["layouts"][li] == {"title": "other"} and [c["traces"][t] for t in ts] == [{"x": [9]}]
