"""Colours and small text helpers shared by every view.

One palette for the whole package, so that a block has the same colour in the pool, in a
block table, on the free queue and in the hash forest: a learner who has seen "orange =
shared" once reads every other picture without a legend. The colours are from the
Okabe-Ito set, chosen to stay distinguishable for the common kinds of colour blindness;
states that matter most (shared versus in use versus cached) differ in lightness too, so
they survive a greyscale print.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.timeline.snapshot import BLOCK_STATES, CACHED, FREE, IN_USE, NULL, SHARED

# -- block states (the pool's vocabulary) ---------------------------------------------------
STATE_COLORS: dict[str, str] = {
    NULL: "#3b3b3b",  # dark grey: the placeholder block 0, never holds KV
    FREE: "#e6e6e6",  # light grey: on the free queue, nothing reusable in it
    CACHED: "#56b4e9",  # sky blue: on the free queue but still hashed -> a hit can revive it
    IN_USE: "#009e73",  # bluish green: in exactly one block table
    SHARED: "#e69f00",  # orange: in several block tables (ref count > 1)
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

HIGHLIGHT = "#d55e00"  # vermillion: the selected request's blocks, in every view
HIT = "#009e73"  # bluish green ring: a hash the latest lookup hit
MISS = "#cc79a7"  # reddish purple cross: where the latest lookup stopped (not the selection colour)
CURSOR = "#cc79a7"  # the current step in the timeline

# -- request lifecycle (the timeline's Gantt) -----------------------------------------------
STATUS_ORDER = ("waiting", "running", "preempted", "finished")
STATUS_COLORS: dict[str, str] = {
    "waiting": "#f0e442",  # yellow
    "running": "#0072b2",  # blue
    "preempted": "#d55e00",  # vermillion: waiting again, its KV thrown away
    "finished": "#999999",
}

# -- the attention kernel's reads -----------------------------------------------------------
KERNEL_ORDER = ("read", "query", "outside_window", "null", "unwritten")
KERNEL_COLORS: dict[str, str] = {
    "read": "#0072b2",  # blue: a key/value the query token attends to
    "query": "#e69f00",  # orange: the query token itself (also read: it attends to itself)
    "outside_window": "#d9d9d9",  # grey: in the table but outside the sliding window
    "null": "#3b3b3b",  # the null block: padding, never read
    "unwritten": "#ffffff",  # a slot of the tail block that holds no token yet
}
KERNEL_LABELS: dict[str, str] = {
    "read": "read",
    "query": "query token",
    "outside_window": "outside window",
    "null": "null ∅",
    "unwritten": "empty slot",
}

FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"

# -- the Player's event list: each event class names its tone (``Event.tone``) -----------------
TONE_STYLES = {
    "": "",
    "step": "color:#666;font-weight:bold",
    "hit": "color:#007a5a",
    "evict": "color:#b35900",
    "alert": f"color:{HIGHLIGHT};font-weight:bold",
}


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
