"""BlockTableView: each request's block table, logical block -> physical block (lesson 02).

A block table is the whole trick of paged attention: the request sees a contiguous
sequence of logical blocks, the pool hands out physical blocks from anywhere. One row per
request (running first, in admission order, then waiting in pop order), one cell per
logical block, labelled with the physical id and coloured like that block in the pool --
so a shared block is orange in both rows that point to it, and the repeated id says the
same thing in numbers. The tail block, if not full, shows how many of its slots hold
tokens; a null block (id 0, sliding-window padding) is drawn ∅. With several KV-cache
groups the tables sit side by side, one column band per group.
"""

from __future__ import annotations

import re

from collections.abc import Callable
from typing import Any

from kvlab.timeline.snapshot import NULL, Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_rows, legend_traces, mark_patch, selection_traces
from kvlab.viz.pool import blocks_of, state_heatmap
from kvlab.viz.style import (
    STATE_COLORS,
    STATE_HELP,
    STATE_INDEX,
    STATE_LABELS,
    html_escape,
    short_hash,
)

GROUP_GAP = 1  # empty columns between two groups' tables
MIN_COLUMNS = 10  # narrow tables keep readable cells instead of stretching


def group_name(group: dict[str, Any]) -> str:
    if group.get("type") == "sliding_window":
        return f"window {group.get('sliding_window')}"
    return "full"


def _shown_columns(width: int, cap: int | None) -> list[int | None]:
    """The logical indices drawn for a table of ``width`` blocks in at most ``cap`` columns:
    all of them, or the first ones, an ellipsis (None) and the last ones."""
    if cap is None or width <= cap:
        return list(range(width))
    cap = max(cap, 3)
    tail = (cap - 1) // 2
    head = cap - 1 - tail
    return list(range(head)) + [None] + list(range(width - tail, width))


def figure_data(
    snapshot: Snapshot, selected_request: str | None = None, *, max_requests: int = 64, max_columns: int | None = None
) -> dict[str, Any]:
    """The block tables as plain data.

    ``rows`` lists the request ids drawn (top to bottom) and ``cells`` one dict per drawn
    cell: ``request_id``, ``group``, ``logical`` (index in the table), ``block_id``,
    ``state`` (the physical block's state, ``null`` for padding), ``color``, ``label``,
    ``partial`` (the tail is not full; ``fill`` slots used) and ``x``/``y`` in the grid.
    ``highlight`` lists the cells (as ``(request_id, group, logical)``) whose block belongs
    to the selected request; ``z``/``text``/``customdata`` are the heatmap arrays.

    What does not fit is aggregated, never squeezed: at most ``max_requests`` rows
    (running first, then waiting) -- ``hidden`` names the others (the selection too: a
    selection marks a picture, it never reorders it) -- and, with ``max_columns``, a long table shows its first and last
    blocks around an ellipsis column (``ellipsis_x``).
    """
    bs = snapshot.block_size
    groups = snapshot.groups or [{"type": "full"}]
    everyone = [r for r in snapshot.running + snapshot.waiting if r in snapshot.requests]
    max_requests = max(1, max_requests)
    order = everyone[:max_requests]
    hidden = [r for r in everyone if r not in order]
    widths = [0] * len(groups)
    for rid in order:
        for g, table in enumerate(snapshot.requests[rid].block_table):
            if g < len(widths):
                widths[g] = max(widths[g], len(table))
    widths = [max(w, 1) for w in widths]
    cap = None if max_columns is None else max(3, (max_columns - GROUP_GAP * (len(groups) - 1)) // len(groups))
    shown = [_shown_columns(w, cap) for w in widths]
    offsets, x = [], 0
    for cols in shown:
        offsets.append(x)
        x += len(cols) + GROUP_GAP
    ncols = max(1, x - GROUP_GAP)
    col_of = [{li: offsets[g] + j for j, li in enumerate(cols) if li is not None} for g, cols in enumerate(shown)]
    ellipsis_x = [offsets[g] + j for g, cols in enumerate(shown) for j, li in enumerate(cols) if li is None]
    z: list[list[float | None]] = [[None] * ncols for _ in order]
    text: list[list[str]] = [[""] * ncols for _ in order]
    custom: list[list[str]] = [[""] * ncols for _ in order]
    cells: list[dict[str, Any]] = []
    selected_blocks = set(blocks_of(snapshot, selected_request))
    highlight: list[tuple[str, int, int]] = []
    hx: list[int] = []
    hy: list[int] = []
    px: list[float] = []
    py: list[int] = []
    for y, rid in enumerate(order):
        r = snapshot.requests[rid]
        for g, table in enumerate(r.block_table[: len(groups)]):
            # Slots holding K/V: the computed tokens (the last sampled token gets its slot next step).
            tail_fill = r.num_computed_tokens - (len(table) - 1) * bs
            for i, bid in enumerate(table):
                if bid == 0:
                    state, label = NULL, "∅"
                else:
                    state = snapshot.blocks[bid].state
                    label = str(bid)
                partial = bid != 0 and i == len(table) - 1 and 0 <= tail_fill < bs
                fill = max(0, min(bs, tail_fill)) if i == len(table) - 1 else bs
                xx = col_of[g].get(i)
                if partial:
                    label = f"{bid}<br><span style='font-size:9px'>{fill}/{bs}</span>"
                    if xx is not None:
                        px.append(xx + 0.34)
                        py.append(y)
                b = snapshot.blocks[bid]
                cells.append(
                    dict(
                        request_id=rid,
                        group=g,
                        logical=i,
                        block_id=bid,
                        state=state,
                        color=STATE_COLORS[state],
                        label="∅" if bid == 0 else str(bid),
                        partial=partial,
                        fill=fill,
                        x=xx,
                        y=y,
                    )
                )
                if bid in selected_blocks:
                    highlight.append((rid, g, i))
                    if xx is not None:
                        hx.append(xx)
                        hy.append(y)
                if xx is None:
                    continue  # inside the ellipsis
                hover = (
                    f"<b>{html_escape(rid)}</b> · {group_name(groups[g])} group · logical block {i}<br>"
                    f"→ physical block {bid}"
                    + (" (null: padding, never read)" if bid == 0 else "")
                    + "<br>"
                    + (
                        f"tokens {i * bs}..{i * bs + bs - 1}<br>state {STATE_HELP[state]}, ref {b.ref_cnt}<br>hash {short_hash(b.block_hash)}"
                        if bid != 0
                        else f"tokens {i * bs}..{i * bs + bs - 1} left the window"
                    )
                    + (f"<br>partial: {fill} of {bs} slots hold tokens" if partial else "")
                )
                z[y][xx] = STATE_INDEX[state]
                text[y][xx] = label
                custom[y][xx] = hover
            for j, li in enumerate(shown[g]):
                if li is None and len(table) > (shown[g][j - 1] or 0) + 1:
                    before, after = shown[g][j - 1], shown[g][j + 1]
                    assert before is not None and after is not None  # the one ellipsis sits between drawn columns
                    text[y][offsets[g] + j] = "…"
                    custom[y][offsets[g] + j] = f"<b>{rid}</b>: logical blocks {before + 1}..{after - 1} not drawn (hover the pool)"
    row_labels = _row_labels(snapshot, order, selected_request)
    more = ""
    if hidden:
        names = ", ".join(hidden[:4]) + (", …" if len(hidden) > 4 else "")
        more = f"+{len(hidden)} more not drawn: {names}"
    return dict(
        rows=order,
        row_labels=row_labels,
        cells=cells,
        z=z,
        text=text,
        customdata=custom,
        group_offsets=offsets,
        group_widths=widths,
        group_columns=shown,
        group_names=[group_name(g) for g in groups],
        ncols=ncols,
        ellipsis_x=ellipsis_x,
        highlight=highlight,
        highlight_x=hx,
        highlight_y=hy,
        partial_x=px,
        partial_y=py,
        hidden=hidden,
        more=more,
        title=f"Block tables · step {snapshot.step} · {len(snapshot.running)} running, {len(snapshot.waiting)} waiting",
    )


def _row_labels(snapshot: Snapshot, order: list[str], selected_request: str | None) -> list[str]:
    """Each drawn row's name and status; the selected row's in bold, after a ▶."""
    out = []
    for rid in order:
        r = snapshot.requests[rid]
        lab = f"{html_escape(rid)} · {r.status}" + ("" if any(r.block_table) else " (no blocks)")
        out.append(f"<b>▶ {lab}</b>" if rid == selected_request else lab)
    return out


ROW_PX = 22  # the smallest row that keeps a block id readable
ROW_MAX_PX = 30  # the tallest row: room for a partial tail's two lines, no more
TWO_LINE_PX = 26  # the thinnest row in which a partial tail's two lines fit
LEGEND_LABELS = ["partial tail"] + [STATE_LABELS[s] for s in ("in_use", "shared", "null")]
_PLAIN = re.compile(r"<[^>]+>")  # markup in a row name (the selection's bold) takes no room
COLUMN_PX = 22  # the narrowest cell for a two- or three-digit id
BOTTOM_PX = 44  # under the rows: the legend
AXIS_TITLE = "logical block index (cell: physical block id)"
AXIS_NOTE = dict(
    text=AXIS_TITLE, xref="paper", yref="paper", x=1, y=1, xanchor="right", yanchor="bottom", yshift=16, showarrow=False, font=dict(size=10)
)


class BlockTableView(View):
    """One row per request: logical block -> physical block id, coloured by the block's state.

    Rows and columns never shrink below a readable size: requests beyond what fits are
    named in a line under the tables, long tables show their first and last blocks.

    ``height`` is a budget, not a size: the figure is as tall as the rows it draws (at
    most ``ROW_MAX_PX`` each), so the legend sits right under the last row. A fixed
    height with a minimum number of rows left a band of empty rows between a short
    table and its legend.
    """

    name = "table"
    title = "Block tables"

    def __init__(
        self,
        timeline: Timeline | None = None,
        *,
        decode: Callable[[int], str] | None = None,
        width: int = 482,
        height: int = 330,
        max_requests: int | None = None,
    ) -> None:
        super().__init__(timeline, decode=decode, width=width, height=height)
        # Room for the title, the column axis, the legend and the "more" line.
        fit = max(1, int((height - 150) // ROW_PX))
        self.max_requests = fit if max_requests is None else max_requests
        self.max_columns = max(MIN_COLUMNS, int((width - 150) // COLUMN_PX))
        go = _go()
        fig = self.figure
        fig.add_trace(state_heatmap(go, name="tables", ygap=3, showlegend=False))
        for tr in selection_traces(go, 24):
            fig.add_trace(tr)
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name="partial tail",
                marker=dict(symbol="triangle-right", size=8, color="#222222"),
                hoverinfo="skip",
                showlegend=True,
            )
        )
        for tr in legend_traces(go, STATE_COLORS, STATE_LABELS, ("in_use", "shared", "null")):
            fig.add_trace(tr)
        fig.update_layout(
            showlegend=True,
            legend=dict(TOP_LEGEND, y=0, yanchor="top"),
            # Column labels on top, right above the tables (small tables leave room below).
            xaxis=dict(
                side="top",
                showgrid=False,
                zeroline=False,
                fixedrange=True,
                tickfont=dict(size=9),
                autorange=False,
            ),
            yaxis=dict(autorange=False, range=[0.5, -0.5], showgrid=False, zeroline=False, fixedrange=True, automargin=True),
            margin=dict(l=10, r=10, t=80, b=BOTTOM_PX),
        )

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot, None, max_requests=self.max_requests, max_columns=self.max_columns)
        self.last_data = d
        ticks_x, ticks_t = [], []
        for g, (off, cols) in enumerate(zip(d["group_offsets"], d["group_columns"])):
            step = max(1, len(cols) // 8)
            for j, li in enumerate(cols):
                if li is None:
                    ticks_x.append(off + j)
                    ticks_t.append("…")
                elif j % step == 0 or j == len(cols) - 1:
                    ticks_x.append(off + j)
                    ticks_t.append(f"{'g' + str(g) + ':' if len(d['group_offsets']) > 1 else ''}{li}")
        fig = self.figure
        n = max(1, len(d["rows"]))
        with fig.batch_update():
            hm, pt = fig.data[0], fig.data[3]
            rows = bool(d["rows"])
            self._put("z", hm, "z", d["z"] if rows else [[None]], "num")
            self._put("hover", hm, "customdata", d["customdata"] if rows else [[""]], "str")
            self._put("y", hm, "y", list(range(len(d["rows"]))) if rows else [0], "num")
            names = " | ".join(f"g{g}: {nm}" for g, nm in enumerate(d["group_names"])) if len(d["group_names"]) > 1 else ""
            # The legend sits under the tables; the top holds the title and the column axis.
            # Requests not drawn are named under the title: under the rows they collided with
            # the legend, which wraps to a row per entry when the row labels are long.
            sub = " · ".join(x for x in (f"groups side by side · {names}" if names else "", html_escape(d["more"])) if x)
            top = self._header(d["title"], (), subtitle=sub, extra_top=36)
            row_px = min(ROW_MAX_PX, (self.height - top - BOTTOM_PX) / n)
            # A partial tail's second line (its fill, "5/16") needs a row of TWO_LINE_PX; in a
            # thinner row it spilled out of the cell, so the cell keeps the id (the ▶ and the
            # hover tell the fill). The legend under the rows wraps in the plot area, which long
            # row names narrow, and plotly takes the extra legend rows from the rows' height.
            names_px = 6.6 * max((len(_PLAIN.sub("", x)) for x in _row_labels(snapshot, d["rows"], None)), default=0) + 8
            spill = max(0, legend_rows(LEGEND_LABELS, self.width - 20 - names_px, 10) - 2) * 19
            text = d["text"] if row_px - spill / n >= TWO_LINE_PX else [[t.split("<br>")[0] for t in r] for r in d["text"]]
            self._put("text", hm, "text", text if rows else [[""]], "str")
            height = int(round(top + n * row_px + BOTTOM_PX))
            self._put("height", fig.layout, "height", height)
            self._put("title.y.fit", fig.layout.title, "y", 1 - 14 / height)  # _header placed it for self.height
            cell_px = max(6, min(row_px, (self.width - 110) / max(MIN_COLUMNS, d["ncols"])) - 2)
            self._selection_size("hl", fig.data[1], fig.data[2], cell_px)
            self._put("pt.x", pt, "x", d["partial_x"], "num")
            self._put("pt.y", pt, "y", d["partial_y"], "num")
            self._put("ytv", fig.layout.yaxis, "tickvals", list(range(len(d["rows"]))))
            self._put("yr", fig.layout.yaxis, "range", [n - 0.5, -0.5])
            # No cell drawn (nobody holds a block): no column is numbered, or a lone "0" would
            # label an empty column.
            drawn = any(c["x"] is not None for c in d["cells"])
            self._put("xtv", fig.layout.xaxis, "tickvals", ticks_x if drawn else [])
            self._put("xtt", fig.layout.xaxis, "ticktext", ticks_t if drawn else [])
            self._put("xr", fig.layout.xaxis, "range", [-0.5, max(MIN_COLUMNS, d["ncols"]) - 0.5])
            # The column axis's title, right-aligned over the tables: an axis title is centred on
            # the plot area, which the row labels leave narrow, and overflowed into the neighbour.
            notes: list[dict[str, Any]] = [] if not drawn else [AXIS_NOTE]
            if not d["rows"]:
                notes.append(dict(text="no running or waiting request", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5))
            self._put("notes", fig.layout, "annotations", notes)
        self._select(snapshot, selected_request)

    def selection_patch(self, snapshot: Snapshot, request_id: str | None) -> dict[str, Any]:
        """The selection mark on every drawn cell that holds one of the request's blocks (a
        shared block is marked in each table that holds it), and its row's name in bold."""
        d = self.last_data
        assert d is not None
        mine = set(blocks_of(snapshot, request_id))
        cells = [c for c in d["cells"] if c["block_id"] in mine and c["x"] is not None]
        patch = mark_patch(1, 2, [c["x"] for c in cells], [c["y"] for c in cells])
        patch["layout"] = {"yaxis.ticktext": _row_labels(snapshot, d["rows"], request_id)}
        return patch
