"""The routing comparison as one picture (lesson 11): per trace, each policy's prefix-cache
hit rate, its simulated TTFT (mean and p90) and how its prefill work spread over the
replicas.

``figure_data(rows)`` takes the rows of ``RoutingResult.row()`` (plain dicts: trace, policy,
hit_rate, ttft_mean, ttft_p90, prefill_per_replica, ...) -- the view never sees the fleet,
the router or a socket -- and ``routing_figure(rows)`` draws them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.utils.notebook_display import OUTPUT_WIDTH
from kvlab.viz.base import _go
from kvlab.viz.style import FONT, INK, REPLICA_GREYS, WHITE

# Policies are told apart by a hatching in ink on white, not by a colour: every colour of
# kvlab's pictures already means something -- sky blue is "cached" (a KV-aware bar in it read
# as "the cache"), blue "running", orange "shared", the greys free / finished / null -- and the
# third panel's greys are the replicas. A hatching means nothing anywhere else.
POLICY_PATTERNS = {"round_robin": "/", "least_loaded": "-", "kv_aware": "x"}
OTHER_POLICY_PATTERNS = (".", "|", "+", "\\")


def policy_pattern(policy: str, others: list[str]) -> str:
    """A policy's hatching (plotly's ``marker.pattern.shape``): fixed for the three standard
    ones, then from a short list in order of appearance."""
    if policy in POLICY_PATTERNS:
        return POLICY_PATTERNS[policy]
    if policy not in others:
        others.append(policy)
    return OTHER_POLICY_PATTERNS[others.index(policy) % len(OTHER_POLICY_PATTERNS)]


def _hatched(shape: str) -> dict[str, Any]:
    """A bar's marker: white, outlined and hatched in ink."""
    return dict(color=WHITE, line=dict(width=1, color=INK), pattern=dict(shape=shape, fgcolor=INK, bgcolor=WHITE, solidity=0.3))


def figure_data(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Group the rows by trace: ``traces`` (in order), ``policies`` (in order, with their
    ``patterns``), and per (trace, policy): ``hit_rate``, ``ttft_mean_ms``, ``ttft_p90_ms``,
    ``prefill_share`` (each replica's share of the trace's prefill work, in %) and
    ``imbalance`` (busiest / mean)."""
    traces: list[str] = []
    policies: list[str] = []
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        t, p = str(r["trace"]), str(r["policy"])
        if t not in traces:
            traces.append(t)
        if p not in policies:
            policies.append(p)
        work = list(r["prefill_per_replica"])
        total = sum(work) or 1
        cells[(t, p)] = dict(
            hit_rate=100 * float(r["hit_rate"]),
            ttft_mean_ms=1e3 * float(r["ttft_mean"]),
            ttft_p90_ms=1e3 * float(r["ttft_p90"]),
            prefill_share=[100 * w / total for w in work],
            imbalance=float(r["imbalance"]),
        )
    others: list[str] = []
    patterns = {p: policy_pattern(p, others) for p in policies}
    return dict(traces=traces, policies=policies, patterns=patterns, cells=cells)


def routing_figure(rows: Sequence[Mapping[str, Any]], *, width: int = OUTPUT_WIDTH, height: int = 330) -> Any:
    """Three panels: hit rate, TTFT (bar = mean, ink diamond = p90 on its policy's bar, log
    scale), prefill work per replica (one stacked bar per policy: equal slices = even load)."""
    from plotly.subplots import make_subplots

    go = _go()
    d = figure_data(rows)
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        subplot_titles=("prefix-cache hit rate (%)", "TTFT (ms, simulated):<br>bar mean, ◆ p90", "prefill work<br>per replica (%)"),
    )
    # Panels 1-2: numeric x, each policy at its own offset inside its trace's slot, so a p90
    # marker sits exactly on its mean bar.
    n_pol = max(1, len(d["policies"]))
    width_each = 0.8 / n_pol
    for j, p in enumerate(d["policies"]):
        marker = _hatched(d["patterns"][p])
        ts = [i for i, t in enumerate(d["traces"]) if (t, p) in d["cells"]]
        xs = [i - 0.4 + width_each * (j + 0.5) for i in ts]
        cell = [d["cells"][(d["traces"][i], p)] for i in ts]
        fig.add_trace(
            go.Bar(
                x=xs,
                y=[v["hit_rate"] for v in cell],
                width=width_each * 0.95,
                name=p,
                marker=marker,
                legendgroup=p,
                text=[f"{v['hit_rate']:.0f}" for v in cell],
                textposition="outside",
                cliponaxis=False,
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=xs,
                y=[v["ttft_mean_ms"] for v in cell],
                width=width_each * 0.95,
                name=p,
                marker=marker,
                legendgroup=p,
                showlegend=False,
                hovertemplate=f"{p}: mean %{{y:.0f}} ms<extra></extra>",
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[v["ttft_p90_ms"] for v in cell],
                mode="markers",
                name=f"{p} p90",
                legendgroup=p,
                showlegend=False,
                marker=dict(symbol="diamond", size=9, color=INK, line=dict(width=1, color=WHITE)),
                hovertemplate=f"{p}: p90 %{{y:.0f}} ms<extra></extra>",
            ),
            row=1,
            col=2,
        )
    for col in (1, 2):
        fig.update_xaxes(tickvals=list(range(len(d["traces"]))), ticktext=d["traces"], range=[-0.5, len(d["traces"]) - 0.5], row=1, col=col)
    # prefill shares: x = "trace / policy", one stacked segment per replica
    cats, shares = [], []
    for t in d["traces"]:
        for p in d["policies"]:
            if (t, p) in d["cells"]:
                cats.append([t, p])
                shares.append(d["cells"][(t, p)]["prefill_share"])
    n_rep = max((len(s) for s in shares), default=0)
    base = [0.0] * len(shares)
    x = [[c[0] for c in cats], [c[1] for c in cats]]
    for k in range(n_rep):
        y = [s[k] if k < len(s) else 0.0 for s in shares]
        # One barmode per figure: stack by hand with `base`.
        fig.add_trace(
            go.Bar(
                x=x,
                y=y,
                base=list(base),
                marker=dict(color=REPLICA_GREYS[k % len(REPLICA_GREYS)], line=dict(color=WHITE, width=1)),
                name=f"replica {k}",
                showlegend=False,
                hovertemplate=f"replica {k}: %{{y:.0f}} %<extra></extra>",
            ),
            row=1,
            col=3,
        )
        base = [b + v for b, v in zip(base, y)]
    fig.update_annotations(font_size=12)  # the three titles fit over their panels at OUTPUT_WIDTH
    fig.update_layout(
        width=width,
        height=height,
        barmode="overlay",
        font=dict(family=FONT, size=11),
        paper_bgcolor="white",
        plot_bgcolor="white",
        margin=dict(l=40, r=10, t=60, b=40),
        legend=dict(orientation="h", y=-0.3, x=0),
        bargap=0.25,
    )
    fig.update_yaxes(range=[0, 108], row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_yaxes(range=[0, 100], row=1, col=3)
    fig.update_xaxes(tickfont=dict(size=9), row=1, col=3)
    return fig


__all__ = ["figure_data", "policy_pattern", "routing_figure"]
