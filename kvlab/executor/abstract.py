"""What the engine needs from whatever computes the tokens.

vLLM: ``vllm/v1/executor/abstract.py``. kvlab has two executors: the
:class:`~kvlab.executor.simulated.SimulatedExecutor` (no model) and the real
:class:`~kvlab.worker.model_runner.ModelRunner` (tiny model + Triton kernels).
"""
from __future__ import annotations

from typing import Protocol

from kvlab.core.sched.output import SchedulerOutput


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """Compute the scheduled tokens; return one sampled token for each request whose
        known tokens are all computed after this step (partial prefills get none)."""
        ...
