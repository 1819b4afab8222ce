"""vLLM 0.33's call shapes, taken by kvlab's classes as they are (vLLM's own tests call them
this way): specs with torch dtypes, ``kv_quant_mode`` and ``page_size_padded``; a
``KVCacheManager`` built from a ``KVCacheConfig``; a ``Request`` built from
``SamplingParams`` / ``PoolingParams`` / ``LoRARequest`` objects; the request hasher's third
argument; a single-type manager told ``needs_kv_cache_zeroing``; a connector registered by
module path.

The vLLM objects are stand-ins with vLLM's attribute names (kvlab does not import vLLM).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvlab import KVCacheManager, Request
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_utils import get_request_block_hasher
from kvlab.core.single_type_kv_cache_manager import CircularBufferManager, FullAttentionManager, SlidingWindowManager
from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvlab.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from kvlab.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvlab.utils import hashing


# -- specs -----------------------------------------------------------------------------------
def test_specs_keep_a_torch_dtype_as_given_and_compare_by_its_plain_name():
    # vLLM's backends read spec.dtype as a torch dtype (get_dtype_size, customize_spec)
    spec = FullAttentionSpec(block_size=4, dtype=torch.float32)
    assert spec.dtype is torch.float32 and spec.dtype_name == "float32"
    assert FullAttentionSpec(block_size=4, dtype=torch.float8_e4m3fn).dtype_name == "fp8_e4m3"
    mamba = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=(torch.bfloat16,))
    assert mamba.dtypes == (torch.bfloat16,) and mamba.dtype_names == ("bfloat16",) and mamba.page_size_bytes == 12
    # the same spec, given either way: equal, one hash, one dict (the plain names)
    by_name = FullAttentionSpec(block_size=4, dtype="float16")
    assert FullAttentionSpec(block_size=4, dtype=torch.float16) == by_name
    assert hash(FullAttentionSpec(block_size=4, dtype=torch.float16)) == hash(by_name)
    assert (
        FullAttentionSpec(block_size=4, dtype=torch.float16).to_dict()
        == by_name.to_dict()
        == {"type": "full", "block_size": 4, "dtype": "float16"}
    )
    assert mamba.to_dict()["dtypes"] == ["bfloat16"]
    assert FullAttentionSpec(block_size=4, dtype=torch.uint8).dtype_name == "uint8"  # quantised caches are raw bytes
    # a spec built by name keeps the name
    assert by_name.dtype == "float16"
    with pytest.raises(ValueError, match=r"dtype must be one of .*\(or the torch dtype of that name\), got torch.int16"):
        FullAttentionSpec(block_size=4, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"dtype must be one of .* got \['float32'\]"):
        FullAttentionSpec(block_size=4, dtype=["float32"])  # type: ignore[arg-type]


def test_a_mamba_shape_given_bare_is_one_state_tensor():
    spec = MambaSpec(block_size=4, shapes=(2, 5), dtypes=("float32",))
    assert spec.shapes == ((2, 5),) and spec.state_size_bytes == 40


def test_kv_quant_mode_makes_mixed_precision_and_zeroing():
    plain = FullAttentionSpec(block_size=4, dtype="fp8")
    scaled = SlidingWindowSpec(block_size=4, dtype="fp8", sliding_window=8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    same = KVCacheConfig(
        4, (), (KVCacheGroupSpec(("a",), plain), KVCacheGroupSpec(("b",), SlidingWindowSpec(block_size=4, dtype="fp8", sliding_window=8)))
    )
    mixed = KVCacheConfig(4, (), (KVCacheGroupSpec(("a",), plain), KVCacheGroupSpec(("b",), scaled)))
    assert (same.has_mixed_precision_kv_cache, same.needs_kv_cache_zeroing) == (False, False)
    assert (mixed.has_mixed_precision_kv_cache, mixed.needs_kv_cache_zeroing) == (True, True)
    assert FullAttentionSpec(block_size=4, kv_quant_mode=3).kv_quant_mode is KVQuantMode.FP8_PER_TOKEN_HEAD
    assert FullAttentionSpec(block_size=4, kv_quant_mode=1).to_dict() == {"type": "full", "block_size": 4, "kv_quant_mode": 1}
    with pytest.raises(ValueError, match="kv_quant_mode must be a KVQuantMode, got 99"):
        FullAttentionSpec(block_size=4, kv_quant_mode=99)


def test_page_size_padded_on_attention_specs():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    assert spec.page_size_bytes == spec.real_page_size_bytes == 16 * 2 * 128 * 2
    padded = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", page_size_padded=10_000)
    assert (padded.real_page_size_bytes, padded.page_size_bytes) == (8192, 10_000)
    with pytest.raises(ValueError, match=r"page_size_padded = 8000 is smaller than the page's K/V \(8192 bytes\)"):
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", page_size_padded=8000)


# -- KVCacheManager(kv_cache_config, ...) ----------------------------------------------------
def _config(**extra):
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=4)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=8, sliding_window=8)),
    ]
    return KVCacheConfig(num_blocks=20, kv_cache_tensors=[], kv_cache_groups=groups, **extra)


def _ids(blocks):
    return [[b.block_id for b in g] for g in blocks.blocks]


def test_manager_from_a_config_equals_the_kvlab_form():
    vllm_form = KVCacheManager(_config(), max_model_len=256, enable_caching=True, hash_block_size=4, scheduler_block_size=8)
    kvlab_form = KVCacheManager(
        20, kv_cache_groups=[FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=8, sliding_window=8)], max_model_len=256
    )
    assert (vllm_form.num_blocks, vllm_form.hash_block_size, vllm_form.scheduler_block_size) == (20, 4, 8)
    for mgr in (vllm_form, kvlab_form):
        req = Request("r", list(range(30)))
        hits, n = mgr.get_computed_blocks(req)
        assert n == 0
        assert _ids(mgr.allocate_slots(req, 30, 0, hits)) == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]


def test_manager_reads_the_configs_retention_interval_and_hash_block_size():
    mgr = KVCacheManager(_config(prefix_cache_retention_interval=0, hash_block_size=4), max_model_len=256)
    assert mgr.coordinator.single_type_managers[1].retention_interval == 0
    assert mgr.hash_block_size == 4
    # a finer hash block than the groups' GCD is prefix_match_unit
    assert KVCacheManager(_config(), max_model_len=256, hash_block_size=2).hash_block_size == 2


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: KVCacheManager(_config(), 8192), TypeError, "give max_model_len and the rest by keyword"),
        (lambda: KVCacheManager(_config(), scheduler_block_size=4), ValueError, r"scheduler_block_size must be 8 \(the LCM"),
        (
            lambda: KVCacheManager(_config(), dcp_world_size=2),
            ValueError,
            r"dcp_world_size = 2: decode context parallelism supports full-attention, Mamba and replicated \(dcp_sharded=False\) "
            r"groups only \(vLLM 0.33\), got group 1: SlidingWindowSpec",
        ),
        (
            lambda: KVCacheManager(_config(), pcp_world_size=0),
            ValueError,
            "pcp_world_size=0 is out of range; pcp_world_size must be an int >= 1",
        ),
        (lambda: KVCacheManager(_config(), watermark=0.01), ValueError, r"watermark must be 0.0 \(kvlab models no admission watermark\)"),
        (lambda: KVCacheManager(_config(hisparse_host_num_blocks=8)), ValueError, "No HiSparse cache group is configured"),
        (
            lambda: KVCacheManager(_config(prefix_cache_retention_interval=0), prefix_cache_retention_interval=16),
            ValueError,
            "disagrees with the config's 0",
        ),
    ],
)
def test_manager_from_a_config_refuses_what_kvlab_does_not_model(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_groups_and_configs_are_mutable_as_vllms():
    cfg = _config()
    cfg.kv_cache_groups[0].kv_cache_spec = FullAttentionSpec(block_size=8)
    assert KVCacheManager(cfg).scheduler_block_size == 8


# -- Request(..., sampling_params=..., lora_request=...) --------------------------------------
def _sampling(max_tokens=17, **kw):
    base = dict(
        max_tokens=max_tokens, prompt_logprobs=None, skip_reading_prefix_cache=None, ignore_eos=False, eos_token_id=100, extra_args=None
    )
    return SimpleNamespace(**{**base, **kw})


def test_request_from_vllms_params_objects():
    lora = SimpleNamespace(lora_name="adapter", lora_int_id=3, lora_path="/ckpt")
    image = SimpleNamespace(identifier="img0", modality="image", mm_position=SimpleNamespace(offset=2, length=3, is_embed=None))
    r = Request(
        "a", list(range(8)), sampling_params=_sampling(), pooling_params=None, lora_request=lora, mm_features=[image], session_id="s1"
    )
    assert (r.max_tokens, r.eos_token_id, r.lora_name, r.lora_int_id, r.lora_path, r.session_id) == (17, 100, "adapter", 3, "/ckpt", "s1")
    assert [(f.identifier, f.offset, f.length) for f in r.mm_features] == [("img0", 2, 3)]
    assert r.skip_reading_prefix_cache is False and r.kv_cache_report_mode == "incremental"
    # vLLM 0.33's rules: prompt logprobs skip the cache read; ignore_eos drops the eos id;
    # extra_args carries the report mode; a pooling request makes one token
    r = Request("b", [1, 2], sampling_params=_sampling(prompt_logprobs=0, ignore_eos=True, extra_args={"kv_cache_report_mode": "full"}))
    assert (r.skip_reading_prefix_cache, r.eos_token_id, r.kv_cache_report_mode) == (True, None, "full")
    assert Request("c", [1, 2], pooling_params=SimpleNamespace(skip_reading_prefix_cache=None)).max_tokens == 1


def test_request_params_given_twice_are_refused():
    with pytest.raises(ValueError, match="max_tokens: given both directly and through vLLM's params objects"):
        Request("a", [1], sampling_params=_sampling(), max_tokens=3)
    with pytest.raises(ValueError, match="give sampling_params or pooling_params, not both"):
        Request("a", [1], sampling_params=_sampling(), pooling_params=SimpleNamespace())
    with pytest.raises(TypeError, match="sampling_params must be a vLLM SamplingParams, got dict"):
        Request("a", [1], sampling_params={"max_tokens": 3})
    with pytest.raises(TypeError, match="session_id must be None or a non-empty str, got 7"):
        Request("a", [1], session_id=7)  # type: ignore[arg-type]


def test_session_id_is_published_in_block_stored():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    req = Request("a", list(range(9)), session_id="chat-7")
    hits, _ = mgr.get_computed_blocks(req)
    mgr.allocate_slots(req, 9, 0, hits)
    stored = [e for e in mgr.take_events() if type(e).__name__ == "BlockStored"]
    assert [e.session_id for e in stored] == ["chat-7"]


# -- smaller shapes --------------------------------------------------------------------------
def test_request_block_hasher_takes_the_lookahead_third():
    hasher = get_request_block_hasher(4, hashing.sha256, 2)
    assert hasher.num_hash_lookahead_tokens == 2
    assert len(Request("r", list(range(10)), block_hasher=hasher).block_hashes) == 2  # a block needs 2 tokens past it
    with pytest.raises(TypeError):
        get_request_block_hasher(4, hashing.sha256, 0, lambda r, s, e: None)  # type: ignore[misc]


def test_single_type_manager_takes_needs_kv_cache_zeroing():
    pool = BlockPool(10, False, hash_block_size=4)
    full = FullAttentionManager(
        FullAttentionSpec(block_size=4), block_pool=pool, kv_cache_group_id=0, enable_caching=False, needs_kv_cache_zeroing=True
    )
    ids = [b.block_id for b in full.allocate_new_blocks("r", 8, 8)]
    assert full.records_new_block_ids and full.take_new_block_ids() == ids == [1, 2]
    # a ring overwrites its one block as it goes: never zeroed (vLLM 0.33)
    ring = CircularBufferManager(
        CircularBufferSpec(block_size=4), block_pool=pool, kv_cache_group_id=1, enable_caching=False, needs_kv_cache_zeroing=True
    )
    ring.allocate_new_blocks("r", 8, 8)
    assert not ring.records_new_block_ids and ring.take_new_block_ids() == []
    window = SlidingWindowManager(
        SlidingWindowSpec(block_size=4, sliding_window=4), block_pool=pool, kv_cache_group_id=2, enable_caching=False
    )
    assert not window.records_new_block_ids
    with pytest.raises(ValueError, match=r"dcp_world_size = 2: decode context parallelism .* got group 0: SlidingWindowSpec"):
        SlidingWindowManager(SlidingWindowSpec(block_size=4, sliding_window=4), block_pool=pool, kv_cache_group_id=3, dcp_world_size=2)
    sharded = FullAttentionManager(FullAttentionSpec(block_size=4), block_pool=pool, kv_cache_group_id=0, dcp_world_size=2)
    assert (sharded.block_size, sharded.dcp_world_size, sharded.kv_cache_spec.block_size) == (8, 2, 8)


def test_a_connector_registered_by_module_path(tmp_path, monkeypatch):
    from kvlab.distributed.kv_transfer.kv_connector import factory

    monkeypatch.setattr(factory, "_REGISTRY", dict(factory._REGISTRY))
    KVConnectorFactory.register_connector(
        "MyExample", "kvlab.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector"
    )
    config = KVTransferConfig("MyExample", kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    assert type(KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, 16)) is ExampleConnector
    with pytest.raises(ValueError, match="Connector 'MyExample' is already registered."):
        KVConnectorFactory.register_connector("MyExample", "x", "Y")
    with pytest.raises(TypeError, match="module_path must be a non-empty str, got ''"):
        KVConnectorFactory.register_connector("Other", "", "Y")


def _window_manager_with_request():
    mgr = KVCacheManager(
        num_blocks=40, kv_cache_groups=[FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=4)]
    )
    window = mgr.coordinator.single_type_managers[1]
    req = Request("q", list(range(100, 133)))
    req.bind_block_hasher(mgr.request_block_hasher)
    window.allocate_new_blocks("q", 33, 33)
    return window, req


def _cached_positions(window):
    return [i for i, b in enumerate(window.req_to_blocks["q"]) if b.cache_key is not None]


@pytest.mark.parametrize(
    ("kwargs", "cached"),
    [
        ({}, [0, 1, 2, 3, 4, 5, 6, 7]),  # the manager's own setting: dense
        ({"retention_interval": 0}, [7]),  # sparse: what a replay of the 33-token prompt can hit
        ({"retention_interval": 0, "replay_boundaries": (8,)}, [1]),  # a resume at token 8 needs block 1
        ({"retention_interval": 0, "replay_boundaries": ()}, []),
    ],
)
def test_cache_blocks_takes_vllms_per_call_retention(kwargs, cached):
    window, req = _window_manager_with_request()
    window.cache_blocks(req, 32, **kwargs)
    assert _cached_positions(window) == cached
    assert (window.retention_interval, window._replay_boundaries) == (None, None)  # only for that call


def test_pop_blocks_for_free_leaves_the_freeing_to_the_caller():
    window, _ = _window_manager_with_request()
    pool = window.block_pool
    free_before = pool.get_num_free_blocks()
    window.remove_skipped_blocks("q", processed_computed_tokens=33)  # vLLM's keyword
    freed_by_window = pool.get_num_free_blocks() - free_before
    blocks = window.pop_blocks_for_free("q")
    assert freed_by_window == 7 and [b.block_id for b in blocks] == [8, 9]  # the null head is dropped
    assert "q" not in window.req_to_blocks and pool.get_num_free_blocks() == free_before + 7
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == free_before + 9


def test_spec_kinds_equal_their_event_strings():
    from kvlab.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind

    assert get_kv_cache_spec_kind(SlidingWindowSpec(block_size=4, sliding_window=4)) == KVCacheSpecKind.SLIDING_WINDOW
    assert type(get_kv_cache_spec_kind(FullAttentionSpec(block_size=4))) is str  # the events carry plain strings
    assert [k.value for k in KVCacheSpecKind][:3] == ["full_attention", "mla_attention", "sliding_window"]


def test_a_full_attention_group_may_carry_a_window_as_vllms_does():
    spec = FullAttentionSpec(block_size=4, sliding_window=8)
    assert (spec.sliding_window, spec.attention_chunk_size, spec.type_name) == (8, None, "full")
    assert spec.to_dict() == {"type": "full", "block_size": 4, "sliding_window": 8}
    with pytest.raises(ValueError, match="give sliding_window or attention_chunk_size, not both"):
        FullAttentionSpec(block_size=4, sliding_window=8, attention_chunk_size=16)
    with pytest.raises(ValueError, match="sliding_window"):
        FullAttentionSpec(block_size=4, sliding_window=0)


def test_parallel_metadata_and_mla_cache_dtype_are_taken_and_checked():
    spec = MLAAttentionSpec(block_size=16, max_tp_shards=1, dcp_sharded=False, cache_dtype_str="auto")
    assert (spec.max_tp_shards, spec.dcp_sharded, spec.page_size_bytes) == (1, False, 16 * 576 * 2)
    # DeepSeek's packed fp8 layout: the tag, and the 656-byte cell its backend publishes
    packed = MLAAttentionSpec(block_size=16, dtype="uint8", cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
    assert (packed.page_size_bytes, packed.unpadded_page_size_bytes) == (16 * 656, 16 * 656)
    assert packed != MLAAttentionSpec(block_size=16, dtype="uint8", cache_dtype_str="fp8", state_content_bytes=656)
    with pytest.raises(TypeError, match=r"cache_dtype_str must be None or a KV-cache dtype name, got 8"):
        MLAAttentionSpec(block_size=16, cache_dtype_str=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dcp_sharded must be a bool, got 1"):
        FullAttentionSpec(block_size=16, dcp_sharded=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tp_shards"):
        FullAttentionSpec(block_size=16, max_tp_shards=0)


def test_per_token_head_scales_widen_each_cell():
    """vLLM 0.33: a per-token-head mode stores an fp32 scale for K and for V beside each
    head's data; the backend publishes the widened cell as state_content_bytes, and the page
    (and what an offload copies) grows by 2 * block_size * heads * 4 bytes."""
    dense = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="uint8")
    mode = KVQuantMode.FP8_PER_TOKEN_HEAD
    assert mode.is_per_token_head and not KVQuantMode.FP8_PER_TENSOR.is_per_token_head
    scaled = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="uint8", kv_quant_mode=mode, state_content_bytes=2 * 128 + 2 * 4
    )
    assert dense.page_size_bytes == 16 * 8 * 256 == 32768
    assert scaled.unpadded_page_size_bytes == 32768 + 2 * 16 * 8 * 4 == 33792
    assert scaled.state_content_size_bytes == 264 and scaled.num_heads == 8
    slots = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, num_head_slots=2, state_content_bytes=1024)
    assert slots.page_size_bytes == 16 * 2 * 1024
    with pytest.raises(ValueError, match=r"page_size_padded = 1000 is smaller than the page's K/V \(33792 bytes\)"):
        FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="uint8", state_content_bytes=264, page_size_padded=1000)
    with pytest.raises(ValueError, match="state_content_bytes"):
        FullAttentionSpec(block_size=16, state_content_bytes=0)
