"""vLLM's KV-event wire format: byte identity against msgpack written out by hand from
vLLM 0.33's schema (vllm/distributed/kv_events.py), both encodings, round trips, CacheIndex.

The expected payloads below are spelled out byte by byte from the msgpack spec and vLLM's
struct definitions (array_like batch, tagged-map events with omit_defaults; tagged arrays for
vLLM <= 0.23) -- they are not produced by kvlab's encoder.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import kv_events
from kvlab.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    KVEventBatch,
    decode_batch,
    encode_batch,
)


def hx(*parts: str) -> bytes:
    """Hex pieces (spaces allowed), one per msgpack item, so each line can be checked."""
    return bytes.fromhex("".join(parts).replace(" ", ""))


def s(text: str) -> str:
    """A msgpack fixstr (< 32 bytes): 0xa0 | length, then UTF-8 -- as hex."""
    b = text.encode()
    assert len(b) < 32
    return f"{0xA0 | len(b):02x}" + b.hex()


H32 = bytes(range(32))  # a 32-byte digest (hashes are digests when int hashes are off)

# --- one batch, every shape of field ------------------------------------------------------------
BATCH = KVEventBatch(
    ts=1.5,
    events=[
        BlockStored(
            block_hashes=[H32, 7],
            parent_block_hash=None,
            token_ids=[1, 2, 300, 70000],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name="sql-lora",
            extra_keys=[None, ("sql-lora", ("img-a", 3), "tenant")],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved(block_hashes=[2**64 - 1], medium="GPU", group_idx=1),
        AllBlocksCleared(),
    ],
    data_parallel_rank=0,
)

MAP_PAYLOAD = hx(
    "93",  # the batch: array of 3 = [ts, events, data_parallel_rank]
    "cb 3ff8000000000000",  # ts: float64 1.5
    "93",  # events: array of 3
    # BlockStored: a map of the tag + the 10 fields that are not at their default (None).
    # lora_id / parent_block_hash have no default, so they appear even as None;
    # kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids do not.
    # The header is a map16 (de 000b), not a fixmap: BlockStored has 15 fields + the tag, and
    # msgspec sizes the header for the most entries the struct could have.
    "de 000b",
    s("type"),
    s("BlockStored"),
    s("block_hashes"),
    "92",
    "c4 20" + H32.hex(),
    "07",  # [bin8(32), 7]
    s("parent_block_hash"),
    "c0",
    s("token_ids"),
    "94 01 02 cd012c ce00011170",  # 1, 2, uint16 300, uint32 70000
    s("block_size"),
    "02",
    s("lora_id"),
    "c0",
    s("medium"),
    s("GPU"),
    s("lora_name"),
    s("sql-lora"),
    s("extra_keys"),
    "92 c0",
    "93" + s("sql-lora") + "92" + s("img-a") + "03" + s("tenant"),
    s("group_idx"),
    "00",
    "b2" + b"kv_cache_spec_kind".hex(),
    "ae" + b"full_attention".hex(),
    # BlockRemoved: tag + 3 fields (locality, ownership omitted)
    "84",
    s("type"),
    s("BlockRemoved"),
    s("block_hashes"),
    "91 cf ffffffffffffffff",  # uint64 2**64 - 1
    s("medium"),
    s("GPU"),
    s("group_idx"),
    "01",
    # AllBlocksCleared: just the tag
    "81",
    s("type"),
    s("AllBlocksCleared"),
    "00",  # data_parallel_rank 0
)

# vLLM <= 0.23: each event a tagged positional array; msgspec writes every field of an
# array-like struct (omit_defaults does not apply), None included.
ARRAY_PAYLOAD = hx(
    "93",
    "cb 3ff8000000000000",
    "93",
    "9c",  # BlockStored: 12 items = tag + the 11 fields of vLLM 0.23
    s("BlockStored"),
    "92",
    "c4 20" + H32.hex(),
    "07",
    "c0",
    "94 01 02 cd012c ce00011170",
    "02",
    "c0",
    s("GPU"),
    s("sql-lora"),
    "92 c0",
    "93" + s("sql-lora") + "92" + s("img-a") + "03" + s("tenant"),
    "00",
    "ae" + b"full_attention".hex(),
    "c0",  # kv_cache_spec_sliding_window None, still written
    "94",
    s("BlockRemoved"),
    "91 cf ffffffffffffffff",
    s("GPU"),
    "01",
    "91",
    s("AllBlocksCleared"),
    "00",
)


def test_map_encoding_is_vllm_033_byte_for_byte():
    assert encode_batch(BATCH) == MAP_PAYLOAD


def test_array_encoding_is_vllm_023_byte_for_byte():
    assert encode_batch(BATCH, array_like=True) == ARRAY_PAYLOAD


def test_a_batch_is_always_three_items():
    # An array-like struct writes every field: a rank that was never set is nil (vLLM's
    # publisher sets it before encoding).
    assert encode_batch(KVEventBatch(ts=0.0, events=[])) == hx("93", "cb 0000000000000000", "90", "c0")
    assert encode_batch(KVEventBatch(ts=2.0, events=[AllBlocksCleared()], data_parallel_rank=3)) == hx(
        "93", "cb 4000000000000000", "91", "81", s("type"), s("AllBlocksCleared"), "03"
    )


def test_decode_reads_both_encodings_to_the_same_batch():
    a, b = decode_batch(MAP_PAYLOAD), decode_batch(ARRAY_PAYLOAD)
    assert a == b
    stored = a.events[0]
    assert type(stored) is BlockStored and stored.block_hashes == [H32, 7] and stored.lora_name == "sql-lora"
    # msgpack has one array type: a nested (identifier, offset) comes back as a list (as in vLLM)
    assert stored.extra_keys == [None, ("sql-lora", ["img-a", 3], "tenant")]
    assert a.events[1] == BlockRemoved(block_hashes=[2**64 - 1], medium="GPU", group_idx=1)
    assert a.events[2] == AllBlocksCleared() and a.data_parallel_rank == 0 and a.ts == 1.5


def test_decode_accepts_a_map_event_with_every_later_field():
    full = BlockStored(
        block_hashes=[1],
        parent_block_hash=2,
        token_ids=[5],
        block_size=1,
        lora_id=3,
        medium="CPU",
        lora_name=None,
        locality="LOCAL",
        ownership="tier-1",
        session_id="s",
        lookahead_token_ids=[[6, 7]],
    )
    assert decode_batch(encode_batch(KVEventBatch(ts=1.0, events=[full]))).events == [full]
    with pytest.raises(ValueError, match=r"BlockStored.locality did not exist.*<= 0.23"):
        encode_batch(KVEventBatch(ts=1.0, events=[full]), array_like=True)


def test_bad_input_is_rejected_with_a_clear_error():
    with pytest.raises(TypeError, match="batch must be a KVEventBatch"):
        encode_batch([AllBlocksCleared()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"batch.events\[1\] is a str"):
        encode_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared(), "x"]))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="payload must be bytes"):
        decode_batch("93")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(hx("92 cb 0000000000000000 91", "81", s("type"), s("BlockMoved")))
    with pytest.raises((ValueError, msgspec.DecodeError)):
        decode_batch(b"\x93")


def test_module_mirrors_vllm_names_and_is_importable_both_ways():
    import kvlab.kv_events as a
    from kvlab.distributed import kv_events as b

    assert a.BlockStored is b.BlockStored is kv_events.BlockStored and a.encode_batch is b.encode_batch
    assert [f for f in BlockStored.__struct_fields__] == [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
        "ownership", "session_id", "lookahead_token_ids",
    ]  # fmt: skip
    assert BlockRemoved.__struct_fields__ == ("block_hashes", "medium", "group_idx", "locality", "ownership")
    assert BlockStored.__struct_config__.tag == "BlockStored" and not BlockStored.__struct_config__.array_like
    assert KVEventBatch.__struct_config__.array_like and KVEventBatch.__struct_config__.omit_defaults


# --- round trips ----------------------------------------------------------------------------------
hashes = st.one_of(st.binary(min_size=32, max_size=32), st.integers(0, 2**64 - 1))
opt_str = st.one_of(st.none(), st.text(min_size=1, max_size=8))
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=12),
    block_size=st.integers(1, 64),
    lora_id=st.one_of(st.none(), st.integers(0, 100)),
    medium=st.sampled_from(["GPU", "CPU", None]),
    lora_name=opt_str,
    extra_keys=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=5))), max_size=4)),
    group_idx=st.one_of(st.none(), st.integers(0, 3)),
    kv_cache_spec_kind=st.sampled_from([None, "full_attention", "sliding_window"]),
    kv_cache_spec_sliding_window=st.one_of(st.none(), st.integers(1, 4096)),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=3),
    medium=st.sampled_from(["GPU", None]),
    group_idx=st.one_of(st.none(), st.integers(0, 3)),
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6),
    data_parallel_rank=st.one_of(st.none(), st.integers(0, 7)),
)


@given(batches)
def test_round_trip_in_both_encodings(batch):
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(encode_batch(batch, array_like=True)) == batch
    # vLLM's own generic decode sees maps for events, an array for the batch
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert isinstance(raw, list) and all(isinstance(e, dict) and "type" in e for e in raw[1])


# --- CacheIndex -----------------------------------------------------------------------------------
def _stored(*hs, group=0):
    return BlockStored(
        block_hashes=list(hs),
        parent_block_hash=None,
        token_ids=[],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
    )


def _removed(*hs, group=0):
    return BlockRemoved(block_hashes=list(hs), medium="GPU", group_idx=group)


def test_cache_index_counts_copies_per_hash():
    idx = CacheIndex()
    idx.apply(KVEventBatch(ts=0.0, events=[_stored(1, 2), _stored(2)]))  # hash 2 stored twice
    assert idx.cached_hashes == {1, 2} and idx.num_copies(2) == 2
    idx.apply(encode_batch(KVEventBatch(ts=1.0, events=[_removed(2)])))  # a payload works too
    assert idx.cached_hashes == {1, 2} and idx.num_copies(2) == 1  # one copy left: still cached
    idx.apply([_removed(2), _removed(1)])
    assert idx.cached_hashes == set() and len(idx) == 0
    idx.apply([_removed(9)])  # a hash stored before we subscribed
    assert idx.num_unknown_removals == 1 and idx.num_events == 6


def test_cache_index_keeps_groups_apart_and_clears_on_reset():
    idx = CacheIndex().apply([_stored(5, group=0), _stored(5, group=1), _removed(5, group=1)])
    assert idx.num_copies(5, group_idx=0) == 1 and idx.num_copies(5, group_idx=1) == 0
    assert 5 in idx and idx.cached_hashes == {5}
    idx.apply([AllBlocksCleared()])
    assert idx.cached_hashes == set() and 5 not in idx
    with pytest.raises(TypeError, match=r"events\[0\] is a int"):
        idx.apply([3])  # type: ignore[list-item]


def test_bench_events_runs_and_reports_the_decode_rate(capsys):
    from kvlab.bench import events

    events.main(["--requests", "200", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "decode_batch:" in out and "events/s" in out and "x the target" in out
    assert "BlockStored" in out and "BlockRemoved" in out
    assert "over ZeroMQ end to end" in out and " 0 lost" in out
