"""HashChainView: the prefix cache as a forest of hash chains (lesson 03).

Each full block's hash covers its parent's hash and its own tokens, so a hash names a
whole prefix, and the cached hashes form a forest: a root per distinct first block, a
branch wherever two prompts diverge. This view lays that forest out left to right (x =
block position in the prefix), labels each node with the tokens of its block, colours it
like the block that carries it, and draws the walk of the latest lookup: the leading
hashes that hit (a thick black line from the start through them), the first miss (a black
cross -- a hash the map did not hold) and the stop. A key that names several physical
blocks (duplicates, lesson 04) is drawn as a stack of two squares and labelled ``×2``. A prefix hit is always a walk from a root along one branch that ends
at the first miss; nothing after a miss can be used, even if it is cached.

The layout is a small "tidy tree" computed here: leaves get consecutive rows, a parent
sits halfway between its first and last child.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.timeline.snapshot import CACHED, IN_USE, SHARED, Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces, selection_traces
from kvlab.viz.style import (
    MISS,
    STATE_COLORS,
    WALK,
    STATE_HELP,
    STATE_LABELS,
    discrete_colorscale,
    html_escape,
    render_tokens,
    short_hash,
)

_RANK = {CACHED: 0, IN_USE: 1, SHARED: 2}
_NODE_STATES = (CACHED, IN_USE, SHARED)
MAX_TEXT_NODES = 300  # beyond this, labels live in the hover text only
MAX_TIPS = 16  # request names drawn at the end of their chains
MIN_LABEL_ROW_PX = 34  # rows closer than this (two label lines, above and below) get labels only on the walk and the selection
LEGEND_LABELS = (
    "parent evicted",
    STATE_LABELS[CACHED],
    STATE_LABELS[IN_USE],
    STATE_LABELS[SHARED],
    "lookup walk (hits)",
    "first miss",
    "×2 one key, two blocks",
)


def _layout(snapshot: Snapshot) -> tuple[dict[str, int], dict[str, float], list[tuple[str, str]], set[str]]:
    """Depth and row of every node (tidy tree), the edges and the orphan roots."""
    nodes = snapshot.hash_nodes
    children: dict[str | None, list[str]] = {}
    orphans: set[str] = set()
    for h, n in nodes.items():
        parent = n.parent_hash if n.parent_hash in nodes else None
        if n.parent_hash is not None and parent is None:
            orphans.add(h)  # its parent block was evicted: the chain's start is gone
        children.setdefault(parent, []).append(h)
    first_block = {h: min(n.block_ids) if n.block_ids else 1 << 30 for h, n in nodes.items()}
    for lst in children.values():
        lst.sort(key=lambda h: first_block[h])
    depth: dict[str, int] = {}
    row: dict[str, float] = {}
    edges: list[tuple[str, str]] = []
    next_row = 0
    # Iterative post-order walk: a long chain (hundreds of blocks) must not hit the recursion limit.
    for root in children.get(None, []):
        stack: list[tuple[str, int, bool]] = [(root, 0, False)]
        while stack:
            h, d, done = stack.pop()
            kids = children.get(h, [])
            if done:
                row[h] = (row[kids[0]] + row[kids[-1]]) / 2 if kids else float(next_row)
                if not kids:
                    next_row += 1
                continue
            depth[h] = d
            stack.append((h, d, True))
            for k in reversed(kids):
                edges.append((h, k))
                stack.append((k, d + 1, False))
    return depth, row, edges, orphans


def figure_data(
    snapshot: Snapshot,
    selected_request: str | None = None,
    *,
    decode: Callable[[int], str] | None = None,
    max_label_chars: int | None = None,
    plot_width: float = 500.0,
) -> dict[str, Any]:
    """The forest and the latest lookup as plain data.

    ``nodes``: one dict per cached hash (``hash``, ``parent``, ``depth``, ``row``,
    ``label`` = its tokens, ``state``, ``color``, ``block_ids``, ``owners``, ``lookup`` =
    "hit"/"miss"/None, ``selected``). ``edges``: (parent, child) hash pairs. ``lookup``:
    ``request_id``, ``hits`` (hashes), ``miss`` (the first missing hash or None),
    ``stop`` ("miss", "cap" -- the last prompt token is always recomputed -- or "end"),
    ``ghost`` (x, y of the drawn miss when that hash is not in the forest).

    ``max_label_chars`` (default: what fits in ``plot_width`` pixels) caps each label;
    labels alternate above and below their nodes, so each may use about two chain
    positions' worth of width.
    """
    depth, row, edges, orphans = _layout(snapshot)
    if max_label_chars is None:
        per_level = plot_width / (max(depth.values(), default=0) + 1.5)
        max_label_chars = max(3, min(16, int(2 * per_level / 6.8) - 1))
    nodes_out: list[dict[str, Any]] = []
    lk = snapshot.last_lookup
    hits: list[str] = []
    miss: str | None = None
    stop = None
    ghost: tuple[float, float] | None = None
    ghost_parent: str | None = None
    if lk is not None:
        hits = lk.block_hashes[: lk.num_hit_blocks]
        k = lk.num_hit_blocks
        if k >= len(lk.block_hashes):
            stop = "end"
        elif (k + 1) * snapshot.block_size > lk.max_hit_tokens:
            stop = "cap"
        else:
            stop = "miss"
            miss = lk.block_hashes[k]
            if miss in row:
                # The request computed the missing block after the lookup and cached it:
                # the miss is now a node of the forest; mark it there.
                ghost = (float(depth[miss]), row[miss])
            else:
                ghost_parent = hits[-1] if hits and hits[-1] in row else None
                gy = row[ghost_parent] + 0.45 if ghost_parent is not None else -1.0
                ghost = (float(k), gy)
    hit_set = set(hits)
    selected: set[str] = set()
    if selected_request in snapshot.requests:
        for table in snapshot.requests[selected_request].block_table:
            for bid in table:
                h = snapshot.blocks[bid].block_hash if bid else None
                if h is not None:
                    selected.add(h)
    for h, n in snapshot.hash_nodes.items():
        state = CACHED
        owners: list[str] = []
        for bid in n.block_ids:
            b = snapshot.blocks[bid]
            if _RANK.get(b.state, 0) > _RANK[state]:
                state = b.state
            owners.extend(o for o in b.owners if o not in owners)
        look = "hit" if h in hit_set else ("miss" if h == miss else None)
        dup = len(n.block_ids) > 1
        nodes_out.append(
            dict(
                hash=h,
                parent=n.parent_hash,
                depth=depth.get(h, 0),
                row=row.get(h, 0.0),
                label=render_tokens(n.token_ids, decode, max_label_chars) + (f" ×{len(n.block_ids)}" if dup else ""),
                duplicate=dup,
                tokens=list(n.token_ids),
                state=state,
                color=STATE_COLORS[state],
                block_ids=list(n.block_ids),
                owners=owners,
                orphan=h in orphans,
                lookup=look,
                selected=h in selected,
            )
        )
    # Where each live request's cached chain ends (its deepest cached block); requests
    # ending at the same node share one label.
    at_node: dict[str, list[str]] = {}
    for rid in snapshot.running[:MAX_TIPS]:
        best = None
        for bid in snapshot.requests[rid].block_table[0] if snapshot.requests[rid].block_table else []:
            h = snapshot.blocks[bid].block_hash if bid else None
            if h in depth and (best is None or depth[h] >= depth[best]):
                best = h
        if best is not None:
            at_node.setdefault(best, []).append(rid)
    tips = [(", ".join(rids), depth[h], row[h]) for h, rids in at_node.items()]
    # The lookup walk: a stub before the first block, then through every hit, to the stop.
    walk_x: list[float] = []
    walk_y: list[float] = []
    hit_pos = [(float(depth[h]), row[h]) for h in hits if h in depth]
    if hit_pos or ghost is not None:
        first = hit_pos[0] if hit_pos else ghost
        assert first is not None  # hits, or else a ghost (the condition above)
        walk_x, walk_y = [first[0] - 0.45], [first[1]]
        for x, y in hit_pos:
            walk_x.append(x)
            walk_y.append(y)
        if ghost is not None:
            walk_x.append(ghost[0])
            walk_y.append(ghost[1])
    ex: list[float | None] = []
    ey: list[float | None] = []
    for p, c in edges:
        ex += [depth[p], depth[c], None]
        ey += [row[p], row[c], None]
    if lk is None:
        summary = "no prefix lookup yet"
    else:
        k, rid, toks = lk.num_hit_blocks, lk.request_id, lk.num_hit_tokens
        summary = {
            "miss": f"last lookup, {rid}: {k} hit ({toks} tokens), then the first miss ✗",
            "cap": f"last lookup, {rid}: {k} hit ({toks} tokens), then the cap: the last token is recomputed",
            "end": f"last lookup, {rid}: all {k} full blocks hit ({toks} tokens)",
        }[stop or "end"]
    return dict(
        nodes=nodes_out,
        edges=edges,
        edge_x=ex,
        edge_y=ey,
        lookup=dict(request_id=lk.request_id if lk else None, hits=hits, miss=miss, stop=stop, ghost=ghost, ghost_parent=ghost_parent),
        tips=tips,
        walk_x=walk_x,
        walk_y=walk_y,
        max_depth=max(depth.values(), default=0),
        num_rows=max((r for r in row.values()), default=0) + 1,
        title=f"Hash chains · step {snapshot.step} · {len(nodes_out)} cached hashes",
        summary=summary,
    )


class HashChainView(View):
    """The hash-chain forest of the prefix cache, with the latest lookup's hit/miss walk."""

    name = "hash"
    title = "Hash chains"

    def __init__(
        self, timeline: Timeline | None = None, *, decode: Callable[[int], str] | None = None, width: int = 482, height: int = 330
    ) -> None:
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        # 0 edges, 1 the lookup walk, 2 duplicate shadows, 3 hashes, 4 first miss, 5 parent
        # evicted, 6-7 the selection mark, then legend-only traces.
        fig.add_trace(
            go.Scatter(x=[], y=[], mode="lines", line=dict(color="#9a9a9a", width=1.5), hoverinfo="skip", name="edges", showlegend=False)
        )
        fig.add_trace(
            go.Scatter(x=[], y=[], mode="lines", line=dict(color=WALK, width=4), hoverinfo="skip", name="lookup walk", showlegend=False)
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                hoverinfo="skip",
                name="duplicates",
                showlegend=False,
                marker=dict(
                    size=15,
                    symbol="square",
                    cmin=-0.5,
                    cmax=len(_NODE_STATES) - 0.5,
                    colorscale=discrete_colorscale([STATE_COLORS[s] for s in _NODE_STATES]),
                    line=dict(width=1.5, color="#333333"),
                ),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers+text",
                name="hashes",
                textposition="bottom center",
                showlegend=False,
                textfont=dict(size=10),
                hovertemplate="%{hovertext}<extra></extra>",
                cliponaxis=False,
                # Colours as numbers on a discrete scale: plotly validates a list of colour
                # *strings* one regex at a time, which dominated the redraw of big forests.
                marker=dict(
                    size=15,
                    symbol="square",
                    cmin=-0.5,
                    cmax=len(_NODE_STATES) - 0.5,
                    colorscale=discrete_colorscale([STATE_COLORS[s] for s in _NODE_STATES]),
                    line=dict(width=1, color="#555555"),
                ),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers+text",
                name="first miss",
                text=[],
                textposition="bottom center",
                showlegend=False,
                marker=dict(symbol="x-thin-open", size=16, line=dict(width=3, color=MISS), color=MISS),
                textfont=dict(size=10, color=MISS),
                hovertemplate="%{hovertext}<extra></extra>",
                cliponaxis=False,
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name="parent evicted",
                hoverinfo="skip",
                marker=dict(symbol="diamond-open", size=22, color="#777777", line=dict(width=1.5, color="#777777")),
            )
        )
        for tr in selection_traces(go, 22):
            fig.add_trace(tr)
        for tr in legend_traces(go, STATE_COLORS, STATE_LABELS, (CACHED, IN_USE, SHARED)):
            fig.add_trace(tr)
        fig.add_trace(
            go.Scatter(x=[None], y=[None], mode="lines", name="lookup walk (hits)", line=dict(color=WALK, width=4), hoverinfo="skip")
        )
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name="first miss",
                marker=dict(symbol="x-thin-open", size=11, color=MISS, line=dict(width=3, color=MISS)),
                hoverinfo="skip",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name="×2 one key, two blocks",
                marker=dict(symbol="square", size=11, color="white", line=dict(width=1.5, color="#333333")),
                hoverinfo="skip",
            )
        )
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            xaxis=dict(
                title=dict(text="block position in the prefix", font=dict(size=10), standoff=2),
                dtick=1,
                zeroline=False,
                showgrid=False,
                fixedrange=True,
                autorange=False,
            ),
            yaxis=dict(visible=False, autorange=False, fixedrange=True),
            margin=dict(l=16, r=16, t=80, b=36),
        )

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot, selected_request, decode=self.decode, plot_width=self.width - 40)
        self.last_data = d
        nodes = d["nodes"]
        rows = d["num_rows"]
        # Pixels between two rows of the forest: when they are too close, labels and request
        # names would overlap, so only the lookup walk and the selection keep theirs.
        row_px = (self.height - 130) / max(rows, 2)
        level_px = (self.width - 60) / (d["max_depth"] + 1.5)
        # Labels alternate above and below, so each may use two levels' width.
        longest = max((len(n["label"]) for n in nodes), default=0)
        crowded = row_px < MIN_LABEL_ROW_PX or 2 * level_px < 6.5 * longest + 12
        show_text = len(nodes) <= MAX_TEXT_NODES
        xs = [n["depth"] for n in nodes]
        ys = [n["row"] for n in nodes]
        texts = [html_escape(n["label"]) if show_text and (not crowded or n["lookup"] or n["selected"]) else "" for n in nodes]
        # Per-point enumerations cost plotly a regex per element: only when labels are drawn.
        positions: list[str] | str = ["top center" if n["depth"] % 2 else "bottom center" for n in nodes] if show_text else "bottom center"
        colors = [_RANK[n["state"]] for n in nodes]
        size = 15 if row_px >= 20 and len(nodes) <= 120 else max(6, min(15, int(row_px * 0.7)))
        hover = []
        for n in nodes:
            full = html_escape(render_tokens(n["tokens"], self.decode, 48))
            extra = "<br>(its parent was evicted: unreachable by a lookup)" if n["orphan"] else ""
            look = f"<br>latest lookup: <b>{n['lookup']}</b>" if n["lookup"] else ""
            dup = f"<br><b>one key, {len(n['block_ids'])} physical blocks</b> (duplicates: a lookup takes either)" if n["duplicate"] else ""
            hover.append(
                f"<b>hash {short_hash(n['hash'])}</b> ← parent {short_hash(n['parent'])}<br>tokens {full}<br>"
                f"blocks {n['block_ids']} · {STATE_HELP[n['state']]}<br>held by {', '.join(map(html_escape, n['owners'])) or '—'}{look}{dup}{extra}"
            )
        lk = d["lookup"]
        gx, gy, gh, gtext = [], [], [], []
        if lk["ghost"] is not None:
            gx, gy = [lk["ghost"][0]], [lk["ghost"][1]]
            cached_now = lk["miss"] in {n["hash"] for n in nodes}
            gh = [
                f"first miss of {html_escape(lk['request_id'])}'s lookup: hash {short_hash(lk['miss'])}<br>"
                + ("the request computed this block afterwards and cached it" if cached_now else "not in the cache; the walk stops here")
            ]
            gtext = ["" if cached_now else "miss"]
        ymin = min([-0.6] + [y - 0.5 for y in gy] + [y - 0.5 for y in d["walk_y"]])
        fig = self.figure
        with fig.batch_update():
            put = self._put
            put("edges.x", fig.data[0], "x", d["edge_x"], "num")
            put("edges.y", fig.data[0], "y", d["edge_y"], "num")
            put("walk.x", fig.data[1], "x", d["walk_x"], "num")
            put("walk.y", fig.data[1], "y", d["walk_y"], "num")
            dups = [n for n in nodes if n["duplicate"]]
            put("dup.x", fig.data[2], "x", [n["depth"] + 0.12 for n in dups], "num")
            put("dup.y", fig.data[2], "y", [n["row"] - 0.12 * max(1.0, 20 / max(row_px, 1)) for n in dups], "num")
            put("dup.size", fig.data[2].marker, "size", size)
            put("dup.color", fig.data[2].marker, "color", [_RANK[n["state"]] for n in dups], "num")
            tr = fig.data[3]
            put("x", tr, "x", xs, "num")
            put("y", tr, "y", ys, "num")
            put("text", tr, "text", texts, "str")
            put("hover", tr, "hovertext", hover, "str")
            put("pos", tr, "textposition", positions)
            put("color", tr.marker, "color", colors, "num")
            put("size", tr.marker, "size", size)
            g = fig.data[4]
            put("ghost.x", g, "x", gx, "num")
            put("ghost.y", g, "y", gy, "num")
            put("ghost.hover", g, "hovertext", gh, "str")
            put("ghost.text", g, "text", gtext, "str")
            orph = [n for n in nodes if n["orphan"]]
            put("orph.x", fig.data[5], "x", [n["depth"] for n in orph], "num")
            put("orph.y", fig.data[5], "y", [n["row"] for n in orph], "num")
            sel = [n for n in nodes if n["selected"]]
            self._put_selection("sel", fig.data[6], fig.data[7], [n["depth"] for n in sel], [n["row"] for n in sel], size + 9)
            # The request names at their chains' tips are left-anchored annotations, a fixed
            # number of pixels right of the node (a text trace's "middle right" position is
            # not kept by the widget's restyle path: the labels came out centred on the node).
            right = max(d["max_depth"], (gx[0] if gx else 0)) + (1.4 if d["tips"] else 0.7)
            tips = d["tips"]
            if crowded:  # only the names that matter now: the selection and the lookup's request
                keep = {selected_request, lk["request_id"]}
                tips = [t for t in tips if keep & set(t[0].split(", "))]
            notes = [
                dict(
                    x=x,
                    y=y,
                    text=f"◀ {html_escape(names)}",
                    xanchor="left",
                    xshift=12,
                    showarrow=False,
                    font=dict(size=10, color="#444444"),
                )
                for names, x, y in tips
            ]
            if not nodes and not gx:
                notes.append(dict(text="no cached hash yet", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5))
            self._put("notes", fig.layout, "annotations", notes)
            self._put("xr", fig.layout.xaxis, "range", [-0.6, right])
            self._put("yr", fig.layout.yaxis, "range", [max(rows, 2) - 0.3, ymin])
            self._put("xdt", fig.layout.xaxis, "dtick", 1 if d["max_depth"] <= 16 else 5)
            self._put("dup.legend", fig.data[-1], "showlegend", bool(dups))
            labels = list(LEGEND_LABELS if orph else LEGEND_LABELS[1:])  # plotly hides the entry of an empty trace
            if not dups:
                labels.pop()
            summary = d["summary"] + (" · labels: walk and selection only (hover the rest)" if crowded and show_text else "")
            self._header(d["title"], labels, subtitle=html_escape(summary))
