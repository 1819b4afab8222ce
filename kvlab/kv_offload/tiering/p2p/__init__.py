"""vLLM 0.33's peer-to-peer tier (``vllm/v1/kv_offload/tiering/p2p/``): engines fetch each
other's offloaded KV. The tier (:mod:`.manager`, registered as ``"p2p"``) holds one session
per peer (:mod:`.session`: wire protocol, client and server roles), talks over the control
channel (:mod:`.control`, ZeroMQ) and moves the bytes over the data path (:mod:`.data`, NIXL)."""
