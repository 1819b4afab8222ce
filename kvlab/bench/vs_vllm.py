"""`python -m kvlab.bench vs-vllm` -- kvlab's KV-cache core side by side with vLLM 0.33's own.

Both run the same operations on the same inputs in one process, interleaved (the order
swapped every round, so both see the same machine), timed in thread CPU time; each row
prints the two medians and kvlab/vLLM (< 1: kvlab is faster). The targets kvlab holds
itself to: every pool and manager path <= 0.8, the scheduler's step (with kvlab's
transaction on) <= 0.8, block hashing (``sha256_cbor``, ``xxhash``) <= 1.0.

The scheduler row builds vLLM's ``Scheduler`` as vLLM's own unit tests do, from a
``VllmConfig`` whose model is a folder holding only an OPT-125m ``config.json`` (written to a
temporary folder; no download, no tokenizer), so it also needs what ``vllm.config`` imports
(``pip install --target`` as below: einops, opentelemetry-api, opentelemetry-sdk, xgrammar,
llguidance, partial-json-parser, ...). Without those the other rows still run.

vLLM is not a dependency of kvlab (its wheel is large and built for CUDA), but its KV-cache
modules are plain Python and import on a CPU. If ``import vllm`` fails here, the benchmark
reads an unpacked wheel from ``KVLAB_VLLM_PATH`` (a ``os.pathsep``-separated list of
folders put in front of ``sys.path``), for example::

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm
    unzip -q /tmp/vllm/vllm-0.33.0-*.whl -x '*.so' -d /tmp/vllm/src
    pip install --target /tmp/vllm/deps --no-deps regex pydantic pydantic-core annotated-types \\
        typing-inspection transformers ...   # what `import vllm.v1.core.sched.scheduler` asks for
    KVLAB_VLLM_PATH=/tmp/vllm/src:/tmp/vllm/deps python -m kvlab.bench vs-vllm
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import get_request_block_hasher
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.transaction import checkpoint_manager, checkpoint_scheduler, release_manager, release_scheduler
from kvlab.request import Request
from kvlab.utils.hashing import get_hash_fn_by_name

BLOCK = 16  # tokens per block, both sides
RUN = 64  # blocks per pool operation
PROMPT = 256  # tokens per manager prompt

#: Rows and the most kvlab/vLLM each may take. "manager" rows run as the scheduler drives the
#: manager (inside a step's transaction); "alone" rows add a transaction per call.
TARGETS = {"pool": 0.8, "manager": 0.8, "scheduler": 0.8, "hash": 1.0, "alone": 1.0}


def load_vllm() -> tuple[SimpleNamespace | None, str]:
    """vLLM's KV-cache classes, or None and why not."""
    extra = [p for p in os.environ.get("KVLAB_VLLM_PATH", "").split(os.pathsep) if p]
    for p in reversed(extra):
        if p not in sys.path:
            sys.path.insert(0, p)
    # Offline, no telemetry; vLLM inspects the model class in a subprocess, which must find
    # the same folders.
    for k, val in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_TARGET_DEVICE": "cpu",
    }.items():
        os.environ.setdefault(k, val)
    if extra:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            extra + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q and q not in extra]
        )
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing as vhash
        from vllm.v1.core import kv_cache_utils as vutils
        from vllm.v1.core.block_pool import BlockPool as VBlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request as VRequest
    except Exception as e:  # noqa: BLE001 - any failure means: no usable vLLM here
        return None, f"{type(e).__name__}: {e}"
    try:
        from vllm import __version__ as version
    except Exception:  # noqa: BLE001
        version = "?"
    try:  # the scheduler row only: vllm.config imports much more than the KV-cache modules
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.structured_output import StructuredOutputManager

        sched = SimpleNamespace(
            CacheConfig=CacheConfig,
            ModelConfig=ModelConfig,
            SchedulerConfig=SchedulerConfig,
            VllmConfig=VllmConfig,
            Scheduler=VScheduler,
            ModelRunnerOutput=ModelRunnerOutput,
            StructuredOutputManager=StructuredOutputManager,
            why="",
        )
    except Exception as e:  # noqa: BLE001 - the other rows run without it
        sched = SimpleNamespace(why=f"{type(e).__name__}: {e}")
    return (
        SimpleNamespace(
            sched=sched,
            torch=torch,
            SamplingParams=SamplingParams,
            hashing=vhash,
            utils=vutils,
            BlockPool=VBlockPool,
            KVCacheManager=VKVCacheManager,
            FullAttentionSpec=FullAttentionSpec,
            KVCacheConfig=KVCacheConfig,
            KVCacheGroupSpec=KVCacheGroupSpec,
            Request=VRequest,
            version=version,
        ),
        "",
    )


class _Side:
    """One implementation behind the operations the rows time: kvlab's or vLLM's."""

    def __init__(self, name: str, v: SimpleNamespace | None, hash_algo: str = "sha256") -> None:
        self.name, self.v = name, v
        if v is None:
            self.hash_fn = get_hash_fn_by_name(hash_algo)
            self.hasher = get_request_block_hasher(BLOCK, self.hash_fn)
        else:
            self.hash_fn = v.hashing.get_hash_fn_by_name(hash_algo)
            v.utils.init_none_hash(self.hash_fn)
            self.hasher = v.utils.get_request_block_hasher(BLOCK, self.hash_fn)
            self.params = v.SamplingParams(max_tokens=16)

    def request(self, rid: str, tokens: list[int], hashed: bool = True) -> Any:
        hasher = self.hasher if hashed else None
        if self.v is None:
            return Request(rid, tokens, max_tokens=16, block_hasher=hasher)
        return self.v.Request(rid, tokens, self.params, None, block_hasher=hasher)

    def pool(self, num_blocks: int) -> Any:
        if self.v is None:
            return BlockPool(num_blocks, hash_block_size=BLOCK)
        return self.v.BlockPool(num_blocks, True, BLOCK)

    def manager(self, num_blocks: int) -> Any:
        if self.v is None:
            return KVCacheManager(num_blocks, BLOCK, log_stats=False, max_model_len=8192)
        v = self.v
        spec = v.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=v.torch.float16)
        cfg = v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[v.KVCacheGroupSpec(["layer.0"], spec)])
        return v.KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True)

    def lookup(self, mgr: Any, req: Any) -> tuple[Any, int]:
        out = mgr.get_computed_blocks(req)
        return out[0], out[1]  # vLLM 0.33 adds a third value (a shared-prefix boundary)


_clock = time.thread_time_ns


def _cycle(side: _Side, rounds: int) -> Callable[[], int]:
    """64 x (allocate, cache, free): every allocated block evicts a cached one."""
    pool = side.pool(RUN * 4 + 1)
    reqs = iter([side.request(f"c{i}", [i * 7919 + t for t in range(RUN * BLOCK)]) for i in range(rounds + 4)])

    def one() -> int:
        req = next(reqs)
        t0 = _clock()
        blocks = pool.get_new_blocks(RUN)
        pool.cache_full_blocks(req, blocks, 0, RUN, BLOCK, 0)
        pool.free_blocks(list(reversed(blocks)))
        return _clock() - t0

    for _ in range(4):  # warm: every block cached once, so each later allocation evicts
        one()
    one.target = pool  # type: ignore[attr-defined]  # for the tests: what the row works on
    return one


def _touch(side: _Side, held: bool) -> Callable[[], int]:
    """A prefix hit adopting 64 blocks: cached and free (they leave the queue), or held by
    another request (only their counts move). The blocks are given back untimed."""
    pool = side.pool(RUN * 2 + 1)
    blocks = pool.get_new_blocks(RUN)
    pool.cache_full_blocks(side.request("t", list(range(RUN * BLOCK))), blocks, 0, RUN, BLOCK, 0)
    if not held:
        pool.free_blocks(list(reversed(blocks)))

    def one() -> int:
        t0 = _clock()
        pool.touch(blocks)
        t = _clock() - t0
        pool.free_blocks(list(reversed(blocks)))
        return t

    one.target = (pool, blocks)  # type: ignore[attr-defined]  # as above
    return one


def _manager(side: _Side, kind: str, rounds: int, in_step: bool = False) -> Callable[[], int]:
    """One request through the manager: lookup, allocate, free. "miss": a new prompt each
    time (the pool evicts); "hit": the same prompt, its blocks cached and free; "hit held":
    the same prompt, its blocks held by another request. Hashes are computed outside the
    timing (as the engine does, when tokens arrive).

    ``in_step``: as kvlab's scheduler drives the manager -- inside the transaction its step
    has open (the changes are journaled; the checkpoint is taken and released outside the
    timing, once per step). Without it, each call is a transaction of its own, as when a
    learner calls the manager directly: kvlab's all-or-nothing guarantee, which vLLM (whose
    engine core ends its process on an exception) does not give. vLLM's side is the same
    either way."""
    mgr = side.manager(1024)
    prompt = list(range(10_000, 10_000 + PROMPT))
    if kind != "miss":
        warm = side.request("warm", prompt)
        blocks, n = side.lookup(mgr, warm)
        mgr.allocate_slots(warm, PROMPT - n, n, blocks)
        if kind == "hit":
            mgr.free(warm)
    prompts = [[i * 131 + t for t in range(PROMPT)] for i in range(rounds + 64)] if kind == "miss" else None
    reqs = iter([side.request(f"m{i}", prompts[i] if prompts else prompt) for i in range(rounds + 64)])

    step = in_step and side.v is None

    def one() -> int:
        req = next(reqs)
        cp = checkpoint_manager(mgr) if step else None
        t0 = _clock()
        blocks, n = side.lookup(mgr, req)
        mgr.allocate_slots(req, PROMPT - n, n, blocks)
        mgr.free(req)
        t = _clock() - t0
        if cp is not None:
            release_manager(mgr, cp)
        return t

    if kind == "miss":
        for _ in range(64):  # warm: the pool full of cached blocks, so misses evict
            one()
    one.target = mgr  # type: ignore[attr-defined]  # as above
    return one


def _hashing(side: _Side, rounds: int) -> Callable[[], int]:
    """The chained hashes of a 1,024-token prompt (64 blocks), as each engine hashes a
    request's tokens."""
    reqs = iter([side.request(f"h{i}", [i * 31 + t for t in range(RUN * BLOCK)], hashed=False) for i in range(rounds)])
    hasher = side.hasher

    def one() -> int:
        req = next(reqs)
        t0 = _clock()
        one.target = hasher(req)  # type: ignore[attr-defined]  # as above: the hashes
        return _clock() - t0

    return one


SCHED_REQUESTS = 200  # requests per scheduler run
SCHED_BLOCKS = 300  # 4,800 token slots for up to 64 running requests of 64-256 prompt tokens: it preempts
SCHED_MAX_TOKENS = 16
SCHED_MAX_SEQS = 64  # both schedulers: running requests at most,
SCHED_BUDGET = 2048  # tokens a step,
SCHED_MAX_MODEL_LEN = 2048  # and tokens a request
SCHED_RUNS = 5  # interleaved whole runs (medians over them)
#: OPT-125m's config.json: vLLM's ModelConfig reads a model's geometry from it (no weights,
#: no tokenizer: ``skip_tokenizer_init``).
_OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "do_layer_norm_before": True,
    "enable_bias": True,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "max_position_embeddings": 2048,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "torch_dtype": "float16",
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


def scheduler_prompts(n: int = SCHED_REQUESTS) -> list[list[int]]:
    """``n`` prompts of 64-256 tokens; request i starts with shared prefix i % 8 (32-128
    tokens, a system prompt), so later requests hit the cache."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 50_000) for _ in range(rng.randrange(32, 129))] for _ in range(8)]
    out = []
    for i in range(n):
        p = prefixes[i % len(prefixes)]
        total = rng.randrange(max(64, len(p) + 1), 257)
        out.append(p + [rng.randrange(3, 50_000) for _ in range(total - len(p))])
    return out


def _vllm_scheduler(v: SimpleNamespace, num_blocks: int) -> Any:
    """vLLM's Scheduler as its unit tests build it (``tests/v1/core/utils.py``), offline."""
    import tempfile

    s = v.sched
    folder = os.path.join(tempfile.gettempdir(), "kvlab-vs-vllm-opt125m")
    os.makedirs(folder, exist_ok=True)
    cfg = os.path.join(folder, "config.json")
    if not os.path.exists(cfg):
        with open(cfg, "w") as f:
            json.dump(_OPT_CONFIG, f)
    model = s.ModelConfig(
        model=folder, tokenizer=folder, skip_tokenizer_init=True, dtype="float16", seed=42, max_model_len=SCHED_MAX_MODEL_LEN
    )
    sched_cfg = s.SchedulerConfig(
        max_num_seqs=SCHED_MAX_SEQS,
        max_num_batched_tokens=SCHED_BUDGET,
        max_model_len=SCHED_MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = s.CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    vcfg = s.VllmConfig(scheduler_config=sched_cfg, model_config=model, cache_config=cache)
    spec = v.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=v.torch.float16)
    kv = v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[v.KVCacheGroupSpec(["layer.0"], spec)])
    cache.num_gpu_blocks = num_blocks
    return s.Scheduler(
        vllm_config=vcfg, kv_cache_config=kv, structured_output_manager=s.StructuredOutputManager(vcfg), block_size=BLOCK, log_stats=True
    )


def _token(step: int, j: int) -> int:
    return 7 + (step * 31 + j) % 40_000


def _scheduler(side: _Side, runs: int = SCHED_RUNS) -> Callable[[], int]:
    """The scheduler's step as an engine drives it: ``schedule()`` then
    ``update_from_output()`` with one sampled token per request whose prompt is done (what a
    model runner returns; a request still in prefill gets none), until all 200 requests
    have finished their 16 tokens. 64 running at most, 2,048 tokens a step, chunked prefill,
    a pool that preempts. kvlab's step runs inside its transaction (checkpoint, release), as
    in its engine. Returns the run's CPU time per step; building the scheduler and the
    requests (their hashes included) is outside the timing."""
    prompts = scheduler_prompts()
    v = side.v

    def build() -> Any:
        if v is None:
            mgr = KVCacheManager(SCHED_BLOCKS, BLOCK, max_model_len=SCHED_MAX_MODEL_LEN)
            sched = Scheduler(mgr, max_num_batched_tokens=SCHED_BUDGET, max_num_seqs=SCHED_MAX_SEQS, max_model_len=SCHED_MAX_MODEL_LEN)
            for i, p in enumerate(prompts):
                sched.add_request(Request(f"req-{i}", p, max_tokens=SCHED_MAX_TOKENS, block_hasher=mgr.request_block_hasher))
            return sched
        sched = _vllm_scheduler(v, SCHED_BLOCKS)
        params = v.SamplingParams(max_tokens=SCHED_MAX_TOKENS, ignore_eos=True)
        for i, p in enumerate(prompts):
            sched.add_request(v.Request(f"req-{i}", p, params, None, block_hasher=side.hasher))
        return sched

    def kvlab_step(sched: Scheduler, step: int) -> Any:
        cp = checkpoint_scheduler(sched)
        out = sched.schedule()
        reqs = sched.requests
        sampled = {}
        for j, (rid, n) in enumerate(out.num_scheduled_tokens.items()):
            r = reqs[rid]
            if r.num_computed_tokens + n >= r.num_tokens:
                sampled[rid] = [_token(step, j)]
        sched.update_from_output(out, sampled)
        release_scheduler(sched, cp)
        return out

    def vllm_step(sched: Any, step: int) -> Any:
        assert v is not None  # only on vLLM's side
        out = sched.schedule()
        reqs = sched.requests
        ids = list(out.num_scheduled_tokens)
        tokens = [[_token(step, j)] if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens else [] for j, rid in enumerate(ids)]
        mro = v.sched.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: j for j, rid in enumerate(ids)},
            sampled_token_ids=tokens,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        sched.update_from_output(out, mro)
        return out

    step_fn = kvlab_step if v is None else vllm_step

    def one() -> int:
        sched = build()
        total = steps = preempted = 0
        scheduled: list[int] = []
        while sched.has_unfinished_requests():
            t0 = _clock()
            out = step_fn(sched, steps)
            total += _clock() - t0
            steps += 1
            preempted += len(out.preempted_req_ids or ())
            scheduled.append(out.total_num_scheduled_tokens)
        one.target = SimpleNamespace(steps=steps, preempted=preempted, scheduled=scheduled, scheduler=sched)  # type: ignore[attr-defined]  # for the tests
        return total // steps

    return one


ROWS: list[tuple[str, str, Callable[..., Callable[[], int]], dict[str, Any]]] = [
    ("pool", "alloc + cache + free of 64 blocks, all evicting", _cycle, {"rounds": True}),
    ("pool", "touch 64 free cached blocks", _touch, {"held": False}),
    ("pool", "touch 64 blocks held by another request", _touch, {"held": True}),
    ("manager", "miss: lookup + allocate + free, 256 tokens", _manager, {"kind": "miss", "rounds": True, "in_step": True}),
    ("manager", "hit on free cached blocks, 256 tokens", _manager, {"kind": "hit", "rounds": True, "in_step": True}),
    ("manager", "hit on blocks another request holds", _manager, {"kind": "hit held", "rounds": True, "in_step": True}),
    ("alone", "miss, each call its own transaction", _manager, {"kind": "miss", "rounds": True}),
    ("alone", "hit on free cached blocks, the same", _manager, {"kind": "hit", "rounds": True}),
    ("scheduler", "step: schedule + update, 200 requests, preempting", _scheduler, {"runs": SCHED_RUNS}),
    ("hash", "sha256_cbor: 64 chained block hashes", _hashing, {"algo": "sha256_cbor", "rounds": True}),
    ("hash", "xxhash: 64 chained block hashes", _hashing, {"algo": "xxhash", "rounds": True}),
]


def run(v: SimpleNamespace, rounds: int = 200) -> list[tuple[str, str, float, float]]:
    """Every row: (kind, label, kvlab's median ns, vLLM's median ns)."""
    out = []
    for kind, label, make, kw in ROWS:
        kw = dict(kw)
        algo = kw.pop("algo", "sha256")
        if kw.pop("rounds", False):
            kw["rounds"] = rounds
        n = kw.get("runs", rounds)
        if kind == "scheduler" and v.sched.why:
            print(f"  (skipped {kind}: {label}: vLLM's scheduler does not import here: {v.sched.why})")
            continue
        sides = [_Side("kvlab", None, algo), _Side("vllm", v, algo)]
        ops = [make(s, **kw) for s in sides]
        times: list[list[int]] = [[], []]
        gc.collect()
        gc.disable()
        try:
            for r in range(n):
                order = (0, 1) if r % 2 else (1, 0)
                for i in order:
                    times[i].append(ops[i]())
        finally:
            gc.enable()
        out.append((kind, label, statistics.median(times[0]), statistics.median(times[1])))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.bench vs-vllm")
    ap.add_argument("--rounds", type=int, default=200, help="interleaved rounds per row (medians over them)")
    args = ap.parse_args(argv)
    v, why = load_vllm()
    if v is None:
        print(f"[vs-vllm] vLLM's KV-cache modules do not import here ({why}).")
        print((__doc__ or "").split("for example::", 1)[-1].rstrip())
        return
    print(f"[vs-vllm] kvlab vs vLLM {v.version} (its own code, this process), thread CPU time, median of {args.rounds} interleaved rounds")
    print(f"  {'':55s} {'kvlab':>10s} {'vLLM':>10s}  kvlab/vLLM  target")
    for kind, label, k, w in run(v, args.rounds):
        ratio = k / w
        target = TARGETS[kind]
        verdict = "met" if ratio <= target else "MISSED"
        print(f"  {kind + ': ' + label:55s} {k / 1000:8.2f}us {w / 1000:8.2f}us  {ratio:9.2f}  <= {target:.1f} {verdict}")
