"""The model runner for a loaded checkpoint: one KV-cache group per kind of layer it has.

:class:`~kvlab.worker.model_runner.ModelRunner` always opens with a full-attention group,
because the toy model always has full-attention layers. A checkpoint may not: Mistral
7B v0.1 slides a 4,096-token window on *every* layer. vLLM then builds a single
sliding-window group, and so does :class:`CheckpointModelRunner`: its groups are exactly the
kinds of layer the model has (full attention first when present, then the window), nothing
more — a group no layer reads would hold blocks for nothing.

On the CPU it runs the torch references of the kernels (``backend="reference"``): the
same block tables and slot mappings, the same arithmetic, without the Triton interpreter,
which is far too slow for a real model's sizes. On CUDA it runs the compiled Triton kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.worker.hf_model import HFCausalLM
from kvlab.worker.model_runner import ModelRunner

__all__ = ["CheckpointModelRunner", "layer_windows", "default_backend"]


def layer_windows(model: HFCausalLM) -> tuple[int | None, ...]:
    """The groups a model needs, as sliding windows (None: full attention), full first."""
    cfg = model.config
    kinds = {cfg.layer_sliding_window(i) for i in range(cfg.num_layers)}
    return tuple(sorted(kinds, key=lambda w: -1 if w is None else w))


def default_backend(device: str | torch.device | None) -> str:
    """``"triton"`` on a CUDA device, the torch ``"reference"`` kernels on the CPU."""
    if device is None:
        return "triton" if torch.cuda.is_available() else "reference"
    return "triton" if torch.device(device).type == "cuda" else "reference"


class CheckpointModelRunner(ModelRunner):
    """A :class:`ModelRunner` for an :class:`HFCausalLM` (see the module docstring)."""

    model: HFCausalLM  # __init__ refuses any other model

    def __init__(
        self,
        model: HFCausalLM,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_cache_groups: Sequence[object] | None = None,
        device: str | torch.device | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, HFCausalLM):
            raise TypeError(f"model must be an HFCausalLM (kvlab.load_model(...).model), got {type(model).__name__}")
        if device is None:
            device = model.device
        backend = default_backend(device) if backend is None else backend
        super().__init__(model, num_blocks, block_size, kv_cache_groups, device=device, backend=backend, **kwargs)

    def _resolve_groups(self, kv_cache_groups: Sequence[object] | None, block_size: int) -> tuple[int | None, ...]:
        needed = layer_windows(self.model)
        if kv_cache_groups is None:
            return needed
        groups = list(kv_cache_groups)
        for g in groups:
            kind = getattr(g, "type_name", "full")
            if kind not in ("full", "sliding_window"):
                raise ValueError(
                    f"kv_cache_groups: the model runner runs full-attention and sliding-window groups only, got {type(g).__name__}"
                )
            bs = getattr(g, "block_size", None)
            if bs is not None and bs != block_size:
                raise ValueError(
                    f"kv_cache_groups: a group has block_size={bs}, but the runner's block_size is {block_size}; all groups must share it"
                )
        windows = tuple(getattr(g, "sliding_window", None) for g in groups)
        if windows != needed:
            raise ValueError(
                f"kv_cache_groups {windows!r} (sliding windows; None = full attention) do not match the "
                f"model, whose layers need exactly {needed!r}, in that order"
            )
        return windows
