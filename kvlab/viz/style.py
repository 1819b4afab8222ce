"""Colours, marks and small text helpers shared by every view.

**One colour, one meaning, in every picture.** A learner who has seen "orange = shared"
once reads every other picture without a legend, so no colour is reused for something
else anywhere in kvlab's views:

=================  =====================================================================
colour             meaning (everywhere)
=================  =====================================================================
light grey         a free block (nothing reusable in it)
sky blue           the prefix cache: a cached block; a prefix hit; the hit-rate series
bluish green       a block in use by one request; KV-cache usage (blocks held)
orange             a block shared by several requests
dark grey          the null block (block 0)
yellow             a waiting request
blue               a running request
vermillion         a preempted request (and the preemption marks)
mid grey           a finished request
reddish purple     a slot the attention kernel reads
dark purple        the query token's slot (read too: it attends to itself), marked "q"
white              an empty slot / nothing
black              ink: text, the step cursor, the lookup walk, the kernel's traced loads
=================  =====================================================================

The colours are the Okabe-Ito set (sky blue lightened, so that "cached" and "shared" do not
have the same lightness), chosen to stay distinguishable for the common kinds of colour
blindness: block states, and request states, stay at least ΔE 15 apart (CIELAB) for
protanopes, deuteranopes and tritanopes, and at least 8 apart in lightness alone, enough for
a greyscale print (``tests/test_viz.py`` simulates the four; ``tests/browser`` screenshots
the views under Chromium's emulation of the same deficiencies). Numbers in the cells (ref
counts, block ids) carry the meaning a second time.

**The selection mark** (the request chosen in the Player's drop-down) is a black frame with
a white inner frame: nothing else in any view is drawn that way, it needs no colour, and
one of its two frames contrasts with every fill.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.timeline.snapshot import BLOCK_STATES, CACHED, FREE, IN_USE, NULL, SHARED

# -- the palette: one colour per concept (see the table above) --------------------------------
LIGHT_GREY = "#e6e6e6"
SKY_BLUE = "#9fd3f2"  # Okabe-Ito sky blue, lightened: "cached" must not share its lightness with "shared"
BLUISH_GREEN = "#009e73"
ORANGE = "#e69f00"
DARK_GREY = "#3b3b3b"
YELLOW = "#f0e442"
DARK_BLUISH_GREEN = "#00503a"  # Okabe-Ito bluish green, darkened: apart from every status colour, in greyscale too
DARK_YELLOW = "#a89a00"  # the waiting colour, dark enough for a thin line on white
BLUE = "#0072b2"
VERMILLION = "#d55e00"
MID_GREY = "#999999"
DARK_INDIGO = "#2b1d4f"  # the paused status: darker than every other status, apart from each for dichromats
# The routing figure's replicas: greys apart from every grey that means something (the null
# block's dark grey, "finished", "free"), so a replica never reads as one of those.
REPLICA_GREYS = ("#1f1f1f", "#5a5a5a", "#7a7a7a", "#b8b8b8", "#cbcbcb")
PURPLE = "#cc79a7"
# The query token's slot: the read colour's hue, darkened -- it is read too -- yet ΔE >= 20 from
# the read slots and >= 21 from the null block for every dichromat, 16 in lightness alone. No
# palette colour was free: every other hue is a block or request state, ink the load marks.
DARK_PURPLE = "#99407a"
WHITE = "#ffffff"
INK = "#000000"

# -- block states (the pool's vocabulary) ---------------------------------------------------
STATE_COLORS: dict[str, str] = {
    NULL: DARK_GREY,  # the placeholder block 0, never holds KV
    FREE: LIGHT_GREY,  # on the free queue, nothing reusable in it
    CACHED: SKY_BLUE,  # on the free queue but still hashed -> a hit can revive it
    IN_USE: BLUISH_GREEN,  # in exactly one block table
    SHARED: ORANGE,  # in several block tables (ref count > 1)
}
STATE_LABELS: dict[str, str] = {NULL: "null", FREE: "free", CACHED: "cached", IN_USE: "in use", SHARED: "shared"}
# The longer wording for hover text, where there is room to say what the state means.
STATE_HELP: dict[str, str] = {
    NULL: "the null block (padding, holds no K/V)",
    FREE: "free (nothing reusable in it)",
    CACHED: "cached, free: evictable, yet a prefix hit can take it back",
    IN_USE: "in use by one request",
    SHARED: "shared by several requests",
}
# Index of each state in the heatmaps' discrete colour scale.
STATE_INDEX: dict[str, int] = {s: i for i, s in enumerate(BLOCK_STATES)}
# Text drawn on a cell must stay readable on its fill.
STATE_TEXT_COLORS: dict[str, str] = {NULL: "white", FREE: "#333333", CACHED: "black", IN_USE: "white", SHARED: "black"}

# -- marks (shapes, not colours) ----------------------------------------------------------------
SELECT_OUTER = INK  # the selection mark: a black frame ...
SELECT_INNER = WHITE  # ... with a white frame inside it
CURSOR = INK  # the current step in the timeline (a dashed line)
HIT = SKY_BLUE  # a prefix hit belongs to the prefix cache
WALK = INK  # the latest lookup's walk through the hash chains
MISS = INK  # where that walk stopped (an x)
USAGE = BLUISH_GREEN  # KV-cache usage = the share of blocks held by requests

# -- request lifecycle (the timeline's Gantt) -----------------------------------------------
STATUS_ORDER = ("waiting", "loading", "running", "paused", "preempted", "finished")
STATUS_COLORS: dict[str, str] = {
    "waiting": YELLOW,
    "loading": DARK_BLUISH_GREEN,  # waiting for a connector's KV, holding its blocks
    "running": BLUE,
    "paused": DARK_INDIGO,  # a streaming session between turns, holding its blocks
    "preempted": VERMILLION,  # waiting again, its KV thrown away
    "finished": MID_GREY,
}

# -- the attention kernel's reads -----------------------------------------------------------
KERNEL_ORDER = ("read", "query", "outside_window", "null", "unwritten")
KERNEL_COLORS: dict[str, str] = {
    "read": PURPLE,  # a key/value the query token attends to
    "query": DARK_PURPLE,  # the query token itself: read too (it attends to itself), marked "q"
    "outside_window": WHITE,  # in the table but outside the sliding window: not read (marked "×")
    "null": DARK_GREY,  # the null block: padding, never read
    "unwritten": WHITE,  # a slot of the tail block that holds no token yet
}
KERNEL_LABELS: dict[str, str] = {
    "read": "read",
    "query": "q = the query token",
    "outside_window": "× outside window",
    "null": "null ∅",
    "unwritten": "empty slot",
}
# Legend symbols of the kernel states (the "q" and "×" are drawn as cell text).
KERNEL_SYMBOLS: dict[str, str] = {
    "read": "square",
    "query": "square",
    "outside_window": "square-x-open",
    "null": "square",
    "unwritten": "square",
}

FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"

# -- the Player's event list: each event class names its tone (``Event.tone``) -----------------
TONE_STYLES = {
    "": "",
    "step": "color:#666;font-weight:bold",
    "hit": f"background:#e3f2fb;border-left:3px solid {SKY_BLUE};padding-left:3px",
    "evict": "color:#444;font-style:italic",
    "alert": f"color:{VERMILLION};font-weight:bold",
}

# plotly's figure options for every view: no toolbar (it covered the titles), no logo.
PLOTLY_CONFIG = {"displayModeBar": False, "displaylogo": False, "responsive": False}


def discrete_colorscale(colors: Sequence[str]) -> list[list[float | str]]:
    """A plotly colour scale with one flat band per category.

    Heatmaps take numbers, not categories; with ``zmin=-0.5, zmax=n-0.5`` the integer
    ``i`` falls in the middle of band ``i``, so category ``i`` is drawn in ``colors[i]``
    and never in a blend of two colours.
    """
    n = len(colors)
    scale: list[list[float | str]] = []
    for i, c in enumerate(colors):
        scale.append([i / n, c])
        scale.append([(i + 1) / n, c])
    return scale


def short_hash(h: str | None) -> str:
    """The first 8 hex digits of a block hash: enough to tell blocks apart on screen."""
    return h[:8] if h else "—"


def default_decode(token_id: int) -> str:
    """Render a token id when no tokenizer is given: the id itself."""
    return str(token_id)


def render_tokens(token_ids: Sequence[int] | None, decode: Callable[[int], str] | None, max_chars: int = 24) -> str:
    """A block's tokens as a short string (at most ``max_chars`` characters, "…" if cut).

    With ``decode`` (e.g. ``ByteTokenizer().token_to_text``) the characters are joined;
    without it the ids are run-length compressed, so vLLM's test prompt ``[0]*16`` reads
    ``0×16`` instead of sixteen zeros. Rendering stops as soon as the limit is passed:
    the hash view labels hundreds of blocks on every redraw.
    """
    if not token_ids:
        return ""
    parts: list[str] = []
    length = 0
    i, n = 0, len(token_ids)
    while i < n and length <= max_chars:
        if decode is not None:
            piece = decode(token_ids[i])
            i += 1
        else:
            j = i
            while j + 1 < n and token_ids[j + 1] == token_ids[i]:
                j += 1
            run = j - i + 1
            piece = (f"{token_ids[i]}×{run}" if run > 2 else " ".join([str(token_ids[i])] * run)) + (" " if j + 1 < n else "")
            i = j + 1
        parts.append(piece)
        length += len(piece)
    text = "".join(parts)
    if i < n or len(text) > max_chars:
        return text[: max(1, max_chars - 1)].rstrip() + "…"
    return text


def html_escape(text: str) -> str:
    """Escape the characters plotly's pseudo-HTML labels would otherwise interpret."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
