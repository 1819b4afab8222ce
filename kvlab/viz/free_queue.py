"""FreeQueueView: the free-block queue, from "evicted next" to "evicted last" (lesson 04).

The queue is the LRU order of the whole cache. A block that reaches ref count 0 is
appended at the tail if it carries a hash (sky blue: a later prefix hit can still take
it back) and put at the head if it holds nothing reusable (grey). A request frees its
table *tail first*, so a finished request's last block sits to the left of (ahead of)
its first block: eviction eats a cached prefix from its end, and what survives is always
a usable beginning. Each cell names the request that last held it and the logical index
it had there (``req0[3]``), which makes that order visible. For a block two requests
shared, that is the one that let go of it *last* -- its release is what put the block on
the queue (``BlockView.last_holder``, kept by the data layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvlab.timeline.snapshot import BLOCK_STATES, CACHED, FREE, Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces, mark_patch, selection_traces
from kvlab.viz.style import (
    STATE_COLORS,
    STATE_HELP,
    STATE_INDEX,
    STATE_LABELS,
    discrete_colorscale,
    short_hash,
    html_escape,
)

ONE_ROW_LIMIT = 32  # longer queues wrap, row by row, like text
MIN_COLUMNS = 12  # a short queue keeps cells of a readable size instead of stretching
BOTTOM_PX = 22  # under the rows: the two end labels
LABELS_PX = 180  # "◀ evicted next" and "evicted last ▶" side by side, with a gap


def figure_data(
    snapshot: Snapshot,
    selected_request: str | None = None,
    *,
    wrap: int = ONE_ROW_LIMIT,
    owner_labels: bool = True,
) -> dict[str, Any]:
    """The free queue as plain data: ``cells`` in queue order (``position``, ``block_id``,
    ``state``, ``color``, ``label``, ``last_owner`` = (request, group, logical index) or
    None, ``x``, ``y``), the heatmap arrays, and ``highlight`` = blocks the selected
    request held last (where its KV went after it finished or was preempted).
    """
    if wrap < 1:
        raise ValueError(f"wrap must be >= 1, got {wrap}")
    q = snapshot.free_queue
    cols = max(1, min(len(q), wrap))
    rows = max(1, math.ceil(len(q) / cols))
    z: list[list[float | None]] = [[None] * cols for _ in range(rows)]
    text: list[list[str]] = [[""] * cols for _ in range(rows)]
    custom: list[list[str]] = [[""] * cols for _ in range(rows)]
    cells = []
    hl, hx, hy = [], [], []
    for pos, bid in enumerate(q):
        b = snapshot.blocks[bid]
        y, x = divmod(pos, cols)
        holder = b.last_holder
        owner = (holder.request_id, holder.group, holder.logical_index) if holder is not None else None
        owner_txt = f"{html_escape(owner[0])}[{owner[2]}]" if owner else ""
        label = str(bid)
        z[y][x] = STATE_INDEX[b.state]
        text[y][x] = f"<b>{bid}</b>" + (f"<br><span style='font-size:9px'>{owner_txt}</span>" if owner_labels and owner_txt else "")
        custom[y][x] = (
            f"<b>position {pos}</b> of {len(q)} (0 = evicted next)<br>block {bid} · {STATE_HELP[b.state]}<br>"
            f"hash {short_hash(b.block_hash)}<br>"
            + (
                f"last held by {html_escape(owner[0])} as logical block {owner[2]} (group {owner[1]})"
                if owner
                else "never held by a request"
            )
        )
        cells.append(dict(position=pos, block_id=bid, state=b.state, color=STATE_COLORS[b.state], label=label, last_owner=owner, x=x, y=y))
        if owner is not None and owner[0] == selected_request:
            hl.append(bid)
            hx.append(x)
            hy.append(y)
    n_cached = sum(1 for c in cells if c["state"] == CACHED)
    return dict(
        cells=cells,
        block_ids=list(q),
        z=z,
        text=text,
        customdata=custom,
        columns=cols,
        rows=rows,
        highlight=hl,
        highlight_x=hx,
        highlight_y=hy,
        title=f"Free queue · step {snapshot.step} · {len(q)} blocks ({n_cached} cached, {len(q) - n_cached} free)",
    )


class FreeQueueView(View):
    """The free queue as a strip: left = evicted next, right = evicted last."""

    name = "free"
    title = "Free queue"

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
        # Up to 128 blocks the cells stay big enough for their labels (>= 26 px: a few
        # rows); bigger pools wrap at 32 or 64 cells per row.
        readable = max(MIN_COLUMNS, int((width - 20) // 26))
        self.wrap = readable if n <= 129 and n - 1 > ONE_ROW_LIMIT // 2 else ONE_ROW_LIMIT if n <= 257 else 64
        self.max_rows = max(1, math.ceil((n - 1) / self.wrap))
        self.cell_px = min(40.0, (width - 20) / max(MIN_COLUMNS, min(self.wrap, n - 1)))
        # Without a given height the figure is as tall as its rows plus its header, which
        # ``update`` measures: a title too long for a narrow view wraps to a second line, and
        # a height fixed for one line squashed the rows under it.
        self.fit_height = height is None
        if height is None:
            height = int(min(640, self.max_rows * self.cell_px + 74))
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(
            go.Heatmap(
                z=[[None]],
                zmin=-0.5,
                zmax=len(BLOCK_STATES) - 0.5,
                colorscale=discrete_colorscale([STATE_COLORS[s] for s in BLOCK_STATES]),
                showscale=False,
                xgap=2,
                ygap=2,
                texttemplate="%{text}",
                textfont=dict(size=11),
                hovertemplate="%{customdata}<extra></extra>",
                name="free queue",
            )
        )
        for tr in selection_traces(go, 20, name="held last by the selected request"):
            fig.add_trace(tr)
        for tr in legend_traces(go, STATE_COLORS, STATE_LABELS, (FREE, CACHED)):
            fig.add_trace(tr)
        fig.data[0].showlegend = False
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            xaxis=dict(visible=False, fixedrange=True, autorange=False),
            yaxis=dict(visible=False, fixedrange=True, autorange=False),
            margin=dict(l=10, r=10, t=50, b=BOTTOM_PX),
        )

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        n = len(snapshot.free_queue)
        cell_px = self.cell_px
        d = figure_data(snapshot, None, wrap=self.wrap, owner_labels=cell_px >= 36)
        self.last_data = d
        rows = d["rows"]
        fig = self.figure
        with fig.batch_update():
            hm = fig.data[0]
            self._put("z", hm, "z", d["z"] if n else [[None]], "num")
            # Ids that do not fit their cell (three digits in a 200-block queue) are left to the
            # hover: drawn, they ran into their neighbours.
            font = 11 if cell_px >= 22 else 8
            fits = len(str(max(snapshot.free_queue, default=0))) * 0.65 * font + 2 <= cell_px
            self._put("text", hm, "text", d["text"] if n and fits else [[""] * len(r) for r in d["text"]] if n else [[""]], "str")
            self._put("hover", hm, "customdata", d["customdata"] if n else [[""]], "str")
            self._put("font", hm.textfont, "size", font)
            self._selection_size("hl", fig.data[1], fig.data[2], cell_px - 5)
            self._select(snapshot, selected_request)
            self._put("xr", fig.layout.xaxis, "range", [-0.5, max(MIN_COLUMNS, d["columns"]) - 0.5])
            self._put("yr", fig.layout.yaxis, "range", [max(self.max_rows, rows) - 0.5, -0.5])
            top = self._header(d["title"], [STATE_LABELS[FREE], STATE_LABELS[CACHED]])
            if self.fit_height:
                height = int(min(640, top + max(self.max_rows, rows) * cell_px + BOTTOM_PX))
                self._put("height", fig.layout, "height", height)
                self._put("title.y.fit", fig.layout.title, "y", 1 - 14 / height)  # _header placed it for self.height
            # The two ends are named right under the last row of blocks, in data coordinates:
            # under the plot area (paper y=0) they hung below the rows the pool may fill one
            # day, far from a short queue. "evicted last" ends under the last block, or
            # further right when the last row is too short for both labels side by side.
            col_px = (self.width - 20) / max(MIN_COLUMNS, d["columns"])
            last_x = d["cells"][-1]["x"] if n else 0
            right = min(max(last_x + 1, math.ceil(LABELS_PX / col_px)), max(MIN_COLUMNS, d["columns"])) - 0.5
            under = dict(y=rows - 0.5, xref="x", yref="y", yanchor="top", yshift=-3, showarrow=False, font=dict(size=10))
            notes = [
                dict(under, text="◀ evicted next", x=-0.5, xanchor="left"),
                dict(under, text="evicted last ▶", x=right, xanchor="right"),
            ]
            if not n:
                notes = [
                    dict(text="empty: every block is held by a request", x=(MIN_COLUMNS - 1) / 2, y=0, xref="x", yref="y", showarrow=False)
                ]
            self._put("notes", fig.layout, "annotations", notes)

    def selection_patch(self, snapshot: Snapshot, request_id: str | None) -> dict[str, Any]:
        """The selection mark on the blocks the request held last."""
        assert self.last_data is not None
        mine = [c for c in self.last_data["cells"] if c["last_owner"] is not None and c["last_owner"][0] == request_id]
        return mark_patch(1, 2, [c["x"] for c in mine], [c["y"] for c in mine])
