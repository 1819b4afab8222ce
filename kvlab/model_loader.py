"""``kvlab.load_model(path_or_id)``: a Hugging Face checkpoint, ready to drive kvlab's engine.

The loading itself lives in the worker layer (:mod:`kvlab.worker.hf_checkpoint`); this
module adds what a lesson wants next to it: the KV-cache groups the model's layers need,
the memory one token costs, and an :class:`~kvlab.engine.llm_engine.LLMEngine` built around
the model with the same scheduler, block pool, prefix cache and event log as every other
lesson::

    m = kvlab.load_model("path/to/checkpoint")          # or a Hub id, with huggingface_hub
    engine = m.build_engine(num_blocks=256, block_size=16)
    out = engine.generate([m.tokenizer.encode_chat(messages)], max_tokens=32)
    print(m.tokenizer.decode(out[0]))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvlab.eventlog.events import EventLog
from kvlab.utils.checks import check_int
from kvlab.worker.hf_checkpoint import Checkpoint, load_checkpoint
from kvlab.worker.hf_runner import CheckpointModelRunner, layer_windows

__all__ = ["LoadedModel", "load_model"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LoadedModel(Checkpoint):
    """A checkpoint's model and tokenizer (the fields of :class:`Checkpoint`), and how its KV
    cache is laid out."""

    @property
    def device(self) -> torch.device:
        return self.model.device

    def kv_cache_groups(self) -> list[KVCacheSpec]:
        """One spec per kind of layer (full attention first, then the sliding window), with
        the model's KV heads, head size and dtype: what the block manager is built with."""
        cfg = self.config
        geo: dict[str, Any] = dict(num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim, dtype=_DTYPE_NAMES[cfg.dtype])
        return [FullAttentionSpec(**geo) if w is None else SlidingWindowSpec(sliding_window=w, **geo) for w in layer_windows(self.model)]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 x layers x KV heads x head_dim x bytes."""
        return self.config.kv_bytes_per_token

    def blocks_per_gib(self, block_size: int = 16) -> int:
        """Whole blocks of ``block_size`` tokens (all layers) that fit in one GiB."""
        block_size = check_int("block_size", block_size, 1)
        return (1 << 30) // (self.kv_bytes_per_token * block_size)

    def build_engine(
        self,
        num_blocks: int = 64,
        block_size: int = 16,
        *,
        enable_caching: bool = True,
        event_log: EventLog | bool | None = True,
        backend: str | None = None,
        runner_kwargs: dict[str, Any] | None = None,
        manager_kwargs: dict[str, Any] | None = None,
        **scheduler_kwargs: Any,
    ) -> LLMEngine:
        """An engine whose executor runs this model on the paged cache.

        ``num_blocks`` blocks of ``block_size`` tokens, each present in every layer (block 0 is
        the null block). ``backend``: None picks Triton on CUDA and the torch reference kernels
        on the CPU. ``scheduler_kwargs`` go to the :class:`Scheduler`
        (``max_num_batched_tokens``, ``max_num_seqs``, ...), ``runner_kwargs`` to the
        :class:`CheckpointModelRunner` (``temperature``, ``seed``, ``keep_history``, ...).
        """
        if event_log is True:
            log: EventLog | None = EventLog()
        elif event_log is None or event_log is False:
            log = None
        elif isinstance(event_log, EventLog):
            log = event_log
        else:
            raise TypeError(f"event_log must be True, False, None or an EventLog, got {type(event_log).__name__}")
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be a bool, got {type(enable_caching).__name__}")
        groups = self.kv_cache_groups()
        # Sized by build_engine from the manager (num_blocks, block_size, the groups): one plan.
        runner = CheckpointModelRunner(self.model, backend=backend, event_log=log, **dict(runner_kwargs or {}))
        mkw = dict(manager_kwargs or {})
        mkw.setdefault("kv_cache_groups", groups)
        mkw.setdefault("enable_caching", enable_caching)
        return build_engine(
            num_blocks=num_blocks,
            block_size=block_size,
            executor=runner,
            event_log=log if log is not None else None,
            tokenizer=self.tokenizer,
            manager_kwargs=mkw,
            **scheduler_kwargs,
        )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LoadedModel({c.architecture}, {self.model.num_parameters():,} parameters, {c.num_layers} layers, "
            f"{c.num_heads} q heads / {c.num_kv_heads} KV heads x {c.head_dim}, {_DTYPE_NAMES[c.dtype]} "
            f"on {self.device}, from {str(self.directory)!r})"
        )


def load_model(
    path_or_id: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    revision: str | None = None,
) -> LoadedModel:
    """Load a Llama / Mistral / Qwen2 / Qwen3 checkpoint (a directory, or a Hub model id when
    ``huggingface_hub`` is installed). ``device=None``: CUDA when present, else the CPU;
    ``dtype=None``: float32 on the CPU, the checkpoint's dtype on CUDA."""
    ckpt = load_checkpoint(path_or_id, dtype=dtype, device=device, revision=revision)
    return LoadedModel(model=ckpt.model, tokenizer=ckpt.tokenizer, directory=ckpt.directory)
