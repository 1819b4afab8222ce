"""One colour, one meaning, in three pictures (issue 19): the kernel's query token, the
routing policies, the offload tiers' marks -- checked as the figure data a learner sees."""

from __future__ import annotations

import itertools
import math

import pytest

pytest.importorskip("plotly")

from test_beyond_pool_views import _offload_timeline  # noqa: E402
from test_viz import _lab_as_seen  # noqa: E402

from kvlab.scenarios import sliding_window  # noqa: E402
from kvlab.viz import KernelView, TiersView  # noqa: E402
from kvlab.viz import kernel  # noqa: E402
from kvlab.viz import offload as ov  # noqa: E402
from kvlab.viz import routing  # noqa: E402
from kvlab.viz.style import KERNEL_ORDER, SKY_BLUE, STATE_COLORS, STATUS_COLORS, short_hash  # noqa: E402

MEANINGS = set(STATE_COLORS.values()) | set(STATUS_COLORS.values())  # block and request states


# -- the attention kernel: the query token is not a read slot's colour ----------------------------
def test_kernel_query_cell_has_its_own_colour_and_legend_entry() -> None:
    w = sliding_window()
    view = KernelView()
    view.update(w.at("S2 hit with null padding"), "S1")
    d = view.last_data
    qi, ri = KERNEL_ORDER.index("query"), KERNEL_ORDER.index("read")
    # the query cells: the last position of each group's table, drawn as the query category, marked q
    cells = [(y, x) for y, row in enumerate(d["z"]) for x, v in enumerate(row) if v == qi]
    assert cells == [(4, 6), (9, 6)] and [d["text"][y][x] for y, x in cells] == ["q", "q"]
    n_cat = len(kernel._CATEGORIES)
    scale = view.figure.data[0].colorscale
    band = {i: (scale[2 * i][1], scale[2 * i + 1][1]) for i in (qi, ri)}
    assert band[qi] == ("#99407a", "#99407a") and band[ri] == ("#cc79a7", "#cc79a7")
    assert scale[2 * qi][0] < (qi + 0.5) / n_cat < scale[2 * qi + 1][0]
    legend = {t.name: t.marker.color for t in view.figure.data[4:]}
    assert legend == {
        "read": "#cc79a7",
        "q = the query token": "#99407a",
        "× outside window": "#777777",
        "null ∅": "#3b3b3b",
        "empty slot": "#ffffff",
    }
    assert len(set(legend.values())) == len(legend)  # no two kernel states share a legend colour
    assert "#99407a" not in MEANINGS and "#99407a" != view.figure.data[1].marker.color  # nor a state, nor the load dots


@pytest.mark.parametrize("vision", ["normal", "protanopia", "deuteranopia", "tritanopia", "achromatopsia"])
def test_kernel_cells_drawn_side_by_side_stay_apart_for_colour_blind_eyes(vision: str) -> None:
    from kvlab.viz.style import KERNEL_COLORS

    floor = 8 if vision == "achromatopsia" else 15
    shown = {k: KERNEL_COLORS[k] for k in ("read", "query", "null", "unwritten")}  # "unwritten" stands for white
    for (a, ca), (b, cb) in itertools.combinations(shown.items(), 2):
        d = math.dist(_lab_as_seen(ca, vision), _lab_as_seen(cb, vision))
        assert d >= floor, f"{vision}: {a} and {b} are only ΔE {d:.1f} apart"


# -- routing: policies are hatched in ink, never coloured ---------------------------------------
ROWS = [
    dict(trace="t1", policy=p, hit_rate=h, ttft_mean=0.1, ttft_p90=0.3, prefill_per_replica=[10, 30], imbalance=1.5)
    for p, h in (("round_robin", 0.5), ("least_loaded", 0.4), ("kv_aware", 0.8), ("kv_aware+load(2)", 0.7), ("custom", 0.1))
]


def test_routing_policies_are_told_apart_by_hatching_not_by_a_colour_with_a_meaning() -> None:
    d = routing.figure_data(ROWS)
    assert d["patterns"] == {"round_robin": "/", "least_loaded": "-", "kv_aware": "x", "kv_aware+load(2)": ".", "custom": "|"}
    fig = routing.routing_figure(ROWS)
    policy_traces = [t for t in fig.data if t.xaxis in ("x", "x2")]
    assert len(policy_traces) == 3 * len(d["policies"])  # hit-rate bar, TTFT bar, p90 diamond
    bars = [t for t in policy_traces if t.type == "bar"]
    assert [(t.name, t.marker.pattern.shape) for t in bars if t.xaxis == "x"] == list(d["patterns"].items())
    assert [t.name for t in fig.data if t.showlegend is not False] == list(d["patterns"])  # the legend: one entry per policy
    for t in bars:
        assert (t.marker.color, t.marker.line.color, t.marker.pattern.fgcolor, t.marker.pattern.bgcolor) == (
            "#ffffff",
            "#000000",
            "#000000",
            "#ffffff",
        )
    diamonds = [t for t in policy_traces if t.type == "scatter"]
    assert {(t.marker.symbol, t.marker.color) for t in diamonds} == {("diamond", "#000000")}
    used = {t.marker.color for t in policy_traces}
    assert used == {"#ffffff", "#000000"} and not used & (MEANINGS | {SKY_BLUE})


# -- offload tiers: a hit is framed on the tier that served it; a copy into a tier is a "+" ------
@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    return _offload_timeline(tmp_path_factory.mktemp("tiers"))


def _marks(d: dict) -> dict[str, tuple[list[int], list[int]]]:
    """Per tier: (LRU positions framed as served, LRU positions marked + copied in)."""
    return {
        r["name"]: ([c["lru_position"] for c in r["cells"] if c["served"]], [c["lru_position"] for c in r["cells"] if c["copied_in"]])
        for r in d["rows"]
    }


def test_a_disk_hit_is_framed_on_the_disk_and_marked_copied_in_on_the_cpu_tier(tiers) -> None:
    d = ov.figure_data(tiers.at(4))  # A2's two blocks: read from disk, promoted through CPU slots 3 and 2
    assert d["served"] == {"STORAGE": 2}
    assert _marks(d) == {"CPU": ([], [3, 4]), "disk": ([7, 8], [])}
    assert (d["served_x"], d["served_y"]) == ([7, 8], ["disk", "disk"])  # one frame per block loaded
    cpu, disk = d["rows"]
    for c in cpu["cells"][3:]:
        assert d["text"][0][c["lru_position"]] == "+" + short_hash(c["hash"])[:4]
    assert [c["hash"] for c in cpu["cells"][3:]] == [c["hash"] for c in disk["cells"][7:]]  # the same blocks
    assert d["hover"][0][4].endswith("promoted from disk on its way to GPU block 4 for A2 (the disk served the hit)")
    assert d["hover"][1][8].endswith("served a hit: read from here into GPU block 4 for A2")
    assert not d["text"][1][7].startswith("+")


def test_a_cpu_hit_and_a_store_in_the_same_step(tiers) -> None:
    d = ov.figure_data(tiers.at(5))  # C2: one block read from the CPU tier, its new block stored and cascaded
    assert d["served"] == {"CPU": 1}
    assert _marks(d) == {"CPU": ([4], [3]), "disk": ([], [9])}
    assert (d["served_x"], d["served_y"]) == ([4], ["CPU"])
    assert d["hover"][0][3].endswith("+ stored this step (copied in)")


def test_tiers_view_draws_one_frame_per_hit_and_names_both_marks(tiers) -> None:
    view = TiersView(tiers)
    view.update(tiers.at(4))
    fig = view.figure
    frames = fig.data[1]
    assert (list(frames.x), list(frames.y)) == ([7, 8], ["disk", "disk"]) and frames.marker.symbol == "square-open"
    legend = [(t.name, t.marker.symbol, t.marker.color) for t in fig.data[1:]]
    assert legend == [
        ("hit read from here", "square-open", "#000000"),
        ("+ copied in here", "square", SKY_BLUE),  # the "+" is written on a cached cell
        ("cached in the tier", "square", SKY_BLUE),
        ("empty slot", "square", "#e6e6e6"),
    ]
    assert "+ =" not in fig.layout.title.text  # the legend, not the title, explains the "+"


def test_replica_greys_are_apart_from_every_grey_that_means_something() -> None:
    from kvlab.viz import style

    meaning = {style.DARK_GREY, style.MID_GREY, style.LIGHT_GREY, style.STATE_COLORS["free"], style.STATUS_COLORS["finished"]}
    level = lambda c: int(c[1:3], 16)  # noqa: E731  (greys: one level)
    assert len(set(style.REPLICA_GREYS)) == len(style.REPLICA_GREYS) >= 5
    for g in style.REPLICA_GREYS:
        assert g[1:3] == g[3:5] == g[5:7], g
        assert min(abs(level(g) - level(m)) for m in meaning) >= 0x18, g


def test_a_legend_entry_with_nothing_drawn_is_left_out_of_the_still_as_plotly_does() -> None:
    import json

    import plotly.io as pio

    from kvlab import show
    from kvlab.scenarios import shared_prefix
    from kvlab.viz.still import _legend_entries

    p = show(shared_prefix(), start=0)  # step 0: req0 waits, no block table holds a partial tail
    table = json.loads(pio.to_json(p.views["table"].still(), validate=False))
    assert "partial tail" not in [name for _g, _c, name in _legend_entries(table)]
    p.go_to(2)  # both tails are partial
    table = json.loads(pio.to_json(p.views["table"].still(), validate=False))
    assert "partial tail" in [name for _g, _c, name in _legend_entries(table)]
