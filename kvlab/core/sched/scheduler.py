"""The scheduler: who gets tokens this step, and who is preempted when blocks run out
(lesson 05).

vLLM: ``vllm/v1/core/sched/scheduler.py``. One step:

1. Running requests first, in admission order. Each asks the KV-cache manager for room
   for its next tokens (a decode needs one slot; a chunked prefill a chunk). If the pool
   is empty, the scheduler *preempts*: under FCFS the most recently admitted running
   request (possibly the asking request itself), under ``priority`` the one with the
   largest ``(priority, arrival_time)``. A preempted request loses all its blocks and
   its computed tokens (recompute later; nothing is swapped to CPU) and goes back to the
   *head* of the waiting queue.
2. Then waiting requests, in queue order -- but not in a step that preempted (memory is
   short), not beyond ``max_num_seqs``, and stopping at the first one that does not fit
   (head-of-line: a waiting request never triggers preemption). "Fits" is vLLM's
   admission gate (``scheduler_reserve_full_isl=True``, the default): the WHOLE prompt,
   after its prefix hit, must fit in the free blocks now, not just the first chunk -- a
   request admitted on its first chunk alone would soon need blocks that are not there and
   preempt someone (lesson 05). ``scheduler_reserve_full_isl=False`` admits on the first
   chunk (vLLM up to 0.18).

Beyond the pool (lessons 12-14): a KV connector (``connector=``, its scheduler half) may
supply a waiting request's KV beyond the local prefix hit -- *external computed tokens*
from a CPU/disk tier or another engine; a load that fails gives the request back to
recompute. A connector's load may also be asynchronous (vLLM's P/D path): the request gets
its blocks, waits holding them (``WAITING_FOR_REMOTE_KVS``, in ``kv_holding_waiting``, tried
before ``waiting`` every step) until the worker reports the KV received, and is admitted only
if the requests still prefilling keep the blocks they need to finish. A streaming-input
session (``Request(..., resumable=True)``, vLLM 0.33) waits the same way between turns
(``WAITING_FOR_STREAMING_REQ``): its turn ends without finishing, its blocks and computed
tokens stay, and its next chunk -- a request with its id -- is prefilled on top of them, so
a conversation's earlier turns are never looked up or computed again. The price is memory
held while nothing runs. Multimodal requests need their items encoded first: a per-step encoder budget
and the :class:`EncoderCacheManager` decide which encoder inputs run, and cut a prefill
chunk before an item that cannot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.core.encoder_cache_manager import EncoderCacheManager, EncoderDecoderCacheManager, compute_encoder_budget
from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvlab.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput
from kvlab.core.sched.request_queue import POLICIES, FCFSRequestQueue, PriorityRequestQueue
from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from kvlab.kv_cache_interface import get_mamba_prefill_checkpoint_position, is_mamba_prefill_checkpoint_valid
from kvlab.core.transaction import adds_request, save_first, scheduler_call
from kvlab.utils.kv_events import KVEventBatch
from kvlab.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.metrics.stats import CachingMetrics, IterationStats, PrefixCacheStats, SchedulerStats
from kvlab.request import Request, RequestStatus, StreamingUpdate
from kvlab.eventlog.events import (
    KVLoadFailed,
    RequestAdded,
    RequestLoading,
    RequestFinished,
    RequestPaused,
    RequestPreempted,
    RequestResumed,
    RequestScheduled,
    SchedulerCreated,
    StepFinished,
    StepStarted,
    TokensAppended,
)
from kvlab.utils.checks import check_int, check_optional_int
from kvlab.utils.hashing import MAX_TOKEN_ID, MIN_TOKEN_ID, TOKEN_ID_WHY
from kvlab.utils.math_utils import cdiv

#: The statuses ``finish_requests`` may set (every finished one).
FINISHED_STATUSES = tuple(s for s in RequestStatus if RequestStatus.is_finished(s))

if TYPE_CHECKING:  # the core never imports a connector: it calls the hooks of the one it is given
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from kvlab.outputs import KVConnectorOutput

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVEventPublisherLike(Protocol):
    """What the scheduler needs of a KV-event publisher (``kvlab.kv_events.ZmqEventPublisher``)."""

    def publish(self, events: KVEventBatch) -> None: ...


def _adapter(request: Request) -> int | str | None:
    """The LoRA adapter a request runs with (vLLM's ``lora_int_id``; kvlab also takes a name
    alone), or None."""
    if request.lora_name is None:
        return None
    return request.lora_int_id if request.lora_int_id is not None else request.lora_name


@dataclass(slots=True)
class _StepPlan:
    """What one ``schedule()`` call has decided so far (shared by its two halves)."""

    token_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)  # req id -> tokens this step
    running: list[Request] = field(default_factory=list)  # scheduled running requests, in order
    new: list[Request] = field(default_factory=list)  # admitted for the first time
    resumed: list[Request] = field(default_factory=list)  # re-admitted after a preemption
    preempted: list[Request] = field(default_factory=list)
    computed_before: dict[str, int] = field(default_factory=dict)  # req id -> computed tokens before
    admitted: list[tuple[Request, str]] = field(default_factory=list)  # (request, "new"|"resumed")
    external: dict[str, int] = field(default_factory=dict)  # req id -> tokens a connector supplies
    encoder_budget: int = 0
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # req id -> items encoded this step
    long_prefill_threshold: int = 0  # this step's cap on one prompt's chunk (0: none)


def _check_scheduler_args(
    kv_cache_manager: Any,
    max_num_batched_tokens: Any,
    max_num_seqs: Any,
    policy: Any,
    enable_chunked_prefill: Any,
    long_prefill_token_threshold: Any,
    max_model_len: Any,
    scheduler_reserve_full_isl: Any,
    kv_event_publisher: Any,
    connector: Any,
    kv_load_failure_policy: Any,
    max_num_encoder_input_tokens: Any,
    encoder_cache_size: Any,
) -> tuple[int, int, int, int | None, int | None, int | None]:
    """``Scheduler``'s arguments, checked before anything is built (raising, named); the
    numbers come back as ints."""
    if not isinstance(kv_cache_manager, KVCacheManager):
        raise TypeError(f"kv_cache_manager must be a KVCacheManager, got {type(kv_cache_manager).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(enable_chunked_prefill, bool):
        raise TypeError(
            f"enable_chunked_prefill must be True or False, got {type(enable_chunked_prefill).__name__} {enable_chunked_prefill!r}"
        )
    max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
    long_prefill_token_threshold = check_int("long_prefill_token_threshold", long_prefill_token_threshold, 0, why=" (0 = off)")
    max_model_len = check_optional_int("max_model_len", max_model_len, 2)
    if not isinstance(scheduler_reserve_full_isl, bool):
        raise TypeError(f"scheduler_reserve_full_isl must be a bool, got {scheduler_reserve_full_isl!r}")
    if kv_event_publisher is not None and not callable(getattr(kv_event_publisher, "publish", None)):
        raise TypeError(f"kv_event_publisher must have a publish(batch) method, got {type(kv_event_publisher).__name__}")
    if kv_event_publisher is not None and not kv_cache_manager.enable_kv_cache_events:
        raise ValueError("kv_event_publisher needs a manager that queues events: KVCacheManager(..., enable_kv_cache_events=True)")
    if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, got {kv_load_failure_policy!r}")
    max_num_encoder_input_tokens = check_optional_int("max_num_encoder_input_tokens", max_num_encoder_input_tokens, 1)
    encoder_cache_size = check_optional_int("encoder_cache_size", encoder_cache_size, 1)
    _check_prefill_lookahead(kv_cache_manager, max_num_batched_tokens, long_prefill_token_threshold)
    if connector is not None:
        for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished"):
            if not callable(getattr(connector, hook, None)):
                raise TypeError(f"connector must be a KV connector's scheduler half (it has no {hook}()), got {type(connector).__name__}")
        role = getattr(getattr(connector, "role", None), "name", None)
        if role != "SCHEDULER":
            raise ValueError(f"connector must be built with role=KVConnectorRole.SCHEDULER, got role {role}")
    return (
        max_num_batched_tokens,
        max_num_seqs,
        long_prefill_token_threshold,
        max_model_len,
        max_num_encoder_input_tokens,
        encoder_cache_size,
    )


def _check_prefill_lookahead(kv_cache_manager: KVCacheManager, max_num_batched_tokens: int, long_prefill_token_threshold: int) -> None:
    """Refuse the settings under which vLLM 0.33's rule "never end a prefill chunk within k
    tokens of its end" (``_reserve_prefill_lookahead``, k = ``num_prefill_lookahead``) stops
    a request for good. The rule leaves exactly k tokens for the last chunk, so (1) a step
    that can never schedule k tokens would cut that chunk to nothing every step; (2) a Mamba
    "align" group cuts a chunk at a block boundary first and the rule then pulls its end
    back off the boundary, so the next chunk stops at that boundary, inside the last k
    tokens, and is cut to nothing -- every step (vLLM 0.33 applies both in this order and
    stalls such a request; kvlab refuses the combination rather than hang a notebook)."""
    k = kv_cache_manager.num_prefill_lookahead
    if k <= 1:
        return  # an EAGLE-family drafter (k = 1): the rule never cuts
    for name, limit in (("max_num_batched_tokens", max_num_batched_tokens), ("long_prefill_token_threshold", long_prefill_token_threshold)):
        if 0 < limit < k:
            raise ValueError(
                f"{name} = {limit} is smaller than the manager's num_prefill_lookahead = {k}: a prompt's last chunk must "
                f"hold all {k} tokens the drafter reads ahead, so a request would never finish its prefill"
            )
    if any(isinstance(g, MambaSpec) and g.mamba_cache_mode == "align" for g in kv_cache_manager.kv_cache_groups):
        raise ValueError(
            f"num_prefill_lookahead = {k} (a multi-module MTP drafter) with a Mamba group in 'align' mode is not scheduled by "
            "kvlab: vLLM 0.33 first cuts a prefill chunk at a Mamba block boundary, then moves its end back by up to "
            f"{k - 1} tokens so the drafter's lookahead stays in the prompt; the next chunk then stops at that boundary, "
            "inside the last tokens, and is cut to nothing every step -- the request never finishes. Use "
            "num_prefill_lookahead <= 1 (EAGLE) or mamba_cache_mode='none'"
        )


class Scheduler:
    """Who gets tokens each step, and who gives its blocks back when the pool runs dry
    (vLLM: ``vllm/v1/core/sched/scheduler.py``; lesson 05).

    Why it exists: the GPU computes a fixed budget of tokens per step
    (``max_num_batched_tokens``) for at most ``max_num_seqs`` requests, and KV memory is
    shared by all of them. The scheduler packs each step -- decodes of running requests,
    chunks of long prompts (chunked prefill), new admissions -- and keeps memory honest:
    it asks the :class:`KVCacheManager` for room before scheduling anything, and when a
    running request cannot get a block it *preempts* one (:meth:`select_victim`: the newest
    under FCFS, the least important under ``priority``), freeing all its blocks; the victim
    recomputes later, helped by its own cached prefix. A waiting request is admitted only
    when its whole prompt fits (vLLM's default), so admission never causes a preemption.

    One step is :meth:`schedule` (decide) then :meth:`update_from_output` (append the sampled
    tokens, finish requests at ``max_tokens`` or ``eos_token_id``, free their blocks).

    ``connector``: the scheduler half of a KV connector (lessons 12-13); the scheduler calls
    its hooks at vLLM's places. ``kv_load_failure_policy``: what happens to a request whose
    external KV failed to load -- "recompute" (kvlab's default: its computed tokens are cut
    back to the first failed block and it computes the rest in place, as vLLM 0.33 does) or
    "fail" (it finishes with reason "error"; vLLM 0.33's default). ``kv_transfer_config``:
    the connector's configuration (a ``KVTransferConfig``; ``build_engine`` passes it), read
    as vLLM reads ``vllm_config.kv_transfer_config``: a KV producer's connector is offered a
    finishing request's Mamba states saved inside blocks. The encoder limits (lesson 14)
    default to ``max_num_batched_tokens``, as in vLLM.
    """

    #: The open transaction's checkpoint, set and cleared by ``kvlab.core.transaction`` (kvlab's
    #: addition: every call is all or nothing); the scheduler itself never reads it.
    _txn: Any = None

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_model_len: int | None = None,
        scheduler_reserve_full_isl: bool = True,
        *,
        kv_event_publisher: KVEventPublisherLike | None = None,
        connector: KVConnectorBase_V1 | None = None,
        kv_load_failure_policy: str = "recompute",
        max_num_encoder_input_tokens: int | None = None,
        encoder_cache_size: int | None = None,
        max_loras: int | None = None,
        kv_transfer_config: Any = None,
    ) -> None:
        max_loras = check_optional_int("max_loras", max_loras, 1, why=" (None: no LoRA limit)")
        if kv_transfer_config is not None and not isinstance(getattr(kv_transfer_config, "is_kv_producer", None), bool):
            raise TypeError(f"kv_transfer_config must be None or a KVTransferConfig, got {type(kv_transfer_config).__name__}")
        (
            max_num_batched_tokens,
            max_num_seqs,
            long_prefill_token_threshold,
            max_model_len,
            max_num_encoder_input_tokens,
            encoder_cache_size,
        ) = _check_scheduler_args(
            kv_cache_manager,
            max_num_batched_tokens,
            max_num_seqs,
            policy,
            enable_chunked_prefill,
            long_prefill_token_threshold,
            max_model_len,
            scheduler_reserve_full_isl,
            kv_event_publisher,
            connector,
            kv_load_failure_policy,
            max_num_encoder_input_tokens,
            encoder_cache_size,
        )
        self.kv_cache_manager = kv_cache_manager
        # vLLM creates it from --kv-events-config; kvlab takes any object with publish(batch)
        # (kvlab.kv_events.ZmqEventPublisher, or a list-like recorder in a test).
        self.kv_event_publisher = kv_event_publisher
        self.max_num_scheduled_tokens = max_num_batched_tokens
        self.max_num_running_reqs = max_num_seqs
        # vLLM's LoRAConfig.max_loras: adapters one batch may use at once (None: no limit)
        self.max_loras = max_loras
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.scheduler_reserve_full_isl = scheduler_reserve_full_isl
        # An encoder-decoder model (Whisper, BART: a CrossAttentionSpec group): the encoder's
        # output becomes cross-attention KV in blocks, so its cache keeps nothing (vLLM 0.33).
        self.is_encoder_decoder = bool(kv_cache_manager.coordinator.cross_attention_group_ids)
        # A Mamba group in "align" mode saves its state only at block boundaries, so prefill
        # chunks must end on them (vLLM's _mamba_block_aligned_split).
        self.need_mamba_block_aligned_split = any(
            isinstance(g, MambaSpec) and g.mamba_cache_mode == "align" for g in kv_cache_manager.kv_cache_groups
        )
        # Fine-grained partial hits (vLLM 0.33): a Mamba state is also saved at the prompt's
        # last hash boundary, so a prefill chunk stops there too.
        self.mamba_partial_cache_hit = self.need_mamba_block_aligned_split and kv_cache_manager.coordinator.enable_partial_hash_hits
        # Opt-in (vLLM 0.33): a chunk also stops exactly at a shared-prefix junction, whose
        # state the manager then saves inside its block.
        self.mamba_shared_prefix_checkpoint = self.mamba_partial_cache_hit and kv_cache_manager.mamba_shared_prefix_checkpoint
        # DeepSeek-V4.1's bounded replay (vLLM 0.33): window groups whose KV is not cached,
        # so a prefix hit is rewound by their window and those tokens recomputed. One window
        # for all of them, so that the rewind fits every group's allocation.
        self.prefix_replay_group_ids = tuple(i for i, g in enumerate(kv_cache_manager.kv_cache_groups) if g.prefix_replay_tokens > 0)
        replay_windows = sorted({kv_cache_manager.kv_cache_groups[i].prefix_replay_tokens for i in self.prefix_replay_group_ids})
        if len(replay_windows) > 1:
            raise ValueError(f"the bounded-replay window groups must share one sliding_window, got {replay_windows}")
        self.prefix_replay_tokens = replay_windows[0] if replay_windows else 0
        # A backend that exports the prompt's state from inside a chunk (vLLM 0.33: every
        # Mamba group reserves a checkpoint block; the first one's alignment is used).
        mamba_specs = [g for g in kv_cache_manager.kv_cache_groups if isinstance(g, MambaSpec)]
        self.mamba_prefill_checkpoint_alignment = mamba_specs[0].prefill_checkpoint_alignment if mamba_specs else None
        self.mamba_has_prefill_checkpoint_blocks = bool(mamba_specs) and all(g.num_prefill_checkpoint_blocks > 0 for g in mamba_specs)
        # vLLM's scheduler keeps these beside the manager's (its Mamba splitter reads them):
        # the block a Mamba "align" state sits on, the hash block, EAGLE's trailing-block drop
        # (the manager's use_eagle; off with lookahead hashes) and the lookahead.
        aligned = [g.block_size for g in mamba_specs if g.mamba_cache_mode == "align"]
        self._cache_block_size = aligned[0] if aligned else kv_cache_manager.coordinator.scheduler_block_size
        self.hash_block_size = kv_cache_manager.hash_block_size
        self.use_eagle_block_drop = kv_cache_manager.use_eagle
        self.num_hash_lookahead_tokens = kv_cache_manager.num_hash_lookahead_tokens
        if connector is not None and self.is_encoder_decoder:
            raise ValueError("Encoder-decoder models are not currently supported with KV connectors (vLLM 0.33 asserts the same)")
        if (
            connector is not None
            and getattr(connector, "supports_divergent_local_hybrid_hits", False)
            and getattr(kv_cache_manager.coordinator, "full_attention_group_id", None) is not None
            and mamba_specs
        ):
            raise ValueError(
                "a KV connector that completes divergent hybrid hits (supports_divergent_local_hybrid_hits=True) on a Mamba "
                "hybrid is not modelled by kvlab: vLLM 0.33 admits such a request on full attention's deeper hit and has the "
                "connector bring the lagging Mamba state, which kvlab's connectors never move. Leave the property False"
            )
        if connector is not None and self.mamba_partial_cache_hit:
            raise ValueError(
                "a KV connector with partial prefix hits (a Mamba hybrid whose blocks are larger than the hash block) is not "
                "modelled by kvlab: vLLM 0.33 hands such a connector the Mamba states saved inside blocks. Use "
                "prefix_match_unit equal to the Mamba block size, or no connector"
            )
        self.events = kv_cache_manager.events
        self.connector = connector
        if connector is not None:
            connector.bind_kv_cache_manager(kv_cache_manager)  # as vLLM's scheduler does, once
        self.kv_load_failure_policy = kv_load_failure_policy
        # The one field of vLLM's engine config its scheduler reads that kvlab's does not
        # take apart: the KV transfer config (see _connector_finished).
        self.vllm_config = SimpleNamespace(kv_transfer_config=kv_transfer_config)
        # vLLM keeps the connector's hits apart: vllm:external_prefix_cache_queries / _hits.
        self.connector_prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if connector is not None else None
        # The last step's connector metrics payload (a KVConnectorStats; see _update_from_output).
        self.kv_connector_stats: Any = None
        self.num_kv_load_failures = 0
        self.max_num_encoder_input_tokens, encoder_cache_size = compute_encoder_budget(
            max_num_batched_tokens, max_num_encoder_input_tokens, encoder_cache_size
        )
        # (an encoder-decoder model: see is_encoder_decoder above)
        self.encoder_cache_manager: EncoderCacheManager = (
            EncoderDecoderCacheManager(encoder_cache_size)
            if self.is_encoder_decoder
            else EncoderCacheManager(encoder_cache_size, self.events)
        )
        # A drafter reads prompt tokens past a chunk (vLLM 0.33's shift_computed_tokens); passed
        # only when there is one, so a subclass with the older four-argument override still runs.
        k = kv_cache_manager.num_prefill_lookahead
        self._encoder_shift: dict[str, int] = {"shift_computed_tokens": k} if k else {}

        self.requests: dict[str, Request] = {}
        self.waiting: FCFSRequestQueue | PriorityRequestQueue = PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
        # Waiting requests that hold blocks: an asynchronous KV load in flight (or landed), so
        # they are tried before ``waiting`` every step (vLLM 0.33's ``kv_holding_waiting``).
        self.kv_holding_waiting: FCFSRequestQueue | PriorityRequestQueue = (
            PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
        )
        # Asynchronous loads the worker reported received / failed (vLLM's names).
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        # Requests still prefilling (an admitted chunk short of the prompt's end, or a load in
        # flight): an asynchronous load is admitted only with the blocks they still need left
        # free (vLLM's set of requests; only their sum of blocks and membership are read).
        self._inflight_prefills: set[Request] = set()
        self.running: list[Request] = []
        # Streaming-input sessions between turns (WAITING_FOR_STREAMING_REQ): queued in
        # kv_holding_waiting, holding their blocks, but with nothing to run until their next
        # chunk arrives -- so they count neither as unfinished work nor as waiting to run,
        # yet each keeps a place among max_num_seqs (vLLM 0.33).
        self.num_waiting_for_streaming_input = 0
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the executor
        self.step_count = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.caching_metrics = CachingMetrics()
        # req_id -> the number of blocks per group already reported to the executor (no
        # entry: the executor does not know the request -- it gets sent in full)
        self._num_sent_blocks: dict[str, tuple[int, ...]] = {}  # per request, per group: blocks the executor has
        self._pending_output: SchedulerOutput | None = None  # scheduled, not applied yet
        self._last_applied_step = 0
        # vLLM 0.33's fence for blocks a step in flight may still use. With overlapping
        # batches (async scheduling, pipeline parallelism) vLLM schedules step n+1 before step
        # n's output is back, so a copy-on-write's two blocks cannot go back to the pool until
        # the step that runs the copy has been processed: they wait in ``deferred_frees`` as
        # (fence, blocks), the fence being that step's number among the non-empty steps. kvlab
        # processes every step's output before it schedules the next -- one batch in flight --
        # so the copies have always run and ``defer_block_free`` stays False (blocks go back
        # at once); set it, and the retentions wait as in vLLM (request frees do not).
        self.defer_block_free = False
        self.sched_step_seq = 0  # non-empty steps scheduled (counted only when deferring)
        self.processed_step_seq = 0  # ... and processed
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock]]] = deque()
        if self.events is not None:
            self.events.emit(
                SchedulerCreated(
                    policy=policy,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_num_seqs=max_num_seqs,
                    enable_chunked_prefill=enable_chunked_prefill,
                )
            )

    # -- requests ----------------------------------------------------------------------------
    @adds_request
    def add_request(self, request: Request) -> None:
        """Queue a new request (all or nothing: a refused request leaves no trace).

        A request whose id names a streaming-input session still open (one added with
        ``resumable=True``) is that session's next chunk instead (vLLM 0.33): a resumable
        one brings more input, a non-resumable one closes the session. See
        :meth:`add_streaming_update`."""
        if self.open_session(request) is not None:
            self.add_streaming_update(request)
            return
        self.check_request(request)
        rid = request.request_id
        self.requests[rid] = request
        self.waiting.add_request(request)
        request._owner = self
        if self.events is not None:
            self.events.emit(
                RequestAdded(
                    request_id=rid,
                    prompt_token_ids=list(request.prompt_token_ids),
                    max_tokens=request.max_tokens,
                    priority=request.priority,
                    arrival_time=request.arrival_time,
                    cache_salt=request.cache_salt,
                    lora_name=request.lora_name,
                )
            )
        if request.resumable:
            request.streaming_queue = deque()
        if self.connector is not None:
            self.connector.on_new_request(request)  # last: if it raises, the request is taken back

    @scheduler_call(touches=lambda sched, request: [request.request_id])
    def add_streaming_update(self, request: Request) -> None:
        """The next chunk of the open session with ``request``'s id (vLLM 0.33's
        ``add_request`` for an id it knows). A session between turns takes it at once: its
        output so far (but the last sampled token, whose K/V was never computed) becomes
        prompt, the chunk is appended, and it is queued again holding its blocks, so only
        the new tokens are prefilled -- no prefix lookup, no recompute. A session still
        running keeps the chunk until its turn ends. A non-resumable request closes the
        session: at once (aborted, its blocks freed) if it is between turns, else when the
        running turn ends. All or nothing; a chunk that cannot run is refused, naming why."""
        session = self.check_streaming_update(request)
        update = StreamingUpdate.from_request(request)
        assert session.streaming_queue is not None  # an open session's (check_streaming_update)
        if session.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            session.streaming_queue = deque([*session.streaming_queue, update])  # a new deque: an undo restores the old one
        elif update is not None:
            self._update_request_as_session(session, update)
        else:
            self._finish_request(session, RequestStatus.FINISHED_ABORTED, "abort")

    def open_session(self, request: Any) -> Request | None:
        """The open streaming session ``request`` would continue -- a resumable request of
        the same id, queued and unfinished -- or None: then it is a request of its own."""
        session = self.requests.get(request.request_id) if isinstance(request, Request) else None
        if session is None or session is request or session.streaming_queue is None or session.is_finished():
            return None
        return session

    def check_streaming_update(self, request: Request) -> Request:
        """Raise if :meth:`add_streaming_update` would refuse ``request``; else return the
        session it continues. Changes nothing. A chunk is a fresh Request of its own, for
        the session's adapter and salt; one given to a session between turns must fit."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__}")
        rid = request.request_id
        session = self.open_session(request)
        if session is None:
            raise ValueError(f"no open streaming session has id {rid!r} (a session's first request is added with resumable=True)")
        if request._owner is not None:
            raise ValueError(f"request {rid!r} is already queued; a session's next chunk is a new Request with the session's id")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.name}); create a new Request")
        if not request.resumable:
            return session  # it only closes the session: its tokens are never read
        if not request.num_prompt_tokens:
            raise ValueError(f"request {rid!r}: a session's next chunk must bring at least one prompt token")
        for name in ("lora_name", "cache_salt"):
            if getattr(request, name) != getattr(session, name):
                raise ValueError(
                    f"request {rid!r}: a session's chunks share its {name} ({getattr(session, name)!r}), got "
                    f"{getattr(request, name)!r} (vLLM keeps the session's and ignores the chunk's)"
                )
        if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            update = StreamingUpdate.from_request(request)
            assert update is not None
            self._check_session_fits(session, update)
        return session

    def _check_session_fits(self, session: Request, update: StreamingUpdate) -> None:
        """The session with the chunk must still fit: under ``max_model_len`` and in the pool."""
        num_prompt = session.num_tokens - 1 + len(update.prompt_token_ids)
        if self.max_model_len is not None and num_prompt >= self.max_model_len:
            raise ValueError(
                f"session {session.request_id!r}: with this chunk its prompt would be {num_prompt} tokens, not below "
                f"max_model_len {self.max_model_len}"
            )
        need = num_prompt + update.max_tokens - 1
        if self.max_model_len is not None:
            need = min(need, self.max_model_len)
        if self._blocks_needed(need) > self.kv_cache_manager.num_blocks - 1:
            raise ValueError(
                f"session {session.request_id!r}: with this chunk it needs {self._blocks_needed(need)} blocks, the pool has "
                f"{self.kv_cache_manager.num_blocks - 1} usable blocks"
            )

    def _update_request_as_session(self, session: Request, update: StreamingUpdate) -> None:
        """Give a session its next chunk (vLLM 0.33's name). The last sampled token is dropped
        -- it was never fed back, so no block holds its K/V -- the rest of the output joins the
        prompt, and the hashes from the block that held the dropped token on are computed
        again over the new tokens. Computed tokens and blocks are kept."""
        keep_end = session.num_tokens - 1
        if keep_end < session.num_computed_tokens:
            raise AssertionError(f"session {session.request_id!r}: {session.num_computed_tokens} computed of {keep_end} kept tokens")
        hash_block_size = self.kv_cache_manager.hash_block_size
        session.replace_tokens(
            prompt_token_ids=[*session.all_token_ids[:keep_end], *update.prompt_token_ids],
            num_kept_hashes=keep_end // hash_block_size,
            mm_features=[*session.mm_features, *(replace(f, offset=f.offset + keep_end) for f in update.mm_features)],
        )
        session.arrival_time = update.arrival_time
        session.max_tokens = update.max_tokens
        session.eos_token_id = update.eos_token_id
        if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
        session.status = RequestStatus.WAITING
        if self.events is not None:
            self.events.emit(
                RequestResumed(
                    request_id=session.request_id,
                    prompt_token_ids=list(update.prompt_token_ids),
                    num_prompt_tokens=session.num_prompt_tokens,
                    num_computed_tokens=session.num_computed_tokens,
                    max_tokens=update.max_tokens,
                )
            )

    def _handle_stopped_request(self, request: Request, reason: str) -> bool:
        """A request stopped (``reason``: "stop" or "length"). True: it finishes. A resumable
        one does not (vLLM 0.33): it takes its next chunk if one is waiting, else it waits
        for one, holding its blocks; a queued close finishes it. So does a queued chunk that
        could never run -- the session with it needs more blocks than the pool has, or reaches
        ``max_model_len`` -- where vLLM 0.33 would keep the session forever, holding its blocks
        (a chunk given between turns is refused instead, naming why)."""
        if not request.resumable:
            return True
        queue = request.streaming_queue or deque()
        update = queue[0] if queue else None
        if queue and update is None:
            return True  # closed while it ran
        if update is not None:
            try:
                self._check_session_fits(request, update)
            except ValueError:
                return True  # the session has no room left for this chunk: it ends here
        if self.events is not None:
            self.events.emit(RequestPaused(request_id=request.request_id, reason=reason, num_output_tokens=request.num_output_tokens))
        if update is not None:
            request.streaming_queue = deque(list(queue)[1:])  # a new deque: an undo restores the old one
            self._update_request_as_session(request, update)
        else:
            request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self.num_waiting_for_streaming_input += 1
        return False

    def check_request(self, request: Request) -> None:
        """Raise if ``add_request(request)`` would refuse it; changes nothing."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a kvlab.Request, got {type(request).__name__}")
        rid = request.request_id
        if request._owner is not None and request._owner is not self:
            raise ValueError(f"request {rid!r} is already queued in another scheduler; a Request runs in one scheduler at a time")
        if rid in self.requests:
            first = self.requests[rid]
            hint = (
                " (a streaming session's first request needs resumable=True)" if request.resumable and first.streaming_queue is None else ""
            )
            raise ValueError(f"request id {rid!r} was already added and has not finished; ids must be unique{hint}")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.name}); create a new Request")
        if not request.num_prompt_tokens:
            raise ValueError(f"request {rid!r}: prompt_token_ids must not be empty (vLLM refuses an empty prompt)")
        need = self.max_kv_tokens_needed(request)
        encoder = sum(f.get_num_embeds() for f in request.mm_features) if self.is_encoder_decoder else 0
        if self._blocks_needed(need, encoder) > self.kv_cache_manager.num_blocks - 1:
            raise ValueError(
                f"request {rid!r} can never fit: {request.num_prompt_tokens} prompt + {request.max_tokens} max "
                f"tokens{f' + {encoder} encoder tokens' if encoder else ''} need {self._blocks_needed(need, encoder)} blocks, "
                f"the pool has {self.kv_cache_manager.num_blocks - 1} "
                "usable blocks (raise num_blocks or lower max_tokens)"
            )
        if not self.enable_chunked_prefill and request.num_prompt_tokens > self.max_num_scheduled_tokens:
            raise ValueError(
                f"request {rid!r} has {request.num_prompt_tokens} prompt tokens, more than max_num_batched_tokens="
                f"{self.max_num_scheduled_tokens}; without chunked prefill it could never be scheduled"
            )
        if self.max_model_len is not None and request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens >= max_model_len {self.max_model_len}")
        for f in request.mm_features:
            if self.is_encoder_decoder and f.offset:
                raise ValueError(
                    f"request {rid!r}: item {f.identifier!r} starts at token {f.offset}; an encoder-decoder model's encoder "
                    "input starts at 0 (the decoder reads it through cross-attention, not at a position of its prompt)"
                )
            if not self.is_encoder_decoder and f.offset + f.length > request.num_prompt_tokens:
                raise ValueError(
                    f"request {rid!r}: item {f.identifier!r} covers tokens [{f.offset}, {f.offset + f.length}) but the prompt "
                    f"has {request.num_prompt_tokens}; an encoder input longer than the prompt needs an encoder-decoder model "
                    "(a CrossAttentionSpec group in the manager)"
                )
        limit = min(self.max_num_encoder_input_tokens, self.encoder_cache_manager.cache_size)
        for f in request.mm_features:
            if f.get_num_embeds() > limit:
                raise ValueError(
                    f"request {rid!r}: item {f.identifier!r} has {f.get_num_embeds()} embeddings, more than the encoder budget "
                    f"({self.max_num_encoder_input_tokens}) or the encoder cache ({self.encoder_cache_manager.cache_size}) "
                    "holds: it could never be encoded (raise max_num_encoder_input_tokens / encoder_cache_size)"
                )

    def max_kv_tokens_needed(self, request: Request) -> int:
        """Tokens whose K/V the request may hold at once: the last sampled token never
        needs a slot (it is never fed back), so prompt + max_tokens - 1."""
        n = request.num_prompt_tokens + request.max_tokens - 1
        return min(n, self.max_model_len) if self.max_model_len else n

    def _blocks_needed(self, num_tokens: int, num_encoder_tokens: int = 0) -> int:
        """Most blocks a request of ``num_tokens`` tokens can hold at once, over all groups (a
        cross-attention group holds the encoder's ``num_encoder_tokens``)."""
        total = 0
        for spec in self.kv_cache_manager.kv_cache_groups:
            bs = spec.block_size
            n = cdiv(num_encoder_tokens if isinstance(spec, CrossAttentionSpec) else num_tokens, bs)  # type: ignore[arg-type]  # the manager filled in every spec's block size (a spec may be given without one)
            if isinstance(spec, SlidingWindowSpec):
                n = min(n, cdiv(spec.num_retained_tokens, bs) + 2)  # type: ignore[arg-type]  # as above
            elif isinstance(spec, CircularBufferSpec):
                n = 1  # one ring block for the request's whole life
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                n = min(n, cdiv(spec.attention_chunk_size, bs) + 1)  # type: ignore[arg-type]  # as above
            elif isinstance(spec, MambaSpec):
                n = min(n, 2)  # the state it reads and the one it writes
            total += n
        return total

    def has_unfinished_requests(self) -> bool:
        """Whether a request has work to do (a session between turns has none)."""
        return bool(self.running) or bool(self.waiting) or len(self.kv_holding_waiting) > self.num_waiting_for_streaming_input

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.kv_holding_waiting) - self.num_waiting_for_streaming_input

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests, the waiting ones holding blocks included (vLLM's)."""
        return len(self.running), len(self.waiting) + len(self.kv_holding_waiting)

    def has_pending_kv_transfers(self) -> bool:
        """Whether a connector's asynchronous transfer still has to report: a load in flight
        (``WAITING_FOR_REMOTE_KVS``), a finished request whose blocks wait for a send, or work
        the connector says it still has to push (``has_pending_push_work``, vLLM 0.33). The
        engine keeps stepping while one does, even when nothing can be scheduled."""
        return (
            len(self.requests) > len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
            or any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.kv_holding_waiting)
            or (self.connector is not None and self.connector.has_pending_push_work())
        )

    @scheduler_call(
        touches=lambda sched, reset_running_requests=False, *a, **k: [r.request_id for r in sched.running] if reset_running_requests else []
    )
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drop every cached prefix -- after a weight update, say, when cached KV was computed
        by the old weights (vLLM 0.33's ``Scheduler.reset_prefix_cache``). Refused (False)
        while a running request holds blocks, unless ``reset_running_requests``: then every
        running request is preempted first (newest first) and recomputes later.
        ``reset_connector`` also empties the connector's tiers (``reset_cache``). All or
        nothing: a call that raises leaves the cache and the queues as they were."""
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
        if reset_running_requests:
            while self.running:
                self._preempt_request(self.running.pop(), for_request=None)
        ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not ok:
            raise RuntimeError(
                "reset_prefix_cache: the cache could not be reset even with every running request preempted -- a "
                "request waiting for a connector's KV (WAITING_FOR_REMOTE_KVS) still holds blocks; let its load finish first"
            )
        if reset_connector:
            ok = self.reset_connector_cache() and ok
        return ok

    def reset_connector_cache(self) -> bool:
        """Empty the connector's own cache (vLLM 0.33). No connector: nothing to reset, done.
        False when the connector could not now (its ``reset_cache`` said False)."""
        if self.connector is None:
            return True
        if self.connector.reset_cache() is False:
            return False
        if self.connector_prefix_cache_stats is not None:
            self.connector_prefix_cache_stats.reset = True
        return True

    @scheduler_call(touches=lambda sched, request_ids, *a, **k: sched.check_finish_args(request_ids)[0])
    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests now (an abort, by default) and free their blocks. Ids that are not
        queued (unknown, or finished already) are ignored, as in vLLM. All or nothing."""
        ids, reason = self.check_finish_args(request_ids, status)
        for rid in ids:
            r = self.requests.get(rid)
            if r is None or r.is_finished():  # a finished one whose blocks wait for a send
                continue
            self._finish_request(r, status, reason)

    def _finish_request(self, r: Request, status: RequestStatus, reason: str) -> None:
        """Take an unfinished request out of its queue and finish it."""
        rid = r.request_id
        delay_free_blocks = False
        if r.status == RequestStatus.RUNNING:
            self.running.remove(r)
        elif any(q is r for q in self.kv_holding_waiting):
            self.kv_holding_waiting.remove_request(r)
            if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                self.num_waiting_for_streaming_input -= 1
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # The load may still be writing into its blocks: they are freed when the
                # worker reports it received, unless it already has (vLLM 0.33).
                delay_free_blocks = rid not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(rid)
                self.failed_recving_kv_req_ids.discard(rid)
        else:
            self.waiting.remove_request(r)
        r.status = status
        self._free_request(r, reason, delay_free_blocks=delay_free_blocks)

    def check_finish_args(self, request_ids: Any, status: Any = RequestStatus.FINISHED_ABORTED) -> tuple[list[str], str]:
        """The ids ``finish_requests`` would finish (deduplicated, in order) and the finish
        reason; raises on bad arguments. Changes nothing."""
        if isinstance(request_ids, str):
            ids = [request_ids]
        elif isinstance(request_ids, (bytes, Mapping)) or not isinstance(request_ids, Iterable):
            raise TypeError(f"request_ids must be a request id (str) or a list of them, got {type(request_ids).__name__} {request_ids!r}")
        else:
            ids = list(request_ids)
        for i, rid in enumerate(ids):
            if not isinstance(rid, str):
                raise TypeError(f"request_ids[{i}] must be a request id (str), got {type(rid).__name__} {rid!r}")
        if not isinstance(status, RequestStatus) or not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished RequestStatus, one of {[s.name for s in FINISHED_STATUSES]}; got {status!r}")
        reason = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length"}.get(status, "abort")
        return list(dict.fromkeys(ids)), reason

    # -- one step -----------------------------------------------------------------------------
    @scheduler_call(touches=lambda sched: [r.request_id for r in sched.kv_holding_waiting])
    def schedule(self) -> SchedulerOutput:
        """Decide one step: which requests run, how many tokens each, and who is preempted.

        Why running requests go first (lesson 05): they already hold KV blocks, and every
        step they wait is latency a user sees mid-answer, while a waiting request has cost
        nothing yet. So running requests claim the token budget and the free blocks first;
        when blocks run out it is a *running* request that must give its blocks back
        (preemption by recompute), and a waiting request is admitted only with what is left
        -- never in a step that preempted (memory is short) and never by preempting anyone
        (head-of-line: the first waiting request that does not fit stops admission). The two
        halves are :meth:`_schedule_running` and :meth:`_schedule_waiting`, as in vLLM.
        """
        out = self._schedule()
        self._pending_output = out
        return out

    def _schedule(self) -> SchedulerOutput:
        self.step_count += 1
        self.kv_cache_manager.new_step_starts()
        events = self.events
        if events is not None:
            events.step = self.step_count
            events.emit(StepStarted(token_budget=self.max_num_scheduled_tokens))
        # The long-prefill cap keeps one long prompt from starving the others of the budget;
        # alone, a request has nobody to starve, so it may use the whole budget (vLLM 0.33;
        # earlier releases capped it even then).
        threshold = self.long_prefill_token_threshold if sum(self.get_request_counts()) > 1 else 0
        plan = _StepPlan(
            token_budget=self.max_num_scheduled_tokens, encoder_budget=self.max_num_encoder_input_tokens, long_prefill_threshold=threshold
        )
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        for rid, n in plan.num_scheduled.items():
            if plan.computed_before[rid] + n >= self.requests[rid].num_tokens:
                self._inflight_prefills.discard(self.requests[rid])  # this chunk ends its prefill
        out = self._make_output(plan)
        if self.defer_block_free and out.total_num_scheduled_tokens > 0:
            self.sched_step_seq += 1  # only non-empty steps run on the device and come back
        if events is not None:
            for r, phase in [(r, "running") for r in plan.running] + plan.admitted:
                events.emit(
                    RequestScheduled(
                        request_id=r.request_id,
                        num_tokens=plan.num_scheduled[r.request_id],
                        num_computed_tokens=plan.computed_before[r.request_id],
                        phase=phase,
                        num_cached_tokens=plan.computed_before[r.request_id] if phase != "running" else 0,
                        num_external_tokens=plan.external.get(r.request_id, 0),
                    )
                )
        return out

    @staticmethod
    def _num_new_tokens(request: Request, num_computed_tokens: int, plan: _StepPlan) -> int:
        """The tokens ``request`` lacks, capped by the step's long-prefill threshold (a long
        prompt is computed in chunks so it cannot hog whole steps; lesson 05)."""
        n = request.num_tokens - num_computed_tokens
        threshold = plan.long_prefill_threshold
        return threshold if 0 < threshold < n else n

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Never end a prefill chunk within ``num_prefill_lookahead`` tokens of the prefill's
        end (vLLM 0.33's ``_reserve_prefill_lookahead``): at a chunk boundary a multi-module
        MTP drafter reads the next k prompt tokens, and a boundary closer to the end than k
        would leave it drafting from guesses, whose KV its later modules would keep. So the
        chunk either finishes the prefill or leaves at least k tokens for the next one. A
        no-op for EAGLE (k = 1)."""
        k = self.kv_cache_manager.num_prefill_lookahead
        remaining = request.num_tokens - num_computed_tokens - num_new_tokens
        if 0 < remaining < k:
            num_new_tokens -= k - remaining
        return max(num_new_tokens, 0)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests, in admission order: room for their next tokens, preempting the
        :meth:`select_victim` choice while the pool has no block for them."""
        mgr = self.kv_cache_manager
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            request = self.running[i]
            n = min(self._num_new_tokens(request, request.num_computed_tokens, plan), plan.token_budget)
            if self.max_model_len is not None:
                n = min(n, self.max_model_len - 1 - request.num_computed_tokens)
            if self.need_mamba_block_aligned_split:
                n = self._mamba_block_aligned_split(request, n)
            encoder_inputs: list[int] = []
            duplicates: list[int] = []
            new_encoder_budget = plan.encoder_budget
            if n > 0 and request.mm_features:
                encoder_inputs, duplicates, n, new_encoder_budget = self._try_schedule_encoder_inputs(
                    request, request.num_computed_tokens, n, plan.encoder_budget, **self._encoder_shift
                )
            n = self._reserve_prefill_lookahead(request, request.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            while True:
                new_blocks = mgr.allocate_slots(request, n)
                if new_blocks is not None:
                    break
                if self.connector is not None and self.connector.has_pending_block_frees():
                    break  # blocks are on their way back: wait for them rather than preempt (vLLM 0.33)
                # No block for a running request: preempt someone.
                victim = self.select_victim()
                self.running.remove(victim)
                if victim in plan.running:
                    # Already scheduled this step (priority policy): take its tokens back.
                    plan.running.remove(victim)
                    plan.token_budget += plan.num_scheduled.pop(victim.request_id)
                    for j in plan.encoder_inputs.pop(victim.request_id, ()):
                        plan.encoder_budget += victim.get_num_encoder_embeds(j)
                    i -= 1
                self._preempt_request(victim, for_request=request)
                plan.preempted.append(victim)
                if victim is request:
                    break  # it preempted itself: nothing left to free for it
            if new_blocks is None:
                if self.policy == "priority" and request.status == RequestStatus.PREEMPTED:
                    # It was the lowest-priority running request and preempted itself: the
                    # requests after it rank higher and may fit in what it just freed. It left
                    # self.running, so index i is already the next one (vLLM 0.33).
                    continue
                break
            if encoder_inputs or duplicates:
                self._allocate_encoder_inputs(request, encoder_inputs, duplicates, plan)
            plan.encoder_budget = new_encoder_budget
            plan.running.append(request)
            plan.num_scheduled[request.request_id] = n
            plan.computed_before[request.request_id] = request.num_computed_tokens
            plan.token_budget -= n
            i += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Waiting requests, in queue order, while the budget, ``max_num_seqs`` and the pool
        allow; a prefix-cache hit is adopted at admission. The requests holding blocks (an
        asynchronous load) are tried first."""
        skipped: list[Request] = []
        skipped_holding: list[Request] = []
        try:
            self._admit_waiting(plan, skipped, skipped_holding)
        finally:
            self._requeue_skipped(self.kv_holding_waiting, skipped_holding)
            self._requeue_skipped(self.waiting, skipped)

    @staticmethod
    def _requeue_skipped(queue: FCFSRequestQueue | PriorityRequestQueue, skipped: list[Request]) -> None:
        """Put the requests this step passed over back at the head of their queue, in their
        order (vLLM's ``prepend_requests``; a priority queue just takes them back)."""
        if isinstance(queue, FCFSRequestQueue):
            for r in reversed(skipped):
                queue.prepend_request(r)
        else:
            for r in skipped:
                queue.add_request(r)

    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        """Whether a waiting request holds blocks: a load in flight, or one that landed
        (vLLM's ``_holds_kv_blocks``)."""
        return request.num_computed_tokens > 0 or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _admit_waiting(self, plan: _StepPlan, skipped: list[Request], skipped_holding: list[Request]) -> None:
        mgr = self.kv_cache_manager
        # The adapters of every running request, scheduled this step or not: they can join a
        # later batch (vLLM 0.33)
        loras = {a for r in self.running if (a := _adapter(r)) is not None} if self.max_loras is not None else set()

        def skip(queue: FCFSRequestQueue | PriorityRequestQueue) -> None:
            # pass it over this step; it goes back to the head of the queue its blocks say
            r = queue.pop_request()
            (skipped_holding if self._holds_kv_blocks(r) else skipped).append(r)

        while plan.token_budget > 0:
            queue = self.kv_holding_waiting if self.kv_holding_waiting else self.waiting
            # a session between turns keeps its place among max_num_seqs (vLLM 0.33)
            if not queue or len(self.running) + self.num_waiting_for_streaming_input >= self.max_num_running_reqs:
                break
            request = queue.peek_request()
            if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                skip(queue)  # nothing to run until its next chunk arrives
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.request_id not in self.finished_recving_kv_req_ids:
                    skip(queue)  # its KV has not arrived yet
                    continue
                self._update_waiting_for_remote_kv(request)
                request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            adapter = _adapter(request) if self.max_loras is not None else None
            if adapter is not None and len(loras) == self.max_loras and adapter not in loras:
                skip(queue)  # a new adapter would exceed max_loras: try the next request
                continue
            num_external = 0
            load_async = False
            window_loaded = False  # the connector's load restores the bounded-replay windows
            connector_queries = 0
            looked_up = request.num_computed_tokens == 0
            if looked_up:
                if request.resumable and mgr.num_hash_lookahead_tokens:
                    # a session's hashes may cover a sampled token it dropped (in a block's
                    # lookahead); its blocks are gone now, so hash the tokens it has (vLLM 0.33)
                    save_first(None if self._txn is None else self._txn.saved_requests, request)
                    request.rehash()
                hits, num_hit_tokens, request.shared_prefix_boundary, hit_diverged = self._get_local_prefix_cache_hit(request)
                assert not hit_diverged  # a connector that completes such hits is refused (__init__)
                # A KV connector may supply more of the prompt beyond the local hit: external
                # computed tokens (lessons 12-13), loaded within the step or asynchronously.
                if self.connector is not None:
                    ext, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
                    if request.skip_reading_prefix_cache:  # asked, but nothing is read (vLLM 0.33)
                        ext, load_async = 0, False
                    if ext is None:
                        skip(queue)  # the connector cannot tell yet: try the next request
                        continue
                    if not isinstance(load_async, bool):
                        raise TypeError(
                            f"connector.get_num_new_matched_tokens()[1] (load_kv_async) must be True or False, got {load_async!r}"
                        )
                    # A load within the step must leave a token to compute (the next one is
                    # sampled from it); an asynchronous one may bring the whole prompt, whose
                    # last token is then recomputed when it lands (vLLM 0.33).
                    num_external = check_int(
                        "connector.get_num_new_matched_tokens()[0]", ext, 0, request.num_tokens - num_hit_tokens - (not load_async)
                    )
                    window_loaded = bool(num_external) and self._load_restores_replay_window(request)
                    if num_external and self.prefix_replay_tokens and not window_loaded:
                        # a replay starts in the block holding its first token, and the window
                        # groups free whole blocks below the window: a loaded hit must end on
                        # a block boundary
                        num_external -= num_external % self.kv_cache_manager.coordinator.scheduler_block_size
                    load_async = load_async and num_external > 0
                    connector_queries = request.num_tokens - num_hit_tokens
                num_computed = num_hit_tokens + num_external
                if not window_loaded and 0 < num_computed <= self.prefix_replay_tokens:
                    # a hit no longer than the replayed window would all be recomputed: drop it
                    hits, num_hit_tokens, num_external, num_computed = mgr.empty_kv_cache_blocks.new_empty(), 0, 0, 0
                    load_async = False
            else:
                # Its asynchronous load has landed: the blocks are its own already, and the
                # replay was marked when it landed (vLLM 0.33).
                hits, num_hit_tokens = mgr.empty_kv_cache_blocks.new_empty(), 0
                num_computed = request.num_computed_tokens
            num_hit = num_computed  # what the cache supplied, before the replay rewinds it
            num_replay = 0
            encoder_inputs: list[int] = []
            duplicates: list[int] = []
            new_encoder_budget = plan.encoder_budget
            if load_async:
                n = 0  # nothing is computed until the KV has arrived
            else:
                if looked_up:
                    num_replay = self._mark_prefix_replay(request, num_computed, window_loaded)
                    num_computed -= num_replay
                n = self._num_new_tokens(request, num_computed, plan)
                if not self.enable_chunked_prefill and n > plan.token_budget:
                    break  # the whole prompt must fit; no skipping ahead
                n = min(n, plan.token_budget)
                if self.need_mamba_block_aligned_split:
                    # vLLM splits from the hit, not the replay: the request's own computed tokens (an
                    # asynchronous load that landed) and what this lookup found
                    n = self._mamba_block_aligned_split(request, n, num_hit - request.num_computed_tokens)
                    if n <= 0:
                        break
                if request.mm_features:
                    encoder_inputs, duplicates, n, new_encoder_budget = self._try_schedule_encoder_inputs(
                        request, num_computed, n, plan.encoder_budget, **self._encoder_shift
                    )
                n = self._reserve_prefill_lookahead(request, num_computed, n)
                if n <= 0:
                    # an item it needs cannot be encoded this step, or the chunk would end in the
                    # drafter's lookahead: pass it over so it does not stall the requests behind it
                    # (vLLM 0.33; the cached items it references stay referenced, as in vLLM)
                    skip(queue)
                    continue
            # vLLM's admission gate: the whole prompt (after the hit) must fit now, not just
            # this chunk (scheduler_reserve_full_isl; lesson 05b section 4). An asynchronous
            # load holds its blocks with nothing computed until the KV arrives, so it must also
            # leave the requests still prefilling the blocks they need to finish.
            new_blocks = mgr.allocate_slots(
                request,
                max(n - num_replay, 0),  # the replayed tokens are in the hit already
                num_hit_tokens,
                hits,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=load_async,  # cached once the KV has arrived
                full_sequence_must_fit=self.scheduler_reserve_full_isl,
                skip_zeroing_group_ids=tuple(self.connector.get_loaded_kv_cache_group_ids(request))
                if load_async and self.connector is not None
                else (),
                # an encoder-decoder model: cross-attention blocks for the encoder's output
                num_encoder_tokens=sum(request.get_num_encoder_embeds(i) for i in encoder_inputs) if self.is_encoder_decoder else 0,
                reserved_blocks=self._inflight_prefill_reserved_blocks() if load_async else 0,
            )
            if new_blocks is None:
                if request.mm_features:
                    self.encoder_cache_manager.free(request)  # untouch what the check referenced
                break  # head-of-line: a waiting request never preempts
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, mgr.get_blocks(request.request_id), num_external)
                stats = self.connector_prefix_cache_stats
                if stats is not None and connector_queries:
                    preempted = request.num_preemptions > 0
                    # Split by tier only once the load is planned: the connector knows its tiers then.
                    sources = (
                        self.connector.get_external_cache_hit_sources(request, num_external) if num_external and not preempted else None
                    )
                    stats.record(connector_queries, num_external, preempted, sources)
            if looked_up:
                mgr.record_prefix_cache_stats(request, num_hit_tokens)  # at admission, as vLLM
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if load_async:
                # Blocks held, KV on its way: it waits (holding them) until the worker reports
                # the load received, then computes the rest (vLLM's WAITING_FOR_REMOTE_KVS).
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed
                self._inflight_prefills.add(request)
                if self.events is not None:
                    self.events.emit(
                        RequestLoading(request_id=request.request_id, num_computed_tokens=num_computed, num_external_tokens=num_external)
                    )
                skip(queue)
                continue
            if encoder_inputs or duplicates:
                self._allocate_encoder_inputs(request, encoder_inputs, duplicates, plan)
            plan.encoder_budget = new_encoder_budget
            queue.pop_request()
            self.running.append(request)
            if adapter is not None:
                loras.add(adapter)
            phase = "resumed" if request.status == RequestStatus.PREEMPTED else "new"
            (plan.resumed if phase == "resumed" else plan.new).append(request)
            plan.admitted.append((request, phase))
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if num_computed + n < request.num_tokens:
                self._inflight_prefills.add(request)  # still prefilling after this chunk
            plan.num_scheduled[request.request_id] = n
            plan.computed_before[request.request_id] = num_computed
            if num_external:
                plan.external[request.request_id] = num_external
            plan.token_budget -= n

    def _get_local_prefix_cache_hit(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The waiting request's local prefix hit, as (blocks, hit tokens, shared-prefix
        boundary, hit_diverged) -- vLLM 0.33's lookup. A connector that completes divergent
        hybrid hits (``supports_divergent_local_hybrid_hits``) is given full attention's own
        hit (``get_computed_blocks_for_connector``); every other lookup is the one every
        group agrees on (``get_computed_blocks``, never diverged)."""
        connector = self.connector
        if connector is not None and getattr(connector, "supports_divergent_local_hybrid_hits", False):
            return self.kv_cache_manager.get_computed_blocks_for_connector(request, max_cache_hit_length)
        blocks, num_local = self.kv_cache_manager.get_computed_blocks(request, max_cache_hit_length)
        return blocks, num_local, request.shared_prefix_boundary, False

    def _request_remaining_blocks(self, request: Request) -> int:
        """Blocks ``request`` still needs to hold its whole sequence (vLLM's
        ``_request_remaining_blocks``)."""
        mgr = self.kv_cache_manager
        full = request.num_tokens if mgr.max_model_len is None else min(request.num_tokens, mgr.max_model_len)
        return mgr.coordinator.get_num_blocks_to_allocate(
            request.request_id,
            full,
            mgr.empty_kv_cache_blocks.blocks,
            request.num_computed_tokens,
            request.num_computed_tokens,
            full,
            apply_admission_cap=True,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
        )

    def _inflight_prefill_reserved_blocks(self) -> int:
        """The blocks the requests still prefilling need to finish (their reservation)."""
        return sum(self._request_remaining_blocks(r) for r in self._inflight_prefills)

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """Its asynchronous load has landed: cache the blocks that arrived, and set where
        computing resumes (vLLM's ``_update_waiting_for_remote_kv``). After a failed load
        only the valid prefix is cached (none: its blocks are freed, and a local hit may
        serve it on the next try); a full-prompt hit recomputes the last token, so the next
        one can be sampled."""
        rid = request.request_id
        mgr = self.kv_cache_manager
        load_failed = rid in self.failed_recving_kv_req_ids
        if load_failed:
            if request.num_computed_tokens:
                mgr.cache_blocks(request, request.num_computed_tokens)
            else:
                mgr.free(request)
            self.failed_recving_kv_req_ids.discard(rid)
        else:
            mgr.cache_blocks(request, request.num_computed_tokens)
        num_replay = self._mark_prefix_replay(
            request, request.num_computed_tokens, window_loaded=not load_failed and self._load_restores_replay_window(request)
        )
        if num_replay > 0:
            request.num_computed_tokens -= num_replay
        elif request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.discard(rid)

    def _load_restores_replay_window(self, request: Request) -> bool:
        """Whether the connector's load restores every bounded-replay window group (a
        transfer of the request's own blocks does; a store addressed by block hashes holds
        no window)."""
        assert self.connector is not None
        return bool(self.prefix_replay_group_ids) and set(self.prefix_replay_group_ids) <= set(
            self.connector.get_loaded_kv_cache_group_ids(request)
        )

    def _mark_prefix_replay(self, request: Request, num_hit_tokens: int, window_loaded: bool) -> int:
        """How many of a hit's tokens to recompute, and where that replay starts
        (``request.replay_start``): the hit's last window, whose window KV no cache holds.
        The worker rebuilds the window from them and keeps their other KV. A load that
        brought the window replays nothing."""
        if not self.prefix_replay_tokens:
            return 0
        if window_loaded:
            request.replay_start = 0
            return 0
        num_replay = min(self.prefix_replay_tokens, num_hit_tokens)
        request.replay_start = num_hit_tokens - num_replay
        return num_replay

    # -- the encoder (lesson 14) ------------------------------------------------------------------
    def _try_schedule_encoder_inputs(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, encoder_budget: int, shift_computed_tokens: int = 0
    ) -> tuple[list[int], list[int], int, int]:
        """Which of ``request``'s items must be encoded for tokens ``[num_computed_tokens,
        + num_new_tokens)``, and how many of those tokens can be scheduled (vLLM's
        ``_try_schedule_encoder_inputs``).

        An item overlapping the window is either cached already (the request just references
        it: ``check_and_update_cache``) or must be encoded -- whole, the encoder attends over
        the whole image -- if the compute budget and the cache have room. When they do not,
        the chunk stops right before the item; a request whose computed tokens already
        reach into such an item (a prefix hit that ends inside it) gets nothing this step.
        ``shift_computed_tokens``: a drafter reads this many prompt tokens past the chunk (its
        ``num_prefill_lookahead``), so an item they fall in is encoded with this chunk.
        Returns (items to encode, repeats of an item encoded this step, tokens to schedule,
        encoder budget left).
        """
        ecm = self.encoder_cache_manager
        to_schedule: list[int] = []
        duplicates: list[int] = []
        scheduled_hashes: set[str] = set()
        num_embeds_to_schedule = 0
        end = num_computed_tokens + num_new_tokens + shift_computed_tokens
        enc_dec = self.is_encoder_decoder
        for i, f in enumerate(request.mm_features):
            if enc_dec:
                # the encoder input sits before the decoder's first token: encoded with the
                # first chunk, never again (its output is cross-attention KV by then); not
                # shared, so no cache check (vLLM 0.33)
                if num_computed_tokens > 0:
                    continue
            elif f.offset >= end:
                break  # items are sorted by offset
            elif f.offset + f.length <= num_computed_tokens:
                continue  # already behind the computed tokens
            elif f.identifier in scheduled_hashes:
                duplicates.append(i)  # the same image again: encoded once
                continue
            elif ecm.check_and_update_cache(request, i):
                continue  # cached already: reuse it
            if not ecm.can_allocate(request, i, encoder_budget, num_embeds_to_schedule):
                if num_computed_tokens < f.offset:
                    # no shift here: the drafter's read-ahead into an item not encoded yet
                    # falls back to token embeddings (vLLM)
                    num_new_tokens = min(num_new_tokens, f.offset - num_computed_tokens)
                else:
                    num_new_tokens = 0
                break
            start, stop = f.get_embeds_indices_in_range(max(0, num_computed_tokens - f.offset), min(f.length, end - f.offset))
            if stop == start:
                continue  # no embedding falls in this step's tokens: nothing to encode yet
            n = f.get_num_embeds()
            num_embeds_to_schedule += n
            encoder_budget -= n
            scheduled_hashes.add(f.identifier)
            to_schedule.append(i)
        return to_schedule, duplicates, num_new_tokens, encoder_budget

    def _allocate_encoder_inputs(self, request: Request, input_ids: list[int], duplicates: list[int], plan: _StepPlan) -> None:
        ecm = self.encoder_cache_manager
        for i in input_ids:
            ecm.allocate(request, i)
        for i in duplicates:
            ecm.check_and_update_cache(request, i)
        if input_ids:
            plan.encoder_inputs[request.request_id] = list(input_ids)

    def _free_encoder_inputs(self, request: Request) -> None:
        """Drop the request's references to items its computed tokens have passed (vLLM
        does this after the step ran: the decoder has read the embeddings into its KV)."""
        ecm = self.encoder_cache_manager
        for i in sorted(ecm.get_cached_input_ids(request)):
            f = request.mm_features[i]
            # encoder-decoder: once one token is computed, the cross-attention KV holds it all
            if f.offset + f.length <= request.num_computed_tokens or (self.is_encoder_decoder and request.num_computed_tokens > 0):
                ecm.free_encoder_input(request, i)

    def _new_block_ids(self, request_id: str, sent: tuple[int, ...]) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """The ids of the blocks a running request got since ``sent`` (per group, how many the
        executor already has), and the new lengths -- in O(new blocks), not O(blocks held): a
        decode step must not cost more for a request with a long context (vLLM sends only the
        step's new blocks too, ``CachedRequestData.new_block_ids``). ``get_blocks`` hands out
        the tables themselves; only their new tails become ids."""
        tables = self.kv_cache_manager.get_blocks(request_id).blocks
        if len(tables) == 1:  # one group (most models): the same, without the per-group loops
            t = tables[0]
            return ([b.block_id for b in t[sent[0] :]],), (len(t),)
        return tuple([b.block_id for b in t[s:]] for t, s in zip(tables, sent)), tuple(len(t) for t in tables)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        mgr = self.kv_cache_manager
        num_scheduled = plan.num_scheduled
        new_data = []
        # The executor gets a request in full when it is new or resumed -- or when it may
        # not know it as it is (after a restore: no blocks sent yet): the new ones first,
        # then the resumed ones, each in admission order (vLLM 0.33 with its V2 model
        # runner, which also takes a resumed request whole).
        sent = self._num_sent_blocks
        resend = [r for r in plan.running if r.request_id not in sent]
        for r in plan.new + plan.resumed + resend:
            ids = mgr.get_block_ids(r.request_id)
            self._num_sent_blocks[r.request_id] = tuple(len(g) for g in ids)
            nc = r.num_computed_tokens
            new_data.append(
                NewRequestData(
                    req_id=r.request_id,
                    prompt_token_ids=list(r.prompt_token_ids),
                    mm_features=list(r.mm_features),
                    sampling_params=None,
                    pooling_params=None,
                    block_ids=ids,
                    num_computed_tokens=nc,
                    lora_request=r.lora_request,
                    prefill_token_ids=list(r.all_token_ids),
                    replay_start=r.replay_start,
                    new_token_ids=r.all_token_ids[nc : nc + num_scheduled[r.request_id]],
                )
            )
        cached = CachedRequestData()
        resent = set(map(id, resend))
        for r in plan.running:
            if id(r) in resent:
                continue
            delta, self._num_sent_blocks[r.request_id] = self._new_block_ids(r.request_id, self._num_sent_blocks[r.request_id])
            nc = r.num_computed_tokens
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(delta if any(delta) else None)
            cached.num_computed_tokens.append(nc)
            cached.new_token_ids.append(r.all_token_ids[nc : nc + num_scheduled[r.request_id]])
        finished, self.finished_req_ids = self.finished_req_ids, set()
        out = SchedulerOutput(
            step=self.step_count,
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_new_req_ids=[r.request_id for r in plan.new],
            scheduled_resumed_req_ids=[r.request_id for r in plan.resumed],
            scheduled_running_req_ids=[r.request_id for r in plan.running],
            preempted_req_ids={r.request_id for r in plan.preempted},
            finished_req_ids=finished,
            scheduled_encoder_inputs=plan.encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            new_block_ids_to_zero=self._get_new_block_ids_to_zero(),
            kv_cache_block_copies=self._take_kv_cache_block_copies(),
        )
        # Mamba "align" states saved this step, drained every step so no stale offer waits.
        offloads = mgr.take_boundary_state_offloads()
        if self.connector is not None:
            # Any scheduled request may become a store now (a block fills on a step that
            # allocated none), and so may a request whose state was handed off.
            req_ids = set(num_scheduled) | {rid for rid in offloads if rid in self.requests}
            out.kv_connector_block_state = KVConnectorBlockState(req_ids, mgr.get_block_ids, offloads)
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
            out.kv_connector_block_state = None  # the connector's alone: not sent to the workers
        return out

    def _take_kv_cache_block_copies(self) -> list[KVCacheBlockCopy] | None:
        """Pages the runner copies this step (copy-on-write, vLLM 0.33). The copies run with
        the step they are handed to, before anything reads or writes those blocks again, so
        the blocks they kept held are let go once that step is done: its number among the
        non-empty steps is ``sched_step_seq + 1`` (see ``defer_block_free``)."""
        copies, retained = self.kv_cache_manager.take_kv_cache_block_copies()
        if copies:
            self._free_cow_retained_blocks(retained, self.sched_step_seq + 1)
        return copies or None

    def _free_cow_retained_blocks(self, blocks: list[KVCacheBlock], fence_seq: int) -> None:
        """Give back the blocks copy-on-write copies kept held: now, unless deferring and step
        ``fence_seq`` (the one running the copies) is not processed yet -- then they wait in
        ``deferred_frees``, reversed, as vLLM keeps them (the drain frees them reversed again:
        in the order given)."""
        if not self.defer_block_free or fence_seq <= self.processed_step_seq:
            self.kv_cache_manager.block_pool.free_blocks(blocks)
            return
        self.deferred_frees.append((fence_seq, blocks[::-1]))

    def _drain_deferred_frees(self) -> None:
        """Free the deferred blocks whose fence step has been processed, oldest first, up to
        the first that has not (fences are appended in step order)."""
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(blocks[::-1])

    def _get_new_block_ids_to_zero(self) -> list[int] | None:
        """Drained every step, so the managers' lists never grow; only zeroing reads them."""
        mgr = self.kv_cache_manager
        ids = mgr.take_new_block_ids()
        return (ids or None) if mgr.needs_kv_cache_zeroing else None

    def _mamba_block_aligned_split(
        self, request: Request, num_new_tokens: int, num_new_local_computed_tokens: int = 0, num_external_computed_tokens: int = 0
    ) -> int:
        """Cut a prefill chunk so it ends where a Mamba state can be saved: on a block
        boundary, and never past the last boundary before the prompt's final token (the
        state a later request with this prompt would start from; one block lower with
        EAGLE). With partial hits, also at the prompt's last hash boundary, where the state
        saved inside a block lets a later request hit part-way into it; and at the block
        boundary before a shared-prefix junction. The prompt's last chunk may end anywhere.

        vLLM 0.33's call shape and inputs: the chunk starts after the request's computed
        tokens plus this step's new local and external hits, and the method reads only the
        scheduler's settings (``cache_config.block_size``, ``hash_block_size``,
        ``use_eagle_block_drop``, ...), never the manager -- vLLM's own tests call it with a
        stand-in ``self`` that carries just those."""
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        bs = self.cache_config.block_size
        eagle, la, hash_bs = self.use_eagle_block_drop, self.num_hash_lookahead_tokens, self.hash_block_size
        last_cache_position = get_mamba_prefill_checkpoint_position(request.num_tokens, bs, eagle, la)
        end = start + num_new_tokens
        # A chunk that reaches the prefill's end and can export the prompt's state from
        # inside needs no stop for it (one forward pass fewer).
        checkpoint_position = get_mamba_prefill_checkpoint_position(prefill_end, hash_bs if self.mamba_partial_cache_hit else bs, eagle, la)
        internal = (
            self.mamba_has_prefill_checkpoint_blocks
            and end >= prefill_end
            and is_mamba_prefill_checkpoint_valid(start, end, checkpoint_position, hash_bs, bs, self.mamba_prefill_checkpoint_alignment)
        )
        if internal:
            last_cache_position = 0
        if end < prefill_end:
            limit = self.max_num_scheduled_tokens
            threshold = self.scheduler_config.long_prefill_token_threshold
            if threshold > 0:
                limit = min(limit, threshold)
            aligned_end = end // bs * bs
            if aligned_end > start or bs <= limit:
                end = aligned_end
        tail = (
            get_mamba_prefill_checkpoint_position(request.num_prompt_tokens, hash_bs, eagle, la)
            if self.mamba_partial_cache_hit and not internal
            else 0
        )
        # A shared-prefix junction the lookup found (a longer prefix one group had cached
        # and the Mamba group had not): the chunk stops at the last block boundary before
        # it, so the state there is saved and a sibling request with that prefix can start
        # from it (vLLM 0.33). Opted in, it stops at the junction itself, inside a block.
        junction = request.shared_prefix_boundary
        if self.mamba_shared_prefix_checkpoint and junction <= request.num_prompt_tokens:
            junction_stop = junction
        else:
            junction_stop = start + (junction - start) // bs * bs
        stops = (
            (start // bs + 1) * bs if start % bs and not internal else 0,
            last_cache_position,
            tail if last_cache_position < tail < request.num_prompt_tokens else 0,
            junction_stop if start < junction < end else 0,
        )
        end = min((x for x in stops if start < x < end), default=end)
        return max(end - start, 0)

    @property
    def cache_config(self) -> SimpleNamespace:
        """The ``CacheConfig`` fields vLLM's scheduler reads, as a read-only view:
        ``block_size`` (the Mamba group's when there is one in "align" mode: the block its
        states are saved on; otherwise the scheduler's block) and ``enable_prefix_caching``."""
        return SimpleNamespace(block_size=self._cache_block_size, enable_prefix_caching=self.kv_cache_manager.enable_caching)

    @property
    def scheduler_config(self) -> SimpleNamespace:
        """The ``SchedulerConfig`` fields vLLM's scheduler reads, as a read-only view of this
        scheduler's own settings (set them on the scheduler, not here)."""
        return SimpleNamespace(
            max_num_batched_tokens=self.max_num_scheduled_tokens,
            max_num_seqs=self.max_num_running_reqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=self.max_model_len,
            policy=self.policy,
        )

    def select_victim(self) -> Request:
        """Which running request loses its blocks. FCFS: the most recently admitted (the
        end of ``running``); priority: the largest ``(priority, arrival_time)``, i.e. the
        least important, latest arrival. (The ``preempt_victim`` exercise swaps this.)"""
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_request(self, request: Request, for_request: Request | None) -> None:
        """Preempt ``request`` for ``for_request`` (the one that found no block), or for a
        prefix-cache reset (``for_request`` None)."""
        lost = request.num_computed_tokens
        self.kv_cache_manager.free(request)
        self._inflight_prefills.discard(request)
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._num_sent_blocks.pop(request.request_id, None)
        self.waiting.prepend_request(request)
        if self.events is not None:
            if for_request is None:
                reason = "reset_prefix_cache(reset_running_requests=True): every running request gives its blocks back"
            else:
                reason = "no free block; " + (
                    "preempted the newest running request (FCFS)"
                    if self.policy == "fcfs"
                    else "preempted the running request with the largest (priority, arrival_time)"
                )
            self.events.emit(
                RequestPreempted(
                    request_id=request.request_id,
                    reason=reason,
                    for_request_id="" if for_request is None else for_request.request_id,
                    num_computed_tokens_lost=lost,
                )
            )

    @scheduler_call(touches=lambda sched, out, *a, **k: _touched_by_output(sched, out, k.get("kv_connector_output")))
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        *,
        iteration: IterationStats | None = None,
        kv_connector_output: KVConnectorOutput | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append samples of requests whose prompt is done, and
        finish (free) requests at ``max_tokens`` or ``eos_token_id``. Returns finished ones.

        ``iteration``: the engine's facts about the step (clock, prefill/decode tokens),
        written into the step's ``StepFinished`` event beside the scheduler's own stats.
        ``kv_connector_output``: the worker-side connector's report; requests whose external
        KV failed to load recompute from the failed block (see ``kv_load_failure_policy``)
        and their output of this step is dropped; asynchronous transfers that ended are
        taken in (``finished_recving``, ``finished_sending``, ``failed_recving``).

        All or nothing: the whole output is checked first -- it must be this scheduler's
        latest ``schedule()`` output, applied once; ``sampled_token_ids`` maps scheduled
        request ids to lists of token ids (int32; numpy ints are fine) -- and nothing
        changes when it is refused (nor when something raises half way). A request aborted
        between ``schedule()`` and this call is skipped, its tokens dropped (as vLLM does).
        """
        sampled = self._check_output(scheduler_output, sampled_token_ids, iteration, kv_connector_output)
        finished = self._update_from_output(scheduler_output, sampled, iteration, kv_connector_output)
        self._pending_output = None
        self._last_applied_step = scheduler_output.step
        return finished

    def _check_output(self, out: Any, sampled_token_ids: Any, iteration: Any, kv_connector_output: Any) -> dict[str, list[int]]:
        if not isinstance(out, SchedulerOutput):
            raise TypeError(f"scheduler_output must be the SchedulerOutput of schedule(), got {type(out).__name__}")
        if out is not self._pending_output:
            step = getattr(out, "step", None)
            if self._pending_output is None and isinstance(step, int) and step <= self._last_applied_step:
                why = f"the output of step {step} was already applied; each output is applied once"
            elif self._pending_output is not None:
                why = f"it is not the latest output of this scheduler (step {self._pending_output.step} waits to be applied)"
            else:
                why = "this scheduler has no output waiting to be applied (call schedule() first)"
            raise ValueError(f"scheduler_output refused: {why}")
        if iteration is not None and not isinstance(iteration, IterationStats):
            raise TypeError(f"iteration must be None or an IterationStats, got {type(iteration).__name__}")
        if kv_connector_output is not None and not hasattr(kv_connector_output, "invalid_block_ids"):
            raise TypeError(f"kv_connector_output must be None or a KVConnectorOutput, got {type(kv_connector_output).__name__}")
        if kv_connector_output is not None and kv_connector_output.invalid_block_ids and len(self.kv_cache_manager.kv_cache_groups) > 1:
            # vLLM 0.33 raises here too (Scheduler._handle_invalid_blocks): a block id names a
            # block of the one pool, but which *group's* table lost it cannot be told from a flat
            # set, so the failed requests cannot be found.
            raise RuntimeError(
                f"kv_connector_output.invalid_block_ids {sorted(kv_connector_output.invalid_block_ids)}: block-level load "
                f"failures are not supported with {len(self.kv_cache_manager.kv_cache_groups)} KV-cache groups (as in vLLM "
                "0.33); a connector for a hybrid model must report the failed requests instead"
            )
        if kv_connector_output is not None:
            self._check_transfer_ids(kv_connector_output)
        if not isinstance(sampled_token_ids, Mapping):
            raise TypeError(f"sampled_token_ids must be a dict {{request_id: [token ids]}}, got {type(sampled_token_ids).__name__}")
        scheduled = out.num_scheduled_tokens
        clean: dict[str, list[int]] = {}
        for rid, toks in sampled_token_ids.items():
            if not isinstance(rid, str):
                raise TypeError(f"sampled_token_ids keys must be request ids (str), got {type(rid).__name__} {rid!r}")
            if rid not in scheduled:
                raise ValueError(
                    f"sampled_token_ids[{rid!r}]: request {rid!r} was not scheduled in step {out.step} (scheduled: {sorted(scheduled)})"
                )
            if not isinstance(toks, (list, tuple)):
                if isinstance(toks, (str, bytes)) or not hasattr(toks, "tolist"):
                    hint = f" (a list: [{toks!r}])" if isinstance(toks, int) or hasattr(toks, "__index__") else ""
                    raise TypeError(f"sampled_token_ids[{rid!r}] must be a list of token ids, got {type(toks).__name__} {toks!r}{hint}")
                toks = toks.tolist()  # a numpy array or a torch tensor
                if not isinstance(toks, list):
                    raise TypeError(f"sampled_token_ids[{rid!r}] must be a 1-D list of token ids, got a scalar {toks!r}")
            clean[rid] = [
                t
                if type(t) is int and MIN_TOKEN_ID <= t <= MAX_TOKEN_ID
                else check_int(f"sampled_token_ids[{rid!r}][{i}]", t, MIN_TOKEN_ID, MAX_TOKEN_ID, why=TOKEN_ID_WHY)
                for i, t in enumerate(toks)
            ]
        for rid, n in scheduled.items():
            r = self.requests.get(rid)
            if r is None or r.status != RequestStatus.RUNNING:
                continue  # aborted since it was scheduled: skipped
            # 0 is possible: a manager whose hit covers the whole prompt (no cap at num_tokens - 1,
            # the capstone's incident 2) leaves nothing to compute; the engine then says it made no progress.
            if type(n) is not int or n < 0 or r.num_computed_tokens + n > r.num_tokens:
                raise ValueError(
                    f"scheduler_output.num_scheduled_tokens[{rid!r}] = {n!r} does not fit request {rid!r} "
                    f"({r.num_computed_tokens} of {r.num_tokens} tokens computed); was the output changed?"
                )
        return clean

    def _check_transfer_ids(self, kv_out: Any) -> None:
        """The worker's transfer report names requests this scheduler can act on: a load
        received or failed for a request waiting for it (or finished meanwhile, holding its
        blocks), a send done for a finished request that kept its blocks."""
        for name in ("finished_recving", "failed_recving", "finished_sending"):
            ids = getattr(kv_out, name, None) or set()
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (set, frozenset, list, tuple)):
                raise TypeError(f"kv_connector_output.{name} must be a set of request ids, got {type(ids).__name__} {ids!r}")
            for rid in ids:
                r = self.requests.get(rid) if isinstance(rid, str) else None
                if name == "finished_sending":
                    ok = r is not None and r.is_finished()
                    want = "a finished request whose blocks wait for the send (request_finished returned True)"
                elif name == "finished_recving":
                    ok = r is not None and (r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.is_finished())
                    want = "a request waiting for its asynchronous load (WAITING_FOR_REMOTE_KVS)"
                else:
                    ok = r is not None
                    want = "a known request"
                if not ok:
                    state = "unknown" if r is None else f"status {r.status.name}"
                    raise ValueError(f"kv_connector_output.{name} names {rid!r} ({state}); it must name {want}")

    def _update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        iteration: IterationStats | None,
        kv_connector_output: KVConnectorOutput | None,
    ) -> list[Request]:
        finished: list[Request] = []
        events = self.events
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            self.processed_step_seq += 1  # this step's writes and copies are done
            self._drain_deferred_frees()
        failed: set[str] = set()  # requests whose output of this step is dropped
        failed_async: set[str] = set()  # loads that failed, under policy "fail": finished below
        if self.connector is not None and kv_connector_output is not None:
            if kv_connector_output.failed_recving:
                failed_async |= self._handle_failed_recving(kv_connector_output.failed_recving, kv_connector_output.errors)
            if kv_connector_output.invalid_block_ids:
                failed_async |= self._handle_invalid_async_loads(kv_connector_output.invalid_block_ids, kv_connector_output.errors)
                failed = self._handle_invalid_blocks(kv_connector_output.invalid_block_ids, kv_connector_output.errors)
                if self.kv_load_failure_policy == "fail":
                    failed_async |= failed
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is None or r.status != RequestStatus.RUNNING or rid in failed:
                continue
            r.num_computed_tokens += n
            if r.mm_features:
                self._free_encoder_inputs(r)
            if r.num_computed_tokens < r.num_tokens:
                continue  # a partial prefill chunk: no token yet
            new_ids = sampled_token_ids.get(rid, ())
            appended = []
            for tok in new_ids:
                r.append_output_token_ids(tok)
                appended.append(tok)
                if self._check_stop(r):
                    break
            if events is not None and appended:
                events.emit(TokensAppended(request_id=rid, token_ids=appended))
            if r.is_finished():
                finished.append(r)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            continuing = []
            for r in finished:
                reason = "stop" if r.status == RequestStatus.FINISHED_STOPPED else "length"
                if self._handle_stopped_request(r, reason):
                    self._free_request(r, reason)
                else:
                    continuing.append(r)
            if continuing:  # sessions waiting for (or given) their next chunk, holding their blocks
                kept = set(map(id, continuing))
                finished = [r for r in finished if id(r) not in kept]
                for r in continuing:
                    self.kv_holding_waiting.add_request(r)
        for rid in failed_async:  # in the set's order, as vLLM's finish_requests takes it
            r = self.requests[rid]
            self._finish_request(r, RequestStatus.FINISHED_ABORTED, "error")
            finished.append(r)
        if self.connector is not None and kv_connector_output is not None:
            # after the step's finished requests were handed over, as vLLM 0.33 does
            self._update_from_kv_xfer_finished(kv_connector_output)
        if self.connector is not None:
            # The step's connector metrics: the worker's payload, then the scheduler half's
            # (after the transfers' report, as vLLM 0.33 collects them; kvlab keeps the last
            # step's for make_stats).
            payload = kv_connector_output.kv_connector_stats if kv_connector_output is not None else None
            mine = self.connector.get_kv_connector_stats()
            if mine is not None and not mine.is_empty():
                payload = mine if payload is None else payload.aggregate(mine)
            self.kv_connector_stats = payload
        stats = self.kv_cache_manager.make_prefix_cache_stats()
        if stats is not None:
            # vLLM's counters take only lookups of never-preempted requests: a victim
            # re-hitting its own blocks is kept apart (stats.preempted_*), not exported.
            self.prefix_cache_queries += stats.queries
            self.prefix_cache_hits += stats.hits
            self.caching_metrics.observe(stats)
        if events is not None:
            s = self.make_stats()
            events.emit(
                StepFinished(
                    num_running=s.num_running_reqs,
                    num_waiting=s.num_waiting_reqs,
                    kv_cache_usage=s.kv_cache_usage,
                    num_preemptions=s.num_preemptions,
                    prefix_cache_queries=s.prefix_cache_queries,
                    prefix_cache_hits=s.prefix_cache_hits,
                    num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                    time=iteration.time if iteration else 0.0,
                    num_prefill_tokens=iteration.num_prefill_tokens if iteration else None,
                    num_decode_tokens=iteration.num_decode_tokens if iteration else None,
                )
            )
        # vLLM publishes the step's KV cache events as one batch at the end of the step.
        # kvlab stamps the batch with the engine's simulated clock when it has one (vLLM:
        # time.time()), so a recorded stream lines up with the engine's metrics.
        if self.kv_event_publisher is not None:
            kv_events = self.kv_cache_manager.take_events()
            if self.connector is not None:  # tiers' BlockStored / BlockRemoved (medium CPU, STORAGE), as vLLM
                kv_events.extend(self.connector.take_events())
            if kv_events:
                ts = iteration.time if iteration is not None else time.time()
                batch = KVEventBatch(ts=ts, events=kv_events)
                self.kv_event_publisher.publish(batch)
        return finished

    def shutdown(self) -> None:
        """Stop the KV-event publisher, then the connector (vLLM: ``Scheduler.shutdown``)."""
        stop = getattr(self.kv_event_publisher, "shutdown", None)  # a publisher may have none
        if callable(stop):
            stop()
        if self.connector is not None:
            self.connector.shutdown()

    def _load_failed(self, r: Request, block_ids: list[int], errors: dict[str, str] | None) -> None:
        """Say so in the event log: where ``r`` will compute from (or that it fails)."""
        if self.events is not None:
            self.events.emit(
                KVLoadFailed(
                    request_id=r.request_id,
                    block_ids=block_ids,
                    reason=(errors or {}).get(r.request_id, "its KV came from a failed load"),
                    recompute=self.kv_load_failure_policy == "recompute",
                    num_computed_tokens=r.num_computed_tokens,
                )
            )

    def _handle_failed_recving(self, failed_req_ids: set[str], errors: dict[str, str] | None = None) -> set[str]:
        """Asynchronous loads the worker reports failed as a whole: under policy "recompute"
        the request keeps its blocks but none of its tokens count as computed, and it
        recomputes once the load has landed; under "fail" the ids are returned, to finish
        (vLLM's ``_handle_failed_recving``)."""
        affected: set[str] = set()
        for rid in failed_req_ids:  # as given (vLLM iterates the set)
            r = self.requests.get(rid)
            if r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                affected.add(rid)
                self.num_kv_load_failures += 1
                if self.kv_load_failure_policy == "recompute":
                    r.num_computed_tokens = 0
                    self.failed_recving_kv_req_ids.add(rid)
                self._load_failed(r, [], errors)
        return set() if self.kv_load_failure_policy == "recompute" else affected

    def _handle_invalid_async_loads(self, invalid_block_ids: set[int], errors: dict[str, str] | None = None) -> set[str]:
        """Asynchronous loads with a block that failed: the computed tokens are cut at the
        first failed block, and the request recomputes from there once its load has landed
        -- or, policy "fail", the ids are returned to finish. Nothing was cached yet, so
        nothing is evicted (vLLM 0.33, for ``WAITING_FOR_REMOTE_KVS``)."""
        waiting = [r for r in self.kv_holding_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        affected, _ = self._update_requests_with_invalid_blocks(waiting, invalid_block_ids, errors)
        if self.kv_load_failure_policy == "recompute":
            self.failed_recving_kv_req_ids |= affected
            return set()
        return affected

    def _update_requests_with_invalid_blocks(
        self, requests: Iterable[Request], invalid_block_ids: set[int], errors: dict[str, str] | None
    ) -> tuple[set[str], set[int]]:
        """Cut each request's computed tokens back to its first block that failed to load --
        unless another of these requests lost that block first and recomputes it: then this
        one keeps its computed tokens (a running one loses only this step's). Counts and logs
        each affected request. Returns their ids and every block from each cut on (vLLM
        0.33's ``_update_requests_with_invalid_blocks``)."""
        bs = self.kv_cache_manager.kv_cache_groups[0].block_size
        affected: set[str] = set()
        marked: set[int] = set()  # blocks one of these requests already recomputes
        from_cut: set[int] = set()
        for r in requests:
            row = self.kv_cache_manager.get_block_ids(r.request_id)[0]
            bad: list[int] = []
            truncated = False
            for idx, bid in enumerate(row[: cdiv(r.num_computed_tokens, bs)]):  # type: ignore[arg-type]  # the manager filled in every block size
                if bid not in invalid_block_ids:
                    continue
                bad.append(bid)
                if bid in marked:
                    continue  # lost by an earlier request: that one recomputes it
                marked.add(bid)
                if not truncated:
                    truncated = True
                    r.num_computed_tokens = idx * bs  # type: ignore[operator]  # as above
                    from_cut.update(row[idx:])
            if bad:
                affected.add(r.request_id)
                self.num_kv_load_failures += 1
                self._load_failed(r, bad, errors)
        return affected, from_cut

    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """The worker's transfers that ended: a load received makes its request schedulable
        next step (or frees the blocks of one finished meanwhile); a send done frees the
        blocks its finished request kept (vLLM's ``_update_from_kv_xfer_finished``)."""
        assert self.connector is not None
        self.connector.update_connector_output(kv_connector_output)
        # In the report's own order: blocks freed here go to the free queue in it (vLLM
        # iterates its sets the same way).
        for rid in kv_connector_output.finished_recving:
            r = self.requests[rid]
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(rid)
            else:
                self._free_blocks(r)
        for rid in kv_connector_output.finished_sending:
            self._free_blocks(self.requests[rid])

    def _handle_invalid_blocks(self, invalid_block_ids: set[int], errors: dict[str, str] | None = None) -> set[str]:
        """Running requests whose computed prefix holds a block that failed to load (vLLM
        0.33's ``_handle_invalid_blocks``): their computed tokens are cut back (see
        :meth:`_update_requests_with_invalid_blocks`). Policy "recompute": each stays running
        and computes the rest next step, into the same blocks, which stay in the prefix
        cache to be rewritten (a request that hits one meanwhile reads what that step
        writes). Policy "fail": the failed blocks and every later block of their tables leave
        the prefix cache, and the requests are finished with an error (by the caller).
        Returns the ids whose output of this step is dropped."""
        affected, from_cut = self._update_requests_with_invalid_blocks(self.running, invalid_block_ids, errors)
        if affected and self.kv_load_failure_policy == "fail":
            self.kv_cache_manager.evict_blocks(from_cut)
        return affected

    def _check_stop(self, r: Request) -> bool:
        if r.num_output_tokens >= r.max_tokens or (self.max_model_len is not None and r.num_tokens >= self.max_model_len):
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if r.eos_token_id is not None and r.output_token_ids[-1] == r.eos_token_id:
            r.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _free_request(self, r: Request, finish_reason: str, delay_free_blocks: bool = False) -> None:
        """Finish ``r``: the connector hears of it first, then its blocks are freed -- unless
        a transfer still uses them (the connector sends them on, or a load is still writing
        into them): then the request stays known, holding them, until the worker reports the
        transfer done (``finished_sending`` / ``finished_recving``; vLLM 0.33)."""
        r._owner = None
        self._inflight_prefills.discard(r)
        if self.connector is not None:
            delay, r.kv_transfer_params = self._connector_finished(r)
            delay_free_blocks |= delay
        if r.mm_features:
            self.encoder_cache_manager.free(r)
        self._num_sent_blocks.pop(r.request_id, None)
        self.finished_req_ids.add(r.request_id)
        r.finish_reason = finish_reason
        if not delay_free_blocks:
            self._free_blocks(r)
        if self.events is not None:
            self.events.emit(RequestFinished(request_id=r.request_id, reason=finish_reason, num_output_tokens=r.num_output_tokens))

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Tell the connector ``request`` finished, once, before its blocks are freed: a
        producer saves or hands them off now. Returns (keep the blocks until the worker
        reports the request in ``finished_sending``, the request's ``kv_transfer_params``).

        In vLLM 0.33's order: a KV producer's connector is first offered the Mamba states
        the request saved inside blocks (``register_finished_partial_tail``; they are lost
        once the blocks are cleaned up); then the blocks that left a window are freed and
        the tables cut to the computed tokens, so the connector gets only what still
        matters. A connector for hybrid models (vLLM's ``SupportsHMA``) gets every group's
        table; another, the first group's. (kvlab's core imports no connector, so it knows
        the former by its ``request_finished_all_groups``: the one hook ``SupportsHMA`` adds.)"""
        connector = self.connector
        if connector is None:
            return False, None
        mgr = self.kv_cache_manager
        tails: list[tuple[int, int, int]] = []
        kv_transfer_config = self.vllm_config.kv_transfer_config
        if kv_transfer_config is not None and kv_transfer_config.is_kv_producer:
            tails = mgr.finalize_partial_tail_offloads(request)
        processed = max(0, request.num_computed_tokens - request.num_in_flight_tokens)  # (no step is in flight in kvlab)
        mgr.remove_skipped_blocks(request.request_id, processed, request.num_prompt_tokens)
        block_ids = mgr.get_block_ids_for_computed_tokens(request.request_id, request.num_computed_tokens)
        tail_delay = connector.register_finished_partial_tail(request, block_ids, tails) if tails else False
        all_groups = getattr(connector, "request_finished_all_groups", None)
        if callable(all_groups):
            hook, (delay, params) = "request_finished_all_groups", all_groups(request, block_ids)
        else:
            hook, (delay, params) = "request_finished", connector.request_finished(request, block_ids[0])
        for hook, value in ((hook, delay), ("register_finished_partial_tail", tail_delay)):
            if not isinstance(value, bool):
                raise TypeError(f"{type(connector).__name__}.{hook} must return a bool (keep the blocks?), got {value!r}")
        return delay or tail_delay, params

    def _free_blocks(self, r: Request) -> None:
        """Free a finished request's blocks, and forget it."""
        assert r.is_finished()
        self.kv_cache_manager.free(r)
        self.requests.pop(r.request_id, None)

    def get_kv_event_publisher_config(self) -> Any:
        """The KV-event publisher's resolved configuration (vLLM's name): None without a
        publisher, or with one that does not say."""
        get = getattr(self.kv_event_publisher, "get_publisher_config", None)
        return None if get is None else get()

    # -- metrics ------------------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            # a session between turns waits for input, not to run (vLLM counts it as skipped)
            num_waiting_reqs=len(self.waiting) + len(self.kv_holding_waiting) - self.num_waiting_for_streaming_input,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_hit_rate_window=self.caching_metrics.hit_rate,
            step=self.step_count,
            kv_connector_stats=None if self.kv_connector_stats is None else self.kv_connector_stats.to_dict(),
            **self._connector_hit_stats(),
        )

    def _connector_hit_stats(self) -> dict[str, Any]:
        """The connector's cumulative lookups and the hit tokens by tier, for ``SchedulerStats``
        (nothing without a connector)."""
        stats = self.connector_prefix_cache_stats
        if stats is None:
            return {}
        by_source = {CacheHitSource.DEVICE: self.prefix_cache_hits}
        for source, n in stats.hits_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
        return {
            "external_prefix_cache_queries": stats.queries,
            "external_prefix_cache_hits": stats.hits,
            "prompt_tokens_cached_by_source": by_source,
        }

    def check_invariants(self) -> None:
        """Manager invariants + every running request holds blocks for its computed tokens."""
        self.kv_cache_manager.check_invariants(held=[b for _, blocks in self.deferred_frees for b in blocks])
        self.encoder_cache_manager.check_invariants()
        waiting = list(self.waiting)
        holding = list(self.kv_holding_waiting)
        queued = {r.request_id for r in self.running} | {r.request_id for r in waiting} | {r.request_id for r in holding}
        assert len(queued) == len(self.running) + len(waiting) + len(holding), "a request is queued twice"
        # every known unfinished request is in exactly one queue (a request in ``requests`` but
        # in no queue would never run, and its id would be refused forever); a finished one
        # is known only while a transfer still holds its blocks
        held = {rid for rid, r in self.requests.items() if r.is_finished()}
        assert set(self.requests) - held == queued, (
            f"requests in no queue: {sorted(set(self.requests) - held - queued)}; queued but unknown: {sorted(queued - set(self.requests))}"
        )
        for r in holding:
            assert r.status in (
                RequestStatus.WAITING_FOR_REMOTE_KVS,
                RequestStatus.WAITING_FOR_STREAMING_REQ,
                RequestStatus.WAITING,
                RequestStatus.PREEMPTED,
            ), f"{r.request_id} holding blocks while waiting with status {r.status.name}"
        paused = sum(r.status == RequestStatus.WAITING_FOR_STREAMING_REQ for r in holding)
        assert paused == self.num_waiting_for_streaming_input, (
            f"{paused} sessions between turns, counted {self.num_waiting_for_streaming_input}"
        )
        # (a load that failed whole leaves it there without blocks until it is tried again)
        assert {r.request_id for r in self._inflight_prefills} <= queued, "a request still prefilling is in no queue"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"{r.request_id} in running with status {r.status.name}"
            ids = self.kv_cache_manager.get_block_ids(r.request_id)
            for spec, g in zip(self.kv_cache_manager.kv_cache_groups, ids):
                if isinstance(spec, CrossAttentionSpec):
                    continue  # it holds the encoder's tokens, not the decoder's
                if isinstance(spec, CircularBufferSpec):
                    assert len(g) == 1, f"{r.request_id}: {len(g)} ring blocks (a running request holds exactly one)"
                    continue
                bs = spec.block_size
                assert len(g) * bs >= r.num_computed_tokens, f"{r.request_id}: {len(g)} blocks of {bs} for {r.num_computed_tokens} tokens"  # type: ignore[operator]  # the manager filled in every spec's block size
                if isinstance(spec, FullAttentionSpec):
                    assert 0 not in g, f"{r.request_id}: a null block in a full-attention table {g}"
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r.request_id} waiting with status {r.status.name}"
            assert r.num_computed_tokens == 0 and not any(self.kv_cache_manager.get_block_ids(r.request_id)), (
                f"waiting {r.request_id} holds KV"
            )


def _touched_by_output(sched: Scheduler, out: Any, kv_out: Any) -> list[str]:
    """The requests ``update_from_output`` may change: those scheduled, and with a transfer
    report every running one (a failed block may sit in one not scheduled this step) and
    those holding blocks while they wait or after they finished."""
    ids = _scheduled_ids(out)
    if kv_out is not None:
        ids += [r.request_id for r in sched.running]
        ids += [r.request_id for r in sched.kv_holding_waiting]
        ids += [rid for rid, r in sched.requests.items() if r.is_finished()]
    return ids


def _scheduled_ids(out: Any) -> list[str]:
    """The requests a ``SchedulerOutput`` names (for the transaction to save before
    ``update_from_output`` changes them); nothing for what is not an output."""
    n = getattr(out, "num_scheduled_tokens", None)
    return list(n) if isinstance(n, dict) else []
