"""kvlab's scheduler from vLLM 0.33's engine config.

vLLM builds its scheduler from the whole engine config: ``Scheduler(vllm_config=...,
kv_cache_config=..., structured_output_manager=..., block_size=...)`` makes the KV-cache
manager and the KV connector itself. kvlab's core scheduler takes those parts built -- the
core imports no connector (its layer contract) -- so this module, above both, reads the
config and builds them::

    Scheduler(**scheduler_kwargs_from_vllm_config(vllm_config, kv_cache_config, block_size=16))

It reads what kvlab's scheduler models: the scheduler config's budgets, policy, chunking and
full-prompt admission; the model's length; prefix caching and KV events; the KV transfer
config (its connector, built by ``KVConnectorFactory`` as vLLM builds it, and its load-failure
policy); LoRA's ``max_loras``. A config that asks for what kvlab's scheduler does not model --
draft tokens from a speculative decoder -- is refused by name.
"""

from __future__ import annotations

from typing import Any

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.utils.checks import check_int

__all__ = ["scheduler_kwargs_from_vllm_config"]


def scheduler_kwargs_from_vllm_config(
    vllm_config: Any,
    kv_cache_config: Any,
    block_size: int,
    hash_block_size: int | None = None,
    log_stats: bool = False,
) -> dict[str, Any]:
    """The arguments of kvlab's ``Scheduler`` for vLLM's ``(vllm_config, kv_cache_config,
    block_size, hash_block_size, log_stats)``: a KV-cache manager built from
    ``kv_cache_config`` and the connector the transfer config names, among them."""
    for name in ("scheduler_config", "model_config", "cache_config"):
        if not hasattr(vllm_config, name):
            raise TypeError(f"vllm_config must be a VllmConfig (it has no {name}), got {type(vllm_config).__name__}")
    block_size = check_int("block_size", block_size, 1)
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(
            "kvlab's scheduler schedules no draft tokens: build it from a VllmConfig without speculative_config "
            "(EAGLE's effect on the cache is modelled by KVCacheManager(use_eagle=True))"
        )
    sc, model_config = vllm_config.scheduler_config, vllm_config.model_config
    events_config = getattr(vllm_config, "kv_events_config", None)
    manager = KVCacheManager(
        kv_cache_config,
        max_model_len=model_config.max_model_len,
        enable_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        log_stats=bool(log_stats),
        max_in_flight_tokens=getattr(vllm_config, "max_in_flight_tokens", None),
        enable_kv_cache_events=bool(events_config is not None and events_config.enable_kv_cache_events),
        hash_block_size=block_size if hash_block_size is None else hash_block_size,
    )
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    connector = None
    if kv_transfer_config is not None:
        connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    lora_config = getattr(vllm_config, "lora_config", None)
    max_num_scheduled_tokens = getattr(sc, "max_num_scheduled_tokens", None)
    return dict(
        kv_cache_manager=manager,
        max_num_batched_tokens=sc.max_num_batched_tokens if max_num_scheduled_tokens is None else max_num_scheduled_tokens,
        max_num_seqs=sc.max_num_seqs,
        policy=str(sc.policy),
        enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        max_model_len=model_config.max_model_len,
        scheduler_reserve_full_isl=bool(getattr(sc, "scheduler_reserve_full_isl", True)),
        connector=connector,
        kv_load_failure_policy=kv_transfer_config.kv_load_failure_policy if kv_transfer_config is not None else "recompute",
        max_loras=None if lora_config is None else lora_config.max_loras,
        kv_transfer_config=kv_transfer_config,
    )
