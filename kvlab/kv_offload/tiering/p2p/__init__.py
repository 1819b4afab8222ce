"""vLLM 0.33's peer-to-peer tier (``vllm/v1/kv_offload/tiering/p2p/``): engines fetch each
other's offloaded KV. kvlab has its control channel (:mod:`.control`) so far; the sessions,
the data path and the tier manager are not built."""
