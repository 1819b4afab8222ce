"""The V1 connector API (vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/``)."""

from kvlab.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole"]
