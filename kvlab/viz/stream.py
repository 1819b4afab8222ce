"""Watching a KV-event stream: its per-batch series, and a player for live or recorded streams
(lesson 10).

* :class:`StreamSeriesView` -- per batch: blocks the engine caches (line), blocks stored
  (bars up) and removed (bars down), and where batches were lost (marks on the axis);
  a cursor at the batch shown.
* :class:`StreamPlayer` -- a :class:`~kvlab.viz.prefix_index.PrefixIndexView` and the
  series over one :class:`~kvlab.timeline.kv_stream.KVStream`, with a slider and Play.
  ``follow=True`` keeps it at the newest batch while the stream grows (call
  :meth:`StreamPlayer.refresh` after appending -- a live loop does). A recording loaded
  with ``KVStream.load`` plays in the very same player.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlab.timeline.kv_stream import KVStream, StreamSeries
from kvlab.viz.base import TOP_LEGEND, View, _go
from kvlab.viz.prefix_index import PrefixIndexView
from kvlab.viz.style import CURSOR, INK, MISS, STATE_COLORS, html_escape
from kvlab.utils.math_utils import cdiv


MAX_BARS = 240  # beyond this many batches the stored/removed bars are summed per bin


def _joined_seqs(series: StreamSeries) -> list[int]:
    """x of each batch: its seq, with each run after a publisher restart (seq back to 0)
    placed after the one before, so the axis keeps going forward."""
    restarts = series.restarts
    x: list[int] = []
    offset = 0
    for i, seq in enumerate(series.seq):
        if i and i < len(restarts) and restarts[i]:
            offset = x[-1] + 1
        x.append(seq + offset)
    return x


def series_data(series: StreamSeries, cursor: int | None = None, *, max_bars: int = MAX_BARS) -> dict[str, Any]:
    """The series as plot data: x = seq (runs after a publisher restart joined end to end);
    ``cached`` per batch; ``bar_x`` / ``stored`` (up) / ``removed`` (negative) per batch, or
    summed per bin of batches when there are more than ``max_bars`` (``bin`` = batches per
    bar); ``lost_at`` (x right after a loss), ``cleared_at``, ``restarted_at`` and the
    cursor's x."""
    n = len(series.seq)
    xs = _joined_seqs(series)
    lost_at = [xs[i] for i in range(n) if series.missing[i] > (series.missing[i - 1] if i else 0)]
    restarted_at = [xs[i] for i in range(1, n) if i < len(series.restarts) and series.restarts[i]]
    k = max(1, cdiv(n, max_bars))
    bar_x, stored, removed = [], [], []
    for a in range(0, n, k):
        bar_x.append(xs[min(n - 1, a + k // 2)])
        stored.append(sum(series.stored_blocks[a : a + k]))
        removed.append(-sum(series.removed_blocks[a : a + k]))
    return dict(
        x=xs,
        cached=list(series.cached_blocks),
        bar_x=bar_x,
        stored=stored,
        removed=removed,
        bin=k,
        lost_at=lost_at,
        cleared_at=[xs[i] for i in range(n) if series.cleared[i]],
        restarted_at=restarted_at,
        cursor=None if cursor is None or not 0 <= cursor < n else xs[cursor],
        title=f"{n} batches · {sum(series.events)} events · {series.missing[-1] if n else 0} batches lost"
        + (f" · {len(restarted_at)} publisher restart{'s' if len(restarted_at) != 1 else ''}" if restarted_at else "")
        + (f" · bars: sums of {k} batches" if k > 1 else ""),
    )


class StreamSeriesView(View):
    """Blocks cached, stored and removed per batch of one stream."""

    name = "series"
    title = "The stream, batch by batch"

    def __init__(self, *, width: int = 760, height: int = 250) -> None:
        super().__init__(None, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(go.Bar(x=[], y=[], name="stored", marker_color=STATE_COLORS["in_use"], yaxis="y2"))
        fig.add_trace(go.Bar(x=[], y=[], name="removed", marker_color=MISS, yaxis="y2"))
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name="cached blocks", line=dict(color=STATE_COLORS["cached"], width=2.5)))
        fig.add_trace(
            go.Scatter(x=[], y=[], mode="markers", name="batches lost before", marker=dict(symbol="triangle-up", size=10, color=INK))
        )
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            barmode="relative",
            bargap=0.1,
            xaxis=dict(title=dict(text="batch seq", font=dict(size=10), standoff=2), fixedrange=True),
            yaxis=dict(title=dict(text="cached blocks", font=dict(size=10)), fixedrange=True, rangemode="tozero"),
            yaxis2=dict(
                title=dict(text="stored / removed", font=dict(size=10)), overlaying="y", side="right", fixedrange=True, showgrid=False
            ),
            margin=dict(l=56, r=56, t=70, b=36),
        )

    def update(self, stream: KVStream, cursor: int | None = None) -> None:  # type: ignore[override]  # drawn from a KV-event stream, not an engine Snapshot
        d = series_data(stream.series, cursor)
        self.last_data = d
        fig = self.figure
        put = self._put
        with fig.batch_update():
            put("st.x", fig.data[0], "x", d["bar_x"], "num")
            put("st.y", fig.data[0], "y", d["stored"], "num")
            put("rm.x", fig.data[1], "x", d["bar_x"], "num")
            top = max([1] + d["stored"] + [-v for v in d["removed"]])
            put("y2r", fig.layout.yaxis2, "range", [-1.1 * top, 1.1 * top])
            put("rm.y", fig.data[1], "y", d["removed"], "num")
            put("c.x", fig.data[2], "x", d["x"], "num")
            put("c.y", fig.data[2], "y", d["cached"], "num")
            put("l.x", fig.data[3], "x", d["lost_at"], "num")
            put("l.y", fig.data[3], "y", [0] * len(d["lost_at"]), "num")
            shapes = (
                []
                if d["cursor"] is None
                else [
                    dict(
                        type="line", x0=d["cursor"], x1=d["cursor"], yref="paper", y0=0, y1=1, line=dict(color=CURSOR, width=2, dash="dot")
                    )
                ]
            )
            shapes += [
                dict(type="line", x0=s, x1=s, yref="paper", y0=0, y1=1, line=dict(color="#333333", width=1)) for s in d["cleared_at"]
            ]
            shapes += [
                dict(type="line", x0=s - 0.5, x1=s - 0.5, yref="paper", y0=0, y1=1, line=dict(color="#333333", width=2, dash="dash"))
                for s in d["restarted_at"]
            ]
            put("shapes", fig.layout, "shapes", shapes)
            self._header(d["title"], ["stored", "removed", "cached blocks", "batches lost before"])


def _widgets() -> Any:
    try:
        import ipywidgets
    except ImportError as e:  # pragma: no cover
        raise ImportError("kvlab.viz.StreamPlayer needs ipywidgets: pip install 'kvlab[lab]'") from e
    return ipywidgets


class StreamPlayer:
    """The prefix forest and the series of one :class:`KVStream`, with a batch slider.

    ``probe``: block keys of a prompt to walk in the forest (a router's question: how much
    of this prompt is cached?); ``follow``: stay at the newest batch as the stream grows.
    """

    def __init__(
        self,
        stream: KVStream,
        *,
        probe: Sequence[Any] | None = None,
        decode: Callable[[int], str] | None = None,
        follow: bool = False,
        width: int = 760,
        interval_ms: int = 400,
        title: str | None = None,
    ) -> None:
        if not isinstance(stream, KVStream):
            raise TypeError(f"stream must be a KVStream (KVStream.load(path) for a recording), got {type(stream).__name__}")
        self.stream = stream
        self.probe = list(probe) if probe is not None else None
        self.follow = bool(follow)
        self.prefixes = PrefixIndexView(decode=decode, width=width)
        self.series = StreamSeriesView(width=width)
        self.title = title if title is not None else (stream.name or "KV-event stream")
        self.index = len(stream) - 1
        self.interval_ms = interval_ms
        self._ui: Any = None
        self._still_handle: Any = None
        self.go_to(self.index)

    # What write_html and the page read of a player: a batch is a step (-1: before the first).
    unit = "batch"
    named_steps: dict[str, int] = {}
    description = ""

    @property
    def first_step(self) -> int:
        return 0 if len(self.stream) else -1

    @property
    def last_step(self) -> int:
        return len(self.stream) - 1

    @property
    def step(self) -> int:
        return self.index

    @property
    def views(self) -> dict[str, View]:
        return {"prefixes": self.prefixes, "series": self.series}

    @property
    def _name(self) -> str:
        return self.title

    def go_to(self, index: int) -> None:
        """Show the cache after batch ``index`` (-1: before the first)."""
        self.index = index
        self.prefixes.update(self.stream.at(index), probe=self.probe)
        self.series.update(self.stream, index)
        if self._ui is not None and self._ui.step != index:
            self._ui.step = index  # the page follows

    def set_probe(self, probe: Sequence[Any] | None) -> None:
        self.probe = list(probe) if probe is not None else None
        self.go_to(self.index)
        if self._ui is not None:
            self._ui.new_version()  # every batch's forest walks the new probe

    def refresh(self) -> None:
        """After the stream grew: jump to the newest batch when following, else redraw --
        and redraw the still a saved lesson will show (a live stream's first picture is empty)."""
        if self._ui is not None:
            self._ui.new_version(steps=self._steps())
        self.go_to(len(self.stream) - 1 if self.follow else self.index)
        if self._still_handle is not None:
            self._still_handle.update(self._still_bundle(), raw=True)

    def _steps(self) -> list[int]:
        return list(range(self.first_step, self.last_step + 1))

    def _status_html(self, index: int) -> str:
        if index < 0:
            return "before the first batch"
        snap, s = self.stream.at(index), self.stream.series
        notes = []
        lost = s.missing[index] - (s.missing[index - 1] if index else 0)
        if lost:
            notes.append(f"{lost} batch{'es' if lost != 1 else ''} lost before it")
        if snap.restarted:
            notes.append("the publisher restarted: a new run, from an empty cache")
        if snap.cleared:
            notes.append("AllBlocksCleared")
        return (
            f"<b>batch {index}</b> · seq {snap.seq} · {snap.num_blocks} blocks cached · "
            f"{s.stored_blocks[index]} stored · {s.removed_blocks[index]} removed" + "".join(f" · {html_escape(x)}" for x in notes)
        )

    def _events_html(self, index: int) -> str:
        if index < 0:
            return ""
        events = self.stream.batches[index].events
        rows = [f"<li>{html_escape(_describe(e))}</li>" for e in events[:MAX_LISTED_EVENTS]]
        if len(events) > MAX_LISTED_EVENTS:
            rows.append(f"<li>… and {len(events) - MAX_LISTED_EVENTS} more events</li>")
        return f"<ul style='font-size:12px;margin:4px 0'>{''.join(rows)}</ul>" if rows else ""

    # -- the page's side (kvlab.viz.replay_widget), as a Player's --------------------------------
    def _figures_at(self, index: int) -> tuple[list[dict[str, Any]], str, str]:
        import json

        import plotly.io as pio

        self.prefixes.update(self.stream.at(index), probe=self.probe)
        self.series.update(self.stream, index)
        figs = [json.loads(pio.to_json(v.still(), validate=False)) for v in (self.prefixes, self.series)]
        return figs, self._status_html(index), self._events_html(index)

    def _figures_done(self) -> None:
        self.prefixes.update(self.stream.at(self.index), probe=self.probe)
        self.series.update(self.stream, self.index)

    def _step_from_browser(self, index: int) -> None:
        if index != self.index and self.first_step <= index <= self.last_step:
            self.go_to(index)

    def select(self, request_id: str | None) -> None:
        """A stream has no requests to pick (the page shows no request menu)."""

    def run_step(self) -> None:
        raise RuntimeError("a KV-event stream cannot be stepped from here: it grows as its publisher sends batches")

    @property
    def widget(self) -> Any:
        """One widget that draws both views in the browser (see :mod:`kvlab.viz.replay_widget`)."""
        if self._ui is None:
            w = _widgets()
            from kvlab.viz.replay_widget import ReplayWidget
            from kvlab.viz.style import PLOTLY_CONFIG

            header = dict(
                title=self.title,
                description="",
                views=list(self.views),
                columns=1,
                steps=self._steps(),
                named=[],
                unit="batch",
                interval=self.interval_ms,
                config=dict(PLOTLY_CONFIG),
                requests=None,
                selected=None,
                can_run=False,
                width=self.prefixes.width,
                step=self.index,
                version=0,
            )
            self._ui = ReplayWidget(self, header)
            self._ui.layout = w.Layout(width="100%")
            self._ui.add_class("kvlab-player")
        return self._ui

    def still(self) -> dict[str, Any]:
        """Both views as one plotly figure (JSON): what a saved lesson shows without a kernel."""
        from kvlab.viz.still import compose

        header = (
            f"<b>{html_escape(self.title)}</b> · after batch {self.index}<br><span style='font-size:10px;color:#555'>"
            "a still picture of the player: run the cell to step through the stream</span>"
        )
        return compose([self.prefixes.still(), self.series.still()], columns=1, header=header, header_px=34)

    def _still_bundle(self) -> dict[str, Any]:
        import json

        import plotly.io as pio

        fig = json.loads(pio.to_json(self.still(), validate=False))
        return {
            "application/vnd.plotly.v1+json": {**fig, "config": {"displayModeBar": False}},
            "text/plain": f"(a still picture of the stream after batch {self.index})",
        }

    def _ipython_display_(self) -> None:
        """The widget, with a still picture beside it for a lesson saved or opened without a
        kernel (see :func:`kvlab.viz.still.display_with_still`); ``refresh`` keeps it current."""
        from kvlab.viz.still import display_with_still

        self._still_handle = display_with_still(self.widget, self._still_bundle(), mark_live=False)


MAX_LISTED_EVENTS = 40  # a batch's event list is cut here (the count is shown)


def _describe(ev: Any) -> str:
    kind = type(ev).__name__
    hashes = getattr(ev, "block_hashes", None)
    if hashes is None:
        return kind
    where = f"group {ev.group_idx}, {ev.medium}" if ev.group_idx is not None else f"{ev.medium}"
    return f"{kind}: {len(hashes)} block{'s' if len(hashes) != 1 else ''} ({where})"


__all__ = ["StreamPlayer", "StreamSeriesView", "series_data"]
