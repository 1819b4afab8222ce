"""Configuration records (vLLM: ``vllm/config/``): ``kv_transfer.KVTransferConfig``,
``attention.HiSparseConfig``."""
