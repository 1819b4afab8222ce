"""A Player as one self-contained HTML file: every step of every view, no kernel, no network.

A teacher hands out a link; a learner opens a run someone else made, on a phone if need
be. The file holds plotly.js (inlined, no CDN), the figures of every view at every step,
and a few lines of JavaScript that give it the Player's controls: ◀ Back, ▶ Play / ❚❚
Pause, Step ▶, the step slider, the "jump to" menu of a scenario, the step's status line
and its event list. Nothing is fetched from anywhere (``tests/browser`` opens it with every
non-``file://`` request blocked).

Size: the figures are stored once per distinct trace and layout (a trace that does not
change between two steps -- the timeline's series, an untouched hash forest -- is stored
once), and every string (cell labels, hover texts) once per file, in a table the traces
point into; so a file is plotly.js (~4.7 MB) plus what actually changes. The selection (a
request chosen in the Player) is exported as it is when the file is written.

A :class:`~kvlab.viz.stream.StreamPlayer` (a KV-event stream, live or recorded) exports the
same way, its batches standing for steps: the prefix forest and the series at every batch,
each batch's status line and its events.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.viz.style import FONT, PLOTLY_CONFIG

if TYPE_CHECKING:
    from kvlab.viz.player import Player
    from kvlab.viz.stream import StreamPlayer

MAX_STEPS = 3000  # a longer run is exported at every k-th step (the slider still covers it)


def _json_for_script(obj: Any) -> str:
    """JSON that can sit inside a <script> element ("</" would end it)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")


def frames(player: Player | _StreamFrames, steps: list[int]) -> dict[str, Any]:
    """Every view's figure at each of ``steps``, deduplicated: ``traces`` and ``layouts``
    hold each distinct JSON once, ``frames[i][v]`` = (layout index, [trace indices]) of view
    ``v`` at ``steps[i]``; plus the status and event-list HTML of each step."""
    import plotly.io as pio

    traces: list[Any] = []
    layouts: list[Any] = []
    t_index: dict[str, int] = {}
    l_index: dict[str, int] = {}
    strings: list[str] = []
    s_index: dict[str, int] = {}

    def pack(obj: Any) -> Any:
        """Lists of strings (1-D or 2-D) become {"__s": indices into the string table}."""
        if isinstance(obj, dict):
            return {k: pack(v) for k, v in obj.items()}
        if isinstance(obj, list) and obj:
            flat = obj if not isinstance(obj[0], list) else [x for row in obj for x in row]
            if flat and all(isinstance(x, str) for x in flat):

                def idx(x: str) -> int:
                    i = s_index.get(x)
                    if i is None:
                        i = s_index[x] = len(strings)
                        strings.append(x)
                    return i

                if isinstance(obj[0], list):
                    return {"__s": [[idx(x) for x in row] for row in obj]}
                return {"__s": [idx(x) for x in obj]}
            return [pack(x) for x in obj]
        return obj

    def intern(obj: Any, table: list[Any], index: dict[str, int]) -> int:
        key = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        i = index.get(key)
        if i is None:
            i = index[key] = len(table)
            table.append(obj)
        return i

    out_frames: list[list[Any]] = []
    status: list[str] = []
    events: list[str] = []
    at = player.step
    try:
        for s in steps:
            player.go_to(s)
            per_view = []
            for v in player.views.values():
                fig = json.loads(pio.to_json(v.still(), validate=False))
                li = intern(fig.get("layout", {}), layouts, l_index)
                per_view.append([li, [intern(pack(tr), traces, t_index) for tr in fig.get("data", [])]])
            out_frames.append(per_view)
            status.append(player._status.value)
            events.append(player._events.value)
    finally:
        player.go_to(at)
    return dict(steps=steps, traces=traces, layouts=layouts, frames=out_frames, status=status, events=events, strings=strings)


MAX_LISTED_EVENTS = 40  # a stream batch's event list is cut here (the count is shown)


class _Text:
    """What ``frames`` reads of the Player's status and event widgets: a ``value``."""

    def __init__(self) -> None:
        self.value = ""


class _StreamFrames:
    """A :class:`StreamPlayer` as :func:`write_html` reads a Player: batch ``i`` is step
    ``i`` (-1 for a stream with no batch yet), and each batch gets a status line and its
    event list, as a Player's step does."""

    unit = "batch"

    def __init__(self, sp: StreamPlayer) -> None:
        self._sp = sp
        n = len(sp.stream)
        self.first_step = 0 if n else -1
        self.last_step = n - 1
        self.named_steps: dict[str, int] = {}
        self.views = {"prefixes": sp.prefixes, "series": sp.series}
        self._name = sp.title
        self.description = ""
        self._status = _Text()
        self._events = _Text()
        self._batches = sp.stream.batches  # one copy, not one per exported batch

    @property
    def step(self) -> int:
        return self._sp.index

    def go_to(self, index: int) -> None:
        self._sp.go_to(index)
        if index < 0:
            self._status.value, self._events.value = "before the first batch", ""
            return
        snap, s = self._sp.stream.at(index), self._sp.stream.series
        notes = []
        lost = s.missing[index] - (s.missing[index - 1] if index else 0)
        if lost:
            notes.append(f"{lost} batch{'es' if lost != 1 else ''} lost before it")
        if snap.restarted:
            notes.append("the publisher restarted: a new run, from an empty cache")
        if snap.cleared:
            notes.append("AllBlocksCleared")
        self._status.value = (
            f"<b>batch {index}</b> · seq {snap.seq} · {snap.num_blocks} blocks cached · "
            f"{s.stored_blocks[index]} stored · {s.removed_blocks[index]} removed" + "".join(f" · {html.escape(x)}" for x in notes)
        )
        events = self._batches[index].events
        rows = [f"<li>{html.escape(_describe(e))}</li>" for e in events[:MAX_LISTED_EVENTS]]
        if len(events) > MAX_LISTED_EVENTS:
            rows.append(f"<li>… and {len(events) - MAX_LISTED_EVENTS} more events</li>")
        self._events.value = f"<ul style='font-size:12px;margin:4px 0'>{''.join(rows)}</ul>" if rows else ""


def _describe(ev: Any) -> str:
    kind = type(ev).__name__
    hashes = getattr(ev, "block_hashes", None)
    if hashes is None:
        return kind
    where = f"group {ev.group_idx}, {ev.medium}" if ev.group_idx is not None else f"{ev.medium}"
    return f"{kind}: {len(hashes)} block{'s' if len(hashes) != 1 else ''} ({where})"


_STYLE = f"""
body {{ font-family: {FONT}; margin: 12px; color: #111; }}
.kv-controls {{ display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 6px 0; }}
.kv-controls button {{ font: inherit; padding: 3px 10px; border: 1px solid #999; background: #f4f4f4; border-radius: 3px; cursor: pointer; }}
.kv-controls button:hover {{ background: #e8e8e8; }}
.kv-controls input[type=range] {{ width: 360px; }}
.kv-grid {{ display: grid; grid-template-columns: repeat(2, max-content); gap: 4px 8px; align-items: start; }}
.kv-desc {{ font-size: 12px; color: #444; max-width: 930px; }}
"""

_SCRIPT = """
const D = JSON.parse(document.getElementById('kv-data').textContent);
const views = D.views, n = D.frames.length;
const unpacked = new Map();
function unpack(o) {
  if (Array.isArray(o)) return o.map(unpack);
  if (o && typeof o === 'object') {
    if (o.__s) return o.__s.map(x => Array.isArray(x) ? x.map(i => D.strings[i]) : D.strings[x]);
    const r = {}; for (const k in o) r[k] = unpack(o[k]); return r;
  }
  return o;
}
function trace(t) { if (!unpacked.has(t)) unpacked.set(t, unpack(D.traces[t])); return unpacked.get(t); }
const divs = views.map((_, v) => document.getElementById('kv-view-' + v));
const slider = document.getElementById('kv-slider');
const playBtn = document.getElementById('kv-play');
let k = D.start, timer = null;
function show(i) {
  k = Math.max(0, Math.min(n - 1, i));
  const f = D.frames[k];
  views.forEach((_, v) => {
    const [li, ts] = f[v];
    Plotly.react(divs[v], ts.map(trace), D.layouts[li], D.config);
  });
  document.getElementById('kv-status').innerHTML = D.status[k];
  document.getElementById('kv-events').innerHTML = D.events[k];
  slider.value = k;
  document.getElementById('kv-step').textContent = (D.unit || 'step') + ' ' + D.steps[k];
  document.body.dataset.step = D.steps[k];
}
function pause() { if (timer) { clearInterval(timer); timer = null; } playBtn.textContent = '▶ Play'; }
function play() {
  if (timer) { pause(); return; }
  if (k >= n - 1) show(0);
  playBtn.textContent = '❚❚ Pause';
  timer = setInterval(() => { if (k >= n - 1) { pause(); } else { show(k + 1); } }, D.interval);
}
document.getElementById('kv-back').onclick = () => { pause(); show(k - 1); };
document.getElementById('kv-next').onclick = () => { pause(); show(k + 1); };
playBtn.onclick = play;
slider.max = n - 1;
slider.oninput = () => { pause(); show(parseInt(slider.value, 10)); };
const jump = document.getElementById('kv-jump');
if (jump) jump.onchange = () => { const s = parseInt(jump.value, 10); if (s >= 0) { pause(); show(D.steps.indexOf(s)); } jump.value = '-1'; };
show(k);
"""


def write_html(player: Player | StreamPlayer, path: str | os.PathLike[str], *, max_steps: int = MAX_STEPS) -> Path:
    """Write ``player``'s whole run (a Player's steps, a StreamPlayer's batches) as a
    self-contained HTML replay; returns the path."""
    from plotly.offline import get_plotlyjs

    from kvlab.viz.stream import StreamPlayer

    if not isinstance(max_steps, int) or max_steps < 2:
        raise ValueError(f"max_steps must be an int >= 2, got {max_steps!r}")
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path must end in .html, got {str(path)!r}")
    if not path.parent.exists():
        raise FileNotFoundError(f"path: the folder {str(path.parent)!r} does not exist")
    src: Player | _StreamFrames = _StreamFrames(player) if isinstance(player, StreamPlayer) else player
    all_steps = list(range(src.first_step, src.last_step + 1))
    every = max(1, -(-len(all_steps) // max_steps))
    steps = all_steps[::every]
    if steps[-1] != all_steps[-1]:
        steps.append(all_steps[-1])
    for s in sorted(set(src.named_steps.values()) | {src.step}):  # named moments are never skipped
        if s in all_steps and s not in steps:
            steps.append(s)
    steps.sort()
    data = frames(src, steps)
    data.update(
        views=list(src.views),
        config=dict(PLOTLY_CONFIG),
        interval=900,
        unit=getattr(src, "unit", "step"),
        start=steps.index(src.step) if src.step in steps else 0,
    )
    title = html.escape(src._name)
    desc = f"<div class='kv-desc'>{html.escape(src.description)}</div>" if src.description else ""
    jump = ""
    if src.named_steps:
        opts = "".join(f"<option value='{s}'>{html.escape(k)} (step {s})</option>" for k, s in src.named_steps.items())
        jump = f"<label>jump to <select id='kv-jump'><option value='-1'>—</option>{opts}</select></label>"
    views = "".join(f"<div id='kv-view-{i}'></div>" for i in range(len(src.views)))
    doc = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{title} · kvlab replay</title><style>{_STYLE}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        f"<div><b style='font-size:14px'>{title}</b>{desc}</div>"
        "<div class='kv-controls'>"
        "<button id='kv-back'>◀ Back</button><button id='kv-play'>▶ Play</button><button id='kv-next'>Step ▶</button>"
        f"<input id='kv-slider' type='range' min='0' value='0' step='1'><span id='kv-step'></span>{jump}"
        "</div><div id='kv-status'></div>"
        f"<div class='kv-grid'>{views}</div><div id='kv-events' style='max-width:930px'></div>"
        f"<script type='application/json' id='kv-data'>{_json_for_script(data)}</script>"
        f"<script>{_SCRIPT}</script>"
        "<p style='font-size:10px;color:#777'>kvlab replay: plotly.js and every step are in this file; it needs no network and no Python.</p>"
        "</body></html>"
    )
    path.write_text(doc, encoding="utf-8")
    return path
