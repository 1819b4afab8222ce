"""KV connectors (vLLM: ``vllm/distributed/kv_transfer/kv_connector/``): ``v1/`` and the factory."""
