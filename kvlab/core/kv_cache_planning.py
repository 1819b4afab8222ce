"""How a model's layers are laid out across tensor-parallel ranks (vLLM 0.33:
``vllm/v1/core/kv_cache_planning.py``, the part an offloading backend reads).

Tensor parallelism splits the KV heads over the ranks. A layer with fewer heads than ranks
cannot be split that far: its heads are *copied*, and consecutive ranks hold identical
bytes. MLA is the extreme case -- one latent "head" (``max_tp_shards=1``), the same on every
rank -- so an offload tier can keep a single copy for the whole group of ranks instead of
one per rank. ``KVCacheConfig.kv_tp_replicas`` records how many ranks share their bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce
from math import gcd
from typing import Any

from kvlab.kv_cache_interface import AttentionSpec, KVCacheSpec, iter_layer_specs


def _layer_tp_replicas(spec: KVCacheSpec, tp_size: int, dcp_size: int) -> int:
    """How many consecutive ranks hold this layer's bytes identically: ``tp_size`` over the
    shards its heads split into (one for a layer that is not attention, or that does not say
    how far it shards, or whose tokens decode context parallelism spreads over the ranks)."""
    if not isinstance(spec, AttentionSpec) or spec.max_tp_shards is None:
        return 1
    if spec.dcp_sharded and dcp_size > 1:
        return 1
    return max(1, tp_size // spec.max_tp_shards)


def kv_cache_groups_tp_replicas(groups: Iterable[Any], tp_size: int, dcp_size: int = 1) -> int:
    """The ranks that hold identical KV in *every* layer of ``groups``: the GCD of each
    layer's replica count (and of ``tp_size``); 1 when the groups hold no layer."""
    specs = [spec for group in groups for spec in iter_layer_specs(group.kv_cache_spec)]
    if not specs:
        return 1
    return reduce(gcd, (_layer_tp_replicas(s, tp_size, dcp_size) for s in specs), tp_size)
