"""PrefixIndexView: the prefixes an engine caches, as its KV-event stream reveals them (lesson 10).

The same forest as lesson 03's hash chains -- x = block position in the prefix, a branch
where two prompts diverge -- but drawn from the *outside*: from ``BlockStored`` /
``BlockRemoved`` batches (a :class:`~kvlab.timeline.kv_stream.StreamSnapshot`), which is
all a router or an operator watching a vLLM server gets. So every node is simply "cached"
(sky blue): the stream cannot tell a block in use from one waiting on the free queue.

What one batch changed is drawn on top: blocks it stored get a black ring, blocks it
removed (evicted) a grey cross where they were. A *probe* -- a prompt's block keys, as a
router computes them -- is walked like the engine's own lookup in lesson 03's picture: a
thick black line through the leading blocks the index holds, a black cross at the first
miss. Orphans (cached blocks whose
parent the stream does not show: evicted first, or stored before the subscriber joined)
are roots with a dashed stub to their left.

``figure_data(snapshot, probe=...)`` returns all of it as plain data (tests read it); the
view draws exactly that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlab.timeline.kv_stream import NodeKey, PrefixNode, StreamSnapshot
from kvlab.viz.base import TOP_LEGEND, View, _go
from kvlab.viz.style import INK, MISS, STATE_COLORS, WALK, html_escape, render_tokens

CACHED_COLOR = STATE_COLORS["cached"]
STORED_RING = INK
REMOVED = "#555555"  # a dark grey cross: where an evicted block was (ink, not a meaning)
MAX_TEXT_NODES = 40  # beyond this, a node's tokens are in its hover text only
LEGEND = ("cached block", "stored by this batch", "removed by this batch", "probe walk (hits)", "probe: first miss")


def short(h: Any) -> str:
    """A block hash as printed: 16 hex digits of an int hash, 8 of a bytes digest."""
    if h is None:
        return "—"
    if isinstance(h, int):
        return f"{h:016x}"
    return bytes(h).hex()[:8]


def _layout(
    nodes: dict[NodeKey, PrefixNode],
) -> tuple[dict[NodeKey, int], dict[NodeKey, float], list[tuple[NodeKey, NodeKey]], set[NodeKey]]:
    """Tidy tree: leaves on consecutive rows, a parent halfway between its first and last
    child; roots (and orphans) in the order they were stored."""
    children: dict[NodeKey | None, list[NodeKey]] = {}
    orphans: set[NodeKey] = set()
    for k, n in nodes.items():
        p = n.parent_key
        if p is not None and p not in nodes:
            orphans.add(k)
            p = None
        children.setdefault(p, []).append(k)
    for lst in children.values():
        lst.sort(key=lambda k: (nodes[k].stored_seq, str(k[2])))
    depth: dict[NodeKey, int] = {}
    row: dict[NodeKey, float] = {}
    edges: list[tuple[NodeKey, NodeKey]] = []
    next_row = 0
    for root in children.get(None, []):
        stack: list[tuple[NodeKey, int, bool]] = [(root, 0, False)]
        while stack:
            k, d, done = stack.pop()
            kids = children.get(k, [])
            if done:
                row[k] = (row[kids[0]] + row[kids[-1]]) / 2 if kids else float(next_row)
                if not kids:
                    next_row += 1
                continue
            depth[k] = d
            stack.append((k, d, True))
            for c in reversed(kids):
                edges.append((k, c))
                stack.append((c, d + 1, False))
    return depth, row, edges, orphans


def figure_data(
    snapshot: StreamSnapshot,
    *,
    probe: Sequence[Any] | None = None,
    group_idx: int | None = 0,
    medium: str | None = "GPU",
    decode: Callable[[int], str] | None = None,
    max_label_chars: int = 10,
    max_nodes: int = 1500,
) -> dict[str, Any]:
    """The forest of one group/medium (``group_idx=None`` / ``medium=None``: every one) as
    plain data: ``nodes`` (``hash``, ``parent``, ``depth``, ``row``, ``label``, ``copies``,
    ``stored`` -- by this batch, ``orphan``, ``probe`` = "hit"/"miss"/None), ``edges`` as
    (parent hash, child hash), ``removed`` ghosts (hash, depth, row), ``probe`` (``hits``,
    ``miss``, ``num_hit_blocks``, ``ghost`` = where a miss outside the forest is drawn),
    ``counts`` and ``title``. Beyond ``max_nodes`` blocks only the most recently stored
    ``max_nodes`` (with their ancestors) are drawn (``counts["hidden"]``).
    """
    if not isinstance(snapshot, StreamSnapshot):
        raise TypeError(f"snapshot must be a StreamSnapshot (KVStream.at(i)), got {type(snapshot).__name__}")

    def keep(k: NodeKey) -> bool:
        return (medium is None or k[0] == medium) and (group_idx is None or k[1] == group_idx)

    live = {k: n for k, n in snapshot.nodes.items() if keep(k)}
    hidden = 0
    if len(live) > max_nodes:
        chosen: dict[NodeKey, PrefixNode] = {}
        for k in sorted(live, key=lambda k: -live[k].stored_seq):
            if len(chosen) >= max_nodes:
                break
            node: NodeKey | None = k
            while node is not None and node in live and node not in chosen:
                chosen[node] = live[node]
                node = live[node].parent_key
        hidden = len(live) - len(chosen)
        live = chosen
    ghosts = {n.key: n for n in snapshot.removed if keep(n.key) and n.key not in live}
    depth, row, edges, orphans = _layout({**live, **ghosts})
    stored = {k for k in snapshot.stored if k in live}
    # the probe walk: leading keys present, then the first miss
    hits: list[NodeKey] = []
    miss: NodeKey | None = None
    ghost: tuple[float, float] | None = None
    if probe is not None:
        g = 0 if group_idx is None else group_idx
        m = "GPU" if medium is None else medium
        for h in probe:
            k = (m, g, h)
            if k in live:
                hits.append(k)
                continue
            miss = k
            break
        if miss is not None:
            if miss in depth:
                ghost = (float(depth[miss]), row[miss])
            else:
                parent = hits[-1] if hits else None
                ghost = (float(len(hits)), row[parent] + 0.45 if parent is not None else -1.0)
    hit_set = set(hits)
    nodes_out = []
    for k, n in live.items():
        nodes_out.append(
            dict(
                key=k,
                hash=n.block_hash,
                parent=n.parent_hash,
                depth=depth[k],
                row=row[k],
                label=render_tokens(list(n.token_ids), decode, max_label_chars),
                tokens=list(n.token_ids),
                copies=n.copies,
                stored=k in stored,
                orphan=k in orphans,
                stored_seq=n.stored_seq,
                lora_name=n.lora_name,
                extra_keys=n.extra_keys,
                probe="hit" if k in hit_set else ("miss" if k == miss else None),
            )
        )
    removed = [dict(key=k, hash=n.block_hash, depth=depth[k], row=row[k]) for k, n in ghosts.items()]
    edges_out = [(p[2], c[2]) for p, c in edges if p in live and c in live]
    ex: list[float | None] = []
    ey: list[float | None] = []
    for p, c in edges:
        if p in live and c in live:
            ex += [depth[p], depth[c], None]
            ey += [row[p], row[c], None]
    leaves = {k for k in live} - {p for p, _ in edges}
    seq = "—" if snapshot.seq is None else str(snapshot.seq)
    who = f"{snapshot.name} · " if snapshot.name else ""
    title = f"{who}cached prefixes after batch seq {seq} · {len(live)} blocks in {len(leaves)} chains" + (
        f" ({hidden} older not drawn)" if hidden else ""
    )
    changes = []
    if snapshot.cleared:
        changes.append("AllBlocksCleared")
    if stored:
        changes.append(f"+{len(stored)} stored")
    if ghosts:
        changes.append(f"−{len(ghosts)} removed")
    if snapshot.missing:
        changes.append(f"{snapshot.missing} batches lost before this one")
    summary = "this batch: " + (", ".join(changes) if changes else "no change to this group")
    if probe is not None:
        summary += f" · probe: {len(hits)} of {len(probe)} blocks cached" + (" then the first miss" if miss is not None else "")
    return dict(
        nodes=nodes_out,
        edges=edges_out,
        edge_x=ex,
        edge_y=ey,
        removed=removed,
        probe=dict(hits=[k[2] for k in hits], miss=None if miss is None else miss[2], num_hit_blocks=len(hits), ghost=ghost),
        counts=dict(
            blocks=len(live), chains=len(leaves), stored=len(stored), removed=len(ghosts), orphans=len(orphans & set(live)), hidden=hidden
        ),
        max_depth=max(depth.values(), default=0),
        num_rows=max(row.values(), default=0.0) + 1,
        title=title,
        summary=summary,
    )


class PrefixIndexView(View):
    """The cached-prefix forest of one engine, from its KV-event stream; ``update(snapshot,
    probe=...)`` redraws in place (a live loop can call it after every batch)."""

    name = "prefixes"
    title = "Cached prefixes (from the KV-event stream)"

    def __init__(
        self,
        *,
        decode: Callable[[int], str] | None = None,
        width: int = 760,
        height: int = 380,
        group_idx: int | None = 0,
        medium: str | None = "GPU",
    ) -> None:
        super().__init__(None, decode=decode, width=width, height=height)
        self.group_idx = group_idx
        self.medium = medium
        go = _go()
        fig = self.figure
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines", line=dict(color="#9a9a9a", width=1.2), hoverinfo="skip", showlegend=False))
        fig.add_trace(
            go.Scatter(x=[], y=[], mode="lines", line=dict(color="#9a9a9a", width=1.2, dash="dot"), hoverinfo="skip", showlegend=False)
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers+text",
                name=LEGEND[0],
                textposition="bottom center",
                textfont=dict(size=9),
                hovertemplate="%{hovertext}<extra></extra>",
                cliponaxis=False,
                marker=dict(size=12, symbol="square", color=CACHED_COLOR, line=dict(width=1, color="#555555")),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name=LEGEND[1],
                hoverinfo="skip",
                marker=dict(size=15, symbol="square-open", color=STORED_RING, line=dict(width=2.5, color=STORED_RING)),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name=LEGEND[2],
                hovertemplate="%{hovertext}<extra></extra>",
                marker=dict(size=12, symbol="x-thin-open", color=REMOVED, line=dict(width=2.5, color=REMOVED)),
            )
        )
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=LEGEND[3], hoverinfo="skip", line=dict(color=WALK, width=4)))
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                mode="markers",
                name=LEGEND[4],
                hovertemplate="%{hovertext}<extra></extra>",
                marker=dict(size=16, symbol="x-thin-open", color=MISS, line=dict(width=3.5, color=MISS)),
            )
        )
        fig.update_layout(
            showlegend=True,
            legend=TOP_LEGEND,
            xaxis=dict(
                title=dict(text="block position in the prefix", font=dict(size=10), standoff=2),
                zeroline=False,
                showgrid=False,
                fixedrange=True,
                autorange=False,
            ),
            yaxis=dict(visible=False, autorange=False, fixedrange=True),
            margin=dict(l=16, r=16, t=80, b=36),
        )

    def update(self, snapshot: StreamSnapshot, probe: Sequence[Any] | None = None) -> None:  # type: ignore[override]  # drawn from a KV-event stream, not an engine Snapshot
        d = figure_data(snapshot, probe=probe, group_idx=self.group_idx, medium=self.medium, decode=self.decode)
        self.last_data = d
        nodes = d["nodes"]
        show_text = len(nodes) <= MAX_TEXT_NODES
        hover = []
        for n in nodes:
            extra = f"<br>copies: {n['copies']}" if n["copies"] > 1 else ""
            if n["orphan"]:
                extra += "<br>its parent is not in the stream (evicted first, or stored before we joined)"
            hover.append(
                f"<b>{short(n['hash'])}</b> ← parent {short(n['parent'])}<br>tokens "
                f"{html_escape(render_tokens(n['tokens'], self.decode, 48))}<br>stored in batch seq {n['stored_seq']}{extra}"
            )
        orph = [n for n in nodes if n["orphan"]]
        sx: list[float | None] = []
        sy: list[float | None] = []
        for n in orph:
            sx += [n["depth"] - 0.6, n["depth"], None]
            sy += [n["row"], n["row"], None]
        new = [n for n in nodes if n["stored"]]
        hit = sorted((n for n in nodes if n["probe"] == "hit"), key=lambda n: n["depth"])
        pg = d["probe"]["ghost"]
        fig = self.figure
        put = self._put
        with fig.batch_update():
            put("e.x", fig.data[0], "x", d["edge_x"], "num")
            put("e.y", fig.data[0], "y", d["edge_y"], "num")
            put("s.x", fig.data[1], "x", sx, "num")
            put("s.y", fig.data[1], "y", sy, "num")
            tr = fig.data[2]
            put("n.x", tr, "x", [n["depth"] for n in nodes], "num")
            put("n.y", tr, "y", [n["row"] for n in nodes], "num")
            put("n.text", tr, "text", [html_escape(n["label"]) if show_text else "" for n in nodes], "str")
            put("n.hover", tr, "hovertext", hover, "str")
            put("n.size", tr.marker, "size", 12 if len(nodes) <= 150 else 6)
            put("new.x", fig.data[3], "x", [n["depth"] for n in new], "num")
            put("new.y", fig.data[3], "y", [n["row"] for n in new], "num")
            put("rm.x", fig.data[4], "x", [r["depth"] for r in d["removed"]], "num")
            put("rm.y", fig.data[4], "y", [r["row"] for r in d["removed"]], "num")
            put("rm.h", fig.data[4], "hovertext", [f"removed (evicted): {short(r['hash'])}" for r in d["removed"]], "str")
            # The walk: a stub before the first block, then through every hit, to the miss.
            wx = [n["depth"] for n in hit] + ([pg[0]] if pg else [])
            wy = [n["row"] for n in hit] + ([pg[1]] if pg else [])
            if wx:
                wx, wy = [wx[0] - 0.45] + wx, [wy[0]] + wy
            put("hit.x", fig.data[5], "x", wx, "num")
            put("hit.y", fig.data[5], "y", wy, "num")
            put("miss.x", fig.data[6], "x", [pg[0]] if pg else [], "num")
            put("miss.y", fig.data[6], "y", [pg[1]] if pg else [], "num")
            put("miss.h", fig.data[6], "hovertext", [f"first miss: {short(d['probe']['miss'])}"] if pg else [], "str")
            ymin = min([-0.6] + ([pg[1] - 0.5] if pg else []))
            put("xr", fig.layout.xaxis, "range", [-0.8, max(d["max_depth"], pg[0] if pg else 0) + 0.8])
            put("yr", fig.layout.yaxis, "range", [max(d["num_rows"], 2) - 0.3, ymin])
            notes = (
                [] if nodes else [dict(text="no cached block in the stream yet", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)]
            )
            put("notes", fig.layout, "annotations", notes)
            self._header(d["title"], LEGEND, subtitle=html_escape(d["summary"]))


__all__ = ["PrefixIndexView", "figure_data", "short"]
