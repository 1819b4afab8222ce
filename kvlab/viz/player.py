"""Player: every view of one run, with Play / Pause / Step / Back and a step slider.

The player is the lessons' main instrument. It reads the data layer only: it keeps a
:class:`~kvlab.timeline.timeline.Timeline` and, at each step, hands the snapshot of that
step to every view, which produces its figure as plain data. Stepping backwards is
therefore as cheap and as exact as stepping forwards, and a saved log replays the same.
The page draws those figures itself (:mod:`kvlab.viz.replay_widget`, one widget per
Player): the kernel sends steps, not redraws.

Sources: a ``Timeline``, an ``EventLog`` (e.g. ``EventLog.load(path)``) or a list of
events. Options add what a scenario or a live engine brings -- ``named_steps`` and
``notes`` (a "jump to" menu and captions), ``follow=True`` (redraw as the log grows:
every step the engine takes, from any cell) and ``run_step`` (a "Run step" button).
:func:`kvlab.show` builds a Player from an engine, a scenario or a saved log with the
right options; this module imports neither the engine nor the scenarios.

Selecting a request in the drop-down outlines its blocks in every view (the selection mark,
a black frame with a white one inside, is used for nothing else). The page draws it without
the kernel: each view's figure travels with what selecting each request changes in it
(``View.selection_patch``).

The Player is designed for a notebook's output area at 1280 px (832 px, two views a row, see
``OUTPUT_WIDTH``); the page measures the area and lays the views out in one, two or three
columns, and zooms out only where one view is wider than the area. Its controls mean what
they show: ▶ plays, ❚❚ pauses where it is (there is no "stop" that jumps back to the first
step), and "Run step" runs one engine step *and shows it*. Next
to the widget it always leaves a still picture of the same step (:mod:`kvlab.viz.still`),
so a lesson saved or opened without a kernel shows the pictures, not an error.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvlab.eventlog.events import Event, EventLog
from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import View
from kvlab.viz.block_table import BlockTableView
from kvlab.viz.free_queue import FreeQueueView
from kvlab.viz.hash_chain import HashChainView
from kvlab.viz.kernel import KernelView
from kvlab.viz.pool import PoolView
from kvlab.utils.notebook_display import OUTPUT_WIDTH
from kvlab.viz.still import compose, display_with_still, player_header
from kvlab.viz.style import FONT, TONE_STYLES, html_escape
from kvlab.viz.timeline import TimelineView

# Display order, two per row: the two strips (pool, free queue) side by side, then the
# per-request pictures (tables, hash chains), then the run (timeline, kernel reads).
VIEW_CLASSES: dict[str, type[View]] = {
    "pool": PoolView,
    "free": FreeQueueView,
    "table": BlockTableView,
    "hash": HashChainView,
    "timeline": TimelineView,
    "kernel": KernelView,
}
DEFAULT_VIEWS: tuple[str, ...] = tuple(VIEW_CLASSES)
DEFAULT_WIDTH = OUTPUT_WIDTH - 8  # the widget adds 8 px of padding; see OUTPUT_WIDTH

# The Player's own style: the Play widget's stop button (■ jumps to the first step, which
# is not what a square means) is hidden; the ▶ / ❚❚ toggle remains (ipywidgets 8: play-pause, stop, repeat).
PLAYER_STYLE = "<style>.kvlab-player .widget-play button:nth-of-type(2){display:none}</style>"


def default_views(timeline: Timeline) -> tuple[str, ...]:
    """Every view that has something to draw for this run: the kernel view needs a step
    that ran requests (a scheduler) or an attention batch -- a log of a manager driven
    directly (an exercise checker) has neither, and gets the other five."""
    if len(timeline.series) or any(timeline.attention_batch(s) is not None for s in timeline.steps):
        return DEFAULT_VIEWS
    return tuple(v for v in DEFAULT_VIEWS if v != "kernel")


def _widgets() -> Any:
    try:
        import ipywidgets
    except ImportError as e:  # pragma: no cover
        raise ImportError("kvlab.viz.Player needs ipywidgets: pip install 'kvlab[lab]'") from e
    return ipywidgets


def _event_html(events: Sequence[Event]) -> str:
    """The current step's events as a compact list, styled by each event's ``tone``."""
    out = []
    for e in events:
        style = TONE_STYLES.get(e.tone, "")
        out.append(f"<div style='{style}'>{html_escape(e.describe())}</div>")
    body = "".join(out) or "<div style='color:#888'>no events</div>"
    return (
        f"<div style='font-family:{FONT};font-size:11px;line-height:1.35;max-height:180px;overflow-y:auto;"
        f"border:1px solid #ddd;padding:4px 6px;background:#fafafa'>{body}</div>"
    )


class Player:
    """Replays (or follows) a run; one ipywidgets container holding every view.

    Parameters
    ----------
    source:
        ``Timeline``, ``EventLog`` or a list of events.
    decode:
        Renders one token id as text in the hash-chain labels.
    views:
        View names (``"pool"``, ``"table"``, ``"hash"``, ``"free"``, ``"timeline"``,
        ``"kernel"``) or ``View`` subclasses, in display order; None: every view that
        has something to draw for this run (:func:`default_views`).
    width:
        Total width in pixels; views are laid out two per row.
    start:
        The step to open at (a number, or a scenario's step name). None: the first step
        that puts a block in use or in the cache, not an empty step 0
        (:attr:`Timeline.first_busy_step`); a live player opens at the last step.
    named_steps, notes, description:
        A scenario's moments (name -> step), captions (name -> text) and summary.
    follow:
        Redraw as the ``EventLog`` grows (live mode): after every step, and after any
        event between steps (a request added from another cell), never mid-step.
    run_step, has_work:
        Live mode's "Run step" button: ``run_step()`` advances the run by one step;
        ``has_work()`` says whether there is anything to run.
    """

    def __init__(
        self,
        source: Timeline | EventLog | Iterable[Event],
        decode: Callable[[int], str] | None = None,
        views: Sequence[str | type[View]] | None = None,
        *,
        width: int = DEFAULT_WIDTH,
        interval_ms: int = 900,
        start: int | str | None = None,
        title: str | None = None,
        description: str = "",
        named_steps: Mapping[str, int] | None = None,
        notes: Mapping[str, str] | None = None,
        follow: bool = False,
        run_step: Callable[[], Any] | None = None,
        has_work: Callable[[], bool] | None = None,
    ) -> None:
        if isinstance(source, Timeline):
            self.timeline = source
        elif isinstance(source, EventLog):
            self.timeline = Timeline(source)
        elif isinstance(source, Iterable) and not isinstance(source, (str, bytes, Mapping)):
            events = list(source)
            if not all(isinstance(e, Event) for e in events):
                raise TypeError("source: an iterable source must contain kvlab.eventlog.events.Event objects")
            self.timeline = Timeline(events)
        else:
            raise TypeError(
                f"source must be a Timeline, an EventLog or a list of events, got {type(source).__name__} "
                "(for an engine, a scenario or a saved file use kvlab.show(...))"
            )
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a callable token_id -> str, got {type(decode).__name__}")
        if not isinstance(width, int) or width < 500:
            raise ValueError(f"width must be an int >= 500 pixels, got {width!r}")
        if not isinstance(interval_ms, int) or interval_ms < 50:
            raise ValueError(f"interval_ms must be an int >= 50, got {interval_ms!r}")
        named = dict(named_steps or {})
        if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in named.items()):
            raise TypeError("named_steps must map step names (str) to step numbers (int)")
        for name, cb in (("run_step", run_step), ("has_work", has_work)):
            if cb is not None and not callable(cb):
                raise TypeError(f"{name} must be a callable, got {type(cb).__name__}")
        if follow and self.timeline.log is None:
            raise ValueError("follow=True needs a Timeline over an EventLog (a list of events cannot grow)")
        self.decode = decode
        self.named_steps = named
        self.notes = dict(notes or {})
        self.description = description
        self.live = bool(follow)
        self._run_step_fn = run_step
        self._has_work = has_work
        self._selected: str | None = None
        self._rendering = False
        self.last_render_ms: float = 0.0

        classes: list[type[View]] = []
        if views is None:
            views = default_views(self.timeline)
        if isinstance(views, (str, bytes)):
            raise TypeError(f"views must be a sequence of view names, got the string {views!r}")
        for v in views:
            if isinstance(v, str):
                if v not in VIEW_CLASSES:
                    raise ValueError(f"views: unknown view {v!r}; choose from {list(VIEW_CLASSES)}")
                classes.append(VIEW_CLASSES[v])
            elif isinstance(v, type) and issubclass(v, View):
                classes.append(v)
            else:
                raise TypeError(f"views: each item must be a view name or a View subclass, got {v!r}")
        if not classes:
            raise ValueError("views must name at least one view")
        view_w = (width - 16) // 2 if len(classes) > 1 else width
        self.views: dict[str, View] = {}
        for cls in classes:
            self.views[cls.name] = cls(self.timeline, decode=decode, width=view_w)

        self._build_widgets(title, interval_ms, width)
        self._step = self.timeline.first_busy_step  # not an empty step 0 (see Timeline.first_busy_step)
        self._last_seen = self.last_step
        if follow:
            assert self.timeline.log is not None  # checked above: follow=True needs an EventLog
            self._follow(self.timeline.log)
            self._step = self.last_step
        if start is not None:
            self._step = self._resolve(start)
        self._sync_controls()
        self._render()

    def _follow(self, log: EventLog) -> None:
        """Redraw when a step ends, and on any event between steps (a request added or
        aborted from another cell), never in the middle of a step. The log holds only a
        weak reference: a discarded player stops listening."""
        ref = weakref.ref(self)

        def on_event(_e: Event) -> None:
            p = ref()
            if p is None:
                log.unsubscribe(on_event)
                return
            if not p.timeline.in_step:  # the timeline takes the new event in first
                p._on_log_grew()

        log.subscribe(on_event)

    # -- steps -------------------------------------------------------------------------------
    @property
    def first_step(self) -> int:
        return self.timeline.first_step

    @property
    def last_step(self) -> int:
        return self.timeline.last_step

    @property
    def step(self) -> int:
        """The step on screen."""
        return self._step

    @property
    def snapshot(self) -> Snapshot:
        """The snapshot on screen."""
        return self.timeline.at(self._step)

    def _resolve(self, step: int | str) -> int:
        if isinstance(step, str):
            if not self.named_steps:
                raise ValueError(f"step names like {step!r} need named steps (kvlab.show(scenario) brings them)")
            if step not in self.named_steps:
                raise ValueError(f"no step named {step!r}; named steps are {list(self.named_steps)}")
            step = self.named_steps[step]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int (or a scenario step name), got {type(step).__name__}")
        if not self.first_step <= step <= self.last_step:
            raise ValueError(f"step {step} is out of range; this run has steps {self.first_step}..{self.last_step}")
        return step

    def go_to(self, step: int | str) -> int:
        """Show ``step`` (a number, or a scenario's step name); returns it."""
        self._step = self._resolve(step)
        self._sync_controls()
        self._render()
        return self._step

    def next(self) -> int:
        """One step forward (stays at the last step)."""
        return self.go_to(min(self._step + 1, self.last_step))

    def back(self) -> int:
        """One step back (stays at the first step)."""
        return self.go_to(max(self._step - 1, self.first_step))

    def run_step(self) -> int:
        """Live mode: advance the run by one step; the player follows it."""
        if self._run_step_fn is None:
            raise RuntimeError("run_step needs a live source (kvlab.show(engine)); this player replays a log")
        if self._has_work is not None and not self._has_work():
            self._status.value = "<span style='color:#888'>no unfinished request: add one, then run a step</span>"
            return self._step
        self._run_step_fn()  # the log subscription refreshes the player
        if not self.live:
            self._on_log_grew()
        # The button says "run a step": show the step it ran, wherever the player stood.
        return self.go_to(self.last_step)

    # -- selection ---------------------------------------------------------------------------
    @property
    def selected_request(self) -> str | None:
        return self._selected

    @selected_request.setter
    def selected_request(self, request_id: str | None) -> None:
        known = self._request_ids()
        if request_id is not None and request_id not in known:
            raise ValueError(f"unknown request {request_id!r}; requests in this run: {known}")
        self._take_selection(request_id)

    def select(self, request_id: str | None) -> None:
        """Outline ``request_id``'s blocks in every view (None clears the selection)."""
        self.selected_request = request_id

    def _select_from_browser(self, request_id: str | None) -> None:
        """The learner picked a request in the page, which has drawn it already: the kernel's
        player follows (``player.selected_request``, ``player.still()``)."""
        if request_id != self._selected and (request_id is None or request_id in self._request_ids()):
            self._take_selection(request_id)

    def _take_selection(self, request_id: str | None) -> None:
        """The one place a selection lands, from code, the drop-down or the page: the kernel's
        views and controls follow, and so does the page (which draws it: no figures travel;
        setting the value it already has is no change)."""
        self._selected = request_id
        self._sync_controls()
        self._render()
        self.widget.selected = request_id or ""

    def _request_ids(self) -> list[str]:
        return self.timeline.request_ids

    # -- widgets -----------------------------------------------------------------------------
    def _build_widgets(self, title: str | None, interval_ms: int, width: int) -> None:
        w = _widgets()
        lo, hi = self.first_step, self.last_step
        name = title or ("live engine" if self.live else "replay")
        self._name = name
        # The kernel-side handles: ``player.step_button.click()``, ``player.slider.value = 3``
        # drive the player from code (and the tests). The page draws its own controls.
        bl = w.Layout(width="auto")
        self.back_button = w.Button(description="◀ Back", tooltip="previous step", layout=bl)
        self.step_button = w.Button(description="Step ▶", tooltip="next step", layout=bl)
        self.play = w.Play(value=lo, min=lo, max=hi, step=1, interval=interval_ms, description="play", show_repeat=False)
        self.slider = w.IntSlider(
            value=lo, min=lo, max=hi, step=1, description="step", continuous_update=False, layout=w.Layout(width="360px")
        )
        w.jslink((self.play, "value"), (self.slider, "value"))
        # "" stands for "nothing selected": a None value leaves an ipywidgets Dropdown blank.
        self.request_dropdown = w.Dropdown(
            options=self._request_options(),
            value="",
            description="request",
            layout=w.Layout(width="210px"),
            style={"description_width": "56px"},
        )
        self.jump_dropdown = None
        if self.named_steps:
            opts = [("—", -1)] + [(f"{k} (step {v})", v) for k, v in self.named_steps.items()]
            self.jump_dropdown = w.Dropdown(
                options=opts, value=-1, description="jump to", layout=w.Layout(width="300px"), style={"description_width": "56px"}
            )
            self.jump_dropdown.observe(self._on_jump, names="value")
        self.run_button = None
        if self._run_step_fn is not None:
            self.run_button = w.Button(description="Run step", button_style="primary", tooltip="run one engine step", layout=bl)
            self.run_button.on_click(lambda _b: self.run_step())
        self._status = w.HTML()
        self._events = w.HTML()
        self.back_button.on_click(lambda _b: self.back())
        self.step_button.on_click(lambda _b: self.next())
        self.slider.observe(self._on_slider, names="value")
        self.request_dropdown.observe(self._on_request, names="value")
        # What is displayed: one widget that draws every view in the browser (see
        # kvlab.viz.replay_widget), with its own controls.
        from kvlab.viz.replay_widget import ReplayWidget

        self._interval_ms = interval_ms
        self._width = width
        self.widget = ReplayWidget(self, self._header(self.first_step))
        # The whole output area: the page lays the views out in as many columns as it holds
        # (static/replay.js, fit()).
        self.widget.layout = w.Layout(width="100%")
        self.widget.add_class("kvlab-player")

    def _header(self, step: int) -> dict[str, Any]:
        """What the page needs besides the figures: see ``static/replay.js``."""
        from kvlab.viz.style import PLOTLY_CONFIG

        return dict(
            title=self._name,
            description=self.description,
            views=list(self.views),
            columns=2 if len(self.views) > 1 else 1,
            steps=list(range(self.first_step, self.last_step + 1)),
            named=[[k, v] for k, v in self.named_steps.items()],
            unit="step",
            interval=self._interval_ms,
            config=dict(PLOTLY_CONFIG),
            requests=self._request_ids(),
            selected=self._selected,
            can_run=self._run_step_fn is not None,
            fill=not self.live,  # a recorded run: the page fetches every step once it is used
            width=self._width,
            step=step,
            version=0,
        )

    def _request_options(self) -> list[tuple[str, str]]:
        return [("— none —", "")] + [(r, r) for r in self._request_ids()]

    def _sync_controls(self) -> None:
        """Put the widgets in line with the state without re-triggering a render."""
        was, self._rendering = self._rendering, True
        try:
            hi = self.last_step
            for c in (self.slider, self.play):
                if c.max != hi:
                    c.max = hi
                if c.value != self._step:
                    c.value = self._step
            if self.request_dropdown.value != (self._selected or ""):
                self.request_dropdown.value = self._selected or ""
        finally:
            self._rendering = was

    def _on_slider(self, change: dict[str, Any]) -> None:
        if not self._rendering and change["new"] != self._step:
            self.go_to(int(change["new"]))

    def _on_request(self, change: dict[str, Any]) -> None:
        new = change["new"] or None
        if not self._rendering and new != self._selected:
            self._take_selection(new)

    def _on_jump(self, change: dict[str, Any]) -> None:
        if change["new"] is not None and change["new"] >= 0:
            self.go_to(int(change["new"]))
            assert self.jump_dropdown is not None
            self.jump_dropdown.value = -1

    def _on_log_grew(self) -> None:
        follow = self._step == self._last_seen  # at the end before the log grew: stay at the end
        self.timeline.refresh()
        self._last_seen = self.last_step
        ids = self._request_ids()
        if len(ids) != len(self.request_dropdown.options) - 1:
            was, self._rendering = self._rendering, True
            try:
                self.request_dropdown.options = self._request_options()
                self.request_dropdown.value = self._selected if self._selected in ids else ""
            finally:
                self._rendering = was
        if follow:
            self._step = self.last_step
        self._sync_controls()
        self._render()
        # The timeline spans the run: every step's figure changed, so the page starts over.
        self.widget.new_version(steps=list(range(self.first_step, self.last_step + 1)), requests=ids)

    # -- drawing -----------------------------------------------------------------------------
    def _render(self) -> None:
        t0 = time.perf_counter()
        snap = self.timeline.at(self._step)
        for v in self.views.values():
            v.update(snap, self._selected)
        self._events.value = _event_html(self.timeline.events_of(self._step))
        self._status.value = self._status_html(self._step)
        if self.widget.step != self._step:
            self.widget.step = self._step  # the page follows (it draws what it has, asks for the rest)
        self.last_render_ms = (time.perf_counter() - t0) * 1000.0

    def _status_html(self, step: int) -> str:
        note = ""
        names = [k for k, s in self.named_steps.items() if s == step]
        if names:
            texts = [f"<b>{html_escape(k)}</b>" + (f": {html_escape(self.notes[k])}" if k in self.notes else "") for k in names]
            note = " · ".join(texts)
        return (
            f"<div style='font-family:{FONT};font-size:12px;min-height:16px'>step {step} of {self.last_step}"
            + (f" — {note}" if note else "")
            + "</div>"
        )

    # -- the page's side (kvlab.viz.replay_widget) ------------------------------------------------
    def _figures_at(self, step: int) -> tuple[list[dict[str, Any]], str, str]:
        """Every view's figure at ``step`` (plain JSON), its status line and its event list,
        for the page; the views are put back by :meth:`_figures_done`."""
        import json

        import plotly.io as pio

        snap = self.timeline.at(step)
        figs = []
        for v in self.views.values():
            # Drawn with nothing selected, plus what selecting each request changes (the page
            # applies the selection itself: picking a request needs no kernel).
            v.update(snap, None)
            fig = json.loads(pio.to_json(v.still(), validate=False))
            patches = v.selection_patches(snap)
            if patches:
                fig["selection"] = json.loads(pio.to_json(patches, validate=False))
            figs.append(fig)
        return figs, self._status_html(step), _event_html(self.timeline.events_of(step))

    def _figures_done(self) -> None:
        snap = self.timeline.at(self._step)
        for v in self.views.values():
            v.update(snap, self._selected)

    def _step_from_browser(self, step: int) -> None:
        """The learner stepped in the page: the kernel's player follows (its views too, so
        ``player.snapshot`` and ``player.still()`` show what the page shows)."""
        if step != self._step and self.first_step <= step <= self.last_step:
            self._step = step
            self._sync_controls()
            self._render()

    # -- display -----------------------------------------------------------------------------
    def still(self) -> dict[str, Any]:
        """Every view at the current step as ONE plotly figure (JSON): the picture that
        stays in a saved notebook (see :mod:`kvlab.viz.still`)."""
        names = [k for k, s in self.named_steps.items() if s == self._step]
        header = player_header(self._name, self._step, self.last_step, " · ".join(names))
        return compose([v.still() for v in self.views.values()], columns=2 if len(self.views) > 1 else 1, header=header, header_px=34)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle: Any = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):  # anywidget: (data, metadata)
            bundle = bundle[0]
        if isinstance(bundle, dict):
            bundle["text/plain"] = ""  # never the VBox(children=...) repr: the still stands in
        return bundle

    def _ipython_display_(self) -> None:
        """Three outputs: a style rule, the still picture, the live widget. While the widget
        is drawn, the rule hides the still; when it cannot be drawn (a saved notebook
        reopened: "model not found"), the rule hides the widget's output and the still
        shows the step instead."""
        import json

        import plotly.io as pio

        fig = json.loads(pio.to_json(self.still(), validate=False))
        display_with_still(
            self.widget,
            {
                "application/vnd.plotly.v1+json": {**fig, "config": {"displayModeBar": False}},
                "text/plain": f"(a still picture of the player at step {self._step})",
            },
            mark_live=False,  # the page marks it once its first picture is drawn: until then, the still
        )

    def __repr__(self) -> str:
        mode = "live" if self.live else "replay"
        return f"Player({mode}, step {self._step} of {self.first_step}..{self.last_step}, views={list(self.views)})"
