"""KV-cache group specs: what kind of layer a group of layers is, and how big its pages are
(lessons 07 and 01).

vLLM: ``vllm/v1/kv_cache_interface.py``. Every group draws blocks from the same pool; the
spec decides three things:

* how many blocks a request needs, and which of them it may drop (a window, a chunk, a
  recurrent state keeps only the last few);
* what counts as a prefix hit (lesson 07);
* how many bytes one block occupies in one layer (``page_size_bytes``). vLLM requires every
  group to have the *same* page size, so that one pool of pages serves all of them; a group
  whose layers store fewer bytes per token gets a larger ``block_size`` instead
  (:func:`kvlab.core.kv_cache_utils.unify_kv_cache_spec_page_size`).

The geometry fields (``num_kv_heads``, ``head_size``, ``dtype``) only feed the byte counts;
the block manager never reads them. ``block_size=None`` means "the manager's block size".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum, IntEnum
from fractions import Fraction
from math import prod
from typing import Any, cast

from kvlab.kv_cache_layout import _DIM_B, _DIM_L, KVCacheLayout
from kvlab.utils.checks import AssertedValueError, check_int, check_optional_int
from kvlab.utils.math_utils import cdiv

# Bytes per element of the dtypes the lessons use (vLLM reads them from torch dtypes; the
# core stays free of torch, so the names are plain strings).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    # vLLM 0.33 allocates a quantised KV cache (fp8 with inline scales, packed MLA layouts)
    # as raw bytes: the spec's dtype is then torch.uint8, one byte per element.
    "uint8": 1,
}

MAMBA_CACHE_MODES = ("none", "align")


class KVQuantMode(IntEnum):
    """How an attention group's K/V are quantised (vLLM 0.33's ``KVQuantMode``, same names
    and numbers). Here it only says whether two groups store K/V the same way: groups of one
    dtype but different modes are mixed precision, so the runner zeroes new blocks
    (``KVCacheConfig.needs_kv_cache_zeroing``). Bytes per token come from ``dtype``."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10
    ULTRAQUANT_4BIT = 11
    OCTAVE_K3V4 = 12
    OCTAVE_K3V3 = 13
    OCTAVE_K3V3_COMPACT = 14

    @property
    def is_per_token_head(self) -> bool:
        """Modes that store one scale per (token, head) next to the data (vLLM's name): a
        backend then widens each head's cell by the scales (``state_content_bytes``)."""
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.INT4_PER_TOKEN_HEAD)


def _check_int(spec: Any, name: str, minimum: int, allow_none: bool = False) -> None:
    """Check (and normalise: numpy ints become ints) the int field ``name`` of a frozen spec."""
    value = getattr(spec, name)
    label = f"{type(spec).__name__}.{name}"
    v = check_optional_int(label, value, minimum) if allow_none else check_int(label, value, minimum)
    object.__setattr__(spec, name, v)


def _check_tokens_per_state(spec: Any) -> None:
    """``tokens_per_state``: an int >= 1 (tokens compressed into one state), or a Fraction
    in (0, 1) (several states per token)."""
    value = spec.tokens_per_state
    label = f"{type(spec).__name__}.tokens_per_state"
    if isinstance(value, Fraction):
        if value.denominator == 1:
            object.__setattr__(spec, "tokens_per_state", int(value))
        elif not 0 < value < 1:
            raise ValueError(f"{label} must be an int >= 1 or a Fraction between 0 and 1, got {value}")
        return
    _check_int(spec, "tokens_per_state", 1)


# torch's names for the same dtypes: vLLM builds its specs with ``torch.float32`` and the
# like, so a spec accepts those too. It keeps what it was given (vLLM's backends read
# ``spec.dtype`` as a torch dtype) and compares and counts bytes by the plain name, so a
# spec built from "float32" equals one built from torch.float32 (the core imports no torch).
_TORCH_DTYPE_NAMES = {
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
}


def _dtype_name(owner: str, name: str, dtype: Any) -> str:
    """The plain name of ``dtype``: one of DTYPE_SIZES' keys, or the torch dtype of the
    same name (recognised by its type, so torch is never imported here)."""
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        plain = _TORCH_DTYPE_NAMES.get(str(dtype))
        if plain is not None:
            return plain
    elif isinstance(dtype, str) and dtype in DTYPE_SIZES:
        return dtype
    raise ValueError(f"{owner}.{name} must be one of {sorted(DTYPE_SIZES)} (or the torch dtype of that name), got {dtype!r}")


def _config_value(vllm_config: Any, path: str) -> Any:
    """The field at the dotted ``path`` of ``vllm_config`` -- vLLM's ``VllmConfig`` or any
    object of its shape (``types.SimpleNamespace`` will do). A missing field is named."""
    value = vllm_config
    for part in path.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise TypeError(
                f"vllm_config has no {path}: a request's worst-case KV memory is read from vLLM 0.33's "
                f"VllmConfig fields (model_config.max_model_len, parallel_config.decode_context_parallel_size, "
                f"max_in_flight_tokens, cache_config.mamba_cache_mode, scheduler_config.max_num_encoder_input_tokens)"
            ) from None
    return value


class SparseCacheRole(str, Enum):
    """What an MLA layer's cache holds in a sparse-attention model (vLLM 0.33; DeepSeek-V3.2,
    GLM-5): the latent K/V that attention reads (``SPARSE``), or the lightning indexer's
    small keys, which score every earlier token to pick the ``index_topk`` that attention
    then reads (``INDEXER``)."""

    SPARSE = "sparse"
    INDEXER = "indexer"


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of every spec: a block of ``block_size`` tokens (None: the manager's)."""

    block_size: int | None = None

    def __post_init__(self) -> None:
        _check_int(self, "block_size", 1, allow_none=True)

    @property
    def type_name(self) -> str:
        raise NotImplementedError

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens of a prefix hit this group recomputes instead of reading (vLLM 0.33; only
        DeepSeek-V4.1's bounded-replay windows are not 0)."""
        return 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this group occupies in ONE layer."""
        raise NotImplementedError

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        return replace(self, block_size=block_size)

    @property
    def has_layer_views(self) -> bool:
        """Whether the worker views each layer's cache as a ``[B, H, N, C]`` array (vLLM 0.33);
        a spec without one (HiSparse's scratch pages) lays its bytes out itself."""
        return True

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """States one kernel block of ``kernel_block_size`` tokens stores (vLLM 0.33)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-layer page layout")

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The most bytes of this group one request can hold at once, per layer (vLLM 0.33):
        what the engine charges a request of ``max_model_len`` tokens when it works out how
        many fit in the pool (:func:`kvlab.core.kv_cache_utils.get_max_concurrency_for_kv_cache_config`).
        ``vllm_config``: vLLM's ``VllmConfig``, or any object with the fields it reads."""
        raise NotImplementedError(f"{type(self).__name__} has no worst-case memory rule")

    def _pages(self, num_blocks: int) -> int:
        return num_blocks * self.page_size_bytes

    def _admission_cap_bytes(self, vllm_config: Any) -> int:
        """The bytes of ``max_admission_blocks_per_request`` (a spec that has one) at the
        config's step budget and ``max_model_len``."""
        self._block_size()
        cap = self.max_admission_blocks_per_request(  # type: ignore[attr-defined]  # only specs that define it call this
            _config_value(vllm_config, "max_in_flight_tokens"), _config_value(vllm_config, "model_config.max_model_len")
        )
        return self._pages(cap)

    def _block_size(self) -> int:
        if self.block_size is None:
            raise ValueError(f"{type(self).__name__}.block_size is None: its memory is unknown until the manager sets it")
        return self.block_size

    @classmethod
    def merge(cls, specs: Sequence[Any]) -> Any:
        """The one spec of a group's layers (vLLM 0.33): every layer of a KV-cache group must
        have the same spec, since they share one block table and one page layout.
        AssertionError otherwise, as in vLLM."""
        if not specs or not all(s == specs[0] for s in specs[1:]):
            raise AssertionError(f"All layers in the same KV cache group must be the same, got {list(specs)!r}")
        return specs[0]

    def to_dict(self) -> dict[str, Any]:
        """``type``, ``block_size`` and every field that differs from its default (JSON-able:
        it goes into the event log's ``PoolCreated``)."""
        d: dict[str, Any] = {"type": self.type_name, "block_size": self.block_size}
        for f in fields(self):
            if not f.init or f.name == "block_size":
                continue  # a derived field (``dtype_name``) follows from the others
            v = getattr(self, _PLAIN_NAMES.get(f.name, f.name))
            if v == f.default:
                continue
            d[f.name] = [list(x) for x in v] if f.name == "shapes" else (list(v) if isinstance(v, tuple) else v)
        return d


# The fields a spec keeps as given (a torch dtype, say) and the plain names it writes down.
_PLAIN_NAMES = {"dtype": "dtype_name", "dtypes": "dtype_names"}


def _field_default(cls: type, name: str) -> Any:
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: per token it stores a key of ``head_size`` and a value of
    ``head_size_v`` (None: same as the key, and set to it) numbers for each of ``num_kv_heads`` heads."""

    num_kv_heads: int = 1
    head_size: int = 64
    head_size_v: int | None = None
    #: The element type, as given: a name ("bfloat16", "fp8_e4m3", ...) or the torch dtype of
    #: that name. Equality and byte counts use ``dtype_name``.
    dtype: Any = field(default="bfloat16", compare=False)
    dtype_name: str = field(init=False, repr=False)
    tokens_per_state: int | Fraction = 1
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    #: vLLM 0.33's tensor-/context-parallel metadata: how many distinct shards the cache
    #: splits into across TP ranks, and whether decode context parallelism splits it.
    #: kvlab runs one rank, so neither changes a block; they are kept for vLLM's call shape.
    max_tp_shards: int | None = None
    dcp_sharded: bool = True
    #: A backend may lay a block out larger than its K/V need (vLLM 0.33's
    #: ``page_size_padded``); the pool then hands out pages of this many bytes.
    page_size_padded: int | None = None
    #: How a backend packs a page (vLLM 0.33, published by the attention backend): the
    #: number of head slots (None: one per KV head) and the bytes of one (head slot, state)
    #: cell (None: dense K and V of ``dtype``). Per-token-head quantisation widens each cell
    #: by its fp32 scales; DeepSeek's packed fp8 MLA cell is 656 bytes.
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    #: The layer belongs to a speculative drafter (vLLM 0.33). A tag only: a drafter's layer
    #: stores its cache exactly like the target's, so it takes no part in equality -- the two
    #: share a group.
    is_draft: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        mode = self.kv_quant_mode
        if type(mode) is not KVQuantMode:
            if type(mode) is not int or mode not in KVQuantMode._value2member_map_:
                raise ValueError(f"{type(self).__name__}.kv_quant_mode must be a KVQuantMode, got {mode!r}")
            object.__setattr__(self, "kv_quant_mode", KVQuantMode(mode))
        _check_int(self, "num_kv_heads", 1)
        _check_int(self, "max_tp_shards", 1, allow_none=True)
        if type(self.dcp_sharded) is not bool:
            raise TypeError(f"{type(self).__name__}.dcp_sharded must be a bool, got {self.dcp_sharded!r}")
        _check_int(self, "head_size", 1)
        _check_int(self, "head_size_v", 0, allow_none=True)
        if self.head_size_v is None:  # vLLM's rule: a value as wide as the key unless told
            object.__setattr__(self, "head_size_v", self.head_size)
        object.__setattr__(self, "dtype_name", _dtype_name(type(self).__name__, "dtype", self.dtype))
        _check_tokens_per_state(self)
        _check_int(self, "num_head_slots", 1, allow_none=True)
        _check_int(self, "state_content_bytes", 1, allow_none=True)
        _check_int(self, "page_size_padded", 1, allow_none=True)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"{type(self).__name__}.page_size_padded = {self.page_size_padded} is smaller than the page's "
                f"K/V ({self.real_page_size_bytes} bytes)"
            )

    @property
    def num_heads(self) -> int:
        """Head slots of a page: ``num_head_slots``, else one per KV head (vLLM's name)."""
        return self.num_kv_heads if self.num_head_slots is None else self.num_head_slots

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes of one (head slot, stored state) cell: ``state_content_bytes`` when a backend
        packs it, else a key and a value of ``dtype`` (vLLM's name)."""
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        v = self.head_size if self.head_size_v is None else self.head_size_v
        return (self.head_size + v) * DTYPE_SIZES[self.dtype_name]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one stored state in one layer (MLA: one latent vector, no V). A state
        is one token unless ``tokens_per_state`` says otherwise."""
        return self.num_heads * self.state_content_size_bytes

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """States a kernel block of ``kernel_block_size`` tokens stores (a backend may split a
        manager block into smaller kernel blocks; vLLM 0.33)."""
        return int(kernel_block_size // self.tokens_per_state)

    @property
    def num_states(self) -> int:
        """States one block stores (vLLM 0.33): ``block_size // tokens_per_state`` --
        DeepSeek-V4 compresses every ``tokens_per_state`` tokens into one state, so a block
        of 128 tokens at 4 tokens per state holds 32; Whisper's block pooling (a Fraction
        ``1/k``) stores ``k`` states per token."""
        if self.block_size is None:
            raise ValueError(f"{type(self).__name__}.block_size is None: page size unknown until the manager sets it")
        return int(self.block_size // self.tokens_per_state)

    @property
    def real_page_size_bytes(self) -> int:
        """The K/V one block holds in one layer, without padding."""
        return self.num_states * self.bytes_per_token

    @property
    def unpadded_page_size_bytes(self) -> int:
        """vLLM 0.33's name for ``real_page_size_bytes`` (what an offload copies per page)."""
        return self.real_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.real_page_size_bytes if self.page_size_padded is None else self.page_size_padded

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if d.get("head_size_v") == self.head_size and _field_default(type(self), "head_size_v") is None:
            del d["head_size_v"]  # the default: as wide as the key
        if isinstance(d.get("tokens_per_state"), Fraction):
            d["tokens_per_state"] = str(d["tokens_per_state"])  # JSON has no fractions: "1/2"
        return d


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every layer in the group attends to every earlier token: all blocks are kept.

    ``sliding_window`` / ``attention_chunk_size`` (vLLM 0.33): with the hybrid allocator
    off, vLLM puts window or chunked-local layers in a full-attention group; the manager
    keeps all their blocks, and the runner still computes each layer with its window."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self, "sliding_window", 1, allow_none=True)
        _check_int(self, "attention_chunk_size", 1, allow_none=True)
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError(
                f"{type(self).__name__}: give sliding_window or attention_chunk_size, not both "
                f"(got {self.sliding_window} and {self.attention_chunk_size})"
            )

    @property
    def type_name(self) -> str:
        return "full"

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """Every token of ``max_model_len`` in its block. Decode context parallelism spreads a
        request's tokens over ``decode_context_parallel_size`` ranks, so each holds ``1/dcp``."""
        max_model_len = _config_value(vllm_config, "model_config.max_model_len")
        dcp = _config_value(vllm_config, "parallel_config.decode_context_parallel_size")
        if self.dcp_sharded and dcp > 1:
            max_model_len = cdiv(max_model_len, dcp)
        return self._pages(cdiv(max_model_len, self._block_size()))

    @classmethod
    def merge(cls, specs: Sequence[Any]) -> Any:
        """A full-attention group's spec (vLLM 0.33): its layers may differ only in their
        window or chunk, and those must agree where given (ValueError otherwise); the group
        keeps the one given. Every other field must match (AssertionError, as in vLLM)."""
        if not specs or not all(isinstance(s, FullAttentionSpec) and not isinstance(s, MLAAttentionSpec) for s in specs):
            raise AssertionError(
                "All attention layers in the same KV cache group must be FullAttentionSpec (MLAAttentionSpec merges apart)"
            )
        merged = {}
        for name in ("sliding_window", "attention_chunk_size"):
            values = {getattr(s, name) for s in specs} - {None}
            if len(values) > 1:
                raise ValueError(
                    f"All attention layers in the same KV cache group must have the same window size, got {name} {sorted(values)}"
                )
            merged[name] = values.pop() if values else None
        first = replace(specs[0], **merged)
        if not all(type(s) is type(first) and replace(s, **merged) == first for s in specs):
            raise AssertionError(f"All layers in the same KV cache group must be the same, got {list(specs)!r}")
        return first


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): the layer caches ONE compressed latent
    vector per token (``kv_lora_rank`` 512 + the rotary part 64 = 576 numbers), shared by
    every head, and rebuilds keys and values from it. There is no separate V and no
    per-head copy, so a token costs ``576 x 2`` bytes per layer in bf16 -- against
    ``2 x 8 x 128 x 2 = 4096`` for a GQA layer with 8 KV heads of 128. The block manager
    treats it as full attention (vLLM maps it to ``FullAttentionManager``)."""

    num_kv_heads: int = 1
    head_size: int = 576
    head_size_v: int | None = 0
    #: vLLM 0.33's KV-cache dtype name for the group ("auto", "fp8", "fp8_ds_mla", ...): a tag
    #: that every layer of a group shares. The bytes follow from ``dtype`` and, for a packed
    #: layout, ``state_content_bytes`` (DeepSeek's "fp8_ds_mla": 656 bytes a token, set by
    #: its backend as in vLLM).
    cache_dtype_str: str | None = None
    #: Sparse attention (vLLM 0.33; DeepSeek-V3.2, GLM-5): what this layer's cache holds
    #: (:class:`SparseCacheRole`), the width of the model's top-k index buffer (None: the
    #: model's ``index_topk``), and whether the layer leads the run of layers that share one
    #: indexer -- HiSparse keeps such a run in one hot-buffer group.
    cache_role: SparseCacheRole = SparseCacheRole.SPARSE
    topk_buffer_width: int | None = None
    is_index_group_leader: bool = False
    #: "deepseek_v4" for DeepSeek-V4's compressed MLA layers, else None (vLLM 0.33's tag).
    model_version: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.cache_dtype_str is not None and (not isinstance(self.cache_dtype_str, str) or not self.cache_dtype_str):
            raise TypeError(f"{name}.cache_dtype_str must be None or a KV-cache dtype name, got {self.cache_dtype_str!r}")
        if self.cache_role not in tuple(SparseCacheRole):
            raise ValueError(f"{name}.cache_role must be one of {[r.value for r in SparseCacheRole]}, got {self.cache_role!r}")
        object.__setattr__(self, "cache_role", SparseCacheRole(self.cache_role))
        _check_int(self, "topk_buffer_width", 1, allow_none=True)
        if not isinstance(self.is_index_group_leader, bool):
            raise TypeError(f"{name}.is_index_group_leader must be True or False, got {self.is_index_group_leader!r}")
        if self.model_version not in (None, "deepseek_v4"):
            raise ValueError(f"{name}.model_version must be None or 'deepseek_v4', got {self.model_version!r}")

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if "cache_role" in d:
            d["cache_role"] = d["cache_role"].value  # the plain string, as the event log writes JSON
        return d

    @property
    def type_name(self) -> str:
        return "mla"

    @classmethod
    def merge(cls, specs: Sequence[Any]) -> Any:
        """An MLA group's spec: every layer the same (vLLM 0.33 merges MLA apart from full
        attention; AssertionError otherwise)."""
        if not specs or not all(isinstance(s, MLAAttentionSpec) for s in specs):
            raise AssertionError("All attention layers in the same KV cache group must be MLAAttentionSpec")
        return super(FullAttentionSpec, cls).merge(specs)  # the base rule: every layer the same


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Layers that cache a hidden state per token instead of keys and values (vLLM 0.33's
    ``extract_hidden_states``, which hands a drafter the target's hidden states). Laid out
    like MLA -- one vector per token -- and managed as full attention."""


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with static attention sinks (vLLM 0.33; openPangu's layers): every
    query also attends to ``sink_len`` learned keys and values that belong to no token. The
    model writes them once into blocks of their own, so ``sink_len`` must fill whole blocks
    (vLLM's manager checks it). To the block manager the group is full attention: the same
    blocks, hits and frees."""

    sink_len: int | None = None

    def __post_init__(self) -> None:
        _check_int(self, "sink_len", 1, allow_none=True)
        super().__post_init__()

    @property
    def type_name(self) -> str:
        return "sink_full"


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A per-request ring of ``block_size`` rows (vLLM 0.33; DeepSeek's KV compressor, GLM's
    indexer tail): the raw keys of the token group still being compressed. It occupies one
    block per request for the request's whole life, whatever its length, and is scratch --
    never shared, never a prefix hit, so its block size need not divide the hash block size
    (it still enters the scheduler block size, the LCM of every group's)."""

    @property
    def type_name(self) -> str:
        return "circular_buffer"

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """One block, the ring, for the request's whole life."""
        return self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window attention (vLLM 0.33's R-SWA): the prompt -- say an image and
    its question -- stays visible to every later token, and of the generated tokens only the
    last ``rswa_window``. So the blocks between the prompt's last block and the window (the
    *gap*) are freed as decoding goes on, and a request holds its prompt plus a window, not
    its whole length. Prefix hits are those of full attention: the prompt is all kept."""

    rswa_window: int = 0

    def __post_init__(self) -> None:
        _check_int(self, "rswa_window", 1)
        super().__post_init__()

    @property
    def type_name(self) -> str:
        return "rswa"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Layers that attend only to the last ``sliding_window`` tokens (the query included).

    The query at position p reads keys p - W + 1 ... p, so once ``n`` tokens are computed
    the first ``max(0, n - W + 1)`` are never read again and whole blocks of them can go.

    ``extra_retained_tokens`` (vLLM 0.33) keeps that many more tokens below the window: read
    by no query, but a multi-module MTP drafter may make the target compute the last
    ``k - 1`` tokens again, and that recompute reads the window as it was. The KV-cache
    manager sets it to ``num_prefill_lookahead - 1`` on every window group, as vLLM's
    planner does; a value given here is replaced.
    """

    sliding_window: int = 0
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sliding_window", check_int("sliding_window", self.sliding_window, 1))
        _check_int(self, "extra_retained_tokens", 0)
        super().__post_init__()

    @property
    def type_name(self) -> str:
        return "sliding_window"

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below a request's next position that stay in its table."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.num_retained_tokens)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Most blocks one request can hold at once (vLLM's admission cap): the retained
        tokens (``W - 1`` and the extra ones) plus one step's tokens in flight, +1 because
        the window need not start at a block boundary."""
        # block_size is set by then: the manager gives a spec with None its own block size before the scheduler asks
        return cdiv(min(self.num_retained_tokens + max_in_flight_tokens, max_model_len), self.block_size) + 1  # type: ignore[arg-type]  # block_size set, see above

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The admission cap's blocks (:meth:`max_admission_blocks_per_request`): a window
        group never holds more, however long the request. vLLM 0.33 asserts that decode
        context parallelism is off for a sharded window."""
        dcp = _config_value(vllm_config, "parallel_config.decode_context_parallel_size")
        if self.dcp_sharded and dcp != 1:
            raise AssertedValueError(
                f"DCP not support sliding window. (decode_context_parallel_size is {dcp}; a window group "
                "under decode context parallelism needs dcp_sharded=False)"
            )
        return self._admission_cap_bytes(vllm_config)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """A sliding window over MLA's one latent vector per token (vLLM 0.33; DeepSeek-V4's
    window layers): the bytes of MLA, the blocks, hits and frees of a window.

    ``bounded_replay`` (DeepSeek-V4.1): the window's KV is never prefix-cached. A request
    that hits the cache recomputes the hit's last ``sliding_window`` tokens instead -- the
    other groups read those tokens' cached KV, this group rebuilds its window from them --
    so the group costs no cached blocks, and a hit no longer than the window saves nothing
    (the scheduler drops it; ``Request.replay_start``)."""

    num_kv_heads: int = 1
    head_size: int = 576
    head_size_v: int | None = 0
    bounded_replay: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bounded_replay, bool):
            raise TypeError(f"SlidingWindowMLASpec.bounded_replay must be True or False, got {self.bounded_replay!r}")
        super().__post_init__()

    @property
    def type_name(self) -> str:
        return "sliding_window_mla"

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): the sequence is cut into chunks of
    ``attention_chunk_size`` tokens and a query reads only keys of its own chunk. Once a
    chunk is complete no later query reads it, so its blocks can go."""

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        _check_int(self, "attention_chunk_size", 1)
        super().__post_init__()

    @property
    def type_name(self) -> str:
        return "chunked_local"

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """One chunk plus one step's tokens in flight (vLLM's admission cap)."""
        # block_size is set by then: the manager gives a spec with None its own block size before the scheduler asks
        return cdiv(min(self.attention_chunk_size + max_in_flight_tokens, max_model_len), self.block_size)  # type: ignore[arg-type]  # block_size set, see above

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The admission cap's blocks: one chunk and one step's tokens in flight."""
        return self._admission_cap_bytes(vllm_config)


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross attention of an encoder-decoder model (Whisper, BART): the decoder's queries
    read the *encoder's* keys and values, computed once from the request's input (audio, an
    image). A request gets its blocks for the encoder's tokens in one allocation and keeps
    them to the end; nothing is shared between requests -- every input differs -- so these
    blocks are never prefix-cached (vLLM turns prefix caching off for such models)."""

    @property
    def type_name(self) -> str:
        return "cross_attention"

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The encoder's longest input (``max_num_encoder_input_tokens``; Whisper: 1,500
        frames), whatever the decoder's length."""
        tokens = _config_value(vllm_config, "scheduler_config.max_num_encoder_input_tokens")
        return self._pages(cdiv(tokens, self._block_size()))


@dataclass(frozen=True, kw_only=True)
class _HiSparsePageSpec(KVCacheSpec):
    """A HiSparse GPU group: scratch pages of ``page_size`` bytes a block in one layer (as
    the layout computed it), never shared and never a prefix hit."""

    page_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self, "page_size", 1)

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    @property
    def has_layer_views(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(_HiSparsePageSpec):
    """HiSparse's hot buffer (vLLM 0.33): a fixed set of ``blocks_per_request`` GPU blocks a
    request holds while it reads its K/V from the host pool -- the rows its last top-k
    selections touched, kept on the GPU so the next step finds most of them there. The same
    size at every length."""

    blocks_per_request: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self, "blocks_per_request", 1)

    @property
    def type_name(self) -> str:
        return "hisparse_hot"

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self._pages(self.blocks_per_request)


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(_HiSparsePageSpec):
    """HiSparse's resident pages (vLLM 0.33): GPU copies of a request's newest K/V pages,
    written by the forward pass and copied to the host pool behind it. Once a page's host
    copy is complete the pool may take its block back, so a running request pins only its
    last pages; admission still reserves one step's worth (:meth:`max_admission_blocks_per_request`)."""

    @property
    def type_name(self) -> str:
        return "hisparse_resident"

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The pages one step's tokens can dirty before any reaches the host."""
        return cdiv(min(max_in_flight_tokens, max_model_len), self._block_size())

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self._admission_cap_bytes(vllm_config)


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A state-space (Mamba / linear-attention) layer: no per-token KV at all, one fixed-size
    recurrent state per request (``shapes`` x ``dtypes``: e.g. a conv state and an SSM
    state), whatever the context length.

    ``mamba_cache_mode``:

    * ``"none"``: the request keeps only its running state; no prefix caching (vLLM refuses
      caching in this mode). vLLM then sets the block size to ``max_model_len`` so one
      block holds the one state.
    * ``"align"``: the state after every ``block_size`` tokens is written to its own block,
      so that a later request with the same prefix can start from a saved state. Chunks of a
      prefill end on block boundaries; the request holds at most two state blocks (the one
      being read and the one being written) and frees the older ones.

    ``num_speculative_blocks`` (vLLM sets it from ``num_speculative_tokens`` for MTP/EAGLE on
    a hybrid): a recurrent state cannot be rolled back, so each draft token the verifier may
    reject needs a state block of its own after the running one -- the runner keeps the
    state after every draft position and continues from the last accepted one. In
    ``align`` mode these scratch blocks ride at the end of the table: when the request
    crosses a block boundary they move to the new end
    (:class:`~kvlab.eventlog.events.BlockRelocated`) instead of being freed and taken again.

    ``num_prefill_checkpoint_blocks`` and ``prefill_checkpoint_alignment`` (vLLM 0.33, set by
    a linear-attention backend whose kernel can write the state at a position *inside* a
    chunk, a multiple of ``prefill_checkpoint_alignment`` tokens from the chunk's start): the
    prompt's reusable state is then exported from the last chunk into one extra block, so
    the scheduler need not end a chunk at that boundary -- one forward pass fewer.
    """

    shapes: tuple[tuple[int, ...], ...] = ((4, 256), (8, 64, 16))
    #: One element type per state tensor, as given (names or torch dtypes); equality and
    #: byte counts use ``dtype_names``.
    dtypes: tuple[Any, ...] = field(default=("bfloat16", "float32"), compare=False)
    dtype_names: tuple[str, ...] = field(init=False, repr=False)
    mamba_cache_mode: str = "align"
    page_size_padded: int | None = None
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"{name}.mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got {self.mamba_cache_mode!r}")
        shapes_given: tuple[Any, ...] = tuple(self.shapes)
        if shapes_given and all(isinstance(d, int) for d in shapes_given):
            shapes_given = (shapes_given,)  # one state tensor's shape given bare, as vLLM's tests write it
        shapes = tuple(tuple(s) for s in shapes_given)
        dtypes = tuple(_dtype_name(name, "dtypes[...]", d) for d in self.dtypes)
        if not shapes or len(shapes) != len(dtypes):
            raise ValueError(f"{name}: shapes and dtypes must be non-empty and of equal length, got {self.shapes!r}, {self.dtypes!r}")
        shapes = tuple(tuple(check_int(f"{name}.shapes[{i}][{j}]", d, 1) for j, d in enumerate(sh)) for i, sh in enumerate(shapes))
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        object.__setattr__(self, "dtype_names", dtypes)
        _check_int(self, "page_size_padded", 1, allow_none=True)
        _check_int(self, "num_speculative_blocks", 0)
        _check_int(self, "num_prefill_checkpoint_blocks", 0)
        _check_int(self, "prefill_checkpoint_alignment", 1, allow_none=True)
        if self.page_size_padded is not None and self.page_size_padded < self.state_size_bytes:
            raise ValueError(f"{name}.page_size_padded = {self.page_size_padded} is smaller than the state ({self.state_size_bytes} bytes)")

    @property
    def type_name(self) -> str:
        return "mamba"

    @property
    def state_size_bytes(self) -> int:
        return sum(prod(s) * DTYPE_SIZES[d] for s, d in zip(self.shapes, self.dtype_names))

    # A state's page viewed as vLLM 0.33's [B, H, N, C]: one head slot, one state, the
    # state's bytes as content -- whatever the block size.
    @property
    def num_heads(self) -> int:
        return 1

    @property
    def state_content_size_bytes(self) -> int:
        return self.state_size_bytes

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        return 1

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """A few states, whatever the length: the running one and one per speculative token;
        in ``"align"`` mode also the one being written at a block boundary and the prefill
        checkpoints. vLLM 0.33 reads the mode from ``vllm_config.cache_config``, not from the
        spec (the engine sets both from the same option)."""
        if _config_value(vllm_config, "cache_config.mamba_cache_mode") == "align":
            return self.page_size_bytes * (2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks)
        return self.page_size_bytes * (1 + self.num_speculative_blocks)

    @property
    def page_size_bytes(self) -> int:
        """One state per block, whatever the block size (padded to the pool's page size)."""
        return self.page_size_padded if self.page_size_padded is not None else self.state_size_bytes


def get_mamba_prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool, num_hash_lookahead_tokens: int = 0
) -> int:
    """Where a prefill of ``num_tokens`` tokens saves its reusable Mamba state (vLLM 0.33): the last hash boundary below the last token
    (whose logits must be computed) -- below the last L tokens with lookahead hashes, since
    a hash there needs the L tokens after it -- or, with EAGLE, which recomputes one hash
    block, one hash block below the last boundary within the prompt."""
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def is_mamba_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a backend can export the state at ``checkpoint_position`` from inside the
    chunk ``[query_start, query_end)`` (vLLM 0.33): the chunk starts on a hash boundary, the
    position lies at least one hash block into it, a multiple of ``checkpoint_alignment``
    from its start, and in a block column of its own, left of the chunk's last one."""
    if checkpoint_alignment is None:
        return False
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


KV_CACHE_SPEC_TYPES: tuple[type[KVCacheSpec], ...] = (
    FullAttentionSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    CircularBufferSpec,
    HiddenStateCacheSpec,
    RSWASpec,
    SlidingWindowSpec,
    SlidingWindowMLASpec,
    ChunkedLocalAttentionSpec,
    MambaSpec,
    CrossAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
)


# --- how KV cache events name a group's spec (vLLM's KVCacheSpecKind values) -----------------
# By class name, most specific first along the MRO, so a spec class added later with vLLM's
# name (MLAAttentionSpec, MambaSpec, ...) is named correctly without touching this table.
class KVCacheSpecKind(str, Enum):
    """The kinds a ``BlockStored`` event names (vLLM 0.33's ``KVCacheSpecKind``). The
    events carry the plain strings; a member equals its string."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


def _uniform_with(spec: KVCacheSpec, other: KVCacheSpec) -> bool:
    """Whether two layers need the same token slots, so one block table serves both
    (vLLM 0.33's ``is_uniform_with_collection``): full attention of any kind (MLA, sinks)
    with full attention, windows of one size, chunks of one size, rings with rings; any
    other kind with its own class only."""
    if isinstance(spec, SlidingWindowSpec):
        return isinstance(other, SlidingWindowSpec) and other.sliding_window == spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return isinstance(other, ChunkedLocalAttentionSpec) and other.attention_chunk_size == spec.attention_chunk_size
    for family in (FullAttentionSpec, CircularBufferSpec):
        if isinstance(spec, family):
            return isinstance(other, family)
    return type(other) is type(spec)


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One group's layers when they need the same token slots but store different shapes
    (vLLM 0.33; DeepSeek-V4's MLA layers of several head sizes): one block table, and a
    block's page is every layer's page side by side. The workers keep the per-layer specs;
    the scheduler's config replaces the wrapper by its first spec
    (:func:`kvlab.core.kv_cache_utils.generate_scheduler_kv_cache_config`), since the block
    manager needs only the type -- and a ``KVCacheManager`` built from a config does the same."""

    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def type_name(self) -> str:
        return self.first_spec.type_name

    @property
    def dcp_sharded(self) -> bool:
        return bool(self.kv_cache_specs) and bool(getattr(self.first_spec, "dcp_sharded", False))

    @property
    def prefix_cacheable(self) -> bool:
        return all(s.prefix_cacheable for s in self.kv_cache_specs.values())

    @property
    def prefix_replay_tokens(self) -> int:
        return max((s.prefix_replay_tokens for s in self.kv_cache_specs.values()), default=0)

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The most blocks any wrapped layer needs, each block a page of every layer."""
        return self._pages(max(cdiv(s.max_memory_usage_bytes(vllm_config), s.page_size_bytes) for s in self.kv_cache_specs.values()))

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """One block size, one DCP sharding, and every layer uniform with the first."""
        specs = list(kv_cache_specs.values())
        if not specs or len({s.block_size for s in specs}) > 1 or len({getattr(s, "dcp_sharded", False) for s in specs}) > 1:
            return False
        return all(_uniform_with(specs[0], s) for s in specs)

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The wrapper of these layers, or None when they cannot share a block table."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        return cls(block_size=next(iter(kv_cache_specs.values())).block_size, kv_cache_specs=dict(kv_cache_specs))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "uniform_type",
            "block_size": self.block_size,
            "kv_cache_specs": {k: s.to_dict() for k, s in self.kv_cache_specs.items()},
        }


def iter_layer_specs(kv_cache_spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """The per-layer specs a group's spec stands for: the wrapped ones of a
    :class:`UniformTypeKVCacheSpecs`, else the spec itself (vLLM 0.33)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        return tuple(kv_cache_spec.kv_cache_specs.values())
    return (kv_cache_spec,)


def is_full_attention_spec(kv_cache_spec: KVCacheSpec) -> bool:
    """Whether the group is full attention, wrapper or not: every layer (at least one) a
    ``FullAttentionSpec`` (MLA and sinks included)."""
    layers = iter_layer_specs(kv_cache_spec)
    return bool(layers) and all(isinstance(s, FullAttentionSpec) for s in layers)


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
    ("unknown" for a spec vLLM has no kind for, or a wrapper of layers of several kinds)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        kinds = {get_kv_cache_spec_kind(s) for s in kv_cache_spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else "unknown"
    for cls in type(kv_cache_spec).__mro__:
        kind = _SPEC_KIND_BY_CLASS_NAME.get(cls.__name__)
        if kind is not None:
            return kind
    return "unknown"


def get_kv_cache_spec_sliding_window(kv_cache_spec: object) -> int | None:
    """``kv_cache_spec_sliding_window`` of a ``BlockStored`` event: the window of a
    sliding-window spec (every wrapped layer's, when they agree), else None."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        windows = {get_kv_cache_spec_sliding_window(s) for s in kv_cache_spec.kv_cache_specs.values()}
        return windows.pop() if len(windows) == 1 else None
    if any(c.__name__ == "SlidingWindowSpec" for c in type(kv_cache_spec).__mro__):
        return kv_cache_spec.sliding_window  # type: ignore[attr-defined]  # a SlidingWindowSpec, matched by class name
    return None


@dataclass(frozen=True)
class KVCacheTensor:
    """Where a set of layers lives in the one backing allocation of ``size`` bytes: layer
    ``l``'s page of block ``b`` starts at ``offset + l * layer_stride + b * block_stride``
    (vLLM 0.33: ``KVCacheTensor`` in ``vllm/v1/kv_cache_interface.py``)."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0
    #: The allocation lives in host memory: HiSparse's source pool (vLLM 0.33).
    host_resident: bool = False


class KVCacheGroupRole(str, Enum):
    """What part a group plays in HiSparse (vLLM 0.33): its source K/V, kept whole in the
    host pool, or its indexer keys, kept whole on the GPU; every other group is ``DEFAULT``."""

    DEFAULT = "default"
    HISPARSE_SOURCE = "hisparse_source"
    HISPARSE_INDEXER = "hisparse_indexer"


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec they share (``layer_names`` is empty
    in the config a ``KVCacheManager`` reports: kvlab's manager is built from specs alone).
    Mutable, as vLLM's is: a manager reads it once, when it is built."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    #: The group holds an EAGLE drafter's layers (vLLM 0.33): only such groups give back the
    #: last block of a hit, which the drafter recomputes. When EAGLE is on and no group is
    #: flagged, every group does (vLLM's fallback).
    is_eagle_group: bool = False
    #: The group's blocks come from HiSparse's host pool, not the GPU pool (vLLM 0.33).
    host_resident: bool = False
    #: Whether a KV connector moves this group's blocks (vLLM 0.33); a group kept out of
    #: transfers is left out of every block-id list a connector is handed.
    enable_kv_transfer: bool = True
    role: KVCacheGroupRole = KVCacheGroupRole.DEFAULT


@dataclass
class KVCacheConfig:
    """What the engine core hands every worker: how many blocks, where each layer's pages
    lie, and which layers form a group (vLLM 0.33's field names). The worker allocates its
    paged caches from it (``ModelRunner.initialize_kv_cache``), so the block count and the
    block size are decided once, where the KV-cache manager is built."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    # vLLM 0.33's other fields, read by ``KVCacheManager(kv_cache_config, ...)``: how densely
    # window and Mamba groups keep cache entries (see KVCacheManager), the layout the worker
    # resolved, the hash block size and hit alignment the engine core chose (None: derived
    # from the groups), and HiSparse's host pool: its blocks, the bytes between two of them,
    # and whether the tensor-parallel ranks of one node share it (the manager builds the host
    # pool from ``hisparse_host_num_blocks``; the other two concern the worker's tensors).
    prefix_cache_retention_interval: int | None = None
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    hisparse_host_num_blocks: int | None = None
    hisparse_host_block_stride: int | None = None
    hisparse_shared_host_pool: bool = False
    #: How many consecutive tensor-parallel ranks hold the same bytes in every layer (vLLM
    #: 0.33; :func:`kvlab.core.kv_cache_planning.kv_cache_groups_tp_replicas`): MLA's one
    #: latent head is copied on every rank, so an offload may keep one copy for all of them.
    kv_tp_replicas: int = 1

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: its page in every layer."""
        group = self.kv_cache_groups[0]
        return group.kv_cache_spec.page_size_bytes * len(group.layer_names)

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        """The groups a KV connector moves (``enable_kv_transfer``), in group order."""
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.enable_kv_transfer)

    @property
    def transfer_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(self.kv_cache_groups[i] for i in self.transfer_group_ids)

    @property
    def transfer_group_index_by_layer(self) -> dict[str, int]:
        """Each transferred layer's index into :attr:`transfer_groups`."""
        return {name: i for i, g in enumerate(self.transfer_groups) for name in g.layer_names}

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        """Transferred groups whose blocks are stored by hash: not scratch state (a ring)."""
        return tuple(i for i in self.transfer_group_ids if self.kv_cache_groups[i].kv_cache_spec.prefix_cacheable)

    @property
    def prefix_cacheable_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(self.kv_cache_groups[i] for i in self.prefix_cacheable_group_ids)

    def select_transfer_block_ids(self, block_ids: Sequence[list[int]]) -> tuple[list[int], ...]:
        """The block-id lists of the transferred groups, from one list per group."""
        if len(block_ids) != len(self.kv_cache_groups):
            raise ValueError(f"block_ids must hold one list per KV cache group ({len(self.kv_cache_groups)}), got {len(block_ids)}")
        return tuple(block_ids[i] for i in self.transfer_group_ids)

    @property
    def has_mamba_layers(self) -> bool:
        return any(isinstance(s, MambaSpec) for g in self.kv_cache_groups for s in iter_layer_specs(g.kv_cache_spec))

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        """Attention groups that store K/V in more than one way: another dtype (say bf16 and
        fp8), or the same dtype quantised another way (``kv_quant_mode``)."""
        kinds = {
            (s.dtype_name, s.kv_quant_mode)
            for g in self.kv_cache_groups
            for s in iter_layer_specs(g.kv_cache_spec)
            if isinstance(s, AttentionSpec)
        }
        return len(kinds) > 1

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether attention blocks must be zeroed when they are handed out (vLLM 0.33). One
        pool serves every group, so a reused block may hold bytes another group wrote: a
        Mamba state, or K/V in another dtype. Attention masks unused slots, but stale bytes
        can decode as NaN or Inf, and NaN times a zero weight is still NaN. A pool of one
        kind and one dtype never needs it."""
        return self.has_mamba_layers or self.has_mixed_precision_kv_cache

    def layer_view_shape(self) -> tuple[int, int, int, int]:
        """The shape each layer's cache is viewed with in vLLM 0.33:
        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K and V side by side in the
        last axis; the resolved layout decides the order in memory)."""
        spec = self.kv_cache_groups[0].kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"layer_view_shape: the first group is a {type(spec).__name__}, not an attention spec")
        v = spec.head_size if spec.head_size_v is None else spec.head_size_v
        block_size = cast(int, spec.block_size)  # set: get_kv_cache_config read the spec's page size
        return (self.num_blocks, spec.num_kv_heads, block_size, spec.head_size + v)

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks the pool behind ``tensor`` holds: the GPU pool's, or HiSparse's host pool's
        for a host-resident tensor (vLLM 0.33)."""
        if not tensor.host_resident:
            return self.num_blocks
        if self.hisparse_host_num_blocks is None:
            raise ValueError(f"tensor of layers {list(tensor.layers)} is host-resident but hisparse_host_num_blocks is None")
        return self.hisparse_host_num_blocks


def compute_layer_kv_cache_shape_bytes(
    spec: KVCacheSpec, num_blocks: int, kernel_block_size: int | None = None
) -> tuple[int, int, int, int]:
    """One layer's logical shape ``(B, H, N, C)``, ``C`` in bytes (vLLM 0.33).

    A backend whose kernel reads smaller blocks than the manager hands out (``kernel_block_size``
    dividing ``block_size``) sees each manager block as ``block_size // kernel_block_size``
    kernel blocks of fewer states; the bytes are the same, only the view is finer."""
    block_size = spec._block_size()
    kernel = block_size if kernel_block_size is None else check_int("kernel_block_size", kernel_block_size, 1)
    if block_size % kernel:
        raise ValueError(f"kernel_block_size {kernel} must divide the spec's block_size {block_size}")
    return (num_blocks * (block_size // kernel), spec.num_heads, spec.get_num_kernel_states(kernel), spec.state_content_size_bytes)  # type: ignore[attr-defined]


def compute_layout_strides(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    layout: KVCacheLayout,
    kernel_block_size: int | None = None,
    fixed_strides: tuple[int | None, ...] = (None,) * 5,
) -> tuple[int, ...]:
    """Byte strides of ``[L, B, H, N, C]`` (in that logical order) for ``layout`` (vLLM 0.33).

    Walk the axes from the innermost in memory outwards: each axis's stride is the bytes of
    everything inside it, unless ``fixed_strides`` pins it (an allocation that interleaves other
    groups' layers fixes ``L`` and ``B``). A padded page (``page_size_padded``) widens the step
    at the innermost of ``L`` and ``B`` to the padded size, so every page starts on a page
    boundary -- which needs every axis outside the page to be ``L``, ``B`` or of size 1."""
    if len(fixed_strides) != 5 or any(x is not None and x <= 0 for x in fixed_strides):
        raise ValueError(f"fixed_strides must be 5 positive strides or None, got {fixed_strides!r}")
    shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size))
    order = layout.stride_order
    padded = getattr(spec, "page_size_padded", None)
    page_end = max(order.index(_DIM_L), order.index(_DIM_B)) + 1  # physical axes before the page's bytes
    if padded is not None:
        if kernel_block_size is not None and kernel_block_size != spec.block_size:
            raise ValueError("a padded page cannot be split into kernel blocks")
        if prod(shape[d] for d in order[:page_end]) != num_layers * num_blocks:
            raise ValueError(
                f"{layout.name} puts an axis of size > 1 outside the page; a padded page needs only L and B there (shape {shape})"
            )
    strides = [0] * 5
    step = 1
    for position in range(4, -1, -1):
        axis = order[position]
        if padded is not None and position == page_end - 1:
            step = max(step, padded)
        strides[axis] = fixed_strides[axis] or step
        step = strides[axis] * shape[axis]
    return tuple(strides)


__all__ = [
    "KVCacheLayout",
    "compute_layer_kv_cache_shape_bytes",
    "compute_layout_strides",
    "KVCacheSpecKind",
    "KVQuantMode",
    "DTYPE_SIZES",
    "KVCacheConfig",
    "KVCacheGroupRole",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "SparseCacheRole",
    "KVCacheSpec",
    "AttentionSpec",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "CircularBufferSpec",
    "HiddenStateCacheSpec",
    "SlidingWindowSpec",
    "SlidingWindowMLASpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
    "CrossAttentionSpec",
    "KV_CACHE_SPEC_TYPES",
    "get_kv_cache_spec_kind",
    "UniformTypeKVCacheSpecs",
    "iter_layer_specs",
    "is_full_attention_spec",
    "get_kv_cache_spec_sliding_window",
]
