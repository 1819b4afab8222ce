"""Executors: what turns a ``SchedulerOutput`` into sampled tokens (``vllm/v1/executor/``)."""
