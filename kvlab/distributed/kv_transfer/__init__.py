"""Moving KV between engines and tiers (vLLM: ``vllm/distributed/kv_transfer/``; lessons 12-13).

``kv_connector/v1/base.py`` is the connector interface (``KVConnectorBase_V1``): a
scheduler-side half that decides what to load and save, and a worker-side half that moves
the bytes. ``kv_connector/v1/offloading_connector.py`` backs the GPU pool with CPU and disk
tiers (``kvlab.kv_offload``); ``kv_connector/v1/example_connector.py`` saves a prompt's KV to
files that another engine loads (disaggregated prefill: ``kvlab.entrypoints.disagg_prefill``). The core never
imports this package: the scheduler only calls the hooks of the object it is given.
"""
