"""KV cache events from the manager: vLLM's BlockPool/KVCacheManager behaviour (v0.33.0)
re-expressed as exact event sequences, plus the hash bytes an outside consumer recomputes."""

from __future__ import annotations

import hashlib

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import FullAttentionSpec, KVCacheManager, MultiModalFeature, Request, SlidingWindowSpec
from kvlab.core import kv_cache_utils
from kvlab.core.block_pool import BlockPool
from kvlab.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheIndex, KVEventBatch, decode_batch, encode_batch
from kvlab.utils import hashing


def i64(h: bytes) -> int:
    """vLLM's int block hash: the low 64 bits of the big-endian digest = its last 8 bytes."""
    return int.from_bytes(h[-8:], "big")


def run(mgr, req, n=None):
    hits, k = mgr.get_computed_blocks(req)
    n = n or req.num_tokens - k
    new = mgr.allocate_slots(req, n, k, hits)
    assert new is not None
    req.num_computed_tokens = k + n
    return new


def stored(hashes, parent, tokens, *, bs=4, group=0, kind="full_attention", window=None, extra=None, lora_name=None):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=lora_name,
        extra_keys=extra if extra is not None else [None] * len(hashes),
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def removed(h, group=0):
    return BlockRemoved(block_hashes=[h], medium="GPU", group_idx=group)


def test_store_grow_free_evict_sequence():
    mgr = KVCacheManager(num_blocks=6, block_size=4, enable_kv_cache_events=True)
    r0 = Request("r0", list(range(10)))
    assert run(mgr, r0).get_block_ids() == ([1, 2, 3],)
    h = r0.block_hashes
    # One BlockStored for the run of blocks that became full, parent None for block 0.
    assert mgr.take_events() == [stored([i64(h[0]), i64(h[1])], None, list(range(8)))]
    assert mgr.take_events() == []  # taken means gone

    r0.append_output_token_ids([10, 11])  # block 2 fills up
    assert mgr.allocate_slots(r0, 2) is not None
    assert mgr.take_events() == [stored([i64(h[2])], i64(h[1]), [8, 9, 10, 11])]

    mgr.free(r0)  # tail first: 3, 2, 1 join the tail; nothing is evicted yet, no event
    assert mgr.take_events() == []
    r1 = Request("r1", list(range(100, 116)))
    assert run(mgr, r1).get_block_ids() == ([4, 5, 3, 2],)
    g = r1.block_hashes
    # Reallocating a cached block drops its hash: one BlockRemoved per block, in pop order,
    # before the new blocks are stored.
    assert mgr.take_events() == [
        removed(i64(h[2])),
        removed(i64(h[1])),
        stored([i64(x) for x in g], None, list(range(100, 116))),
    ]


def test_a_recomputed_last_block_stores_its_hash_twice_and_each_copy_is_removed():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    a, b = Request("a", list(range(8))), Request("b", list(range(8)))
    run(mgr, a)
    run(mgr, b)  # hits block 1 only (a hit never covers the last token), recomputes the 2nd
    h0, h1 = (i64(x) for x in a.block_hashes)
    assert mgr.get_block_ids("a") == ([1, 2],) and mgr.get_block_ids("b") == ([1, 3],)
    events = mgr.take_events()
    assert events == [stored([h0, h1], None, list(range(8))), stored([h1], h0, [4, 5, 6, 7])]
    index = CacheIndex().apply(KVEventBatch(ts=0.0, events=events))
    assert index.num_copies(h1) == 2 and index.num_copies(h0) == 1

    mgr.free(a)  # tail first: block 2 -> tail; block 1 is still b's
    mgr.free(b)  # block 3, then block 1 -> tail
    assert [x.block_id for x in mgr.block_pool.free_block_queue.get_all_free_blocks()] == [4, 5, 6, 7, 2, 3, 1]
    run(mgr, Request("big", list(range(50, 66))))  # 4 blocks: pops 4 5 6 7, no cached block yet
    assert mgr.take_events()[0].block_hashes[0] not in (h0, h1)
    run(mgr, Request("more", list(range(80, 88))))  # 2 blocks: pops 2 and 3, both copies of h1
    first, second, *_ = mgr.take_events()
    assert first == second == removed(h1)
    index.apply([first])
    assert index.num_copies(h1) == 1 and h1 in index.cached_hashes  # one copy left: still a hit
    index.apply([second])
    assert h1 not in index.cached_hashes and h0 in index.cached_hashes and index.num_unknown_removals == 0


def test_reset_prefix_cache_sends_all_blocks_cleared_only_when_it_succeeds():
    mgr = KVCacheManager(num_blocks=4, block_size=4, enable_kv_cache_events=True)
    r = Request("r", list(range(8)))
    run(mgr, r)
    mgr.take_events()
    assert mgr.reset_prefix_cache() is False and mgr.take_events() == []  # r holds blocks
    mgr.free(r)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]  # no BlockRemoved for the cleared hashes
    run(mgr, Request("s", list(range(8))))  # the pool reuses blocks without old hashes now
    assert [type(e) for e in mgr.take_events()] == [BlockStored]


def test_each_group_stores_its_own_event_with_its_spec():
    mgr = KVCacheManager(
        num_blocks=13,
        block_size=4,
        kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)],
        enable_kv_cache_events=True,
    )
    r = Request("r", list(range(12)))
    run(mgr, r)
    hs = [i64(x) for x in r.block_hashes]
    assert mgr.take_events() == [
        stored(hs, None, list(range(12)), group=0),
        stored(hs, None, list(range(12)), group=1, kind="sliding_window", window=8),
    ]
    mgr.free(r)
    run(mgr, Request("s", list(range(40, 64))))  # 6 blocks per group = all 12: every cached one goes
    gone = [(e.group_idx, e.block_hashes[0]) for e in mgr.take_events() if type(e) is BlockRemoved]
    assert sorted(gone) == sorted([(0, h) for h in hs] + [(1, h) for h in hs])


def test_extra_keys_lora_name_and_salt_appear_per_block_untagged():
    mgr = KVCacheManager(num_blocks=6, block_size=4, enable_kv_cache_events=True)
    img = MultiModalFeature(identifier="img-a", offset=2, length=3)  # tokens 2, 3, 4
    r = Request("r", list(range(9)), lora_name="sql", cache_salt="t1", mm_features=[img])
    run(mgr, r)
    (ev,) = mgr.take_events()
    assert ev.lora_name == "sql" and ev.lora_id is None  # no adapter id given, and no engine to give one
    assert ev.extra_keys == [("sql", ("img-a", 2), "t1"), ("sql", ("img-a", -2))]


def test_tagged_keys_are_published_untagged_as_vllm_does():
    tagged = [(("lora", "sql", "/adapters/sql"), ("mm", "img-a", 2), ("cache_salt", "t1")), None, (("prompt_embeds", b"\x01"),)]
    assert kv_cache_utils.to_event_extra_keys(tagged) == [("sql", ("img-a", 2), "t1"), None, (b"\x01",)]
    assert kv_cache_utils.to_event_extra_keys([("sql", ("img-a", 2))]) == [("sql", ("img-a", 2))]  # untagged: as is
    assert kv_cache_utils.to_event_extra_keys([]) is None


def test_hashes_are_digests_when_int_hashes_are_off(monkeypatch):
    r = Request("r", list(range(8)))
    mgr = KVCacheManager(num_blocks=4, block_size=4, enable_kv_cache_events=True, kv_events_use_int_block_hashes=False)
    run(mgr, r)
    assert mgr.take_events()[0].block_hashes == list(r.block_hashes)
    # None reads vLLM's environment variable (default "1": ints)
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert KVCacheManager(num_blocks=4, enable_kv_cache_events=True).block_pool.kv_events_use_int_block_hashes is False
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ValueError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be an integer"):
        KVCacheManager(num_blocks=4, enable_kv_cache_events=True)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    assert KVCacheManager(num_blocks=4).block_pool.kv_events_use_int_block_hashes is True
    with pytest.raises(TypeError, match="enable_kv_cache_events must be a bool"):
        KVCacheManager(num_blocks=4, enable_kv_cache_events="yes")  # type: ignore[arg-type]


def test_events_off_means_no_queue_at_all():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    run(mgr, Request("r", list(range(8))))
    mgr.free(Request("r", list(range(8))))
    assert mgr.reset_prefix_cache() and mgr.take_events() == [] and mgr.block_pool.kv_event_queue == []


def test_null_blocks_are_skipped_but_their_tokens_are_not():
    pool = BlockPool(8, enable_kv_cache_events=True)
    r = Request("r", list(range(12)), block_hasher=kv_cache_utils.get_request_block_hasher(4, hashing.sha256))
    blocks = [pool.null_block, *pool.get_new_blocks(2)]
    pool.cache_full_blocks(r, blocks, 0, 3, 4, 1)
    (ev,) = pool.take_events()
    assert ev.block_hashes == [i64(x) for x in r.block_hashes[1:]] and ev.token_ids == list(range(12))
    assert ev.extra_keys == [None, None] and ev.group_idx == 1 and ev.kv_cache_spec_kind is None  # the manager fills it
    # every block of the run dropped: vLLM still sends the event, with no hashes
    pool.cache_full_blocks(r, [pool.null_block], 0, 1, 4, 1)
    (ev,) = pool.take_events()
    assert ev.block_hashes == [] and ev.extra_keys is None and ev.token_ids == [0, 1, 2, 3]


# --- an outside consumer recomputes the hashes: vLLM's sha256_cbor and NONE_HASH ----------------
# Expected digests worked out by hand from the CBOR spec (RFC 8949) and hashlib, not by kvlab:
#   NONE_HASH   = sha256(cbor("vllm-none-hash"))          cbor text(14) = 0x6e + the bytes
#   block (1,2,3,4) = sha256(cbor([NONE_HASH, [1,2,3,4], null]))
#               = sha256(0x83 | 0x58 0x20 NONE_HASH | 0x84 01 02 03 04 | 0xf6)
# (cross-checked against vllm/utils/hashing.py of the v0.33.0 release).
ROOT_CBOR = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
BLOCK_1234 = "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111"
BLOCK_5678 = "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1"


def test_sha256_cbor_matches_vllm_bytes_for_the_default_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash()
    assert hashlib.sha256(b"\x6e" + b"vllm-none-hash").hexdigest() == ROOT_CBOR
    root = kv_cache_utils.none_hash_for(hashing.sha256_cbor)
    assert root.hex() == ROOT_CBOR
    assert hashlib.sha256(b"\x83\x58\x20" + root + b"\x84\x01\x02\x03\x04\xf6").hexdigest() == BLOCK_1234
    h0 = kv_cache_utils.hash_block_tokens(hashing.sha256_cbor, None, [1, 2, 3, 4])
    assert h0.hex() == BLOCK_1234
    assert kv_cache_utils.hash_block_tokens(hashing.sha256_cbor, h0, [5, 6, 7, 8]).hex() == BLOCK_5678
    mgr = KVCacheManager(num_blocks=4, block_size=4, hash_algo="sha256_cbor")
    r = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.get_computed_blocks(r)
    assert [x.hex() for x in r.block_hashes] == [BLOCK_1234, BLOCK_5678]
    # With PYTHONHASHSEED set, vLLM's root is hash_fn(that string): cbor text(3) "123" = 0x63 ...
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    try:
        assert kv_cache_utils.init_none_hash(hashing.sha256_cbor) == hashlib.sha256(b"\x63123").digest()
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        kv_cache_utils.init_none_hash()


def test_a_consumer_recomputes_every_stored_hash_from_the_events(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash()
    mgr = KVCacheManager(
        num_blocks=16, block_size=4, hash_algo="sha256_cbor", enable_kv_cache_events=True, kv_events_use_int_block_hashes=False
    )
    for rid, toks in [("a", list(range(13))), ("b", list(range(8)) + [99] * 9)]:
        run(mgr, Request(rid, toks))
    payload = encode_batch(KVEventBatch(ts=0.0, events=mgr.take_events(), data_parallel_rank=0))

    # The consumer: only hashlib, cbor2 and vLLM's documented recipe.
    def consumer_hash(parent, tokens, extra):
        return hashlib.sha256(cbor2.dumps([parent, tokens, extra], canonical=True)).digest()

    root = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    checked = 0
    for ev in decode_batch(payload).events:
        parent = ev.parent_block_hash or root
        for j, h in enumerate(ev.block_hashes):
            parent = consumer_hash(parent, ev.token_ids[j * ev.block_size : (j + 1) * ev.block_size], ev.extra_keys[j])
            assert parent == h
            checked += 1
    assert checked == 3 + 2  # a stores 3 blocks; b hits a's first 2 and stores its own 2


# --- the stream rebuilds the pool's map exactly -------------------------------------------------
ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "add", "free", "reset"]), st.integers(0, 3), st.integers(1, 14)),
    min_size=1,
    max_size=30,
)


@given(ops, st.booleans())
def test_cache_index_from_events_equals_the_pools_map(seq, use_int):
    mgr = KVCacheManager(
        num_blocks=9,
        block_size=2,
        kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(sliding_window=3)],
        enable_kv_cache_events=True,
        kv_events_use_int_block_hashes=use_int,
    )
    index = CacheIndex()
    running: list[Request] = []
    for n, (op, variant, length) in enumerate(seq):
        if op == "add":
            r = Request(f"r{n}", [variant] * 3 + list(range(length)))  # shared prefixes by variant
            hits, k = mgr.get_computed_blocks(r)
            if mgr.allocate_slots(r, r.num_tokens - k, k, hits) is not None:
                r.num_computed_tokens = r.num_tokens
                running.append(r)
        elif op == "free" and running:
            mgr.free(running.pop(variant % len(running)))
        elif op == "reset":
            mgr.reset_prefix_cache()
        index.apply(decode_batch(encode_batch(KVEventBatch(ts=float(n), events=mgr.take_events()))))
        expect: dict[tuple[int, object], int] = {}
        for key, blocks in mgr.block_pool.cached_block_hash_to_block.items():
            h = kv_cache_utils.maybe_convert_block_hash(key[:-4], use_int)
            expect[(int.from_bytes(key[-4:], "big"), h)] = len(blocks)
        got = {(g, h): c for (_, g, h), c in index._copies.items()}
        assert got == expect
        assert index.num_unknown_removals == 0


# --- vLLM <= 0.22's free order, as a switch --------------------------------------------------
def test_older_free_rule_appends_uncached_blocks_to_the_tail():
    def queue_after_free(prepend):
        mgr = KVCacheManager(num_blocks=8, block_size=4, prepend_uncached_blocks=prepend)
        r = Request("r", list(range(10)))  # blocks 1, 2 full (cached), 3 partial (no hash)
        run(mgr, r)
        mgr.free(r)
        return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]

    assert queue_after_free(True) == [3, 4, 5, 6, 7, 2, 1]  # >= 0.24: the partial block is reused first
    assert queue_after_free(False) == [4, 5, 6, 7, 3, 2, 1]  # <= 0.22: everything to the tail


def test_the_data_layer_replays_the_older_free_rule():
    from kvlab.engine.llm_engine import build_engine
    from kvlab.timeline import replay

    final = {}
    for prepend in (True, False):
        e = build_engine(num_blocks=12, block_size=4, max_num_batched_tokens=16, manager_kwargs={"prepend_uncached_blocks": prepend})
        for i in range(8):
            e.add_request(Request(f"r{i}", [i % 2] * 6 + list(range(10 * i, 10 * i + 3 + i)), max_tokens=3 + i % 4))
        while e.has_unfinished_requests():
            e.step()
            live = [b.block_id for b in e.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]
            assert replay(e.events).free_queue == live, (prepend, e.scheduler.step_count)
        final[prepend] = live
    assert final[True] != final[False]  # the two rules really differ on this run


def test_lora_id_is_the_adapters_int_id_as_vllm_publishes_it():
    # vLLM 0.33 publishes BlockStored.lora_id = request.lora_request.adapter_id (its
    # lora_int_id); checked against vLLM 0.33.0 itself: LoRARequest("sql", 7, "/a/sql") on a
    # 9-token prompt, blocks of 4, sha256_cbor, gives lora_id 7, lora_name "sql", extra keys
    # [("sql",), ("sql",)] and the same two block hashes as this.
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    r = Request("r", list(range(9)), lora_name="sql", lora_path="/a/sql", lora_int_id=7)
    run(mgr, r)
    (ev,) = mgr.take_events()
    assert (ev.lora_id, ev.lora_name, ev.extra_keys) == (7, "sql", [("sql",), ("sql",)])
    # The id does not enter the hash (vLLM hashes the name and the path): same hashes as id 8.
    other = Request("o", list(range(9)), lora_name="sql", lora_path="/a/sql", lora_int_id=8)
    other.bind_block_hasher(mgr.request_block_hasher)
    assert other.block_hashes == r.block_hashes


def test_an_engine_numbers_adapters_from_1_in_order_of_first_use():
    from kvlab.engine.llm_engine import build_engine

    class Publisher:
        def __init__(self) -> None:
            self.batches: list = []

        def publish(self, batch) -> None:
            self.batches.append(batch)

    pub = Publisher()
    eng = build_engine(num_blocks=32, block_size=4, manager_kwargs=dict(enable_kv_cache_events=True), kv_event_publisher=pub)
    reqs = [
        Request("a", list(range(8)), max_tokens=1, lora_name="sql"),
        Request("b", list(range(100, 108)), max_tokens=1, lora_name="chat"),
        Request("c", list(range(200, 208)), max_tokens=1, lora_name="sql"),
        Request("d", list(range(300, 308)), max_tokens=1),
    ]
    for r in reqs:
        eng.add_request(r)
    assert [r.lora_int_id for r in reqs] == [1, 2, 1, None]
    assert eng.lora_ids == {"sql": 1, "chat": 2}
    eng.run()
    stored = [(e.lora_name, e.lora_id) for b in pub.batches for e in b.events if isinstance(e, BlockStored)]
    assert stored == [("sql", 1), ("chat", 2), ("sql", 1), (None, None)]
    # generate() numbers its adapter the same way; an id given is kept.
    eng.generate([list(range(400, 408))], max_tokens=1, lora_name="code", lora_path="/p/code")
    eng.add_request(Request("e", list(range(500, 508)), max_tokens=1, lora_name="math", lora_int_id=9))
    assert eng.lora_ids == {"sql": 1, "chat": 2, "code": 3, "math": 9}
    eng.add_request(Request("f", list(range(600, 608)), max_tokens=1, lora_name="law"))
    assert eng.lora_ids["law"] == 10  # after the highest id in use


def test_adapter_ids_are_refused_when_they_clash_and_a_failed_add_leaves_none_behind():
    from kvlab.engine.llm_engine import build_engine

    eng = build_engine(num_blocks=32, block_size=4)
    eng.add_request(Request("a", list(range(8)), lora_name="sql"))
    with pytest.raises(ValueError, match=r"lora_int_id = 5 for adapter 'sql', which this engine numbers 1"):
        eng.add_request(Request("b", list(range(8)), lora_name="sql", lora_int_id=5))
    with pytest.raises(ValueError, match=r"lora_int_id = 1 for adapter 'chat', but adapter 'sql' has that id"):
        eng.add_request(Request("c", list(range(8)), lora_name="chat", lora_int_id=1))
    with pytest.raises(ValueError, match="lora_int_id = 1 for adapter 'chat'"):
        eng.generate([[1, 2, 3]], lora_name="chat", lora_int_id=1)
    assert eng.lora_ids == {"sql": 1} and set(eng.scheduler.requests) == {"a"}

    # An add that fails half way (an event subscriber raises) takes its new adapter id back.
    def boom(event) -> None:
        raise RuntimeError("subscriber down")

    eng.events.subscribe(boom)
    r = Request("d", list(range(8)), lora_name="chat")
    with pytest.raises(RuntimeError, match="subscriber down"):
        eng.add_request(r)
    assert r.lora_int_id is None and eng.lora_ids == {"sql": 1}
    with pytest.raises(RuntimeError, match="subscriber down"):
        eng.generate([[1, 2, 3]], lora_name="code")
    assert eng.lora_ids == {"sql": 1} and set(eng.scheduler.requests) == {"a"}
    eng.events.unsubscribe(boom)
    eng.add_request(r)
    assert r.lora_int_id == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (dict(lora_name="sql", lora_int_id=0), ValueError, "lora_int_id=0 is out of range; lora_int_id must be None or an int >= 1"),
        (dict(lora_name="sql", lora_int_id="7"), TypeError, "lora_int_id must be None or an int"),
        (dict(lora_name="sql", lora_int_id=True), TypeError, "lora_int_id must be None or an int"),
        (dict(lora_int_id=3), ValueError, "lora_int_id = 3 needs a lora_name"),
    ],
)
def test_a_bad_lora_int_id_is_refused_by_name(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        Request("r", [1, 2, 3], **kwargs)


def test_an_event_naming_a_group_the_manager_does_not_have_is_passed_on_with_a_warning(caplog):
    # vLLM 0.33's KVCacheManager.take_events logs "Group index `N` not in KV cache metadata"
    # and leaves that event's spec fields unset; the other events are annotated as usual.
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    r = Request("r", list(range(9)))
    r.bind_block_hasher(mgr.request_block_hasher)
    pool = mgr.block_pool
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks[:1], 0, 1, 4, 3)  # group 3: this manager has one group
    run(mgr, Request("s", list(range(50, 58))))
    with caplog.at_level("WARNING", logger="kvlab.core.kv_cache_manager"):
        evs = mgr.take_events()
    assert [(e.group_idx, e.kv_cache_spec_kind) for e in evs if isinstance(e, BlockStored)] == [(3, None), (0, "full_attention")]
    assert [rec.getMessage() for rec in caplog.records] == ["Group index `3` not in KV cache metadata"]


# --- kv_cache_report_mode="full": a prefix hit is published too (vLLM 0.33) ----------------------
# Checked against vLLM 0.33.0's KVCacheManager: the same four requests (the second with a LoRA
# adapter), on a full-attention manager and on full + sliding window, give the very same events.
def test_a_full_report_request_publishes_its_prefix_hit_as_a_block_stored():
    mgr = KVCacheManager(num_blocks=40, block_size=4, enable_kv_cache_events=True)
    a = Request("a", list(range(18)))
    run(mgr, a)
    ha = [i64(x) for x in a.block_hashes]
    assert mgr.take_events() == [stored(ha, None, list(range(16)))]
    # An incremental request (the default) that hits publishes nothing for the hit.
    run(mgr, Request("d", list(range(18))))
    assert mgr.take_events() == []
    # A full-report request: its 4-block hit is told first (no parent: a hit starts at block
    # 0), then the block it caches, as usual.
    b = Request("b", list(range(18)) + [99, 98, 97], kv_cache_report_mode="full")
    run(mgr, b)
    hb = [i64(x) for x in b.block_hashes]
    assert hb[:4] == ha and mgr.take_events() == [stored(ha, None, list(range(16))), stored(hb[4:], hb[3], [16, 17, 99, 98])]
    # Every lookup of a full-report request reports its hit, whether or not it is then allocated.
    c = Request("c", list(range(13)), kv_cache_report_mode="full")
    mgr.get_computed_blocks(c)
    mgr.get_computed_blocks(c)
    assert mgr.take_events() == [stored(ha[:3], None, list(range(12)))] * 2


def test_a_full_report_on_a_sliding_window_group_hashes_every_position_of_the_hit():
    groups = [FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=8)]
    mgr = KVCacheManager(num_blocks=40, block_size=4, kv_cache_groups=groups, enable_kv_cache_events=True)
    run(mgr, Request("a", list(range(18))))
    mgr.take_events()
    c = Request("c", list(range(13)), kv_cache_report_mode="full")
    hits, n = mgr.get_computed_blocks(c)
    assert n == 12 and [b.is_null for b in hits.blocks[1]] == [True, False, False]  # the window needs 2 blocks
    hc = [i64(x) for x in c.block_hashes]
    assert mgr.take_events() == [
        stored(hc, None, list(range(12))),
        stored(hc, None, list(range(12)), group=1, kind="sliding_window", window=8),  # the null position's hash too
    ]


def test_report_mode_is_checked_and_a_pool_reports_only_what_it_was_asked():
    with pytest.raises(ValueError, match=r"kv_cache_report_mode must be one of \('incremental', 'full'\), got 'all'"):
        Request("r", [1, 2, 3], kv_cache_report_mode="all")
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    r = Request("r", list(range(9)))
    run(mgr, r)
    mgr.take_events()
    pool = mgr.block_pool
    with pytest.raises(ValueError, match=r"num_cached_blocks = 3, but request 'r' has only 2 full blocks of 4 tokens"):
        pool.emit_cached_block_events(r, 3, 4, 0)
    with pytest.raises(ValueError, match="num_cached_blocks"):
        pool.emit_cached_block_events(r, -1, 4, 0)
    pool.emit_cached_block_events(r, 0, 4, 0)  # nothing to tell
    assert mgr.take_events() == []
    quiet = KVCacheManager(num_blocks=8, block_size=4)  # events off: nothing is queued
    q = Request("q", list(range(9)), kv_cache_report_mode="full")
    run(quiet, q)
    quiet.get_computed_blocks(Request("q2", list(range(9)), kv_cache_report_mode="full"))
    assert quiet.block_pool.kv_event_queue == []


def test_a_copy_counting_index_over_counts_a_full_reports_hit_as_the_fold_says():
    # The hit's BlockStored is not a new copy, and no BlockRemoved will match it.
    mgr = KVCacheManager(num_blocks=6, block_size=4, enable_kv_cache_events=True)
    a = Request("a", list(range(9)))
    run(mgr, a)
    mgr.free(a)
    mgr.get_computed_blocks(Request("c", list(range(9)), kv_cache_report_mode="full"))
    index = CacheIndex().apply(mgr.take_events())
    h0 = i64(a.block_hashes[0])
    assert index.num_copies(h0) == 2
    run(mgr, Request("s", list(range(40, 60))))  # 5 blocks: both cached ones are evicted
    index.apply(mgr.take_events())
    assert index.num_copies(h0) == 1  # one too many, for good
