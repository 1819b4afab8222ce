"""What vLLM 0.33 measures about NIXL transfers (vLLM: ``NixlKVConnectorStats`` in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py``). Only the payload: kvlab has
no NIXL transport (see the package's docstring).

A decode engine pulls a request's KV from the prefill engine's GPU in one NIXL transfer per
request (and remote rank). Each finished transfer appends one entry to four parallel lists --
``transfer_duration`` and ``post_duration`` in seconds (NIXL reports microseconds),
``bytes_transferred``, ``num_descriptors`` (one per contiguous region copied) -- so the
number of successful transfers is the length of any of them. Failures append a 1 to their
own list, so that merging two payloads is list concatenation and counting is ``len``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.metrics.kv_connector_stats import KVConnectorStats

#: The timing lists: one entry per successful transfer, in step with each other.
_TRANSFER_KEYS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
#: The failure lists: a 1 per event.
_FAILURE_KEYS = (
    "num_failed_transfers",
    "num_failed_notifications",
    "num_failed_handshakes",
    "num_kv_expired_reqs",
    "num_notifications_after_expiry",
)


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between the two nearest ranks (what
    ``numpy.percentile`` computes by default), as a plain float."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


@dataclass
class NixlKVConnectorStats(KVConnectorStats):
    """One list per measurement, of plain numbers: the payload crosses from the workers to the
    frontend that logs it, so it holds nothing that does not serialise."""

    def __post_init__(self) -> None:
        if not self.data:  # built empty: start every list
            self.reset()

    def reset(self) -> None:
        self.data = {key: [] for key in (*_TRANSFER_KEYS, *_FAILURE_KEYS)}

    def record_transfer(self, res: Any) -> None:
        """One finished transfer's telemetry (NIXL's ``nixlXferTelemetry``: ``xferDuration``
        and ``postDuration`` in microseconds, ``totalBytes``, ``descCount``); None, when NIXL
        reported none, records nothing. Times are kept in seconds, like every other duration
        vLLM reports."""
        if res is None:
            return
        self.data["transfer_duration"].append(res.xferDuration / 1e6)
        self.data["post_duration"].append(res.postDuration / 1e6)
        self.data["bytes_transferred"].append(res.totalBytes)
        self.data["num_descriptors"].append(res.descCount)

    def record_failed_transfer(self) -> None:
        self.data["num_failed_transfers"].append(1)

    def record_failed_notification(self) -> None:
        """The reader could not tell the prefill engine it is done with the blocks."""
        self.data["num_failed_notifications"].append(1)

    def record_failed_handshake(self) -> None:
        self.data["num_failed_handshakes"].append(1)

    def record_kv_expired_req(self) -> None:
        """The prefill engine freed a request's blocks before any reader came for them."""
        self.data["num_kv_expired_reqs"].append(1)

    def record_notification_after_expiry(self) -> None:
        """A reader's "done" arrived for a request already expired: its blocks may have been
        reused while it read them."""
        self.data["num_notifications_after_expiry"].append(1)

    def clone_and_reset(self) -> NixlKVConnectorStats:
        """This interval's payload to send, and an empty one to go on recording in."""
        old = copy.copy(self)  # shares the lists, which reset() replaces rather than clears
        self.reset()
        return old

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])

    def is_empty(self) -> bool:
        """Nothing transferred and nothing failed: an interval of failures alone still counts,
        so that it is logged."""
        return self.num_successful_transfers == 0 and not any(self.data[key] for key in _FAILURE_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Append ``other``'s entries to this payload's lists (in place; returns self)."""
        if not other.is_empty():
            for key, values in other.data.items():
                self.data[key].extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's transfers as a log line's numbers (times in ms, sizes in MB), plain
        Python numbers so the line reads ``1500.0``, not a NumPy repr. The failure counts
        come every time: transport failures (transfers, handshakes, notifications) together,
        expired requests and late notifications apart, since they mean something else (a
        prefill engine waiting too long for its readers)."""
        failures: dict[str, int | float] = {
            "Num failed transfers": sum(
                len(self.data[k]) for k in ("num_failed_transfers", "num_failed_handshakes", "num_failed_notifications")
            ),
            "Num KV expired reqs": len(self.data["num_kv_expired_reqs"]),
            "Num notifs after expiry": len(self.data["num_notifications_after_expiry"]),
        }
        n = self.num_successful_transfers
        if n == 0:  # the timings describe successful transfers only
            zeros: dict[str, int | float] = dict.fromkeys(
                (
                    "Num successful transfers",
                    "Avg xfer time (ms)",
                    "P90 xfer time (ms)",
                    "Avg post time (ms)",
                    "P90 post time (ms)",
                    "Avg MB per transfer",
                    "Throughput (MB/s)",
                    "Avg number of descriptors",
                ),
                0,
            )
            return {**zeros, **failures}
        lengths = {key: len(self.data[key]) for key in _TRANSFER_KEYS}
        if set(lengths.values()) != {n}:
            raise ValueError(f"NixlKVConnectorStats: the per-transfer lists must have one entry per transfer, got lengths {lengths}")
        xfer = [float(t) for t in self.data["transfer_duration"]]
        post = [float(t) for t in self.data["post_duration"]]
        total_mb = sum(self.data["bytes_transferred"]) / 2**20
        total_s = sum(xfer)
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(sum(xfer) / n * 1e3, 3),
            "P90 xfer time (ms)": round(_percentile(xfer, 90) * 1e3, 3),
            "Avg post time (ms)": round(sum(post) / n * 1e3, 3),
            "P90 post time (ms)": round(_percentile(post, 90) * 1e3, 3),
            "Avg MB per transfer": round(total_mb / n, 3),
            "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s else math.inf,
            "Avg number of descriptors": round(sum(self.data["num_descriptors"]) / n, 1),
            **failures,
        }
