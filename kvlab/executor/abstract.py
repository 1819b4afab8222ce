"""What the engine needs from whatever computes the tokens.

vLLM: ``vllm/v1/executor/abstract.py``. kvlab has two executors: the
:class:`~kvlab.executor.simulated.SimulatedExecutor` (no model) and the real
:class:`~kvlab.worker.model_runner.ModelRunner` (tiny model + Triton kernels).
"""

from __future__ import annotations

from typing import Protocol

from kvlab.core.sched.output import SchedulerOutput


class Executor(Protocol):
    """``execute_model`` is all it must have. ``writes_kv_cache`` (optional, default True):
    whether it writes K/V into the cache blocks -- when the engine undoes a step the
    executor took part in, blocks that step handed out may hold new values, so if they
    are cached again after the undo their cache entries are dropped."""

    writes_kv_cache: bool

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """Compute the scheduled tokens; return one sampled token for each request whose
        known tokens are all computed after this step (partial prefills get none)."""
        ...
