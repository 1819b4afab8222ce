"""Which KV-cache groups the offloading connector copies to its tiers (vLLM 0.33:
``get_offloading_group_ids`` in ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``).

Without HiSparse, every prefix-cacheable group (kvlab's connector serves one: a single
full-attention group). With HiSparse the source group's K/V already lives whole in the
host pool, so a second copy would only duplicate it: the connector offloads the indexer
keys alone (the ``HISPARSE_INDEXER`` groups), which stay on the GPU and are lost with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.kv_cache_interface import KVCacheGroupRole

if TYPE_CHECKING:
    from kvlab.kv_cache_interface import KVCacheConfig


def get_offloading_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """The ids of the groups the offloading connector stores and loads, in group order."""
    if kv_cache_config.hisparse_host_num_blocks is None:
        return kv_cache_config.prefix_cacheable_group_ids
    return tuple(i for i, group in enumerate(kv_cache_config.kv_cache_groups) if group.role is KVCacheGroupRole.HISPARSE_INDEXER)
