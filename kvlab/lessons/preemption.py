"""Lessons 05a and 05b (the token budget, preemption and recompute): the token budget's picture --
tokens scheduled per request per step, and each step's simulated time, for two runs side by
side -- and the work of each preemption counted from a run's event log (what swapping would
have copied, what recompute computes again)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.eventlog.events import BlocksFreed, RequestPreempted, RequestScheduled
from kvlab.timeline.timeline import Timeline
from kvlab.utils.notebook_display import OUTPUT_WIDTH

__all__ = ["PreemptionWork", "budget_figure", "gantt_figure", "peak_blocks_swapped_out", "preemption_work"]


def budget_figure(runs: Mapping[str, Any], budget: int, colors: Mapping[str, str]) -> go.Figure:
    """``runs``: title -> an engine's ``EventLog``. Upper row: tokens scheduled per step, one
    colour per request of ``colors``; lower row: the step's simulated time; a dotted line at
    ``budget`` over the first run."""
    fig = make_subplots(
        rows=2,
        cols=len(runs),
        shared_xaxes=True,
        shared_yaxes="rows",
        row_heights=[0.62, 0.38],
        vertical_spacing=0.09,
        horizontal_spacing=0.05,
        subplot_titles=list(runs),
    )
    for col, log in enumerate(runs.values(), start=1):
        rows: dict[int, dict[str, int]] = {}
        for e in log:
            if isinstance(e, RequestScheduled):
                rows.setdefault(e.step, {})[e.request_id] = e.num_tokens
        steps = sorted(rows)
        for rid, c in colors.items():
            y = [rows[s].get(rid, 0) for s in steps]
            fig.add_trace(
                go.Bar(
                    x=steps,
                    y=y,
                    name=rid,
                    marker_color=c,
                    legendgroup=rid,
                    showlegend=col == 1,
                    text=[n if n > 1 else "" for n in y],
                    textposition="inside",
                ),
                row=1,
                col=col,
            )
        series = Timeline(log).series  # per step, from the log's StepFinished records
        t = [0.0] + series.time
        fig.add_trace(
            go.Bar(
                x=series.step,
                y=[1000 * (b - a) for a, b in zip(t, t[1:])],
                marker_color="#999999",
                name="step time (ms)",
                showlegend=col == 1,
            ),
            row=2,
            col=col,
        )
    fig.add_hline(y=budget, line_dash="dot", line_color="#d55e00", row=1, col=1, annotation_text=f"budget {budget}")
    fig.update_layout(
        barmode="stack",
        width=OUTPUT_WIDTH,
        height=430,
        margin=dict(l=50, r=20, t=40, b=40),
        legend=dict(orientation="h", y=-0.12),
        bargap=0.15,
    )
    fig.update_yaxes(title_text="tokens scheduled", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2)
    return go.Figure(fig)


@dataclass(frozen=True, slots=True)
class PreemptionWork:
    """One preemption, counted from a run's event log: what the victim gave up and what it
    took to get it back. ``blocks_held`` is what swapping would have copied to CPU memory at
    the preemption and back at the resume; ``recomputed_tokens`` is what recompute computes
    again: the tokens it had computed, minus those its prefix lookup found in the GPU pool
    (``hit_tokens``) and those a KV connector loaded (``loaded_tokens``, the CPU tier of
    lesson 12)."""

    request_id: str
    step: int
    resumed_at: int | None
    tokens_lost: int
    blocks_held: int
    hit_tokens: int
    loaded_tokens: int

    @property
    def recomputed_tokens(self) -> int:
        return max(0, self.tokens_lost - self.hit_tokens - self.loaded_tokens)


def preemption_work(log: Iterable[Any]) -> list[PreemptionWork]:
    """Every preemption of a run, in order (see :class:`PreemptionWork`)."""
    events = list(log)
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, RequestPreempted):
            continue
        held = next(
            (
                len(f.block_ids)
                for f in reversed(events[:i])
                if isinstance(f, BlocksFreed) and f.request_id == e.request_id and f.step == e.step
            ),
            0,
        )
        back = next(
            (s for s in events[i + 1 :] if isinstance(s, RequestScheduled) and s.request_id == e.request_id and s.phase == "resumed"), None
        )
        lost = e.num_computed_tokens_lost
        hit = min(back.num_cached_tokens - back.num_external_tokens, lost) if back else 0
        loaded = min(back.num_external_tokens, lost - hit) if back else 0
        out.append(PreemptionWork(e.request_id, e.step, back.step if back else None, lost, held, hit, loaded))
    return out


def peak_blocks_swapped_out(work: Iterable[PreemptionWork]) -> int:
    """The most blocks that swapping would have held in CPU memory at once: each victim's
    blocks from its preemption until its resume."""
    deltas: dict[int, int] = {}
    for w in work:
        deltas[w.step] = deltas.get(w.step, 0) + w.blocks_held
        if w.resumed_at is not None:
            deltas[w.resumed_at] = deltas.get(w.resumed_at, 0) - w.blocks_held
    peak = level = 0
    for step in sorted(deltas):
        level += deltas[step]
        peak = max(peak, level)
    return peak


def gantt_figure(timeline: Timeline, title: str, width: int = OUTPUT_WIDTH, height: int = 330) -> go.Figure:
    """Each request's state per step over a whole run (a still copy of kvlab's TimelineView)."""
    from kvlab.viz import TimelineView

    v = TimelineView(timeline, width=width, height=height)
    v.update(timeline.at(timeline.last_step))
    v.figure.layout.title.text = title
    return go.Figure(v.figure)
