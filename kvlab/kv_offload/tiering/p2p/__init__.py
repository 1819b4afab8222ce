"""vLLM 0.33's peer-to-peer tier (``vllm/v1/kv_offload/tiering/p2p/``): engines fetch each
other's offloaded KV. kvlab has its control channel (:mod:`.control`, ZeroMQ), its data path
(:mod:`.data`, NIXL), its sessions' wire protocol and their client role (:mod:`.session`) so
far; the server role, the session that joins the roles and the tier manager are not built."""
