"""TiersView: the offload tiers behind the GPU pool, step by step (lesson 12).

One row per tier (CPU, then STORAGE = disk), each a strip of its blocks in LRU order --
evicted next on the left, like the free queue -- with empty room on the right. Every block a
tier holds is part of the prefix cache, so it is sky blue, as a cached block in the pool (one
colour, one meaning: ``kvlab/viz/style.py``); empty slots are light grey. What happened in
this step is told by marks, not colours: ``+`` before the hash -- *stored* this step (copied
out of the GPU pool); an ink frame -- *loaded* this step, i.e. this step's prefix hit was
served from here (copied back to the GPU). The hover names the slot and, for a loaded block,
the request and the GPU block it went to. Below the strips, the step's transfers in words
("load 2 block(s) disk → GPU [4, 3] for A2"): which tier served each hit.
"""

from __future__ import annotations

from typing import Any

from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces
from kvlab.viz.style import CACHED, FREE, INK, STATE_COLORS, discrete_colorscale, short_hash

TIER_STATUS = ("free", "resident", "stored", "loaded")
# A tier holds prefix-cache entries: every entry is "cached" (sky blue); the step's events are marks.
TIER_COLORS = {"free": STATE_COLORS[FREE], "resident": STATE_COLORS[CACHED], "stored": STATE_COLORS[CACHED], "loaded": STATE_COLORS[CACHED]}
TIER_LABELS = {"free": "empty slot", "resident": "cached in the tier", "stored": "+ stored this step", "loaded": "loaded this step (a hit)"}
TIER_NAMES = {"CPU": "CPU", "STORAGE": "disk"}
MAX_COLUMNS = 32


def figure_data(snapshot: Snapshot, *, max_columns: int = MAX_COLUMNS) -> dict[str, Any]:
    """The tiers as plain data: ``rows`` (one per tier: ``medium``, ``capacity``, ``cells``
    = [{"hash", "slot", "status", "lru_position"}] in LRU order), the heatmap arrays, the
    step's ``transfers`` in words and ``served`` = {medium: blocks loaded this step}."""
    if max_columns < 1:
        raise ValueError(f"max_columns must be >= 1, got {max_columns}")
    stored: set[tuple[str, str]] = set()
    loaded: dict[tuple[str, str], tuple[str | None, int]] = {}
    lines: list[str] = []
    served: dict[str, int] = {}
    for t in snapshot.transfers:
        for i, (h, m) in enumerate(zip(t.block_hashes, t.media)):
            if t.direction == "store":
                stored.add((m, h))
            else:
                gpu = t.block_ids[i] if i < len(t.block_ids) else -1
                loaded[(m, h)] = (t.request_id, gpu)
                if m != "CPU":
                    loaded[("CPU", h)] = (t.request_id, gpu)  # promoted through the CPU tier
                served[m] = served.get(m, 0) + 1
        where = "/".join(TIER_NAMES.get(m, m) for m in dict.fromkeys(t.media))
        if t.direction == "load":
            lines.append(f"load {len(t.media)} block(s) {where} → GPU {t.block_ids} for {t.request_id}")
        elif t.block_ids:
            lines.append(f"store GPU {t.block_ids} → {where} ({t.request_id})")
        else:
            lines.append(f"cascade {len(t.media)} block(s) CPU → {where} (files)")
    rows: list[dict[str, Any]] = []
    for medium, tier in snapshot.tiers.items():
        cells: list[dict[str, Any]] = []
        for pos, (h, slot) in enumerate(tier.entries):
            status = "loaded" if (medium, h) in loaded else "stored" if (medium, h) in stored else "resident"
            cells.append(dict(hash=h, slot=slot, status=status, lru_position=pos, to=loaded.get((medium, h))))
        rows.append(dict(medium=medium, name=TIER_NAMES.get(medium, medium), capacity=tier.capacity, cells=cells))
    cols = min(max_columns, max((r["capacity"] for r in rows), default=1))
    z: list[list[float | None]] = []
    text: list[list[str]] = []
    hover: list[list[str]] = []
    for r in rows:
        room = min(cols, r["capacity"])  # beyond a small tier's capacity: nothing drawn
        zr: list[float | None] = [TIER_STATUS.index("free")] * room + [None] * (cols - room)
        tr, hr = [""] * cols, [f"{r['name']}: empty slot"] * room + [""] * (cols - room)
        for c in r["cells"][:cols]:
            i = c["lru_position"]
            zr[i] = TIER_STATUS.index(c["status"])
            tr[i] = ("+" if c["status"] == "stored" else "") + short_hash(c["hash"])[:4]
            to = f"<br>loaded into GPU block {c['to'][1]} for {c['to'][0]}" if c["to"] else ""
            hr[i] = (
                f"<b>{r['name']}</b> LRU position {i} (0 = evicted next)<br>hash {short_hash(c['hash'])} · slot "
                f"{c['slot']}<br>{TIER_LABELS[c['status']]}{to}"
            )
        z.append(zr)
        text.append(tr)
        hover.append(hr)
    used = ", ".join(f"{r['name']} {len(r['cells'])}/{r['capacity']}" for r in rows)
    frame_x = [c["lru_position"] for r in rows for c in r["cells"][:cols] if c["status"] == "loaded"]
    frame_y = [r["name"] for r in rows for c in r["cells"][:cols] if c["status"] == "loaded"]
    return dict(
        rows=rows,
        z=z,
        text=text,
        hover=hover,
        columns=cols,
        transfers=lines,
        served=served,
        loaded_x=frame_x,
        loaded_y=frame_y,
        title=f"Offload tiers · step {snapshot.step} · {used or 'none'}",
    )


class TiersView(View):
    """The tiers' LRU strips and the step's transfers (pass to ``Player(views=(..., TiersView))``)."""

    name = "tiers"
    title = "Offload tiers"

    def __init__(self, timeline: Timeline | None = None, *, decode: Any = None, width: int = 482, height: int = 260) -> None:
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(
            go.Heatmap(
                z=[[None]],
                zmin=-0.5,
                zmax=len(TIER_STATUS) - 0.5,
                colorscale=discrete_colorscale([TIER_COLORS[s] for s in TIER_STATUS]),
                showscale=False,
                xgap=2,
                ygap=6,
                texttemplate="%{text}",
                textfont=dict(size=9),
                hovertemplate="%{customdata}<extra></extra>",
                name="tiers",
            )
        )
        fig.data[0].showlegend = False
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name=TIER_LABELS["loaded"],
                hoverinfo="skip",
                marker=dict(symbol="square-open", size=22, color=INK, line=dict(width=3, color=INK)),
            )
        )
        for tr in legend_traces(go, TIER_COLORS, TIER_LABELS, ("resident", "free")):
            fig.add_trace(tr)
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            xaxis=dict(visible=False, fixedrange=True),
            yaxis=dict(fixedrange=True, autorange="reversed", tickfont=dict(size=11)),
            margin=dict(l=48, r=10, t=50, b=70),
        )

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot)
        self.last_data = d
        fig = self.figure
        with fig.batch_update():
            hm = fig.data[0]
            names = [r["name"] for r in d["rows"]] or ["(no tiers)"]
            self._put("z", hm, "z", d["z"] or [[None]], "num")
            self._put("text", hm, "text", d["text"] or [[""]], "str")
            self._put("hover", hm, "customdata", d["hover"] or [[""]], "str")
            self._put("y", hm, "y", names, "str")
            cell = max(8, (self.width - 70) / max(1, d["columns"]) - 3)
            self._put("fsize", fig.data[1].marker, "size", cell)
            self._put("fx", fig.data[1], "x", d["loaded_x"], "num")
            self._put("fy", fig.data[1], "y", d["loaded_y"], "str")
            self._header(d["title"] + "  (+ = stored this step)", [TIER_LABELS[s] for s in ("loaded", "resident", "free")])
            note = "<br>".join(d["transfers"][:4]) or "no transfers this step"
            self._put(
                "notes",
                fig.layout,
                "annotations",
                [
                    dict(
                        text="◀ evicted next",
                        x=0,
                        y=0,
                        xref="paper",
                        yref="paper",
                        xanchor="left",
                        yanchor="top",
                        yshift=-2,
                        showarrow=False,
                        font=dict(size=10),
                    ),
                    dict(
                        text=note,
                        x=0,
                        y=0,
                        xref="paper",
                        yref="paper",
                        xanchor="left",
                        yanchor="top",
                        yshift=-18,
                        showarrow=False,
                        align="left",
                        font=dict(size=10),
                    ),
                ],
            )
