"""The bytes of the CPU tier, and the copies in and out of it (vLLM:
``vllm/v1/kv_offload/cpu/gpu_worker.py``; lesson 12).

The CPU tier is one host tensor ``[num_cpu_blocks, num_layers, 2, block_size, kv_heads,
head_dim]``: slot ``s`` holds one GPU block's keys and values for every layer. A store copies
GPU block ``b`` of every layer's paged cache (``kv_caches[l][b]``) into slot ``s``; a load
copies it back into whatever GPU block the request got this time. On a machine without a
GPU both are host copies, still real tensor copies -- the bytes round-trip exactly, which is
why greedy outputs with offloading equal those without. A slot is also what a storage file
holds: ``slot_bytes`` / ``put_slot_bytes`` are what the connector's worker writes to and
reads from a file.

The simulated executor has no tensors (``kv_caches`` is empty): then a slot is zero bytes,
files carry only their header, and everything else -- slots, files, checks -- is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.utils.checks import check_int


class CPUKVBuffer:
    """Host memory for ``num_blocks`` GPU blocks of every layer."""

    def __init__(self, num_blocks: int, kv_caches: Sequence[Any]) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.kv_caches = list(kv_caches)
        self.tensor: Any = None
        self.block_nbytes = 0
        if self.kv_caches:
            import torch

            first = self.kv_caches[0]
            for i, t in enumerate(self.kv_caches):
                if t.shape != first.shape or t.dtype != first.dtype:
                    raise ValueError(
                        f"kv_caches[{i}] has shape {tuple(t.shape)} {t.dtype}; every layer must match {tuple(first.shape)} {first.dtype}"
                    )
            # [slots, layers, 2, block_size, kv_heads, head_dim], pinned would be nicer on CUDA
            self.tensor = torch.zeros((self.num_blocks, len(self.kv_caches), *first.shape[1:]), dtype=first.dtype)
            self.block_nbytes = self.tensor[0].numel() * self.tensor.element_size()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"CPU slot {slot} out of range 0..{self.num_blocks - 1}")

    def store(self, gpu_block: int, slot: int) -> None:
        """GPU block -> CPU slot, every layer."""
        self._check_slot(slot)
        for layer, kv in enumerate(self.kv_caches):
            self.tensor[slot, layer].copy_(kv[gpu_block])

    def load(self, slot: int, gpu_block: int) -> None:
        """CPU slot -> GPU block, every layer."""
        self._check_slot(slot)
        for layer, kv in enumerate(self.kv_caches):
            kv[gpu_block].copy_(self.tensor[slot, layer], non_blocking=False)

    def slot_bytes(self, slot: int) -> bytes:
        self._check_slot(slot)
        if self.tensor is None:
            return b""
        import torch

        return self.tensor[slot].contiguous().view(torch.uint8).numpy().tobytes()

    def put_slot_bytes(self, slot: int, payload: bytes) -> None:
        """Fill a slot from bytes (what a storage file holds)."""
        self._check_slot(slot)
        if len(payload) != self.block_nbytes:
            raise ValueError(f"slot payload has {len(payload)} bytes, a slot holds {self.block_nbytes}")
        if self.tensor is not None:
            import torch

            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.tensor[slot].copy_(raw.view(self.tensor.dtype).view(self.tensor.shape[1:]))
