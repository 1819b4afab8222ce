"""A base for test connectors that only have a scheduler side: the worker hooks do nothing
(the tests run a model-free executor)."""

from __future__ import annotations

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


class SchedulerSideConnector(KVConnectorBase_V1):
    def start_load_kv(self, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self, skip_req_ids=frozenset()):
        pass
