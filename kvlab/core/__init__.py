"""The KV-cache core: blocks, the pool, per-group managers, the manager (``vllm/v1/core/``).

Pure Python and the standard library only: no torch, no widgets. ``sched/`` holds the
scheduler, as ``vllm/v1/core/sched/`` does.
"""
