"""The offloading connector's telemetry at vLLM 0.33's path
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py``); the code lives in
:mod:`kvlab.kv_offload.stats`."""

from kvlab.kv_offload.stats import (
    KV_OFFLOAD_CONFIG_INFO,
    OffloadingConnectorStats,
    _ConnectorMetricName,
    _MetricType,
    _StatsKey,
    _TransferMetricName,
)

__all__ = [
    "KV_OFFLOAD_CONFIG_INFO",
    "OffloadingConnectorStats",
    "_ConnectorMetricName",
    "_MetricType",
    "_StatsKey",
    "_TransferMetricName",
]
