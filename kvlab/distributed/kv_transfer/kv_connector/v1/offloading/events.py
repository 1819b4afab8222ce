"""The KV events the offloading connector publishes for its tiers (vLLM 0.33:
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``).

A tier knows a stored chunk only by its key -- the chunk's last block hash and its group --
so by default the connector publishes *placeholders*: a ``BlockStored`` with that one hash,
no tokens, no parent and ``block_size=0``, and a ``BlockRemoved`` naming the same hash. A
consumer learns that the hash is in host memory, not what it stands for.

With ``self_describing_kv_events`` on (``kv_connector_extra_config``), the
:class:`OffloadingEventsTracker` snapshots each chunk's payload while its request is still
alive -- when the chunk is stored, or when a lookup finds it in the CPU tier -- and the
events then carry every block hash of the chunk, the parent, the tokens and the block size,
as the GPU pool's own events do. A KV-aware router can then route to prefixes that live only
in host memory. Only full-attention groups get payloads: a window or Mamba chunk does not
stand for its whole prefix, so those stay placeholders (with their group's kind, so a reader
can skip them). A payload is kept until the chunk is gone from every tier that announced it,
so each removal names the same hashes its store did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvlab.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes, to_event_extra_keys
from kvlab.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from kvlab.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
from kvlab.kv_offload.base import Medium, OffloadingKVEventsConfig, OffloadKey, get_offload_block_hash, get_offload_group_idx

if TYPE_CHECKING:
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
    from kvlab.kv_cache_interface import KVCacheGroupSpec
    from kvlab.kv_offload.base import OffloadingEvent
    from kvlab.request import Request
    from kvlab.utils.hashing import BlockHash

logger = logging.getLogger(__name__)

_EVENT_MEDIUM = {Medium.CPU: MEDIUM_CPU, Medium.STORAGE: MEDIUM_STORAGE}


def _event_medium(event: OffloadingEvent) -> str:
    """The event's ``medium`` string ("CPU", "STORAGE"; a tier's own string as it is)."""
    return _EVENT_MEDIUM[event.medium] if isinstance(event.medium, Medium) else event.medium


#: The residency a primary-tier (CPU) hit or store stands for.
_PRIMARY: tuple[Medium | str, str | None] = (Medium.CPU, None)


class OffloadingEventGroupSpec(NamedTuple):
    """What a ``BlockStored`` event says of its group: the spec's kind ("full_attention",
    "sliding_window", ...) and, for a window, its size in tokens."""

    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


def get_offloading_event_group_spec(kv_cache_group: KVCacheGroupSpec) -> OffloadingEventGroupSpec:
    spec = kv_cache_group.kv_cache_spec
    return OffloadingEventGroupSpec(get_kv_cache_spec_kind(spec), get_kv_cache_spec_sliding_window(spec))


@dataclass(slots=True)
class _OffloadEventMetadata:
    """One chunk's ``BlockStored`` payload, taken while its request was alive, and the
    (medium, ownership) residencies that announced it and have not removed it yet."""

    block_hashes: tuple[BlockHash, ...]  # the chunk's blocks; the last is its key's hash
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None  # not captured yet (None), as in vLLM 0.33
    group_idx: int
    kv_cache_spec: OffloadingEventGroupSpec
    active_residencies: set[tuple[Medium | str, str | None]]


def _metadata(
    req: Request, group_config: GroupOffloadConfig, hashes: Sequence[BlockHash], first_hash: int, start: int, end: int, block_size: int
) -> _OffloadEventMetadata:
    """The payload of ``hashes`` (the first at hash index ``first_hash``) over tokens
    ``start:end`` of ``req``, held by the CPU tier."""
    lora = req.lora_request
    return _OffloadEventMetadata(
        block_hashes=tuple(hashes),
        parent_block_hash=req.block_hashes[first_hash - 1] if first_hash else None,
        token_ids=tuple(req.all_token_ids[start:end]),
        block_size=block_size,
        lora_id=None if lora is None else lora.adapter_id,
        lora_name=None if lora is None else lora.name,
        extra_keys=None,
        group_idx=group_config.group_idx,
        kv_cache_spec=group_config.kv_event_group_spec,
        active_residencies={_PRIMARY},
    )


class OffloadingEventsTracker:
    """Turns the tiers' raw changes (:class:`~kvlab.kv_offload.base.OffloadingEvent`) into the
    KV events the engine publishes, with payloads where it recorded them (see the module).

    ``record_store`` / ``record_lookup`` snapshot a chunk's payload (no-ops unless
    self-describing events are on, and for window or Mamba groups); ``take_events``
    translates a batch; ``reset`` drops the payloads (the tiers were cleared).
    ``group_specs`` (group index -> kind) classify the placeholders."""

    def __init__(
        self,
        config: OffloadingKVEventsConfig,
        group_specs: dict[int, OffloadingEventGroupSpec] | None = None,
        *,
        use_int_block_hashes: bool = True,
    ) -> None:
        self.config = config
        self._group_specs = dict(group_specs or {})
        self.self_describing_enabled = bool(config.enable_kv_cache_events and config.self_describing_kv_events)
        self.use_int_block_hashes = use_int_block_hashes
        self._pending_event_metadata: dict[OffloadKey, _OffloadEventMetadata] = {}
        self._warned: set[str] = set()

    # -- recording ---------------------------------------------------------------------------
    def record_store(self, req: Request, group_config: GroupOffloadConfig, chunk_idx: int, offload_key: OffloadKey) -> None:
        """Snapshot the payload of chunk ``chunk_idx`` of ``req``, about to be stored."""
        if not self.self_describing_enabled or group_config.sliding_window_size_in_chunks is not None:
            return
        self._put(offload_key, self._chunk_metadata(req, group_config, chunk_idx))

    def record_lookup(self, req: Request, group_config: GroupOffloadConfig, chunk_idx: int, offload_key: OffloadKey) -> None:
        """A lookup found the chunk in the CPU tier (ready, or still being written): keep its
        payload (an earlier snapshot wins) and count the CPU tier as holding it -- the tier
        itself cannot tell: it never sees the request."""
        if not self.self_describing_enabled or group_config.sliding_window_size_in_chunks is not None:
            return
        meta = self._pending_event_metadata.get(offload_key)
        if meta is None:
            meta = self._pending_event_metadata[offload_key] = self._chunk_metadata(req, group_config, chunk_idx)
        meta.active_residencies.add(_PRIMARY)

    def record_partial_store(self, req: Request, group_config: GroupOffloadConfig, boundary_tokens: int, offload_key: OffloadKey) -> None:
        """Snapshot a stored partial tail: the chunk's first ``boundary_tokens`` tokens' part."""
        if group_config.sliding_window_size_in_chunks is None and self.self_describing_enabled:
            self._put(offload_key, self._partial_metadata(req, group_config, boundary_tokens))

    def record_partial_lookup(self, req: Request, group_config: GroupOffloadConfig, boundary_tokens: int, offload_key: OffloadKey) -> None:
        """A lookup hit a partial tail: snapshot it unless a payload is already kept."""
        if group_config.sliding_window_size_in_chunks is not None or not self.self_describing_enabled:
            return
        if offload_key not in self._pending_event_metadata:
            self._put(offload_key, self._partial_metadata(req, group_config, boundary_tokens))

    def _put(self, key: OffloadKey, meta: _OffloadEventMetadata) -> None:
        """Keep ``meta`` for ``key``; residencies already counted for it carry over."""
        old = self._pending_event_metadata.get(key)
        if old is not None:
            meta.active_residencies |= old.active_residencies
        self._pending_event_metadata[key] = meta

    def _chunk_metadata(self, req: Request, group_config: GroupOffloadConfig, chunk_idx: int) -> _OffloadEventMetadata:
        """A whole chunk's payload: its blocks' hashes at the group's block size, the parent
        (the hash before the chunk), the chunk's tokens."""
        per_chunk = group_config.hashes_per_chunk
        if per_chunk <= 0 or chunk_idx < 0:
            raise ValueError(f"chunk {chunk_idx} of {per_chunk} hashes per chunk")
        tokens_per_hash = group_config.tokens_per_chunk // per_chunk
        first, last = chunk_idx * per_chunk, (chunk_idx + 1) * per_chunk
        if last > len(req.block_hashes):
            raise ValueError(f"chunk {chunk_idx} of request {req.request_id} is not hashed yet")
        hashes = resolve_block_hashes(req.block_hashes[first:last], tokens_per_hash, group_config.tokens_per_block)
        start = chunk_idx * group_config.tokens_per_chunk
        return _metadata(req, group_config, hashes, first, start, start + group_config.tokens_per_chunk, group_config.tokens_per_block)

    def _partial_metadata(self, req: Request, group_config: GroupOffloadConfig, boundary_tokens: int) -> _OffloadEventMetadata:
        """A partial tail's payload: from its block's start to ``boundary_tokens`` (a hash
        boundary inside the block), at the hash's granularity -- only what is valid."""
        tokens_per_hash = group_config.tokens_per_chunk // group_config.hashes_per_chunk
        if boundary_tokens <= 0 or boundary_tokens % tokens_per_hash:
            raise ValueError(f"a partial tail ends on a hash boundary ({tokens_per_hash} tokens), got {boundary_tokens}")
        # The block holding the last valid token (a boundary on a block edge closes that block).
        start = (boundary_tokens - 1) // group_config.tokens_per_chunk * group_config.tokens_per_chunk
        first, last = start // tokens_per_hash, boundary_tokens // tokens_per_hash
        if last > len(req.block_hashes):
            raise ValueError(f"request {req.request_id} is hashed to {len(req.block_hashes)} hashes, not {last}")
        return _metadata(req, group_config, req.block_hashes[first:last], first, start, boundary_tokens, tokens_per_hash)

    # -- translating --------------------------------------------------------------------------
    def take_events(self, events: Iterable[OffloadingEvent]) -> Iterator[KVCacheEvent]:
        """The KV events for a batch of tier changes, in order. A payload whose last
        residency was removed is dropped only after the whole batch: a removal from the CPU
        tier may come before the same batch's store of that chunk to disk."""
        removed: set[OffloadKey] = set()
        for event in events:
            if event.removed:
                if self.self_describing_enabled:
                    removed.update(event.keys)
                yield from self._removed(event)
            else:
                yield from self._stored(event)
        for key in removed:
            meta = self._pending_event_metadata.get(key)
            if meta is not None and not meta.active_residencies:
                del self._pending_event_metadata[key]

    def reset(self) -> None:
        """Forget every payload (the tiers were cleared); the groups' kinds stay."""
        self._pending_event_metadata.clear()

    def _ext(self, h: BlockHash) -> bytes | int:
        return maybe_convert_block_hash(h, self.use_int_block_hashes)

    def _warn_once(self, what: str) -> None:
        if self.self_describing_enabled and what not in self._warned:
            self._warned.add(what)
            logger.warning(
                "OffloadingEventsTracker: no payload for an offload key during %s; publishing a placeholder (expected for "
                "window and Mamba groups, and for chunks no request stored or looked up since the payloads were reset)",
                what,
            )

    def _stored(self, event: OffloadingEvent) -> Iterator[KVCacheEvent]:
        medium = _event_medium(event)
        locality = event.locality.value if event.locality is not None else None
        for key in event.keys:
            meta = self._pending_event_metadata.get(key)
            if meta is None:
                self._warn_once("BlockStored")
                group = get_offload_group_idx(key)
                kind = self._group_specs.get(group) if self.self_describing_enabled else None
                kind = kind or OffloadingEventGroupSpec(None, None)
                yield BlockStored(
                    block_hashes=[self._ext(get_offload_block_hash(key))],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=group,
                    kv_cache_spec_kind=kind.kv_cache_spec_kind,
                    kv_cache_spec_sliding_window=kind.kv_cache_spec_sliding_window,
                    locality=locality,
                    ownership=event.ownership,
                )
                continue
            if event.removal_expected:  # this tier will announce the removal: wait for it
                meta.active_residencies.add((event.medium, event.ownership))
            yield BlockStored(
                block_hashes=[self._ext(h) for h in meta.block_hashes],
                parent_block_hash=None if meta.parent_block_hash is None else self._ext(meta.parent_block_hash),
                token_ids=list(meta.token_ids),
                block_size=meta.block_size,
                lora_id=meta.lora_id,
                medium=medium,
                lora_name=meta.lora_name,
                extra_keys=to_event_extra_keys(meta.extra_keys) if meta.extra_keys is not None else None,
                group_idx=meta.group_idx,
                kv_cache_spec_kind=meta.kv_cache_spec.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=meta.kv_cache_spec.kv_cache_spec_sliding_window,
                locality=locality,
                ownership=event.ownership,
            )

    def _removed(self, event: OffloadingEvent) -> Iterator[KVCacheEvent]:
        """One ``BlockRemoved`` per group (an event names one group); none for a failed
        store's reservation (``metadata_only``), which only ends that residency."""
        medium = _event_medium(event)
        locality = event.locality.value if event.locality is not None else None
        residency = (event.medium, event.ownership)
        by_group: dict[int, list[bytes | int]] = {}
        for key in event.keys:
            meta = self._pending_event_metadata.get(key)
            if meta is not None:
                meta.active_residencies.discard(residency)
            if event.metadata_only:
                continue
            if meta is not None:
                by_group.setdefault(meta.group_idx, []).extend(self._ext(h) for h in meta.block_hashes)
            else:
                self._warn_once("BlockRemoved")
                by_group.setdefault(get_offload_group_idx(key), []).append(self._ext(get_offload_block_hash(key)))
        for group, hashes in by_group.items():
            yield BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, locality=locality, ownership=event.ownership)
