"""A base for test connectors: every hook does nothing (no tokens from elsewhere, nothing to
save), so a test overrides only the hooks it is about. The worker hooks are never called:
the tests run a model-free executor."""

from __future__ import annotations

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class SchedulerSideConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def start_load_kv(self, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self, skip_req_ids=frozenset()):
        pass
