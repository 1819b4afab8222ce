"""A request: its tokens, its identity for the prefix cache, and its lifecycle.

vLLM: ``vllm/v1/request.py``. The fields that matter to the KV cache are the token ids,
``num_computed_tokens`` (how many tokens already have K/V in the cache -- the scheduler
moves it), and ``block_hashes`` (one per full block, grown as tokens are appended).
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from types import SimpleNamespace
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.utils.checks import check_int, check_number, check_optional_int
from kvlab.utils.hashing import MAX_TOKEN_ID, MIN_TOKEN_ID, TOKEN_ID_WHY, BlockHash

_PACK_ONE_TOKEN = struct.Struct("<i").pack


def _pack_tokens(token_ids: list[int]) -> bytes:
    """Token ids as little-endian int32: the layout kvlab's block hashes digest."""
    return _PACK_ONE_TOKEN(token_ids[0]) if len(token_ids) == 1 else struct.pack(f"<{len(token_ids)}i", *token_ids)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Blocks allocated, KV arriving from a connector's asynchronous load (vLLM 0.33: a P/D
    # decode instance receiving a prefill); scheduled once the worker reports it received.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    # A resumable request (a streaming-input session, vLLM 0.33) whose turn ended: it keeps
    # its blocks and its computed tokens, and waits for the next chunk of input.
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()  # emitted eos_token_id
    FINISHED_LENGTH_CAPPED = enum.auto()  # reached max_tokens
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(frozen=True, slots=True)
class StreamingUpdate:
    """The next chunk of a streaming-input session (vLLM 0.33): what a resumable request
    with the session's id brings -- its prompt tokens and images are appended to the
    session, its ``max_tokens`` and ``eos_token_id`` replace the session's (vLLM replaces the
    whole ``sampling_params``; these are the two kvlab's scheduler reads)."""

    prompt_token_ids: tuple[int, ...]
    mm_features: tuple[MultiModalFeature, ...]
    max_tokens: int
    eos_token_id: int | None
    arrival_time: float

    @classmethod
    def from_request(cls, request: Request) -> StreamingUpdate | None:
        """The update a request stands for; None for one that is not resumable (it closes
        the session)."""
        if not request.resumable:
            return None
        return cls(
            tuple(request.prompt_token_ids), tuple(request.mm_features), request.max_tokens, request.eos_token_id, request.arrival_time
        )


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item (e.g. an image) occupying ``length`` placeholder tokens.

    The placeholder token ids are the same for every image, so the prompt's token ids
    cannot tell two images apart; ``identifier`` (vLLM: the content hash of the item) goes
    into the hash of every block the item overlaps.
    """

    identifier: str
    offset: int
    length: int
    modality: str = "image"
    #: Which of the ``length`` placeholder positions receive an embedding (vLLM's
    #: ``PlaceholderRange.is_embed``); None: all of them. Some processors put separator or
    #: "image break" tokens inside an item's placeholder: the encoder makes no output for
    #: them, so they take no encoder-cache room and no encoder budget.
    is_embed: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise TypeError(f"MultiModalFeature.identifier must be a non-empty str, got {self.identifier!r}")
        object.__setattr__(self, "offset", check_int("MultiModalFeature.offset", self.offset, 0))
        object.__setattr__(self, "length", check_int("MultiModalFeature.length", self.length, 1))
        if self.is_embed is not None:
            mask = self.is_embed
            if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence) or any(type(b) is not bool for b in mask):
                raise TypeError(f"MultiModalFeature.is_embed must be None or a sequence of bools, got {mask!r:.80}")
            if len(mask) != self.length:
                raise ValueError(
                    f"MultiModalFeature.is_embed has {len(mask)} entries; it needs one per placeholder position ({self.length})"
                )
            object.__setattr__(self, "is_embed", tuple(mask))

    def get_num_embeds(self) -> int:
        """The embeddings the encoder makes for this item: what it costs in the encoder cache
        and in the step's encoder budget (vLLM: ``PlaceholderRange.get_num_embeds``)."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def get_embeds_indices_in_range(self, start_idx: int, end_idx: int) -> tuple[int, int]:
        """Which of the item's embeddings fall on placeholder positions ``[start_idx, end_idx)``
        (relative to ``offset``), as [first, last) indices into its encoder output."""
        if self.is_embed is None:
            return start_idx, end_idx
        return sum(self.is_embed[:start_idx]), sum(self.is_embed[:end_idx])


_last_arrival = 0.0


def _next_arrival() -> float:
    global _last_arrival
    _last_arrival = max(time.monotonic(), _last_arrival + 1e-6)
    return _last_arrival


def _check_token_ids(name: str, token_ids: Sequence[int]) -> list[int]:
    if type(token_ids) is list:  # the common case, without the abstract-class test
        out = token_ids.copy()
    elif isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    else:
        out = list(token_ids)
    for i, t in enumerate(out):
        if type(t) is not int or not MIN_TOKEN_ID <= t <= MAX_TOKEN_ID:  # the common case costs two tests
            out[i] = check_int(f"{name}[{i}]", t, MIN_TOKEN_ID, MAX_TOKEN_ID, why=TOKEN_ID_WHY)
    return out


#: What a request's KV events report (vLLM 0.33's ``kv_cache_report_mode``).
KV_CACHE_REPORT_MODES = ("incremental", "full")


def _check_lora(lora_name: Any, lora_path: Any, lora_int_id: Any) -> int | None:
    """The adapter fields, checked together (a path or an id needs a name); returns the id."""
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise TypeError(f"lora_name must be None or a non-empty str, got {lora_name!r}")
    if lora_path is not None and (not isinstance(lora_path, str) or lora_name is None):
        raise TypeError(f"lora_path must be None or a str, and needs a lora_name; got lora_path={lora_path!r}, lora_name={lora_name!r}")
    # vLLM's LoRARequest.lora_int_id: ids start at 1 (vLLM raises "id must be > 0").
    lora_int_id = check_optional_int("lora_int_id", lora_int_id, 1)
    if lora_int_id is not None and lora_name is None:
        raise ValueError(f"lora_int_id = {lora_int_id} needs a lora_name: the id numbers an adapter, and the name is what the hash uses")
    return lora_int_id


def _check_request_args(
    request_id: Any,
    prompt_token_ids: Any,
    max_tokens: Any,
    eos_token_id: Any,
    cache_salt: Any,
    lora_name: Any,
    lora_path: Any,
    lora_int_id: Any,
    kv_cache_report_mode: Any,
    prompt_logprobs: Any,
    skip_reading_prefix_cache: Any,
    prompt_embeds: Any,
    priority: Any,
    arrival_time: Any,
    mm_features: Any,
) -> tuple[list[int], int, int | None, int | None, int | None, bool, int, float | None, list[MultiModalFeature]]:
    """``Request``'s arguments, checked (raising, named, before the object exists) and
    normalised: the prompt as a list of ints, the counts as ints, the features by offset."""
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
    # An empty prompt is a valid Request (vLLM's KV-cache manager allocates for one, e.g.
    # a draft's lookahead slots); the scheduler refuses it at add_request.
    if prompt_token_ids is None and prompt_embeds is not None and hasattr(prompt_embeds, "__len__"):
        # vLLM 0.33: an embeddings-only prompt has no token ids; its positions hold the
        # placeholder id 0 (vLLM keeps prompt_token_ids None and fills all_token_ids with
        # zeros -- kvlab keeps the zeros in prompt_token_ids too, which every reader uses).
        prompt = [0] * len(prompt_embeds)
    else:
        prompt = _check_token_ids("prompt_token_ids", prompt_token_ids)
    max_tokens = check_int("max_tokens", max_tokens, 1)
    eos_token_id = check_optional_int("eos_token_id", eos_token_id, 0, MAX_TOKEN_ID)
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise TypeError(f"cache_salt must be None or a non-empty str, got {cache_salt!r}")
    lora_int_id = _check_lora(lora_name, lora_path, lora_int_id)
    if kv_cache_report_mode not in KV_CACHE_REPORT_MODES or type(kv_cache_report_mode) is not str:
        raise ValueError(f"kv_cache_report_mode must be one of {KV_CACHE_REPORT_MODES}, got {kv_cache_report_mode!r}")
    prompt_logprobs = check_optional_int("prompt_logprobs", prompt_logprobs, -1, why=" (-1: the whole vocabulary)")
    if skip_reading_prefix_cache is None:  # vLLM 0.33's SamplingParams default
        skip_reading_prefix_cache = prompt_logprobs is not None
    elif type(skip_reading_prefix_cache) is not bool:
        raise TypeError(f"skip_reading_prefix_cache must be None, True or False, got {skip_reading_prefix_cache!r}")
    if prompt_embeds is not None:
        try:
            n_rows = len(prompt_embeds)
            prompt_embeds[0:0]
        except TypeError:
            raise TypeError(
                f"prompt_embeds must be a sliceable sequence of per-token rows (list, numpy array, tensor), "
                f"got {type(prompt_embeds).__name__}"
            ) from None
        if n_rows != len(prompt):
            raise ValueError(
                f"prompt_embeds has {n_rows} rows but prompt_token_ids has {len(prompt)} tokens; give one row per "
                "prompt position (vLLM uses placeholder ids, e.g. zeros, for embedding prompts)"
            )
    priority = check_int("priority", priority)  # lower runs first
    if arrival_time is not None:
        arrival_time = check_number("arrival_time", arrival_time)
    if mm_features is not None and (isinstance(mm_features, (str, bytes)) or not isinstance(mm_features, Sequence)):
        raise TypeError(
            f"mm_features must be None or a list of MultiModalFeature, got {type(mm_features).__name__}"
            + (" (wrap a single feature in a list: mm_features=[feature])" if isinstance(mm_features, MultiModalFeature) else "")
        )
    given = list(mm_features or ())
    for i, f in enumerate(given):  # type-check before sorting reads .offset
        if not isinstance(f, MultiModalFeature):
            raise TypeError(f"mm_features[{i}] must be a MultiModalFeature, got {type(f).__name__}")
    features = sorted(given, key=lambda f: f.offset)
    for i, f in enumerate(features):
        # An encoder-decoder model's encoder input (Whisper's audio) sits at 0 and can be
        # longer than the decoder's prompt; the scheduler checks which kind its model is.
        if f.offset + f.length > len(prompt) and f.offset:
            raise ValueError(
                f"mm_features: {f.identifier!r} covers tokens [{f.offset}, {f.offset + f.length}) "
                f"but the prompt has only {len(prompt)} tokens (only an encoder-decoder model's encoder input, at "
                "offset 0, may be longer than the prompt)"
            )
        if i and features[i - 1].offset + features[i - 1].length > f.offset:
            raise ValueError(
                f"mm_features: {features[i - 1].identifier!r} and {f.identifier!r} overlap; "
                "each placeholder token belongs to at most one item"
            )
    return prompt, max_tokens, eos_token_id, lora_int_id, prompt_logprobs, skip_reading_prefix_cache, priority, arrival_time, features


def _vllm_feature(i: int, f: Any) -> Any:
    """vLLM's ``MultiModalFeatureSpec`` (identifier, modality, ``mm_position``: a
    ``PlaceholderRange`` with offset, length and an optional ``is_embed`` mask) as kvlab's
    ``MultiModalFeature``; anything else is passed on for the usual check."""
    pos = getattr(f, "mm_position", None)
    if isinstance(f, MultiModalFeature) or pos is None:
        return f
    mask = getattr(pos, "is_embed", None)
    try:
        return MultiModalFeature(
            identifier=f.identifier,
            offset=pos.offset,
            length=pos.length,
            modality=getattr(f, "modality", "image"),
            is_embed=None if mask is None else tuple(bool(b) for b in mask),
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"mm_features[{i}]: {e}") from None


# kvlab's arguments that vLLM's params objects also set, with their defaults.
_VLLM_PARAMS_DEFAULTS: dict[str, Any] = {
    "max_tokens": 16,
    "eos_token_id": None,
    "lora_name": None,
    "lora_int_id": None,
    "lora_path": None,
    "prompt_logprobs": None,
    "kv_cache_report_mode": "incremental",
    "skip_reading_prefix_cache": None,
}


def _from_vllm_params(sampling_params: Any, pooling_params: Any, lora_request: Any, **kvlab_args: Any) -> tuple[Any, ...]:
    """The kvlab arguments that vLLM's own ``Request(..., sampling_params=...,
    pooling_params=..., lora_request=...)`` call shape stands for (vLLM 0.33's rules):

    - ``SamplingParams``: ``max_tokens``, ``prompt_logprobs``, ``skip_reading_prefix_cache``,
      the eos id set by ``update_from_generation_config`` (unless ``ignore_eos``), and
      ``extra_args["kv_cache_report_mode"]``;
    - ``PoolingParams``: one output token, nothing else generated;
    - ``LoRARequest``: ``lora_name``, ``lora_int_id`` (its ``adapter_id``), ``lora_path``.

    ``kvlab_args``: the same arguments as the call gave them (the keys of
    _VLLM_PARAMS_DEFAULTS); one set away from its default that a vLLM object also sets is
    refused, so no value is silently dropped. Returns them in that order, updated."""
    out: dict[str, Any] = {}
    if sampling_params is not None and pooling_params is not None:
        raise ValueError("give sampling_params or pooling_params, not both")
    if sampling_params is not None:
        if not hasattr(sampling_params, "max_tokens"):
            raise TypeError(f"sampling_params must be a vLLM SamplingParams, got {type(sampling_params).__name__}")
        out["max_tokens"] = sampling_params.max_tokens
        out["prompt_logprobs"] = getattr(sampling_params, "prompt_logprobs", None)
        out["skip_reading_prefix_cache"] = getattr(sampling_params, "skip_reading_prefix_cache", None)
        if not getattr(sampling_params, "ignore_eos", False):
            out["eos_token_id"] = getattr(sampling_params, "eos_token_id", None)
        extra = getattr(sampling_params, "extra_args", None) or {}
        out["kv_cache_report_mode"] = extra.get("kv_cache_report_mode", "incremental")
    elif pooling_params is not None:
        out["max_tokens"] = 1
        out["skip_reading_prefix_cache"] = getattr(pooling_params, "skip_reading_prefix_cache", None)
    if lora_request is not None:
        if not hasattr(lora_request, "lora_name"):
            raise TypeError(f"lora_request must be a vLLM LoRARequest, got {type(lora_request).__name__}")
        out["lora_name"] = lora_request.lora_name
        out["lora_int_id"] = getattr(lora_request, "lora_int_id", None)
        out["lora_path"] = getattr(lora_request, "lora_path", None) or None
    clash = sorted(k for k in out if kvlab_args[k] != _VLLM_PARAMS_DEFAULTS[k])
    if clash:
        raise ValueError(f"{', '.join(clash)}: given both directly and through vLLM's params objects; give each once")
    return tuple(out.get(k, kvlab_args[k]) for k in _VLLM_PARAMS_DEFAULTS)


class Request:
    """One generation request. Everything is validated before the object exists.

    It also takes vLLM 0.33's call shape: ``sampling_params`` / ``pooling_params`` /
    ``lora_request`` objects, vLLM's ``MultiModalFeatureSpec`` items and ``session_id``."""

    # Declared fields (kvlab's addition; vLLM's Request keeps a plain ``__dict__``): a
    # transaction saves a request's state every step, and reading an instance's
    # ``__dict__`` would turn CPython's compact attribute storage into a real dict, making
    # every later attribute read of that request slower. Other attributes (a learner's, a
    # connector's) still go into ``__dict__``.
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "max_tokens",
        "eos_token_id",
        "cache_salt",
        "lora_name",
        "lora_path",
        "lora_int_id",
        "kv_cache_report_mode",
        "prompt_logprobs",
        "skip_reading_prefix_cache",
        "prompt_embeds",
        "_prompt_embeds_per_block_hashes",
        "priority",
        "arrival_time",
        "mm_features",
        "status",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_preemptions",
        "num_cached_tokens",
        "finish_reason",
        "kv_transfer_params",
        "shared_prefix_boundary",
        "replay_start",
        "resumable",
        "streaming_queue",
        "_all_token_ids",
        "_token_bytes",
        "_output_token_ids",
        "block_hashes",
        "_block_hasher",
        "_owner",
        "__dict__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | None,
        *,
        max_tokens: int = 16,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        mm_features: Sequence[MultiModalFeature] | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        lora_path: str | None = None,
        prompt_embeds: Any = None,
        lora_int_id: int | None = None,
        kv_cache_report_mode: str = "incremental",
        prompt_logprobs: int | None = None,
        skip_reading_prefix_cache: bool | None = None,
        sampling_params: Any = None,
        pooling_params: Any = None,
        lora_request: Any = None,
        session_id: str | None = None,
        resumable: bool = False,
    ) -> None:
        if not isinstance(resumable, bool):
            raise TypeError(f"resumable must be True or False, got {resumable!r}")
        if resumable and prompt_embeds is not None:
            raise ValueError("a resumable request (a streaming-input session) cannot carry prompt_embeds; vLLM 0.33 refuses them too")
        if sampling_params is not None or pooling_params is not None or lora_request is not None:
            (
                max_tokens,
                eos_token_id,
                lora_name,
                lora_int_id,
                lora_path,
                prompt_logprobs,
                kv_cache_report_mode,
                skip_reading_prefix_cache,
            ) = _from_vllm_params(
                sampling_params,
                pooling_params,
                lora_request,
                max_tokens=max_tokens,
                eos_token_id=eos_token_id,
                lora_name=lora_name,
                lora_int_id=lora_int_id,
                lora_path=lora_path,
                prompt_logprobs=prompt_logprobs,
                kv_cache_report_mode=kv_cache_report_mode,
                skip_reading_prefix_cache=skip_reading_prefix_cache,
            )
        if mm_features is not None and not isinstance(mm_features, (str, bytes)) and isinstance(mm_features, Sequence):
            mm_features = [_vllm_feature(i, f) for i, f in enumerate(mm_features)]
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise TypeError(f"session_id must be None or a non-empty str, got {session_id!r}")
        (
            prompt,
            max_tokens,
            eos_token_id,
            lora_int_id,
            prompt_logprobs,
            skip_reading_prefix_cache,
            priority,
            arrival_time,
            features,
        ) = _check_request_args(
            request_id,
            prompt_token_ids,
            max_tokens,
            eos_token_id,
            cache_salt,
            lora_name,
            lora_path,
            lora_int_id,
            kv_cache_report_mode,
            prompt_logprobs,
            skip_reading_prefix_cache,
            prompt_embeds,
            priority,
            arrival_time,
            mm_features,
        )

        self.request_id = request_id
        if session_id is not None:
            # vLLM 0.33 publishes it in each BlockStored: which conversation a block belongs to
            self.session_id = session_id
        # A streaming-input session (vLLM 0.33): when a turn ends (max_tokens, eos) the request
        # keeps its blocks and waits for the next chunk -- a resumable request with the same
        # id -- instead of finishing. Chunks that arrive while it runs wait in
        # ``streaming_queue`` (None there: a chunk that closes the session), which the
        # scheduler creates when it queues the session.
        self.resumable = resumable
        self.streaming_queue: deque[StreamingUpdate | None] | None = None
        self.prompt_token_ids = prompt
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.lora_path = lora_path
        # The adapter's number (vLLM's ``LoRARequest.lora_int_id``, published as ``lora_id``
        # in KV events). The name and path make the hash; the id only numbers the adapter.
        # None until an engine gives it one (LLMEngine.add_request), unless given here.
        self.lora_int_id = lora_int_id
        # "full": each prefix hit this request gets is published as a BlockStored too (vLLM
        # 0.33 reads it from SamplingParams.extra_args); "incremental": only new blocks are.
        self.kv_cache_report_mode = kv_cache_report_mode
        # A request that wants its prompt's logprobs must compute every prompt token, so it
        # reads nothing from the prefix cache (its blocks are still cached for others) -- vLLM
        # 0.33's default for skip_reading_prefix_cache. kvlab computes no logprobs: the
        # field has only this effect.
        self.prompt_logprobs = prompt_logprobs
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.prompt_embeds = prompt_embeds
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.priority = priority
        # Default arrival: the creation time, made strictly increasing so ties cannot happen.
        self.arrival_time = _next_arrival() if arrival_time is None else float(arrival_time)
        self.mm_features: list[MultiModalFeature] = features

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens scheduled whose step has not come back yet (vLLM's asynchronous scheduling
        # counts them in num_computed_tokens ahead of time). kvlab's steps run one after the
        # other, so it stays 0; vLLM 0.33's managers read it (a Mamba state is handed to a
        # connector only when nothing past it is in flight).
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling (vLLM's field)
        # Why it finished, in vLLM's words: "stop" (eos), "length" (max_tokens or
        # max_model_len) or "abort"; None while it runs. (vLLM's ``stop_reason`` is something
        # else: the stop string or token that matched.)
        self.finish_reason: str | None = None
        # What a KV connector handed back when the request finished (vLLM's
        # ``kv_transfer_params``: e.g. where a prefill engine saved the prompt's KV).
        self.kv_transfer_params: dict[str, Any] | None = None
        # Where the last prefix lookup found a longer shared prefix than the hit: one group had
        # it cached, another not (sparse retention). Caching keeps what a hit there needs, so
        # the next request with this prefix gets it (vLLM 0.33's Marconi-style junction; 0: none).
        self.shared_prefix_boundary = 0
        # DeepSeek-V4.1's bounded replay (vLLM 0.33): the first position the scheduler made
        # this request recompute at admission although its KV was a prefix hit -- the hit's
        # last window, whose sliding-window KV is not cached. The worker rebuilds only that
        # window from these tokens; below it, the window layers see nothing. 0: no replay.
        self.replay_start = 0
        self._all_token_ids: list[int] = list(prompt)
        self._token_bytes = bytearray(_pack_tokens(prompt))  # the same tokens, packed once
        self._output_token_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self._block_hasher: Callable[[Request], list[BlockHash]] | None = None
        # The scheduler this request is queued in (one at a time; cleared when it finishes).
        self._owner: object | None = None
        if block_hasher is not None:
            self.bind_block_hasher(block_hasher)

    # -- tokens ---------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def lora_request(self) -> Any:
        """vLLM's ``request.lora_request``: the adapter this request runs with, as a read-only
        record (``lora_name``, ``lora_int_id`` -- vLLM's ``adapter_id`` --, ``lora_path``), or
        None for the base model."""
        if self.lora_name is None:
            return None
        return SimpleNamespace(
            lora_name=self.lora_name, lora_int_id=self.lora_int_id, adapter_id=self.lora_int_id, lora_path=self.lora_path
        )

    @lora_request.setter
    def lora_request(self, value: Any) -> None:
        """Set a vLLM ``LoRARequest`` (or None): it sets ``lora_name``, ``lora_int_id`` and
        ``lora_path``, checked as the constructor checks them (nothing changes on a refusal).
        Set it before the request is hashed: hashes already computed keep their adapter."""
        if value is None:
            name = path = int_id = None
        elif not hasattr(value, "lora_name"):
            raise TypeError(f"lora_request must be None or a vLLM LoRARequest, got {type(value).__name__}")
        else:
            name, int_id, path = value.lora_name, getattr(value, "lora_int_id", None), getattr(value, "lora_path", None) or None
        int_id = _check_lora(name, path, int_id)
        self.lora_name, self.lora_int_id, self.lora_path = name, int_id, path

    @property
    def token_bytes(self) -> bytearray:
        """``all_token_ids`` as little-endian int32 bytes, grown with it: a block hasher
        slices its blocks out of this instead of packing every block's ints (read only)."""
        return self._token_bytes

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def get_num_encoder_embeds(self, input_id: int) -> int:
        """The embeddings multimodal item ``input_id`` brings (vLLM's name)."""
        return self.mm_features[input_id].get_num_embeds()

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens; the hashes of blocks they complete are computed now."""
        if type(token_ids) is int and MIN_TOKEN_ID <= token_ids <= MAX_TOKEN_ID:
            ids = [token_ids]  # one valid token: how a scheduler appends them
        else:
            if type(token_ids) is not list and (
                type(token_ids) is int or not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes))
            ):
                token_ids = [token_ids]  # type: ignore[list-item]  # one token (an int, numpy's included)
            ids = _check_token_ids("token_ids", token_ids)
            if not ids:
                return
        self._output_token_ids.extend(ids)
        self._all_token_ids.extend(ids)
        self._token_bytes += _pack_tokens(ids)
        if self._block_hasher is not None:
            try:
                new = self._block_hasher(self)
            except BaseException:
                # All or nothing: a hash function that raises (a learner's, say) must not
                # leave tokens whose full blocks have no hash -- the request could never be
                # cached or looked up again.
                n = len(ids)
                del self._output_token_ids[-n:], self._all_token_ids[-n:], self._token_bytes[-4 * n :]
                raise
            self.block_hashes.extend(new)

    # -- hashing --------------------------------------------------------------------------
    def bind_block_hasher(self, hasher: Callable[[Request], list[BlockHash]]) -> None:
        """Attach a block hasher (usually the first manager's) and hash the full blocks.

        A request has one chain of hashes. Another hasher with the same ``block_size`` and
        ``hash_fn`` would compute the same chain, so it is accepted and the first one kept;
        a different one is an error (its hashes would not match the ones already known).
        """
        current = self._block_hasher
        if current is hasher:
            return
        if current is not None:
            if _hasher_params(current) == _hasher_params(hasher):
                return
            raise ValueError(
                f"request {self.request_id!r} is already hashed with {_describe_hasher(current)}; "
                f"a manager with {_describe_hasher(hasher)} cannot reuse it -- create a new Request"
            )
        hashes = hasher(self)  # first: a hasher that raises leaves the request unbound, as it was
        self._block_hasher = hasher
        self.block_hashes = hashes

    @property
    def block_hasher(self) -> Callable[[Request], list[BlockHash]] | None:
        return self._block_hasher

    def replace_tokens(self, prompt_token_ids: Sequence[int], num_kept_hashes: int, mm_features: Sequence[MultiModalFeature]) -> None:
        """Make ``prompt_token_ids`` the request's tokens, all prompt, and ``mm_features`` its
        items; keep its first ``num_kept_hashes`` block hashes and compute the rest again
        (a streaming session's next chunk: the scheduler's ``_update_request_as_session``).
        All or nothing: new lists replace the old ones, so a hash function that raises
        leaves the request as it was -- and so does an undo that puts the old ones back."""
        old = (self.prompt_token_ids, self._all_token_ids, self._token_bytes, self._output_token_ids, self.mm_features, self.block_hashes)
        prompt = list(prompt_token_ids)
        self.prompt_token_ids, self._all_token_ids = prompt, list(prompt)
        self._token_bytes = bytearray(_pack_tokens(prompt))
        self._output_token_ids = []
        self.mm_features = list(mm_features)
        self.block_hashes = self.block_hashes[:num_kept_hashes]
        if self._block_hasher is not None:
            try:
                self.block_hashes.extend(self._block_hasher(self))
            except BaseException:
                (
                    self.prompt_token_ids,
                    self._all_token_ids,
                    self._token_bytes,
                    self._output_token_ids,
                    self.mm_features,
                    self.block_hashes,
                ) = old
                raise

    def rehash(self) -> None:
        """Compute every block hash again from the tokens the request has now (all or
        nothing, as :meth:`replace_tokens`)."""
        if self._block_hasher is not None:
            old, self.block_hashes = self.block_hashes, []
            try:
                self.block_hashes = self._block_hasher(self)
            except BaseException:
                self.block_hashes = old
                raise

    # -- lifecycle ------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, status={self.status.name})"


def _hasher_params(hasher: object) -> tuple:
    return (getattr(hasher, "block_size", None), getattr(hasher, "hash_fn", hasher), getattr(hasher, "mm_resume", "window"))


def _describe_hasher(hasher: object) -> str:
    block_size, fn, _ = _hasher_params(hasher)
    return f"block_size={block_size}, hash {getattr(fn, '__name__', fn)}"
