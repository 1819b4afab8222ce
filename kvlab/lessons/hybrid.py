"""Lesson 07b (hybrid models): the pictures of groups that do not look alike.

* :func:`block_layout_figure` -- one request's block tables laid out along the token axis, one
  row per group, each block as wide as the tokens it holds: groups of different block sizes
  side by side, the hash boundaries every ``hash_block_size`` tokens, null blocks grey and a
  prefix hit's length as a line;
* :func:`held_blocks_figure` -- blocks a request really holds per group as its context grows;
* :func:`bytes_per_token_figure` -- the KV bytes one token costs in one layer, per kind of layer.

They take plain data (block ids, token counts), read from a manager or an event log by the
lesson; nothing here touches the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from kvlab.timeline.snapshot import NULL
from kvlab.viz.style import FONT, INK, STATE_COLORS
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = ["block_layout_figure", "held_blocks_figure", "bytes_per_token_figure"]

# One colour per meaning in every kvlab picture (kvlab.viz.style): a held block is "in use"
# green whatever its group, the null block dark grey; groups are told apart by their row
# labels, curves by line styles, and the hit's length is drawn in ink like the lookup walk.
_HELD = STATE_COLORS["in_use"]
_LINES = (
    dict(color=INK, dash="solid"),
    dict(color="#6e6e6e", dash="dash"),
    dict(color=INK, dash="dot"),
    dict(color="#6e6e6e", dash="dashdot"),
    dict(color=INK, dash="longdash"),
    dict(color="#9e9e9e", dash="solid"),
)


def block_layout_figure(
    rows: Sequence[tuple[str, Sequence[int], int]],
    num_tokens: int,
    hash_block_size: int,
    hit_tokens: int | None = None,
    title: str = "",
    width: int = OUTPUT_WIDTH,
) -> go.Figure:
    """``rows``: (label, block ids of one group's table, that group's block size)."""
    fig = go.Figure()
    shapes, notes = [], []
    for r, (label, ids, bs) in enumerate(rows):
        y0, y1 = r - 0.38, r + 0.38
        for i, bid in enumerate(ids):
            x0, x1 = i * bs, min((i + 1) * bs, max(num_tokens, (i + 1) * bs))
            color = STATE_COLORS[NULL] if bid == 0 else _HELD
            shapes.append(dict(type="rect", x0=x0, x1=x1, y0=y0, y1=y1, fillcolor=color, line=dict(color="white", width=2), layer="below"))
            notes.append(
                dict(
                    x=(x0 + x1) / 2,
                    y=r,
                    text="∅" if bid == 0 else str(bid),
                    showarrow=False,
                    font=dict(family=FONT, size=12, color="white"),
                )
            )
    for t in range(hash_block_size, num_tokens + 1, hash_block_size):
        shapes.append(dict(type="line", x0=t, x1=t, y0=-0.6, y1=len(rows) - 0.4, line=dict(color="#999999", width=1, dash="dot")))
    if hit_tokens is not None:
        shapes.append(dict(type="line", x0=hit_tokens, x1=hit_tokens, y0=-0.75, y1=len(rows) - 0.45, line=dict(color=INK, width=3)))
        notes.append(
            dict(
                x=hit_tokens,
                y=-0.72,
                text=f"hit: {hit_tokens} tokens",
                showarrow=False,
                xanchor="right" if hit_tokens > 0.75 * num_tokens else "left",  # the label stays inside the plot
                yanchor="bottom",
                font=dict(family=FONT, size=12, color=INK),
            )
        )
    fig.add_scatter(
        x=[0, num_tokens], y=[-0.9, len(rows) - 0.5], mode="markers", marker=dict(opacity=0), hoverinfo="skip", showlegend=False
    )
    fig.update_layout(
        title=title,
        width=width,
        height=110 + 70 * len(rows),
        margin=dict(l=190, r=20, t=50, b=45),
        shapes=shapes,
        annotations=notes,
        plot_bgcolor="white",
        xaxis=dict(title=f"token position (dotted: a hash every {hash_block_size} tokens)", range=[0, num_tokens], showgrid=False),
        yaxis=dict(tickvals=list(range(len(rows))), ticktext=[label for label, _, _ in rows], autorange="reversed", showgrid=False),
    )
    return fig


def held_blocks_figure(curves: Mapping[str, tuple[Sequence[int], Sequence[int]]], title: str, width: int = 760) -> go.Figure:
    """``curves``: name -> (tokens in context, blocks held) per step."""
    fig = go.Figure(
        layout=dict(
            width=width,
            height=330,
            margin=dict(l=60, r=20, t=40, b=50),
            title=title,
            xaxis_title="tokens computed",
            yaxis_title="blocks held (null blocks not counted)",
            legend=dict(x=0.02, y=0.98),
            plot_bgcolor="white",
            yaxis=dict(rangemode="tozero"),
        )
    )
    for (name, (x, y)), style in zip(curves.items(), _LINES):
        fig.add_scatter(x=list(x), y=list(y), name=name, mode="lines", line=dict(style, width=3, shape="hv"))
    return fig


def bytes_per_token_figure(rows: Sequence[tuple[str, int]], title: str, width: int = 760) -> go.Figure:
    """``rows``: (kind of layer, bytes one token costs in one layer)."""
    fig = go.Figure(
        layout=dict(
            width=width,
            height=300,
            margin=dict(l=230, r=40, t=40, b=50),
            title=title,
            xaxis_title="bytes per token per layer",
            plot_bgcolor="white",
        )
    )
    fig.add_bar(
        y=[r[0] for r in rows],
        x=[r[1] for r in rows],
        orientation="h",
        marker_color="#6e6e6e",
        text=[f"{r[1]:,} B" for r in rows],
        textposition="outside",
        cliponaxis=False,
    )
    fig.update_yaxes(autorange="reversed")
    return fig
