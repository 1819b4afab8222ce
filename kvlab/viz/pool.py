"""PoolView: every physical block of the pool, coloured by state (lessons 02-04).

The pool is the one picture that makes "the cache *is* the pool" visible: free, cached,
in-use and shared blocks are the same objects in different states, and a block that a
finished request left behind stays sky-blue (cached, evictable) until the free-queue head
reaches it. The cell label is the reference count -- the number that protects a block
from eviction.

One heatmap draws all the blocks (a 2,000-block pool is one trace with 2,000 cells, not
2,000 traces); the legend entries and the selection outline are separate small traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvlab.timeline.snapshot import BLOCK_STATES, NULL, Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_rows, legend_traces, mark_patch, selection_traces
from kvlab.viz.style import (
    STATE_COLORS,
    STATE_HELP,
    STATE_INDEX,
    STATE_LABELS,
    discrete_colorscale,
    html_escape,
    render_tokens,
    short_hash,
)

# Pools up to this many blocks print the block id and ref count in every cell; larger ones
# keep the numbers in the hover text (the cells become too small to read).
LABEL_LIMIT = 256


def grid_columns(num_blocks: int) -> int:
    """Cells per row: one strip for the lesson-sized pools, then a near-square grid."""
    if num_blocks <= 12:
        return max(num_blocks, 1)
    if num_blocks <= 24:
        return math.ceil(num_blocks / 2)
    if num_blocks <= 256:
        return 16
    if num_blocks <= 1024:
        return 32
    return 64


def blocks_of(snapshot: Snapshot, request_id: str | None) -> list[int]:
    """Physical blocks (null excluded) in any group of the request's block table, in order."""
    if request_id is None or request_id not in snapshot.requests:
        return []
    seen: dict[int, None] = {}
    for table in snapshot.requests[request_id].block_table:
        for bid in table:
            if bid != 0:
                seen[bid] = None
    return list(seen)


def figure_data(
    snapshot: Snapshot,
    selected_request: str | None = None,
    *,
    columns: int | None = None,
    decode: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """Everything the pool picture shows, as plain data.

    Returns per-block lists (``block_ids``, ``states``, ``colors``, ``labels`` = ref
    counts, ``hover``), the heatmap grid (``z``, ``text``, ``customdata``, ``columns``,
    ``rows``), the ``highlight`` block ids (the selected request's blocks) with their
    cell coordinates, per-state ``counts`` and the ``title``.
    """
    n = snapshot.num_blocks
    cols = columns or grid_columns(n)
    if cols < 1:
        raise ValueError(f"columns must be >= 1, got {cols}")
    rows = max(1, math.ceil(n / cols))
    show_text = n <= LABEL_LIMIT
    z: list[list[float | None]] = [[None] * cols for _ in range(rows)]
    text: list[list[str]] = [[""] * cols for _ in range(rows)]
    custom: list[list[str]] = [[""] * cols for _ in range(rows)]
    ids, states, colors, labels, hovers = [], [], [], [], []
    counts = {s: 0 for s in BLOCK_STATES}
    for b in snapshot.blocks:
        bid, st = b.block_id, b.state
        r, c = divmod(bid, cols)
        label = "∅" if st == NULL else str(b.ref_cnt)
        lines = [f"<b>block {bid}</b> · {STATE_HELP[st]}"]
        if st != NULL:
            lines.append(f"ref count {b.ref_cnt}")
            lines.append(f"hash {short_hash(b.block_hash)}")
            if b.token_ids:
                lines.append("tokens " + html_escape(render_tokens(b.token_ids, decode, 32)))
            lines.append("owners " + (", ".join(map(html_escape, b.owners)) if b.owners else "—"))
            pos = "—" if b.free_position is None else f"{b.free_position} of {len(snapshot.free_queue)} (0 = evicted next)"
            lines.append(f"LRU position {pos}")
        hover = "<br>".join(lines)
        z[r][c] = STATE_INDEX[st]
        text[r][c] = f"<span style='font-size:9px'>{bid}</span><br><b>{label}</b>" if show_text else ""
        custom[r][c] = hover
        ids.append(bid)
        states.append(st)
        colors.append(STATE_COLORS[st])
        labels.append(label)
        hovers.append(hover)
        counts[st] += 1
    highlight, hx, hy = _marked(snapshot, selected_request, cols)
    title = (
        f"Block pool · step {snapshot.step} · {counts['free']} free, {counts['cached']} cached, "
        f"{counts['in_use']} in use, {counts['shared']} shared"
    )
    return dict(
        block_ids=ids,
        states=states,
        colors=colors,
        labels=labels,
        hover=hovers,
        z=z,
        text=text,
        customdata=custom,
        columns=cols,
        rows=rows,
        highlight=highlight,
        highlight_x=hx,
        highlight_y=hy,
        counts=counts,
        title=title,
    )


def state_heatmap(go: Any, *, name: str, ygap: int, **kwargs: Any) -> Any:
    """One heatmap whose cells are coloured by block state (the pool and the block tables
    share it, so a state has the same colour in both). ``z`` holds ``STATE_INDEX`` values;
    cell text and hover come in ``text`` / ``customdata``."""
    return go.Heatmap(
        z=[[None]],
        zmin=-0.5,
        zmax=len(BLOCK_STATES) - 0.5,
        colorscale=discrete_colorscale([STATE_COLORS[s] for s in BLOCK_STATES]),
        showscale=False,
        xgap=2,
        ygap=ygap,
        texttemplate="%{text}",
        textfont=dict(size=11),
        hovertemplate="%{customdata}<extra></extra>",
        name=name,
        **kwargs,
    )


def _marked(snapshot: Snapshot, request_id: str | None, cols: int) -> tuple[list[int], list[int], list[int]]:
    """The request's blocks and their cells (column, row) in a pool drawn ``cols`` wide."""
    ids = blocks_of(snapshot, request_id)
    return ids, [b % cols for b in ids], [b // cols for b in ids]


class PoolView(View):
    """The block pool as a grid: colour = state, label = ref count, hover = the details."""

    name = "pool"
    title = "Block pool"

    def __init__(
        self,
        timeline: Timeline | None = None,
        *,
        num_blocks: int | None = None,
        decode: Callable[[int], str] | None = None,
        width: int = 482,
        height: int | None = None,
    ) -> None:
        n = num_blocks or (timeline.at(timeline.first_step).num_blocks if timeline is not None else 16)
        self.columns = grid_columns(n)
        self.rows = max(1, math.ceil(n / self.columns))
        self.cell_px = max(4.0, min(40.0, (width - 20) / self.columns))
        # Square cells under the title, a subtitle line and the legend, which wraps to a
        # second row in a narrow view (the same estimate View._header makes the margin from).
        if height is None:
            legend = legend_rows([STATE_LABELS[s] for s in BLOCK_STATES], width - 24, 10)
            height = int(min(660, self.rows * self.cell_px + 6 + 20 + 15 + 19 * legend + 10 + 6))
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(state_heatmap(go, name="blocks", ygap=2))
        for tr in selection_traces(go, max(6.0, self.cell_px - 5)):
            fig.add_trace(tr)
        for tr in legend_traces(go, STATE_COLORS, STATE_LABELS, BLOCK_STATES):
            fig.add_trace(tr)
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            xaxis=dict(visible=False, range=[-0.5, self.columns - 0.5], fixedrange=True, autorange=False),
            yaxis=dict(visible=False, range=[self.rows - 0.5, -0.5], fixedrange=True, autorange=False),
            margin=dict(l=10, r=10, t=50, b=6),
        )
        fig.data[0].showlegend = False
        if self.cell_px < 27:  # two lines (id, ref count) of 11 px text need 27 px: smaller text below
            fig.data[0].textfont.size = 9

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot, None, columns=self.columns, decode=self.decode)
        self.last_data = d
        fig = self.figure
        with fig.batch_update():
            hm = fig.data[0]
            self._put("z", hm, "z", d["z"], "num")
            self._put("text", hm, "text", d["text"], "str")
            self._put("hover", hm, "customdata", d["customdata"], "str")
            top = self._header(d["title"], [STATE_LABELS[s] for s in BLOCK_STATES])
            cell_h = (self.height - top - 6) / self.rows  # cells may be wider than tall: the frame fits both
            self._selection_size("hl", fig.data[1], fig.data[2], min(self.cell_px, cell_h) - 4)
            self._select(snapshot, selected_request)

    def selection_patch(self, snapshot: Snapshot, request_id: str | None) -> dict[str, Any]:
        """The selection mark on the request's blocks (their ids in its hover data)."""
        assert self.last_data is not None
        ids, xs, ys = _marked(snapshot, request_id, self.last_data["columns"])
        patch = mark_patch(1, 2, xs, ys)
        patch["traces"]["1"]["customdata"] = ids
        return patch
