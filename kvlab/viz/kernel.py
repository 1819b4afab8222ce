"""KernelView: what the paged-attention kernel reads for one query token (lessons 02, 07).

The kernel never sees a request's tokens as one array. For the query at position ``p`` it
walks the block table: key position ``j`` lives in physical block ``table[j // block_size]``
at offset ``j % block_size``, i.e. in slot ``block_id * block_size + j % block_size`` of
the KV cache. This view draws exactly that walk: one row per logical block (labelled with
the physical block it maps to), one cell per slot, coloured by whether the kernel reads
it. With a sliding window ``W`` only positions ``p - W + 1 .. p`` are read; older
positions are greyed out, and blocks that left the window entirely are the null block
(id 0), which the kernel never reads.

Data source: the ``AttentionBatch`` event the model runner emits for each step (the block
tables and slot mappings the kernel really received; ``Timeline.attention_batch(step)``).
When a log has none (the simulated executor), the same picture is derived from the
snapshot's block table -- the identical arithmetic, so the two agree whenever both exist.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.timeline.events import AttentionBatch
from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces
from kvlab.viz.block_table import group_name
from kvlab.viz.style import (
    KERNEL_COLORS,
    KERNEL_LABELS,
    KERNEL_ORDER,
    discrete_colorscale,
)

_KIDX = {k: i for i, k in enumerate(KERNEL_ORDER)}
SLOT_LABEL_ROWS = 12  # print slot numbers in the cells up to this many rows


def pick_request(snapshot: Snapshot, selected_request: str | None, batch: AttentionBatch | None) -> str | None:
    """The request to draw: the selected one if the kernel read K/V for it, else the first
    of the batch, of this step's scheduled requests, of the running ones."""
    in_batch = list(batch.req_ids) if batch is not None else []

    def has_kv(rid: str) -> bool:
        if rid in in_batch:
            return True
        r = snapshot.requests.get(rid)
        return r is not None and rid in snapshot.running and r.num_computed_tokens > 0

    candidates = in_batch + [r for r in snapshot.scheduled if r in snapshot.running] + snapshot.running
    if selected_request is not None and has_kv(selected_request):
        return selected_request
    return next((r for r in candidates if has_kv(r)), None)


def figure_data(
    snapshot: Snapshot,
    selected_request: str | None = None,
    *,
    batch: AttentionBatch | None = None,
) -> dict[str, Any]:
    """The kernel's reads for the last query token of one request, as plain data.

    Returns ``request_id`` (None when no request holds K/V), ``source``
    ("attention_batch" or "block_table"), ``position`` (the query's position), ``groups``
    (per group: ``name``, ``window``, ``table``, ``read_blocks``, ``read_slots``,
    ``query_slot``) and ``rows`` (per group and logical block: ``group``, ``logical``,
    ``block_id``, ``cells`` = [(position, slot or None, state)], with ``state`` one of
    read / query / outside_window / null / unwritten), plus the heatmap arrays.
    """
    bs = snapshot.block_size
    rid = pick_request(snapshot, selected_request, batch)
    out: dict[str, Any] = dict(request_id=rid, source=None, position=None, groups=[], rows=[], z=[], text=[], customdata=[], row_labels=[])
    if rid is None:
        out["title"] = f"Attention read · step {snapshot.step} · no request holds K/V"
        return out
    group_specs = snapshot.groups or [{"type": "full"}]
    if batch is not None and rid in batch.req_ids:
        i = batch.req_ids.index(rid)
        bs = batch.block_size or bs
        p = batch.seq_lens[i] - 1
        tables = [list(t[i]) for t in batch.block_tables]
        windows = list(batch.sliding_windows) or [g.get("sliding_window") for g in group_specs]
        q_index = sum(batch.query_lens[:i]) + batch.query_lens[i] - 1
        query_slots = [sm[q_index] if q_index < len(sm) else None for sm in batch.slot_mappings]
        source = "attention_batch"
    else:
        r = snapshot.requests[rid]
        p = r.num_computed_tokens - 1
        tables = [list(t) for t in r.block_table]
        windows = [g.get("sliding_window") for g in group_specs]
        query_slots = []
        for t in tables:
            bi = p // bs
            query_slots.append(t[bi] * bs + p % bs if bi < len(t) and t[bi] != 0 else None)
        source = "block_table"
    out.update(source=source, position=p)
    while len(windows) < len(tables):
        windows.append(None)
    for g, table in enumerate(tables):
        w = windows[g]
        first_read = max(0, p - w + 1) if w else 0
        read_blocks: list[int] = []
        read_slots: list[int] = []
        for li, bid in enumerate(table):
            cells = []
            zrow, trow, crow = [], [], []
            for off in range(bs):
                pos = li * bs + off
                slot = bid * bs + off if bid != 0 else None
                if pos > p:
                    state = "unwritten"
                elif bid == 0:
                    state = "null"
                elif pos < first_read:
                    state = "outside_window"
                else:
                    state = "query" if pos == p else "read"
                if state in ("read", "query"):
                    read_slots.append(slot)  # type: ignore[arg-type]
                    if not read_blocks or read_blocks[-1] != bid:
                        read_blocks.append(bid)
                cells.append((pos, slot, state))
                zrow.append(_KIDX[state])
                trow.append("" if slot is None else str(slot))
                crow.append(
                    f"position {pos} → block {bid} (logical {li}), offset {off}<br>"
                    + (f"slot {bid} × {bs} + {off} = {slot}" if slot is not None else "null block: no slot")
                    + f"<br>{KERNEL_LABELS[state]}"
                )
            out["rows"].append(dict(group=g, logical=li, block_id=bid, cells=cells))
            out["z"].append(zrow)
            out["text"].append(trow)
            out["customdata"].append(crow)
            gname = group_name(group_specs[g]) if g < len(group_specs) else f"group {g}"
            prefix = f"g{g} " if len(tables) > 1 else ""
            out["row_labels"].append(f"{prefix}L{li} → {'∅' if bid == 0 else bid}")
        out["groups"].append(
            dict(name=group_name(group_specs[g]) if g < len(group_specs) else f"group {g}", window=w, table=table,
                 read_blocks=read_blocks, read_slots=read_slots, query_slot=query_slots[g] if g < len(query_slots) else None,
                 first_read=first_read)
        )
    def ids(blocks: list[int]) -> str:
        return ",".join(map(str, blocks[:6])) + (",…" if len(blocks) > 6 else "")

    parts = [f"{gr['name']}: {len(gr['read_slots'])} slots in blocks [{ids(gr['read_blocks'])}]" for gr in out["groups"]]
    out["title"] = f"Attention read · {rid} · query at position {p} · step {snapshot.step}"
    # Derived from the table unless the runner's AttentionBatch said what the kernel got.
    out["subtitle"] = " · ".join(parts) + (" · from AttentionBatch" if source == "attention_batch" else "")
    return out


class KernelView(View):
    """The slots the attention kernel reads, through the block table, for one query token."""

    name = "kernel"
    title = "Attention read"

    def __init__(self, timeline: Timeline | None = None, *, decode: Callable[[int], str] | None = None, width: int = 482, height: int = 330) -> None:
        super().__init__(timeline, decode=decode, width=width, height=height)
        go = _go()
        fig = self.figure
        fig.add_trace(
            go.Heatmap(z=[[None]], zmin=-0.5, zmax=len(KERNEL_ORDER) - 0.5, colorscale=discrete_colorscale([KERNEL_COLORS[k] for k in KERNEL_ORDER]),
                       showscale=False, xgap=1, ygap=3, texttemplate="%{text}", textfont=dict(size=8),
                       hovertemplate="%{customdata}<extra></extra>", name="slots", showlegend=False)
        )
        for tr in legend_traces(go, KERNEL_COLORS, KERNEL_LABELS, KERNEL_ORDER):
            fig.add_trace(tr)
        fig.update_layout(
            showlegend=True,
            legend=dict(TOP_LEGEND, font=dict(size=9)),
            xaxis=dict(title=dict(text="offset in block (slot = block × block_size + offset)", font=dict(size=10), standoff=2),
                       fixedrange=True, showgrid=False, zeroline=False, side="bottom", autorange=False),
            yaxis=dict(fixedrange=True, showgrid=False, zeroline=False, automargin=True, autorange=False),
            margin=dict(l=10, r=10, t=86, b=36),
        )

    def batch_for(self, snapshot: Snapshot) -> AttentionBatch | None:
        """The ``AttentionBatch`` of the snapshot's step, if the runner emitted one by then."""
        if self.timeline is None:
            return None
        b = self.timeline.attention_batch(snapshot.step)
        return b if b is not None and b.seq < snapshot.num_events else None

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        d = figure_data(snapshot, selected_request, batch=self.batch_for(snapshot))
        self.last_data = d
        fig = self.figure
        n = len(d["rows"])
        bs = len(d["z"][0]) if d["z"] else snapshot.block_size
        with fig.batch_update():
            hm = fig.data[0]
            if n:
                text = d["text"] if n <= SLOT_LABEL_ROWS and bs <= 16 else [[""] * bs for _ in range(n)]
                z, hover, y = d["z"], d["customdata"], list(range(n))
            else:
                z, text, hover, y = [[None]], [[""]], [[""]], [0]
            self._put("z", hm, "z", z, "num")
            self._put("text", hm, "text", text, "str")
            self._put("hover", hm, "customdata", hover, "str")
            self._put("y", hm, "y", y, "num")
            every = max(1, -(-n // 20))
            ticks = [i for i in range(n) if i % every == 0]
            self._put("ytv", fig.layout.yaxis, "tickvals", ticks)
            self._put("ytt", fig.layout.yaxis, "ticktext", [d["row_labels"][i] for i in ticks])
            self._put("yr", fig.layout.yaxis, "range", [max(n, 4) - 0.5, -0.5])
            self._put("xr", fig.layout.xaxis, "range", [-0.5, bs - 0.5])
            self._put("xd", fig.layout.xaxis, "dtick", 1 if bs <= 16 else 4)
            sub = d.get("subtitle", "")
            self._header(d["title"], [KERNEL_LABELS[k] for k in KERNEL_ORDER], legend_font=9, subtitle=sub)
            empty = [dict(text="no request holds K/V at this step", x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)]
            self._put("notes", fig.layout, "annotations", [] if n else empty)
