"""Which cache slots did the kernel really read? Two ways to *observe* it, not compute it.

The kernel view of lesson 02 used to derive "which blocks does this query read" from the
kernel's inputs -- the same arithmetic the kernel is supposed to do, so it could only agree
with itself. This module watches the kernel instead:

* **Under the Triton interpreter** (every CPU machine), :func:`trace_loads` intercepts the
  interpreter's one load primitive (``InterpreterBuilder.create_masked_load``: every
  ``tl.load`` of every kernel ends there, with the absolute addresses of its lanes and
  their mask). For the kernel arguments being watched (the key and value caches), the
  addresses whose mask lane is on -- the elements actually fetched from memory -- are
  turned back into ``(block, offset)`` through the tensor's own shape and strides, and
  filed under the program (grid index) that loaded them. A masked-off lane fetches
  nothing and is not recorded, exactly as on a GPU.
* **On a GPU** the loads cannot be watched, but their effect can: :func:`probe_reads_nan`
  poisons one block (then one slot) of the K and V caches with NaN at a time and runs the
  kernel again. A slot that is loaded makes its sequence's output NaN -- even a slot whose
  score is then masked to ``-inf``, because its value row still enters ``p @ V`` and
  ``0 × NaN = NaN`` -- and a slot that is never loaded leaves it finite.

Both report the slots (``block * block_size + offset``) each sequence read, so they can be
compared with each other and with what the block table says the kernel *should* read. On
the CPU the two methods must agree: a test checks it.

Cost under the interpreter: one range test per load, and for the watched tensors a few
vectorised integer divisions and a ``np.unique`` per load (measured by ``python -m
kvlab.bench kernel``). Nothing is recorded outside a ``with trace_loads(...)`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ._env import INTERPRET

__all__ = [
    "KernelLaunch",
    "LoadTrace",
    "probe_reads_nan",
    "reads_by_sequence",
    "trace_loads",
    "traced_unified_attention",
]


@dataclass(slots=True)
class _Watched:
    """Where one watched tensor argument lives in host memory during one launch."""

    lo: int  # first byte of its storage
    hi: int  # one past its last byte
    first: int  # address of the view's element [0, 0, ...]
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements


@dataclass(slots=True)
class KernelLaunch:
    """One kernel launch seen by a trace.

    ``loads[name][program]`` is the sorted array of keys ``i0 * shape[1] + i1`` (the first
    two indices of the watched tensor: ``block * block_size + offset`` for a paged cache)
    that program ``(x, y, z)`` fetched from argument ``name``. ``captured`` holds host
    copies of the arguments named in ``capture`` (e.g. the q-tile schedule).
    """

    kernel: str
    grid: tuple[int, int, int]
    loads: dict[str, dict[tuple[int, int, int], np.ndarray]] = field(default_factory=dict)
    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    num_loads: int = 0  # load instructions executed (watched or not)

    def keys(self, name: str) -> np.ndarray:
        """Every key any program fetched from ``name``, sorted and unique."""
        parts = list(self.loads.get(name, {}).values())
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


class LoadTrace:
    """What :func:`trace_loads` recorded: one :class:`KernelLaunch` per launch, in order."""

    def __init__(self, watch: Sequence[str], capture: Sequence[str], kernels: Sequence[str] | None) -> None:
        self.watch = tuple(watch)
        self.capture = tuple(capture)
        self.kernels = None if kernels is None else tuple(kernels)
        self.launches: list[KernelLaunch] = []
        self._current: KernelLaunch | None = None
        self._watched: dict[str, _Watched] = {}
        self._grid_idx: tuple[int, int, int] = (0, 0, 0)

    def __repr__(self) -> str:
        return f"LoadTrace({len(self.launches)} launches, watching {list(self.watch)})"

    # -- called from the patched interpreter ----------------------------------------------------
    def _begin(self, kernel: str, named_args: Mapping[str, object]) -> None:
        if self.kernels is not None and kernel not in self.kernels:
            self._current = None
            return
        self._current = KernelLaunch(kernel=kernel, grid=(1, 1, 1))
        self._watched = {}
        for name in self.watch:
            t = named_args.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            self._watched[name] = _Watched(
                lo=st.data_ptr(),
                hi=st.data_ptr() + st.nbytes(),
                first=t.data_ptr(),
                itemsize=t.element_size(),
                shape=tuple(t.shape),
                strides=tuple(t.stride()),
            )
            self._current.loads[name] = {}
        for name in self.capture:
            t = named_args.get(name)
            if isinstance(t, torch.Tensor):
                self._current.captured[name] = t.detach().to("cpu", copy=True)
        self.launches.append(self._current)

    def _record(self, addresses: np.ndarray, mask: np.ndarray, program: tuple[int, int, int], grid: tuple[int, int, int]) -> None:
        launch = self._current
        if launch is None:
            return
        launch.num_loads += 1
        launch.grid = grid
        if not self._watched:
            return
        a = np.asarray(addresses).reshape(-1)
        m = np.asarray(mask, dtype=bool).reshape(-1)
        if m.shape != a.shape:
            m = np.broadcast_to(np.asarray(mask, dtype=bool), np.asarray(addresses).shape).reshape(-1)
        a = a[m]
        if a.size == 0:
            return
        a = a.astype(np.int64, copy=False)
        amin, amax = int(a.min()), int(a.max())
        for name, w in self._watched.items():
            if amax < w.lo or amin >= w.hi:
                continue
            keys = _keys_in_view(a, w)
            if keys.size:
                per_prog = launch.loads[name]
                old = per_prog.get(program)
                per_prog[program] = keys if old is None else np.union1d(old, keys)


def _keys_in_view(addresses: np.ndarray, w: _Watched) -> np.ndarray:
    """The ``i0 * shape[1] + i1`` keys of the addresses that are elements of the view ``w``
    (an address of the same storage outside the view -- e.g. the value half when ``w`` is
    the key view of a ``[blocks, 2, ...]`` tensor -- is not an element of it)."""
    off = addresses - w.first
    ok = (off >= 0) & (off % w.itemsize == 0)
    off = off[ok] // w.itemsize
    # Size-1 dimensions may carry any stride: their index is 0, leave them out.
    order = sorted((i for i in range(len(w.shape)) if w.shape[i] > 1), key=lambda i: -w.strides[i])
    idx: dict[int, np.ndarray] = {i: np.zeros(off.shape, dtype=np.int64) for i in range(len(w.shape))}
    rest = off
    valid = np.ones(off.shape, dtype=bool)
    for i in order:
        s = max(w.strides[i], 1)
        q = rest // s
        valid &= q < w.shape[i]
        idx[i] = q
        rest = rest - q * s
    valid &= rest == 0
    if not valid.any():
        return np.zeros(0, dtype=np.int64)
    i0 = idx[0][valid]
    i1 = idx[1][valid] if len(w.shape) > 1 else np.zeros_like(i0)
    n1 = w.shape[1] if len(w.shape) > 1 else 1
    return np.unique(i0 * n1 + i1)


_ACTIVE: list[LoadTrace] = []


@contextlib.contextmanager
def trace_loads(watch: Sequence[str], *, capture: Sequence[str] = (), kernels: Sequence[str] | None = None) -> Iterator[LoadTrace]:
    """Record, for every kernel launched inside the block, what it loads from the arguments
    named ``watch`` (the kernel's own parameter names, e.g. ``"key_cache_ptr"``).

    ``capture``: argument names whose host values are kept per launch (e.g. the q-tile
    schedule, to know which sequence each program served). ``kernels``: only launches of
    these kernel function names are recorded (default: all).

    Needs the Triton interpreter (``kvlab.kernels.INTERPRET``); on a GPU use
    :func:`probe_reads_nan`. Traces do not nest.
    """
    if not INTERPRET:
        raise RuntimeError(
            "trace_loads needs the Triton interpreter (no CUDA, or TRITON_INTERPRET=1); on a GPU, observe the reads with probe_reads_nan"
        )
    if isinstance(watch, str) or isinstance(capture, str):
        raise TypeError("watch and capture must be sequences of argument names, not a single string")
    if _ACTIVE:
        raise RuntimeError("trace_loads blocks do not nest")
    from triton.runtime import interpreter as interp

    trace = LoadTrace(watch, capture, kernels)
    builder = interp.interpreter_builder
    executor = interp.GridExecutor
    original_load = builder.create_masked_load  # bound method of the one interpreter builder
    original_init = executor._init_args_hst

    def create_masked_load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):  # noqa: ANN001, ANN202
        out = original_load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)
        trace._record(ptrs.data, mask.data, builder.grid_idx, builder.grid_dim)
        return out

    def init_args_hst(self, args_dev, kwargs):  # noqa: ANN001, ANN202
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        named = dict(zip(self.arg_names, args_hst))
        named.update(kwargs_hst)
        trace._begin(getattr(self.fn, "__name__", "kernel"), named)
        return args_hst, kwargs_hst

    builder.create_masked_load = create_masked_load
    executor._init_args_hst = init_args_hst
    _ACTIVE.append(trace)
    try:
        yield trace
    finally:
        _ACTIVE.pop()
        executor._init_args_hst = original_init
        del builder.create_masked_load  # back to the class's method


# -- the attention kernel ------------------------------------------------------------------------
_CACHE_ARGS = ("key_cache_ptr", "value_cache_ptr")


def reads_by_sequence(launch: KernelLaunch, num_seqs: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per sequence, the sorted slots its programs loaded from the key cache and from the
    value cache, for one launch of ``_unified_attention_kernel`` traced with its q-tile
    schedule captured (program ``x`` served sequence ``tile_seq[x]``; -1 is an idle slot)."""
    tile_seq = launch.captured["tile_seq_ptr"].tolist()
    out: tuple[list[set[int]], list[set[int]]] = ([set() for _ in range(num_seqs)], [set() for _ in range(num_seqs)])
    for which, name in enumerate(_CACHE_ARGS):
        for (x, _y, _z), keys in launch.loads.get(name, {}).items():
            seq = tile_seq[x]
            if 0 <= seq < num_seqs:
                out[which][seq].update(int(k) for k in keys)
    return [sorted(s) for s in out[0]], [sorted(s) for s in out[1]]


def traced_unified_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """``unified_attention`` under :func:`trace_loads`: returns ``(out, reads)`` with
    ``reads[s]`` = the sorted slots (``block * block_size + offset``) sequence ``s``'s
    programs loaded from the K or V cache -- observed, not derived from the block table."""
    from .attention import unified_attention

    with trace_loads(_CACHE_ARGS, capture=("tile_seq_ptr",), kernels=("_unified_attention_kernel",)) as trace:
        out = unified_attention(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window)
    num_seqs = int(seq_lens.shape[0])
    reads: list[set[int]] = [set() for _ in range(num_seqs)]
    for launch in trace.launches:
        k, v = reads_by_sequence(launch, num_seqs)
        for s in range(num_seqs):
            reads[s].update(k[s])
            reads[s].update(v[s])
    return out, [sorted(r) for r in reads]


def probe_reads_nan(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    blocks: Sequence[int] | None = None,
) -> list[list[int]]:
    """The slots each sequence's attention loads, found by NaN poisoning (works on a GPU).

    For every block in ``blocks`` (default: all, the null block included), a copy of the
    caches with that whole block set to NaN goes through the kernel; sequences whose
    output turns NaN read something in it. Each block that some sequence reads is then
    probed slot by slot. Launches: ``num_blocks`` plus ``block_size`` per block read.
    The caches themselves are not modified. Returns ``reads[s]`` like
    :func:`traced_unified_attention`.
    """
    from .attention import unified_attention

    if not (q.dtype.is_floating_point and key_cache.dtype.is_floating_point):
        raise TypeError("probe_reads_nan needs floating-point q and caches (NaN must be representable)")
    num_blocks, block_size = int(key_cache.shape[0]), int(key_cache.shape[1])
    num_seqs = int(seq_lens.shape[0])
    cu = cu_seqlens_q.tolist()
    candidates = list(range(num_blocks)) if blocks is None else [int(b) for b in blocks]
    for b in candidates:
        if not 0 <= b < num_blocks:
            raise ValueError(f"blocks: {b} is not a block id in 0..{num_blocks - 1}")
    k, v = key_cache.clone(), value_cache.clone()

    def poisoned_seqs(block: int, offset: int | None) -> list[int]:
        where = (block,) if offset is None else (block, offset)
        k_saved, v_saved = k[where].clone(), v[where].clone()
        k[where] = float("nan")
        v[where] = float("nan")
        try:
            out = unified_attention(q, k, v, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window)
        finally:
            k[where] = k_saved
            v[where] = v_saved
        bad = torch.isnan(out).flatten(1).any(dim=1).tolist()
        return [s for s in range(num_seqs) if any(bad[cu[s] : cu[s + 1]])]

    reads: list[set[int]] = [set() for _ in range(num_seqs)]
    for b in candidates:
        if not poisoned_seqs(b, None):
            continue
        for off in range(block_size):
            for s in poisoned_seqs(b, off):
                reads[s].add(b * block_size + off)
    return [sorted(r) for r in reads]
