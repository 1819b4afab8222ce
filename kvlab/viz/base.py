"""What every view shares: a plotly figure that is mutated in place.

A view is built once (its traces are created empty) and then only *updated*: each
``update(snapshot)`` assigns new arrays to the existing traces inside one
``batch_update``, skipping arrays that did not change. A Player hands each step's figure to
the page as plain data (:mod:`kvlab.viz.replay_widget`); a view shown on its own is its
figure as it is now; ``view.widget`` is a live ``FigureWidget`` for code that wants one.
What selecting a request changes is a *patch* (:meth:`View.selection_patch`), so that the
page can apply it without the kernel.

Each view module also exposes a pure ``figure_data(snapshot, ...)`` function that returns
plain Python data (ids, colours, labels). The view draws exactly that data, so tests check
the picture without a browser.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.style import FONT, PLOTLY_CONFIG, SELECT_INNER, SELECT_OUTER
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:  # plotly is imported lazily: kvlab's core must not need it
    import plotly.graph_objects as go


def _go() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as e:  # pragma: no cover - the lab extra is installed in the venv
        raise ImportError("kvlab.viz needs plotly and ipywidgets: pip install 'kvlab[lab]'") from e
    return go


_FIGURE_WIDGET: type[Any] | None = None  # a subclass of go.FigureWidget (untyped: plotly has no stubs)
_LOADER: list[Any] = []  # the kernel's one loader widget (see figure_widget_class)

# Both modules below find the same slot in the page: a promise of plotly's widget module that
# the loader fulfils once and every figure awaits. The slot is made by whichever runs first.
_SLOT_JS = (
    "const slot = (globalThis[KEY] ??= (() => {\n"
    "  const s = { started: false };\n"
    "  s.module = new Promise((resolve, reject) => { s.resolve = resolve; s.reject = reject; });\n"
    "  return s;\n"
    "})());\n"
)


def figure_widget_class() -> type[Any]:
    """``go.FigureWidget`` whose ~5 MB of browser code reaches the page once per kernel.

    Why: plotly's ``FigureWidget`` is an anywidget whose JavaScript (plotly.js and the
    widget, ~5 MB) is the ``_esm`` source of every figure. That source travels with each
    figure from the kernel through the Jupyter server to the page (a player has six
    figures, the capstone some thirty: 160 MB), anywidget imports it from a fresh blob URL
    for each figure (a full parse and evaluation, which must finish within anywidget's
    2-second start-up budget; on a busy machine the later figures missed it and stayed
    blank), and a notebook saved with its widgets' state kept one copy per figure.

    So the bundle travels once: the first figure a kernel makes first creates one hidden
    loader widget (:func:`preload`) whose module holds plotly's source unchanged and
    imports it once per page; each figure's own module is a few lines that wait for that
    import and re-export plotly's widget. The widget code is plotly's own.
    """
    global _FIGURE_WIDGET
    if _FIGURE_WIDGET is None:
        import hashlib
        import json

        import anywidget

        go = _go()
        source = str(go.FigureWidget._esm)  # anywidget keeps the bundle as file contents
        key = json.dumps("__kvlab_plotly_widget_" + hashlib.sha1(source.encode()).hexdigest()[:16])
        loader_esm = (
            "// kvlab: plotly's widget bundle, imported once per page for every figure (see kvlab.viz.base).\n"
            f"const KEY = {key};\n{_SLOT_JS}"
            "if (!slot.started) {\n"
            "  slot.started = true;\n"
            f"  const url = URL.createObjectURL(new Blob([{json.dumps(source)}], {{ type: 'text/javascript' }}));\n"
            "  import(url).then(slot.resolve, slot.reject).finally(() => URL.revokeObjectURL(url));\n"
            "}\n"
            "await slot.module;\n"
            "export default {};\n"
        )
        figure_esm = (
            "// kvlab: plotly's widget, from the bundle the page imported once (see kvlab.viz.base).\n"
            f"const KEY = {key};\n{_SLOT_JS}"
            "const mod = await slot.module;\n"
            "export const FigureModel = mod.FigureModel;\n"
            "export const FigureView = mod.FigureView;\n"
            "export default mod.default;\n"
        )

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            preload()  # the loader's comm opens first, so the page has the bundle coming
            go.FigureWidget.__init__(self, *args, **kwargs)

        loader = type("KvlabPlotlyLoader", (anywidget.AnyWidget,), {"_esm": loader_esm, "__module__": __name__})
        _FIGURE_WIDGET = type(
            "KvlabFigureWidget",
            (go.FigureWidget,),
            {
                "_esm": figure_esm,
                "__module__": __name__,
                "__init__": __init__,
                "_loader_class": loader,
                "_build_update_params_from_batch": _complete_batch,
            },
        )
    return _FIGURE_WIDGET


def _complete_batch(self: Any) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """plotly's batch update, with no "undefined" placeholders in it.

    Why: a ``batch_update`` that sets a property on some traces sends, for the other traces
    of the batch, a placeholder meaning "unchanged". A figure whose page view does not exist
    yet (a Player renders its first step before it is displayed) applied those placeholders
    as values, and the property was lost: the hash chains' squares shrank to dots, legend
    entries appeared and vanished. Each placeholder is replaced by what the trace holds now
    (None where it holds nothing: "unset", which is what it was). A property that the
    trace's kind does not have stays a placeholder: plotly skips it, the page ignores it.
    """
    from plotly.basedatatypes import BaseFigure, Undefined

    restyle, relayout, traces = BaseFigure._build_update_params_from_batch(self)
    for prop, values in restyle.items():
        for k, v in enumerate(values):
            if v is Undefined:
                try:
                    values[k] = self.data[traces[k]][prop]
                except (KeyError, ValueError):  # not a property of this kind of trace (a heatmap has
                    pass  # no marker): plotly must skip it, and the page ignores it for that trace
    return restyle, relayout, traces


def preload() -> None:
    """Send plotly's widget code to the page now, before any figure is shown.

    It creates this kernel's hidden loader widget (see :func:`figure_widget_class`), whose
    module imports the ~5 MB bundle once per page; every figure waits for that import.
    The first figure calls it by itself; calling it earlier (a notebook's first cell) lets
    the page load the bundle while the next cells run. Calling it again does nothing,
    unless the loader was closed (``Widget.close_all()``): then a new one is made.
    """
    if not _LOADER or _LOADER[0].comm is None:
        _LOADER[:] = [figure_widget_class()._loader_class()]


class View:
    """Base class: owns ``self.figure`` (a ``go.FigureWidget``) and the optional timeline.

    ``timeline`` gives views that need more than one snapshot (the timeline's per-step
    series and Gantt, the kernel's attention batch of the step) the data layer's answers;
    ``update`` still receives the snapshot to draw. A view reads the data layer only:
    never the engine, never the raw event log.
    """

    name: ClassVar[str] = "view"
    title: ClassVar[str] = ""

    def __init__(
        self,
        timeline: Timeline | None = None,
        *,
        decode: Callable[[int], str] | None = None,
        width: int = 482,
        height: int = 330,
    ) -> None:
        if not isinstance(width, int) or width < 200:
            raise ValueError(f"width must be an int >= 200 pixels, got {width!r}")
        if not isinstance(height, int) or height < 80:
            raise ValueError(f"height must be an int >= 80 pixels, got {height!r}")
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a callable token_id -> str, got {type(decode).__name__}")
        self.timeline = timeline
        self.decode = decode
        self.width = width
        self.height = height
        # A plain figure until the view is first shown; then the FigureWidget (see `widget`).
        self._plain: Any = self._make_figure()
        self._widget: go.FigureWidget | None = None
        self.last_data: dict[str, Any] | None = None
        self._sent: dict[str, Any] = {}

    def _make_figure(self) -> Any:
        """The empty (plain) figure; a view with subplots overrides this."""
        return _go().Figure(layout=self._base_layout())

    @property
    def figure(self) -> Any:
        """The figure to draw on: the plain figure before the view is shown, the live
        ``FigureWidget`` after. Both take the same property updates."""
        return self._widget if self._widget is not None else self._plain

    # -- to override ----------------------------------------------------------------------
    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------
    def _base_layout(self) -> dict[str, Any]:
        return dict(
            width=self.width,
            height=self.height,
            margin=dict(l=48, r=12, t=58, b=28),
            font=dict(family=FONT, size=11),
            paper_bgcolor="white",
            plot_bgcolor="white",
            title=dict(text=self.title, x=0.01, xanchor="left", y=1 - 14 / self.height, yanchor="top", font=dict(size=13)),
            showlegend=False,
            dragmode=False,
            hoverlabel=dict(font=dict(family=FONT, size=11)),
        )

    def _header(self, title: str, legend_labels: Sequence[str] = (), legend_font: int = 10, subtitle: str = "", extra_top: int = 0) -> int:
        """Set the title (and a smaller second line) and make room for them and the legend.

        The title hangs from the top edge; the horizontal legend sits on the plot area's top
        edge and grows upwards. The top margin is sized for both (legend rows are estimated
        from the label lengths), so they never overlap. A long subtitle is wrapped at its
        " · " separators (plotly does not wrap titles).
        """
        rows = legend_rows(legend_labels, self.width - 24, legend_font) if legend_labels else 0
        # plotly does not wrap a title: what does not fit moves to the subtitle's first line.
        fit = int((self.width - 20) / 8.0)
        if len(title) > fit and title.count(" · ") >= 2:
            head, _, tail = title.partition(" · ")
            step, _, rest = tail.partition(" · ")
            title, subtitle = f"{head} · {step}", rest + (f" · {subtitle}" if subtitle else "")
        sub_lines = wrap_parts(subtitle, int((self.width - 20) / 6.2)) if subtitle else []
        n_sub = len(sub_lines)
        # The title block hangs from 6 px below the top: a 13 px line, then 10 px lines.
        top = 6 + 20 + 15 * n_sub + (19 * rows + 10 if rows else 6) + extra_top
        t = self.figure.layout.title
        text = title + "".join(f"<br><span style='font-size:10px;color:#444'>{line}</span>" for line in sub_lines)
        self._put("title", t, "text", text)
        self._put("title.y", t, "y", 1 - 14 / self.height)  # plotly draws the first line ~8 px above its anchor
        self._put("margin.t", self.figure.layout.margin, "t", top)
        return top

    def _put(self, key: str, obj: Any, prop: str, value: Any, kind: str = "raw") -> None:
        """``setattr(obj, prop, value)`` unless ``value`` equals what ``key`` last sent.

        Two costs dominate a redraw of a big pool: plotly validating long Python lists
        element by element, and the widget sending them. Skipping unchanged arrays (the
        hash forest rarely changes between two steps) removes the second; handing plotly
        numpy arrays (``kind`` "num" for numbers, "str" for strings; "raw" passes the
        value as is) takes its fast path for the first.
        """
        if key in self._sent and self._sent[key] == value:
            return
        self._sent[key] = value
        if kind == "num":
            # 1-D floats travel as a binary typed array (NaN = a gap in a line); 2-D arrays
            # travel as JSON, where NaN is invalid, so they keep None (null = empty cell).
            two_d = len(value) > 0 and isinstance(value[0], (list, tuple))
            arr: Any = np.array(value, dtype=object if two_d else float) if len(value) else value
        elif kind == "str":
            arr = np.array(value, dtype=object) if len(value) else value
        else:
            arr = value
        setattr(obj, prop, arr)

    @property
    def widget(self) -> go.FigureWidget:
        """The live figure, created on first use FROM the complete figure.

        Why late: a ``FigureWidget`` opens its comm when it is constructed, and plotly's
        front end (an anywidget loading ~5 MB of JavaScript asynchronously) can drop state
        that arrives before it is ready -- traces added after construction then never
        reach the page and the figure stays blank. Built from a figure that already holds
        every trace, the widget's first message carries them all; later redraws only
        restyle existing traces.
        """
        if self._widget is None:
            self._widget = figure_widget_class()(self._plain)
            self._widget._config = dict(PLOTLY_CONFIG)
            self._plain = None
        return self._widget

    def still(self) -> dict[str, Any]:
        """The figure as it is now, as plotly JSON (a picture that needs no kernel)."""
        return self.figure.to_plotly_json()

    # -- the selection ---------------------------------------------------------------------
    # A selected request changes a few properties of a view's figure (where its selection
    # mark sits, which row label is bold), never the rest. Each view says which, as a
    # *patch*: {"traces": {index: {property: value}}, "layout": {"dotted.path": value}}.
    # The kernel applies the patch here; the page's renderer (static/replay.js) receives the
    # patch of every request with each step and applies it itself, so picking a request in
    # the page needs no kernel, and the two draw the same picture (tests/test_viz_selection.py).

    def selection_patch(self, snapshot: Snapshot, request_id: str | None) -> dict[str, Any] | None:
        """What selecting ``request_id`` (None: nothing) sets in the figure that the last
        ``update`` drew for ``snapshot``; every request's patch sets the same properties.
        None: this view does not mark a selection."""
        return None

    def selectable(self, snapshot: Snapshot) -> Iterable[str]:
        """The requests this view can mark at ``snapshot``."""
        return snapshot.requests

    def selection_patches(self, snapshot: Snapshot) -> dict[str, dict[str, Any]]:
        """Every request's patch that differs from "nothing selected", for the page; call it
        right after ``update(snapshot)`` with nothing selected."""
        none = self.selection_patch(snapshot, None)
        if none is None:
            return {}
        out = {}
        for rid in self.selectable(snapshot):
            p = self.selection_patch(snapshot, rid)
            if p is not None and p != none:
                out[rid] = p
        return out

    def _select(self, snapshot: Snapshot, request_id: str | None) -> None:
        """Apply ``request_id``'s patch (see :meth:`selection_patch`) to the figure."""
        patch = self.selection_patch(snapshot, request_id)
        if patch is None:
            return
        fig = self.figure
        for i, props in patch.get("traces", {}).items():
            for prop, value in props.items():
                self._put(f"sel.{i}.{prop}", fig.data[int(i)], prop, value, "num" if prop in ("x", "y", "customdata") else "raw")
        for path, value in patch.get("layout", {}).items():
            *parents, prop = path.split(".")
            obj = fig.layout
            for part in parents:
                obj = obj[part]
            self._put(f"sel.{path}", obj, prop, value)

    def _selection_size(self, key: str, outer: Any, inner: Any, size: float) -> None:
        """Size the selection mark (see :func:`selection_traces`) for cells of ``size`` px;
        where it sits is the selection's patch (:func:`mark_patch`)."""
        small = size < 18  # on small cells thinner frames, so the cell's colour still shows
        self._put(key + ".os", outer.marker, "size", max(6.0, size))
        self._put(key + ".is", inner.marker, "size", max(3.0, size - (4 if small else 6)))
        self._put(key + ".ow", outer.marker.line, "width", 2 if small else 2.5)
        self._put(key + ".iw", inner.marker.line, "width", 1 if small else 1.2)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """A view shown on its own (a cell's last expression) is its figure as it is now,
        drawn by JupyterLab's plotly renderer: no widget model of its own, so nothing that can
        miss its start-up on a busy machine and stay blank. ``view.widget`` is the live
        figure that follows ``update``; a Player steps through a run."""
        import json

        import plotly.io as pio

        fig = json.loads(pio.to_json(self.still(), validate=False))
        title = str(((fig.get("layout") or {}).get("title") or {}).get("text") or type(self).__name__).split("<br>")[0]
        return {"application/vnd.plotly.v1+json": {**fig, "config": dict(PLOTLY_CONFIG)}, "text/plain": f"<{type(self).__name__}: {title}>"}


def mark_patch(outer: int, inner: int, xs: list[Any], ys: list[Any]) -> dict[str, Any]:
    """A selection patch that puts the selection mark (traces ``outer`` and ``inner``, made
    by :func:`selection_traces`) on the cells at ``xs, ys``."""
    return {"traces": {str(outer): {"x": list(xs), "y": list(ys)}, str(inner): {"x": list(xs), "y": list(ys)}}}


def selection_traces(go: Any, size: float, name: str = "selected request") -> list[Any]:
    """The selection mark: a black square frame with a white frame inside it.

    Nothing else in any view is drawn this way, it carries no colour (so it survives
    colour blindness), and on any fill one of the two frames contrasts: the black one on
    light cells, the white one on dark ones.
    """
    common = dict(x=[], y=[], mode="markers", hoverinfo="skip", showlegend=False, name=name)
    return [
        go.Scatter(**common, marker=dict(symbol="square-open", size=size, color=SELECT_OUTER, line=dict(width=3.5, color=SELECT_OUTER))),
        go.Scatter(
            **common,
            marker=dict(symbol="square-open", size=max(3.0, size - 6), color=SELECT_INNER, line=dict(width=1.5, color=SELECT_INNER)),
        ),
    ]


def legend_traces(go: Any, colors: dict[str, str], labels: dict[str, str], order: tuple[str, ...], symbol: str = "square") -> list[Any]:
    """One invisible point per category, only to put the palette in the legend.

    The data itself is drawn by a single heatmap (fast for thousands of cells), and
    heatmaps have no per-category legend entries.
    """
    return [
        go.Scatter(
            x=[None],
            y=[None],
            mode="markers",
            marker=dict(symbol=symbol, size=11, color=colors[k], line=dict(width=1, color="#777777")),
            name=labels[k],
            showlegend=True,
            hoverinfo="skip",
        )
        for k in order
    ]


def wrap_parts(text: str, max_chars: int, sep: str = " · ") -> list[str]:
    """Split a subtitle at its ``sep`` separators into lines of at most ``max_chars``
    visible characters; a part too long for a line is cut after its commas."""
    import re

    def width(t: str) -> int:
        return len(re.sub(r"<[^>]+>", "", t))

    pieces: list[tuple[str, str]] = []  # (text, what joins it to the piece before)
    for k, part in enumerate(text.split(sep)):
        if width(part) > max_chars and ", " in part:
            sub = part.split(", ")
            pieces.extend((p + ("," if j < len(sub) - 1 else ""), sep if j == 0 and k else " ") for j, p in enumerate(sub))
        else:
            pieces.append((part, sep if k else ""))
    lines: list[str] = []
    cur = ""
    for piece, joiner in pieces:
        cand = f"{cur}{joiner}{piece}" if cur else piece
        if cur and width(cand) > max_chars:
            lines.append(cur)
            cur = piece
        else:
            cur = cand
    if cur:
        lines.append(cur)
    return lines


def legend_rows(labels: Sequence[str], width: float, font_size: int = 10) -> int:
    """How many rows a horizontal plotly legend with these labels takes (a deliberately
    generous estimate: ~46 px of symbol and padding per entry plus ~0.66 em per character).

    plotly puts a legend that fits in one row as is; one that does not is laid out as a
    grid whose columns are as wide as the widest entry."""
    widths = [46 + 0.66 * font_size * len(label) for label in labels]
    if not widths or sum(widths) <= width:
        return 1
    cols = max(1, int(width // max(widths)))
    return cdiv(len(widths), cols)


TOP_LEGEND = dict(
    orientation="h", x=0.0, xanchor="left", y=1.0, yanchor="bottom", font=dict(size=10), itemclick=False, itemdoubleclick=False
)
