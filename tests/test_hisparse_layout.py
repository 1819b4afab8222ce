"""HiSparse's configuration (vLLM 0.33): the worst-case memory each spec charges a request,
the pool's maximum concurrency, and HiSparse's group layout and pool sizes. Every expected
value below was first computed by vLLM 0.33.0's own functions on the same inputs."""

from __future__ import annotations

from types import SimpleNamespace as N

import pytest

from kvlab.config.attention import HiSparseConfig
from kvlab.config.kv_transfer import KVTransferConfig, hisparse_host_pool_gib
from kvlab.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_capacity, get_max_concurrency_for_kv_cache_config
from kvlab.hisparse import layout as L
from kvlab.hisparse import runtime as R
from kvlab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)


def cfg(max_model_len=16384, mbt=1024, batches=1, dcp=1, mamba="none", enc=1500, spec=None, hs=None, topk=2048, tp=1):
    """What the sizing reads of vLLM's VllmConfig, and nothing more."""
    return N(
        model_config=N(max_model_len=max_model_len, hf_config=N(index_topk=topk)),
        parallel_config=N(decode_context_parallel_size=dcp, tensor_parallel_size=tp, world_size=tp),
        max_in_flight_tokens=mbt * batches,
        cache_config=N(mamba_cache_mode=mamba),
        scheduler_config=N(max_num_encoder_input_tokens=enc),
        speculative_config=spec,
        attention_config=N(hisparse_config=hs),
    )


def config(num_blocks, *groups, **kw):
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([f"g{i}"], s) for i, s in enumerate(groups)], **kw
    )


FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096)
CHUNK = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", attention_chunk_size=8192)
MLA = MLAAttentionSpec(block_size=64, dtype="bfloat16")
MAMBA = MambaSpec(block_size=16, mamba_cache_mode="align", num_speculative_blocks=2)


# --- how many requests of max_model_len fit -----------------------------------------------------
@pytest.mark.parametrize(
    "groups, kw, expected",
    [
        ((FULL,), {}, 10_000 / 1024),  # 16,384 tokens = 1,024 blocks
        ((SWA,), {}, 10_000 / 321),  # (4,095 + 1,024 in flight) / 16 -> 320, +1 unaligned window start
        ((SWA,), {"batches": 2}, 10_000 / 385),  # two batches in flight hold 2,048 tokens
        ((FULL, SWA), {}, 10_000 / 1345),  # one pool: a request costs the sum
        ((CHUNK,), {}, 10_000 / 576),  # one chunk and one step in flight
        ((MLA,), {"dcp": 4}, 10_000 / 64),  # 16,384 / 4 ranks / 64 tokens a block
        ((MLAAttentionSpec(block_size=64, dtype="bfloat16", dcp_sharded=False),), {"dcp": 4}, 10_000 / 256),  # not sharded
        ((FULL, CircularBufferSpec(block_size=16, head_size=128)), {}, 10_000 / 1025),  # the ring: one block
        ((FULL, MAMBA), {"mamba": "align"}, 10_000 / 1028),  # 2 + 2 speculative states
        ((FULL, MAMBA), {"mamba": "none"}, 10_000 / 1027),  # 1 + 2 speculative states
    ],
)
def test_max_concurrency(groups, kw, expected):
    assert get_max_concurrency_for_kv_cache_config(cfg(**kw), config(10_000, *groups)) == expected


def test_capacity_in_tokens_and_cross_attention():
    assert get_kv_cache_capacity(cfg(), config(10_000, FULL)) == (160_000, 9.765625)
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype="float16")
    # Whisper-like: 448 decoder tokens (28 blocks) and 1,500 encoder frames (94 blocks).
    assert get_max_concurrency_for_kv_cache_config(cfg(max_model_len=448), config(10_000, FULL, cross)) == 10_000 / 122


def test_uniform_type_group_costs_what_its_scheduler_shape_costs():
    """A group of several layers charges blocks, not bytes: wrapped or not, the same answer."""
    wrapped = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={f"l{i}": FULL for i in range(4)})
    worker = KVCacheConfig(
        num_blocks=1345 * 3,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1", "l2", "l3"], wrapped), KVCacheGroupSpec(["w"], SWA)],
    )
    assert get_max_concurrency_for_kv_cache_config(cfg(), worker) == 3
    assert get_max_concurrency_for_kv_cache_config(cfg(), generate_scheduler_kv_cache_config([worker])) == 3


def test_window_under_dcp_is_refused_like_vllm():
    with pytest.raises(AssertionError, match="DCP not support sliding window") as err:
        get_max_concurrency_for_kv_cache_config(cfg(dcp=2), config(100, SWA))
    assert isinstance(err.value, ValueError)  # kvlab's refusal is a ValueError too
    unsharded = SlidingWindowSpec(block_size=16, sliding_window=4096, dcp_sharded=False)
    assert get_max_concurrency_for_kv_cache_config(cfg(dcp=2), config(3210, unsharded)) == 10


def test_missing_config_field_is_named():
    with pytest.raises(TypeError, match="vllm_config has no cache_config.mamba_cache_mode"):
        MAMBA.max_memory_usage_bytes(N(model_config=N(max_model_len=8)))
    with pytest.raises(ValueError, match="block_size is None"):
        FullAttentionSpec().max_memory_usage_bytes(cfg())


# --- HiSparse ----------------------------------------------------------------------------------
def model_specs(n_layers=4, leaders=(0, 2)):
    """A small DeepSeek-V3.2-like model: MLA K/V (576 bf16 numbers a token) and an fp8
    indexer key with its scale (132 bytes a token) per layer, one indexer per run of layers."""
    specs = {f"l{i}.attn": MLAAttentionSpec(block_size=64, dtype="bfloat16", is_index_group_leader=i in leaders) for i in range(n_layers)}
    for i in range(n_layers):
        specs[f"l{i}.attn.indexer"] = MLAAttentionSpec(block_size=64, head_size=132, dtype="uint8", cache_role=SparseCacheRole.INDEXER)
    return specs


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(R.current_platform, "is_cuda_alike", lambda: False)


def test_layout_groups():
    c = cfg(max_model_len=8192, mbt=2048, hs=HiSparseConfig())
    groups = L.get_hisparse_kv_cache_groups(c, model_specs())
    got = [
        (
            list(g.layer_names),
            type(g.kv_cache_spec).__name__,
            g.kv_cache_spec.page_size_bytes,
            getattr(g.kv_cache_spec, "blocks_per_request", None),
            g.host_resident,
            g.enable_kv_transfer,
            g.role,
        )
        for g in groups
    ]
    assert got == [
        (
            ["l0.attn", "l1.attn", "l2.attn", "l3.attn"],
            "UniformTypeKVCacheSpecs",
            4 * 73_728,
            None,
            True,
            True,
            KVCacheGroupRole.HISPARSE_SOURCE,
        ),
        (
            [f"l{i}.attn.indexer" for i in range(4)],
            "UniformTypeKVCacheSpecs",
            4 * 8_448,
            None,
            False,
            True,
            KVCacheGroupRole.HISPARSE_INDEXER,
        ),
        (
            ["l0.attn.hisparse_resident", "l1.attn.hisparse_resident"],
            "HiSparseResidentSpec",
            73_728,
            None,
            False,
            False,
            KVCacheGroupRole.DEFAULT,
        ),
        (
            ["l2.attn.hisparse_resident", "l3.attn.hisparse_resident"],
            "HiSparseResidentSpec",
            73_728,
            None,
            False,
            False,
            KVCacheGroupRole.DEFAULT,
        ),
        (["l0.attn.hisparse_hot", "l1.attn.hisparse_hot"], "HiSparseHotSpec", 73_728, 64, False, False, KVCacheGroupRole.DEFAULT),
        (["l2.attn.hisparse_hot", "l3.attn.hisparse_hot"], "HiSparseHotSpec", 73_728, 64, False, False, KVCacheGroupRole.DEFAULT),
    ]
    # Two top-k of 2,048 rows (one step's and one of slack) in 64-token blocks.
    layout = L.create_hisparse_layout(c, groups, host_budget=200 * 4 * 73_728 + 5)
    assert (layout.host_num_blocks, layout.host_block_stride, layout.shared_host_pool, len(layout.device_groups)) == (
        200,
        4 * 73_728,
        False,
        5,
    )
    kv = KVCacheConfig(num_blocks=400, kv_cache_tensors=[], kv_cache_groups=groups, hisparse_host_num_blocks=200)
    # Admission: 128 indexer + 2 x 32 resident + 2 x 64 hot = 320 blocks; steady: 128 + 2 x 2 + 128 = 260.
    assert get_max_concurrency_for_kv_cache_config(c, kv) == 400 / 320
    assert L.get_hisparse_steady_state_concurrency(c, kv) == 1 + 80 / 260


def test_layout_with_speculative_decoding_and_a_given_buffer(caplog):
    spec = N(num_speculative_tokens=2, parallel_drafting=False)
    groups = L.get_hisparse_kv_cache_groups(cfg(spec=spec, hs=HiSparseConfig()), model_specs(6, (0, 3)))
    assert [len(g.layer_names) for g in groups] == [6, 6, 3, 3, 3, 3]
    assert groups[-1].kv_cache_spec.blocks_per_request == 128  # (3 queries + 1) x 2,048 rows / 64
    groups = L.get_hisparse_kv_cache_groups(cfg(hs=HiSparseConfig(device_buffer_size=4100)), model_specs())
    assert groups[-1].kv_cache_spec.blocks_per_request == 65
    assert "allocates 60 unused rows" in caplog.text


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"hs": HiSparseConfig(device_buffer_size=2047)}, "expected at least 2048"),
        ({"hs": HiSparseConfig(device_buffer_size=40_000), "topk": 8}, "int16 slot-index limit: got 40000, maximum is 32768"),
    ],
)
def test_hot_buffer_bounds(kw, message):
    with pytest.raises(ValueError, match=message):
        L.get_hisparse_kv_cache_groups(cfg(**kw), model_specs())


def test_host_pool_must_hold_one_longest_request():
    c = cfg(max_model_len=8192, hs=HiSparseConfig())
    groups = L.get_hisparse_kv_cache_groups(c, model_specs())
    page = groups[0].kv_cache_spec.page_size_bytes
    assert L.create_hisparse_layout(c, groups, host_budget=130 * page).host_num_blocks == 130  # 128 pages + null + tail
    with pytest.raises(ValueError, match="has 129 blocks but max_model_len needs 130; increase host_pool_gib"):
        L.create_hisparse_layout(c, groups, host_budget=130 * page - 1)


def test_shared_host_pool_rounds_blocks_to_os_pages(monkeypatch):
    monkeypatch.setattr(R.current_platform, "is_cuda_alike", lambda: True)
    p = N(
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        world_size=2,
        distributed_executor_backend="mp",
        nnodes_within_dp=1,
    )
    assert R.use_shared_hisparse_host_pool(N(parallel_config=p))
    assert R.get_hisparse_host_block_stride(73_728 + 1, use_shared_host_pool=True) == 77_824  # 19 pages of 4 KiB
    assert R.get_hisparse_host_block_stride(73_728 + 1, use_shared_host_pool=False) == 73_729


def test_layout_refusals():
    assert L.get_hisparse_kv_cache_groups(cfg(), model_specs()) is None  # HiSparse off
    assert L.get_hisparse_kv_cache_groups(cfg(hs=HiSparseConfig()), {"a": FULL}) is None  # no MLA
    v4 = {"a": MLAAttentionSpec(block_size=256, head_size=512, dtype="uint8", model_version="deepseek_v4")}
    with pytest.raises(ValueError, match="does not support DeepSeek V4"):
        L.get_hisparse_kv_cache_groups(cfg(hs=HiSparseConfig()), v4)
    with pytest.raises(ValueError, match="requires sparse-MLA and indexer cache specs"):
        L.get_hisparse_kv_cache_groups(cfg(hs=HiSparseConfig()), {"a": MLA})
    with pytest.raises(ValueError, match=r"all MLA; these are not: \['w'\]"):
        L.get_hisparse_kv_cache_groups(cfg(hs=HiSparseConfig()), {**model_specs(), "w": SWA})


def test_host_pool_gib_from_the_connector():
    assert hisparse_host_pool_gib(None) is None
    assert hisparse_host_pool_gib(KVTransferConfig("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": "1.5"})) == 1.5
    multi = {
        "connectors": [
            {"kv_connector": "OffloadingConnector"},
            {"kv_connector": "HiSparseConnector", "kv_connector_extra_config": {"host_pool_gib": 2}},
        ]
    }
    assert hisparse_host_pool_gib(KVTransferConfig("MultiConnector", kv_connector_extra_config=multi)) == 2.0
    assert hisparse_host_pool_gib(KVTransferConfig("OffloadingConnector")) is None
    with pytest.raises(ValueError, match="requires host_pool_gib"):
        hisparse_host_pool_gib(KVTransferConfig("HiSparseConnector"))
    with pytest.raises(ValueError, match="must be positive, got 0.0"):
        hisparse_host_pool_gib(KVTransferConfig("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 0}))
    assert (
        L.get_hisparse_host_pool_bytes(
            N(kv_transfer_config=KVTransferConfig("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 1.5}))
        )
        == 3 << 29
    )


def test_hisparse_spec_fields_are_checked():
    with pytest.raises(ValueError, match="cache_role must be one of"):
        MLAAttentionSpec(cache_role="dense")
    with pytest.raises(ValueError, match="model_version must be None or 'deepseek_v4'"):
        MLAAttentionSpec(model_version="v5")
    assert MLAAttentionSpec(cache_role="indexer").cache_role is SparseCacheRole.INDEXER
    assert MLAAttentionSpec(cache_role="indexer").to_dict()["cache_role"] == "indexer"
    with pytest.raises(ValueError, match="HiSparseHotSpec.blocks_per_request"):
        HiSparseHotSpec(block_size=16, page_size=64, blocks_per_request=0)
    with pytest.raises(ValueError, match="HiSparseConfig|device_buffer_size"):
        HiSparseConfig(device_buffer_size=0)
    assert HiSparseResidentSpec(block_size=16, page_size=64).max_admission_blocks_per_request(100, 40) == 3


def test_manager_runs_the_laid_out_groups_and_refuses_them_alone():
    from kvlab.core.kv_cache_manager import KVCacheManager

    c = cfg(max_model_len=8192, hs=HiSparseConfig())
    groups = L.get_hisparse_kv_cache_groups(c, model_specs())
    m = KVCacheManager(
        KVCacheConfig(num_blocks=400, kv_cache_tensors=[], kv_cache_groups=groups, hisparse_host_num_blocks=200), max_model_len=8192
    )
    assert m.hisparse is not None and m.hisparse.host_manager.block_pool.num_gpu_blocks == 200
    with pytest.raises(ValueError, match=r"kv_cache_groups \[0\] hold HiSparse's source K/V, which lives in a host pool"):
        KVCacheManager(KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=[groups[0]]), max_model_len=8192)
    for i, group in ((0, groups[2].kv_cache_spec), (1, groups[4].kv_cache_spec)):
        with pytest.raises(ValueError, match=rf"kv_cache_groups\[{i}\] is one of HiSparse's GPU groups"):
            KVCacheManager(num_blocks=40, kv_cache_groups=[FullAttentionSpec()] * i + [group], max_model_len=8192)
