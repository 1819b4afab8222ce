"""The offloading connector's telemetry (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py``).

The payload and the metric names live in :mod:`kvlab.kv_offload.stats`, beside the offload
managers that fill it. Here is the frontend's end: :class:`OffloadPromMetrics` declares every
metric the connector and its backend can report (the backend's own come from its spec
class, ``build_metric_definitions``) and turns each payload into Prometheus samples --
counters incremented, gauges set, histogram samples observed, per engine. A labelled metric
gets a series per label values the first time they are seen. The static configuration facts
(``vllm:kv_offload_config_info``) become one gauge pinned to 1 per series, the facts in its
labels: the spec declares the label names at start-up, a payload fills them by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from kvlab.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)
from kvlab.kv_offload.cpu.spec import CPUOffloadingSpec
from kvlab.kv_offload.factory import OffloadingSpecFactory
from kvlab.kv_offload.stats import (
    _DEPRECATED_CONNECTOR_METRIC_DEFINITIONS,
    _DEPRECATED_SIZE,
    _DEPRECATED_TOTAL_BYTES,
    _DEPRECATED_TOTAL_TIME,
    KV_OFFLOAD_CONFIG_INFO,
    TRANSFER_SIZE_BUCKETS,
    OffloadingConnectorStats,
    _ConnectorMetricName,
    _MetricType,
    _StatsKey,
    _TransferMetricName,
    _TransferType,
    get_connector_metric_definitions,
)
from kvlab.logger import init_logger

__all__ = [
    "KV_OFFLOAD_CONFIG_INFO",
    "TRANSFER_SIZE_BUCKETS",
    "OffloadPromMetrics",
    "OffloadingConnectorStats",
    "_ConnectorMetricName",
    "_MetricType",
    "_StatsKey",
    "_TransferMetricName",
    "_TransferType",
    "get_connector_metric_definitions",
]

logger = init_logger(__name__)

_INFO_HELP = "The engine's KV offload configuration, one series per tier or source, the facts in its labels (the value is 1)."

# flat transfer metric -> (the older per-direction metric it also feeds, its direction)
_DEPRECATED_TWIN = {
    _TransferMetricName.LOAD_BYTES: ("bytes", _TransferType.LOAD),
    _TransferMetricName.LOAD_TIME: ("time", _TransferType.LOAD),
    _TransferMetricName.LOAD_SIZE: ("size", _TransferType.LOAD),
    _TransferMetricName.STORE_BYTES: ("bytes", _TransferType.STORE),
    _TransferMetricName.STORE_TIME: ("time", _TransferType.STORE),
    _TransferMetricName.STORE_SIZE: ("size", _TransferType.STORE),
}


class OffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
        self._info_keys: tuple[str, ...] = tuple(self._spec_cls.config_info_keys(extra))
        self._offloading_metric_metadata: dict[str, OffloadingMetricMetadata] = {
            **self._spec_cls.build_metric_definitions(extra),
            **get_connector_metric_definitions(),
            KV_OFFLOAD_CONFIG_INFO: OffloadingGaugeMetadata(_INFO_HELP, labelnames=self._info_keys),
        }
        # The CPU backend also feeds the older per-direction metrics (unlabelled samples only).
        self._observe_deprecated_metrics = issubclass(self._spec_cls, CPUOffloadingSpec)
        directed = labelnames + ["transfer_type"]
        meta = _DEPRECATED_CONNECTOR_METRIC_DEFINITIONS
        size_meta = meta[_DEPRECATED_SIZE]
        assert isinstance(size_meta, OffloadingHistogramMetadata)
        self._counter_kv_bytes = self._counter_cls(
            name=_DEPRECATED_TOTAL_BYTES, documentation=meta[_DEPRECATED_TOTAL_BYTES].documentation, labelnames=directed
        )
        self._counter_kv_transfer_time = self._counter_cls(
            name=_DEPRECATED_TOTAL_TIME, documentation=meta[_DEPRECATED_TOTAL_TIME].documentation, labelnames=directed
        )
        self._histogram_transfer_size = self._histogram_cls(
            name=_DEPRECATED_SIZE, documentation=size_meta.documentation, buckets=size_meta.buckets, labelnames=directed
        )
        # (engine, direction) -> the older metrics' series
        self.counter_kv_bytes: dict[tuple[int, str], Any] = {}
        self.counter_kv_transfer_time: dict[tuple[int, str], Any] = {}
        self.histogram_transfer_size: dict[tuple[int, str], Any] = {}
        for engine_idx, values in per_engine_labelvalues.items():
            for direction in _TransferType.ALL:
                labels = [*values, direction]
                self.counter_kv_bytes[(engine_idx, direction)] = self._counter_kv_bytes.labels(*labels)
                self.counter_kv_transfer_time[(engine_idx, direction)] = self._counter_kv_transfer_time.labels(*labels)
                self.histogram_transfer_size[(engine_idx, direction)] = self._histogram_transfer_size.labels(*labels)
        # flat metric name -> (engine, direction) -> the older metric's series it also feeds
        tables = {"bytes": self.counter_kv_bytes, "time": self.counter_kv_transfer_time, "size": self.histogram_transfer_size}
        self._twin_tables = {name: (tables[kind], direction) for name, (kind, direction) in _DEPRECATED_TWIN.items()}
        self._offloading_metric_defs = {name: self._create_metric(name, md) for name, md in self._offloading_metric_metadata.items()}
        # (engine, metric name, label values) -> the series, made when first observed
        self.offloading_metrics: dict[tuple[int, str, tuple[str, ...]], Any] = {}

    def _create_metric(self, metric_name: str, metadata: OffloadingMetricMetadata) -> Any:
        kwargs: dict[str, Any] = {
            "name": metric_name,
            "documentation": metadata.documentation,
            "labelnames": self._labelnames + list(metadata.labelnames),
        }
        if isinstance(metadata, OffloadingCounterMetadata):
            return self._counter_cls(**kwargs)
        if isinstance(metadata, OffloadingGaugeMetadata):  # only a gauge takes a multiprocess mode
            return self._gauge_cls(**kwargs, multiprocess_mode=metadata.multiprocess_mode)
        if isinstance(metadata, OffloadingHistogramMetadata):
            if metadata.buckets is not None:
                kwargs["buckets"] = metadata.buckets
            return self._histogram_cls(**kwargs)
        raise AssertionError(f"Unknown offloading metric metadata: {metadata}")

    def _series(self, metric_name: str, labelvalues: tuple[str, ...], engine_idx: int) -> Any:
        expected = len(self._offloading_metric_metadata[metric_name].labelnames)
        if len(labelvalues) != expected:
            raise AssertionError(f"Metric {metric_name} expects {expected} labels, got {len(labelvalues)}")
        key = (engine_idx, metric_name, labelvalues)
        series = self.offloading_metrics.get(key)
        if series is None:
            engine_values = self.per_engine_labelvalues[engine_idx]
            series = self.offloading_metrics[key] = self._offloading_metric_defs[metric_name].labels(*engine_values, *labelvalues)
        return series

    def _deprecated_twin(self, metric_name: str, labelvalues: tuple[str, ...], engine_idx: int) -> Any:
        twin = self._twin_tables.get(metric_name)
        if twin is None or labelvalues or not self._observe_deprecated_metrics:
            return None
        table, direction = twin
        return table[(engine_idx, direction)]

    def _observe_info(self, info: Sequence[dict[str, Any]], engine_idx: int) -> None:
        """One series per mapping, each value a label by its name (a manager may order its
        mapping as it likes). A declared name no mapping fills reads empty; a filled name the
        spec did not declare is dropped (a metric's label names are fixed); either is logged
        once. A name one series fills and another does not is normal (each tier its own)."""
        filled: dict[str, None] = {}
        for series in info:
            filled.update(dict.fromkeys(series))
            values = tuple(str(series.get(k, "")) for k in self._info_keys)
            self._series(KV_OFFLOAD_CONFIG_INFO, values, engine_idx).set(1)
        empty = tuple(k for k in self._info_keys if k not in filled)
        dropped = tuple(k for k in filled if k not in self._info_keys)
        if empty or dropped:
            logger.warning_once(
                "%s: the spec %s and engine %d's offload manager disagree on its labels; declared but never filled "
                "(empty on every series): %s; filled but not declared (dropped): %s",
                KV_OFFLOAD_CONFIG_INFO,
                self._spec_cls.__name__,
                engine_idx,
                empty,
                dropped,
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one payload (``OffloadingConnectorStats.data``) of engine ``engine_idx``."""
        info = transfer_stats_data.get(_StatsKey.INFO)
        if info is not None:
            self._observe_info(info, engine_idx)
        types = transfer_stats_data.get(_StatsKey.TYPES, {})
        for name, by_labels in transfer_stats_data.get(_StatsKey.DATA, {}).items():
            kind = types.get(name)
            if kind is None:
                raise AssertionError(f"Unknown offloading stats key: {name}")
            if name not in self._offloading_metric_defs:
                raise AssertionError(f"{name} was never declared: neither the connector nor the backend spec defines it")
            for labels, value in by_labels.items():
                series, twin = self._series(name, labels, engine_idx), self._deprecated_twin(name, labels, engine_idx)
                if kind == _MetricType.COUNTER:
                    series.inc(value)
                    if twin is not None:
                        twin.inc(value)
                elif kind == _MetricType.GAUGE:
                    series.set(value)
                elif kind == _MetricType.HISTOGRAM:
                    for sample in value:
                        series.observe(sample)
                        if twin is not None:
                            twin.observe(sample)
                else:
                    raise AssertionError(f"Unknown metric type '{kind}' for key: {name}")
