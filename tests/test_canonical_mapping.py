"""The canonical page (vLLM 0.33's ``derive_canonical_mappings``): each tensor-parallel rank's
share of a block lands in one parallelism-free page, so KV stored under one TP size loads
under another. The byte copies run through the CPU worker's own copy plans
(``kvlab.kv_offload.cpu.gpu_worker``), as a store and a load would.

vLLM 0.33.0's own tests of the module (test_canonical_mapping.py, 27) pass on kvlab's
(``scripts/vllm_tests/run.sh``, strict)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVQuantMode, MLAAttentionSpec
from kvlab.kv_offload.base import CanonicalKVCacheRef
from kvlab.kv_offload.cpu.gpu_worker import _build_copy_plan

TOTAL_HEADS, BS, HEAD = 4, 4, 8  # int8: a head's K (or V) row is 8 bytes


def _engine(tp: int, rank: int, dcp: int = 1) -> SimpleNamespace:
    par = SimpleNamespace(
        tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=1,
        cp_kv_cache_interleave_size=1, world_size=tp, rank=rank,
    )  # fmt: skip
    return SimpleNamespace(parallel_config=par, model_config=SimpleNamespace(get_total_num_kv_heads=lambda: TOTAL_HEADS))


def _layout(tp: int, *specs) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    caches = {  # FlashAttention's split layout: (blocks, K|V, tokens, heads, head size)
        f"l{i}": torch.zeros(2, 2, BS, s.num_kv_heads, HEAD, dtype=torch.int8) for i, s in enumerate(specs) if type(s) is FullAttentionSpec
    }
    return KVCacheConfig(num_blocks=2, kv_cache_tensors=(), kv_cache_groups=groups), caches


def _full(tp: int, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=TOTAL_HEADS // tp, head_size=HEAD, dtype="int8", **kw)


def _apply(mapping, src: bytes, size: int, store: bool) -> bytes:
    """One page through the worker's copy plan: a store writes the canonical page from the
    local one, a load the local page from the canonical one."""
    plan = _build_copy_plan(CanonicalKVCacheRef(0, mapping.local_page_size_bytes, mapping), gpu_to_cpu=store)
    out = bytearray(size)
    for s, d, n in zip(plan.frag_offsets_src.tolist(), plan.frag_offsets_dst.tolist(), plan.frag_sizes.tolist()):
        out[d : d + n] = src[s : s + n]
    return bytes(out)


@pytest.mark.parametrize(("store_tp", "load_tp"), [(2, 1), (1, 4), (4, 2)])
def test_kv_stored_under_one_tp_size_loads_under_another(store_tp: int, load_tp: int) -> None:
    canonical_size = 2 * BS * TOTAL_HEADS * HEAD  # K and V of every head, every token
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 256, canonical_size, dtype=np.uint8).tobytes()  # the block, unsplit
    # Each storing rank holds its share of the block: what a load of `whole` gives it.
    canonical = bytearray(canonical_size)
    for rank in range(store_tp):
        cfg, caches = _layout(store_tp, _full(store_tp))
        m = derive_canonical_mappings(_engine(store_tp, rank), cfg, caches)["l0"]
        assert (m.canonical_page_size_bytes, m.local_page_size_bytes) == (canonical_size, canonical_size // store_tp)
        share = _apply(m, whole, m.local_page_size_bytes, store=False)
        stored = _apply(m, share, canonical_size, store=True)
        for i, b in enumerate(stored):  # each rank writes its own bytes only
            canonical[i] |= b
    assert bytes(canonical) == whole
    # An engine with another TP size loads its ranks' shares and stores them back: the same page.
    again = bytearray(canonical_size)
    for rank in range(load_tp):
        cfg, caches = _layout(load_tp, _full(load_tp))
        m = derive_canonical_mappings(_engine(load_tp, rank), cfg, caches)["l0"]
        share = _apply(m, bytes(canonical), m.local_page_size_bytes, store=False)
        again = bytearray(a | b for a, b in zip(again, _apply(m, share, canonical_size, store=True)))
    assert bytes(again) == whole


def test_mla_ranks_take_turns_and_an_uncertified_layer_stays_whole() -> None:
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype="int8", max_tp_shards=1)
    scaled = _full(2, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)  # scales packed with the data: not certified
    cfg, caches = _layout(2, mla, scaled)
    per_rank = [derive_canonical_mappings(_engine(2, r), cfg, caches) for r in range(2)]
    # MLA: the same latent on both ranks, one copy per block, written by each rank in turn
    assert [(m["l0"].canonical_page_size_bytes, m["l0"].is_writer(0), m["l0"].is_writer(1)) for m in per_rank] == [
        (BS * 64, True, False),
        (BS * 64, False, True),
    ]
    # the scaled layer: each rank's page whole, side by side, not shareable with another TP size
    page = scaled.unpadded_page_size_bytes
    assert [(m["l1"].canonical_page_size_bytes, m["l1"].runs[0].canonical_offset, m["l1"].parallelism_agnostic) for m in per_rank] == [
        (2 * page, 0, False),
        (2 * page, page, False),
    ]
    engine = _engine(2, 0)
    engine.parallel_config.world_size = 4  # two pipeline stages: no page of theirs is shared
    assert derive_canonical_mappings(engine, cfg, caches) == {}
