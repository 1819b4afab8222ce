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
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces, mark_patch, selection_traces
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


def _free_row(parent_row: float, k: int, depth: dict[str, int], row: dict[str, float]) -> float:
    """The row for a cross at position ``k`` after a parent on ``parent_row``.

    Inline (the chain simply continues) when nothing sits at that position near the row;
    else the nearest half row at least half a row from every node there, so the cross never
    lands on, or touches, a block of another chain (which would read as that block missing).
    """
    taken = [r for h, r in row.items() if depth[h] == k]
    for j in range(2 * len(taken) + 3):
        y = parent_row + (j + 1) // 2 * 0.5 * (1 if j % 2 else -1)
        if y >= -0.5 and all(abs(y - r) >= (1.0 if j == 0 else 0.5) for r in taken):
            return y
    return max(taken, default=parent_row) + 1.0


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
                # the position is filled now. ``ghost`` still says where, but no cross is
                # drawn there (``filled``): a ✗ on a cached block would claim it missed.
                ghost = (float(depth[miss]), row[miss])
            else:
                ghost_parent = hits[-1] if hits and hits[-1] in row else None
                ghost = (float(k), _free_row(row[ghost_parent], k, depth, row) if ghost_parent is not None else -1.0)
    hit_set = set(hits)
    selected = _hashes_of(snapshot, selected_request)
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
            bh = snapshot.blocks[bid].block_hash if bid else None
            if bh in depth and (best is None or depth[bh] >= depth[best]):
                best = bh
        if best is not None:
            at_node.setdefault(best, []).append(rid)
    tips = [(", ".join(rids), depth[h], row[h]) for h, rids in at_node.items()]
    # A chain no live request holds is still somebody's prompt: the request that released
    # its last block (``last_holder``), so that no row of the forest is anonymous.
    parents = {n.parent_hash for n in snapshot.hash_nodes.values()}
    freed_tips: list[tuple[str, int, float]] = []
    for h, n in snapshot.hash_nodes.items():
        holders = [snapshot.blocks[b].last_holder for b in n.block_ids]
        last = next((x.request_id for x in holders if x is not None), None)
        if h not in parents and h not in at_node and last is not None and len(tips) + len(freed_tips) < MAX_TIPS:
            freed_tips.append((last, depth[h], row[h]))
    # Where shared prompts part: a node with several children (depth, row, branches).
    kids: dict[str, int] = {}
    for p, _ in edges:
        kids[p] = kids.get(p, 0) + 1
    forks = [(depth[h], row[h], c) for h, c in kids.items() if c > 1]
    filled = miss is not None and miss in row
    # The lookup walk: a stub before the first block, then through every hit, to the stop
    # (a drawn ✗ only where the missing hash is still missing).
    walk_x: list[float] = []
    walk_y: list[float] = []
    hit_pos = [(float(depth[h]), row[h]) for h in hits if h in depth]
    cross = None if filled else ghost
    if hit_pos or cross is not None:
        first = hit_pos[0] if hit_pos else cross
        assert first is not None  # hits, or else a cross (the condition above)
        walk_x, walk_y = [first[0] - 0.45], [first[1]]
        for x, y in hit_pos:
            walk_x.append(x)
            walk_y.append(y)
        if cross is not None:
            walk_x.append(cross[0])
            walk_y.append(cross[1])
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
            "miss": f"last lookup, {rid}: {k} hit ({toks} tokens), then the first miss "
            + (f"(block {k}: {rid} computed and cached it since)" if filled else "✗"),
            "cap": f"last lookup, {rid}: {k} hit ({toks} tokens), then the cap: the last token is recomputed",
            "end": f"last lookup, {rid}: all {k} full blocks hit ({toks} tokens)",
        }[stop or "end"]
    return dict(
        nodes=nodes_out,
        edges=edges,
        edge_x=ex,
        edge_y=ey,
        lookup=dict(
            request_id=lk.request_id if lk else None, hits=hits, miss=miss, stop=stop, ghost=ghost, ghost_parent=ghost_parent, filled=filled
        ),
        tips=tips,
        freed_tips=freed_tips,
        forks=forks,
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
        # Drawn with nothing selected: a selection marks squares (its patch), it never moves
        # a label -- so the page can mark any request without the kernel.
        d = figure_data(snapshot, None, decode=self.decode, plot_width=self.width - 40)
        self.last_data = d
        nodes = d["nodes"]
        lk = d["lookup"]
        cross = None if lk["ghost"] is None or lk["filled"] else lk["ghost"]
        orph = [n for n in nodes if n["orphan"]]
        dups = [n for n in nodes if n["duplicate"]]
        labels = list(LEGEND_LABELS if orph else LEGEND_LABELS[1:])  # plotly hides the entry of an empty trace
        if not dups:
            labels.pop()
        # Geometry in pixels, from the plot area the header really leaves (sized for the longer
        # subtitle: the shorter one only frees room). A label line is kept free above the first
        # row and below the last, so their labels neither leave the plot nor cover the axis.
        top = self._header(d["title"], labels, subtitle=html_escape(d["summary"] + CROWDED_NOTE))
        plot_w, plot_h = self.width - 32, self.height - top - 36
        ys_all = [n["row"] for n in nodes] + ([cross[1]] if cross else []) + d["walk_y"]
        lo, hi = min(ys_all, default=0.0), max(ys_all, default=0.0)
        sy = max(plot_h - 2 * LABEL_PAD, 20) / max(hi - lo, 1.5)
        y_top = lo - LABEL_PAD / sy
        # Names after the chains' ends: levels are narrowed until the longest one fits.
        tips = [("◀ " + _names(t[0]), t[1], t[2], t[0], k == "freed_tips") for k in ("tips", "freed_tips") for t in d[k]]
        if cross is not None:  # a chain that ends in the cross is named after the cross
            tips = [(t, cross[0] if y == cross[1] and cross[0] > x else x, y, full, f) for t, x, y, full, f in tips]
        right = max(d["max_depth"], cross[0] if cross else 0) + 0.7
        sx = plot_w / (right + 0.6)
        for t, x, *_ in tips:
            sx = min(sx, (plot_w + 4 - TIP_SHIFT - _text_px(t)) / (x + 0.6))
        sx = max(sx, 4.0)
        right = plot_w / sx - 0.6
        longest = max((len(n["label"]) for n in nodes), default=0)
        crowded = sy < MIN_LABEL_ROW_PX or 2 * sx < 6.5 * longest + 12
        show_text = len(nodes) <= MAX_TEXT_NODES
        # Squares never touch: at most 3 px less than a level's width.
        size = min(15 if sy >= 20 and len(nodes) <= 120 else max(6, min(15, int(sy * 0.7))), max(6, int(sx - 3)))

        def px(x: float, y: float) -> tuple[float, float]:
            return (x + 0.6) * sx, (y - y_top) * sy

        # Every square and mark is room taken; a label is drawn only where it covers none of
        # them and no other label: names first, then the miss, the forks, the walk's tokens.
        room = _Room(plot_w, plot_h)
        for n in nodes:
            half = (size + (9 if n["selected"] else 4 if n["duplicate"] else 0)) / 2 + (4 if n["orphan"] else 0)
            room.box(*px(n["depth"], n["row"]), half, half)
        if cross is not None:
            room.box(*px(*cross), 8, 8)
        keep = {lk["request_id"]}
        notes: list[dict[str, Any]] = []
        for t, x, y, full, freed in sorted(tips, key=lambda t: not keep & set(t[3].split(", "))):
            cx, cy = px(x, y)
            if room.take(cx + TIP_SHIFT, cy - 7, cx + TIP_SHIFT + _text_px(t), cy + 7):
                why = f"{html_escape(full)}: the prompt's chain " + (
                    "(released; its blocks stay cached for a later hit)" if freed else "ends here"
                )
                color = "#777777" if freed else "#444444"
                notes.append(
                    dict(
                        x=x,
                        y=y,
                        text=html_escape(t),
                        xanchor="left",
                        xshift=TIP_SHIFT,
                        showarrow=False,
                        hovertext=why,
                        font=dict(size=10, color=color),
                    )
                )
        gtext = []
        if cross is not None:
            cx, cy = px(*cross)
            gtext = ["miss" if room.take(cx - 14, cy + 9, cx + 14, cy + 21) else ""]
        # "fork" (about 24 px wide) ends before the next level's squares, which fan out there.
        fshift = min(0.0, sx - size / 2 - 14)
        for x, y, c in d["forks"]:
            for sign in (-1, 1):
                cx, cy = px(x, y)
                cx, edge = cx + fshift, cy + sign * (size / 2 + 1)
                if room.take(cx - 12, min(edge, edge + sign * 12), cx + 12, max(edge, edge + sign * 12)):
                    why = f"{c} prompts share the chain up to here and differ in the next block"
                    notes.append(
                        dict(
                            x=x,
                            y=y,
                            text="fork",
                            xshift=fshift,
                            yshift=-sign * (size / 2 + 7),
                            showarrow=False,
                            hovertext=why,
                            font=dict(size=9, color="#444444"),
                        )
                    )
                    break
        texts = [""] * len(nodes)
        positions = ["bottom center"] * len(nodes)
        order = sorted(range(len(nodes)), key=lambda i: not (nodes[i]["lookup"] or nodes[i]["selected"]))
        for i in order if show_text else ():
            n = nodes[i]
            if crowded and not (n["lookup"] or n["selected"]):
                break  # the rest have no priority: hover them
            w = _text_px(n["label"]) / 2
            cx, cy = px(n["depth"], n["row"])
            for sign in (1, -1) if n["depth"] % 2 == 0 else (-1, 1):
                edge = cy + sign * (size / 2 + 1)
                if room.take(cx - w, min(edge, edge + sign * 12), cx + w, max(edge, edge + sign * 12)):
                    texts[i] = html_escape(n["label"])
                    positions[i] = "bottom center" if sign > 0 else "top center"
                    break
        hover = []
        for n in nodes:
            full = html_escape(render_tokens(n["tokens"], self.decode, 48))
            extra = "<br>(its parent was evicted: unreachable by a lookup)" if n["orphan"] else ""
            look = f"<br>latest lookup: <b>{n['lookup']}</b>" if n["lookup"] else ""
            if n["lookup"] == "miss":
                look += " then; the request computed this block since and cached it"
            dup = f"<br><b>one key, {len(n['block_ids'])} physical blocks</b> (duplicates: a lookup takes either)" if n["duplicate"] else ""
            hover.append(
                f"<b>hash {short_hash(n['hash'])}</b> ← parent {short_hash(n['parent'])}<br>tokens {full}<br>"
                f"blocks {n['block_ids']} · {STATE_HELP[n['state']]}<br>held by {', '.join(map(html_escape, n['owners'])) or '—'}{look}{dup}{extra}"
            )
        gx, gy, gh = [], [], []
        if cross is not None:
            gx, gy = [cross[0]], [cross[1]]
            gh = [
                f"first miss of {html_escape(lk['request_id'])}'s lookup: hash {short_hash(lk['miss'])}<br>not in the cache; the walk stops here"
            ]
        fig = self.figure
        with fig.batch_update():
            put = self._put
            put("edges.x", fig.data[0], "x", d["edge_x"], "num")
            put("edges.y", fig.data[0], "y", d["edge_y"], "num")
            put("walk.x", fig.data[1], "x", d["walk_x"], "num")
            put("walk.y", fig.data[1], "y", d["walk_y"], "num")
            put("dup.x", fig.data[2], "x", [n["depth"] + 0.12 for n in dups], "num")
            put("dup.y", fig.data[2], "y", [n["row"] - 0.12 * max(1.0, 20 / max(sy, 1)) for n in dups], "num")
            put("dup.size", fig.data[2].marker, "size", size)
            put("dup.color", fig.data[2].marker, "color", [_RANK[n["state"]] for n in dups], "num")
            tr = fig.data[3]
            put("x", tr, "x", [n["depth"] for n in nodes], "num")
            put("y", tr, "y", [n["row"] for n in nodes], "num")
            put("text", tr, "text", texts, "str")
            put("hover", tr, "hovertext", hover, "str")
            # Per-point enumerations cost plotly a regex per element: only when labels are drawn.
            put("pos", tr, "textposition", positions if any(texts) else "bottom center")
            put("color", tr.marker, "color", [_RANK[n["state"]] for n in nodes], "num")
            put("size", tr.marker, "size", size)
            g = fig.data[4]
            put("ghost.x", g, "x", gx, "num")
            put("ghost.y", g, "y", gy, "num")
            put("ghost.hover", g, "hovertext", gh, "str")
            put("ghost.text", g, "text", gtext, "str")
            put("orph.x", fig.data[5], "x", [n["depth"] for n in orph], "num")
            put("orph.y", fig.data[5], "y", [n["row"] for n in orph], "num")
            self._selection_size("sel", fig.data[6], fig.data[7], size + 9)
            self._select(snapshot, selected_request)
            if not nodes and not gx:
                notes.append(dict(text="no cached hash yet", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5))
            put("notes", fig.layout, "annotations", notes)
            put("xr", fig.layout.xaxis, "range", [-0.6, right])
            put("yr", fig.layout.yaxis, "range", [y_top + plot_h / sy, y_top])
            put("xdt", fig.layout.xaxis, "dtick", 1 if d["max_depth"] <= 16 else 5)
            put("dup.legend", fig.data[-1], "showlegend", bool(dups))
            self._header(d["title"], labels, subtitle=html_escape(d["summary"] + (CROWDED_NOTE if crowded and show_text else "")))

    def selection_patch(self, snapshot: Snapshot, request_id: str | None) -> dict[str, Any]:
        """The selection mark on the cached blocks of the request's block table."""
        assert self.last_data is not None
        mine = _hashes_of(snapshot, request_id)
        sel = [n for n in self.last_data["nodes"] if n["hash"] in mine]
        return mark_patch(6, 7, [n["depth"] for n in sel], [n["row"] for n in sel])


def _hashes_of(snapshot: Snapshot, request_id: str | None) -> set[Any]:
    """The block hashes in the request's block tables (its cached blocks)."""
    out: set[Any] = set()
    if request_id in snapshot.requests:
        for table in snapshot.requests[request_id].block_table:
            for bid in table:
                h = snapshot.blocks[bid].block_hash if bid else None
                if h is not None:
                    out.add(h)
    return out


TIP_SHIFT = 12  # pixels between a chain's last block and its owner's name
LABEL_PAD = 22  # pixels kept above the first row and below the last, for their labels
CROWDED_NOTE = " · labels: walk and selection only (hover the rest)"


def _names(names: str) -> str:
    """Owners as drawn after a chain: the first name and how many more, when several."""
    first, *rest = names.split(", ")
    return first + (f" +{len(rest)}" if rest else "") if len(names) > 16 else names


def _text_px(text: str) -> float:
    """Width of a 10 px label in pixels (a generous monospace estimate)."""
    return 6.5 * len(text) + 4


class _Room:
    """Pixel boxes already covered (squares, marks, drawn labels), in 24 px columns.

    Labels are placed greedily: one is drawn only if its box is inside the plot (give or
    take a few pixels) and overlaps no box taken before it -- so no label covers a square
    of a neighbouring chain or another label, whatever the forest's shape.
    """

    def __init__(self, width: float, height: float) -> None:
        self.width, self.height = width, height
        self.cols: dict[int, list[tuple[float, float, float, float]]] = {}

    def box(self, x: float, y: float, half_w: float, half_h: float) -> None:
        b = (x - half_w, y - half_h, x + half_w, y + half_h)
        for c in range(int(b[0] // 24), int(b[2] // 24) + 1):
            self.cols.setdefault(c, []).append(b)

    def take(self, x0: float, y0: float, x1: float, y1: float) -> bool:
        if x0 < -14 or x1 > self.width + 14 or y0 < -4 or y1 > self.height + 4:
            return False
        for c in range(int(x0 // 24), int(x1 // 24) + 1):
            if any(x0 < o[2] and o[0] < x1 and y0 < o[3] and o[1] < y1 for o in self.cols.get(c, ())):
                return False
        self.box((x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2)
        return True
