"""HashChainView's picture defects (issue 19, item 5): the ✗, overlapping labels, owners and forks.

Each test reads the drawn figure (trace x/y/text, annotations) of a small deterministic run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from kvlab import Request  # noqa: E402
from kvlab.engine.llm_engine import build_engine  # noqa: E402
from kvlab.scenarios import eviction, preemption  # noqa: E402
from kvlab.timeline import Timeline  # noqa: E402
from kvlab.viz import HashChainView  # noqa: E402
from kvlab.viz.hash_chain import _free_row, _Room  # noqa: E402


@pytest.fixture(scope="module")
def forked() -> Timeline:
    """a and b share two full blocks; c shares only the first: one fork after "ABCD"."""
    e = build_engine(num_blocks=16, block_size=4)
    e.add_request(Request("a", list(b"ABCDEFGHab"), max_tokens=4))
    e.add_request(Request("b", list(b"ABCDEFGHcd"), max_tokens=4))
    e.add_request(Request("c", list(b"ABCDWXYZef"), max_tokens=4))
    e.step()
    e.step()
    return Timeline(e.events)


def test_no_cross_on_a_miss_the_request_has_cached_since() -> None:
    sc = eviction()
    v = HashChainView(sc.timeline(), decode=sc.decode)
    v.update(sc.at("A2 partial hit"))
    f = v.figure
    assert v.last_data["lookup"]["filled"] is True
    assert list(f.data[4].x) == [] and list(f.data[4].text) == []  # no ✗ on A2's green block
    assert list(f.data[1].x) == [-0.45, 0.0] and list(f.data[1].y) == [0.0, 0.0]  # the walk covers the one hit only
    assert v.last_data["summary"] == "last lookup, A2: 1 hit (4 tokens), then the first miss (block 1: A2 computed and cached it since)"


def test_a_miss_still_missing_keeps_its_cross() -> None:
    sc = preemption()
    v = HashChainView(sc.timeline(), decode=sc.decode)
    v.update(sc.at("preempted"))
    g = v.figure.data[4]
    assert (list(g.x), list(g.y), list(g.text)) == ([0.0], [-1.0], ["miss"])
    assert list(v.figure.data[1].x) == [-0.45, 0.0]


def test_a_cross_never_lands_beside_another_chains_block() -> None:
    depth = {"p": 7, "s": 8, "t": 8}
    assert _free_row(1.0, 8, depth, {"p": 1.0, "s": 2.0, "t": 3.0}) == 1.0  # a leaf's chain: inline
    assert _free_row(0.5, 8, depth, {"p": 0.5, "s": 0.0, "t": 1.0}) == 1.5  # a fork: the free half row below


def test_every_chain_is_named_freed_ones_in_grey() -> None:
    sc = eviction()
    v = HashChainView(sc.timeline(), decode=sc.decode)
    v.update(sc.at("A2 partial hit"))
    assert v.last_data["freed_tips"] == [("B", 0, 1.0), ("C", 5, 2.0)]  # released prompts, named by their last holder
    notes = [(a.text, a.x, a.y, a.font.color) for a in v.figure.layout.annotations]
    assert notes == [("◀ A2", 2, 0.0, "#444444"), ("◀ B", 0, 1.0, "#777777"), ("◀ C", 5, 2.0, "#777777")]


def test_a_fork_is_marked_where_shared_prompts_part(forked: Timeline) -> None:
    v = HashChainView(forked, decode=chr)
    v.update(forked.at(forked.last_step))
    assert v.last_data["forks"] == [(0, 0.5, 2)]
    notes = [(a.text, a.x, a.y) for a in v.figure.layout.annotations]
    assert notes == [("◀ c", 1, 1.0), ("◀ a, b", 1, 0.0), ("fork", 0, 0.5)]
    assert "2 prompts share the chain" in v.figure.layout.annotations[2].hovertext
    assert list(v.figure.data[3].text) == ["ABCD", "EFGH", "WXYZ"]
    assert list(v.figure.data[3].textposition) == ["bottom center", "top center", "top center"]


def test_labels_that_do_not_fit_are_hidden_not_overlapped(forked: Timeline) -> None:
    v = HashChainView(forked, decode=chr, height=200)  # rows too close for a label line between them
    v.update(forked.at(forked.last_step))
    assert list(v.figure.data[3].text) == ["", "", ""] and v.figure.data[3].marker.size == 9
    room = _Room(100, 100)
    room.box(50, 50, 7.5, 7.5)  # a square
    assert not room.take(40, 55, 60, 67)  # a label over its lower edge
    assert room.take(40, 58, 60, 70) and not room.take(55, 60, 75, 72)  # below it; then not over that label
