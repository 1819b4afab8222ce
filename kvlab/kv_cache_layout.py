"""The order in which a KV cache's axes lie in memory (vLLM 0.33: ``vllm/v1/kv_cache_layout.py``).

Every layer's cache is the same *logical* array in vLLM 0.33: ``[L, B, H, N, C]`` -- the layers
that share one allocation, the blocks, the head slots, the states (tokens) of a block, and the
content bytes of one (head, state) cell (a key and a value side by side). What differs between
attention backends is only which axis is outermost in memory. Each :class:`KVCacheLayout`
member is that order, written as the logical axes from outermost to innermost.

Why it matters to a cache engine: an offload or a transfer copies *blocks*. A layout whose
``L`` and ``B`` axes are outermost (``LB...`` or ``BL...``) keeps one layer's block in one run
of bytes -- one copy per (layer, block) -- while ``LHBNC`` scatters a block across every head
(one run per head), and ``BL..`` keeps a block of *all* layers together (one copy per block).
Pure Python: the stride arithmetic is in :func:`kvlab.kv_cache_interface.compute_layout_strides`
and the torch views in :mod:`kvlab.worker.kv_cache_views`.
"""

from __future__ import annotations

from enum import Enum

# The logical axes, by their index in [L, B, H, N, C].
_DIM_L, _DIM_B, _DIM_H, _DIM_N, _DIM_C = 0, 1, 2, 3, 4


class KVCacheLayout(Enum):
    """A physical order of the logical ``[L, B, H, N, C]`` axes; the value lists the logical
    axis indices from the outermost in memory to the innermost (the content is always last)."""

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)

    @property
    def stride_order(self) -> tuple[int, ...]:
        """The logical axes, outermost in memory first."""
        return self.value

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """The same order for one layer's 4-D ``[B, H, N, C]`` view (the ``L`` axis dropped)."""
        return tuple(i - 1 for i in self.value if i != _DIM_L)

    @property
    def is_layer_compact(self) -> bool:
        """One layer's cache is one run of memory: ``L`` is the outermost axis."""
        return self.value[0] == _DIM_L

    @property
    def is_block_contiguous(self) -> bool:
        """Inside a block, heads, states and content are in their logical order."""
        return self.value[-3:] == (_DIM_H, _DIM_N, _DIM_C)

    @property
    def is_block_compact(self) -> bool:
        """One layer's page of one block is one run of bytes: ``L`` and ``B`` are the two
        outermost axes (in either order)."""
        return set(self.value[:2]) == {_DIM_L, _DIM_B}

    @property
    def is_block_outermost(self) -> bool:
        """A block of every layer is one run: ``B`` is the outermost axis."""
        return self.value[0] == _DIM_B


__all__ = ["KVCacheLayout"]
