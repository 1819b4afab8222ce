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
point into; so a file is plotly.js (~4.7 MB) plus what actually changes. The request menu
works in the file as in the Lab: each figure comes with what selecting each request changes
in it (the selection mark, a bold row name; for the kernel view, that request's reads), and
the file opens with the Player's selection.

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

from kvlab.viz.frames import FramePacker
from kvlab.viz.style import FONT, PLOTLY_CONFIG
from kvlab.utils.math_utils import cdiv

STATIC = Path(__file__).with_name("static")

if TYPE_CHECKING:
    from kvlab.viz.player import Player
    from kvlab.viz.stream import StreamPlayer

MAX_STEPS = 3000  # a longer run is exported at every k-th step (the slider still covers it)


def _json_for_script(obj: Any) -> str:
    """JSON that can sit inside a <script> element ("</" would end it)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")


def frames(player: Player | StreamPlayer, steps: list[int]) -> dict[str, Any]:
    """Every view's figure at each of ``steps``, packed as the renderer reads them
    (:class:`~kvlab.viz.frames.FramePacker`: ``traces``, ``layouts`` and ``strings`` hold each
    distinct part once; ``frames[i][v]`` = (layout index, [trace indices]) of view ``v`` at
    ``steps[i]``), plus the status and event-list HTML of each step (a stream's batch). The
    player stays where it is."""
    try:
        return FramePacker(player._figures_at).pack(steps)
    finally:
        player._figures_done()


_STYLE = f"body {{ font-family: {FONT}; margin: 12px; color: #111; }}"  # the rest comes with replay.js

# The page's own lines: mount the renderer (the same one the Player uses in JupyterLab) on
# the data in the page, with ids a reader (or a test) can name, and show the starting step.
_SCRIPT = """
const D = JSON.parse(document.getElementById('kv-data').textContent);
const api = kvlabReplay.mount(document.getElementById('kv-root'), D, { ids: true });
api.add(D);
api.go(D.steps[D.start]);
"""


def write_html(player: Player | StreamPlayer, path: str | os.PathLike[str], *, max_steps: int = MAX_STEPS) -> Path:
    """Write ``player``'s whole run (a Player's steps, a StreamPlayer's batches) as a
    self-contained HTML replay; returns the path."""
    from plotly.offline import get_plotlyjs

    from kvlab.viz.player import Player

    if not isinstance(max_steps, int) or max_steps < 2:
        raise ValueError(f"max_steps must be an int >= 2, got {max_steps!r}")
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path must end in .html, got {str(path)!r}")
    if not path.parent.exists():
        raise FileNotFoundError(f"path: the folder {str(path.parent)!r} does not exist")
    src = player
    all_steps = list(range(src.first_step, src.last_step + 1))
    every = max(1, cdiv(len(all_steps), max_steps))
    steps = all_steps[::every]
    if steps[-1] != all_steps[-1]:
        steps.append(all_steps[-1])
    for s in sorted(set(src.named_steps.values()) | {src.step}):  # named moments are never skipped
        if s in all_steps and s not in steps:
            steps.append(s)
    steps.sort()
    data = frames(src, steps)
    cols = 2 if len(src.views) > 1 and getattr(src, "unit", "step") == "step" else 1  # a stream's views stack
    data.update(
        views=list(src.views),
        config=dict(PLOTLY_CONFIG),
        interval=900,
        unit=getattr(src, "unit", "step"),
        columns=cols,
        start=steps.index(src.step) if src.step in steps else 0,
    )
    data.update(
        title=src._name,
        description=src.description,
        named=[[k, v] for k, v in src.named_steps.items()],
        # A Player's request menu works in the file too: every figure carries what selecting
        # each request changes in it. A stream has no requests to pick.
        requests=src._request_ids() if isinstance(src, Player) else None,
        selected=src._selected if isinstance(src, Player) else None,
        can_run=False,
        width=cols * max((v.width for v in src.views.values()), default=400) + 16,
    )
    title = html.escape(src._name)
    doc = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{title} · kvlab replay</title><style>{_STYLE}</style>"
        f"<script>{get_plotlyjs()}</script></head><body><div id='kv-root'></div>"
        f"<script type='application/json' id='kv-data'>{_json_for_script(data)}</script>"
        f"<script>{(STATIC / 'replay.js').read_text(encoding='utf-8')}</script>"
        f"<script>{_SCRIPT}</script>"
        "<p style='font-size:10px;color:#777'>kvlab replay: plotly.js and every step are in this file; it needs no network and no Python.</p>"
        "</body></html>"
    )
    path.write_text(doc, encoding="utf-8")
    return path
