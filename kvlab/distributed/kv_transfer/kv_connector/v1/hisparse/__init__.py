"""HiSparse's connector (vLLM 0.33: ``vllm/distributed/kv_transfer/kv_connector/v1/hisparse/``)."""
