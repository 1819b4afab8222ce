"""Every public entry point, fed bad input: a TypeError/ValueError that names the argument
(and what is allowed), raised before anything changes.

Each case runs in a world with state everywhere -- an engine mid-run (running and waiting
requests, cached blocks on the free queue, an event log), a stand-alone scheduler with an
output waiting to be applied, KV caches holding values -- and afterwards the full
fingerprint of all of it (tests/state_fingerprint.py: every block, table, queue, request,
counter and event) must be exactly what it was. The table is counted by entry point in
``test_the_table_covers_every_public_door`` (>= 150 cases in all).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from state_fingerprint import fingerprint

import kvlab.kernels as K  # noqa: I001  (before triton)
from kvlab import (
    BlockPool,
    FullAttentionSpec,
    KVCacheManager,
    MultiModalFeature,
    Request,
    RequestStatus,
    Scheduler,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    hash_block_tokens,
)
from kvlab.core.kv_cache_manager import KVCacheBlocks
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.engine.cost_model import CostModel
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.exercises import check
from kvlab.metrics.stats import IterationStats
from kvlab.timeline import Snapshot, Timeline, replay
from kvlab.eventlog.events import EventLog

MMF = MultiModalFeature


def world() -> SimpleNamespace:
    w = SimpleNamespace()
    eng = build_engine(num_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    eng.generate([list(range(1, 10))], max_tokens=2)  # leaves cached blocks on the free queue
    for rid, prompt in (("run1", [11] * 6), ("run2", [12] * 7), ("wait", [13] * 9)):
        eng.add_request(Request(rid, prompt, max_tokens=4))
    eng.step()
    w.eng, w.sched, w.mgr = eng, eng.scheduler, eng.kv_cache_manager
    w.pool = w.mgr.block_pool
    w.run1, w.wait = w.sched.requests["run1"], w.sched.requests["wait"]
    assert w.run1.status == RequestStatus.RUNNING and w.wait.status == RequestStatus.WAITING
    # A stand-alone scheduler whose output waits to be applied.
    m2 = KVCacheManager(num_blocks=10, block_size=4, event_log=EventLog())
    w.s2 = Scheduler(m2)
    w.a, w.b = Request("a", [1, 2, 3]), Request("b", [4, 5, 6, 7, 8])
    w.s2.add_request(w.a), w.s2.add_request(w.b)
    w.out = w.s2.schedule()
    # Kernel arguments that work (the cases spoil one of them), and caches holding values.
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(4, 2, 16, 2, 32, generator=g)
    w.rc = dict(
        key=torch.randn(3, 2, 32, generator=g),
        value=torch.randn(3, 2, 32, generator=g),
        key_cache=kv[:, 0],
        value_cache=kv[:, 1],
        slot_mapping=torch.tensor([0, 17, 33], dtype=torch.int64),
    )
    w.ua = dict(
        q=torch.randn(2, 4, 32, generator=g),
        key_cache=kv[:, 0],
        value_cache=kv[:, 1],
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 20], dtype=torch.int32),
        block_table=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        softmax_scale=32**-0.5,
        sliding_window=None,
    )
    w.kv = kv
    w.log_text = eng.events.to_json()
    w.snap_text = replay(eng.events).to_json()
    return w


def state(w: SimpleNamespace) -> tuple:
    return (
        fingerprint(w.eng, [w.run1, w.wait]),
        fingerprint(w.s2, [w.a, w.b]),
        w.kv.clone(),
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in w.rc.items()},
    )


def same_state(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and a[1] == b[1]
        and torch.equal(a[2], b[2])
        and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a[3].values(), b[3].values()))
    )


def rc(w, **bad):
    return K.reshape_and_cache(**{**w.rc, **bad})


def ua(w, **bad):
    return K.unified_attention(**{**w.ua, **bad})


def log_with(w, edit):
    """The world's saved log, edited (a JSON dict), read back."""
    import json

    d = json.loads(w.log_text)
    edit(d)
    return EventLog.from_json(json.dumps(d))


def snap_with(w, edit):
    import json

    d = json.loads(w.snap_text)
    edit(d)
    return Snapshot.from_json(json.dumps(d))


class Staged:
    """A case whose bad call needs a (legitimate) call before it: the state is taken after
    ``setup`` and must survive ``bad``."""

    def __init__(self, setup, bad) -> None:
        self.setup, self.bad = setup, bad


def _stale_hit_setup(w):
    w.stale = Request("stale", list(range(1, 10)))
    hits, n = w.mgr.get_computed_blocks(w.stale)  # the cached blocks of the generate() prompt
    assert n == 8
    w.forged = KVCacheBlocks(([hits.blocks[0][0], w.pool.blocks[19]],))  # a real hit, then a block without the hash


def _two_schedulers_setup(w):
    w.twice = Request("twice", [1, 2, 3])
    w.s2.add_request(w.twice)


def _generate_never_fits(w):
    w.eng.generate([[1, 2, 3], list(range(200))], max_tokens=4)


E_CORE, E_SCHED, E_ENGINE, E_GEN, E_KERN, E_FILES, E_CHECK = "core", "scheduler", "engine", "generate", "kernels", "files", "checkers"

CASES = [
    # --- core: Request / MultiModalFeature ----------------------------------------------------------
    (E_CORE, "Request id int", lambda w: Request(7, [1]), TypeError, "request_id must be a non-empty str"),
    (E_CORE, "Request id bytes", lambda w: Request(b"r", [1]), TypeError, "request_id"),
    (
        E_CORE,
        "Request empty prompt (refused at the scheduler)",
        lambda w: w.sched.add_request(Request("x", [])),
        ValueError,
        "prompt_token_ids must not be empty",
    ),
    (E_CORE, "Request prompt str", lambda w: Request("x", "hello"), TypeError, "prompt_token_ids must be a sequence of ints"),
    (E_CORE, "Request prompt int", lambda w: Request("x", 5), TypeError, "prompt_token_ids must be a sequence of ints"),
    (E_CORE, "Request token str", lambda w: Request("x", [1, "2"]), TypeError, r"prompt_token_ids\[1\]"),
    (
        E_CORE,
        "Request token -2**31-1",
        lambda w: Request("x", [1, -(2**31) - 1]),
        ValueError,
        r"prompt_token_ids\[1\]=-2147483649 is out of range",
    ),
    (E_CORE, "Request token 2**31", lambda w: Request("x", [2**31]), ValueError, r"prompt_token_ids\[0\].*int32"),
    (E_CORE, "Request token float", lambda w: Request("x", [1.0]), TypeError, r"prompt_token_ids\[0\]"),
    (E_CORE, "Request token bool", lambda w: Request("x", [True]), TypeError, r"prompt_token_ids\[0\].*bool"),
    (E_CORE, "Request token np.float", lambda w: Request("x", [np.float32(1)]), TypeError, r"prompt_token_ids\[0\]"),
    (E_CORE, "Request max_tokens 0", lambda w: Request("x", [1], max_tokens=0), ValueError, "max_tokens=0 is out of range"),
    (E_CORE, "Request max_tokens str", lambda w: Request("x", [1], max_tokens="4"), TypeError, "max_tokens"),
    (E_CORE, "Request eos -1", lambda w: Request("x", [1], eos_token_id=-1), ValueError, "eos_token_id"),
    (E_CORE, "Request salt bytes", lambda w: Request("x", [1], cache_salt=b"s"), TypeError, "cache_salt must be None or a non-empty str"),
    (E_CORE, "Request salt empty", lambda w: Request("x", [1], cache_salt=""), TypeError, "cache_salt"),
    (E_CORE, "Request lora int", lambda w: Request("x", [1], lora_name=3), TypeError, "lora_name"),
    (E_CORE, "Request priority float", lambda w: Request("x", [1], priority=0.5), TypeError, "priority"),
    (E_CORE, "Request arrival nan", lambda w: Request("x", [1], arrival_time=math.nan), ValueError, "arrival_time"),
    (E_CORE, "Request arrival inf", lambda w: Request("x", [1], arrival_time=math.inf), ValueError, "arrival_time"),
    (E_CORE, "Request arrival str", lambda w: Request("x", [1], arrival_time="now"), TypeError, "arrival_time"),
    (
        E_CORE,
        "Request one feature, not a list",
        lambda w: Request("x", list(range(9)), mm_features=MMF("a", 0, 2)),
        TypeError,
        r"mm_features must be None or a list of MultiModalFeature, got MultiModalFeature \(wrap a single feature in a list",
    ),
    (E_CORE, "Request feature tuple", lambda w: Request("x", list(range(9)), mm_features=[(0, 2)]), TypeError, r"mm_features\[0\]"),
    (
        E_CORE,
        "Request feature past the prompt",
        lambda w: Request("x", list(range(9)), mm_features=[MMF("a", 8, 3)]),
        ValueError,
        "mm_features",
    ),
    (
        E_CORE,
        "Request features overlap",
        lambda w: Request("x", list(range(9)), mm_features=[MMF("a", 0, 4), MMF("b", 2, 2)]),
        ValueError,
        "overlap",
    ),
    (E_CORE, "MultiModalFeature id empty", lambda w: MMF("", 0, 1), TypeError, "identifier"),
    (E_CORE, "MultiModalFeature offset -1", lambda w: MMF("a", -1, 1), ValueError, "offset"),
    (E_CORE, "MultiModalFeature length 0", lambda w: MMF("a", 0, 0), ValueError, "length"),
    (E_CORE, "append_output_token_ids 2**31", lambda w: w.run1.append_output_token_ids([2**31]), ValueError, r"token_ids\[0\]"),
    (E_CORE, "append_output_token_ids str", lambda w: w.run1.append_output_token_ids("5"), TypeError, r"token_ids\[0\]"),
    # --- core: manager / pool / hashing ----------------------------------------------------------------
    (E_CORE, "KVCacheManager num_blocks 1", lambda w: KVCacheManager(num_blocks=1), ValueError, r"num_blocks=1 is out of range.*>= 2"),
    (E_CORE, "KVCacheManager num_blocks str", lambda w: KVCacheManager(num_blocks="8"), TypeError, "num_blocks"),
    (E_CORE, "KVCacheManager block_size 0", lambda w: KVCacheManager(num_blocks=8, block_size=0), ValueError, "block_size"),
    (E_CORE, "KVCacheManager block_size float", lambda w: KVCacheManager(num_blocks=8, block_size=4.0), TypeError, "block_size"),
    (E_CORE, "KVCacheManager hash md5", lambda w: KVCacheManager(num_blocks=8, hash_algo="md5"), ValueError, "unknown hash_algo 'md5'"),
    (
        E_CORE,
        "KVCacheManager caching 1",
        lambda w: KVCacheManager(num_blocks=8, enable_caching=1),
        TypeError,
        "enable_caching must be a bool",
    ),
    (E_CORE, "KVCacheManager groups str", lambda w: KVCacheManager(num_blocks=8, kv_cache_groups="full"), TypeError, "kv_cache_groups"),
    (
        E_CORE,
        "KVCacheManager group not a spec",
        lambda w: KVCacheManager(num_blocks=8, kv_cache_groups=[3]),
        TypeError,
        r"kv_cache_groups\[0\]",
    ),
    (E_CORE, "KVCacheManager no groups", lambda w: KVCacheManager(num_blocks=8, kv_cache_groups=[]), ValueError, "at least one spec"),
    (
        E_CORE,
        "KVCacheManager event_log list",
        lambda w: KVCacheManager(num_blocks=8, event_log=[]),
        TypeError,
        "event_log must be None or an EventLog",
    ),
    (E_CORE, "KVCacheManager pool class", lambda w: KVCacheManager(num_blocks=8, block_pool_cls=dict), TypeError, "block_pool_cls"),
    (E_CORE, "KVCacheManager max_model_len 0", lambda w: KVCacheManager(num_blocks=8, max_model_len=0), ValueError, "max_model_len"),
    (E_CORE, "SlidingWindowSpec window 0", lambda w: SlidingWindowSpec(sliding_window=0), ValueError, "sliding_window"),
    (E_CORE, "FullAttentionSpec block_size str", lambda w: FullAttentionSpec(block_size="x"), TypeError, "block_size"),
    (E_CORE, "get_computed_blocks(str)", lambda w: w.mgr.get_computed_blocks("run1"), TypeError, "request must be a kvlab.Request"),
    (E_CORE, "get_computed_blocks(None)", lambda w: w.mgr.get_computed_blocks(None), TypeError, "request must be a kvlab.Request"),
    (E_CORE, "allocate_slots 0 tokens", lambda w: w.mgr.allocate_slots(w.run1, 0), ValueError, "num_new_tokens must be >= 1"),
    (E_CORE, "allocate_slots -1 tokens", lambda w: w.mgr.allocate_slots(w.run1, -1), ValueError, "num_new_tokens"),
    (E_CORE, "allocate_slots True tokens", lambda w: w.mgr.allocate_slots(w.run1, True), TypeError, "num_new_tokens"),
    (E_CORE, "allocate_slots str tokens", lambda w: w.mgr.allocate_slots(w.run1, "3"), TypeError, "num_new_tokens"),
    (
        E_CORE,
        "allocate_slots lookahead -1",
        lambda w: w.mgr.allocate_slots(w.run1, 1, num_lookahead_tokens=-1),
        ValueError,
        "num_lookahead_tokens",
    ),
    (
        E_CORE,
        "allocate_slots hits as a list",
        lambda w: w.mgr.allocate_slots(Request("h", [1, 2, 3, 4, 5]), 1, 4, [w.pool.blocks[1]]),
        TypeError,
        "new_computed_blocks must be None or the KVCacheBlocks",
    ),
    (
        E_CORE,
        "allocate_slots stale/forged hit",
        Staged(_stale_hit_setup, lambda w: w.mgr.allocate_slots(w.stale, 1, 8, w.forged)),
        ValueError,
        r"new_computed_blocks\[0\]\[1\]: block 19 no longer carries the hash",
    ),
    (
        E_CORE,
        "allocate_slots hit from another pool",
        lambda w: w.mgr.allocate_slots(Request("h", [1] * 9), 1, 4, KVCacheBlocks(([KVCacheBlock(1)],))),
        ValueError,
        r"not a block of this manager's pool",
    ),
    (
        E_CORE,
        "allocate_slots hits for running",
        lambda w: w.mgr.allocate_slots(w.run1, 1, 4, KVCacheBlocks(([w.pool.blocks[1]],))),
        ValueError,
        "already running",
    ),
    (
        E_CORE,
        "allocate_slots computed without hits",
        lambda w: w.mgr.allocate_slots(Request("h", [1] * 9), 1, 4),
        ValueError,
        "new_computed_blocks is empty",
    ),
    (
        E_CORE,
        "allocate_slots duplicate id",
        lambda w: w.mgr.allocate_slots(Request("run1", [5, 5]), 2),
        ValueError,
        "already held by another request",
    ),
    (
        E_CORE,
        "allocate_slots delay flag 1",
        lambda w: w.mgr.allocate_slots(w.run1, 1, delay_cache_blocks=1),
        TypeError,
        "delay_cache_blocks must be a bool",
    ),
    (E_CORE, "free('r')", lambda w: w.mgr.free("run1"), TypeError, "request must be a kvlab.Request, got str 'run1'"),
    (E_CORE, "free(None)", lambda w: w.mgr.free(None), TypeError, "request must be a kvlab.Request, got NoneType"),
    (E_CORE, "get_block_ids(5)", lambda w: w.mgr.get_block_ids(5), TypeError, "request_id must be a str"),
    (E_CORE, "pool get_new_blocks -1", lambda w: w.pool.get_new_blocks(-1), ValueError, "num_blocks"),
    (E_CORE, "pool get_new_blocks str", lambda w: w.pool.get_new_blocks("2"), TypeError, "num_blocks"),
    (E_CORE, "pool get_new_blocks too many", lambda w: w.pool.get_new_blocks(999), ValueError, "cannot get num_blocks = 999"),
    (
        E_CORE,
        "pool free_blocks twice",
        lambda w: w.pool.free_blocks([w.pool.blocks[w.mgr.get_block_ids("run1")[0][0]]] * 2),
        ValueError,
        "freed more often",
    ),
    (
        E_CORE,
        "pool free_blocks foreign",
        lambda w: w.pool.free_blocks([KVCacheBlock(3)]),
        ValueError,
        r"ordered_blocks\[0\] \(block 3\) is not a block of this pool",
    ),
    (E_CORE, "pool free_blocks ints", lambda w: w.pool.free_blocks([3]), TypeError, r"ordered_blocks\[0\] must be a KVCacheBlock"),
    (
        E_CORE,
        "pool touch foreign",
        lambda w: w.pool.touch([KVCacheBlock(1)]),
        ValueError,
        r"blocks\[0\] \(block 1\) is not a block of this pool",
    ),
    (E_CORE, "pool touch None", lambda w: w.pool.touch(None), TypeError, "blocks must be a list of KVCacheBlock"),
    (E_CORE, "BlockPool(1)", lambda w: BlockPool(1), ValueError, "num_blocks"),
    (
        E_CORE,
        "hash_block_tokens token str",
        lambda w: hash_block_tokens(get_hash_fn_by_name("sha256"), None, [1, "x"]),
        TypeError,
        r"curr_block_token_ids\[1\]",
    ),
    (
        E_CORE,
        "hash_block_tokens token -2**31-1",
        lambda w: hash_block_tokens(get_hash_fn_by_name("sha256"), None, [-(2**31) - 1]),
        ValueError,
        r"curr_block_token_ids\[0\]=-2147483649",
    ),
    (
        E_CORE,
        "hash_block_tokens token 2**32 xxhash",
        lambda w: hash_block_tokens(get_hash_fn_by_name("xxhash"), None, [2**32]),
        ValueError,
        r"curr_block_token_ids\[0\]",
    ),
    (
        E_CORE,
        "hash_block_tokens parent str",
        lambda w: hash_block_tokens(get_hash_fn_by_name("xxhash"), "p", [1]),
        TypeError,
        "parent_block_hash must be None or bytes",
    ),
    (
        E_CORE,
        "hash_block_tokens extra list",
        lambda w: hash_block_tokens(get_hash_fn_by_name("xxhash"), None, [1], ["k"]),
        TypeError,
        "extra_keys must be None or a tuple",
    ),
    (
        E_CORE,
        "hash_block_tokens tokens str",
        lambda w: hash_block_tokens(get_hash_fn_by_name("xxhash"), None, "123"),
        TypeError,
        "curr_block_token_ids must be a sequence",
    ),
    (
        E_CORE,
        "hash_block_tokens fn not callable",
        lambda w: hash_block_tokens("sha256", None, [1]),
        TypeError,
        "hash_fn must be a hash function",
    ),
    (E_CORE, "get_hash_fn_by_name None", lambda w: get_hash_fn_by_name(None), TypeError, "hash_algo must be a str"),
    (E_CORE, "get_hash_fn_by_name md5", lambda w: get_hash_fn_by_name("md5"), ValueError, "unknown hash_algo"),
    # --- scheduler ---------------------------------------------------------------------------------
    (E_SCHED, "Scheduler(object())", lambda w: Scheduler(object()), TypeError, "kv_cache_manager must be a KVCacheManager"),
    (E_SCHED, "Scheduler policy lifo", lambda w: Scheduler(w.mgr, policy="lifo"), ValueError, "policy must be one of"),
    (E_SCHED, "Scheduler budget 0", lambda w: Scheduler(w.mgr, max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (E_SCHED, "Scheduler seqs float", lambda w: Scheduler(w.mgr, max_num_seqs=2.5), TypeError, "max_num_seqs"),
    (
        E_SCHED,
        "Scheduler chunked str",
        lambda w: Scheduler(w.mgr, enable_chunked_prefill="yes"),
        TypeError,
        "enable_chunked_prefill must be True or False",
    ),
    (
        E_SCHED,
        "Scheduler threshold -1",
        lambda w: Scheduler(w.mgr, long_prefill_token_threshold=-1),
        ValueError,
        "long_prefill_token_threshold",
    ),
    (E_SCHED, "add_request(str)", lambda w: w.sched.add_request("r"), TypeError, "request must be a kvlab.Request"),
    (E_SCHED, "add_request duplicate id", lambda w: w.sched.add_request(Request("run1", [1])), ValueError, "'run1' was already added"),
    (E_SCHED, "add_request the same running request", lambda w: w.sched.add_request(w.run1), ValueError, "already added"),
    (E_SCHED, "add_request never fits", lambda w: w.sched.add_request(Request("big", list(range(200)))), ValueError, "can never fit"),
    (
        E_SCHED,
        "add_request queued in another scheduler",
        Staged(_two_schedulers_setup, lambda w: w.sched.add_request(w.twice)),
        ValueError,
        "'twice' is already queued in another scheduler",
    ),
    (E_SCHED, "finish_requests bytes id", lambda w: w.sched.finish_requests(b"run1"), TypeError, "request_ids must be a request id"),
    (
        E_SCHED,
        "finish_requests int id",
        lambda w: w.sched.finish_requests(["run1", 5]),
        TypeError,
        r"request_ids\[1\] must be a request id",
    ),
    (E_SCHED, "finish_requests None", lambda w: w.sched.finish_requests(None), TypeError, "request_ids"),
    (
        E_SCHED,
        "finish_requests RUNNING",
        lambda w: w.sched.finish_requests("run1", RequestStatus.RUNNING),
        ValueError,
        "status must be a finished RequestStatus, one of",
    ),
    (
        E_SCHED,
        "finish_requests WAITING",
        lambda w: w.sched.finish_requests("wait", RequestStatus.WAITING),
        ValueError,
        "status must be a finished",
    ),
    (E_SCHED, "finish_requests status int", lambda w: w.sched.finish_requests("run1", 6), ValueError, "status must be a finished"),
    (
        E_SCHED,
        "update np.int64 + int (fine) with one bad",
        lambda w: w.s2.update_from_output(w.out, {"a": [np.int64(5)], "b": [-(2**31) - 1]}),
        ValueError,
        r"sampled_token_ids\['b'\]\[0\]=-2147483649 is out of range",
    ),
    (
        E_SCHED,
        "update token 2**31",
        lambda w: w.s2.update_from_output(w.out, {"a": [2**31]}),
        ValueError,
        r"sampled_token_ids\['a'\]\[0\].*int32",
    ),
    (E_SCHED, "update token str", lambda w: w.s2.update_from_output(w.out, {"a": ["5"]}), TypeError, r"sampled_token_ids\['a'\]\[0\]"),
    (
        E_SCHED,
        "update bare int",
        lambda w: w.s2.update_from_output(w.out, {"a": 5}),
        TypeError,
        r"sampled_token_ids\['a'\] must be a list of token ids, got int 5 \(a list: \[5\]\)",
    ),
    (
        E_SCHED,
        "update bare numpy int",
        lambda w: w.s2.update_from_output(w.out, {"a": np.int64(5)}),
        TypeError,
        r"sampled_token_ids\['a'\] must be a 1-D list",
    ),
    (
        E_SCHED,
        "update unknown id",
        lambda w: w.s2.update_from_output(w.out, {"zzz": [1]}),
        ValueError,
        "request 'zzz' was not scheduled in step 1",
    ),
    (
        E_SCHED,
        "update key int",
        lambda w: w.s2.update_from_output(w.out, {1: [1]}),
        TypeError,
        "sampled_token_ids keys must be request ids",
    ),
    (E_SCHED, "update not a dict", lambda w: w.s2.update_from_output(w.out, [("a", [1])]), TypeError, "sampled_token_ids must be a dict"),
    (
        E_SCHED,
        "update output of another scheduler",
        Staged(lambda w: setattr(w, "other", w.sched.schedule()), lambda w: w.s2.update_from_output(w.other, {})),
        ValueError,
        "is not the latest output",
    ),
    (
        E_SCHED,
        "update not an output",
        lambda w: w.s2.update_from_output({"a": 3}, {}),
        TypeError,
        "scheduler_output must be the SchedulerOutput",
    ),
    (
        E_SCHED,
        "update applied twice",
        Staged(lambda w: w.s2.update_from_output(w.out, {}), lambda w: w.s2.update_from_output(w.out, {})),
        ValueError,
        "the output of step 1 was already applied",
    ),
    (
        E_SCHED,
        "update iteration bad",
        lambda w: w.s2.update_from_output(w.out, {}, iteration=3.0),
        TypeError,
        "iteration must be None or an IterationStats",
    ),
    (
        E_SCHED,
        "update output edited",
        Staged(lambda w: w.out.num_scheduled_tokens.__setitem__("a", 99), lambda w: w.s2.update_from_output(w.out, {})),
        ValueError,
        r"num_scheduled_tokens\['a'\] = 99 does not fit request 'a'",
    ),
    # --- engine ---------------------------------------------------------------------------------------
    (
        E_ENGINE,
        "LLMEngine(object())",
        lambda w: LLMEngine(object(), w.sched, SimulatedExecutor()),
        TypeError,
        "kv_cache_manager must be a KVCacheManager",
    ),
    (
        E_ENGINE,
        "LLMEngine scheduler None",
        lambda w: LLMEngine(w.mgr, None, SimulatedExecutor()),
        TypeError,
        "scheduler must be a Scheduler",
    ),
    (
        E_ENGINE,
        "LLMEngine other manager",
        lambda w: LLMEngine(w.s2.kv_cache_manager, w.sched, SimulatedExecutor()),
        ValueError,
        "different kv_cache_manager",
    ),
    (
        E_ENGINE,
        "LLMEngine executor without execute_model",
        lambda w: LLMEngine(w.mgr, w.sched, object()),
        TypeError,
        "executor must have an execute_model",
    ),
    (E_ENGINE, "LLMEngine cost model dict", lambda w: LLMEngine(w.mgr, w.sched, SimulatedExecutor(), {"a": 1}), TypeError, "cost_model"),
    (E_ENGINE, "LLMEngine tokenizer str", lambda w: LLMEngine(w.mgr, w.sched, SimulatedExecutor(), None, "gpt2"), TypeError, "tokenizer"),
    (E_ENGINE, "SimulatedExecutor vocab '5'", lambda w: SimulatedExecutor(vocab_size="5"), TypeError, "vocab_size"),
    (E_ENGINE, "SimulatedExecutor vocab 2.5", lambda w: SimulatedExecutor(vocab_size=2.5), TypeError, "vocab_size"),
    (E_ENGINE, "SimulatedExecutor vocab 1", lambda w: SimulatedExecutor(vocab_size=1), ValueError, "vocab_size"),
    (E_ENGINE, "SimulatedExecutor eos_every -1", lambda w: SimulatedExecutor(eos_every=-1), ValueError, "eos_every"),
    (E_ENGINE, "CostModel negative", lambda w: CostModel(step_overhead_s=-1), ValueError, "step_overhead_s"),
    (E_ENGINE, "CostModel nan", lambda w: CostModel(decode_s_per_token=math.nan), ValueError, "decode_s_per_token"),
    (
        E_ENGINE,
        "build_engine event_log 'yes'",
        lambda w: build_engine(event_log="yes"),
        TypeError,
        "event_log must be True, False, None or an EventLog",
    ),
    (E_ENGINE, "build_engine manager_kwargs list", lambda w: build_engine(manager_kwargs=[]), TypeError, "manager_kwargs"),
    (E_ENGINE, "build_engine num_blocks 1", lambda w: build_engine(num_blocks=1), ValueError, "num_blocks"),
    (E_ENGINE, "build_engine policy", lambda w: build_engine(policy="sjf"), ValueError, "policy"),
    (E_ENGINE, "engine.add_request(str)", lambda w: w.eng.add_request("r"), TypeError, "request must be a kvlab.Request"),
    (E_ENGINE, "engine.add_request duplicate", lambda w: w.eng.add_request(Request("wait", [1])), ValueError, "'wait' was already added"),
    (E_ENGINE, "engine.abort_request bytes", lambda w: w.eng.abort_request(b"run1"), TypeError, "request_ids"),
    (E_ENGINE, "engine.abort_request ints", lambda w: w.eng.abort_request([1, 2]), TypeError, r"request_ids\[0\]"),
    (E_ENGINE, "engine.run max_steps -1", lambda w: w.eng.run(max_steps=-1), ValueError, "max_steps"),
    (E_ENGINE, "engine.run max_steps str", lambda w: w.eng.run(max_steps="3"), TypeError, "max_steps"),
    (E_ENGINE, "run_trace str", lambda w: w.eng.run_trace("abc"), TypeError, "requests must be a list of Request"),
    (E_ENGINE, "run_trace one Request", lambda w: w.eng.run_trace(Request("t", [1])), TypeError, "requests must be a list of Request"),
    (
        E_ENGINE,
        "run_trace item not a Request",
        lambda w: w.eng.run_trace([Request("t1", [1]), [1, 2]]),
        TypeError,
        r"requests\[1\] must be a kvlab.Request",
    ),
    (
        E_ENGINE,
        "run_trace duplicate ids",
        lambda w: w.eng.run_trace([Request("t", [1]), Request("t", [2])]),
        ValueError,
        r"requests\[1\]: request id 't' appears twice",
    ),
    (
        E_ENGINE,
        "run_trace id already queued",
        lambda w: w.eng.run_trace([Request("t", [1]), Request("run2", [2])]),
        ValueError,
        "'run2' was already added",
    ),
    (
        E_ENGINE,
        "run_trace one never fits",
        lambda w: w.eng.run_trace([Request("t", [1]), Request("u", list(range(300)))]),
        ValueError,
        "can never fit",
    ),
    # --- generate -------------------------------------------------------------------------------------
    (E_GEN, "generate bare str", lambda w: w.eng.generate("hello"), TypeError, "prompts must be a list of prompts"),
    (
        E_GEN,
        "generate [1, 2, 3]",
        lambda w: w.eng.generate([1, 2, 3]),
        TypeError,
        r"prompts\[0\] must be a list of token ids or a str, got int 1 \(one prompt of token ids is generate\(\[\[1, 2, 3\]\]\)\)",
    ),
    (E_GEN, "generate None", lambda w: w.eng.generate(None), TypeError, "prompts must be a list"),
    (E_GEN, "generate bytes prompt", lambda w: w.eng.generate([b"abc"]), TypeError, r"prompts\[0\]"),
    (
        E_GEN,
        "generate str without tokenizer",
        lambda w: w.eng.generate(["hi"]),
        TypeError,
        r"prompts\[0\] is a string; string prompts need",
    ),
    (E_GEN, "generate empty prompt", lambda w: w.eng.generate([[1], []]), ValueError, "prompt_token_ids must not be empty"),
    (E_GEN, "generate bad token", lambda w: w.eng.generate([[1, -3]]), ValueError, r"prompt_token_ids\[1\]"),
    (E_GEN, "generate max_tokens 0", lambda w: w.eng.generate([[1]], max_tokens=0), ValueError, "max_tokens"),
    (E_GEN, "generate unknown kwarg", lambda w: w.eng.generate([[1]], temperature=0.5), TypeError, "temperature"),
    (E_GEN, "generate bad salt", lambda w: w.eng.generate([[1]], cache_salt=5), TypeError, "cache_salt"),
    (E_GEN, "generate a prompt that never fits (nothing queued)", _generate_never_fits, ValueError, "'gen-3' can never fit"),
    # --- kernels ------------------------------------------------------------------------------------------
    (
        E_KERN,
        "reshape_and_cache meta tensors",
        lambda w: K.reshape_and_cache(*(w.rc[k].to("meta") for k in ("key", "value", "key_cache", "value_cache", "slot_mapping"))),
        ValueError,
        "key is a meta tensor",
    ),
    (
        E_KERN,
        "reshape_and_cache key 0 heads",
        lambda w: rc(w, key=torch.zeros(3, 0, 32), value=torch.zeros(3, 0, 32)),
        ValueError,
        "key has shape .3, 0, 32.; num_kv_heads and head_dim must be >= 1",
    ),
    (
        E_KERN,
        "reshape_and_cache cache block size 0",
        lambda w: rc(w, key_cache=torch.zeros(4, 0, 2, 32), value_cache=torch.zeros(4, 0, 2, 32)),
        ValueError,
        "key_cache has block_size = 0",
    ),
    (
        E_KERN,
        "reshape_and_cache 0 blocks",
        lambda w: rc(w, key_cache=torch.zeros(0, 16, 2, 32), value_cache=torch.zeros(0, 16, 2, 32)),
        ValueError,
        "num_blocks = 0",
    ),
    (
        E_KERN,
        "reshape_and_cache slot past the end",
        lambda w: rc(w, slot_mapping=torch.tensor([0, 1, 64])),
        ValueError,
        r"slot_mapping\[2\] = 64 is outside the cache",
    ),
    (
        E_KERN,
        "reshape_and_cache two tokens one slot",
        lambda w: rc(w, slot_mapping=torch.tensor([5, 1, 5])),
        ValueError,
        "both name slot 5",
    ),
    (
        E_KERN,
        "reshape_and_cache slots int32",
        lambda w: rc(w, slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)),
        ValueError,
        "slot_mapping has dtype int32",
    ),
    (E_KERN, "reshape_and_cache key list", lambda w: rc(w, key=[[0.0]]), TypeError, "key must be a torch.Tensor"),
    (E_KERN, "reshape_and_cache value dtype", lambda w: rc(w, value=w.rc["value"].half()), ValueError, "value has dtype"),
    (
        E_KERN,
        "unified_attention meta tensors",
        lambda w: ua(w, **{k: w.ua[k].to("meta") for k in ("q", "key_cache", "value_cache", "cu_seqlens_q", "seq_lens", "block_table")}),
        ValueError,
        "q is a meta tensor",
    ),
    (E_KERN, "unified_attention q 0 heads", lambda w: ua(w, q=torch.zeros(2, 0, 32)), ValueError, "num_q_heads = 0"),
    (
        E_KERN,
        "unified_attention cache block size 0",
        lambda w: ua(w, key_cache=torch.zeros(4, 0, 2, 32), value_cache=torch.zeros(4, 0, 2, 32)),
        ValueError,
        "key_cache has block_size = 0",
    ),
    (
        E_KERN,
        "unified_attention kv heads 0",
        lambda w: ua(w, key_cache=torch.zeros(4, 16, 0, 32), value_cache=torch.zeros(4, 16, 0, 32)),
        ValueError,
        "num_kv_heads = 0",
    ),
    (
        E_KERN,
        "unified_attention block id -1",
        lambda w: ua(w, block_table=torch.tensor([[-1, 0], [2, 3]], dtype=torch.int32)),
        ValueError,
        r"block_table\[0, 0\] = -1",
    ),
    (E_KERN, "unified_attention scale 0", lambda w: ua(w, softmax_scale=0.0), ValueError, "softmax_scale"),
    (E_KERN, "unified_attention window 0", lambda w: ua(w, sliding_window=0), ValueError, "sliding_window"),
    (
        E_KERN,
        "unified_attention head_dim 24",
        lambda w: ua(w, q=torch.zeros(2, 4, 24), key_cache=torch.zeros(4, 16, 2, 24), value_cache=torch.zeros(4, 16, 2, 24)),
        ValueError,
        "head_dim 24",
    ),
    (
        E_KERN,
        "unified_attention cu_seqlens total",
        lambda w: ua(w, cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)),
        ValueError,
        r"cu_seqlens_q\[-1\]",
    ),
    # --- files -------------------------------------------------------------------------------------------
    (E_FILES, "from_json not JSON", lambda w: EventLog.from_json("{"), ValueError, "the event log is not valid JSON"),
    (E_FILES, "from_json a number", lambda w: EventLog.from_json(5), TypeError, "must be JSON text"),
    (E_FILES, "from_json a list", lambda w: EventLog.from_json("[]"), ValueError, "must be a JSON object with a 'version'"),
    (E_FILES, "from_json no version", lambda w: log_with(w, lambda d: d.pop("version")), ValueError, "has no 'version' field"),
    (
        E_FILES,
        "from_json version 2",
        lambda w: log_with(w, lambda d: d.update(version=2)),
        ValueError,
        "version 2 is not supported: this kvlab reads version 1",
    ),
    (E_FILES, "from_json version '1'", lambda w: log_with(w, lambda d: d.update(version="1")), ValueError, "version must be an int"),
    (
        E_FILES,
        "from_json unknown top field",
        lambda w: log_with(w, lambda d: d.update(extra=1)),
        ValueError,
        r"unknown field\(s\) \['extra'\]",
    ),
    (E_FILES, "from_json events not a list", lambda w: log_with(w, lambda d: d.update(events={})), ValueError, "events must be a list"),
    (E_FILES, "from_json step -1", lambda w: log_with(w, lambda d: d.update(step=-1)), ValueError, "step must be an int >= 0"),
    (
        E_FILES,
        "from_json unknown kind",
        lambda w: log_with(w, lambda d: d["events"][3].update(kind="nope")),
        ValueError,
        r"events\[3\]: unknown event kind 'nope'",
    ),
    (
        E_FILES,
        "from_json missing field",
        lambda w: log_with(w, lambda d: d["events"][0].pop("num_blocks")),
        ValueError,
        r"events\[0\] \(pool_created\) is missing field\(s\) \['num_blocks'\]",
    ),
    (
        E_FILES,
        "from_json unknown field",
        lambda w: log_with(w, lambda d: d["events"][0].update(color="red")),
        ValueError,
        r"events\[0\] \(pool_created\) has unknown field\(s\) \['color'\]",
    ),
    (
        E_FILES,
        "from_json block ids str",
        lambda w: log_with(w, lambda d: next(e for e in d["events"] if e["kind"] == "blocks_allocated").update(block_ids="1,2")),
        ValueError,
        r"\.block_ids must be a list of int",
    ),
    (
        E_FILES,
        "from_json negative block id",
        lambda w: log_with(w, lambda d: next(e for e in d["events"] if e["kind"] == "blocks_allocated")["block_ids"].__setitem__(0, -2)),
        ValueError,
        r"\.block_ids\[0\] = -2 is out of range: it must be an int >= 0",
    ),
    (
        E_FILES,
        "from_json bool as int",
        lambda w: log_with(w, lambda d: d["events"][0].update(num_blocks=True)),
        ValueError,
        r"events\[0\] \(pool_created\)\.num_blocks must be an int",
    ),
    (
        E_FILES,
        "from_json bad hex",
        lambda w: log_with(w, lambda d: next(e for e in d["events"] if e["kind"] == "block_cached").update(block_hash={"hex": "zz"})),
        ValueError,
        r"\.block_hash: 'zz' is not hexadecimal",
    ),
    (
        E_FILES,
        "from_json NaN usage",
        lambda w: EventLog.from_json(w.log_text.replace('"kv_cache_usage": 0.0', '"kv_cache_usage": NaN', 1)),
        ValueError,
        r"kv_cache_usage must be a finite number",
    ),
    (
        E_FILES,
        "from_json seq out of order",
        lambda w: log_with(w, lambda d: d["events"][2].update(seq=7)),
        ValueError,
        r"events\[2\]\.seq = 7, but it is event 2",
    ),
    (
        E_FILES,
        "from_json steps go back",
        lambda w: log_with(w, lambda d: d["events"][-1].update(step=0)),
        ValueError,
        r"steps never go back",
    ),
    (
        E_FILES,
        "from_json 10**9 blocks",
        lambda w: log_with(w, lambda d: d["events"][0].update(num_blocks=10**9)),
        ValueError,
        "more blocks than this reader allows",
    ),
    (E_FILES, "from_json max_blocks str", lambda w: EventLog.from_json(w.log_text, max_blocks="9"), TypeError, "max_blocks must be an int"),
    (E_FILES, "from_json nested too deep", lambda w: EventLog.from_json("[" * 100_000 + "]" * 100_000), ValueError, "nested too deeply"),
    (E_FILES, "load missing file", lambda w: EventLog.load("/nonexistent/kvlab-run.json"), FileNotFoundError, "kvlab-run.json"),
    (
        E_FILES,
        "to_json redact_salts 'yes'",
        lambda w: w.eng.events.to_json(redact_salts="yes"),
        TypeError,
        "redact_salts must be True or False",
    ),
    (E_FILES, "replay a JSON string", lambda w: replay(w.log_text), TypeError, "EventLog.from_json reads saved text"),
    (E_FILES, "replay a list of dicts", lambda w: replay([{"kind": "pool_created"}]), TypeError, r"log\[0\] must be an Event"),
    (E_FILES, "replay step str", lambda w: replay(w.eng.events, step="3"), TypeError, "step must be None or an int"),
    (E_FILES, "Timeline of a str", lambda w: Timeline("run.json"), TypeError, "log must be an EventLog or a list of events"),
    (E_FILES, "Timeline checkpoint 0", lambda w: Timeline(w.eng.events, checkpoint_events=0), ValueError, "checkpoint_events"),
    (
        E_FILES,
        "Snapshot.from_json no version",
        lambda w: snap_with(w, lambda d: d.pop("version")),
        ValueError,
        "the snapshot has no 'version' field",
    ),
    (
        E_FILES,
        "Snapshot.from_json version 9",
        lambda w: snap_with(w, lambda d: d.update(version=9)),
        ValueError,
        "version 9 is not supported",
    ),
    (
        E_FILES,
        "Snapshot.from_json missing blocks",
        lambda w: snap_with(w, lambda d: d.pop("blocks")),
        ValueError,
        r"the snapshot is missing field\(s\) \['blocks'\]",
    ),
    (
        E_FILES,
        "Snapshot.from_json block state",
        lambda w: snap_with(w, lambda d: d["blocks"][1].update(state="purple")),
        ValueError,
        r"blocks\[1\]\.state = 'purple'",
    ),
    (
        E_FILES,
        "Snapshot.from_json block id order",
        lambda w: snap_with(w, lambda d: d["blocks"][1].update(block_id=5)),
        ValueError,
        r"blocks\[1\]\.block_id = 5",
    ),
    (
        E_FILES,
        "Snapshot.from_json num_blocks",
        lambda w: snap_with(w, lambda d: d.update(num_blocks=99)),
        ValueError,
        "blocks has 20 entries but num_blocks = 99",
    ),
    (
        E_FILES,
        "Snapshot.from_json free queue",
        lambda w: snap_with(w, lambda d: d.update(free_queue=[0, 0])),
        ValueError,
        "free_queue must list distinct block ids",
    ),
    (
        E_FILES,
        "Snapshot.from_json unknown running",
        lambda w: snap_with(w, lambda d: d.update(running=["ghost"])),
        ValueError,
        r"running names unknown requests \['ghost'\]",
    ),
    (
        E_FILES,
        "Snapshot.from_json request key",
        lambda w: snap_with(w, lambda d: d["requests"]["run1"].update(request_id="x")),
        ValueError,
        r"requests\['run1'\]\.request_id = 'x'",
    ),
    (
        E_FILES,
        "Snapshot.from_json holder",
        lambda w: snap_with(w, lambda d: next(b for b in d["blocks"] if b["last_holder"]).update(last_holder=["x"])),
        ValueError,
        r"last_holder must be a list of 3 values",
    ),
    # --- checkers --------------------------------------------------------------------------------------
    (E_CHECK, "check(id int)", lambda w: check(3, len), TypeError, "exercise_id must be a str"),
    (E_CHECK, "check(unknown id)", lambda w: check("nope", len), ValueError, "unknown exercise_id 'nope'"),
    (E_CHECK, "check(None id)", lambda w: check(None, len), TypeError, "exercise_id must be a str"),
]


@pytest.mark.parametrize("door, case, call, exc, match", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input_names_the_argument_and_changes_nothing(door, case, call, exc, match):
    w = world()
    if isinstance(call, Staged):
        call.setup(w)
        call = call.bad
    before = state(w)
    with pytest.raises(exc, match=match):
        call(w)
    assert same_state(before, state(w)), f"{case}: the refused call changed the state"
    w.sched.check_invariants()
    w.s2.check_invariants()
    assert not w.eng.interrupted


def test_the_table_covers_every_public_door():
    doors: dict[str, int] = {}
    for door, *_ in CASES:
        doors[door] = doors.get(door, 0) + 1
    assert sum(doors.values()) >= 150, doors
    assert all(doors[d] >= 3 for d in (E_CORE, E_SCHED, E_ENGINE, E_GEN, E_KERN, E_FILES, E_CHECK)), doors


def test_numpy_ints_are_ints_at_every_door():
    i = np.int64
    r = Request("np", [i(1), np.int32(2), np.uint16(3)], max_tokens=i(2), priority=np.int8(1), eos_token_id=i(9))
    assert r.prompt_token_ids == [1, 2, 3] and all(type(t) is int for t in r.prompt_token_ids) and r.max_tokens == 2
    eng = build_engine(num_blocks=i(12), block_size=np.int32(4), max_num_batched_tokens=i(16), max_num_seqs=i(2))
    eng.add_request(r)
    eng.run(max_steps=i(50))
    assert r.is_finished()
    out = eng.generate([np.array([5, 6, 7])], max_tokens=i(2))
    assert len(out[0]) == 2
    sched = Scheduler(KVCacheManager(num_blocks=8, block_size=4))
    sched.add_request(Request("x", [1, 2]))
    so = sched.schedule()
    sched.update_from_output(so, {"x": np.array([np.int64(4)])}, iteration=IterationStats(0.0, 2, 0))
    assert sched.requests["x"].output_token_ids == [4]
    f = get_hash_fn_by_name("sha256")
    assert hash_block_tokens(f, None, [i(1), i(2)]) == hash_block_tokens(f, None, [1, 2])
    K.reshape_and_cache(
        torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16), torch.tensor([i(3)])
    )
