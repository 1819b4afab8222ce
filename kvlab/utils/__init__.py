"""Small shared helpers (``vllm/utils/``): hash functions by name."""
