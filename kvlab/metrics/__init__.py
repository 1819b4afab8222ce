"""Statistics with vLLM's names (``vllm/v1/metrics/``): prefix-cache and scheduler stats."""
