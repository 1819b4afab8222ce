"""A still picture of a Player: every view of one step, composed into ONE plotly figure.

Why: a Player is a widget, and a widget needs a running kernel. A lesson opened without
one -- never run (JupyterLab does not trust it, so it may not render widgets) or reopened
after saving (the widget's model is gone) -- would show a raw ``VBox(children=…`` line or
"Error displaying widget: model not found" where the pictures should be. The Player
therefore also emits this composed figure as plain plotly JSON
(``application/vnd.plotly.v1+json``), which JupyterLab draws from the saved notebook with
no kernel, trusted or not. While the widget is alive, a style rule hides the still;
when the widget cannot be drawn, the rule hides the widget's error instead (see
``STILL_STYLE``).

How: the views keep their own figures; :func:`compose` lays them out two per row like the
Player does, renames each view's axes (``x`` -> ``x7``), maps its domains, paper-referenced
annotations and shapes, title and legend into its cell of the big figure, and gives each
view its own legend (plotly's ``legend2``, ``legend3``, ...).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from kvlab.utils.notebook_display import LIVE, STILL_MARK, STILL_STYLE, display_with_still  # noqa: F401  (the views import them from here)
from kvlab.viz.style import FONT, html_escape

GAP_X, GAP_Y = 8, 4  # pixels between two views (the Player's grid gap)

_AXIS_KEY = re.compile(r"^([xy])axis(\d*)$")
_TAG = re.compile(r"<[^>]+>")
CHAR_PX = 6.7  # width of one character of the views' monospace font at 10-11 px
_GLYPHS = {
    "square": "■",
    "square-open": "□",
    "square-x-open": "⊠",
    "circle": "●",
    "circle-open": "○",
    "x": "✖",
    "x-thin-open": "✖",
    "diamond": "◆",
    "diamond-open": "◇",
    "triangle-right": "▶",
}


def _axis_id(letter: str, n: int) -> str:
    return letter if n == 1 else f"{letter}{n}"


def _plain_len(text: str) -> int:
    return len(_TAG.sub("", str(text)).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


def _legend_entries(fig: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(glyph, colour, name) of every legend entry a view's figure shows."""
    out = []
    for tr in fig.get("data", []):
        show = tr.get("showlegend")
        if show is False or not tr.get("name"):
            continue
        kind = tr.get("type", "scatter")
        xs = tr.get("x")
        # A typed array (plotly's JSON for numpy data) with no bytes holds no point either.
        empty = xs is not None and (len(xs) == 0 if isinstance(xs, (list, tuple)) else isinstance(xs, dict) and not xs.get("bdata"))
        if show is None and (kind not in ("scatter", "bar") or xs is None):  # plotly's default: a scatter's or a bar's
            continue
        if empty and kind in ("scatter", "bar"):  # plotly lists no trace that holds no point at all
            continue
        marker, line = tr.get("marker") or {}, tr.get("line") or {}
        if kind == "bar":
            glyph, color = "■", marker.get("color") if isinstance(marker.get("color"), str) else "#666666"
        elif tr.get("mode") == "lines":
            glyph, color = "━", line.get("color", "#333333")
        else:
            glyph = _GLYPHS.get(str(marker.get("symbol", "circle")), "■")
            color = marker.get("color") if isinstance(marker.get("color"), str) else (marker.get("line") or {}).get("color", "#333333")
            if str(color).lower() in ("#ffffff", "white"):
                glyph, color = "□", "#666666"
        out.append((glyph, str(color), str(tr["name"])))
    return out


def _legend_text(entries: list[tuple[str, str, str]], width_px: float) -> tuple[str, int]:
    """The entries as one annotation text, wrapped to ``width_px``; returns (text, lines)."""
    lines: list[str] = []
    cur: list[str] = []
    used = 0.0
    for glyph, color, name in entries:
        w = (len(name) + 4) * CHAR_PX * 0.9
        if cur and used + w > width_px:
            lines.append("  ".join(cur))
            cur, used = [], 0.0
        cur.append(f"<span style='color:{color}'>{glyph}</span> {html_escape(name)}")
        used += w
    if cur:
        lines.append("  ".join(cur))
    return "<br>".join(lines), len(lines)


def compose(figures: Sequence[dict[str, Any]], *, columns: int = 2, header: str = "", header_px: int = 0) -> dict[str, Any]:
    """One plotly figure (JSON) holding ``figures`` (each a view's ``to_plotly_json()``)
    laid out ``columns`` per row, in order, with an optional ``header`` line on top."""
    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    figs = [copy.deepcopy(f) for f in figures]
    sizes = [(int(f["layout"].get("width") or 480), int(f["layout"].get("height") or 330)) for f in figs]
    rows = [list(range(i, min(i + columns, len(figs)))) for i in range(0, len(figs), columns)]
    col_w = [max((sizes[r[c]][0] for r in rows if c < len(r)), default=0) for c in range(columns)]
    row_h = [max(sizes[i][1] for i in r) for r in rows]
    width = sum(col_w) + GAP_X * (columns - 1)
    height = header_px + sum(row_h) + GAP_Y * max(0, len(rows) - 1)
    origin: dict[int, tuple[int, int]] = {}
    y = header_px
    for r, idx in enumerate(rows):
        x = 0
        for c, i in enumerate(idx):
            origin[i] = (x, y)
            x += col_w[c] + GAP_X
        y += row_h[r] + GAP_Y

    def px_x(p: float) -> float:
        return p / width

    def px_y(p: float) -> float:
        return 1 - p / height

    data: list[dict[str, Any]] = []
    layout: dict[str, Any] = dict(
        width=width,
        height=height,
        margin=dict(l=0, r=0, t=0, b=0),
        showlegend=True,
        hovermode="closest",
        font=dict(family=FONT, size=11),
        paper_bgcolor="white",
        plot_bgcolor="white",
        dragmode=False,
        annotations=[],
        shapes=[],
    )
    if header:
        layout["annotations"].append(
            dict(
                text=header,
                xref="paper",
                yref="paper",
                x=0,
                y=1,
                xanchor="left",
                yanchor="top",
                showarrow=False,
                align="left",
                font=dict(size=12),
            )
        )
    next_axis = {"x": 1, "y": 1}
    for i, fig in enumerate(figs):
        lay = fig["layout"]
        w, h = sizes[i]
        ox, oy = origin[i]
        m = {"l": 0, "r": 0, "t": 0, "b": 0, **(lay.get("margin") or {})}
        # plotly's automargin would grow the *whole* composed figure's margin for one
        # view's tick labels: make the room inside the view's own cell instead.
        for key, ax in lay.items():
            if key.startswith("yaxis") and isinstance(ax, dict) and ax.get("automargin") and ax.get("visible", True) is not False:
                labels = ax.get("ticktext") or []
                widest = max((_plain_len(t) for t in labels), default=3)
                m["l"] = max(m["l"], 16 + widest * CHAR_PX)
                ax["automargin"] = False
        pw, ph = max(1.0, w - m["l"] - m["r"]), max(1.0, h - m["t"] - m["b"])

        def paper_x(v: float, ox: float = ox, m: dict = m, pw: float = pw) -> float:
            return px_x(ox + m["l"] + v * pw)

        def paper_y(v: float, oy: float = oy, m: dict = m, ph: float = ph) -> float:
            return px_y(oy + m["t"] + (1 - v) * ph)

        # Axes: every xaxis*/yaxis* of the view gets a fresh id.
        rename: dict[str, str] = {}
        axes = {k: v for k, v in lay.items() if _AXIS_KEY.match(k)}
        for letter in ("x", "y"):  # traces without an axis name use x / y
            axes.setdefault(f"{letter}axis", {})
        # _AXIS_KEY.match(...) below is never None: every key of axes matches it (filtered, or xaxis/yaxis).
        for key in sorted(axes, key=lambda k: (k[0], int(_AXIS_KEY.match(k).group(2) or 1))):  # type: ignore[union-attr]  # see above
            letter, num = _AXIS_KEY.match(key).groups()  # type: ignore[union-attr]  # see above
            old = _axis_id(letter, int(num or 1))
            rename[old] = _axis_id(letter, next_axis[letter])
            next_axis[letter] += 1
        for key, ax in axes.items():
            letter, num = _AXIS_KEY.match(key).groups()  # type: ignore[union-attr]  # a key of axes: it matches
            ax = dict(ax)
            d0, d1 = ax.get("domain", [0, 1])
            ax["domain"] = sorted([paper_x(d0), paper_x(d1)]) if letter == "x" else sorted([paper_y(d0), paper_y(d1)])
            # An axis is drawn along its anchor: x{n} sits on y{n} unless it says otherwise.
            other = "y" if letter == "x" else "x"
            ax.setdefault("anchor", _axis_id(other, int(num or 1)))
            for attr in ("anchor", "matches", "overlaying", "scaleanchor"):
                if ax.get(attr) in rename:
                    ax[attr] = rename[ax[attr]]
            new = rename[_axis_id(letter, int(num or 1))]
            layout[f"{letter}axis{'' if new in ('x', 'y') else new[1:]}"] = ax
        # The legend becomes an annotation wrapped to the view's width (a plotly legend
        # would wrap at the edge of the whole composed figure, over the neighbour).
        entries = _legend_entries(fig) if lay.get("showlegend", True) else []
        for tr in fig.get("data", []):
            tr = dict(tr)
            tr["xaxis"] = rename.get(tr.get("xaxis", "x"), tr.get("xaxis", "x"))
            tr["yaxis"] = rename.get(tr.get("yaxis", "y"), tr.get("yaxis", "y"))
            tr["showlegend"] = False
            data.append(tr)
        if entries:
            lg = lay.get("legend") or {}
            text, _ = _legend_text(entries, w - 30)
            layout["annotations"].append(
                dict(
                    text=text,
                    xref="paper",
                    yref="paper",
                    x=paper_x(float(lg.get("x", 0.0))),
                    y=paper_y(float(lg.get("y", 1.0))),
                    xanchor=lg.get("xanchor", "left"),
                    yanchor=lg.get("yanchor", "bottom"),
                    showarrow=False,
                    align="left",
                    font=dict(size=(lg.get("font") or {}).get("size", 10)),
                )
            )

        def ref(r: str | None, letter: str) -> str:
            if r is None:  # plotly's default: the first axis of that letter
                return rename.get(letter, letter)
            base, _, rest = r.partition(" ")
            return (rename.get(base, base) + (" " + rest if rest else "")) if base != "paper" else "paper"

        for a in lay.get("annotations", []) or []:
            a = dict(a)
            if a.get("xref", "x") == "paper":
                a["x"] = paper_x(float(a.get("x", 0.5)))
            else:
                a["xref"] = ref(a.get("xref"), "x")
            if a.get("yref", "y") == "paper":
                a["y"] = paper_y(float(a.get("y", 0.5)))
            else:
                a["yref"] = ref(a.get("yref"), "y")
            layout["annotations"].append(a)
        for s in lay.get("shapes", []) or []:
            s = dict(s)
            for letter, conv in (("x", paper_x), ("y", paper_y)):
                r = s.get(f"{letter}ref", letter)
                if r == "paper":
                    for k in (f"{letter}0", f"{letter}1"):
                        if k in s:
                            s[k] = conv(float(s[k]))
                else:
                    s[f"{letter}ref"] = ref(r, letter)
            layout["shapes"].append(s)
        title = lay.get("title") or {}
        if title.get("text"):
            tx, ty = float(title.get("x", 0.01)), float(title.get("y", 1.0))
            top_px = max(0.0, (1 - ty) * h - 8)  # plotly draws a title's first line ~8 px above its anchor
            layout["annotations"].append(
                dict(
                    text=title["text"],
                    xref="paper",
                    yref="paper",
                    x=px_x(ox + tx * w),
                    y=px_y(oy + top_px),
                    xanchor=title.get("xanchor", "left"),
                    yanchor=title.get("yanchor", "top"),
                    showarrow=False,
                    align="left",
                    font=dict(size=(title.get("font") or {}).get("size", 13)),
                )
            )
    return dict(data=data, layout=layout)


def player_header(title: str, step: int, last_step: int, note: str = "") -> str:
    """The line above a still: what it shows and how to get the live Player back."""
    extra = f" — {html_escape(note)}" if note else ""
    return (
        f"<b>{html_escape(title)}</b> · step {step} of {last_step}{extra}<br>"
        "<span style='font-size:10px;color:#555'>a still picture of the Player: run the cell to step through the run</span>"
    )
