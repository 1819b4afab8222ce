"""vLLM 0.33's offloading scheduler half, built from a spec (``OffloadingConnectorScheduler``):
a full-attention group beside a sliding-window group, one block per chunk, two workers.

One story, told step by step: request ``a`` (26 tokens, 6 block hashes) finds chunks 0-4 of
the full group and chunks 1, 3, 4 of the window group (window 8 tokens = 2 chunks) in a
real CPU tier; it loads 20 tokens, stores its last chunk, finishes; ``b`` reuses one of its
blocks; the cache is reset with stores in flight. Every expected value below was first
produced by vLLM 0.33's own class in the same story (a throwaway script that ran it through
both), then written down here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kvlab.core.kv_cache_manager import KVCacheBlocks
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import get_sliding_window_size_in_chunks
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from kvlab.kv_offload.base import OffloadingKVEventsConfig, get_offload_block_hash, get_offload_group_idx
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.request import RequestStatus


def _key(key: bytes) -> tuple[str, int]:
    return get_offload_block_hash(key).decode(), get_offload_group_idx(key)


def _keys(keys: Any) -> list[tuple[str, int]]:
    return sorted(map(_key, keys))


def _spec(groups: list[KVCacheGroupSpec], manager: Any, tokens_per_hash: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(
            groups=tuple(
                SimpleNamespace(
                    group_id=i,
                    tokens_per_block=g.kv_cache_spec.block_size,
                    sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(g.kv_cache_spec, g.kv_cache_spec.block_size),
                )
                for i, g in enumerate(groups)
            )
        ),
        tokens_per_block=tuple(g.kv_cache_spec.block_size for g in groups),
        tokens_per_hash=tokens_per_hash,
        blocks_per_chunk=1,
        offload_prompt_only=True,
        extra_config={},
        kv_events_config=OffloadingKVEventsConfig(enable_kv_cache_events=False, self_describing_kv_events=False),
        get_manager=lambda: manager,
    )


def _engine_config(world_size: int) -> SimpleNamespace:
    return SimpleNamespace(
        speculative_config=None,
        cache_config=SimpleNamespace(enable_prefix_caching=True, prefix_cache_retention_interval=None),
        parallel_config=SimpleNamespace(world_size=world_size, decode_context_parallel_size=1),
    )


def _build(world_size: int = 2) -> tuple[OffloadingConnectorScheduler, CPUOffloadingManager]:
    kw: dict[str, Any] = dict(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(**kw)),
        KVCacheGroupSpec(["window"], SlidingWindowSpec(**kw, sliding_window=8)),
    ]
    manager = CPUOffloadingManager(num_chunks=20)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return OffloadingConnectorScheduler(_spec(groups, manager), _engine_config(world_size), config), manager  # type: ignore[arg-type]


class _Req(SimpleNamespace):
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


def _req(rid: str, num_tokens: int, num_hashes: int) -> _Req:
    return _Req(
        request_id=rid,
        kv_transfer_params=None,
        kv_hints=None,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        block_hashes=[f"h{i}".encode() for i in range(num_hashes)],
        skip_reading_prefix_cache=False,
        lora_request=None,
        all_token_ids=list(range(num_tokens)),
        status=RequestStatus.WAITING,
        num_computed_tokens=0,
        shared_prefix_boundary=0,
    )


def _out(new: Any = (), cached: Any = (), sched: Any = None, finished: Any = ()) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], new_block_ids=[b for _, b in cached], resumed_req_ids=set()),
        num_scheduled_tokens=dict(sched or {}),
        finished_req_ids=set(finished),
        preempted_req_ids=set(),
        kv_cache_block_copies=None,
        kv_connector_block_state=None,
    )


def _gpu(spec: Any) -> tuple[list[int], list[int], list[int]]:
    return [int(b) for b in spec.block_ids], list(spec.group_sizes), list(spec.block_indices)


def _ack(sched: OffloadingConnectorScheduler, jobs: dict[int, int]) -> None:
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=jobs)))


def _story_until_load() -> tuple[OffloadingConnectorScheduler, _Req]:
    sched, manager = _build()
    a = _req("a", 26, 6)
    sched.on_new_request(a)
    state = sched._req_status["a"]
    state.update_offload_keys()
    full, window = (g.offload_keys for g in state.group_states)
    stored = manager.prepare_store(full[:5] + [window[1], window[3], window[4]], state.req_context)
    assert stored is not None
    manager.complete_store(stored.keys_to_store, state.req_context)
    return sched, a


def _allocate_a(sched: OffloadingConnectorScheduler, a: _Req) -> None:
    full = [KVCacheBlock(10 + i) for i in range(7)]
    window = [KVCacheBlock(0, is_null=True) for _ in range(3)] + [KVCacheBlock(i) for i in (23, 24, 25, 26)]
    sched.update_state_after_alloc(a, KVCacheBlocks((full, window)), 20)


def _story_until_store() -> tuple[OffloadingConnectorScheduler, _Req, Any]:
    """``a`` loads its 20 tokens (both workers report it), then computes the rest of its prompt."""
    sched, a = _story_until_load()
    sched.get_num_new_matched_tokens(a, 0)
    _allocate_a(sched, a)
    sched.build_connector_meta(_out())
    _ack(sched, {0: 2})
    a.num_computed_tokens = 20
    meta = sched.build_connector_meta(_out(new=[("a", ([10, 11, 12, 13, 14, 15, 16], [0, 0, 0, 23, 24, 25, 26]))], sched={"a": 6}))
    return sched, a, meta


def test_two_groups_agree_on_one_hit_and_one_load_job() -> None:
    sched, a = _story_until_load()
    # The full group holds chunks 0-4 (20 tokens); the window group needs only the 2 chunks
    # before the hit (3 and 4), which it holds -- chunk 0 and 2 being absent does not matter.
    assert sched.get_num_new_matched_tokens(a, 0) == (20, True)
    _allocate_a(sched, a)
    [(job_id, job)] = sched._current_batch_load_jobs.items()
    assert job_id == 0 and job.sync is False
    # One job over both groups: the full group's 5 blocks from index 0, the window group's 2
    # blocks from index 3 (its null blocks are not loaded).
    assert _gpu(job.dst_spec) == ([10, 11, 12, 13, 14, 23, 24], [5, 2], [0, 3])
    assert _keys(sched._jobs[0].keys) == [("h0", 0), ("h1", 0), ("h2", 0), ("h3", 0), ("h3", 1), ("h4", 0), ("h4", 1)]
    # Each loaded key covers its own tokens (what get_external_cache_hit_sources splits).
    ranges = [(lo, hi, _key(k)) for lo, hi, k in sched._req_status["a"].load_key_ranges]
    assert ranges == [(0, 4, ("h0", 0)), (4, 8, ("h1", 0)), (8, 12, ("h2", 0)), (12, 16, ("h3", 0)), (16, 20, ("h4", 0))] + [
        (12, 16, ("h3", 1)),
        (16, 20, ("h4", 1)),
    ]


def test_async_load_holds_its_chunks_until_every_worker_reported() -> None:
    sched, a = _story_until_load()
    sched.get_num_new_matched_tokens(a, 0)
    _allocate_a(sched, a)
    meta = sched.build_connector_meta(_out())
    assert (list(meta.load_jobs), meta.store_jobs, meta.jobs_to_flush) == ([0], {}, set())
    # Another request with the same prefix waits rather than loading the same chunks twice.
    c = _req("c", 26, 6)
    sched.on_new_request(c)
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    sched.build_connector_meta(_out())
    _ack(sched, {0: 1})  # one of two workers: the job is still in flight
    assert list(sched._jobs) == [0] and sched._chunks_being_loaded
    _ack(sched, {0: 1})
    assert (sched._jobs, sched._chunks_being_loaded, sched._req_status["a"].transfer_jobs) == ({}, set(), set())
    assert sched.get_num_new_matched_tokens(c, 0) == (20, True)


def test_store_job_takes_each_groups_new_chunk() -> None:
    sched, a, meta = _story_until_store()
    [(job_id, job)] = meta.store_jobs.items()
    # The loaded chunks are not stored again; chunk 5 (tokens 20-23) is, in both groups.
    assert job_id == 1 and _gpu(job.src_spec) == ([15, 25], [1, 1], [5, 5])
    assert _keys(sched._jobs[1].keys) == [("h5", 0), ("h5", 1)]
    assert (meta.load_jobs, meta.jobs_to_flush) == ({}, set())


def test_finished_requests_pending_store_is_flushed_when_its_block_is_reused() -> None:
    sched, a, _ = _story_until_store()
    # Decoding past the prompt stores nothing more (offload_prompt_only).
    a.num_computed_tokens, a.num_tokens = 26, 34
    a.block_hashes += [b"h6", b"h7"]
    meta = sched.build_connector_meta(_out(cached=[("a", ([17, 18], [27, 28]))], sched={"a": 8}))
    assert (meta.store_jobs, meta.jobs_to_flush) == ({}, set())
    a.status, a.num_computed_tokens = RequestStatus.FINISHED_STOPPED, 34
    assert sched.request_finished(a) == (False, None)  # its blocks free at once
    # b gets block 25, which store job 1 still reads: the worker flushes job 1 first.
    b = _req("b", 9, 2)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    blocks = ([KVCacheBlock(25), KVCacheBlock(40), KVCacheBlock(41)], [KVCacheBlock(42), KVCacheBlock(43), KVCacheBlock(44)])
    sched.update_state_after_alloc(b, KVCacheBlocks(blocks), 0)
    meta = sched.build_connector_meta(_out(new=[("b", ([25, 40, 41], [42, 43, 44]))], sched={"b": 9}, finished=["a"]))
    assert meta.jobs_to_flush == {1}
    # b stores only the window group's first chunk: the tier holds the rest from a.
    assert {j: _gpu(t.src_spec) for j, t in meta.store_jobs.items()} == {2: ([42], [0, 1], [0, 0])}
    assert {bid: sorted(jobs) for bid, jobs in sched._block_id_to_pending_jobs.items()} == {15: [1], 25: [1], 42: [2]}
    assert "a" in sched._req_status  # until its store is reported

    # A cache reset forgets both stores but fences the manager until every worker reported them.
    sched.reset_cache()
    assert (sched._reset_fence, sched._stale_job_threshold) == ({1: 2, 2: 2}, 3)
    assert (sched._current_batch_jobs_to_flush, list(sched._req_status)) == ({1, 2}, ["b"])
    _ack(sched, {1: 2})
    assert sched._reset_fence == {2: 2}


def test_partial_tail_stored_from_the_cores_hand_off_and_loaded_by_the_next_request() -> None:
    """vLLM 0.33's partial tails: a full group beside a Mamba "align" group, 16-token blocks,
    hashes every 4 tokens. ``a`` (30 tokens) computes its prompt; the core hands off its Mamba
    states at token 16 (block 3) and at 28 (copied into block 9). The chunk edge is stored
    alone; 28 is inside a block, so one job stores both groups' partial entries there, keyed
    by the hash at token 28; the full group's whole chunk follows. ``b`` with the same prompt
    then loads 28 tokens: a whole chunk and the partial entries. (Values from vLLM 0.33's own
    class in the same story.)"""
    kw: dict[str, Any] = dict(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(**kw)), KVCacheGroupSpec(["mamba"], mamba)]
    manager = CPUOffloadingManager(num_chunks=16)
    config = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)
    sched = OffloadingConnectorScheduler(_spec(groups, manager), _engine_config(1), config)  # type: ignore[arg-type]
    assert sched.config.supports_partial_tail
    a = _req("a", 30, 7)
    a.status = RequestStatus.RUNNING
    sched.on_new_request(a)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2)], [KVCacheBlock(3), KVCacheBlock(4)])), 0)
    out = _out(new=[("a", ([1, 2], [3, 4]))], sched={"a": 30})
    out.kv_connector_block_state = SimpleNamespace(boundary_state_offloads={"a": [(1, 3, 16), (1, 9, 28)]})
    meta = sched.build_connector_meta(out)
    stores = {j: (_gpu(t.src_spec), _keys(sched._jobs[j].keys)) for j, t in meta.store_jobs.items()}
    assert stores == {
        0: (([3], [0, 1], [0, 0]), [("h3", 1)]),  # the state at 16: a chunk edge
        1: (([2, 9], [1, 1], [1, 1]), [("h6", 0), ("h6", 1)]),  # 28: the full group's block 2, the Mamba copy 9
        2: (([1], [1, 0], [0, 0]), [("h3", 0)]),  # the full group's whole chunk
    }
    _ack(sched, {j: 1 for j in meta.store_jobs})
    b = _req("b", 30, 7)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (28, True)
    assert sched._req_status["b"].partial_tail_boundary == 28
    blocks = ([KVCacheBlock(11), KVCacheBlock(12)], [KVCacheBlock(0, is_null=True), KVCacheBlock(14)])
    sched.update_state_after_alloc(b, KVCacheBlocks(blocks), 28)
    [(job_id, job)] = sched._current_batch_load_jobs.items()
    assert (job_id, _gpu(job.dst_spec)) == (3, ([11, 12, 14], [2, 1], [0, 1]))
    assert _keys(sched._jobs[3].keys) == [("h3", 0), ("h6", 0), ("h6", 1)]
    ranges = [(lo, hi, _key(k)) for lo, hi, k in sched._req_status["b"].load_key_ranges]
    assert ranges == [(0, 16, ("h3", 0)), (16, 28, ("h6", 0)), (0, 28, ("h6", 1))]  # a Mamba state covers its whole prefix


def test_kvlab_requests_store_a_prompt_and_a_later_one_loads_it() -> None:
    """The half takes kvlab's own Request: ``a`` (10 tokens: 2 whole blocks of 4) stores its
    prompt's two chunks in one job; ``b`` with the same prompt then finds both in the tier."""
    from kvlab.core.kv_cache_utils import get_request_block_hasher
    from kvlab.request import Request
    from kvlab.utils.hashing import sha256

    kw: dict[str, Any] = dict(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(**kw))]
    manager = CPUOffloadingManager(num_chunks=8)
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    sched = OffloadingConnectorScheduler(_spec(groups, manager), _engine_config(1), config)  # type: ignore[arg-type]
    hasher = get_request_block_hasher(4, sha256)
    a = Request("a", list(range(10)), block_hasher=hasher)
    sched.on_new_request(a)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)],)), 0)
    meta = sched.build_connector_meta(_out(new=[("a", ([1, 2, 3],))], sched={"a": 10}))
    [(job_id, job)] = meta.store_jobs.items()
    assert (job_id, _gpu(job.src_spec)) == (0, ([1, 2], [2], [0]))
    _ack(sched, {0: 1})
    b = Request("b", list(range(10)), block_hasher=hasher)
    sched.on_new_request(b)
    # The two whole chunks a stored: 8 of b's 10 tokens (the last 2 fill no chunk).
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)
    sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(6), KVCacheBlock(7)],)), 8)
    [(load_id, load)] = sched._current_batch_load_jobs.items()
    assert (load_id, _gpu(load.dst_spec)) == (1, ([5, 6], [2], [0]))
    assert sched._jobs[1].keys == set(sched._req_status["b"].group_states[0].offload_keys)
    assert len(sched._jobs[1].keys) == 2
