"""vLLM 0.33's peer-to-peer tier (``vllm/v1/kv_offload/tiering/p2p/``): engines fetch each
other's offloaded KV. kvlab has its control channel (:mod:`.control`, ZeroMQ), its data path
(:mod:`.data`, NIXL) and its sessions' wire protocol (:mod:`.session.protocol`) so far; the
sessions themselves and the tier manager are not built."""
