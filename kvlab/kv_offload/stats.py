"""The offloading connector's telemetry (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py``, which re-exports it;
it lives here, beside the offload managers that fill it, so that ``kvlab.kv_offload`` needs
nothing from ``kvlab.distributed``).

One self-describing payload, :class:`OffloadingConnectorStats`, carries every metric under its
Prometheus name: its type (counter, gauge or histogram) in ``data["types"]`` and its values in
``data["data"]``, keyed by the tuple of label values (``()`` for an unlabelled metric), plus
the static configuration facts in ``data["info"]``. Counters add up when payloads merge,
gauges keep the latest value, histograms keep every sample. Because the types travel with
the values, the receiving process needs no metric definitions to merge or reduce a payload.

Who fills it: the worker reports the bytes and time of each transfer it finished
(``vllm:kv_offload_load_*``, ``vllm:kv_offload_store_*``); the connector's scheduler half
adds its lookups' durations and the stores the offload manager could not allocate; the
offload manager adds its own gauges (``CPUOffloadingManager.get_stats``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.metrics.kv_connector_stats import KVConnectorStats
from kvlab.kv_offload.base import (
    ConfigInfoMapping,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

KV_OFFLOAD_CONFIG_INFO = "vllm:kv_offload_config_info"


class _TransferMetricName:
    """GPU <-> offload-medium transfers."""

    LOAD_BYTES = "vllm:kv_offload_load_bytes"
    LOAD_TIME = "vllm:kv_offload_load_time"
    LOAD_SIZE = "vllm:kv_offload_load_size"
    STORE_BYTES = "vllm:kv_offload_store_bytes"
    STORE_TIME = "vllm:kv_offload_store_time"
    STORE_SIZE = "vllm:kv_offload_store_size"


class _ConnectorMetricName:
    """What the connector's scheduler half records."""

    LOOKUP_SYNC_DELAY = "vllm:kv_offload_lookup_sync_delay_seconds"
    LOOKUP_ASYNC_DELAY = "vllm:kv_offload_lookup_async_delay_seconds"
    ALLOCATION_FAILURE = "vllm:kv_offload_allocation_failure"


class _TransferType:
    """The ``transfer_type`` label of the older, per-direction transfer metrics."""

    LOAD = "CPU_to_GPU"
    STORE = "GPU_to_CPU"
    ALL = (LOAD, STORE)


#: Bytes: the transfer-size histograms' buckets, 1 MB to 200 MB (vLLM 0.33's).
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


def get_connector_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics the connector itself reports, whatever its backend: transfers (the
    worker) and lookups and failed allocations (the scheduler half). A backend adds its own
    (``OffloadingSpec.build_metric_definitions``)."""
    return {
        _TransferMetricName.LOAD_BYTES: OffloadingCounterMetadata("Bytes copied from an offload tier into the GPU pool."),
        _TransferMetricName.LOAD_TIME: OffloadingCounterMetadata("Seconds spent copying from an offload tier into the GPU pool."),
        _TransferMetricName.LOAD_SIZE: OffloadingHistogramMetadata("Bytes per load job.", buckets=TRANSFER_SIZE_BUCKETS),
        _TransferMetricName.STORE_BYTES: OffloadingCounterMetadata("Bytes copied from the GPU pool to an offload tier."),
        _TransferMetricName.STORE_TIME: OffloadingCounterMetadata("Seconds spent copying from the GPU pool to an offload tier."),
        _TransferMetricName.STORE_SIZE: OffloadingHistogramMetadata("Bytes per store job.", buckets=TRANSFER_SIZE_BUCKETS),
        _ConnectorMetricName.LOOKUP_SYNC_DELAY: OffloadingHistogramMetadata(
            "Seconds one lookup of a request's blocks in the tiers took.",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1),
        ),
        _ConnectorMetricName.LOOKUP_ASYNC_DELAY: OffloadingHistogramMetadata(
            "Seconds from a lookup that had to wait for a tier to the lookup that answered (or the request's end).",
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 10),
        ),
        _ConnectorMetricName.ALLOCATION_FAILURE: OffloadingCounterMetadata("Stores the tiers found no room for."),
    }


# The older transfer metrics, one series per direction (``transfer_type``), still fed from
# the same payload while users move to the names above.
_DEPRECATED_TOTAL_BYTES = "vllm:kv_offload_total_bytes"
_DEPRECATED_TOTAL_TIME = "vllm:kv_offload_total_time"
_DEPRECATED_SIZE = "vllm:kv_offload_size"
_DEPRECATED_CONNECTOR_METRIC_DEFINITIONS: dict[str, OffloadingMetricMetadata] = {
    _DEPRECATED_TOTAL_BYTES: OffloadingCounterMetadata("Bytes moved between the GPU pool and the CPU tier, per direction."),
    _DEPRECATED_TOTAL_TIME: OffloadingCounterMetadata("Seconds spent moving bytes between the GPU pool and the CPU tier, per direction."),
    _DEPRECATED_SIZE: OffloadingHistogramMetadata("Bytes per transfer, per direction.", buckets=TRANSFER_SIZE_BUCKETS),
}


class _MetricType:
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class _StatsKey:
    TYPES = "types"  # metric name -> _MetricType
    DATA = "data"  # metric name -> {label values: value (a number, or a list for a histogram)}
    INFO = "info"  # one {label name: value} per configuration series, or None


@dataclass
class OffloadingConnectorStats(KVConnectorStats):
    """The offloading connector's payload (see the module doc for its layout)."""

    def __post_init__(self) -> None:
        if _StatsKey.DATA not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {_StatsKey.TYPES: {}, _StatsKey.DATA: {}, _StatsKey.INFO: None}

    @property
    def _types(self) -> dict[str, str]:
        return self.data[_StatsKey.TYPES]

    @property
    def _values(self) -> dict[str, Any]:
        return self.data[_StatsKey.DATA]

    def metric_sections(self) -> tuple[dict[str, Any], ...]:
        """The type section and the value section, in that order (live references)."""
        return (self._types, self._values)

    def aggregate(self, other: KVConnectorStats) -> OffloadingConnectorStats:
        """Merge ``other`` into this payload (returned): counters add, gauges take ``other``'s
        value, histograms append its samples, and ``other``'s info -- the scheduler sends it
        once -- replaces this one's only when it has some."""
        if other.is_empty():
            return self
        if not isinstance(other, OffloadingConnectorStats):
            raise TypeError(f"can only aggregate an OffloadingConnectorStats, got {type(other).__name__}")
        other_info = other.data.get(_StatsKey.INFO)
        if other_info is not None:
            self.data[_StatsKey.INFO] = [dict(series) for series in other_info]
        for key, label_values in other._values.items():
            type_str = other._types.get(key)
            if type_str is None:
                raise AssertionError(f"Unknown offloading stats key: {key}")
            self._types.setdefault(key, type_str)
            mine = self._values.setdefault(key, {})
            for labels, value in label_values.items():
                if type_str == _MetricType.HISTOGRAM:
                    mine.setdefault(labels, []).extend(value)
                elif type_str == _MetricType.COUNTER:
                    mine[labels] = mine.get(labels, 0) + value
                elif type_str == _MetricType.GAUGE:
                    mine[labels] = value
                else:
                    raise AssertionError(f"Unknown metric type '{type_str}' for key: {key}")
        return self

    def reduce(self) -> dict[str, int | float]:
        """One number per counter and gauge series, a ``_count`` and a ``_sum`` per histogram
        series; a labelled series is named ``"name:(label values)"``. The info is left out."""
        out: dict[str, int | float] = {}
        for key, label_values in self._values.items():
            type_str = self._types.get(key)
            if type_str is None:
                raise AssertionError(f"Unknown offloading stats key: {key}")
            for labels, value in label_values.items():
                name = f"{key}:{labels}" if labels else key
                if type_str == _MetricType.HISTOGRAM:
                    out[f"{name}_count"] = len(value)
                    out[f"{name}_sum"] = sum(value)
                elif type_str in (_MetricType.COUNTER, _MetricType.GAUGE):
                    out[name] = value
                else:
                    raise AssertionError(f"Unknown metric type '{type_str}' for key: {key}")
        return out

    def is_empty(self) -> bool:
        """No observation and no info (an info-only payload is not empty: it must reach the
        metrics frontend)."""
        return not self.data.get(_StatsKey.DATA) and self.data.get(_StatsKey.INFO) is None

    def increase_counter(self, counter_name: str, counter_increase_value: int | float = 1, labelvalues: tuple[str, ...] = ()) -> None:
        self._types.setdefault(counter_name, _MetricType.COUNTER)
        values = self._values.setdefault(counter_name, {})
        values[labelvalues] = values.get(labelvalues, 0) + counter_increase_value

    def set_gauge(self, gauge_name: str, gauge_value: int | float, labelvalues: tuple[str, ...] = ()) -> None:
        self._types.setdefault(gauge_name, _MetricType.GAUGE)
        self._values.setdefault(gauge_name, {})[labelvalues] = gauge_value

    def observe_histogram(self, histogram_name: str, histogram_value: int | float, labelvalues: tuple[str, ...] = ()) -> None:
        self._types.setdefault(histogram_name, _MetricType.HISTOGRAM)
        self._values.setdefault(histogram_name, {}).setdefault(labelvalues, []).append(histogram_value)

    def set_info(self, info: Sequence[ConfigInfoMapping]) -> None:
        """The engine's static offload configuration, one mapping per series (as the
        manager's ``config_info()`` returns it)."""
        self.data[_StatsKey.INFO] = [dict(series) for series in info]
