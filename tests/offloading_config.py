"""One place that builds the offloading connector's ``OffloadingConfig`` for tests: a model
"m" in float16, one group of 16-token blocks on layer "l0", one block per chunk. A test
names only what it is about."""

from __future__ import annotations

from typing import Any

from kvlab.kv_offload import config as oc


def offloading_config(**overrides: Any) -> oc.OffloadingConfig:
    fields: dict[str, Any] = dict(
        groups=(oc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=oc.OffloadingModelConfig("m", "float16"),
        cache=oc.OffloadingCacheConfig(16, 1),
        parallel=None,
    )
    fields.update(overrides)
    return oc.OffloadingConfig(**fields)
