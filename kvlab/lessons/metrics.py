"""Lessons 08a and 08b (metrics, tuning): the charts of vLLM's numbers during and across runs.

Plain data in (rows of ``Timeline.series``, lists of rates, sweeps), plotly figures out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import median
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = ["gains_figure", "gauges_figure", "hit_rate_windows_figure", "idle_histogram_figure", "occupancy_figure", "pool_sweep_figure"]

BLUE, ORANGE, VERMILLION, GREEN, YELLOW = "#0072b2", "#e69f00", "#d55e00", "#009e73", "#b8a800"


def gauges_figure(rows: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Usage, running / waiting requests and the preemption counter, per step (``Timeline.series.rows()``)."""
    steps = [r["step"] for r in rows]
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        row_heights=[0.36, 0.36, 0.28],
        subplot_titles=(
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running (solid), _waiting (dotted)",
            "vllm:num_preemptions (a counter)",
        ),
    )
    fig.add_scatter(x=steps, y=[round(r["kv_cache_usage"], 3) for r in rows], line=dict(color=BLUE), row=1, col=1)
    fig.add_scatter(x=steps, y=[r["num_running"] for r in rows], line=dict(color=BLUE, shape="hv"), row=2, col=1)
    fig.add_scatter(x=steps, y=[r["num_waiting"] for r in rows], line=dict(color=YELLOW, shape="hv", dash="dot"), row=2, col=1)
    fig.add_scatter(x=steps, y=[r["num_preemptions"] for r in rows], line=dict(color=VERMILLION, shape="hv"), row=3, col=1)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=1, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(width=OUTPUT_WIDTH, height=520, showlegend=False, margin=dict(l=50, r=20, t=40, b=40))
    return fig


def hit_rate_windows_figure(window: Sequence[float], cumulative: Sequence[float], change_at: int, every: int = 10) -> go.Figure:
    fig = go.Figure(
        layout=dict(
            width=820,
            height=320,
            margin=dict(l=60, r=20, t=40, b=50),
            title="Prefix-cache hit rate: log window vs counters",
            xaxis_title="requests served",
            yaxis=dict(title="token hit rate", tickformat=".0%"),
            legend=dict(x=0.03, y=0.1),
        )
    )
    x = list(range(1, len(window) + 1, every))
    fig.add_scatter(x=x, y=[round(r, 4) for r in window[::every]], name="rolling window (log line)", line=dict(color=BLUE, width=3))
    fig.add_scatter(
        x=x,
        y=[round(r, 4) for r in cumulative[::every]],
        name="cumulative (Prometheus counters)",
        line=dict(color=ORANGE, width=3, dash="dash"),
    )
    fig.add_vline(x=change_at, line_dash="dot", annotation_text="traffic changes")
    return fig


def occupancy_figure(lengths: Sequence[int], by_block_size: Mapping[int, Sequence[float]]) -> go.Figure:
    """``by_block_size``: block size -> share of the used blocks' slots that hold a token, per length."""
    fig = go.Figure(
        layout=dict(
            width=820,
            height=320,
            margin=dict(l=60, r=20, t=40, b=50),
            title="Share of the used blocks' slots that hold a token",
            xaxis_title="tokens in the request",
            yaxis=dict(title="tokens / slots", tickformat=".0%"),
        )
    )
    for (bs, occ), color in zip(by_block_size.items(), (GREEN, BLUE, ORANGE, VERMILLION)):
        fig.add_scatter(x=list(lengths), y=[round(o, 4) for o in occ], name=f"block size {bs}", line=dict(color=color))
    return fig


def pool_sweep_figure(pools: Sequence[int], preemptions: Sequence[int], ttft_ms: Sequence[float]) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=("vllm:num_preemptions", "median TTFT (ms)"))
    fig.add_bar(x=[str(n) for n in pools], y=list(preemptions), marker_color=VERMILLION, row=1, col=1)
    fig.add_scatter(x=[str(n) for n in pools], y=list(ttft_ms), mode="lines+markers", line=dict(color=BLUE, width=3), row=1, col=2)
    fig.update_xaxes(title_text="blocks in the pool")
    fig.update_layout(width=820, height=300, showlegend=False, margin=dict(l=50, r=20, t=40, b=50))
    return fig


def gains_figure(gains: Mapping[int, float], title: str) -> go.Figure:
    """``gains``: mean output tokens -> throughput gain from caching (a fraction)."""
    fig = go.Figure(
        layout=dict(
            width=820,
            height=300,
            margin=dict(l=60, r=20, t=40, b=50),
            title=title,
            xaxis=dict(title="mean output tokens per request", type="category"),
            yaxis=dict(title="throughput gain from caching", tickformat=".0%"),
        )
    )
    fig.add_bar(
        x=[str(m) for m in gains],
        y=list(gains.values()),
        marker_color=BLUE,
        text=[f"{g:.0%}" for g in gains.values()],
        textposition="outside",
    )
    return fig


def idle_histogram_figure(idle_by_pool: Mapping[int, Sequence[float]]) -> go.Figure:
    """``idle_by_pool``: pool blocks -> idle seconds before eviction of each sampled block (log bins, medians dashed)."""
    fig = go.Figure(
        layout=dict(
            width=820,
            height=340,
            margin=dict(l=60, r=20, t=40, b=50),
            title="vllm:kv_block_idle_before_evict_seconds (sampled blocks; dashed: median)",
            xaxis=dict(title="idle time before eviction (simulated s, log scale)", type="log"),
            yaxis_title="evicted blocks per bin",
            legend=dict(x=0.02, y=0.95),
        )
    )
    edges = [0.01 * 1.35**k for k in range(27)]
    centers = [(lo * hi) ** 0.5 for lo, hi in zip(edges, edges[1:])]
    for (nb, idle), color in zip(idle_by_pool.items(), (VERMILLION, ORANGE, BLUE, GREEN)):
        idle = [max(x, 0.01) for x in idle]
        counts = [sum(lo <= x < hi for x in idle) for lo, hi in zip(edges, edges[1:])]
        fig.add_scatter(x=centers, y=counts, mode="lines", line=dict(shape="hvh", color=color, width=2.5), name=f"{nb} blocks")
        fig.add_vline(x=median(idle), line=dict(color=color, dash="dash", width=1.5))
    return fig
