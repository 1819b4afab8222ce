"""The messages two P2P sessions exchange (vLLM 0.33:
``vllm/v1/kv_offload/tiering/p2p/session/protocol.py``).

Each engine holds one session per peer, and each session plays both parts: a *client* asking
the peer for blocks and a *server* sending the peer blocks. Messages are msgpack dicts whose
``"type"`` names the kind; the keys are the class constants below. A message from a peer is
checked with its kind's ``validate`` before anything reads it: a malformed one is a protocol
violation (ValueError), after which the session disconnects; a kind it does not know (a newer
peer's) is logged and ignored.

The conversation::

    client                                  server
      |-- connect (identity, NIXL metadata,   |   checks block_len, fingerprint and hash
      |   region, fingerprint, hash seed) --> |   seed, registers the client's region
      | <------------------------ connect_ack |   (only once registered: no write can
      |                                       |    reach an unregistered peer)
      |-- lookup (keys, round) -------------> |   symmetric P2P: which keys do you hold?
      | <------------- lookup_resp (key, hit) |   (may be split over several replies)
      |-- fetch (keys -> my block indexes) -> |   ready blocks are written at once, the
      |                                       |   others when the server stores them
      | <---- transfer_done (round, success)  |
      |-- abort_fetch (round) --------------> |   the client timed out: cancel the round
      | <----------------- abort_ack (round)  |
      |-- fetch (no keys) ------------------> |   "request finished": the server lets go
      |<------------- disconnect -----------> |   either side, any time

A request may run several lookup -> fetch *rounds*; ``round_seq`` keeps each round's
answers, writes and completion apart (a disaggregated-prefill client never looks up and stays
in round 0). The fingerprint (model, dtype, block sizes) and the hash seed (``PYTHONHASHSEED``
or the default) must match: peers that differ would compute other hashes or lay blocks out
otherwise, and must never exchange blocks.
"""

from __future__ import annotations

from typing import Any, ClassVar

TYPE_KEY = "type"

# A field's check: (key, what it must be). "str", "bytes", "bool", "list": that type;
# "pos": an int > 0; "nonneg": an int >= 0. (bool is an int in Python, and not a count.)
_Check = tuple[str, str]


def _is_count(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check(msg: dict, key: str, kind: str) -> None:
    value = msg.get(key)
    if kind in ("pos", "nonneg"):
        if not _is_count(value, 1 if kind == "pos" else 0):
            wanted = "positive int" if kind == "pos" else "non-negative int"
            raise ValueError(f"{key}: expected {wanted}, got {value!r}")
        return
    typ = {"str": str, "bytes": bytes, "bool": bool, "list": list}[kind]
    if not isinstance(value, typ):
        raise ValueError(f"{key}: expected {typ.__name__}, got {type(value).__name__}")


def _same_length(msg: dict, a: str, b: str) -> None:
    if len(msg[a]) != len(msg[b]):
        raise ValueError(f"{a}/{b} length mismatch: {len(msg[a])} vs {len(msg[b])}")


class _Message:
    TYPE: ClassVar[str]
    CHECKS: ClassVar[tuple[_Check, ...]] = ()

    @classmethod
    def validate(cls, msg: dict) -> None:
        """Raise ValueError naming the first field of the wrong type or value."""
        for key, kind in cls.CHECKS:
            _check(msg, key, kind)
        cls._validate_more(msg)

    @classmethod
    def _validate_more(cls, msg: dict) -> None:
        return

    @classmethod
    def make(cls, **fields: Any) -> dict:
        """The message as sent: ``{"type": TYPE, **fields}``."""
        return {TYPE_KEY: cls.TYPE, **fields}


class ConnectMsg(_Message):
    """Client -> server, first: who we are and where our blocks are."""

    TYPE = "connect"
    PEER_ID = "peer_id"  # our control address, "host:port"
    AGENT_METADATA = "agent_metadata"  # our data transport's metadata (NIXL's agent)
    BASE_ADDR = "base_addr"
    NUM_BLOCKS = "num_blocks"
    BLOCK_LEN = "block_len"  # must equal the server's
    CONFIG_FINGERPRINT = "config_fingerprint"  # must equal the server's
    HASH_SEED = "hash_seed"  # must equal the server's
    CHECKS = (
        (PEER_ID, "str"),
        (AGENT_METADATA, "bytes"),
        (BASE_ADDR, "nonneg"),
        (NUM_BLOCKS, "pos"),
        (BLOCK_LEN, "pos"),
        (HASH_SEED, "str"),
    )


class ConnectAckMsg(_Message):
    """Server -> client: registered; messages may flow."""

    TYPE = "connect_ack"
    PEER_ID = "peer_id"
    CHECKS = ((PEER_ID, "str"),)


class DisconnectMsg(_Message):
    """Either way: this session is over (no fields)."""

    TYPE = "disconnect"


class FetchMsg(_Message):
    """Client -> server: write these keys into my block indexes (closes one round). Empty
    ``keys`` and ``block_indexes``: the request is finished."""

    TYPE = "fetch"
    KV_REQUEST_ID = "kv_request_id"
    KEYS = "keys"  # offload keys (bytes)
    BLOCK_INDEXES = "block_indexes"  # the client's blocks, one per key
    ROUND_SEQ = "round_seq"
    CHECKS = ((KV_REQUEST_ID, "str"), (ROUND_SEQ, "nonneg"), (KEYS, "list"), (BLOCK_INDEXES, "list"))

    @classmethod
    def _validate_more(cls, msg: dict) -> None:
        _same_length(msg, "keys", "block_indexes")
        for idx in msg[cls.BLOCK_INDEXES]:
            if not _is_count(idx, 0):
                raise ValueError(f"block_indexes: invalid index {idx!r}")


class LookupMsg(_Message):
    """Client -> server: which of these keys do you hold? (symmetric P2P)"""

    TYPE = "lookup"
    KV_REQUEST_ID = "kv_request_id"
    KEYS = "keys"
    ROUND_SEQ = "round_seq"
    CHECKS = ((KV_REQUEST_ID, "str"), (KEYS, "list"), (ROUND_SEQ, "nonneg"))


class LookupRespMsg(_Message):
    """Server -> client: one hit flag per key (an answer may come in several messages)."""

    TYPE = "lookup_resp"
    KV_REQUEST_ID = "kv_request_id"
    KEYS = "keys"
    HITS = "hits"
    CHECKS = ((KV_REQUEST_ID, "str"), (KEYS, "list"), (HITS, "list"))

    @classmethod
    def _validate_more(cls, msg: dict) -> None:
        _same_length(msg, "keys", "hits")
        for hit in msg[cls.HITS]:
            if not isinstance(hit, bool):
                raise ValueError(f"hits: invalid value {hit!r}")


class TransferDoneMsg(_Message):
    """Server -> client: every block of the round was written (or the round failed)."""

    TYPE = "transfer_done"
    KV_REQUEST_ID = "kv_request_id"
    SUCCESS = "success"
    ROUND_SEQ = "round_seq"
    CHECKS = ((KV_REQUEST_ID, "str"), (SUCCESS, "bool"), (ROUND_SEQ, "nonneg"))


class AbortFetchMsg(_Message):
    """Client -> server: I gave up waiting for this round; cancel its writes."""

    TYPE = "abort_fetch"
    KV_REQUEST_ID = "kv_request_id"
    ROUND_SEQ = "round_seq"
    CHECKS = ((KV_REQUEST_ID, "str"), (ROUND_SEQ, "nonneg"))


class AbortAckMsg(_Message):
    """Server -> client: the round's writes are stopped; its blocks are yours again."""

    TYPE = "abort_ack"
    KV_REQUEST_ID = "kv_request_id"
    ROUND_SEQ = "round_seq"
    CHECKS = ((KV_REQUEST_ID, "str"), (ROUND_SEQ, "nonneg"))


MESSAGE_TYPES: dict[str, type[_Message]] = {
    m.TYPE: m
    for m in (ConnectMsg, ConnectAckMsg, DisconnectMsg, FetchMsg, LookupMsg, LookupRespMsg, TransferDoneMsg, AbortFetchMsg, AbortAckMsg)
}


def validate_message(msg: Any) -> type[_Message] | None:
    """The kind of a message from a peer, after checking its fields; None for a kind this
    side does not know (to be ignored, not fought). ValueError if it is not a message at all
    or a known kind is malformed."""
    if not isinstance(msg, dict):
        raise ValueError(f"a message must be a dict, got {type(msg).__name__}")
    kind = MESSAGE_TYPES.get(msg.get(TYPE_KEY))  # type: ignore[arg-type]
    if kind is not None:
        kind.validate(msg)
    return kind
