"""Routing policies: which replica gets the next request (lesson 11).

A fleet of identical engines behind one router. Without knowledge of their caches the
router can spread requests evenly (**round-robin**) or send each to the replica with the
fewest unfinished requests (**least-loaded**). A **KV-aware** router (llm-d's
kv-cache-manager, NVIDIA Dynamo's KV router, vLLM's production stack) reads every
replica's KV-event stream, keeps a ``CacheIndex`` per replica, and scores a replica by the
length of the request's prefix it already caches -- the prefill it would skip.

To score, the router must compute the request's block keys itself, *exactly* as the
replicas do: the same block size, the same hash function (vLLM's ``sha256_cbor``: canonical
CBOR, so any language can reproduce it), the same chain root (``NONE_HASH``, derived from
``PYTHONHASHSEED`` in vLLM >= 0.29 -- a router with another seed matches nothing), the same
extra keys (the ``cache_salt`` goes into the first block, so a tenant's prefix is matched
only for that tenant), and the published form of a hash (its low 64 bits as an int).
:func:`prompt_block_hashes` does it with kvlab's own hasher, the one the engine uses.

A policy is any object with ``name`` and ``choose(request, block_hashes, replicas)``; each
:class:`ReplicaState` is what the router knows of one replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvlab.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
from kvlab.distributed.kv_events import MEDIUM_GPU, CacheIndex
from kvlab.request import Request
from kvlab.utils.checks import check_int, check_number, check_optional_int
from kvlab.utils.hashing import get_hash_fn_by_name


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_algo: str = "sha256_cbor",
    cache_salt: str | None = None,
    lora_name: str | None = None,
    use_int: bool = True,
) -> list[int | bytes]:
    """The published keys of a prompt's full blocks, as its replica will publish them.

    Built with the engine's own hasher (``get_request_block_hasher``), so every rule -- the
    chain, NONE_HASH, extra keys -- is the replica's. ``use_int`` gives vLLM's default event
    form (low 64 bits of the digest); False the 32-byte digests.
    """
    block_size = check_int("block_size", block_size, 1)
    if not isinstance(use_int, bool):
        raise TypeError(f"use_int must be True or False, got {use_int!r}")
    hasher = get_request_block_hasher(block_size, get_hash_fn_by_name(hash_algo))
    req = Request("router-probe", list(token_ids), cache_salt=cache_salt, lora_name=lora_name, block_hasher=hasher)
    return [maybe_convert_block_hash(h, use_int) for h in req.block_hashes]


@dataclass
class ReplicaState:
    """What the router knows of one replica: its name, its ``CacheIndex`` (rebuilt from its
    event stream), its load (unfinished requests, as of the last sync) and how many
    requests it was sent."""

    name: str
    index: CacheIndex = field(default_factory=CacheIndex)
    load: int = 0
    num_routed: int = 0

    def cached_prefix_blocks(self, block_hashes: Sequence[Any], group_idx: int | None = 0, medium: str | None = MEDIUM_GPU) -> int:
        """Leading blocks of the prompt this replica holds: the walk stops at the first miss,
        as the replica's own lookup does (a later block without its parents is no hit)."""
        n = 0
        num_copies = self.index.num_copies
        for h in block_hashes:
            if num_copies(h, group_idx, medium) == 0:
                break
            n += 1
        return n


def check_choice_args(block_hashes: Any, replicas: Any) -> None:
    """What every ``choose`` needs, checked before a policy changes anything (RoundRobin's
    turn, KVAware's ``last_scores``): a non-empty list of :class:`ReplicaState` and a list
    of block hashes."""
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
        raise TypeError(f"replicas must be a list of ReplicaState, got {type(replicas).__name__}")
    if not replicas:
        raise ValueError("replicas must not be empty: a router needs at least one replica to choose from")
    for i, r in enumerate(replicas):
        if not isinstance(r, ReplicaState):
            raise TypeError(f"replicas[{i}] must be a ReplicaState, got {type(r).__name__} {r!r}")
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise TypeError(f"block_hashes must be a list of block hashes (prompt_block_hashes(...)), got {type(block_hashes).__name__}")


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: Any, block_hashes: Sequence[Any], replicas: Sequence[ReplicaState]) -> int: ...


class RoundRobin:
    """Replica 0, 1, ..., N-1, 0, ...: even by count, blind to caches and lengths."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Any, block_hashes: Sequence[Any], replicas: Sequence[ReplicaState]) -> int:
        check_choice_args(block_hashes, replicas)
        i = self._next % len(replicas)
        self._next += 1
        return i


class LeastLoaded:
    """The replica with the fewest unfinished requests (ties: the lowest index)."""

    name = "least_loaded"

    def choose(self, request: Any, block_hashes: Sequence[Any], replicas: Sequence[ReplicaState]) -> int:
        check_choice_args(block_hashes, replicas)
        return min(range(len(replicas)), key=lambda i: (replicas[i].load, i))


class KVAware:
    """The replica caching the longest prefix of the request; ties go to the least loaded.

    ``load_weight`` > 0 trades cache affinity for balance, as production routers do
    (Dynamo's KV router adds the replica's active load to the prefill it would skip; llm-d
    adds a load scorer to its prefix scorer): score = cached prefix blocks - ``load_weight``
    x unfinished requests on the replica, i.e. each queued request counts as
    ``load_weight`` blocks of prefill. With 0 (the default) the prefix decides alone -- and
    a popular prefix piles onto one replica.
    """

    def __init__(self, load_weight: float = 0.0, *, group_idx: int | None = 0, medium: str | None = MEDIUM_GPU) -> None:
        self.load_weight = check_number("load_weight", load_weight, 0)
        self.group_idx = check_optional_int("group_idx", group_idx, 0)
        if medium is not None and not isinstance(medium, str):
            raise TypeError(f"medium must be None or a str ('GPU', 'CPU', 'STORAGE'), got {type(medium).__name__}")
        self.medium = medium
        self.name = "kv_aware" if not self.load_weight else f"kv_aware+load({self.load_weight:g})"
        self.last_scores: list[float] = []

    def choose(self, request: Any, block_hashes: Sequence[Any], replicas: Sequence[ReplicaState]) -> int:
        check_choice_args(block_hashes, replicas)
        w = self.load_weight
        scores = [r.cached_prefix_blocks(block_hashes, self.group_idx, self.medium) - w * r.load for r in replicas]
        self.last_scores = scores
        return min(range(len(replicas)), key=lambda i: (-scores[i], replicas[i].load, i))


POLICIES: dict[str, type[RoutingPolicy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "kv_aware": KVAware}


def make_policy(policy: str | RoutingPolicy) -> RoutingPolicy:
    """A fresh policy object from its name, or ``policy`` itself (any object with
    ``name`` and ``choose``)."""
    if isinstance(policy, str):
        try:
            return POLICIES[policy]()
        except KeyError:
            raise ValueError(f"policy={policy!r} is unknown; choose one of {sorted(POLICIES)} or pass a policy object") from None
    if not callable(getattr(policy, "choose", None)) or not isinstance(getattr(policy, "name", None), str):
        raise TypeError(
            f"policy must be a name or an object with .name and .choose(request, block_hashes, replicas), got {type(policy).__name__}"
        )
    return policy


__all__ = [
    "KVAware",
    "check_choice_args",
    "LeastLoaded",
    "POLICIES",
    "ReplicaState",
    "RoundRobin",
    "RoutingPolicy",
    "make_policy",
    "prompt_block_hashes",
]
