"""Helpers for the secondary-tier tests (file system, object store): the spec a tier is
built from, and a bounded wait for a tier's lookup thread."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from kvlab.kv_offload import config as oc
from offloading_config import offloading_config


def tier_spec(*, events: bool = True, blocks_per_chunk: int = 1) -> Any:
    """What a tier reads of vLLM's ``OffloadingSpec``: model "m", one rank, a
    parallelism-agnostic layout."""
    conf = offloading_config(enable_kv_cache_events=events, parallel=oc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
    return SimpleNamespace(config=conf, blocks_per_chunk=blocks_per_chunk, kv_events_config=SimpleNamespace(enable_kv_cache_events=events))


def answered(tier: Any, deadline_s: float = 60.0) -> None:
    """Wait (bounded) until the tier's lookup thread answered every key sent to it."""
    lm = tier._lookup_manager
    end = time.monotonic() + deadline_s
    while not lm._lookup_queue.empty() or any(s.phase.name == "IN_FLIGHT" for s in lm._lookup_state.values()):
        lm.drain_results()
        assert time.monotonic() < end, "the lookup thread did not answer"
        time.sleep(0.005)
