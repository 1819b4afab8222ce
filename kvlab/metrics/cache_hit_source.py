"""Where a cached prompt token's keys and values came from (vLLM 0.33:
``vllm/v1/metrics/cache_hit_source.py``).

The members run outward from the accelerator, in the order a block travels when it is
offloaded: the GPU's own prefix cache, host memory, a peer, a disk. A request whose hits
came from several places is reported by the farthest one (``outermost``), so a mix of a
known tier and an unknown one never passes for the known one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class CacheHitSource(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    #: A connector or store that does not say (last, so it wins any mix).
    EXTERNAL_UNSPECIFIED = "external_unspecified"

    @classmethod
    def outermost(cls, sources: Iterable[CacheHitSource]) -> CacheHitSource:
        """The source in ``sources`` farthest from the accelerator (ValueError when empty)."""
        order = list(cls)
        return max(sources, key=order.index)
