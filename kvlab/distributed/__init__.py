"""vLLM's ``vllm/distributed``: the KV cache event stream (``kv_events``)."""
