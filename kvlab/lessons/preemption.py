"""Lesson 05 (preemption): the token budget's picture -- tokens scheduled per request per step,
and each step's simulated time, for two runs side by side."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.timeline.events import RequestScheduled
from kvlab.timeline.timeline import Timeline

__all__ = ["budget_figure"]


def budget_figure(runs: Mapping[str, Any], budget: int, colors: Mapping[str, str]) -> go.Figure:
    """``runs``: title -> an engine's ``EventLog``. Upper row: tokens scheduled per step, one
    colour per request of ``colors``; lower row: the step's simulated time; a dotted line at
    ``budget`` over the first run."""
    fig = make_subplots(rows=2, cols=len(runs), shared_xaxes=True, shared_yaxes="rows", row_heights=[0.62, 0.38],
                        vertical_spacing=0.09, horizontal_spacing=0.05, subplot_titles=list(runs))
    for col, log in enumerate(runs.values(), start=1):
        rows: dict[int, dict[str, int]] = {}
        for e in log:
            if isinstance(e, RequestScheduled):
                rows.setdefault(e.step, {})[e.request_id] = e.num_tokens
        steps = sorted(rows)
        for rid, c in colors.items():
            y = [rows[s].get(rid, 0) for s in steps]
            fig.add_trace(go.Bar(x=steps, y=y, name=rid, marker_color=c, legendgroup=rid, showlegend=col == 1,
                                 text=[n if n > 1 else "" for n in y], textposition="inside"), row=1, col=col)
        series = Timeline(log).series  # per step, from the log's StepFinished records
        t = [0.0] + series.time
        fig.add_trace(go.Bar(x=series.step, y=[1000 * (b - a) for a, b in zip(t, t[1:])], marker_color="#999999",
                             name="step time (ms)", showlegend=col == 1), row=2, col=col)
    fig.add_hline(y=budget, line_dash="dot", line_color="#d55e00", row=1, col=1, annotation_text=f"budget {budget}")
    fig.update_layout(barmode="stack", width=900, height=430, margin=dict(l=50, r=20, t=40, b=40),
                      legend=dict(orientation="h", y=-0.12), bargap=0.15)
    fig.update_yaxes(title_text="tokens scheduled", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2)
    return go.Figure(fig)
