"""The encoder cache: where an image's encoder output waits until the decoder has read it
(vLLM: ``vllm/v1/core/encoder_cache_manager.py``; lesson 14).

A multimodal prompt holds placeholder tokens for each image (``MultiModalFeature``: an
``identifier`` -- the item's content hash -- an ``offset`` and a ``length``). Before the
decoder can compute those positions, the vision encoder must turn the image into
``length`` embeddings. They are computed **once per item** and kept in the encoder cache
until every request that needs them has computed past the item; then they stay around,
unreferenced, until the space is needed -- so a second request with the same image (same
hash) reuses them without running the encoder again.

The manager does the bookkeeping only (the embeddings themselves live in the worker): the
capacity is counted in embeddings, ``cached`` maps an item hash to the requests that
reference it, and ``freeable`` holds unreferenced entries oldest first -- evicted only when
``can_allocate`` needs room. Evicted hashes are reported once through
``get_freed_mm_hashes()`` so the worker can drop the tensors. The scheduler also limits
how many embeddings the encoder computes per step (the *encoder compute budget*); both
limits default to ``max_num_batched_tokens``, as in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict

from kvlab.request import Request
from kvlab.eventlog.events import EncoderCacheCreated, EncoderCacheEvicted, EncoderInputFreed, EncoderInputScheduled, EventLog
from kvlab.utils.checks import check_int, check_optional_int


def _check_item(request: object, input_id: object) -> int:
    """``input_id`` as a plain int naming one of ``request``'s multimodal items, or raise
    (checked before the cache changes)."""
    if not isinstance(request, Request):
        raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r:.60}")
    n = len(request.mm_features or ())
    if n == 0:
        raise ValueError(f"request {request.request_id!r} has no multimodal items (mm_features is empty)")
    return check_int("input_id", input_id, 0, n - 1, why=f" (request {request.request_id!r} has {n} items)")


def _embeds_if_in_budget(request: object, input_id: object, encoder_compute_budget: object, num_embeds_to_schedule: object) -> int | None:
    """``can_allocate``'s arguments checked; then the embeddings item ``input_id`` would
    bring to this step's total (``num_embeds_to_schedule`` promised already), or None when
    the item alone exceeds the compute budget."""
    input_id = _check_item(request, input_id)
    encoder_compute_budget = check_int("encoder_compute_budget", encoder_compute_budget, 0)
    num_embeds_to_schedule = check_int("num_embeds_to_schedule", num_embeds_to_schedule, 0)
    num_embeds = request.get_num_encoder_embeds(input_id)  # type: ignore[attr-defined]  # a Request: _check_item said so
    if num_embeds > encoder_compute_budget:
        return None
    return num_embeds + num_embeds_to_schedule


class EncoderCacheManager:
    """Space for encoder outputs, shared across requests by item hash (vLLM's names)."""

    def __init__(self, cache_size: int, event_log: EventLog | None = None) -> None:
        self.cache_size = check_int("cache_size", cache_size, 0)
        self.num_free_slots = self.cache_size
        self.num_freeable_slots = self.cache_size
        self.cached: dict[str, set[str]] = {}  # mm_hash -> ids of the requests referencing it
        self.num_embeds_by_hash: dict[str, int] = {}
        self.request_cached_ids: dict[str, set[int]] = {}  # request id -> its cached input indices
        self.request_hash_refs: dict[str, dict[str, int]] = {}  # request id -> mm_hash -> #inputs
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced entries, oldest first
        self.freed: list[str] = []
        self.events = event_log
        if event_log is not None:
            event_log.emit(EncoderCacheCreated(cache_size=self.cache_size))

    def reset(self) -> None:
        """Forget everything (vLLM calls this after a weight update)."""
        self.cached.clear()
        self.num_embeds_by_hash.clear()
        self.request_cached_ids.clear()
        self.request_hash_refs.clear()
        self.freeable.clear()
        self.freed.clear()
        self.num_free_slots = self.num_freeable_slots = self.cache_size

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Is item ``input_id`` of ``request`` cached? If so, the request now references it
        (an unreferenced entry leaves ``freeable``) and the encoder need not run."""
        input_id = _check_item(request, input_id)
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        self.cached[mm_hash].add(request.request_id)
        new = self._add_cached_input_id(request.request_id, input_id, mm_hash)
        if self.events is not None and new:  # vLLM checks again every step the item is in the window
            self.events.emit(
                EncoderInputScheduled(
                    request_id=request.request_id,
                    input_id=input_id,
                    mm_hash=mm_hash,
                    num_embeds=self.num_embeds_by_hash[mm_hash],
                    computed=False,
                )
            )
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int) -> bool:
        """Is there compute budget and room for item ``input_id`` (beyond the
        ``num_embeds_to_schedule`` already promised this step)? Room may come from evicting
        unreferenced entries, oldest first -- that eviction happens here, as in vLLM."""
        num_embeds = _embeds_if_in_budget(request, input_id, encoder_compute_budget, num_embeds_to_schedule)
        if num_embeds is None:
            return False
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        evicted = []
        while num_embeds > self.num_free_slots:
            mm_hash, n = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.num_embeds_by_hash[mm_hash]
            self.freed.append(mm_hash)
            evicted.append(mm_hash)
            self.num_free_slots += n
        if self.events is not None:
            self.events.emit(EncoderCacheEvicted(mm_hashes=evicted))
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve room for item ``input_id``'s embeddings (``can_allocate`` said yes); the
        worker computes them this step."""
        input_id = _check_item(request, input_id)
        feature = request.mm_features[input_id]
        mm_hash, n = feature.identifier, feature.get_num_embeds()
        # Checked first, changed after: a refused allocate leaves the cache as it was.
        cached_n = self.num_embeds_by_hash.get(mm_hash, n)
        if cached_n != n:
            raise ValueError(f"item {mm_hash!r} has {n} embeddings in request {request.request_id!r} but {cached_n} in the cache")
        if self.num_free_slots < n or self.num_freeable_slots < n:
            raise ValueError(
                f"allocate: item {input_id} of request {request.request_id!r} needs {n} embeddings but only "
                f"{self.num_free_slots} slots are free; ask can_allocate() first (it evicts to make room)"
            )
        if mm_hash not in self.cached:
            self.cached[mm_hash] = set()
        self.num_embeds_by_hash.setdefault(mm_hash, n)
        self.cached[mm_hash].add(request.request_id)
        self._add_cached_input_id(request.request_id, input_id, mm_hash)
        self.num_free_slots -= n
        self.num_freeable_slots -= n
        if self.events is not None:
            self.events.emit(
                EncoderInputScheduled(request_id=request.request_id, input_id=input_id, mm_hash=mm_hash, num_embeds=n, computed=True)
            )

    def _add_cached_input_id(self, request_id: str, input_id: int, mm_hash: str) -> bool:
        ids = self.request_cached_ids.setdefault(request_id, set())
        if input_id in ids:
            return False
        ids.add(input_id)
        refs = self.request_hash_refs.setdefault(request_id, {})
        refs[mm_hash] = refs.get(mm_hash, 0) + 1
        return True

    def get_cached_input_ids(self, request: Request) -> set[int]:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r:.60}")
        return self.request_cached_ids.get(request.request_id, set())

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """The request no longer needs item ``input_id`` (its computed tokens passed it).
        The last reference makes the entry freeable; its data stays until space is needed."""
        input_id = _check_item(request, input_id)
        rid = request.request_id
        mm_hash = request.mm_features[input_id].identifier
        ids = self.request_cached_ids.get(rid)
        if ids is not None and input_id in ids:
            ids.remove(input_id)
            refs = self.request_hash_refs[rid]
            refs[mm_hash] -= 1
            if not refs[mm_hash]:
                del refs[mm_hash]
            if not ids:
                del self.request_cached_ids[rid]
                del self.request_hash_refs[rid]
        if not self.cached.get(mm_hash):
            return
        if mm_hash in self.request_hash_refs.get(rid, ()):
            return  # the same image appears again later in this request
        self.cached[mm_hash].discard(rid)
        if not self.cached[mm_hash]:
            n = self.num_embeds_by_hash[mm_hash]
            self.freeable[mm_hash] = n
            self.num_freeable_slots += n
        if self.events is not None:
            self.events.emit(EncoderInputFreed(request_id=rid, mm_hash=mm_hash, unreferenced=not self.cached[mm_hash]))

    def free(self, request: Request) -> None:
        """Drop every reference ``request`` holds (it finished or was preempted)."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r:.60}")
        for input_id in sorted(self.get_cached_input_ids(request)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """Hashes evicted since the last call (the worker drops their tensors); an entry
        evicted and allocated again in the same step is kept."""
        freed = [h for h in self.freed if h not in self.cached]
        self.freed = []
        return freed

    def check_invariants(self) -> None:
        used = sum(self.num_embeds_by_hash.values())
        assert self.num_free_slots == self.cache_size - used, f"free slots {self.num_free_slots} != {self.cache_size} - {used}"
        freeable = sum(n for h, n in self.freeable.items())
        assert self.num_freeable_slots == self.num_free_slots + freeable, "freeable slots out of step"
        for h, refs in self.cached.items():
            assert (not refs) == (h in self.freeable), f"{h}: referenced by {refs} but freeable={h in self.freeable}"


class EncoderDecoderCacheManager(EncoderCacheManager):
    """The encoder cache of an encoder-decoder model (Whisper, BART; vLLM 0.33's names).

    There the encoder's output becomes the cross-attention layers' keys and values, which
    live in KV-cache blocks (``CrossAttentionSpec``), not here. So nothing is shared or
    kept: every request runs its own encoder input (``check_and_update_cache`` is always
    False), the slots only limit how many encoder embeddings are in flight, and each entry
    is handed to the worker to drop one step after it was allocated -- after the step that
    used it, as an ordinary entry would be.

    One difference from vLLM 0.33, kept on purpose: vLLM's ``free_encoder_input`` gives an
    input's slots back whether or not they were taken, and its scheduler frees every input of
    an encoder-decoder request after each of its steps -- so there the free-slot count climbs
    past ``cache_size`` with every decode step and the limit stops limiting. kvlab gives
    back only the slots a request holds (``held``), so the count stays within the cache."""

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        self.allocated: list[str] = []
        self.to_free: list[str] = []
        self.held: dict[str, dict[int, int]] = {}  # request id -> {input: slots it holds}

    def reset(self) -> None:
        self.num_free_slots = self.cache_size
        self.allocated.clear()
        self.to_free.clear()
        self.held.clear()

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        _check_item(request, input_id)
        return False

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int) -> bool:
        num_embeds = _embeds_if_in_budget(request, input_id, encoder_compute_budget, num_embeds_to_schedule)
        return num_embeds is not None and num_embeds <= self.num_free_slots

    def allocate(self, request: Request, input_id: int) -> None:
        input_id = _check_item(request, input_id)
        feature = request.mm_features[input_id]
        n = feature.get_num_embeds()
        if n > self.num_free_slots:
            raise ValueError(
                f"allocate: item {input_id} of request {request.request_id!r} needs {n} embeddings but only "
                f"{self.num_free_slots} slots are free; ask can_allocate() first"
            )
        self.num_free_slots -= n
        self.allocated.append(feature.identifier)
        self.held.setdefault(request.request_id, {})[input_id] = n

    def free(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r:.60}")
        for input_id in range(len(request.mm_features or ())):
            self.free_encoder_input(request, input_id)

    def get_cached_input_ids(self, request: Request) -> set[int]:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__} {request!r:.60}")
        return set(range(len(request.mm_features or ())))

    def get_freed_mm_hashes(self) -> list[str]:
        """The entries allocated in the step before the last call: the worker drops them
        *before* it runs the next step, so each lives through the step that used it."""
        to_free, self.to_free, self.allocated = self.to_free, self.allocated, []
        return to_free

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        input_id = _check_item(request, input_id)
        held = self.held.get(request.request_id)
        if held is None or input_id not in held:
            return  # never taken, or given back already
        self.num_free_slots += held.pop(input_id)
        if not held:
            del self.held[request.request_id]

    def check_invariants(self) -> None:
        used = sum(n for inputs in self.held.values() for n in inputs.values())
        assert self.num_free_slots == self.cache_size - used, f"free slots {self.num_free_slots} != {self.cache_size} - {used}"
        assert all(self.held.values()), "a request holding nothing is kept"


def compute_encoder_budget(
    max_num_batched_tokens: int, max_num_encoder_input_tokens: int | None, encoder_cache_size: int | None, max_tokens_per_item: int = 0
) -> tuple[int, int]:
    """(compute budget per step, cache size), both in embeddings: vLLM defaults both to
    ``max_num_batched_tokens`` and raises them to the largest item, so any single item fits."""
    max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    max_num_encoder_input_tokens = check_optional_int("max_num_encoder_input_tokens", max_num_encoder_input_tokens, 0)
    encoder_cache_size = check_optional_int("encoder_cache_size", encoder_cache_size, 0)
    max_tokens_per_item = check_int("max_tokens_per_item", max_tokens_per_item, 0)
    budget = max_num_batched_tokens if max_num_encoder_input_tokens is None else max_num_encoder_input_tokens
    size = max_num_batched_tokens if encoder_cache_size is None else encoder_cache_size
    return max(budget, max_tokens_per_item), max(size, max_tokens_per_item)
