"""The engine loop and its simulated clock (``vllm/v1/engine/``)."""
