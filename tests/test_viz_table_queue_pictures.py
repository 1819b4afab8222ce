"""The block tables' and the free queue's pictures fit what they draw (issue 19, item 5).

Checked as figure data from small deterministic runs: the block tables' figure is as tall
as its rows (no band of empty rows above the legend) and numbers no column when no cell is
drawn (a lone "0" over nothing); the free queue names its two ends right under its last row
of blocks, in data coordinates, so the labels follow the rows in the view and in the still.
"""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from kvlab import Request  # noqa: E402
from kvlab.engine.llm_engine import build_engine  # noqa: E402
from kvlab.scenarios import preemption  # noqa: E402
from kvlab.show import show  # noqa: E402
from kvlab.timeline import Timeline  # noqa: E402
from kvlab.viz import BlockTableView, FreeQueueView, Player  # noqa: E402
from kvlab.viz.block_table import AXIS_TITLE  # noqa: E402

ENDS = ("◀ evicted next", "evicted last ▶")


@pytest.fixture(scope="module")
def story():
    return preemption()  # 8 blocks of 4 tokens; P, Q, R; Q is preempted


def _ends(view: FreeQueueView) -> list[tuple]:
    return [(a.text, a.x, a.y, a.xref, a.yref, a.xanchor, a.yanchor) for a in view.figure.layout.annotations]


# -- BlockTableView -----------------------------------------------------------------------------
def test_block_table_height_follows_its_rows(story) -> None:
    view = BlockTableView(story.timeline())
    view.update(story.at("preempted"))
    lay = view.figure.layout
    assert view.last_data["rows"] == ["P", "Q", "R"]
    # 68 px of title and column axis, three 30 px rows, 44 px of legend: no empty rows.
    assert (lay.margin.t, lay.height) == (68, 68 + 3 * 30 + 44)
    assert lay.yaxis.range == (2.5, -0.5)
    assert (lay.legend.y, lay.legend.yanchor) == (0, "top")  # right under the last row
    assert lay.title.y == 1 - 14 / 202  # the title hangs 14 px from the top of the real height
    view.update(story.at(0))  # one row: the figure shrinks with it
    assert (lay.height, lay.yaxis.range) == (68 + 30 + 44, (0.5, -0.5))


def test_block_table_keeps_its_height_budget_when_rows_fill_it() -> None:
    e = build_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    for i in range(12):
        e.add_request(Request(f"r{i:02d}", list(range(1000 * i, 1000 * i + 60)), max_tokens=4, arrival_time=float(i)))
    e.step()
    tl = Timeline(e.events)
    view = BlockTableView(tl)
    view.update(tl.at(tl.last_step))
    assert len(view.last_data["rows"]) == view.max_requests == 8
    # Eight rows of (330 - 68 - 44) / 8 = 27.25 px: the whole budget, never more.
    assert view.figure.layout.height == 330 and view.figure.layout.yaxis.range == (7.5, -0.5)


def test_block_table_numbers_columns_only_when_cells_are_drawn(story) -> None:
    view = BlockTableView(story.timeline())
    xaxis = view.figure.layout.xaxis
    view.update(story.at("preempted"))  # P holds five blocks
    assert xaxis.ticktext == ("0", "1", "2", "3", "4") and xaxis.tickvals == (0, 1, 2, 3, 4)
    # The axis's title is a note right-aligned over the tables (centred, it overflowed a narrow plot).
    title = [(a.text, a.x, a.y, a.xanchor, a.yanchor) for a in view.figure.layout.annotations]
    assert title == [(AXIS_TITLE, 1, 1, "right", "bottom")] and not xaxis.title.text
    for step in (0, "end"):  # P waits with no block; then no request is left
        view.update(story.at(step))
        assert (xaxis.tickvals, xaxis.ticktext) == ((), ())
        assert AXIS_TITLE not in [a.text for a in view.figure.layout.annotations]


# -- FreeQueueView ------------------------------------------------------------------------------
def test_free_queue_ends_are_named_under_the_last_row_of_blocks(story) -> None:
    view = FreeQueueView(story.timeline())
    view.update(story.at(0))  # eight free blocks in one row
    assert _ends(view) == [
        (ENDS[0], -0.5, 0.5, "x", "y", "left", "top"),
        (ENDS[1], 7.5, 0.5, "x", "y", "right", "top"),  # ends under the last block
    ]
    view.update(story.at("preempted"))  # three blocks: "evicted last" moves right to leave room
    assert [(a.text, a.x, a.y) for a in view.figure.layout.annotations] == [(ENDS[0], -0.5, 0.5), (ENDS[1], 4.5, 0.5)]


def test_free_queue_ends_follow_the_rows_of_a_wrapped_queue() -> None:
    e = build_engine(num_blocks=200, block_size=4)
    e.add_request(Request("A", list(range(480)), max_tokens=4))
    e.step()
    tl = Timeline(e.events)
    view = FreeQueueView(tl)
    assert (view.wrap, view.max_rows) == (32, 7)
    view.update(tl.at(tl.first_step))  # 199 free blocks: 7 rows, 7 blocks in the last one
    assert [(a.text, a.x, a.y) for a in view.figure.layout.annotations] == [(ENDS[0], -0.5, 6.5), (ENDS[1], 12.5, 6.5)]
    view.update(tl.at(tl.last_step))  # A holds 120: 79 free blocks in 3 rows, the last one of 15
    d = view.last_data
    assert (len(d["block_ids"]), d["rows"], d["columns"]) == (79, 3, 32)
    assert view.figure.layout.yaxis.range == (6.5, -0.5)  # the view keeps room for the whole pool...
    assert _ends(view) == [  # ...and the labels sit under row 2, not under row 6
        (ENDS[0], -0.5, 2.5, "x", "y", "left", "top"),
        (ENDS[1], 14.5, 2.5, "x", "y", "right", "top"),
    ]


def test_free_queue_height_makes_room_for_a_wrapped_title(story) -> None:
    wide, narrow = FreeQueueView(story.timeline()), FreeQueueView(story.timeline(), width=408)
    for view in (wide, narrow):
        view.update(story.at(0))
    # 482 px: a one-line title (55 px of header), one row of 38.5 px cells, 22 px of labels.
    assert (wide.figure.layout.margin.t, wide.figure.layout.height) == (55, int(55 + 38.5 + 22))
    # 408 px: the title wraps to a second line; the figure grows by it instead of squashing the row.
    assert "<br>" in narrow.figure.layout.title.text and narrow.cell_px == 388 / 12
    assert (narrow.figure.layout.margin.t, narrow.figure.layout.height) == (70, int(70 + 388 / 12 + 22))
    given = FreeQueueView(story.timeline(), width=408, height=200)
    given.update(story.at(0))
    assert given.figure.layout.height == 200  # a height the caller asked for is kept


def test_an_empty_free_queue_says_so_and_names_no_ends() -> None:
    e = build_engine(num_blocks=4, block_size=4)
    e.add_request(Request("A", list(range(10)), max_tokens=3))
    e.step()  # A's prefill holds all three blocks
    tl = Timeline(e.events)
    view = FreeQueueView(tl)
    view.update(tl.at(tl.last_step))
    assert view.last_data["block_ids"] == []
    assert [(a.text, a.x, a.y, a.xref, a.yref) for a in view.figure.layout.annotations] == [
        ("empty: every block is held by a request", 5.5, 0, "x", "y")
    ]


def test_the_still_keeps_the_free_queue_ends_on_its_blocks(story) -> None:
    p = show(story)
    assert isinstance(p, Player)
    p.go_to("preempted")
    still = p.still()
    free = p.views["free"].figure.layout
    ends = [a for a in still["layout"]["annotations"] if a["text"] in ENDS]
    # The same data coordinates as in the view's own figure: under the one row of blocks.
    assert [(a["text"], a["x"], a["y"]) for a in ends] == [(a.text, a.x, a.y) for a in free.annotations]
    assert [a["y"] for a in ends] == [0.5, 0.5]
    for a in ends:  # in the free queue's own (renamed) axes, whose range the still keeps
        assert a["xref"] != "x" and tuple(still["layout"][f"yaxis{a['yref'][1:]}"]["range"]) == free.yaxis.range
    table = p.views["table"].figure.layout
    assert table.height == 68 + 3 * 30 + 44  # the still's cell for the tables is just as tall


def test_requests_not_drawn_are_named_under_the_title_not_over_the_legend() -> None:
    e = build_engine(num_blocks=8, block_size=4, max_num_seqs=1)
    for i in range(12):
        e.add_request(Request(f"w<{i}>", list(range(100 * i, 100 * i + 6)), max_tokens=2))
    e.step()
    tl = Timeline(e.events)
    v = BlockTableView(tl)
    v.update(tl.at(tl.last_step))
    d = v.last_data
    hidden = len(tl.at(tl.last_step).requests) - len(d["rows"])
    assert hidden > 0 and d["more"].startswith(f"+{hidden} more not drawn: ")
    title = v.figure.layout.title.text
    assert f"+{hidden} more not drawn: w&lt;" in title  # request ids are escaped, never markup
    assert not [a for a in v.figure.layout.annotations if "more not drawn" in (a.text or "")]


def test_free_queue_ids_that_do_not_fit_their_cells_are_left_to_the_hover() -> None:
    from kvlab.engine.llm_engine import build_engine
    from kvlab.timeline.timeline import Timeline
    from kvlab.viz.free_queue import FreeQueueView

    small = build_engine(num_blocks=40, block_size=4)
    big = build_engine(num_blocks=260, block_size=4)
    for e in (small, big):
        e.add_request(Request("a", list(range(9)), max_tokens=1))
        e.step()
    v_small, v_big = FreeQueueView(Timeline(small.events)), FreeQueueView(Timeline(big.events))
    v_small.update(Timeline(small.events).at(Timeline(small.events).steps[-1]))
    v_big.update(Timeline(big.events).at(Timeline(big.events).steps[-1]))
    assert v_big.cell_px < 20 and all(t == "" for row in v_big.figure.data[0].text for t in row)
    cells = v_big.last_data["cells"]
    assert len(cells) > 200 and sum(1 for row in v_big.figure.data[0].customdata for h in row if h) == len(cells)  # each id in its hover
    assert any("<b>" in t for row in v_small.figure.data[0].text for t in row)  # two digits fit


def test_a_partial_tail_keeps_its_fill_line_only_where_two_lines_fit_the_row() -> None:
    from kvlab.bench.viz import capstone_run
    from kvlab.scenarios import shared_prefix

    p = show(shared_prefix(), start=2)  # two rows with room: both tails show their fill
    roomy = [t for row in p.views["table"].figure.data[0].text for t in row if "<br>" in t]
    assert [t.split("<br>")[0] for t in roomy] == ["4", "5"] and "8/16" in roomy[0]
    # The capstone's tables at step 15: five rows under long names, whose legend wraps under
    # them and thins the rows -- "63 / 1/4" spilled out of its cell; the id stays, the ▶ and
    # the hover tell the fill.
    cap = Player(capstone_run().events, start=15)
    labels = [t for row in cap.views["table"].figure.data[0].text for t in row if t]
    assert "63" in labels and not any("<br>" in t for t in labels)
