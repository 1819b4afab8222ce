"""Per-step figure data, packed once: what the browser renderer (``static/replay.js``) reads.

Both the Player in JupyterLab (:mod:`kvlab.viz.replay_widget`) and the page that
:func:`kvlab.export_html` writes hand the renderer chunks made here, so both draw the same
pictures from the same data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any


class FramePacker:
    """Figures of a player's views at chosen steps, packed the way ``replay.js`` reads them.

    ``render(step)`` gives each view's figure at ``step`` (plain JSON dicts), the step's
    status line and its event list. Each trace and layout is stored once (by its JSON), every
    string of a string list once (in a table the traces point into), and numbered; a packer
    remembers what it has handed out, so each chunk carries only what is new (``t0``, ``l0``,
    ``s0`` and ``m0`` say where its entries start, and the browser checks them).

    A figure may carry ``"selection"``: per request, what selecting it changes (a view's
    ``selection_patch``, or ``{"figure": ...}`` for a view that then draws another figure).
    Each view's map is stored once in ``marks`` (a recorded run's Gantt frames the same row at
    every step), and a frame is ``[layout, [traces], mark index or -1]``."""

    def __init__(self, render: Callable[[int], tuple[list[dict[str, Any]], str, str]]) -> None:
        self._render = render
        self.traces: list[Any] = []
        self.layouts: list[Any] = []
        self.strings: list[str] = []
        self.marks: list[Any] = []
        self._m: dict[str, int] = {}
        self._t: dict[str, int] = {}
        self._l: dict[str, int] = {}
        self._s: dict[str, int] = {}

    def _string(self, x: str) -> int:
        i = self._s.get(x)
        if i is None:
            i = self._s[x] = len(self.strings)
            self.strings.append(x)
        return i

    def _pack(self, obj: Any) -> Any:
        """Lists of strings (1-D or 2-D) become {"__s": indices into the string table}."""
        if isinstance(obj, dict):
            return {k: self._pack(v) for k, v in obj.items()}
        if isinstance(obj, list) and obj:
            flat = obj if not isinstance(obj[0], list) else [x for row in obj for x in row]
            if flat and all(isinstance(x, str) for x in flat):
                if isinstance(obj[0], list):
                    return {"__s": [[self._string(x) for x in row] for row in obj]}
                return {"__s": [self._string(x) for x in obj]}
            return [self._pack(x) for x in obj]
        return obj

    @staticmethod
    def _intern(obj: Any, table: list[Any], index: dict[str, int]) -> int:
        key = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        i = index.get(key)
        if i is None:
            i = index[key] = len(table)
            table.append(obj)
        return i

    def _figure(self, f: dict[str, Any]) -> list[Any]:
        return [
            self._intern(f.get("layout", {}), self.layouts, self._l),
            [self._intern(self._pack(tr), self.traces, self._t) for tr in f.get("data", [])],
        ]

    def _selection(self, sel: dict[str, Any] | None) -> int:
        if not sel:
            return -1
        packed = {rid: {"figure": self._figure(p["figure"])} if "figure" in p else self._pack(p) for rid, p in sel.items()}
        return self._intern(packed, self.marks, self._m)

    def pack(self, steps: Sequence[int]) -> dict[str, Any]:
        t0, l0, s0, m0 = len(self.traces), len(self.layouts), len(self.strings), len(self.marks)
        frames, status, events = [], [], []
        for s in steps:
            figs, st, ev = self._render(s)
            frames.append([[*self._figure(f), self._selection(f.get("selection"))] for f in figs])
            status.append(st)
            events.append(ev)
        return dict(
            t0=t0,
            l0=l0,
            s0=s0,
            m0=m0,
            traces=self.traces[t0:],
            layouts=self.layouts[l0:],
            strings=self.strings[s0:],
            marks=self.marks[m0:],
            steps=list(steps),
            frames=frames,
            status=status,
            events=events,
        )
