"""The P2P tier's sessions, one per peer (vLLM 0.33: ``vllm/v1/kv_offload/tiering/p2p/session/``).
kvlab has their wire protocol (:mod:`.protocol`) and the client role (:mod:`.client`); the
server role and the session that joins the two are not built."""
