"""Two engines' pools and the KV handed between them (lesson 13, disaggregated prefill).

The prefill engine's pool on top, the decode engine's below, each at the step where the
request's KV crossed: the prefill engine *saved* the prompt from its blocks (outlined),
the decode engine *loaded* it into blocks of its own (outlined) -- different block ids,
the same keys and values, through the files in the middle. Arrows pair the blocks in
table order. Both pools are drawn from each engine's saved event log (its Timeline).
"""

from __future__ import annotations

import os
from typing import Any

from kvlab.timeline.snapshot import BLOCK_STATES, Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import _go
from kvlab.viz.style import FONT, INK, STATE_COLORS, STATE_INDEX, STATE_LABELS, discrete_colorscale


def find_transfer(timeline: Timeline, request_id: str, direction: str) -> int | None:
    """The first step whose transfers include ``direction`` for ``request_id``."""
    for step in range(1, timeline.last_step + 1):
        if any(t.request_id == request_id and t.direction == direction for t in timeline.at(step).transfers):
            return step
    return None


def figure_data(prefill: Snapshot, decode: Snapshot, request_id: str) -> dict[str, Any]:
    """Both pools' block states, the request's saved and loaded blocks, and the pairs."""
    saved = [t for t in prefill.transfers if t.request_id == request_id and t.direction == "store"]
    loaded = [t for t in decode.transfers if t.request_id == request_id and t.direction == "load"]
    if not saved or not loaded:
        raise ValueError(
            f"no hand-off of {request_id!r} in these snapshots (saved: {bool(saved)}, loaded: {bool(loaded)}); "
            "pick the steps with find_transfer()"
        )
    s, l_ = saved[0], loaded[0]
    pairs = list(zip(s.block_ids, l_.block_ids))
    return dict(
        prefill_states=[b.state for b in prefill.blocks],
        decode_states=[b.state for b in decode.blocks],
        saved_blocks=list(s.block_ids),
        loaded_blocks=list(l_.block_ids),
        pairs=pairs,
        saved_tokens=s.num_tokens,
        loaded_tokens=l_.num_tokens,
        folder=os.path.basename(s.paths[0]) if s.paths else "",
        title=(
            f"{request_id}: the prefill engine saved {s.num_tokens} tokens from its blocks {s.block_ids};<br>"
            f"the decode engine loaded {l_.num_tokens} of them into its blocks {l_.block_ids}"
        ),
    )


def transfer_figure(prefill: Timeline, decode: Timeline, request_id: str, *, width: int = 760) -> Any:
    """A plotly figure of the hand-off of ``request_id`` (steps found in each timeline)."""
    ps, ds = find_transfer(prefill, request_id, "store"), find_transfer(decode, request_id, "load")
    if ps is None or ds is None:
        raise ValueError(f"{request_id!r} was not handed over between these two runs")
    d = figure_data(prefill.at(ps), decode.at(ds), request_id)
    go = _go()
    n = max(len(d["prefill_states"]), len(d["decode_states"]))
    z = [[STATE_INDEX[x] for x in d["prefill_states"]], [None] * n, [STATE_INDEX[x] for x in d["decode_states"]]]
    text = [[str(i) for i in range(len(d["prefill_states"]))], [""] * n, [str(i) for i in range(len(d["decode_states"]))]]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=10),
            zmin=-0.5,
            zmax=len(BLOCK_STATES) - 0.5,
            colorscale=discrete_colorscale([STATE_COLORS[s] for s in BLOCK_STATES]),
            showscale=False,
            xgap=2,
            ygap=2,
            hoverinfo="skip",
        )
    )
    for row, ids in ((0, d["saved_blocks"]), (2, d["loaded_blocks"])):
        fig.add_trace(
            go.Scatter(
                x=ids,
                y=[row] * len(ids),
                mode="markers",
                hoverinfo="skip",
                showlegend=False,
                marker=dict(symbol="square-open", size=18, color=INK, line=dict(width=3, color=INK)),
            )
        )
    for src, dst in d["pairs"]:
        fig.add_annotation(
            x=dst,
            y=2,
            ax=src,
            ay=0,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=3,
            arrowwidth=1.5,
            arrowcolor="#555",
            standoff=9,
            startstandoff=9,
        )
    fig.add_annotation(
        x=max(max(d["saved_blocks"] + d["loaded_blocks"]) + 2, (n - 1) / 2),
        y=1,
        xanchor="left",
        text=f"files: {d['folder'][:12]}…/layers.*.kv  ({d['saved_tokens']} tokens saved, {d['loaded_tokens']} loaded)",
        showarrow=False,
        font=dict(size=10),
        bgcolor="white",
    )
    fig.update_layout(
        width=width,
        height=300,
        font=dict(family=FONT, size=11),
        margin=dict(l=120, r=10, t=70, b=20),
        title=dict(text=d["title"], font=dict(size=12), x=0.01),
        xaxis=dict(visible=False),
        plot_bgcolor="white",
        yaxis=dict(tickvals=[0, 1, 2], ticktext=[f"prefill pool (step {ps})", "", f"decode pool (step {ds})"], autorange="reversed"),
    )
    for s in ("in_use", "cached", "free"):
        fig.add_trace(
            go.Scatter(
                x=[None], y=[None], mode="markers", name=STATE_LABELS[s], marker=dict(symbol="square", size=11, color=STATE_COLORS[s])
            )
        )
    fig.update_layout(showlegend=True, legend=dict(orientation="h", y=-0.05, x=0))
    return fig
