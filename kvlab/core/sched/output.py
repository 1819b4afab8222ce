"""What the scheduler hands the executor each step (vLLM: ``vllm/v1/core/sched/output.py``).

The executor (simulated or the real model runner) keeps per-request state between steps,
exactly as vLLM's GPU model runner does: a new or resumed request arrives whole in
``scheduled_new_reqs``; a request that keeps running arrives as a delta in
``scheduled_cached_reqs`` (the block ids appended since last step). kvlab also hands over
the token ids scheduled this step, so no executor has to mirror the sampler's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.kv_cache_utils import KVCacheBlockCopy


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has not seen since it was (re)admitted, in vLLM 0.33's field
    order (so vLLM's keyword call builds one as well). kvlab's engine keeps no sampling or
    pooling parameters on a request -- its executors only need the token ids -- so its
    scheduler leaves those two None."""

    req_id: str
    prompt_token_ids: list[int] | None
    # The request's multimodal items (identifier, offset, length): the worker needs them to
    # find each scheduled encoder input's placeholder positions (lesson 14).
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]  # one list per KV-cache group, the full table
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit)
    lora_request: Any  # the request's adapter record (Request.lora_request), or None
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    # Every token the request holds now (prompt + outputs so far), as vLLM 0.33 fills it for
    # its V2 model runner -- kvlab's shape. For a resumed request this is longer than the
    # prompt: its outputs must be recomputed too.
    prefill_token_ids: list[int] | None = None
    # DeepSeek-V4.1's bounded replay (vLLM 0.33): the tokens from here to
    # ``num_computed_tokens`` are a prefix hit scheduled again, so that the window layers
    # rebuild their KV; the other layers' cached KV for them is kept (see Request.replay_start).
    replay_start: int = 0
    # kvlab's own: the tokens to compute this step, so no executor has to mirror the sampler.
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        """Every token the request holds now: ``prefill_token_ids``, or the prompt alone when
        the scheduler did not fill them (vLLM's V1 model runner)."""
        if self.prefill_token_ids is not None:
            return self.prefill_token_ids
        return list(self.prompt_token_ids or ())

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return 0 if self.prompt_embeds is None else int(self.prompt_embeds.shape[0])


@dataclass(slots=True)
class CachedRequestData:
    """Running requests, as parallel lists (vLLM keeps them columnar too)."""

    req_ids: list[str] = field(default_factory=list)
    # Block ids appended to each group's table since the last step (None: nothing new).
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM 0.33's V1 model runner gets a resumed request here, its whole table as "new" block
    # ids; with its V2 runner -- kvlab's shape -- a resumed request comes whole among the new
    # ones (``scheduled_new_reqs``), so this set stays empty.
    resumed_req_ids: set[str] = field(default_factory=set)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class KVConnectorBlockState:
    """What the scheduler shows a producer-side KV connector of its block tables for one step
    (vLLM 0.33), never sent to the workers. ``boundary_state_offloads``: the Mamba "align"
    states saved this step, request id -> [(group id, block id, tokens the state covers)] --
    a connector that offloads them needs the exact block, which its own copy of the block
    table (appended to step by step) cannot tell it after a copy-on-write."""

    req_ids: set[str]  # the step's scheduled requests, and those with a hand-off
    resolve_block_ids: Callable[[str], tuple[list[int], ...]]  # asked only for what a connector reads
    boundary_state_offloads: dict[str, list[tuple[int, int, int]]]

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return self.resolve_block_ids(req_id) if req_id in self.req_ids else None


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # {req_id: n}, every scheduled request
    total_num_scheduled_tokens: int
    scheduled_new_req_ids: list[str]  # admitted from waiting for the first time, in order
    scheduled_resumed_req_ids: list[str]  # re-admitted after a preemption, in order
    scheduled_running_req_ids: list[str]  # already running, in order
    preempted_req_ids: set[str]
    # Requests that finished (or were aborted) since the previous step: the executor drops
    # their state. Preempted requests must be dropped too.
    finished_req_ids: set[str]
    num_common_prefix_blocks: tuple[int, ...] = ()
    # Encoder inputs to run this step, {req_id: [indices into its mm_features]}, and the
    # item hashes the encoder cache evicted, whose outputs the worker may drop (lesson 14).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # What the scheduler-side KV connector tells its worker side this step (lessons 12-13).
    kv_connector_metadata: Any = None
    # vLLM 0.33: attention blocks handed out since the last step, for the runner to zero
    # before it writes them (None: none, or the pool needs no zeroing -- see
    # KVCacheConfig.needs_kv_cache_zeroing).
    new_block_ids_to_zero: list[int] | None = None
    # vLLM 0.33: pages the runner copies before the forward pass, after zeroing (copy-on-write:
    # a hit that ended inside a block continues in its private copy). None: no copy.
    kv_cache_block_copies: list[KVCacheBlockCopy] | None = None
    # vLLM 0.33: a connector sets it when its loads must start before the forward pass rather
    # than after it (HiSparse rebinds its worker state every step).
    has_sync_kv_loads: bool = False
    # vLLM 0.33: the block state the scheduler-side connector reads in build_connector_meta;
    # cleared before the output goes to the executor.
    kv_connector_block_state: KVConnectorBlockState | None = None

    @classmethod
    def make_empty(cls, step: int = 0) -> SchedulerOutput:
        """A step that schedules nothing (vLLM's ``SchedulerOutput.make_empty``)."""
        return cls(
            step=step,
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            scheduled_new_req_ids=[],
            scheduled_resumed_req_ids=[],
            scheduled_running_req_ids=[],
            preempted_req_ids=set(),
            finished_req_ids=set(),
        )
