"""Seconds per engine step, so TTFT and TPOT can be read off without a GPU (lesson 08).

kvlab's own: vLLM measures real time; kvlab's simulated clock advances by this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvlab.utils.checks import check_number


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
    # Loading a token's KV from an offload tier (lessons 12-13): 128 KiB per token (an
    # 8B GQA model, fp16) over ~25 GB/s of PCIe from host memory, ~3 GB/s from an NVMe disk,
    # ~10 GB/s over a network link from another engine ("FILE", disaggregated prefill).
    # Stores are copied while the next step computes: free here, as in vLLM.
    # (Left out of the repr: lessons 03 and 08 print the step costs they use.)
    load_s_per_token: dict[str, float] = field(default_factory=lambda: {"CPU": 5.2e-6, "STORAGE": 4.4e-5, "FILE": 1.3e-5}, repr=False)
    # The vision encoder, per embedding (lesson 14).
    encoder_s_per_token: float = field(default=0.0002, repr=False)

    def __post_init__(self) -> None:
        for name in ("step_overhead_s", "prefill_s_per_token", "decode_s_per_token", "kv_read_s_per_token", "encoder_s_per_token"):
            setattr(self, name, check_number(name, getattr(self, name), 0))
        if not isinstance(self.load_s_per_token, Mapping):
            raise TypeError(f"load_s_per_token must be a dict {{medium: seconds per token}}, got {type(self.load_s_per_token).__name__}")
        self.load_s_per_token = {m: check_number(f"load_s_per_token[{m!r}]", v, 0) for m, v in self.load_s_per_token.items()}

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        num_context_tokens: int,
        num_loaded_tokens: Mapping[str, int] | None = None,
        num_encoder_tokens: int = 0,
    ) -> float:
        if num_prefill_tokens + num_decode_tokens == 0:
            return 0.0
        load = sum(self.load_s_per_token.get(m, 0.0) * n for m, n in (num_loaded_tokens or {}).items())
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * num_prefill_tokens
            + self.decode_s_per_token * num_decode_tokens
            + self.kv_read_s_per_token * num_context_tokens
            + load
            + self.encoder_s_per_token * num_encoder_tokens
        )
