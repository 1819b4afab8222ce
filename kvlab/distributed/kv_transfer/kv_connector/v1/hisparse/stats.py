"""HiSparse's telemetry payload (vLLM 0.33: ``HiSparseKVConnectorStats`` in
``vllm/distributed/kv_transfer/kv_connector/v1/hisparse/stats.py``).

Two kinds of numbers ride in it. Counts over an interval -- hot-buffer hits and misses,
bytes copied from host to device (the worker's, which kvlab does not build), and each host
block's residency that ended (its lifetime, how long it sat idle before eviction, the gaps
between its reuses) -- add up when payloads merge. Levels -- how full the host pool is, how
many page write-backs are in flight -- do not: a merge keeps the newest observation, since
the sum of two fill levels means nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvlab.metrics.kv_connector_stats import KVConnectorStats

#: The keys that hold a level (the last observation wins), not a count.
LEVEL_KEYS = frozenset({"host_cache_usage_perc", "pending_page_transfers"})
_KEYS = (
    "cache_hits",
    "cache_misses",
    "host_to_device_bytes",
    "host_cache_usage_perc",
    "pending_page_transfers",
    "host_block_lifetime_seconds",
    "host_block_idle_before_evict_seconds",
    "host_block_reuse_gap_seconds",
)


@dataclass
class HiSparseKVConnectorStats(KVConnectorStats):
    """One list per key, of plain numbers (the payload crosses processes)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {key: [] for key in _KEYS}

    def record_snapshot(self, hits: int, misses: int, host_to_device_bytes: int) -> None:
        """One interval of the worker's hot-buffer counters."""
        self.data["cache_hits"].append(hits)
        self.data["cache_misses"].append(misses)
        self.data["host_to_device_bytes"].append(host_to_device_bytes)

    def record_host_usage(self, usage: float, pending_page_transfers: int) -> None:
        """The host pool's fill level (0-1, the null block not counted) and the write-backs in flight."""
        self.data["host_cache_usage_perc"].append(usage)
        self.data["pending_page_transfers"].append(pending_page_transfers)

    def record_host_evictions(self, events: Iterable[Any]) -> None:
        """Sampled host-block residencies that ended (``KVCacheEvictionEvent``s)."""
        for e in events:
            self.data["host_block_lifetime_seconds"].append(e.lifetime_seconds)
            self.data["host_block_idle_before_evict_seconds"].append(e.idle_seconds)
            self.data["host_block_reuse_gap_seconds"].extend(e.reuse_gaps_seconds)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        for key, values in other.data.items():
            if key not in self.data:
                raise ValueError(f"a HiSparse payload has no key {key!r}; known: {list(_KEYS)}")
            self.data[key].extend(values[-1:] if key in LEVEL_KEYS else values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "HiSparse hot-buffer hits": sum(self.data["cache_hits"]),
            "HiSparse hot-buffer misses": sum(self.data["cache_misses"]),
            "HiSparse host-to-device bytes": sum(self.data["host_to_device_bytes"]),
        }
        usage = self.data["host_cache_usage_perc"]
        if usage:
            out["HiSparse host KV cache usage %"] = round(100 * usage[-1], 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())
