"""Lessons 04b and 04c (eviction, tail-first freeing, cache pressure): the pictures of who keeps a cached block and for how long.

Plain data in, plotly figures out; the lesson computes the numbers.

* :func:`hit_rate_figure` -- prompt tokens served from the cache against the pool size, one
  line per freeing order;
* :func:`pool_kinds_figure` -- pools side by side, one cell per block: null, free, cached for
  other requests, cached for one document;
* :func:`erosion_figure` -- a document's cached tokens and the TTFT of a question about it,
  after more and more unrelated traffic.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.viz.style import discrete_colorscale
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = ["erosion_figure", "hit_rate_figure", "pool_kinds_figure"]

BLUE, VERMILLION = "#0072b2", "#d55e00"


def hit_rate_figure(sizes: Sequence[int], rates: Mapping[str, Sequence[float]], title: str) -> go.Figure:
    """``rates``: label -> hit rate (0-1) per pool size; the first label is drawn blue, the second vermillion."""
    fig = go.Figure()
    for (label, r), color in zip(rates.items(), (BLUE, VERMILLION, "#009e73")):
        fig.add_scatter(x=list(sizes), y=[100 * x for x in r], mode="lines+markers", name=label, line_color=color)
    fig.update_layout(
        width=700,
        height=360,
        margin=dict(t=50, b=50, l=60, r=20),
        title=title,
        xaxis_title="pool size (blocks of 16 tokens)",
        yaxis_title="hit rate (%)",
        legend=dict(x=0.98, xanchor="right", y=0.05),
    )
    return fig


KINDS = [("null block", "#3b3b3b"), ("free", "#e6e6e6"), ("cached: other requests", "#a9d8f3"), ("cached: the document", BLUE)]


def pool_kinds_figure(snapshots: Mapping[str, Any], document_keys: Collection[str], per_row: int = 20) -> go.Figure:
    """``snapshots``: title -> a ``Snapshot``; a block whose hash is in ``document_keys`` is the document's."""

    def kind(block: Any) -> int:
        if block.state == "null":
            return 0
        return 3 if block.block_hash in document_keys else 2 if block.block_hash else 1

    fig = make_subplots(rows=1, cols=len(snapshots), horizontal_spacing=0.04, subplot_titles=list(snapshots))
    for col, snap in enumerate(snapshots.values(), start=1):
        z = [[kind(b) for b in snap.blocks[r : r + per_row]] for r in range(0, snap.num_blocks, per_row)]
        fig.add_heatmap(
            z=z,
            zmin=-0.5,
            zmax=len(KINDS) - 0.5,
            colorscale=discrete_colorscale([c for _, c in KINDS]),
            showscale=False,
            xgap=2,
            ygap=2,
            hoverinfo="skip",
            row=1,
            col=col,
        )
    for name, color in KINDS:  # legend entries
        fig.add_scatter(x=[None], y=[None], mode="markers", name=name, marker=dict(symbol="square", size=11, color=color))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed")
    fig.update_layout(
        width=OUTPUT_WIDTH, height=330, margin=dict(t=60, b=10, l=10, r=10), plot_bgcolor="white", legend=dict(orientation="h", y=1.2)
    )
    return fig


def erosion_figure(traffic: Sequence[int], cached_tokens: Sequence[int], ttft_ms: Sequence[float]) -> go.Figure:
    fig = go.Figure()
    fig.add_scatter(x=list(traffic), y=list(cached_tokens), mode="lines+markers", name="document tokens from the cache", line_color=BLUE)
    fig.add_scatter(x=list(traffic), y=list(ttft_ms), mode="lines+markers", name="simulated TTFT (ms)", line_color=VERMILLION, yaxis="y2")
    fig.update_layout(
        width=700,
        height=360,
        margin=dict(t=50, b=50, l=60, r=60),
        title="The same question, after more and more traffic",
        xaxis_title="unrelated chats served in between",
        yaxis=dict(title="tokens from the cache"),
        yaxis2=dict(title="TTFT (ms)", overlaying="y", side="right", rangemode="tozero"),
        legend=dict(x=0.98, xanchor="right", y=0.5),
    )
    return fig
