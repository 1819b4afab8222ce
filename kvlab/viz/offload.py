"""TiersView: the offload tiers behind the GPU pool, step by step (lesson 12).

One row per tier (CPU, then STORAGE = disk), each a strip of its blocks in LRU order --
evicted next on the left, like the free queue -- with empty room on the right. Every block a
tier holds is part of the prefix cache, so it is sky blue, as a cached block in the pool (one
colour, one meaning: ``kvlab/viz/style.py``); empty slots are light grey. What happened in
this step is told by two marks, not colours, one per direction of a copy:

* an ink frame -- *served from here*: this step's prefix hit was read from this tier into the
  GPU. A hit is framed on one tier only: the tier that served it.
* ``+`` before the hash -- *copied in* this step: stored (out of the GPU pool), cascaded (CPU
  slot to file), or promoted: a disk hit is read into a CPU slot on its way to the GPU (the
  CPU tier is the gateway), so the CPU tier gains a copy it did not serve. Framing that CPU
  slot too (as this view once did) drew one hit as two.

The hover names the slot and, for a hit, the request and the GPU block it went to. Below the
strips, the step's transfers in words ("load 2 block(s) disk → GPU [4, 3] for A2"): which
tier served each hit.
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
# The step's two marks (legend names): where a hit was read from; where a block was copied to.
MARK_LABELS = {"served": "hit read from here", "copied_in": "+ copied in here"}
TIER_NAMES = {"CPU": "CPU", "STORAGE": "disk"}
MAX_COLUMNS = 32


def figure_data(snapshot: Snapshot, *, max_columns: int = MAX_COLUMNS) -> dict[str, Any]:
    """The tiers as plain data: ``rows`` (one per tier: ``medium``, ``capacity``, ``cells``
    = [{"hash", "slot", "status", "lru_position", "to", "served", "copied_in"}] in LRU
    order), the heatmap arrays, the step's ``transfers`` in words, ``served`` = {medium:
    blocks loaded this step} and the frames' coordinates ``served_x`` / ``served_y``.

    A cell's ``status`` is "loaded" wherever this step's hit passed through the tier (the
    tier that served it, and the CPU slot a disk hit was promoted into); ``served`` is True
    on the serving tier only, ``copied_in`` on every tier that received a copy (a store, the
    cascade, a promotion) -- the two marks the picture draws."""
    if max_columns < 1:
        raise ValueError(f"max_columns must be >= 1, got {max_columns}")
    stored: set[tuple[str, str]] = set()
    promoted: set[tuple[str, str]] = set()
    loaded: dict[tuple[str, str], tuple[str | None, int]] = {}
    read_from: set[tuple[str, str]] = set()
    lines: list[str] = []
    served: dict[str, int] = {}
    for t in snapshot.transfers:
        for i, (h, m) in enumerate(zip(t.block_hashes, t.media)):
            if t.direction == "store":
                stored.add((m, h))
            else:
                gpu = t.block_ids[i] if i < len(t.block_ids) else -1
                loaded[(m, h)] = (t.request_id, gpu)
                read_from.add((m, h))
                if m != "CPU":
                    loaded[("CPU", h)] = (t.request_id, gpu)  # promoted through the CPU tier
                    promoted.add(("CPU", h))
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
            key = (medium, h)
            status = "loaded" if key in loaded else "stored" if key in stored else "resident"
            cells.append(
                dict(
                    hash=h,
                    slot=slot,
                    status=status,
                    lru_position=pos,
                    to=loaded.get(key),
                    served=key in read_from,
                    copied_in=key in stored or key in promoted,
                )
            )
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
            tr[i] = ("+" if c["copied_in"] else "") + short_hash(c["hash"])[:4]
            hr[i] = (
                f"<b>{r['name']}</b> LRU position {i} (0 = evicted next)<br>hash {short_hash(c['hash'])} · slot "
                f"{c['slot']}<br>{_what_happened(c)}"
            )
        z.append(zr)
        text.append(tr)
        hover.append(hr)
    used = ", ".join(f"{r['name']} {len(r['cells'])}/{r['capacity']}" for r in rows)
    framed = [(c["lru_position"], r["name"]) for r in rows for c in r["cells"][:cols] if c["served"]]
    return dict(
        rows=rows,
        z=z,
        text=text,
        hover=hover,
        columns=cols,
        transfers=lines,
        served=served,
        served_x=[x for x, _ in framed],
        served_y=[y for _, y in framed],
        title=f"Offload tiers · step {snapshot.step} · {used or 'none'}",
    )


def _what_happened(cell: dict[str, Any]) -> str:
    """The hover's last line: what this step did to the block in this tier."""
    if cell["to"] is None:
        return TIER_LABELS[cell["status"]] + (" (copied in)" if cell["copied_in"] else "")
    rid, gpu = cell["to"]
    if cell["served"]:
        return f"served a hit: read from here into GPU block {gpu} for {rid}"
    return f"+ copied in: promoted from disk on its way to GPU block {gpu} for {rid} (the disk served the hit)"


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
                name=MARK_LABELS["served"],
                hoverinfo="skip",
                marker=dict(symbol="square-open", size=22, color=INK, line=dict(width=3, color=INK)),
            )
        )
        # The "+" is cell text; its legend entry shows the cell it is written on.
        labels = dict(TIER_LABELS, stored=MARK_LABELS["copied_in"])
        for tr in legend_traces(go, TIER_COLORS, labels, ("stored", "resident", "free")):
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
            self._put("fx", fig.data[1], "x", d["served_x"], "num")
            self._put("fy", fig.data[1], "y", d["served_y"], "str")
            self._header(d["title"], [*MARK_LABELS.values(), TIER_LABELS["resident"], TIER_LABELS["free"]])
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
