"""The model side (``vllm/v1/worker/``): the paged model runner, the tiny model, the tokenizer.

Imports torch and the Triton kernels; nothing in ``kvlab.core`` imports this package.
"""
