"""Lesson 07b (hybrid models): where the bytes of a block live when several KV-cache groups
share one pool.

vLLM 0.33 plans a hybrid model's KV memory in ``vllm/v1/core/kv_cache_planning.py``:

1. ``unify_kv_cache_spec_page_size`` gives every layer the same page size (one block of one
   layer, in bytes);
2. ``_get_kv_cache_groups_uniform_page_size`` puts the layers of one kind into groups of the
   same number of layers (the smallest kind's count, or the largest one's when they are
   close), taking every ``num_groups``-th layer of a kind into one group;
3. ``get_kv_cache_config_from_groups`` allocates ONE backing buffer of
   ``num_blocks x bytes_per_block`` bytes and describes, for each group, where its layers
   sit in it (``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``). The groups
   overlay each other from byte 0: with the default layer-outer layout (``LBNHC``), layer
   ``l`` of every group uses the bytes ``[l x layer_stride, (l + 1) x layer_stride)``, and
   block ``b`` of that layer starts ``b x page`` bytes into them. So a block id means the
   same bytes whichever group holds it; the pool hands each id to one group at a time.

:func:`plan_kv_cache_layout` repeats these three steps on kvlab's specs (plain data out);
:func:`layout_figure` draws the result, and :meth:`KVCacheLayoutPlan.kv_cache_config` hands it to
vLLM's allocation (:func:`kvlab.worker.kv_cache_views.allocate_kv_cache`) to be made real. kvlab's own model runner keeps it simpler: each
layer gets a tensor of its own with a page for every block id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import ceil

import plotly.graph_objects as go

from kvlab.core.kv_cache_utils import unify_kv_cache_spec_page_size
from kvlab.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvlab.lessons.pool_sizing import KVCacheTensor  # the one description of a tensor (lesson 02)
from kvlab.viz.style import FONT, INK, STATE_COLORS, STATE_TEXT_COLORS

__all__ = ["KVCacheTensor", "KVCacheLayoutPlan", "plan_kv_cache_layout", "layout_figure"]


@dataclass(frozen=True)
class KVCacheLayoutPlan:
    """A hybrid model's KV memory as vLLM 0.33 lays it out (layer-outer layout)."""

    group_layers: tuple[tuple[str, ...], ...]
    group_specs: tuple[KVCacheSpec, ...]
    num_blocks: int
    page_size_bytes: int
    bytes_per_block: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]

    @property
    def size(self) -> int:
        """Bytes of the one backing buffer."""
        return self.bytes_per_block * self.num_blocks

    @property
    def layers_per_group(self) -> int:
        return max(len(names) for names in self.group_layers)

    def group_of(self, layer: str) -> int:
        return next(g for g, names in enumerate(self.group_layers) if layer in names)

    def page_offset(self, layer: str, block_id: int) -> int:
        """Byte where ``layer``'s page of block ``block_id`` starts in the backing buffer."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in 0 .. {self.num_blocks - 1}, got {block_id}")
        t = self.kv_cache_tensors[self.group_of(layer)]
        return t.offset + t.layers.index(layer) * t.layer_stride + block_id * t.block_stride

    def kv_cache_config(self) -> KVCacheConfig:
        """The plan as the ``KVCacheConfig`` a worker allocates from
        (:func:`kvlab.worker.kv_cache_views.allocate_kv_cache`)."""
        groups = tuple(KVCacheGroupSpec(names, spec) for names, spec in zip(self.group_layers, self.group_specs))
        return KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=self.kv_cache_tensors, kv_cache_groups=groups)

    def regions(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """The buffer cut where the layers' views start and end: (first byte, end byte, the
        layers that view these bytes -- one layer of each group)."""
        out = []
        for slot in range(self.layers_per_group):
            start = slot * self.kv_cache_tensors[0].layer_stride
            viewers = tuple(names[slot] for names in self.group_layers if slot < len(names))
            out.append((start, start + self.num_blocks * self.page_size_bytes, viewers))
        return out


def _group_layers(specs: Mapping[str, KVCacheSpec]) -> tuple[list[tuple[str, ...]], list[KVCacheSpec]]:
    """vLLM 0.33's ``_get_kv_cache_groups_uniform_page_size``: equal specs form a kind; every
    kind is cut into groups of ``group_size`` layers, layer ``i`` of a kind going to group
    ``i % num_groups`` of that kind."""
    kinds: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        kinds.setdefault(spec, []).append(name)
    counts = [len(names) for names in kinds.values()]
    group_size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups, group_specs = [], []
    for spec, names in kinds.items():
        num_groups = ceil(len(names) / group_size)
        for i in range(num_groups):
            groups.append(tuple(names[i::num_groups]))
            group_specs.append(spec)
    return groups, group_specs


def plan_kv_cache_layout(layer_specs: Mapping[str, KVCacheSpec] | Sequence[KVCacheSpec], num_blocks: int) -> KVCacheLayoutPlan:
    """Plan one backing buffer of ``num_blocks`` blocks for a model whose layers have the
    given specs (a mapping layer name -> spec, or a list: layer ``i`` is ``"layers.i"``), as
    vLLM 0.33 does with its default layer-outer layout. Every spec needs a ``block_size``."""
    if not isinstance(layer_specs, Mapping):
        layer_specs = {f"layers.{i}": s for i, s in enumerate(layer_specs)}
    if not layer_specs:
        raise ValueError("layer_specs is empty: an attention-free model has no KV cache to lay out")
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
        raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
    names = list(layer_specs)
    unified = dict(zip(names, unify_kv_cache_spec_page_size([layer_specs[n] for n in names])))
    page = next(iter(unified.values())).page_size_bytes
    groups, group_specs = _group_layers(unified)
    bytes_per_block = max(len(g) for g in groups) * page
    size = bytes_per_block * num_blocks
    tensors = tuple(KVCacheTensor(size=size, layers=g, layer_stride=page * num_blocks, block_stride=page, offset=0) for g in groups)
    return KVCacheLayoutPlan(
        group_layers=tuple(groups),
        group_specs=tuple(group_specs),
        num_blocks=num_blocks,
        page_size_bytes=page,
        bytes_per_block=bytes_per_block,
        kv_cache_tensors=tensors,
    )


def _kind(spec: KVCacheSpec) -> str:
    window = getattr(spec, "sliding_window", None)
    return f"window {window}" if window else spec.type_name.replace("_", " ")


def _kib(n: int) -> str:
    return f"{n // 1024:,} KiB" if n % 1024 == 0 else f"{n:,} B"


def layout_figure(
    plan: KVCacheLayoutPlan, tables: Sequence[Sequence[int]] = (), block: int | None = None, title: str = "", width: int = 840
) -> go.Figure:
    """The backing buffer, one row per stretch of ``num_blocks`` pages that the same layers
    view (one layer of each group), each page a cell labelled with its block id and the group
    whose table holds it (``tables``: one block table per group, e.g. a request's). ``block``:
    outline that block id's page in every row, with its byte offset."""
    holder = {bid: g for g, table in enumerate(tables) for bid in table if bid != 0}
    regions = plan.regions()
    fig = go.Figure()
    shapes, notes = [], []
    hx, hy, htext = [], [], []
    for r, (start, _end, viewers) in enumerate(regions):
        for b in range(plan.num_blocks):
            state = "null" if b == 0 else ("in_use" if b in holder else "free")
            shapes.append(
                dict(
                    type="rect",
                    x0=b,
                    x1=b + 1,
                    y0=r - 0.36,
                    y1=r + 0.36,
                    fillcolor=STATE_COLORS[state],
                    line=dict(color="white", width=2),
                    layer="below",
                )
            )
            label = "∅" if b == 0 else (f"{b}<br>G{holder[b]}" if b in holder else str(b))
            notes.append(dict(x=b + 0.5, y=r, text=label, showarrow=False, font=dict(family=FONT, size=12, color=STATE_TEXT_COLORS[state])))
            off = start + b * plan.page_size_bytes
            who = "the null block" if b == 0 else (f"held by group {holder[b]}" if b in holder else "free")
            views = ", ".join(f"{v} (G{plan.group_of(v)}, {plan.group_specs[plan.group_of(v)].block_size} tokens)" for v in viewers)
            hx.append(b + 0.5)
            hy.append(r)
            htext.append(f"block {b} ({who})<br>bytes {off:,} – {off + plan.page_size_bytes - 1:,}<br>viewed as: {views}")
        if block is not None:
            shapes.append(
                dict(
                    type="rect", x0=block, x1=block + 1, y0=r - 0.42, y1=r + 0.42, line=dict(color=INK, width=3), fillcolor="rgba(0,0,0,0)"
                )
            )
            notes.append(
                dict(
                    x=block + 0.5,
                    y=r + 0.42,
                    yanchor="top",
                    showarrow=False,
                    text=f"byte {start + block * plan.page_size_bytes:,}",
                    font=dict(family=FONT, size=11, color=INK),
                    bgcolor="white",
                )
            )
    fig.add_scatter(x=hx, y=hy, mode="markers", marker=dict(opacity=0, size=30), hovertext=htext, hoverinfo="text", showlegend=False)

    def viewer(v: str) -> str:
        spec = plan.group_specs[plan.group_of(v)]
        return f"{v} · G{plan.group_of(v)} {_kind(spec)}, {spec.block_size} tok"

    ticktext = [f"bytes {_kib(s)} – {_kib(e)}:<br>" + "<br>".join(viewer(v) for v in viewers) for s, e, viewers in regions]
    fig.update_layout(
        title=dict(text=title, font=dict(size=14)),
        width=width,
        height=130 + 105 * len(regions),
        margin=dict(l=215, r=15, t=45, b=55),
        shapes=shapes,
        annotations=notes,
        plot_bgcolor="white",
        xaxis=dict(
            range=[0, plan.num_blocks],
            tickvals=[b + 0.5 for b in range(plan.num_blocks)],
            ticktext=[_kib(b * plan.page_size_bytes) for b in range(plan.num_blocks)],
            showgrid=False,
            title=f"offset of the page inside its row (one page = {plan.page_size_bytes:,} bytes)",
            tickfont=dict(size=10),
            zeroline=False,
        ),
        yaxis=dict(
            tickvals=list(range(len(regions))),
            ticktext=ticktext,
            autorange="reversed",
            showgrid=False,
            range=[len(regions) - 0.4, -0.55],
            tickfont=dict(family=FONT, size=11),
            zeroline=False,
        ),
    )
    return fig
