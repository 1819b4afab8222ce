"""KernelView: which cache slots the attention kernel reads for one request -- expected
from the block table, and observed from the kernel's real loads (lessons 02, 07).

The kernel never sees a request's tokens as one array. For a query at position ``p`` it
walks the block table: key position ``j`` lives in physical block ``table[j // block_size]``
at offset ``j % block_size``, i.e. in slot ``block_id * block_size + j % block_size`` of
the KV cache. This view draws that walk for the request's query tokens of one step: one
row per logical block of the **manager's** block table (labelled with the physical block),
one cell per slot, coloured by whether the step's queries should read it. With a sliding
window ``W`` a query at ``p`` reads positions ``p - W + 1 .. p`` only; older positions are
marked ×, and blocks that left the window entirely are the null block (id 0).

**Observed, not derived.** When the run has a model on the Triton interpreter, the runner
traces the kernel's actual loads (``AttentionBatch.kernel_reads``, see
``kvlab.kernels.trace``). Each slot the kernel loaded gets a black dot; an expected slot it
did not load gets an empty ring, and a load the table does not explain gets a ✖ -- in a
block of the table (a slot outside the window, the null block) or in an extra row for a
block that is not in the request's table at all (another request's block: what a wrong
block table makes the kernel read). The subtitle states the verdict: how many slots were
loaded, and that block 0 and the out-of-window slots were never read. Without a trace (the
simulated executor, a GPU) the picture is the table's arithmetic and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.eventlog.events import AttentionBatch
from kvlab.timeline.snapshot import BLOCK_STATES, Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.viz.base import TOP_LEGEND, View, _go, legend_traces
from kvlab.viz.block_table import group_name
from kvlab.viz.style import (
    INK,
    KERNEL_COLORS,
    KERNEL_LABELS,
    KERNEL_ORDER,
    KERNEL_SYMBOLS,
    STATE_COLORS,
    STATE_HELP,
    STATE_LABELS,
    discrete_colorscale,
    html_escape,
)
from kvlab.utils.math_utils import cdiv

# One colour scale for the kernel states and, for blocks outside the table, the block states.
_CATEGORIES = KERNEL_ORDER + tuple(f"block:{s}" for s in BLOCK_STATES)
_KIDX = {k: i for i, k in enumerate(_CATEGORIES)}
_COLORS = [KERNEL_COLORS[k] for k in KERNEL_ORDER] + [STATE_COLORS[s] for s in BLOCK_STATES]
SLOT_LABEL_ROWS = 12  # print slot numbers in the cells up to this many rows
ROW_PX = 13  # rows thinner than this are merged: runs of fully read blocks become one row
MARK_LABELS = {"loaded": "loaded (traced)", "missed": "expected, not loaded", "unexpected": "loaded, not expected"}


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


def _ids(blocks: list[int]) -> str:
    return ",".join(map(str, blocks[:6])) + (",…" if len(blocks) > 6 else "")


def figure_data(
    snapshot: Snapshot,
    selected_request: str | None = None,
    *,
    batch: AttentionBatch | None = None,
    at_batch: Snapshot | None = None,
    max_rows: int | None = None,
) -> dict[str, Any]:
    """The kernel's reads for one request's query tokens of the step, as plain data.

    ``batch``: the step's ``AttentionBatch`` (what the kernel got, and its traced loads);
    ``at_batch``: the state when the kernel ran (the manager's block tables -- what
    *should* be read); both default to what ``snapshot`` says.

    Returns ``request_id`` (None when no request holds K/V), ``source`` ("traced",
    "attention_batch" or "block_table"), ``position`` (the last query's position),
    ``query_positions``, ``groups`` (per group: ``name``, ``window``, ``table`` (the
    manager's), ``given_table`` (the kernel's), ``read_blocks``, ``read_slots``,
    ``query_slot``, ``first_read`` and, when traced, ``observed_slots``, ``missed``,
    ``unexpected``, ``stray_blocks``, ``null_loads``, ``outside_window_loads``) and ``rows``
    (per group and logical block: ``group``, ``logical`` (None for a block outside the
    table), ``block_id``, ``cells`` = [(position, slot or None, state)] with ``state`` one
    of read / query / outside_window / null / unwritten (or ``block:<state>`` for a block
    outside the table), ``loaded`` = per cell True/False/None), plus the heatmap arrays
    and the mark coordinates.
    """
    bs = snapshot.block_size
    rid = pick_request(snapshot, selected_request, batch)
    out: dict[str, Any] = dict(
        request_id=rid,
        source=None,
        position=None,
        query_positions=[],
        groups=[],
        rows=[],
        z=[],
        text=[],
        customdata=[],
        row_labels=[],
        marks={k: ([], []) for k in MARK_LABELS},
    )
    if rid is None:
        out["title"] = f"Attention read · step {snapshot.step} · no request holds K/V"
        out["subtitle"] = ""
        return out
    state_snap = at_batch if at_batch is not None else snapshot
    group_specs = snapshot.groups or [{"type": "full"}]
    observed: list[list[int]] | None = None
    if batch is not None and rid in batch.req_ids:
        i = batch.req_ids.index(rid)
        bs = batch.block_size or bs
        seq_len, q_len = batch.seq_lens[i], batch.query_lens[i]
        given = [list(t[i]) for t in batch.block_tables]
        windows = list(batch.sliding_windows) or [g.get("sliding_window") for g in group_specs]
        if batch.kernel_reads is not None:
            observed = [list(g[i]) if i < len(g) else [] for g in batch.kernel_reads]
        source = "traced" if observed is not None else "attention_batch"
    else:
        r = snapshot.requests[rid]
        seq_len = r.num_computed_tokens
        q_len = max(1, min(snapshot.scheduled.get(rid, 1), seq_len))
        given = [list(t) for t in r.block_table]
        windows = [g.get("sliding_window") for g in group_specs]
        source = "block_table"
    p, q0 = seq_len - 1, seq_len - q_len
    req_now = state_snap.requests.get(rid)
    manager = [list(t) for t in req_now.block_table] if req_now is not None and any(req_now.block_table) else given
    n_needed = cdiv(seq_len, bs)
    out.update(source=source, position=p, query_positions=list(range(q0, seq_len)))
    while len(windows) < len(manager):
        windows.append(None)
    for g, table in enumerate(manager):
        table = table[:n_needed] if len(table) >= n_needed else table
        w = windows[g]
        # Every query of the step reads from its own window start: the union starts at the
        # first query's (q0 - W + 1).
        first_read = max(0, q0 - w + 1) if w else 0
        seen = set(observed[g]) if observed is not None and g < len(observed) else None
        read_blocks: list[int] = []
        read_slots: list[int] = []
        expected: set[int] = set()
        in_table: set[int] = set()
        null_loads = outside_loads = past_end_loads = 0
        group_rows: list[dict[str, Any]] = []
        for li, bid in enumerate(table):
            cells: list[tuple[int | None, int | None, str]] = []
            loaded: list[bool | None] = []
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
                    state = "query" if pos >= q0 else "read"
                if state in ("read", "query"):
                    assert slot is not None  # read or query: a real block (bid != 0), so a real slot
                    read_slots.append(slot)
                    expected.add(slot)
                    if not read_blocks or read_blocks[-1] != bid:
                        read_blocks.append(bid)
                if slot is not None:
                    in_table.add(slot)
                got = None if seen is None or slot is None else slot in seen
                if got and state == "outside_window":
                    outside_loads += 1
                if got and state == "unwritten":
                    past_end_loads += 1
                cells.append((pos, slot, state))
                loaded.append(got)
            gt = given[g] if g < len(given) else []
            group_rows.append(dict(group=g, logical=li, block_id=bid, cells=cells, loaded=loaded, given=gt[li] if li < len(gt) else None))
        stray: list[int] = []
        unexpected: list[int] = []
        missed: list[int] = []
        if seen is not None:
            missed = sorted(expected - seen)
            unexpected = sorted(seen - expected)
            null_loads = sum(1 for s in seen if s // bs == 0)
            stray = sorted({s // bs for s in seen if s not in in_table})
            for bid in stray:
                st = state_snap.blocks[bid].state if bid < len(state_snap.blocks) else "free"
                cells = [(None, bid * bs + off, f"block:{st}") for off in range(bs)]
                group_rows.append(
                    dict(group=g, logical=None, block_id=bid, cells=cells, loaded=[bid * bs + off in seen for off in range(bs)], given=None)
                )
        out["rows"].extend(group_rows)
        gname = group_name(group_specs[g]) if g < len(group_specs) else f"group {g}"
        out["groups"].append(
            dict(
                name=gname,
                window=w,
                table=table,
                given_table=given[g] if g < len(given) else [],
                read_blocks=read_blocks,
                read_slots=read_slots,
                query_slot=(table[p // bs] * bs + p % bs) if p // bs < len(table) and table[p // bs] != 0 else None,
                first_read=first_read,
                observed_slots=sorted(seen) if seen is not None else None,
                missed=missed,
                unexpected=unexpected,
                stray_blocks=stray,
                null_loads=null_loads,
                outside_window_loads=outside_loads,
                past_end_loads=past_end_loads,
            )
        )
    _rows_to_arrays(out, state_snap, bs, len(manager) > 1, max_rows)
    queries = f"query at position {p}" if q_len == 1 else f"{q_len} queries, positions {q0}–{p}"
    out["title"] = f"Attention read · {html_escape(rid)} · {queries} · step {snapshot.step}"
    out["subtitle"] = _verdict(out, source)
    return out


def _verdict(out: dict[str, Any], source: str) -> str:
    """One line: what was read, and -- when traced -- what the loads showed."""
    parts = []
    for gr in out["groups"]:
        label = f"{gr['name']}: " if len(out["groups"]) > 1 else ""
        if gr["observed_slots"] is None:
            parts.append(f"{label}{len(gr['read_slots'])} slots in blocks [{_ids(gr['read_blocks'])}]")
            continue
        n = len(gr["observed_slots"])
        if not gr["missed"] and not gr["unexpected"]:
            tail = "block 0 never read" + (", nothing outside the window" if gr["window"] else "")
            parts.append(f"{label}{n} slots loaded = the table's {len(gr['read_slots'])}; {tail}")
        else:
            bad = []
            others = [b for b in gr["stray_blocks"] if b != 0]
            if others:
                bad.append(f"blocks [{_ids(others)}] NOT in the table")
            if gr["null_loads"]:
                bad.append(f"{gr['null_loads']} slots of null block 0")
            if gr["outside_window_loads"]:
                bad.append(f"{gr['outside_window_loads']} outside the window")
            if gr["past_end_loads"]:
                bad.append(f"{gr['past_end_loads']} empty slots past the end")
            if gr["missed"]:
                bad.append(f"{len(gr['missed'])} expected slots not loaded")
            parts.append(f"{label}{n} slots loaded: " + ", ".join(bad))
    how = {
        "traced": "traced kernel loads",
        "attention_batch": "from the AttentionBatch (loads not traced)",
        "block_table": "derived from the block table (no kernel in this run)",
    }[source]
    return " · ".join(parts) + f" · {how}"


def _rows_to_arrays(out: dict[str, Any], snap: Snapshot, bs: int, several_groups: bool, max_rows: int | None) -> None:
    """Heatmap rows (merging runs of plain fully-read rows when there are too many), labels,
    hover text and the positions of the load marks."""
    rows = out["rows"]

    def plain(r: dict[str, Any]) -> bool:
        loaded = set(r["loaded"])
        return r["logical"] is not None and all(s == "read" for _, _, s in r["cells"]) and loaded in ({True}, {None})

    drawn: list[list[dict[str, Any]]] = [[r] for r in rows]
    if max_rows is not None and len(rows) > max_rows:
        merged: list[list[dict[str, Any]]] = []
        for r in rows:
            if merged and plain(r) and plain(merged[-1][-1]) and merged[-1][-1]["group"] == r["group"]:
                merged[-1].append(r)
            else:
                merged.append([r])
        drawn = merged
    out["drawn_rows"] = [[(r["group"], r["logical"], r["block_id"]) for r in run] for run in drawn]
    marks = out["marks"]
    for y, run in enumerate(drawn):
        r = run[0]
        g, li, bid = r["group"], r["logical"], r["block_id"]
        prefix = f"g{g} " if several_groups else ""
        zrow, trow, crow = [], [], []
        if len(run) > 1:
            blocks = [x["block_id"] for x in run]
            out["row_labels"].append(f"{prefix}L{run[0]['logical']}–L{run[-1]['logical']} ({len(run)} blocks)")
            traced = r["loaded"][0] is not None
            for off in range(bs):
                zrow.append(_KIDX["read"])
                trow.append("")
                crow.append(
                    f"logical blocks {run[0]['logical']}..{run[-1]['logical']} → blocks {blocks}<br>every slot read"
                    + (" and loaded (traced)" if traced else "")
                )
                if traced:
                    marks["loaded"][0].append(off + 0.3)
                    marks["loaded"][1].append(y - 0.22)
        else:
            if li is None:
                b = snap.blocks[bid] if bid < len(snap.blocks) else None
                owners = ", ".join(b.owners) if b is not None and b.owners else ""
                whose = f"{owners}'s" if owners else (STATE_LABELS[b.state] if b is not None else "?")
                out["row_labels"].append(f"{prefix}✖ {bid} ({whose})")
            else:
                # Where the kernel's own table says something else (the runner's append-only
                # copy still lists blocks that left the window), both are shown.
                got = r.get("given")
                also = f" (kernel: {got})" if got is not None and got != bid else ""
                out["row_labels"].append(f"{prefix}L{li} → {'∅' if bid == 0 else bid}{also}")
            for off, ((pos, slot, state), got) in enumerate(zip(r["cells"], r["loaded"])):
                zrow.append(_KIDX[state])
                trow.append(
                    "q"
                    if state == "query"
                    else "×"
                    if state == "outside_window"
                    else ""
                    if slot is None or state == "unwritten"
                    else str(slot)
                )
                if li is None:
                    st = state.split(":", 1)[1]
                    hover = (
                        f"block {bid}, offset {off}: slot {slot}<br><b>not in this request's table</b><br>"
                        f"block state: {STATE_HELP.get(st, st)}"
                    )
                else:
                    hover = (
                        f"position {pos} → block {bid} (logical {li}), offset {off}<br>"
                        + (f"slot {bid} × {bs} + {off} = {slot}" if slot is not None else "null block: no slot")
                        + f"<br>{KERNEL_LABELS[state]}"
                    )
                expected = state in ("read", "query")
                if got is not None:
                    hover += "<br>traced: " + ("loaded" if got else "not loaded")
                    kind = ("loaded" if expected else "unexpected") if got else ("missed" if expected else None)
                    if kind is not None:
                        marks[kind][0].append(off + 0.3)
                        marks[kind][1].append(y - 0.22)
                crow.append(hover)
        out["z"].append(zrow)
        out["text"].append(trow)
        out["customdata"].append(crow)


class KernelView(View):
    """The slots the attention kernel reads for one request: expected from the block table,
    observed from the traced loads."""

    name = "kernel"
    title = "Attention read"

    def __init__(
        self, timeline: Timeline | None = None, *, decode: Callable[[int], str] | None = None, width: int = 482, height: int = 330
    ) -> None:
        super().__init__(timeline, decode=decode, width=width, height=height)
        self._at_batch: tuple[int, Snapshot] | None = None
        go = _go()
        fig = self.figure
        fig.add_trace(
            go.Heatmap(
                z=[[None]],
                zmin=-0.5,
                zmax=len(_CATEGORIES) - 0.5,
                colorscale=discrete_colorscale(_COLORS),
                showscale=False,
                xgap=1,
                ygap=3,
                texttemplate="%{text}",
                textfont=dict(size=8),
                hovertemplate="%{customdata}<extra></extra>",
                name="slots",
                showlegend=False,
            )
        )
        marks = {
            "loaded": dict(symbol="circle", size=5, color=INK, line=dict(width=1, color="white")),
            "missed": dict(symbol="circle-open", size=7, color=INK, line=dict(width=1.5, color=INK)),
            "unexpected": dict(symbol="x", size=9, color=INK, line=dict(width=1, color="white")),
        }
        for kind, marker in marks.items():
            fig.add_trace(go.Scatter(x=[], y=[], mode="markers", marker=marker, name=MARK_LABELS[kind], hoverinfo="skip", showlegend=True))
        for k in KERNEL_ORDER:
            # An open symbol is drawn in the marker colour: the white of "outside window"
            # cells would vanish, so its legend glyph is grey like the × in the cells.
            colors = {k: "#777777"} if KERNEL_SYMBOLS[k].endswith("-open") else KERNEL_COLORS
            (tr,) = legend_traces(go, colors, KERNEL_LABELS, (k,), symbol=KERNEL_SYMBOLS[k])
            fig.add_trace(tr)
        fig.update_layout(
            showlegend=True,
            legend=dict(TOP_LEGEND, font=dict(size=9)),
            xaxis=dict(
                title=dict(text="offset in block (slot = block × block_size + offset)", font=dict(size=10), standoff=2),
                fixedrange=True,
                showgrid=False,
                zeroline=False,
                side="bottom",
                autorange=False,
            ),
            yaxis=dict(fixedrange=True, showgrid=False, zeroline=False, automargin=True, autorange=False),
            margin=dict(l=10, r=10, t=86, b=36),
        )

    def batch_for(self, snapshot: Snapshot) -> AttentionBatch | None:
        """The ``AttentionBatch`` of the snapshot's step, if the runner emitted one by then."""
        if self.timeline is None:
            return None
        b = self.timeline.attention_batch(snapshot.step)
        return b if b is not None and b.seq < snapshot.num_events else None

    def _state_at(self, batch: AttentionBatch | None) -> Snapshot | None:
        """The manager's state when the kernel ran (right after the batch event), cached."""
        if batch is None or self.timeline is None:
            return None
        if self._at_batch is None or self._at_batch[0] != batch.seq:
            self._at_batch = (batch.seq, self.timeline.after_event(batch.seq))
        return self._at_batch[1]

    def selection_patches(self, snapshot: Snapshot) -> dict[str, dict[str, Any]]:
        """The view draws ONE request's reads: selecting another that the kernel read K/V
        for replaces the whole figure, so its patch is that figure (``{"figure": ...}``).
        Call right after ``update(snapshot)``; the view is left as that call drew it."""
        batch = self.batch_for(snapshot)
        shown = pick_request(snapshot, None, batch)
        out = {}
        others = [r for r in snapshot.requests if r != shown and pick_request(snapshot, r, batch) == r]
        for rid in others:
            self.update(snapshot, rid)
            out[rid] = {"figure": self.still()}
        if others:
            self.update(snapshot, None)
        return out

    def update(self, snapshot: Snapshot, selected_request: str | None = None) -> None:
        batch = self.batch_for(snapshot)
        max_rows = max(4, int((self.height - 130) // ROW_PX))
        d = figure_data(snapshot, selected_request, batch=batch, at_batch=self._state_at(batch), max_rows=max_rows)
        self.last_data = d
        fig = self.figure
        n = len(d["z"])
        bs = len(d["z"][0]) if d["z"] else snapshot.block_size
        with fig.batch_update():
            hm = fig.data[0]
            if n:
                keep = n <= SLOT_LABEL_ROWS and bs <= 16
                text = d["text"] if keep else [[t if t in ("q", "×") else "" for t in row] for row in d["text"]]
                z, hover, y = d["z"], d["customdata"], list(range(n))
            else:
                z, text, hover, y = [[None]], [[""]], [[""]], [0]
            self._put("z", hm, "z", z, "num")
            self._put("text", hm, "text", text, "str")
            self._put("hover", hm, "customdata", hover, "str")
            self._put("y", hm, "y", y, "num")
            legend = []
            for i, kind in enumerate(MARK_LABELS, start=1):
                xs, ys = d["marks"][kind]
                self._put(f"mk.{kind}.x", fig.data[i], "x", xs, "num")
                self._put(f"mk.{kind}.y", fig.data[i], "y", ys, "num")
                self._put(f"mk.{kind}.legend", fig.data[i], "showlegend", bool(xs))
                if xs:
                    legend.append(MARK_LABELS[kind])
            self._put("mk.size", fig.data[1].marker, "size", 5 if n <= 24 else 3)
            every = max(1, cdiv(n, 20))
            ticks = [i for i in range(n) if i % every == 0]
            self._put("ytv", fig.layout.yaxis, "tickvals", ticks)
            self._put("ytt", fig.layout.yaxis, "ticktext", [d["row_labels"][i] for i in ticks])
            self._put("yr", fig.layout.yaxis, "range", [max(n, 4) - 0.5, -0.5])
            self._put("xr", fig.layout.xaxis, "range", [-0.5, bs - 0.5])
            self._put("xd", fig.layout.xaxis, "dtick", 1 if bs <= 16 else 4)
            sub = d.get("subtitle", "")
            self._header(d["title"], legend + [KERNEL_LABELS[k] for k in KERNEL_ORDER], legend_font=9, subtitle=sub)
            empty = [dict(text="no request holds K/V at this step", x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)]
            self._put("notes", fig.layout, "annotations", [] if n else empty)
