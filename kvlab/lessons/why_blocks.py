"""Lesson 01 (why blocks): the pictures behind "one buffer per request versus a pool of blocks".

The notebook keeps its cells short; the drawing code lives here. Three pictures:

* :func:`layout_figure` -- the same requests at the same moment, laid out slot by slot in one
  contiguous buffer per request (Orca-style, reserved for the maximum length) and in a pool
  of blocks (drawn from a real kvlab engine's block tables), coloured by what each slot holds;
* :func:`waste_figure` -- the PagedAttention paper's Fig. 2 (share of KV memory by use),
  kvlab's simulated bars beside the paper's;
* :func:`sweep_figure` -- the block-size sweep: internal waste versus block-table size.

The accounting follows :mod:`kvlab.workloads.memory_sim`: *token states* hold a computed token, *reserved*
slots are held for tokens the request will produce later, *internal fragmentation* is held
memory no token will ever fill, *external fragmentation* is free memory that cannot serve
the request that must go next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.timeline.snapshot import Snapshot
from kvlab.viz.style import FONT
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = [
    "CATEGORIES",
    "COLORS",
    "LABELS",
    "ToyRequest",
    "contiguous_slots",
    "paged_slots",
    "count",
    "layout_figure",
    "waste_figure",
    "sweep_figure",
]

CATEGORIES = ("token", "reserved", "internal", "external", "free")
LABELS = {
    "token": "token states",
    "reserved": "reserved (for later tokens)",
    "internal": "internal fragmentation",
    "external": "external fragmentation",
    "free": "free, usable",
}
# Okabe-Ito colours; green = token states, as "in use" is green in every kvlab view.
COLORS = {
    "token": "#009e73",
    "reserved": "#f0e442",
    "internal": "#d55e00",
    "external": "#cc79a7",
    "free": "#e6e6e6",
}


@dataclass(frozen=True, slots=True)
class ToyRequest:
    """A request of the toy example: ``prompt`` tokens, then ``output`` tokens."""

    name: str
    prompt: int
    output: int

    @property
    def final_len(self) -> int:
        return self.prompt + self.output


Slot = tuple[str, str]  # (category, request name or "")


def contiguous_slots(held: dict[str, int], requests: Sequence[ToyRequest], capacity: int, max_len: int) -> tuple[list[Slot], list[str]]:
    """One buffer of ``max_len`` slots per request, placed first-fit in admission order.

    ``held[name]`` is how many token states the request holds now. A request that does not
    fit waits, and then every free slot is external fragmentation: none can hold it.
    Returns the slots (category, owner) and the names admitted.
    """
    slots: list[Slot] = []
    admitted: list[str] = []
    waiting = False
    for r in requests:
        if waiting or len(slots) + max_len > capacity:
            waiting = True
            continue
        n = held[r.name]
        slots += [("token", r.name)] * n
        slots += [("reserved", r.name)] * (r.final_len - n)
        slots += [("internal", r.name)] * (max_len - r.final_len)
        admitted.append(r.name)
    rest = "external" if waiting else "free"
    slots += [(rest, "")] * (capacity - len(slots))
    return slots, admitted


def paged_slots(snapshot: Snapshot) -> list[Slot]:
    """The pool of a kvlab snapshot, slot by slot (the null block 0 left out).

    A slot of a request's block holds a token state if its position is below the request's
    ``num_computed_tokens``; the rest of its last block is internal fragmentation. Every
    other block is free -- and usable by any request.
    """
    bs = snapshot.block_size
    slots: list[Slot] = [("free", "")] * ((snapshot.num_blocks - 1) * bs)
    for rid in snapshot.running:
        r = snapshot.requests[rid]
        for i, bid in enumerate(r.block_table[0]):
            for off in range(bs):
                cat = "token" if i * bs + off < r.num_computed_tokens else "internal"
                slots[(bid - 1) * bs + off] = (cat, rid)
    return slots


def count(slots: Sequence[Slot]) -> dict[str, int]:
    """Slots per category."""
    out = {c: 0 for c in CATEGORIES}
    for c, _ in slots:
        out[c] += 1
    return out


def layout_figure(rows: Sequence[tuple[str, Sequence[Slot]]], block_size: int, *, width: int = OUTPUT_WIDTH) -> Any:
    """The rows of slots as one picture: a cell per slot, the owner's name on its token
    states, thin gaps between slots and a thicker line every ``block_size`` slots in rows
    whose title mentions "block"."""
    import plotly.graph_objects as go

    n = max(len(s) for _, s in rows)
    idx = {c: i for i, c in enumerate(CATEGORIES)}
    z, text, hover = [], [], []
    for _, slots in rows:
        z.append([idx[c] for c, _ in slots] + [None] * (n - len(slots)))
        text.append([o if c == "token" else "" for c, o in slots] + [""] * (n - len(slots)))
        hover.append([f"slot {i}: {LABELS[c]}" + (f" ({o})" if o else "") for i, (c, o) in enumerate(slots)] + [""] * (n - len(slots)))
    k = len(CATEGORIES)
    scale = []
    for i, c in enumerate(CATEGORIES):
        scale += [[i / k, COLORS[c]], [(i + 1) / k, COLORS[c]]]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            customdata=hover,
            texttemplate="%{text}",
            textfont=dict(size=10),
            zmin=-0.5,
            zmax=k - 0.5,
            colorscale=scale,
            showscale=False,
            xgap=1,
            ygap=10,
            hovertemplate="%{customdata}<extra></extra>",
        )
    )
    for c in CATEGORIES:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=LABELS[c],
                marker=dict(symbol="square", size=12, color=COLORS[c], line=dict(width=1, color="#777")),
            )
        )
    for y, (title, _) in enumerate(rows):
        if "block" in title:
            for x in range(0, n + 1, block_size):
                fig.add_shape(type="line", x0=x - 0.5, x1=x - 0.5, y0=y - 0.42, y1=y + 0.42, line=dict(color="#333", width=2))
    fig.update_layout(
        width=width,
        height=110 + 70 * len(rows),
        margin=dict(l=10, r=10, t=40, b=30),
        font=dict(family=FONT, size=11),
        plot_bgcolor="white",
        paper_bgcolor="white",
        legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom", font=dict(size=10)),
        xaxis=dict(
            title=dict(text="slot (one token's K/V in every layer)", font=dict(size=10)),
            showgrid=False,
            zeroline=False,
            fixedrange=True,
            dtick=4,
        ),
        yaxis=dict(tickvals=list(range(len(rows))), ticktext=[t for t, _ in rows], autorange="reversed", fixedrange=True, automargin=True),
    )
    return fig


def waste_figure(results: Sequence[Any], paper: dict[str, tuple[float | None, ...]], *, width: int = OUTPUT_WIDTH) -> Any:
    """Stacked bars of the memory split, kvlab (simulated) beside the paper for each design,
    with the number of preemptions of each kvlab run above its bar (the shares do not count the
    recomputation they cause).

    ``results``: :class:`kvlab.workloads.memory_sim.SimResult` rows (max, pow2, oracle, paged(16)).
    ``paper``: strategy -> (token states, reservation, internal, external) in %; ``None``
    where the paper gives no bar (vLLM's bar gives only its token states).
    """
    import plotly.graph_objects as go

    names = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)", "paged": "paged, block 16"}
    groups: list[str] = []
    sources: list[str] = []
    values: dict[str, list[float | None]] = {c: [] for c in CATEGORIES}
    for r in results:
        groups += [names[r.strategy]] * 2
        sources += ["kvlab", "paper"]
        ours = (r.token_states_pct, r.reservation_pct, r.internal_pct, r.external_pct, r.free_pct)
        theirs = tuple(paper[r.strategy]) + (None,)
        for c, a, b in zip(CATEGORIES, ours, theirs):
            values[c] += [a, b]
    fig = go.Figure()
    for c in CATEGORIES:
        fig.add_trace(
            go.Bar(
                x=[groups, sources],
                y=values[c],
                name=LABELS[c].replace(" (for later tokens)", ""),
                marker=dict(color=COLORS[c], line=dict(color="#555", width=0.5)),
                text=[f"{v:.1f}" if v is not None and v >= 4 else "" for v in values[c]],
                textposition="inside",
                insidetextanchor="middle",
                textfont=dict(size=10),
                hovertemplate="%{x}: %{y:.1f} %<extra>" + LABELS[c] + "</extra>",
            )
        )
    # What the shares do not show: how often a design ran out of memory and preempted a request
    # (its tokens are recomputed later). The paged run buys its 97 % with many preemptions.
    fig.add_trace(
        go.Scatter(
            x=[[names[r.strategy] for r in results], ["kvlab"] * len(results)],
            y=[103] * len(results),
            mode="text",
            text=[f"{r.num_preemptions:,} preempted" for r in results],
            textfont=dict(size=10, color="#b00020"),
            showlegend=False,
            hovertemplate="%{text} while serving the 1,000 requests<extra></extra>",
        )
    )
    fig.update_layout(
        barmode="stack",
        width=width,
        height=430,
        margin=dict(l=50, r=10, t=70, b=60),
        font=dict(family=FONT, size=11),
        plot_bgcolor="white",
        paper_bgcolor="white",
        title=dict(text="Where KV memory goes — share of the KV cache, % (paper: Kwon et al. 2023, Fig. 2)", x=0.01, font=dict(size=13)),
        legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=10)),
        yaxis=dict(title="% of KV memory", range=[0, 108], tickvals=[0, 20, 40, 60, 80, 100], fixedrange=True, gridcolor="#eee"),
        xaxis=dict(fixedrange=True),
    )
    return fig


def sweep_figure(
    block_sizes: Sequence[int], internal: dict[str, Sequence[float]], table_entries: Sequence[float], *, width: int = OUTPUT_WIDTH
) -> Any:
    """Block-size sweep: internal fragmentation (% of KV memory, one line per trace) and
    the mean block-table length of a ShareGPT-like request (log scale), with the paper's
    best range 16-128 shaded."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=("internal fragmentation (% of KV memory)", "block-table entries per request"),
    )
    styles = {"ShareGPT-like": ("#0072b2", "solid"), "Alpaca-like": ("#d55e00", "dash")}
    for name, ys in internal.items():
        color, dash = styles.get(name, ("#333", "solid"))
        fig.add_trace(
            go.Scatter(x=list(block_sizes), y=list(ys), name=name, mode="lines+markers", line=dict(color=color, dash=dash)), row=1, col=1
        )
    fig.add_trace(
        go.Scatter(
            x=list(block_sizes),
            y=list(table_entries),
            name="ShareGPT-like, mean table length",
            mode="lines+markers",
            line=dict(color="#009e73"),
            showlegend=True,
        ),
        row=1,
        col=2,
    )
    for col in (1, 2):
        fig.add_vrect(x0=16, x1=128, fillcolor="#56b4e9", opacity=0.18, line_width=0, row=1, col=col)
        fig.update_xaxes(
            type="log",
            tickvals=list(block_sizes),
            ticktext=[str(b) for b in block_sizes],
            title=dict(text="block size (tokens)", font=dict(size=10)),
            fixedrange=True,
            row=1,
            col=col,
        )
    fig.update_yaxes(rangemode="tozero", fixedrange=True, gridcolor="#eee", row=1, col=1)
    ticks = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    fig.update_yaxes(type="log", fixedrange=True, gridcolor="#eee", tickvals=ticks, ticktext=[str(t) for t in ticks], row=1, col=2)
    for xref in ("x", "x2"):
        fig.add_annotation(
            x=math.log10(45),
            y=0.97,
            xref=xref,
            yref="paper",
            yanchor="top",
            showarrow=False,
            text="16–128: best<br>on ShareGPT<br>(paper)",
            font=dict(size=9, color="#2a6f97"),
        )
    fig.update_layout(
        width=width,
        height=380,
        margin=dict(l=50, r=10, t=60, b=50),
        font=dict(family=FONT, size=11),
        plot_bgcolor="white",
        paper_bgcolor="white",
        legend=dict(orientation="h", x=0, y=-0.28, font=dict(size=10)),
    )
    return fig
