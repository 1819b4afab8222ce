"""What the worker hands back to the scheduler besides sampled tokens (vLLM: ``vllm/v1/outputs.py``).

vLLM's ``ModelRunnerOutput`` carries a ``KVConnectorOutput``: which requests finished an
asynchronous send or receive, and which *blocks* failed to load -- the scheduler then
recomputes what those blocks should have held (lessons 12 and 13). kvlab's executors return
their sampled tokens as a plain dict, and a connector's report travels beside it in this
record (``executor.take_kv_connector_output()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class KVConnectorOutput:
    """One step's report from the worker-side KV connector.

    ``invalid_block_ids``: blocks whose KV could not be loaded (a tier file missing or
    corrupt, a transfer that failed half way); the scheduler gives their requests back to
    recompute (vLLM's ``kv_load_failure_policy="recompute"``). ``num_loaded_tokens`` and
    ``num_stored_tokens`` (kvlab's own) count tokens moved this step per medium ("CPU",
    "STORAGE", "FILE"), so the simulated clock can charge the copies; ``errors`` says why a
    request's load failed. ``worker_meta``: the
    connector's own report to its scheduler side (vLLM: ``kv_connector_worker_meta``).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    # vLLM 0.33: requests whose asynchronous load failed as a whole (a connector that cannot
    # say which blocks); the scheduler recomputes them (or fails them, policy "fail").
    failed_recving: set[str] = field(default_factory=set)
    # vLLM 0.33: the worker-side connector's metrics payload (a KVConnectorStats), if any.
    kv_connector_stats: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    num_stored_tokens: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its load failed (names the file)
    worker_meta: Any = None

    @property
    def kv_connector_worker_meta(self) -> Any:
        """vLLM 0.33's name for ``worker_meta`` (the connectors use it, so they also read
        vLLM's own output record)."""
        return self.worker_meta

    @kv_connector_worker_meta.setter
    def kv_connector_worker_meta(self, value: Any) -> None:
        self.worker_meta = value

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.num_loaded_tokens
            or self.num_stored_tokens
            or self.worker_meta is not None
        )
