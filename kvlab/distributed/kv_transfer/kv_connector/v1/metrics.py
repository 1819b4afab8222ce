"""A KV connector's telemetry at vLLM 0.33's path
(``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``); the code lives in
:mod:`kvlab.metrics.kv_connector_stats`."""

from kvlab.metrics.kv_connector_stats import KVConnectorStats

__all__ = ["KVConnectorStats"]
