"""Lesson 06 (identity and privacy): the timing attack's picture -- the probe's TTFT for right
and wrong guesses without salts, and the ROC curve of each salting scheme.

The lesson computes the probes, the ROC points and the AUCs itself (that is the lesson);
this module only draws them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = ["timing_attack_figure"]

_LINES = {
    "no salt": dict(color="#d55e00", width=5),
    "secret salt per tenant": dict(color="#009e73", width=2),
    "tenant name as salt": dict(color="#000000", width=2, dash="dash"),
}


def timing_attack_figure(
    probes: tuple[Sequence[bool], Sequence[float]],
    curves: Mapping[str, tuple[Sequence[float], Sequence[float], float]],
    width: int = OUTPUT_WIDTH,
) -> go.Figure:
    """``probes``: (right guess?, TTFT in s) per probe without salts; ``curves``: setting ->
    (false-positive rates, true-positive rates, AUC). Settings drawn on top of each other
    (the same trials) keep a thinner or dashed line so both stay visible."""
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.12,
        subplot_titles=["probe TTFT without salts", "ROC of the timing attack"],
    )
    right, ttft = probes
    for is_right, label, color in ((True, "right guess", "#d55e00"), (False, "wrong guess", "#0072b2")):
        fig.add_histogram(
            x=[t * 1e3 for t, r in zip(ttft, right) if r == is_right],
            name=label,
            marker_color=color,
            opacity=0.6,
            xbins=dict(size=0.5),
            row=1,
            col=1,
        )
    for name, (fpr, tpr, area) in curves.items():
        fig.add_scatter(
            x=list(fpr), y=list(tpr), mode="lines", line=_LINES.get(name, dict(width=2)), row=1, col=2, name=f"{name} (AUC {area:.2f})"
        )
    fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(color="#999999", dash="dot"), name="coin flip", row=1, col=2)
    fig.update_layout(
        barmode="overlay", width=width, height=420, margin=dict(t=40, b=110, l=60, r=20), legend=dict(orientation="h", y=-0.22)
    )
    fig.update_xaxes(title_text="simulated TTFT (ms)", row=1, col=1)
    fig.update_xaxes(title_text="false-positive rate", range=[0, 1], row=1, col=2)
    fig.update_yaxes(title_text="probes", row=1, col=1)
    fig.update_yaxes(title_text="true-positive rate", range=[0, 1], row=1, col=2)
    return go.Figure(fig)
