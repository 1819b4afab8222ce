"""A differential run of the schedulers: vLLM 0.33.0's ``Scheduler`` and kvlab's, driven by
the same random workloads of ordinary requests and streaming-input sessions, compared after
every step.

Each workload draws a pool (12, 16, 24 or 40 blocks of 4 tokens, prefix caching on), a token
budget per step (8, 16 or 64) and ``max_num_seqs`` (2, 3 or 8). Over 60 steps requests arrive
(some sharing a prefix); most are resumable (``resumable=True``: a session), and an open
session now and then gets its next chunk or is closed by a request that is not resumable --
while it runs, while it waits for input, or while it is preempted. Each step both schedulers
schedule, the same token is sampled for each request whose prompt is done, and then these
must be equal:

* the tokens scheduled per request,
* every request's status, computed tokens, token ids and block table,
* the number of free blocks.

One difference is by design: a session whose queued chunk could never fit the pool is ended by
kvlab at the turn's end (by kvlab's bound for any request: the blocks it may hold at once, prompt
and answer, more than the pool has); vLLM keeps it, holding its blocks, where it may never run.
The harness aborts it in vLLM too, counts it ("ended for lack of room") and ends the workload
there: vLLM frees its blocks after the step, kvlab within it, so the free queue's order differs
from then on.

``--window``: a sliding-window group (window 8) beside full attention. ``--priority``: the priority
policy, each request of priority 0, 1 or 2 (a session's chunks keep the session's).

    KVLAB_VLLM_PATH=/tmp/vtw/src:/tmp/vtw/deps python scripts/vllm_tests/differential_sessions.py [--workloads N] [--seed S]

(``run.sh`` leaves vLLM's wheel and its imports in ``src`` and ``deps`` of its folder.) Exits 1
at the first divergence, printing the workload, the step and both sides.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from dataclasses import dataclass
from typing import Any
from unittest.mock import MagicMock

for _p in reversed([p for p in os.environ.get("KVLAB_VLLM_PATH", "").split(os.pathsep) if p]):
    sys.path.insert(0, _p)
for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from kvlab.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvlab.core.sched.scheduler import Scheduler as KScheduler  # noqa: E402
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from kvlab.request import Request as KRequest  # noqa: E402

try:
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256 as v_sha256
    from vllm.v1 import kv_cache_interface as v_iface
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VRequest
    from vllm.v1.request import RequestStatus as VStatus
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as e:  # pragma: no cover - a maintainer's tool
    sys.exit(f"vLLM 0.33.0 is needed (set KVLAB_VLLM_PATH, see the docstring): {e}")

BS = 4
MAX_MODEL_LEN = 1024


WINDOW = 8


def vllm_scheduler(num_blocks: int, budget: int, seqs: int, window: bool, policy: str) -> Any:
    """vLLM's scheduler without a model: the model config stubbed (text only, no encoder)."""
    config = VllmConfig(device_config=DeviceConfig("cpu"))
    mc = config.model_config = MagicMock()
    mc.skip_tokenizer_init, mc.is_multimodal_model, mc.supports_multimodal_inputs = True, False, False
    mc.is_encoder_decoder, mc.is_diffusion, mc.enable_return_routed_experts = False, False, False
    mc.multimodal_config, mc.max_model_len = None, MAX_MODEL_LEN
    config.cache_config = MagicMock()
    config.cache_config.num_gpu_blocks, config.cache_config.enable_prefix_caching = num_blocks, True
    config.cache_config.enable_mamba_shared_prefix_checkpoint = False
    sc = config.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len, sc.policy = budget, seqs, MAX_MODEL_LEN, policy
    specs = [v_iface.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)]
    if window:
        specs.append(v_iface.SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=WINDOW))
    groups = [v_iface.KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]
    kv = v_iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return VScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
        hash_block_size=BS,
    )


def kvlab_scheduler(num_blocks: int, budget: int, seqs: int, window: bool, policy: str) -> KScheduler:
    groups: list[Any] = [FullAttentionSpec()] + ([SlidingWindowSpec(sliding_window=WINDOW)] if window else [])
    mgr = KVCacheManager(
        num_blocks=num_blocks,
        block_size=BS,
        kv_cache_groups=groups,
        max_model_len=MAX_MODEL_LEN,
        hash_algo="sha256",
        max_in_flight_tokens=budget,  # vLLM: max_concurrent_batches (1) x max_num_batched_tokens
    )
    return KScheduler(mgr, max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=MAX_MODEL_LEN, policy=policy)


@dataclass
class Counts:
    workloads: int = 0
    steps: int = 0
    requests: int = 0
    sessions: int = 0
    chunks: int = 0
    closes: int = 0
    preemptions: int = 0
    ended_for_room: int = 0


class Pair:
    """The two schedulers, fed the same calls."""

    def __init__(self, num_blocks: int, budget: int, seqs: int, window: bool, policy: str) -> None:
        self.num_blocks = num_blocks
        self.v = vllm_scheduler(num_blocks, budget, seqs, window, policy)
        self.k = kvlab_scheduler(num_blocks, budget, seqs, window, policy)
        self.clock = 0.0  # every request's arrival time, the same on both sides

    def add(self, rid: str, prompt: list[int], max_tokens: int, resumable: bool, priority: int = 0) -> bool:
        """Both, or neither: kvlab refuses a request or chunk that can never fit (vLLM would
        hold it forever); then it is not sent at all."""
        self.clock += 1.0
        try:
            self.k.add_request(
                KRequest(rid, prompt, max_tokens=max_tokens, resumable=resumable, priority=priority, arrival_time=self.clock)
            )
        except ValueError:
            return False
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        hasher = get_request_block_hasher(BS, v_sha256)
        self.v.add_request(
            VRequest(
                request_id=rid,
                priority=priority,
                arrival_time=self.clock,
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
                resumable=resumable,
            )
        )
        return True

    def step(self, token: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        out = self.v.schedule()
        ids = list(out.num_scheduled_tokens)
        # vLLM counts a step's tokens as computed when it schedules them; a request whose prompt
        # is done gets a sampled token, one still prefilling none
        done = [self.v.requests[r].num_computed_tokens >= self.v.requests[r].num_tokens for r in ids]
        self.v.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[token[r]] if d else [] for r, d in zip(ids, done)],
                logprobs=None,
                prompt_logprobs_dict={r: None for r in ids},
                pooler_output=[],
            ),
        )
        kout = self.k.schedule()
        self.k.update_from_output(kout, {r: [token[r]] for r in kout.num_scheduled_tokens})
        self.k.check_invariants()
        return dict(out.num_scheduled_tokens), dict(kout.num_scheduled_tokens)

    def end_sessions_kvlab_ended(self) -> int:
        """Abort in vLLM the sessions kvlab ended because their next chunk cannot fit."""
        ended = 0
        for rid in [r for r in self.v.requests if r not in self.k.requests]:
            r = self.v.requests[rid]
            # kvlab's bound: the most blocks a request of this many tokens may hold at once
            if self.k._blocks_needed(min(r.num_tokens + r.max_tokens - 1, MAX_MODEL_LEN)) > self.num_blocks - 1:
                self.v.finish_requests(rid, VStatus.FINISHED_ABORTED)
                ended += 1
        return ended

    @staticmethod
    def snapshot(sched: Any) -> tuple[dict[str, tuple], int]:
        mgr = sched.kv_cache_manager
        rows = {}
        for rid, r in sorted(sched.requests.items()):
            table = tuple(map(tuple, mgr.get_block_ids(rid))) if r.num_computed_tokens or r.status.name == "RUNNING" else None
            rows[rid] = (r.status.name, r.num_computed_tokens, list(r.all_token_ids), table)
        return rows, mgr.block_pool.get_num_free_blocks()


def run_workload(seed: int, counts: Counts, window: bool, policy: str) -> str | None:
    """One workload; a description of the first divergence, or None."""
    rng = random.Random(seed)
    pair = Pair(rng.choice([12, 16, 24, 40]), rng.choice([8, 16, 64]), rng.choice([2, 3, 8]), window, policy)
    prefix = [rng.randrange(1, 50) for _ in range(8)]
    sessions: set[str] = set()
    n = 0
    for t in range(60):
        if rng.random() < 0.35:
            n += 1
            resumable = rng.random() < 0.6
            shared = prefix[: rng.randrange(0, 9)] if rng.random() < 0.5 else []
            prompt = shared + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 14))]
            priority = rng.randrange(0, 3) if policy == "priority" else 0
            if pair.add(f"r{n}", prompt, rng.randrange(1, 6), resumable, priority):
                counts.requests += 1
                if resumable:
                    sessions.add(f"r{n}")
                    counts.sessions += 1
        for rid in sorted(sessions):
            if rid not in pair.k.requests:
                sessions.discard(rid)
            elif rng.random() < 0.2:
                if rng.random() < 0.25:
                    pair.add(rid, [0], 1, False)
                    sessions.discard(rid)
                    counts.closes += 1
                elif pair.add(rid, [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))], rng.randrange(1, 5), True):
                    counts.chunks += 1
        token = {r: rng.randrange(100, 200) for r in set(pair.k.requests) | set(pair.v.requests)}
        v_sched, k_sched = pair.step(token)
        counts.steps += 1
        ended = pair.end_sessions_kvlab_ended()
        v_state, k_state = pair.snapshot(pair.v), pair.snapshot(pair.k)
        if v_sched != k_sched or v_state != k_state:
            return f"workload {seed}, step {t}:\n  vLLM  {v_sched} {v_state}\n  kvlab {k_sched} {k_state}"
        if ended:
            # vLLM freed the session's blocks after the step, kvlab in it: the free queues now
            # differ in order, so the workload ends here
            counts.ended_for_room += ended
            break
    counts.preemptions += pair.k.num_preemptions
    counts.workloads += 1
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="the first workload's seed; the others follow")
    ap.add_argument("--window", action="store_true", help="a full-attention group and a sliding-window group (window 8)")
    ap.add_argument("--priority", action="store_true", help="the priority policy, requests of priority 0-2")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    init_none_hash(v_sha256)
    counts = Counts()
    for seed in range(args.seed, args.seed + args.workloads):
        diverged = run_workload(seed, counts, args.window, "priority" if args.priority else "fcfs")
        if diverged:
            print("DIVERGED at", diverged)
            return 1
    c = counts
    print(
        f"all {c.workloads} workloads agree: {c.steps:,} steps, {c.requests:,} requests ({c.sessions:,} sessions), "
        f"{c.chunks:,} chunks, {c.closes:,} closes, {c.preemptions:,} preemptions, {c.ended_for_room} sessions ended for lack of room"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
