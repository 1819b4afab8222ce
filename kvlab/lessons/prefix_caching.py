"""Lesson 03 (prefix caching): the TTFT chart of two workloads, caching off and on.

It takes plain data -- per workload the requests in arrival order and each run's TTFT per
request -- so the lesson keeps its numbers and this module keeps the plotting recipe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = ["ttft_figure"]

OFF, ON = "#999999", "#0072b2"


def ttft_figure(runs: Mapping[str, tuple[Sequence[str], Sequence[float], Sequence[float]]], width: int = OUTPUT_WIDTH) -> go.Figure:
    """``runs``: workload name -> (request ids in arrival order, TTFT in s with caching off, with caching on)."""
    fig = make_subplots(rows=1, cols=len(runs), subplot_titles=list(runs), horizontal_spacing=0.07)
    for col, (ids, off, on) in enumerate(runs.values(), start=1):
        for ttft, label, color in ((off, "caching off", OFF), (on, "caching on", ON)):
            fig.add_scatter(
                x=list(range(len(ids))),
                y=[t * 1e3 for t in ttft],
                hovertext=list(ids),
                mode="lines+markers",
                name=label,
                line_color=color,
                legendgroup=label,
                showlegend=col == 1,
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="request, in arrival order", row=1, col=col)
    fig.update_yaxes(title_text="simulated TTFT (ms)", row=1, col=1)
    fig.update_layout(width=width, height=380, margin=dict(t=60, b=50, l=60, r=20), legend=dict(orientation="h", y=1.16))
    return go.Figure(fig)
