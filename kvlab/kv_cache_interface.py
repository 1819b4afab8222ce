"""KV-cache group specs: what kind of attention a group of layers does (lesson 07).

vLLM: ``vllm/v1/kv_cache_interface.py``. Every group draws blocks from the same pool; the
spec decides how many blocks a request needs and what counts as a prefix hit.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.utils.checks import check_int


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every layer in the group attends to every earlier token: all blocks are kept."""

    block_size: int | None = None  # None: the manager's block_size

    @property
    def type_name(self) -> str:
        return "full"

    def with_block_size(self, block_size: int) -> "FullAttentionSpec":
        return FullAttentionSpec(block_size=block_size)

    def to_dict(self) -> dict:
        return {"type": self.type_name, "block_size": self.block_size}


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Layers that attend only to the last ``sliding_window`` tokens (the query included).

    The query at position p reads keys p - W + 1 ... p, so once ``n`` tokens are computed
    the first ``max(0, n - W + 1)`` are never read again and whole blocks of them can go.
    """

    sliding_window: int = 0
    block_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sliding_window", check_int("sliding_window", self.sliding_window, 1))

    @property
    def type_name(self) -> str:
        return "sliding_window"

    def with_block_size(self, block_size: int) -> "SlidingWindowSpec":
        return SlidingWindowSpec(sliding_window=self.sliding_window, block_size=block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def to_dict(self) -> dict:
        return {"type": self.type_name, "block_size": self.block_size, "sliding_window": self.sliding_window}


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


# --- how KV cache events name a group's spec (vLLM's KVCacheSpecKind values) -----------------
# By class name, most specific first along the MRO, so a spec class added later with vLLM's
# name (MLAAttentionSpec, MambaSpec, ...) is named correctly without touching this table.
_SPEC_KIND_BY_CLASS_NAME = {
    "SlidingWindowMLASpec": "sliding_window_mla",
    "MLAAttentionSpec": "mla_attention",
    "SinkFullAttentionSpec": "sink_full_attention",
    "FullAttentionSpec": "full_attention",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "SlidingWindowSpec": "sliding_window",
    "MambaSpec": "mamba",
    "EncoderOnlyAttentionSpec": "encoder_only_attention",
    "CrossAttentionSpec": "cross_attention",
}


def get_kv_cache_spec_kind(kv_cache_spec: object) -> str:
    """``kv_cache_spec_kind`` of a ``BlockStored`` event: "full_attention", "sliding_window", ...
    ("unknown" for a spec vLLM has no kind for)."""
    for cls in type(kv_cache_spec).__mro__:
        kind = _SPEC_KIND_BY_CLASS_NAME.get(cls.__name__)
        if kind is not None:
            return kind
    return "unknown"


def get_kv_cache_spec_sliding_window(kv_cache_spec: object) -> int | None:
    """``kv_cache_spec_sliding_window`` of a ``BlockStored`` event: the window of a
    sliding-window spec, else None."""
    if any(c.__name__ == "SlidingWindowSpec" for c in type(kv_cache_spec).__mro__):
        return kv_cache_spec.sliding_window  # type: ignore[attr-defined]
    return None
