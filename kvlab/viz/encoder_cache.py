"""EncoderCacheView: the encoder cache at one step (lesson 14).

A bar as long as the cache (in encoder embeddings), cut into one segment per cached item:
green while requests still need it (their computed tokens have not passed the item),
sky blue once nobody does -- still cached, and evicted oldest first when room is needed --
and grey for the free room. Below it, the step's decisions: which items the encoder ran
("encode"), which a request found cached by hash ("reuse").
"""

from __future__ import annotations

from typing import Any

from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces
from kvlab.viz.style import CACHED, FREE, IN_USE, STATE_COLORS, html_escape

ENCODER_COLORS = {"referenced": STATE_COLORS[IN_USE], "freeable": STATE_COLORS[CACHED], "free": STATE_COLORS[FREE]}
ENCODER_LABELS = {"referenced": "needed by a request", "freeable": "cached, unreferenced (evictable)", "free": "free"}


def figure_data(snapshot: Snapshot) -> dict[str, Any]:
    """``segments`` = [{"mm_hash", "start", "length", "status", "requests"}] across the
    cache (entries first, free room last), the step's ``decisions`` in words, ``title``."""
    ec = snapshot.encoder_cache
    if ec is None:
        return dict(segments=[], decisions=[], cache_size=0, title=f"Encoder cache · step {snapshot.step} · none")
    segments = []
    at = 0
    order = {h: i for i, h in enumerate(ec.freeable)}
    for e in ec.entries:
        status = "referenced" if e.requests else "freeable"
        segments.append(
            dict(
                mm_hash=e.mm_hash, start=at, length=e.num_embeds, status=status, requests=list(e.requests), evict_rank=order.get(e.mm_hash)
            )
        )
        at += e.num_embeds
    if at < ec.cache_size:
        segments.append(dict(mm_hash="", start=at, length=ec.cache_size - at, status="free", requests=[], evict_rank=None))
    decisions = [f"{'encode' if computed else 'reuse'} {h} for {rid}" for rid, h, computed in ec.scheduled]
    return dict(
        segments=segments,
        decisions=decisions,
        cache_size=ec.cache_size,
        title=f"Encoder cache · step {snapshot.step} · {ec.num_used}/{ec.cache_size} embeddings",
    )


class EncoderCacheView(View):
    """Pass to ``Player(views=(..., EncoderCacheView))``."""

    name = "encoder"
    title = "Encoder cache"

    def __init__(self, timeline: Timeline | None = None, *, decode: Any = None, width: int = 482, height: int = 220) -> None:
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(
            go.Bar(
                x=[],
                y=[],
                base=[],
                orientation="h",
                marker=dict(color=[], line=dict(color="white", width=2)),
                text=[],
                textposition="inside",
                insidetextanchor="middle",
                hovertext=[],
                hovertemplate="%{hovertext}<extra></extra>",
                showlegend=False,
            )
        )
        for tr in legend_traces(go, ENCODER_COLORS, ENCODER_LABELS, ("referenced", "freeable", "free")):
            fig.add_trace(tr)
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            barmode="overlay",
            yaxis=dict(visible=False, fixedrange=True),
            xaxis=dict(title="embeddings", fixedrange=True),
            margin=dict(l=12, r=12, t=50, b=80),
        )

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot)
        self.last_data = d
        segs = d["segments"]
        fig = self.figure
        with fig.batch_update():
            bar = fig.data[0]
            self._put("x", bar, "x", [s["length"] for s in segs], "num")
            self._put("y", bar, "y", ["cache"] * len(segs), "str")
            self._put("base", bar, "base", [s["start"] for s in segs], "num")
            self._put("color", bar.marker, "color", [ENCODER_COLORS[s["status"]] for s in segs], "str")
            self._put("text", bar, "text", [s["mm_hash"] for s in segs], "str")
            self._put(
                "hover",
                bar,
                "hovertext",
                [
                    html_escape(
                        f"{s['mm_hash'] or 'free'}: {s['length']} embeddings, "
                        + (f"needed by {', '.join(s['requests'])}" if s["requests"] else ENCODER_LABELS[s["status"]])
                    )
                    for s in segs
                ],
                "str",
            )
            self._put("xr", fig.layout.xaxis, "range", [0, max(1, d["cache_size"])])
            self._header(d["title"], [ENCODER_LABELS[k] for k in ("referenced", "freeable", "free")])
            note = "; ".join(d["decisions"]) or "no encoder work this step"
            self._put(
                "notes",
                fig.layout,
                "annotations",
                [
                    dict(
                        text=html_escape(note),
                        x=0,
                        y=0,
                        xref="paper",
                        yref="paper",
                        xanchor="left",
                        yanchor="top",
                        yshift=-36,
                        showarrow=False,
                        font=dict(size=10),
                    )
                ],
            )
