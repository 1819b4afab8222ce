"""Seconds per engine step, so TTFT and TPOT can be read off without a GPU (lesson 08).

kvlab's own: vLLM measures real time; kvlab's simulated clock advances by this model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CostModel:
    """Seconds per step = overhead + prefill and decode tokens + KV read.

    Illustrative defaults for a 7B-class model on one datacenter GPU: decode is memory
    bound (weights read once per step, shared by the batch; KV read per context token),
    prefill is compute bound (time per token). Change them to explore.
    """

    step_overhead_s: float = 0.010
    prefill_s_per_token: float = 0.00012
    decode_s_per_token: float = 0.0003
    kv_read_s_per_token: float = 1e-7

    def step_time(self, num_prefill_tokens: int, num_decode_tokens: int, num_context_tokens: int) -> float:
        if num_prefill_tokens + num_decode_tokens == 0:
            return 0.0
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * num_prefill_tokens
            + self.decode_s_per_token * num_decode_tokens
            + self.kv_read_s_per_token * num_context_tokens
        )
