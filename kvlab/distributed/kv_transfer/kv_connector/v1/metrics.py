"""A KV connector's telemetry on the frontend (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``).

The payload itself, :class:`~kvlab.metrics.kv_connector_stats.KVConnectorStats`, lives with
the engine's other metrics (the offload tiers fill it and need nothing from here). What is
here turns the payloads the engine sends into output: :class:`KVConnectorLogging` sums an
interval's payloads into one log line, :class:`KVConnectorProm` asks the connector class
for its Prometheus metrics (``build_prom_metrics``) and feeds them every payload.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvlab.logger import init_logger
from kvlab.metrics.kv_connector_stats import KVConnectorStats

__all__ = ["KVConnectorLogging", "KVConnectorProm", "KVConnectorPromMetrics", "KVConnectorStats"]

logger = init_logger(__name__)


def _connector_class(kv_transfer_config: Any) -> Any:
    """The configured connector's class, from the factory. The factory sits above this
    package (it imports the connectors defined here), so it is looked up when asked for."""
    factory = importlib.import_module("kvlab.distributed.kv_transfer.kv_connector.factory")
    return factory.KVConnectorFactory.get_connector_class(kv_transfer_config)


class KVConnectorLogging:
    """Adds up the payloads of one logging interval and writes them as one line."""

    def __init__(self, kv_transfer_config: Any) -> None:
        self.connector_cls: Any = None
        if kv_transfer_config is not None and kv_transfer_config.kv_connector:
            self.connector_cls = _connector_class(kv_transfer_config)
        self.reset()

    def reset(self) -> None:
        self.transfer_stats_accumulator: KVConnectorStats | None = None

    def observe(self, transfer_stats_data: dict[str, Any]) -> None:
        """One payload (every worker's, merged) as the engine sent it."""
        if self.connector_cls is None:
            raise RuntimeError("KVConnectorLogging.observe: no KV connector is configured")
        stats = self.connector_cls.build_kv_connector_stats(transfer_stats_data)
        if stats is None:
            logger.warning_once("%s reports stats but cannot rebuild them (build_kv_connector_stats): not logged", self.connector_cls)
            return
        acc = self.transfer_stats_accumulator
        self.transfer_stats_accumulator = stats if acc is None else acc.aggregate(stats)

    def log(self, log_fn: Callable[..., Any] = logger.info) -> None:
        """Write the interval's numbers (``reduce``) and start a new interval. A payload of
        configuration facts alone reduces to nothing: no line then."""
        acc = self.transfer_stats_accumulator
        if acc is None or acc.is_empty():
            return
        numbers = acc.reduce()
        if numbers:
            log_fn("KV Transfer metrics: %s", ", ".join(f"{k}={v}" for k, v in numbers.items()))
        self.reset()


class KVConnectorPromMetrics:
    """A connector's Prometheus metrics (subclassed per connector). ``metric_types`` maps
    prometheus_client's ``Gauge``, ``Counter`` and ``Histogram`` to the classes to build
    (the frontend's own, e.g. bound to a registry); every series carries ``labelnames``,
    with each engine's values in ``per_engine_labelvalues``."""

    def __init__(
        self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]
    ) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        raise NotImplementedError


class KVConnectorProm:
    """The frontend's side: the configured connector's Prometheus metrics, fed every payload."""

    def __init__(self, vllm_config: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[Any]]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.prom_metrics: KVConnectorPromMetrics | None = None
        transfer = vllm_config.kv_transfer_config
        if transfer is not None and transfer.kv_connector:
            connector_cls = _connector_class(transfer)
            build = getattr(connector_cls, "build_prom_metrics", None)
            if build is not None:
                types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
                self.prom_metrics = build(vllm_config, types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if self.prom_metrics is not None:
            self.prom_metrics.observe(transfer_stats_data, engine_idx)
