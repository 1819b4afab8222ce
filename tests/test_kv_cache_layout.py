"""vLLM 0.33's physical KV-cache layouts (``KVCacheLayout``), the stride arithmetic that places
the logical ``[L, B, H, N, C]`` axes in memory, and the one-buffer allocation with a view per
layer (``allocate_kv_cache``). Every expected stride below is worked out by hand in the comment
beside it: a float16 attention layer, 16-token blocks, 2 KV heads of 64 -> a (head, token)
cell of (64 + 64) x 2 = 256 bytes, a page of 2 x 16 x 256 = 8,192 bytes."""

from __future__ import annotations

import pytest
import torch

from kvlab.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
)
from kvlab.worker.kv_cache_views import allocate_kv_cache, create_kv_cache_views

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
L, B = 3, 10


@pytest.mark.parametrize(
    "layout, layer_compact, block_contiguous, block_compact, block_outermost, layer_view_order",
    [
        (KVCacheLayout.LBHNC, True, True, True, False, (0, 1, 2, 3)),
        (KVCacheLayout.LBNHC, True, False, True, False, (0, 2, 1, 3)),
        (KVCacheLayout.LHBNC, True, False, False, False, (1, 0, 2, 3)),
        (KVCacheLayout.BLHNC, False, True, True, True, (0, 1, 2, 3)),
        (KVCacheLayout.BLNHC, False, False, True, True, (0, 2, 1, 3)),
        (KVCacheLayout.BHLNC, False, False, False, True, (0, 1, 2, 3)),
    ],
)
def test_each_layout_says_what_a_block_copy_can_count_on(
    layout, layer_compact, block_contiguous, block_compact, block_outermost, layer_view_order
):
    got = (layout.is_layer_compact, layout.is_block_contiguous, layout.is_block_compact, layout.is_block_outermost)
    assert got == (layer_compact, block_contiguous, block_compact, block_outermost)
    assert layout.layer_view_order == layer_view_order


def test_a_layers_logical_shape_counts_content_in_bytes_and_splits_kernel_blocks():
    assert compute_layer_kv_cache_shape_bytes(SPEC, B) == (10, 2, 16, 256)
    assert compute_layer_kv_cache_shape_bytes(SPEC, B, kernel_block_size=8) == (20, 2, 8, 256)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=("float32",))
    assert compute_layer_kv_cache_shape_bytes(mamba, B) == (10, 1, 1, 128)  # one state of 4 x 8 x 4 bytes
    with pytest.raises(ValueError, match="kernel_block_size 5 must divide the spec's block_size 16"):
        compute_layer_kv_cache_shape_bytes(SPEC, B, kernel_block_size=5)
    with pytest.raises(ValueError, match="kernel_block_size must be"):
        compute_layer_kv_cache_shape_bytes(SPEC, B, kernel_block_size=0)
    with pytest.raises(ValueError, match="block_size is None"):
        compute_layer_kv_cache_shape_bytes(FullAttentionSpec(num_kv_heads=2, head_size=64), B)


@pytest.mark.parametrize(
    "layout, strides",
    [
        # innermost first: C 1, then N 256, H 16 x 256, B 2 x 4096, L 10 x 8192
        (KVCacheLayout.LBHNC, (81920, 8192, 4096, 256, 1)),
        # C 1, H 256, N 2 x 256, B 16 x 512, L 10 x 8192
        (KVCacheLayout.LBNHC, (81920, 8192, 256, 512, 1)),
        # C 1, N 256, B 16 x 256, H 10 x 4096, L 2 x 40960: a block is split across the heads
        (KVCacheLayout.LHBNC, (81920, 4096, 40960, 256, 1)),
        # C 1, N 256, H 4096, L 2 x 4096, B 3 x 8192: a block of every layer is one run
        (KVCacheLayout.BLHNC, (8192, 24576, 4096, 256, 1)),
        # C 1, N 256, L 16 x 256, H 3 x 4096, B 2 x 12288
        (KVCacheLayout.BHLNC, (4096, 24576, 12288, 256, 1)),
    ],
)
def test_strides_follow_the_layout_from_the_innermost_axis_out(layout, strides):
    assert compute_layout_strides(SPEC, B, L, layout) == strides


def test_fixed_strides_padding_and_kernel_blocks():
    # An allocation that interleaves two groups' layers pins L and B; the rest follows the layout.
    pinned = (100_000, 20_000, None, None, None)
    assert compute_layout_strides(SPEC, B, L, KVCacheLayout.LBNHC, fixed_strides=pinned) == (100_000, 20_000, 256, 512, 1)
    # A padded page widens the block step to the padded size: 8,192 -> 9,000 bytes.
    padded = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16", page_size_padded=9000)
    assert compute_layout_strides(padded, B, L, KVCacheLayout.LBHNC) == (90000, 9000, 4096, 256, 1)
    with pytest.raises(ValueError, match="LHBNC puts an axis of size > 1 outside the page"):
        compute_layout_strides(padded, B, L, KVCacheLayout.LHBNC)
    with pytest.raises(ValueError, match="a padded page cannot be split into kernel blocks"):
        compute_layout_strides(padded, B, L, KVCacheLayout.LBHNC, kernel_block_size=8)
    # 8-token kernel blocks: 20 blocks of 2 x 8 x 256 = 4,096 bytes.
    assert compute_layout_strides(SPEC, B, L, KVCacheLayout.LBHNC, kernel_block_size=8) == (81920, 4096, 2048, 256, 1)
    with pytest.raises(ValueError, match="fixed_strides must be 5 positive strides"):
        compute_layout_strides(SPEC, B, L, KVCacheLayout.LBHNC, fixed_strides=(0, None, None, None, None))


SMALL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")  # cell 32 bytes, page 128
PAGE = 128


def _packed_config(num_blocks: int = 3) -> KVCacheConfig:
    """Two attention layers packed in one allocation -- block b holds layer a's page, then
    layer b's -- and a scratch ring group with no tensor of its own."""
    tensor = KVCacheTensor(size=2 * PAGE * num_blocks, layers=("a", "b"), layer_stride=PAGE, block_stride=2 * PAGE)
    scratch = CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    groups = (KVCacheGroupSpec(("a", "b"), SMALL), KVCacheGroupSpec(("scratch",), scratch))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(tensor,), kv_cache_groups=groups)


def test_a_packed_allocation_interleaves_the_layers_pages_block_by_block():
    caches = allocate_kv_cache(_packed_config(), "cpu", KVCacheLayout.LBNHC)
    assert sorted(caches) == ["a", "b"]  # the scratch group has no tensor: no view
    a, b = caches["a"], caches["b"]
    assert (tuple(a.shape), a.dtype, a.stride()) == ((3, 1, 4, 16), torch.float16, (128, 16, 16, 1))  # element strides
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert (b.storage_offset() - a.storage_offset()) * 2 == PAGE  # b's block 0 starts one page after a's
    b[2].fill_(7.0)
    raw = torch.empty(0, dtype=torch.int8).set_(a.untyped_storage())
    block2 = raw[2 * 2 * PAGE : 3 * 2 * PAGE].view(torch.float16)
    assert block2[:64].eq(0).all() and block2[64:].eq(7).all()  # a's page of block 2 untouched, then b's
    assert a.eq(0).all() and b[:2].eq(0).all()


def test_allocation_refusals_and_a_spec_that_lays_out_its_own_bytes():
    config = _packed_config()
    with pytest.raises(
        ValueError, match=r"layers \['a', 'b'\] does not keep a layer's block as one dense page \(block_stride 256 bytes, page 128"
    ):
        allocate_kv_cache(config, "cpu", KVCacheLayout.LBNHC, kernel_block_sizes=[2, 4])
    t1 = KVCacheTensor(size=256, layers=("a",), layer_stride=128, block_stride=128)
    t2 = KVCacheTensor(size=512, layers=("b",), layer_stride=128, block_stride=128)
    uneven = KVCacheConfig(num_blocks=2, kv_cache_tensors=(t1, t2), kv_cache_groups=(KVCacheGroupSpec(("a", "b"), SMALL),))
    with pytest.raises(ValueError, match=r"same backing allocation; sizes \[256, 512\]"):
        allocate_kv_cache(uneven, "cpu", KVCacheLayout.LBNHC)
    hot = HiSparseHotSpec(block_size=4, page_size=PAGE, blocks_per_request=2)
    own = KVCacheConfig(num_blocks=2, kv_cache_tensors=(t1,), kv_cache_groups=(KVCacheGroupSpec(("a",), hot),))
    [(name, buf)] = allocate_kv_cache(own, "cpu", KVCacheLayout.LBNHC).items()
    assert (name, tuple(buf.shape), buf.dtype) == ("a", (256,), torch.int8)  # the raw buffer, laid out by its owner
    with pytest.raises(ValueError, match="raw must be a flat int8 buffer"):
        create_kv_cache_views(torch.zeros(4), SMALL, 2, KVCacheLayout.LBNHC, t1)


def test_kernel_blocks_split_a_dense_page_into_equal_halves():
    tensor = KVCacheTensor(size=2 * PAGE * 2, layers=("a", "b"), layer_stride=2 * PAGE, block_stride=PAGE)
    config = KVCacheConfig(num_blocks=2, kv_cache_tensors=(tensor,), kv_cache_groups=(KVCacheGroupSpec(("a", "b"), SMALL),))
    caches = allocate_kv_cache(config, "cpu", KVCacheLayout.LBHNC, kernel_block_sizes=[2])
    a = caches["a"]
    assert (tuple(a.shape), a.stride()) == ((4, 1, 2, 16), (32, 32, 16, 1))  # 4 kernel blocks of 64 bytes
    a[1].fill_(1.0)  # the second half of manager block 0
    assert a.view(2, -1)[0].tolist() == [0.0] * 32 + [1.0] * 32
