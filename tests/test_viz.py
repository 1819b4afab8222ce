"""The views and the player, checked as data (no browser).

Every view module has a pure ``figure_data(snapshot, ...)``; the view draws exactly that
data into a plotly ``FigureWidget``. So these tests check, for known snapshots of the
built-in scenarios, the ids, colours by state, labels and highlights that the pictures
show -- and that the player's ``go_to`` / ``next`` / ``back`` and request selection change
the figures (in place) as expected.
"""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from kvlab import Request  # noqa: E402
from kvlab.engine.llm_engine import build_engine  # noqa: E402
from kvlab.scenarios import eviction, preemption, shared_prefix, sliding_window  # noqa: E402
from kvlab.show import show  # noqa: E402
from kvlab.timeline import Timeline, replay  # noqa: E402
from kvlab.eventlog.events import AttentionBatch, EventLog  # noqa: E402
from kvlab.viz import (  # noqa: E402
    BlockTableView,
    FreeQueueView,
    HashChainView,
    KernelView,
    Player,
    PoolView,
    TimelineView,
    block_table,
    free_queue,
    hash_chain,
    kernel,
    pool,
    timeline,
)
from kvlab.viz.style import (  # noqa: E402
    KERNEL_COLORS,
    KERNEL_ORDER,
    STATE_COLORS,
    STATUS_COLORS,
    STATUS_ORDER,
    render_tokens,
)


@pytest.fixture(scope="module")
def story():
    return shared_prefix()


@pytest.fixture(scope="module")
def window():
    return sliding_window()


@pytest.fixture(scope="module")
def player(story):
    return show(story)


# -- PoolView ----------------------------------------------------------------------------------
def test_pool_colours_labels_and_hover(story) -> None:
    d = pool.figure_data(story.at("req1 prefix hit"), decode=story.decode)
    assert d["block_ids"] == list(range(11))
    assert d["states"][:6] == ["null", "shared", "shared", "shared", "in_use", "in_use"]
    assert d["colors"][1] == STATE_COLORS["shared"] and d["colors"][4] == STATE_COLORS["in_use"]
    assert d["colors"][0] == STATE_COLORS["null"] and d["colors"][6] == STATE_COLORS["free"]
    assert d["labels"] == ["∅", "2", "2", "2", "1", "1", "0", "0", "0", "0", "0"]  # ref counts
    h1 = d["hover"][1]
    assert "ref count 2" in h1 and "owners req0, req1" in h1
    assert f"hash {story.at('req1 prefix hit').blocks[1].block_hash[:8]}" in h1
    assert "You␣are␣a␣tutor." in h1  # the block's tokens, decoded
    assert d["counts"] == {"free": 5, "cached": 0, "in_use": 2, "shared": 3, "null": 1}
    later = pool.figure_data(story.at("both freed"))
    assert later["colors"][1] == STATE_COLORS["cached"]
    assert "LRU position 9 of 10" in later["hover"][1] and "LRU position 0 of 10" in later["hover"][5]


def test_pool_grid_and_selection(story) -> None:
    s = story.at("req1 prefix hit")
    d = pool.figure_data(s, "req1")
    assert (d["columns"], d["rows"]) == (11, 1)
    assert d["z"][0][:6] == [4, 3, 3, 3, 2, 2]  # indices into the state palette
    assert d["highlight"] == [1, 2, 3, 5]
    assert d["highlight_x"] == [1, 2, 3, 5] and d["highlight_y"] == [0, 0, 0, 0]
    assert pool.figure_data(s, None)["highlight"] == []


def test_pool_view_draws_2000_blocks_with_one_trace() -> None:
    e = build_engine(num_blocks=2000, block_size=16)
    for i in range(8):
        e.add_request(Request(f"r{i}", list(range(i, i + 300)), max_tokens=4, arrival_time=float(i)))
    e.step()
    snap = replay(e.events)
    view = PoolView(num_blocks=2000)
    view.update(snap, "r3")
    heatmaps = [t for t in view.figure.data if t.type == "heatmap"]
    assert len(heatmaps) == 1 and len(view.figure.data) < 10
    z = heatmaps[0].z
    assert len(z) == 32 and len(z[0]) == 64  # 2,000 cells in a 64-wide grid
    assert list(view.figure.data[1].customdata) == pool.blocks_of(snap, "r3")


# -- BlockTableView -----------------------------------------------------------------------------
def test_block_table_ids_sharing_partial_tail_and_highlight(story) -> None:
    d = block_table.figure_data(story.at("req1 prefix hit"), "req1")
    assert d["rows"] == ["req0", "req1"]
    by_req = {r: [c for c in d["cells"] if c["request_id"] == r] for r in d["rows"]}
    assert [c["block_id"] for c in by_req["req0"]] == [1, 2, 3, 4]
    assert [c["block_id"] for c in by_req["req1"]] == [1, 2, 3, 5]
    shared = [c for c in d["cells"] if c["block_id"] in (1, 2, 3)]
    assert len(shared) == 6 and {c["color"] for c in shared} == {STATE_COLORS["shared"]}
    tails = [(c["block_id"], c["fill"]) for c in d["cells"] if c["partial"]]
    assert tails == [(4, 8), (5, 5)]  # 56 - 48 and 53 - 48 computed tokens in the tail blocks
    assert "8/16" in d["text"][0][3]
    # Selecting req1 outlines every cell that points at one of req1's blocks -- also req0's
    # cells for the shared blocks 1-3, which makes the sharing visible.
    assert d["highlight"] == [
        ("req0", 0, 0),
        ("req0", 0, 1),
        ("req0", 0, 2),
        ("req1", 0, 0),
        ("req1", 0, 1),
        ("req1", 0, 2),
        ("req1", 0, 3),
    ]
    assert "<b>" in d["row_labels"][1] and "<b>" not in d["row_labels"][0]


def test_block_table_orders_running_then_waiting(story) -> None:
    d = block_table.figure_data(story.at("req0 prefill"))
    assert d["rows"] == ["req0", "req1"] and "waiting" in d["row_labels"][1]
    pre = preemption().at("preempted")
    d = block_table.figure_data(pre)
    assert d["rows"] == ["P", "Q", "R"] and "(no blocks)" in d["row_labels"][1]


def test_block_table_groups_side_by_side_with_null_padding(window) -> None:
    d = block_table.figure_data(window.at("S2 hit with null padding"), "S1")
    assert d["group_names"] == ["full", "window 32"]
    assert d["group_offsets"] == [0, 6] and d["group_widths"] == [5, 5]
    s2 = [c for c in d["cells"] if c["request_id"] == "S2"]
    assert [(c["group"], c["label"]) for c in s2] == [
        (0, "1"),
        (0, "2"),
        (0, "3"),
        (0, "4"),
        (0, "11"),
        (1, "∅"),
        (1, "∅"),
        (1, "7"),
        (1, "8"),
        (1, "12"),
    ]
    nulls = [c for c in d["cells"] if c["block_id"] == 0]
    assert nulls and {c["color"] for c in nulls} == {STATE_COLORS["null"]}
    assert all(c["x"] >= 6 for c in nulls)  # drawn in the window group's band
    assert not any(c["block_id"] == 0 for c in d["cells"] if (c["request_id"], c["group"], c["logical"]) in d["highlight"])


# -- HashChainView ------------------------------------------------------------------------------
def test_hash_chain_forest_labels_and_lookup_walk(story) -> None:
    d = hash_chain.figure_data(story.at("req1 prefix hit"), decode=story.decode, max_label_chars=16)
    nodes = sorted(d["nodes"], key=lambda n: n["depth"])
    assert [n["depth"] for n in nodes] == [0, 1, 2] and [n["block_ids"] for n in nodes] == [[1], [2], [3]]
    assert [n["label"] for n in nodes] == ["You␣are␣a␣tutor.", "␣Explain␣vLLM's␣", "paged␣KV␣cache.…"]
    assert {n["color"] for n in nodes} == {STATE_COLORS["shared"]}
    assert d["edges"] == [(nodes[0]["hash"], nodes[1]["hash"]), (nodes[1]["hash"], nodes[2]["hash"])]
    assert d["lookup"]["request_id"] == "req1" and len(d["lookup"]["hits"]) == 3 and d["lookup"]["stop"] == "end"
    assert all(n["lookup"] == "hit" for n in nodes)
    assert d["tips"] == [("req0, req1", 2, 0.0)]


def test_hash_chain_first_miss_and_divergence() -> None:
    sc = eviction()
    d = hash_chain.figure_data(sc.at("A2 partial hit"), decode=sc.decode)
    lk = d["lookup"]
    assert lk["request_id"] == "A2" and lk["stop"] == "miss" and len(lk["hits"]) == 1
    hit = next(n for n in d["nodes"] if n["lookup"] == "hit")
    miss = next(n for n in d["nodes"] if n["lookup"] == "miss")
    # A2 computed its second block after the miss and cached it: the miss is now a node,
    # and the ghost cross is drawn on it.
    assert hit["block_ids"] == [1] and miss["block_ids"] == [2] and miss["parent"] == hit["hash"]
    assert lk["ghost"] == (float(miss["depth"]), miss["row"])
    assert "then the first miss" in d["summary"]
    roots = [n for n in d["nodes"] if n["depth"] == 0]
    assert [n["label"] for n in roots] == ["Alic", "Bob:", "Caro"]  # three distinct prompts
    c = hash_chain.figure_data(sc.at("C freed"))  # C's lookup missed at its very first block,
    first = next(n for n in c["nodes"] if n["block_ids"] == [7])  # which C then computed and cached
    assert c["lookup"]["request_id"] == "C" and c["lookup"]["hits"] == [] and c["lookup"]["miss"] == first["hash"]


def test_hash_chain_ghost_for_a_miss_that_is_not_cached() -> None:
    d = hash_chain.figure_data(preemption().at("preempted"))
    lk = d["lookup"]
    assert lk["request_id"] == "R" and lk["stop"] == "miss" and lk["hits"] == []
    assert lk["miss"] not in {n["hash"] for n in d["nodes"]}
    assert lk["ghost"] == (0.0, -1.0)  # a lonely root-level cross: nothing of R is cached


def test_render_tokens_default_and_decoded() -> None:
    assert render_tokens([0] * 16, None) == "0×16"
    assert render_tokens([7, 7, 8], None) == "7 7 8"
    assert render_tokens(list(range(40)), None, 10) == "0 1 2 3 4…"
    assert render_tokens([72, 105], chr) == "Hi"
    assert render_tokens([], chr) == ""


# -- FreeQueueView ------------------------------------------------------------------------------
def test_free_queue_order_colours_and_last_owners(story) -> None:
    d = free_queue.figure_data(story.at("both freed"), "req0")
    assert d["block_ids"] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert [c["color"] for c in d["cells"]] == [STATE_COLORS["free"]] * 7 + [STATE_COLORS["cached"]] * 3
    owners = {c["block_id"]: c["last_owner"] for c in d["cells"]}
    # req1's tail (block 5) is evicted next; its prefix sits at the far end, *last block first*.
    assert owners[5] == ("req1", 0, 3) and owners[4] == ("req0", 0, 3)
    assert [owners[b] for b in (3, 2, 1)] == [("req1", 0, 2), ("req1", 0, 1), ("req1", 0, 0)]
    assert owners[6] is None
    assert d["highlight"] == [4]  # the only block req0 held last
    assert "req1[3]" in d["text"][0][0]


def test_free_queue_labels_a_shared_block_with_the_request_that_released_it_last() -> None:
    # A computes a 2-block prefix; B hits it (B is the last to *take* blocks 1 and 2) and
    # finishes first; A finishes last, and its release puts the prefix on the free queue.
    e = build_engine(num_blocks=12, block_size=4)
    e.add_request(Request("A", list(range(100, 108)) + [1], max_tokens=6))
    e.step()
    e.add_request(Request("B", list(range(100, 108)) + [2], max_tokens=2))
    e.run()
    d = free_queue.figure_data(replay(e.events), "A")
    owners = {c["block_id"]: c["last_owner"] for c in d["cells"]}
    assert owners[1] == ("A", 0, 0) and owners[2] == ("A", 0, 1)
    assert "A[0]" in d["text"][0][d["block_ids"].index(1)] and 1 in d["highlight"] and 2 in d["highlight"]
    # B's only block of its own (4) went to the queue head and A took it next: B left nothing behind.
    assert free_queue.figure_data(replay(e.events), "B")["highlight"] == [] and owners[4] == ("A", 0, 3)


def test_free_queue_wraps_long_queues() -> None:
    e = build_engine(num_blocks=300, block_size=16)
    snap = replay(e.events)
    d = free_queue.figure_data(snap, wrap=64)
    assert d["columns"] == 64 and d["rows"] == 5 and len(d["cells"]) == 299


# -- TimelineView -------------------------------------------------------------------------------
def test_timeline_metrics_and_gantt(story) -> None:
    r = timeline.run_data(story.timeline())
    assert r["steps"] == list(range(9))
    assert r["requests"] == ["req0", "req1", "req2", "long"]
    assert r["status"]["req0"] == ["waiting", "running", "running", "finished", None, None, None, None, None]
    assert r["status"]["long"][6:] == ["waiting", "running", "finished"]
    assert r["usage"][1:4] == [40.0, 50.0, 40.0] and r["usage"][7] == 100.0
    assert round(r["hit_rate"][2], 1) == 90.6  # 48 of 53 queried tokens hit
    d = timeline.figure_data(story.at(2), "req1", run=r)
    assert d["cursor"] == 2 and d["selected_row"] == 1
    assert [STATUS_ORDER[i] for i in d["z"][0][:4]] == ["waiting", "running", "running", "finished"]
    assert [STATUS_COLORS[STATUS_ORDER[i]] for i in d["z"][0][:2]] == [STATUS_COLORS["waiting"], STATUS_COLORS["running"]]


def test_timeline_data_carries_the_simulated_clock(story) -> None:
    r = timeline.run_data(story.timeline())
    series = story.timeline().series
    assert r["time"] == [None] + series.time and r["time"][-1] == story.engine.clock
    view = TimelineView(story.timeline())
    view.update(story.at(3))
    assert list(view.figure.data[0].customdata)[1:] == series.time  # the usage line's hover shows the clock
    assert timeline.run_data(None)["steps"] == [0]


def test_timeline_marks_preemptions() -> None:
    sc = preemption()
    r = timeline.run_data(sc.timeline())
    step = sc.step_of("preempted")
    assert r["preemptions"][step] == 1 and sum(r["preemptions"]) == 1
    assert r["status"]["Q"][step] == "preempted"
    assert r["status"]["Q"][sc.step_of("resumed with hits")] == "running"


# -- KernelView ---------------------------------------------------------------------------------
def test_kernel_reads_through_the_block_table(story) -> None:
    d = kernel.figure_data(story.at("req1 prefix hit"), "req1")
    assert d["request_id"] == "req1" and d["source"] == "block_table" and d["position"] == 52
    (g,) = d["groups"]
    assert g["read_blocks"] == [1, 2, 3, 5]
    assert g["read_slots"] == list(range(16, 64)) + list(range(80, 85))  # slot = block * 16 + offset
    assert g["query_slot"] == 5 * 16 + 4
    # req1's step computed its 5 new tokens (positions 48..52): all five are queries, each
    # reading the 48 cached prefix tokens and the new tokens before it.
    assert d["query_positions"] == [48, 49, 50, 51, 52]
    last_row = d["rows"][-1]
    assert [s for _, _, s in last_row["cells"]][:6] == ["query"] * 5 + ["unwritten"]
    assert "5 queries, positions 48–52" in d["title"] and "derived from the block table" in d["subtitle"]
    assert kernel.figure_data(story.at("req1 prefix hit"))["request_id"] == "req0"  # default: first running
    assert kernel.figure_data(story.at("both freed"))["request_id"] is None


def test_kernel_honours_the_sliding_window(window) -> None:
    d = kernel.figure_data(window.at("S2 hit with null padding"), "S1")
    full, win = d["groups"]
    assert d["position"] == 70 and win["window"] == 32 and win["first_read"] == 39
    assert full["read_blocks"] == [1, 2, 3, 4, 9] and len(full["read_slots"]) == 71
    assert win["read_blocks"] == [7, 8, 10] and len(win["read_slots"]) == 32
    rows = [r for r in d["rows"] if r["group"] == 1]
    assert {s for _, _, s in rows[0]["cells"]} == {"null"} and {s for _, _, s in rows[1]["cells"]} == {"null"}
    states7 = [s for _, _, s in rows[2]["cells"]]
    assert states7 == ["outside_window"] * 7 + ["read"] * 9  # positions 32..38 are out of the window
    assert 0 not in win["read_blocks"]  # the null block is never read


def _attention_batch(snap, req_ids: list[str]) -> AttentionBatch:
    """The batch a model runner would emit for ``req_ids`` (one decode token each)."""
    bs = snap.block_size
    groups = len(snap.groups)
    tables = [[list(snap.requests[r].block_table[g]) for r in req_ids] for g in range(groups)]
    seq_lens = [snap.requests[r].num_computed_tokens for r in req_ids]
    slots = [[t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables[g], seq_lens)] for g in range(groups)]
    windows = [g.get("sliding_window") for g in snap.groups]
    return AttentionBatch(
        req_ids=req_ids,
        query_lens=[1] * len(req_ids),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mappings=slots,
        block_size=bs,
        sliding_windows=windows,
    )


def test_kernel_view_prefers_the_attention_batch_event(window) -> None:
    step = window.step_of("S2 hit with null padding")
    events = [e for e in window.log if e.step <= step]
    snap = Timeline(events).at(step)
    batch = _attention_batch(snap, ["S2", "S1"])
    batch.seq, batch.step = len(events), step
    tl = Timeline(events + [batch])
    view = KernelView(tl)
    view.update(tl.at(step), "S1")
    d = view.last_data
    assert d["source"] == "attention_batch" and d["request_id"] == "S1"
    derived = kernel.figure_data(snap, "S1")
    for got, want in zip(d["groups"], derived["groups"]):
        assert got["read_slots"] == want["read_slots"] and got["query_slot"] == want["query_slot"]
    # The query cell is drawn in the query colour: its value's band in the colour scale.
    hm = view.figure.data[0]
    qi = KERNEL_ORDER.index("query")
    (lo, c_lo), (hi, c_hi) = hm.colorscale[2 * qi], hm.colorscale[2 * qi + 1]
    n_cat = len(kernel._CATEGORIES)  # the kernel states, then the block states (blocks outside the table)
    assert lo < (qi + 0.5) / n_cat < hi and c_lo == c_hi == KERNEL_COLORS["query"]
    assert sum(row.count(qi) for row in d["z"]) == 2  # one query token per group
    view.update(tl.at(step), None)
    assert view.last_data["request_id"] == "S2"  # the batch's first request
    assert "AttentionBatch" in view.figure.layout.title.text


# -- Player ---------------------------------------------------------------------------------------
def test_player_steps_and_redraws_in_place(player) -> None:
    p = player
    figs = {name: v.figure for name, v in p.views.items()}
    ntraces = {name: len(f.data) for name, f in figs.items()}
    assert list(p.views) == ["pool", "free", "table", "hash", "timeline", "kernel"]
    assert p.step == 1 and p.first_step == 0 and p.last_step == 8  # opens at the first step that holds a block
    p.go_to(0)
    assert p.go_to(1) == 1
    assert "step 1" in p.views["pool"].figure.layout.title.text
    assert p.next() == 2 and p.step == 2
    z2 = [list(r) for r in p.views["pool"].figure.data[0].z]
    assert z2[0][:6] == [4, 3, 3, 3, 2, 2]  # blocks 1-3 shared at step 2
    assert p.back() == 1
    assert [list(r) for r in p.views["pool"].figure.data[0].z][0][:6] == [4, 2, 2, 2, 2, 0]  # null, 1-4 in use, 5 free
    assert p.go_to("both freed") == 4
    assert list(p.views["free"].last_data["block_ids"]) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert p.slider.value == 4 and p.play.value == 4
    p.go_to(8)
    assert p.next() == 8  # stays at the end
    p.go_to(0)
    assert p.back() == 0
    # Same figure objects, same number of traces: the views were updated, not rebuilt.
    assert all(v.figure is figs[n] and len(v.figure.data) == ntraces[n] for n, v in p.views.items())
    with pytest.raises(ValueError, match="out of range"):
        p.go_to(99)
    with pytest.raises(TypeError):
        p.go_to(1.5)  # type: ignore[arg-type]


def test_player_slider_and_buttons_drive_it(player) -> None:
    player.go_to(0)
    player.slider.value = 3
    assert player.step == 3 and "step 3" in player.views["table"].figure.layout.title.text
    player.step_button.click()
    assert player.step == 4
    player.back_button.click()
    assert player.step == 3
    assert player.jump_dropdown is not None
    player.jump_dropdown.value = player.named_steps["long request evicts"]
    assert player.step == 7 and player.jump_dropdown.value == -1
    assert "evict block 3" in player._events.value


def test_selecting_a_request_highlights_exactly_its_blocks(player) -> None:
    p = player
    p.go_to("req1 prefix hit")
    p.select("req1")
    assert p.request_dropdown.value == "req1"
    assert list(p.views["pool"].figure.data[1].customdata) == [1, 2, 3, 5]
    tb = p.views["table"].last_data
    at = {(c["x"], c["y"]): c["block_id"] for c in tb["cells"]}
    tfig = p.views["table"].figure
    marked = [at[int(x), int(y)] for x, y in zip(tfig.data[1].x, tfig.data[1].y)]
    assert set(marked) == {1, 2, 3, 5} and len(marked) == sum(1 for c in tb["cells"] if c["block_id"] in (1, 2, 3, 5))
    assert "<b>▶ req1" in tfig.layout.yaxis.ticktext[tb["rows"].index("req1")]
    snap = p.snapshot
    req1_hashes = {snap.blocks[b].block_hash for b in (1, 2, 3)}
    hv = p.views["hash"]
    marked = set(zip(hv.figure.data[6].x, hv.figure.data[6].y))
    assert marked == {(n["depth"], n["row"]) for n in hv.last_data["nodes"] if n["hash"] in req1_hashes} and len(marked) == 3
    tv = p.views["timeline"]
    assert list(tv.figure.data[tv._sel].y) == [0.5, 0.5, 1.5, 1.5, 0.5]  # a frame around row 1 (req1)
    assert p.views["kernel"].last_data["request_id"] == "req1"
    p.go_to("both freed")
    fv = p.views["free"]
    at = {(c["x"], c["y"]): c["block_id"] for c in fv.last_data["cells"]}
    assert [at[int(x), int(y)] for x, y in zip(fv.figure.data[1].x, fv.figure.data[1].y)] == [5, 3, 2, 1]  # what req1 held last
    assert list(p.views["pool"].figure.data[1].customdata) == []  # it holds nothing now
    p.request_dropdown.value = ""  # "— none —"
    assert p.selected_request is None and p.views["free"].last_data["highlight"] == []
    with pytest.raises(ValueError, match="unknown request"):
        p.select("nobody")


def test_player_sources_and_display(story) -> None:
    for src in (story.log, Timeline(story.log), list(story.log)):
        p = Player(src, views=["pool"])
        assert list(p.views) == ["pool"] and p.last_step == 8
    bundle = Player(story.log, views=["table"])._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert isinstance(show(story, views=("pool", "free")), Player)
    with pytest.raises(TypeError, match="source must be"):
        Player(42)
    with pytest.raises(ValueError, match="unknown view"):
        show(story, views=["pool", "nope"])
    with pytest.raises(ValueError, match="step names"):
        Player(story.log, views=["pool"]).go_to("both freed")


def test_player_event_list_is_styled_by_each_events_tone() -> None:
    sc = preemption()
    p = show(sc, views=("pool",), start="preempted")
    html = p._events.value
    line = next(part for part in html.split("<div") if "PREEMPT" in part)
    assert "font-weight:bold" in line and "d55e00" in line  # tone "alert"
    assert "— step" in html and "color:#666" in html  # tone "step"


def test_show_loads_a_saved_log_and_checks_its_sources(story, tmp_path) -> None:
    path = tmp_path / "run.json"
    story.log.save(str(path))
    p = show(path, views=("pool",), start=4)
    assert p.snapshot == story.at(4) and not p.live and p.run_button is None
    assert show(str(path), views=("pool",)).last_step == 8
    with pytest.raises(FileNotFoundError, match="no saved event log"):
        show(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="follow=True needs"):
        Player(list(story.log), views=("pool",), follow=True)
    with pytest.raises(TypeError, match="named_steps"):
        Player(story.log, views=("pool",), named_steps={"x": "1"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="no step named"):
        show(story, views=("pool",)).go_to("nope")
    with pytest.raises(RuntimeError, match="live source"):
        Player(story.log, views=("pool",)).run_step()


def test_live_player_follows_the_engine() -> None:
    e = build_engine(num_blocks=12, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=3, arrival_time=0.0))
    p = show(e, views=("pool", "table", "timeline"))
    assert p.live and p.run_button is not None and p.step == 0
    p.run_step()
    assert p.step == 1 and "step 1" in p.views["pool"].figure.layout.title.text
    e.add_request(Request("b", list(range(10)), max_tokens=2, arrival_time=0.0))  # from "another cell"
    assert [v for _, v in p.request_dropdown.options] == ["", "a", "b"]
    assert p.views["table"].last_data["rows"] == ["a", "b"]
    e.step()
    assert p.step == 2 and p.views["table"].last_data["rows"] == ["a", "b"]
    assert p.snapshot == replay(e.events)
    p.go_to(1)  # looking back: the player stops following ...
    e.step()
    assert p.step == 1
    p.go_to(p.last_step)  # ... until it is back at the end
    while e.has_unfinished_requests():
        p.run_button.click()
    assert p.step == p.last_step and p.snapshot.running == []
    p.run_step()  # nothing left to run: a message, no error
    assert "no unfinished request" in p._status.value


def test_views_work_without_a_timeline(story) -> None:
    snap = story.at("both freed")
    for cls in (PoolView, BlockTableView, HashChainView, FreeQueueView, TimelineView, KernelView):
        v = cls()
        v.update(snap, "req1")
        assert v.figure.layout.title.text


def test_bad_arguments_are_clear_errors(story) -> None:
    with pytest.raises(ValueError, match="width"):
        PoolView(width=10)
    with pytest.raises(TypeError, match="decode"):
        show(story, decode=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrap"):
        free_queue.figure_data(story.at(1), wrap=0)
    with pytest.raises(ValueError, match="event log"):
        show(build_engine(num_blocks=4, block_size=4, event_log=None))
    assert EventLog() is not None


def test_live_player_redraws_once_per_step_not_mid_step() -> None:
    e = build_engine(num_blocks=12, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=2, arrival_time=0.0))
    p = show(e, views=("pool",))
    renders = []
    original = p._render
    p._render = lambda: (renders.append(len(e.events)), original())  # type: ignore[method-assign]
    e.step()
    assert renders == [len(e.events)]  # one redraw, after the step's last event
    e.scheduler.finish_requests("a")  # an abort between steps is followed too
    assert p.snapshot.running == [] and p.snapshot.requests["a"].finish_reason == "abort"


def test_plotlys_bundle_reaches_the_page_once_per_kernel() -> None:
    """Thirty figures must not mean thirty copies of plotly's 5 MB widget code sent, parsed
    and saved: one hidden loader carries it, each figure's module only waits for it."""
    import json

    import plotly.graph_objects as go

    import kvlab.viz.base as base
    from kvlab.viz import figure_widget_class, preload

    cls = figure_widget_class()
    assert cls is figure_widget_class() and issubclass(cls, go.FigureWidget)
    views = (PoolView(), TimelineView(), KernelView())
    widgets = [v.widget for v in views]
    assert len(base._LOADER) == 1
    loader = base._LOADER[0]
    # the loader's module imports plotly's own code, unchanged, once per page ...
    literal = loader._esm.split("new Blob([", 1)[1].split("], { type", 1)[0]
    assert json.loads(literal) == str(go.FigureWidget._esm)
    assert "if (!slot.started)" in loader._esm and "import(url).then(slot.resolve" in loader._esm
    key = loader._esm.split("const KEY = ", 1)[1].split(";", 1)[0]
    for w in widgets:
        # ... and what each figure sends is a few lines that await the same slot
        assert isinstance(w, go.FigureWidget) and len(w._esm) < 1000
        assert f"const KEY = {key};" in w._esm and "const mod = await slot.module;" in w._esm
        assert "export default mod.default;" in w._esm and "import(" not in w._esm
    preload()
    assert base._LOADER == [loader]  # idempotent while the loader's comm is open
    loader.close()
    preload()  # a closed loader (Widget.close_all()) is replaced
    assert len(base._LOADER) == 1 and base._LOADER[0] is not loader and base._LOADER[0].comm is not None


# -- pictures a learner can trust ------------------------------------------------------------------
def test_one_colour_one_meaning_across_every_view() -> None:
    """No colour means two things: block states, request states and the kernel's reads use
    disjoint colours, and the other marks reuse a colour only for the same concept."""
    import re
    from pathlib import Path

    from kvlab.viz import style

    blocks = set(style.STATE_COLORS.values())
    statuses = set(style.STATUS_COLORS.values())
    reads = {style.KERNEL_COLORS["read"], style.KERNEL_COLORS["query"]}
    assert len(blocks) == 5 and len(statuses) == 6
    assert not blocks & statuses and not blocks & reads and not statuses & reads
    assert style.HIT == style.STATE_COLORS["cached"]  # a prefix hit is the prefix cache's colour
    assert style.USAGE == style.STATE_COLORS["in_use"]  # usage counts the blocks held
    assert style.KERNEL_COLORS["null"] == style.STATE_COLORS["null"]  # the null block, everywhere
    assert style.SELECT_OUTER == style.INK and style.SELECT_INNER == style.WHITE  # no colour: a mark
    # Views take every colour from the palette: no colour literal anywhere else in kvlab/viz.
    root = Path(style.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "style.py":
            continue
        found = set(re.findall(r"#([0-9a-fA-F]{6})\b", path.read_text()))
        hues = {c for c in found if not c[0:2] == c[2:4] == c[4:6]}  # greys (ink, paper) are not meanings
        assert not hues, f"{path.name} has its own colours {sorted(hues)}"


def test_the_selection_mark_is_a_black_and_white_frame_in_every_view(player) -> None:
    p = player
    p.go_to("req1 prefix hit")
    p.select("req1")
    for name, (outer_i, inner_i) in {"pool": (1, 2), "table": (1, 2), "free": (1, 2), "hash": (6, 7)}.items():
        fig = p.views[name].figure
        outer, inner = fig.data[outer_i], fig.data[inner_i]
        assert outer.marker.symbol == inner.marker.symbol == "square-open", name
        assert outer.marker.line.color == "#000000" and inner.marker.line.color == "#ffffff", name
        assert inner.marker.size < outer.marker.size, name
    assert len(p.views["pool"].figure.data[1].x) == 4  # req1's blocks 1, 2, 3, 5
    tv = p.views["timeline"]
    frame = tv.figure.data[tv._sel : tv._sel + 2]
    assert [t.line.color for t in frame] == ["#000000", "#ffffff"] and [len(t.x) for t in frame] == [5, 5]
    assert tv.figure.layout.shapes[0].line.dash == "dash"  # the step cursor: a dashed line, not a colour
    p.select(None)


def test_run_step_shows_the_step_it_ran_wherever_the_player_stood() -> None:
    e = build_engine(num_blocks=16, block_size=4)
    e.add_request(Request("a", list(range(10)), max_tokens=6, arrival_time=0.0))
    e.run()
    p = show(e, views=("pool", "table"), start=1)
    e.add_request(Request("b", list(range(100, 110)), max_tokens=3, arrival_time=0.0))
    assert p.step == 1  # a request added from another cell: the player stays where it is
    ran = p.run_step()
    assert ran == p.step == p.last_step == 7
    assert "step 7" in p.views["pool"].figure.layout.title.text and p.views["table"].last_data["rows"] == ["b"]


def test_player_fits_the_notebook_and_is_one_widget(player) -> None:
    from kvlab.viz.player import DEFAULT_WIDTH
    from kvlab.viz.replay_widget import ReplayWidget

    assert DEFAULT_WIDTH <= 960 and player.widget.layout.width == "100%" and player.widget.header["width"] == DEFAULT_WIDTH
    assert sum(v.width for v in list(player.views.values())[:2]) + 8 <= DEFAULT_WIDTH
    # One widget model draws every view in the page; no view opened a FigureWidget of its own.
    assert isinstance(player.widget, ReplayWidget) and all(v._widget is None for v in player.views.values())
    h = player.widget.header
    assert h["config"]["displayModeBar"] is False and h["views"] == list(player.views) and h["steps"] == list(range(9))
    assert ["both freed", 4] in h["named"] and h["requests"] == ["req0", "req1", "req2", "long"] and h["can_run"] is False


def test_a_manager_only_log_fills_every_panel_it_shows() -> None:
    """An exercise checker drives a KVCacheManager without a scheduler: its replay still has
    block tables, a Gantt and a usage line, and no empty kernel panel."""
    from kvlab.exercises.checks_pool import run_shared_prefix_story, story_manager

    log = run_shared_prefix_story(story_manager())["log"]
    p = Player(log)
    assert list(p.views) == ["pool", "free", "table", "hash", "timeline"]
    p.go_to(2)
    assert p.views["table"].last_data["rows"] == ["req0", "req1"]
    t = p.views["timeline"].last_data
    assert t["requests"] == ["req0", "req1", "req2", "req3"]
    assert t["usage"][1] == pytest.approx(100 * 4 / 10) and t["usage"][2] == pytest.approx(100 * 5 / 10)
    assert t["status"]["req0"][1:4] == ["running", "running", "finished"]
    assert t["running"][2] == 2
    assert all(v.figure.layout.annotations == () or "no " not in str(v.figure.layout.annotations) for v in p.views.values())


def test_capstone_size_tables_aggregate_what_does_not_fit() -> None:
    e = build_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    for i in range(12):
        e.add_request(Request(f"r{i:02d}", list(range(1000 * i, 1000 * i + 60)), max_tokens=4, arrival_time=float(i)))
    e.step()
    snap = replay(e.events)
    d = block_table.figure_data(snap, "r11", max_requests=5, max_columns=9)
    assert len(d["rows"]) == 5 and "r11" in d["hidden"]  # a selection never reorders the picture
    assert "r11" not in d["more"] or d["more"].endswith("…")
    assert len(d["hidden"]) == len(snap.running + snap.waiting) - 5 and d["more"].startswith(f"+{len(d['hidden'])} more")
    (cols,) = d["group_columns"]
    assert None in cols and cols[0] == 0 and cols[-1] == d["group_widths"][0] - 1  # first blocks, …, last blocks
    assert d["ncols"] == 9 and d["ellipsis_x"] == [cols.index(None)]
    view = BlockTableView(Timeline(e.events))
    view.update(snap)
    assert view.max_requests == 8 and len(view.last_data["rows"]) <= 8


def test_crowded_hash_forests_keep_labels_only_on_the_walk() -> None:
    e = build_engine(num_blocks=64, block_size=4)
    for i in range(6):
        e.add_request(Request(f"q{i}", list(range(100 * i, 100 * i + 60)), max_tokens=1, arrival_time=float(i)))
    e.run()
    tl = Timeline(e.events)
    view = HashChainView(tl, height=260)
    view.update(tl.at(tl.last_step), "q5")
    texts = list(view.figure.data[3].text)
    nodes = view.last_data["nodes"]
    assert any(texts) and all(t == "" or n["lookup"] or n["selected"] for t, n in zip(texts, nodes))
    assert "labels: walk and selection only" in view.figure.layout.title.text


def test_duplicate_keys_are_drawn_and_labelled() -> None:
    from kvlab.executor.simulated import SimulatedExecutor

    class NextLetter(SimulatedExecutor):
        def next_token(self, context):
            return context[-1] + 1

    e = build_engine(num_blocks=12, block_size=4, executor=NextLetter())
    e.add_request(Request("first", list(b"ABCDEF"), max_tokens=3))
    e.run()
    e.add_request(Request("second", list(b"ABCDEF"), max_tokens=4))
    for _ in range(3):
        e.step()
    tl = Timeline(e.events)
    view = HashChainView(tl, decode=chr)
    view.update(tl.at(tl.last_step))
    dup = [n for n in view.last_data["nodes"] if n["duplicate"]]
    assert [n["block_ids"] for n in dup] == [[2, 3]] and dup[0]["label"] == "EFGH ×2"
    assert len(view.figure.data[2].x) == 1  # the second square of the stack
    assert "×2 one key, two blocks" in [t.name for t in view.figure.data if t.showlegend]


def test_timeline_title_gives_the_peak_and_gantt_labels_never_overlap() -> None:
    sc = preemption()
    v = TimelineView(sc.timeline())
    v.update(sc.at("end"), "Q")
    assert "usage 0%" in v.figure.layout.title.text and "(peak 100%)" in v.figure.layout.title.text
    e = build_engine(num_blocks=64, block_size=16, max_num_batched_tokens=256)
    for i in range(23):
        e.add_request(Request(f"r{i}", list(range(1000 * i, 1000 * i + 40)), max_tokens=8, arrival_time=float(i)))
    e.run()
    tl = Timeline(e.events)
    v = TimelineView(tl)
    v.update(tl.at(5), "r7")
    ticks = list(v.figure.layout.yaxis3.tickvals)
    gantt_px = 0.54 * (v.height - 110)
    assert 7 in ticks and all(b - a >= 23 * 12 / gantt_px - 1e-9 for a, b in zip(ticks, ticks[1:]))
    # Up to MAX_ROW_LABELS rows the view grows until every row has its own name.
    assert v.height == 622 and ticks == list(range(23))


def test_gantt_names_every_row_up_to_the_label_limit_then_every_kth() -> None:
    from kvlab.viz.timeline import gantt_height

    assert [gantt_height(n) for n in (0, 12, 14, 21, 24, 40)] == [400, 400, 422, 577, 644, 644]
    e = build_engine(num_blocks=64, block_size=16, max_num_batched_tokens=512)
    for i in range(30):
        e.add_request(Request(f"r{i}", list(range(1000 * i, 1000 * i + 20)), max_tokens=2, arrival_time=float(i)))
    e.run()
    tl = Timeline(e.events)
    v = TimelineView(tl)
    v.update(tl.at(3), "r9")
    # 30 rows in 644 px: every 2nd row is named, and the selected row 9 (its neighbours give way).
    assert list(v.figure.layout.yaxis3.tickvals) == [0, 2, 4, 6, 9, 12, 14, 16, 18, 20, 22, 24, 26, 28]
    assert v.figure.layout.yaxis3.ticktext[4] == "<b>▶ r9</b>"


def test_player_display_leaves_a_still_picture(story, monkeypatch) -> None:
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False, **kw: shown.append(obj))
    p = show(story, start="req1 prefix hit")
    p._ipython_display_()
    style, still, widget = shown
    assert "kvlab-still-next" in style["text/html"] and ":has(" in style["text/html"]
    fig = still["application/vnd.plotly.v1+json"]
    titles = [a["text"] for a in fig["layout"]["annotations"] if a["text"].startswith(("Block", "Free", "Hash", "Timeline", "Attention"))]
    assert [t.split(" · ")[0] for t in titles] == ["Block pool", "Free queue", "Block tables", "Hash chains", "Timeline", "Attention read"]
    assert "step 2 of 8" in fig["layout"]["annotations"][0]["text"]
    assert fig["layout"]["width"] <= 960 and not any(t.get("showlegend") for t in fig["data"])
    assert "application/vnd.jupyter.widget-view+json" in widget and widget["text/plain"] == ""  # never VBox(children=…)


_MACHADO = {  # Machado, Oliveira & Fernandes 2009, severity 1, on linear RGB
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602), (0.004733, 0.691367, 0.303900)),
}


def _lab_as_seen(hex_color: str, vision: str) -> tuple[float, float, float]:
    """CIELAB of a colour as a viewer with ``vision`` sees it (``achromatopsia``: luminance only)."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    if vision == "achromatopsia":
        y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
        lin = [y, y, y]
    elif vision in _MACHADO:
        lin = [min(1.0, max(0.0, sum(m * c for m, c in zip(row, lin)))) for row in _MACHADO[vision]]
    xyz = [sum(m * c for m, c in zip(row, lin)) for row in ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505))]
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (xyz[0] / 0.95047, xyz[1], xyz[2] / 1.08883)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


@pytest.mark.parametrize("vision", ["normal", "protanopia", "deuteranopia", "tritanopia", "achromatopsia"])
def test_the_palette_survives_colour_blindness(vision: str) -> None:
    """Colours drawn side by side stay apart for dichromats (CIELAB ΔE >= 15) and, in
    lightness alone, enough to tell apart in a greyscale print (ΔE >= 8). The browser test
    takes screenshots under Chromium's emulation of the same deficiencies."""
    import itertools
    import math

    from kvlab.viz import style

    floor = 8 if vision == "achromatopsia" else 15
    for group in (style.STATE_COLORS, style.STATUS_COLORS):
        for (a, ca), (b, cb) in itertools.combinations(group.items(), 2):
            d = math.dist(_lab_as_seen(ca, vision), _lab_as_seen(cb, vision))
            assert d >= floor, f"{vision}: {a} and {b} are only ΔE {d:.1f} apart"


def test_batch_updates_send_no_placeholders_for_properties_a_trace_holds() -> None:
    """A batch that sets marker.size on one trace must not erase the others' sizes in a
    page that draws the figure later (a Player renders before it is displayed)."""
    from plotly.basedatatypes import Undefined

    from kvlab.viz import figure_widget_class

    import plotly.graph_objects as go

    w = figure_widget_class()(
        data=[go.Scatter(x=[1], marker=dict(size=11), showlegend=False), go.Scatter(x=[2], marker=dict(size=5)), go.Heatmap(z=[[1]])]
    )
    sent = []
    w._send_update_msg = lambda **k: sent.append(k)
    with w.batch_update():
        w.data[0].x = [3]
        w.data[1].marker.size = 20
        w.data[1].showlegend = True
        w.data[2].z = [[2]]
    (msg,) = sent
    style, traces = msg["restyle_data"], msg["trace_indexes"]
    assert traces == [0, 1, 2]
    assert style["marker.size"][:2] == [11, 20]  # trace 0 keeps its size: sent as it is, not a placeholder
    assert style["showlegend"] == [False, True, None]  # the heatmap's: unset, and sent as unset
    assert style["marker.size"][2] is Undefined and style["z"][0] is Undefined  # properties a kind lacks


def test_a_view_shown_on_its_own_is_its_figure_not_a_widget(story) -> None:
    v = PoolView(Timeline(story.log))
    v.update(Timeline(story.log).at(2))
    bundle = v._repr_mimebundle_()
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/plain"} and v._widget is None
    fig = bundle["application/vnd.plotly.v1+json"]
    assert fig["layout"]["title"]["text"].startswith("Block pool · step 2") and fig["config"]["displayModeBar"] is False
    assert bundle["text/plain"].startswith("<PoolView: Block pool · step 2")
