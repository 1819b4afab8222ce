"""The scheduler, its output and its waiting queues (``vllm/v1/core/sched/``)."""
