"""The P2P sessions' wire protocol (vLLM 0.33's ``session/protocol.py``): what a peer's message
must look like before a session reads it."""

from __future__ import annotations

import msgspec
import pytest

from kvlab.kv_offload.tiering.p2p.session.protocol import (
    MESSAGE_TYPES,
    TYPE_KEY,
    AbortAckMsg,
    AbortFetchMsg,
    ConnectAckMsg,
    ConnectMsg,
    DisconnectMsg,
    FetchMsg,
    LookupMsg,
    LookupRespMsg,
    TransferDoneMsg,
    validate_message,
)

CONNECT = ConnectMsg.make(
    peer_id="10.0.0.1:5000", agent_metadata=b"agent", base_addr=0, num_blocks=64, block_len=4096, config_fingerprint="ab" * 8, hash_seed="0"
)


def test_every_kind_survives_the_wire_and_is_recognised():
    keys = [b"k" * 12, b"j" * 12]
    sent = [
        CONNECT,
        ConnectAckMsg.make(peer_id="10.0.0.2:5000"),
        DisconnectMsg.make(),
        LookupMsg.make(kv_request_id="r1", keys=keys, round_seq=2),
        LookupRespMsg.make(kv_request_id="r1", keys=keys, hits=[True, False]),
        FetchMsg.make(kv_request_id="r1", keys=keys, block_indexes=[7, 0], round_seq=2),
        TransferDoneMsg.make(kv_request_id="r1", success=True, round_seq=2),
        AbortFetchMsg.make(kv_request_id="r1", round_seq=3),
        AbortAckMsg.make(kv_request_id="r1", round_seq=3),
    ]
    received = [msgspec.msgpack.decode(msgspec.msgpack.encode(m)) for m in sent]
    assert received == sent  # bytes stay bytes, bools stay bools
    kinds = [validate_message(m) for m in received]
    assert [k.TYPE for k in kinds if k] == [m[TYPE_KEY] for m in sent] and len(set(kinds)) == len(MESSAGE_TYPES) == 9
    assert sent[5] == {"type": "fetch", "kv_request_id": "r1", "keys": keys, "block_indexes": [7, 0], "round_seq": 2}


def test_a_kind_this_side_does_not_know_is_left_to_the_caller_to_ignore():
    assert validate_message({TYPE_KEY: "hello_from_the_future", "x": 1}) is None


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        ({**CONNECT, "block_len": 0}, "block_len: expected positive int, got 0"),
        ({**CONNECT, "num_blocks": True}, "num_blocks: expected positive int, got True"),  # a bool is not a count
        ({**CONNECT, "base_addr": -1}, "base_addr: expected non-negative int, got -1"),
        ({**CONNECT, "agent_metadata": "agent"}, "agent_metadata: expected bytes, got str"),
        ({k: v for k, v in CONNECT.items() if k != "hash_seed"}, "hash_seed: expected str, got NoneType"),
        (FetchMsg.make(kv_request_id="r", keys=[b"k"], block_indexes=[], round_seq=0), "keys/block_indexes length mismatch: 1 vs 0"),
        (FetchMsg.make(kv_request_id="r", keys=[b"k"], block_indexes=[-3], round_seq=0), "block_indexes: invalid index -3"),
        (LookupRespMsg.make(kv_request_id="r", keys=[b"k"], hits=[1]), "hits: invalid value 1"),
        (AbortAckMsg.make(kv_request_id="r"), "round_seq: expected non-negative int, got None"),
        ([TYPE_KEY, "fetch"], "a message must be a dict, got list"),
    ],
)
def test_a_malformed_message_is_refused_with_the_field_at_fault(msg, error):
    with pytest.raises(ValueError, match=error):
        validate_message(msg)
