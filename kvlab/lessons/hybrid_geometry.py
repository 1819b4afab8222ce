"""Lesson 07b, section 4: the block size of a real hybrid model, as vLLM 0.33 works it out.

One pool of pages serves every group, and one block of a Mamba (or linear-attention) group
holds one whole recurrent state. So a page must hold a state, and vLLM gets there from the
attention side: at start-up (``Platform._align_hybrid_block_size`` in
``vllm/platforms/interface.py``) it raises the attention block size, in multiples of what the
attention kernel supports, until one attention page (``block_size`` tokens of one layer) is at
least one state; in ``mamba_cache_mode="align"`` the Mamba group gets that same block size,
and the state's page is padded up to the attention page. For Qwen3-Next that is 544 tokens
per block, where a plain model has 16.

The inputs are plain numbers from the model's ``config.json``; the state shapes follow vLLM's
``MambaStateShapeCalculator.gated_delta_net_state_shape`` (the Gated DeltaNet layers of
Qwen3-Next), sharded over tensor-parallel ranks as vLLM shards them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.kv_cache_interface import DTYPE_SIZES, FullAttentionSpec, MambaSpec
from kvlab.utils.checks import check_int
from kvlab.utils.math_utils import cdiv

__all__ = ["HybridGeometry", "LinearAttentionShape", "QWEN3_NEXT_80B_A3B", "align_hybrid_block_size", "hybrid_geometry"]


@dataclass(frozen=True)
class LinearAttentionShape:
    """A hybrid of full-attention layers and Gated DeltaNet (linear attention) layers, with
    the fields of its ``config.json`` that size the KV cache."""

    name: str
    num_layers: int
    full_attention_interval: int  # every n-th layer is full attention, the others linear
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    dtype: str = "bfloat16"

    @property
    def num_full_attention_layers(self) -> int:
        return self.num_layers // self.full_attention_interval

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One linear layer's state on one rank: the convolution's last ``kernel - 1`` inputs
        over the q, k and v channels, and the recurrent state, one ``head_v x head_k`` matrix
        per value head. Both are split across the ranks."""
        tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
        conv_dim = self.linear_key_head_dim * self.linear_num_key_heads * 2 + self.linear_value_head_dim * self.linear_num_value_heads
        if conv_dim % tp or self.linear_num_value_heads % tp:
            raise ValueError(f"tensor_parallel_size = {tp} does not divide {self.name}'s linear-attention heads")
        return (self.linear_conv_kernel_dim - 1, conv_dim // tp), (
            self.linear_num_value_heads // tp,
            self.linear_value_head_dim,
            self.linear_key_head_dim,
        )


#: Qwen/Qwen3-Next-80B-A3B-Instruct, from its ``config.json``: 48 layers, every 4th one full
#: attention (2 KV heads of 256), the others Gated DeltaNet (16 key heads and 32 value heads of
#: 128, a convolution of width 4), in bf16.
QWEN3_NEXT_80B_A3B = LinearAttentionShape("Qwen3-Next-80B-A3B", 48, 4, 2, 256, 16, 32, 128, 128, 4)


def align_hybrid_block_size(
    attn_page_size_1_token: int, mamba_page_size: int, block_size: int = 16, kernel_block_alignment: int = 16
) -> int:
    """vLLM 0.33's rule: the smallest multiple of the kernel's block alignment (at least the
    configured ``block_size``) whose attention page holds one state -- or ``block_size``
    itself when that is larger already."""
    a = check_int("attn_page_size_1_token", attn_page_size_1_token, 1)
    m = check_int("mamba_page_size", mamba_page_size, 1)
    bs = check_int("block_size", block_size, 1)
    align = max(check_int("kernel_block_alignment", kernel_block_alignment, 1), bs)
    return max(bs, align * cdiv(m, align * a))


@dataclass(frozen=True)
class HybridGeometry:
    """What start-up decides for one rank of a hybrid server."""

    model: str
    tensor_parallel_size: int
    attn_bytes_per_token: int  # one full-attention layer, K and V
    state_bytes: int  # one linear layer's state
    block_size: int  # tokens per block, in both groups
    page_size: int  # bytes of one block of one layer
    specs: tuple[FullAttentionSpec, MambaSpec]  # one group of each kind

    @property
    def padding_pct(self) -> float:
        """How much larger the state's page is than the state (vLLM logs this)."""
        return 100 * (self.page_size - self.state_bytes) / self.state_bytes


def hybrid_geometry(shape: LinearAttentionShape, tensor_parallel_size: int = 1, block_size: int = 16) -> HybridGeometry:
    """The block size and the two specs of ``shape`` on one of ``tensor_parallel_size`` ranks
    (FlashAttention's kernel blocks: multiples of 16). KV heads are split across the ranks, at
    least one each."""
    tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    kv_heads = max(1, shape.num_kv_heads // tp)
    attention = FullAttentionSpec(block_size=1, num_kv_heads=kv_heads, head_size=shape.head_dim, dtype=shape.dtype)
    shapes = shape.state_shapes(tp)
    state = MambaSpec(block_size=1, shapes=shapes, dtypes=(shape.dtype, shape.dtype))
    attn_1 = attention.page_size_bytes
    bs = align_hybrid_block_size(attn_1, state.state_size_bytes, block_size)
    page = bs * attn_1
    specs = (
        FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=shape.head_dim, dtype=shape.dtype),
        MambaSpec(block_size=bs, shapes=shapes, dtypes=(shape.dtype, shape.dtype), page_size_padded=page),
    )
    assert DTYPE_SIZES[shape.dtype] * 2 * kv_heads * shape.head_dim == attn_1
    return HybridGeometry(shape.name, tp, attn_1, state.state_size_bytes, bs, page, specs)
