"""TimelineView: the whole run at a glance, with a cursor at the current step (lesson 05).

Top: KV-cache usage and the step's prefix-cache hit rate. Middle: how many requests are
running and waiting, and where preemptions happened. Bottom: a Gantt chart -- one row per
request, one column per step, coloured waiting / loading (a connector's KV on its way,
blocks held) / running / preempted (waiting again after losing its KV) / finished. The numbers are the ones the engine itself reports at the end
of every step (``StepFinished`` events, vLLM's ``/metrics`` gauges, read through
``Timeline.series``), so the picture and a Prometheus dashboard of the same run would
agree; hovering a point shows the simulated clock at that step.

Only the cursor moves when the player steps; the data is recomputed only when the log
grows (live mode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go
from kvlab.viz.style import (
    CURSOR,
    DARK_YELLOW,
    HIT,
    SELECT_INNER,
    SELECT_OUTER,
    STATUS_COLORS,
    STATUS_ORDER,
    USAGE,
    discrete_colorscale,
    html_escape,
)
from kvlab.utils.math_utils import cdiv

_STATUS_INDEX = {s: i for i, s in enumerate(STATUS_ORDER)}
MAX_ROW_LABELS = 24
LABEL_PX = 12  # a Gantt row label needs this many pixels, or only every k-th row is named
LEGEND_LABELS = ("KV usage %", "hit rate %", "# running", "# waiting", "preemption") + STATUS_ORDER


GANTT_SHARE = 0.54  # the Gantt's share of the plot area (the two charts above take the rest)
CHROME_PX = 110  # title, legend and margins: the part of the height no chart gets


def gantt_height(num_requests: int) -> int:
    """The view's height for a run of ``num_requests``: at least 400 px, and tall enough
    that each of the first ``MAX_ROW_LABELS`` rows gets ``LABEL_PX`` and so its own name.

    Why: plotly names only every k-th row when the rows are thinner than a label, and the
    row left unnamed may be the one the lesson is about (the capstone's preempted request
    was). Beyond ``MAX_ROW_LABELS`` rows every k-th row is named, and the selected one."""
    rows = min(num_requests, MAX_ROW_LABELS)
    return max(400, CHROME_PX + cdiv(rows * LABEL_PX * 100, int(GANTT_SHARE * 100)))


def run_data(timeline: Timeline | None) -> dict[str, Any]:
    """Per-step metrics and the per-request status grid, all from the Timeline.

    ``steps`` runs from the first to the last step of the log; the metric lists (``usage``
    and ``hit_rate`` in percent, ``running``, ``waiting``, ``time`` = the simulated clock,
    ``preemptions`` = this step's count) have one entry per step, None where the step did
    not finish. ``status[rid][i]`` is the request's status at the end of ``steps[i]``
    (None before it arrived and after the step it finished in).
    """
    if timeline is None or not timeline.num_events:
        return dict(
            steps=[0], requests=[], status={}, usage=[None], hit_rate=[None], running=[None], waiting=[None], preemptions=[0], time=[None]
        )
    steps = list(range(timeline.first_step, timeline.last_step + 1))
    n = len(steps)
    idx = {s: i for i, s in enumerate(steps)}
    usage: list[float | None] = [None] * n
    hit_rate: list[float | None] = [None] * n
    running: list[int | None] = [None] * n
    waiting: list[int | None] = [None] * n
    time: list[float | None] = [None] * n
    preemptions = [0] * n
    series = timeline.series
    for k, s in enumerate(series.step):
        i = idx[s]
        usage[i] = 100.0 * series.kv_cache_usage[k]
        running[i], waiting[i] = series.num_running[k], series.num_waiting[k]
        rate = series.hit_rate[k]
        hit_rate[i] = None if rate is None else 100.0 * rate
        time[i] = series.time[k]
        preemptions[i] = series.preemptions[k]
    status = timeline.request_status(steps)
    if not len(series):
        # No scheduler steps (a manager driven directly, e.g. by an exercise checker): the
        # usage comes from the blocks held, the queue lengths from the requests' statuses.
        held = timeline.block_usage
        for s, i in idx.items():
            if s in held:
                usage[i] = 100.0 * held[s]
            running[i] = sum(1 for r in status.values() if r[i] == "running")
            waiting[i] = sum(1 for r in status.values() if r[i] in ("waiting", "loading", "preempted"))
    return dict(
        steps=steps,
        requests=list(status),
        status=status,
        usage=usage,
        hit_rate=hit_rate,
        running=running,
        waiting=waiting,
        preemptions=preemptions,
        time=time,
    )


def figure_data(
    snapshot: Snapshot, selected_request: str | None = None, *, timeline: Timeline | None = None, run: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``run_data`` of the timeline plus the cursor (the snapshot's step), the Gantt matrix
    ``z`` (status indices) and the row of the selected request."""
    d = dict(run if run is not None else run_data(timeline))
    reqs = d["requests"]
    d["z"] = [[None if st is None else _STATUS_INDEX[st] for st in d["status"][r]] for r in reqs]
    d["cursor"] = snapshot.step
    d["selected_row"] = reqs.index(selected_request) if selected_request in reqs else None
    return d


class TimelineView(View):
    """Usage, hits, queue lengths, preemptions and a Gantt of requests, with a step cursor."""

    name = "timeline"
    title = "Timeline"

    def __init__(
        self, timeline: Timeline | None = None, *, decode: Callable[[int], str] | None = None, width: int = 482, height: int | None = None
    ) -> None:
        if height is None:
            height = gantt_height(len(timeline.request_ids) if timeline is not None else 0)
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="lines+markers",
                name="KV usage %",
                showlegend=True,
                line=dict(color=USAGE, width=2),
                marker=dict(size=4),
                hovertemplate="step %{x} · t = %{customdata:.3f} s<br>KV usage %{y:.0f}%<extra></extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name="hit rate %",
                showlegend=True,
                marker=dict(color=HIT, size=7, symbol="diamond", line=dict(width=0.5, color="#333333")),
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(x=[], y=[], mode="lines", name="# running", showlegend=True, line=dict(color=STATUS_COLORS["running"], shape="hv")),
            row=2,
            col=1,
        )
        fig.add_trace(
            go.Scatter(x=[], y=[], mode="lines", name="# waiting", showlegend=True, line=dict(color=DARK_YELLOW, shape="hv", dash="dot")),
            row=2,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name="preemption",
                showlegend=True,
                marker=dict(color=STATUS_COLORS["preempted"], size=10, symbol="x"),
            ),
            row=2,
            col=1,
        )
        fig.add_trace(
            go.Heatmap(
                z=[[None]],
                zmin=-0.5,
                zmax=len(STATUS_ORDER) - 0.5,
                colorscale=discrete_colorscale([STATUS_COLORS[s] for s in STATUS_ORDER]),
                showscale=False,
                xgap=1,
                ygap=1,
                hovertemplate="%{text} · step %{x}: %{customdata}<extra></extra>",
                name="requests",
                showlegend=False,
            ),
            row=3,
            col=1,
        )
        for s in STATUS_ORDER:
            fig.add_trace(
                go.Scatter(x=[None], y=[None], mode="markers", name=s, marker=dict(symbol="square", size=10, color=STATUS_COLORS[s])),
                row=3,
                col=1,
            )
        # The selection mark around a request's row: a black frame with a white one inside.
        self._sel = len(fig.data)
        for color, line_px in ((SELECT_OUTER, 3.0), (SELECT_INNER, 1.5)):
            fig.add_trace(
                go.Scatter(
                    x=[], y=[], mode="lines", line=dict(color=color, width=line_px), hoverinfo="skip", showlegend=False, name="selected"
                ),
                row=3,
                col=1,
            )
        fig.update_layout(
            showlegend=True,
            legend=dict(TOP_LEGEND, font=dict(size=9)),
            margin=dict(l=10, r=10, t=70, b=30),
            hovermode="closest",
        )
        fig.update_yaxes(fixedrange=True, tickfont=dict(size=9))
        fig.update_xaxes(fixedrange=True, showgrid=False)
        fig.update_yaxes(range=[-6, 106], title=dict(text="%", font=dict(size=9), standoff=2), row=1, col=1)
        fig.update_yaxes(title=dict(text="reqs", font=dict(size=9), standoff=2), rangemode="tozero", row=2, col=1)
        fig.update_yaxes(autorange=False, automargin=True, row=3, col=1)
        fig.update_xaxes(title=dict(text="step", font=dict(size=10), standoff=2), row=3, col=1)
        self._run: dict[str, Any] | None = None
        self._run_n = -1

    def _make_figure(self) -> Any:
        from plotly.subplots import make_subplots

        base = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.05, row_heights=[0.24, 0.22, GANTT_SHARE])
        base.update_layout(self._base_layout())
        return base

    def _run_of(self) -> dict[str, Any]:
        """``run_data`` of the timeline, recomputed only when the log has grown."""
        n = self.timeline.num_events if self.timeline is not None else 0
        if self._run is None or n != self._run_n:
            self._run = run_data(self.timeline)
            self._run_n = n
        return self._run

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot, None, run=self._run_of())
        self.last_data = d
        fig = self.figure
        steps = d["steps"]
        reqs = d["requests"]
        put = self._put  # unchanged arrays (all of them, between two steps of a replay) are skipped
        with fig.batch_update():
            for i, key in enumerate(("usage", "hit_rate", "running", "waiting")):
                put(f"{key}.x", fig.data[i], "x", steps, "num")
                put(f"{key}.y", fig.data[i], "y", d[key], "num")
            put("usage.time", fig.data[0], "customdata", d["time"], "num")
            px = [s for s, n in zip(steps, d["preemptions"]) if n]
            put("pre.x", fig.data[4], "x", px, "num")
            put("pre.y", fig.data[4], "y", [d["running"][steps.index(s)] or 0 for s in px], "num")
            hm = fig.data[5]
            put("gantt.x", hm, "x", steps, "num")
            put("gantt.xgap", hm, "xgap", 1 if len(steps) * 4 < self.width else 0)  # no stripes on long runs
            put("gantt.y", hm, "y", list(range(len(reqs))) or [0], "num")
            put("gantt.z", hm, "z", d["z"] if reqs else [[None]], "num")
            put("gantt.status", hm, "customdata", [[st or "—" for st in d["status"][r]] for r in reqs] or [["—"]], "str")
            names = [html_escape(r) for r in reqs]  # request ids are the user's text: never markup
            put("gantt.names", hm, "text", [[r] * len(steps) for r in names] or [[""]], "str")
            top = max((v for v in d["running"] + d["waiting"] if v is not None), default=1)
            put("y2.dtick", fig.layout.yaxis2, "dtick", 1 if top <= 6 else None)
            put("y2.range", fig.layout.yaxis2, "range", [-0.3, top + 0.5])
            put("x3.range", fig.layout.xaxis3, "range", [steps[0] - 0.5, steps[-1] + 0.5])
            put("y3.range", fig.layout.yaxis3, "range", [max(len(reqs), 1) - 0.5, -0.5])
            shapes = [
                dict(
                    type="line",
                    xref="x",
                    yref="paper",
                    x0=d["cursor"],
                    x1=d["cursor"],
                    y0=0,
                    y1=1,
                    line=dict(color=CURSOR, width=1.5, dash="dash"),
                )
            ]
            put("shapes", fig.layout, "shapes", shapes)
            at = steps.index(d["cursor"]) if d["cursor"] in steps else None
            usage = d["usage"][at] if at is not None else None
            peak = max((u for u in d["usage"] if u is not None), default=None)
            extra = f" · usage {usage:.0f}%" if usage is not None else ""
            if peak is not None and (usage is None or peak - usage >= 0.5):
                extra += f" (peak {peak:.0f}%)"
            self._header(f"Timeline · step {d['cursor']} of {steps[-1]}{extra}", LEGEND_LABELS, legend_font=9)
            self._select(snapshot, selected_request)

    def selectable(self, snapshot: Snapshot) -> list[str]:
        """Every request of the run: the Gantt spans it."""
        assert self.last_data is not None
        return list(self.last_data["requests"])

    def selection_patch(self, snapshot: Snapshot, request_id: str | None) -> dict[str, Any]:
        """A frame around the request's Gantt row, and its name in bold among the row names.
        Beyond ``MAX_ROW_LABELS`` rows every k-th row is named: the selected one always, and
        its neighbours give way so that names never overlap."""
        d = self.last_data
        assert d is not None
        reqs, steps = d["requests"], d["steps"]
        names = [html_escape(r) for r in reqs]  # request ids are the user's text: never markup
        gantt_px = GANTT_SHARE * (self.height - CHROME_PX)
        every = max(1, cdiv(len(reqs), MAX_ROW_LABELS), cdiv(len(reqs) * LABEL_PX, max(int(gantt_px), 1)))
        sel = reqs.index(request_id) if request_id in reqs else None
        ticks = [i for i in range(len(reqs)) if (i % every == 0 and (sel is None or abs(i - sel) >= every)) or i == sel]
        frame: list[dict[str, list[float]]] = [{"x": [], "y": []}, {"x": [], "y": []}]
        if sel is not None and steps:
            x0, x1 = steps[0] - 0.5, steps[-1] + 0.5
            frame = [{"x": [x0, x1, x1, x0, x0], "y": [sel - p, sel - p, sel + p, sel + p, sel - p]} for p in (0.5, 0.36)]
        return {
            "traces": {str(self._sel): frame[0], str(self._sel + 1): frame[1]},
            "layout": {
                "yaxis3.tickvals": ticks,
                "yaxis3.ticktext": [f"<b>▶ {names[i]}</b>" if i == sel else names[i] for i in ticks],
            },
        }
