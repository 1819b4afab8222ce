"""A full fingerprint of an engine's (or a scheduler's, or a manager's) state, for the
all-or-nothing tests: a call that raises must leave it exactly as before.

Everything a call could change is in it: per block the ref count, hash and queue links (as
the free-queue order) and the prefix-cache map with its duplicate order; every group's
block tables and cached counts; the scheduler's queues, counters and the requests it
knows; every request's status, counters, tokens, packed tokens, block hashes, hasher and
owner; the engine's clock, metrics and finished requests; the event log (length, step and
the events themselves, as JSON dicts).
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Any

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine
from kvlab.request import Request


def pool_fingerprint(pool) -> tuple:
    q = pool.free_block_queue
    return (
        tuple((b.block_id, b.ref_cnt, b.cache_key, b.block_hash_num_tokens, b.is_null) for b in pool.blocks),
        tuple(b.block_id for b in q.get_all_free_blocks()),
        q.num_free_blocks,
        tuple(sorted((k, tuple(b.block_id for b in v)) for k, v in pool.cached_block_hash_to_block.items())),
        pool.num_evicted_blocks,
        # Links of blocks that are not free must be empty.
        tuple(b.block_id for b in pool.blocks if b.ref_cnt and (b.prev_free_block or b.next_free_block)),
        # Outside a call, the queue and the map run as the classes they were built as (the
        # journaled subclasses exist only while a transaction is open).
        type(q).__name__,
        type(pool.cached_block_hash_to_block).__name__,
    )


def request_fingerprint(r: Request) -> tuple:
    """Every attribute the request has (not a hand-kept list of them: a field added later, or
    one a connector sets, is in it too), containers by value, other objects by identity."""
    return tuple((name, _value(v)) for name, v in sorted(_attributes(r).items()))


def _attributes(obj: Any) -> dict[str, Any]:
    """Every attribute ``obj`` holds: its slots (each class's ``__slots__``) and its ``__dict__``."""
    slots = {n for c in type(obj).__mro__ for n in vars(c).get("__slots__", ()) if n not in ("__dict__", "__weakref__")}
    out = {n: getattr(obj, n) for n in slots if hasattr(obj, n)}
    out.update(getattr(obj, "__dict__", {}))
    return out


_PLAIN = frozenset({type(None), bool, int, float, str, bytes})


def _value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str, bytes, Enum)):
        return v
    if isinstance(v, bytearray):
        return bytes(v)
    if isinstance(v, (list, tuple)):
        if _PLAIN.issuperset(map(type, v)):  # a token list: its values as they are, checked in C
            return tuple(v)
        return tuple(_value(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((repr(k), _value(x)) for k, x in v.items()))
    return ("object", id(v))  # the hasher, the owning scheduler, a feature, an embeddings tensor


def manager_fingerprint(mgr: KVCacheManager) -> tuple:
    groups = []
    for m in mgr.coordinator.single_type_managers:
        groups.append(
            (
                tuple(sorted((rid, tuple(b.block_id for b in t)) for rid, t in m.req_to_blocks.items())),
                tuple(sorted(m.num_cached_block.items())),
            )
        )
    stats = mgr.prefix_cache_stats
    return (
        pool_fingerprint(mgr.block_pool),
        tuple(groups),
        tuple(sorted(mgr._requests)),
        None if stats is None else tuple(getattr(stats, f.name) for f in fields(stats)),
        mgr._txn is None,
        tuple(request_fingerprint(r) for r in sorted(mgr._requests.values(), key=lambda r: r.request_id)),
    )


LOG_EVENTS = True  # False: the log's length and step only (cheap, for long soaks)


# id(log) -> (the log, [(event, repr of its to_dict())] for a prefix of it): the sweeps take a
# fingerprint before every step, so each event is turned into its dict once, not once per step.
_LOG_MEMO: dict[int, tuple[Any, list[tuple[Any, str]]]] = {}


def log_fingerprint(log) -> tuple:
    """The log's length, step and every event as its dict. An event keeps its memoised dict
    while the same object stays at the same position (the log only appends and is cut back);
    any other event is converted afresh."""
    if log is None:
        return (None,)
    if not LOG_EVENTS:
        return (len(log), log.step)
    entry = _LOG_MEMO.get(id(log))
    if entry is None or entry[0] is not log:
        if len(_LOG_MEMO) >= 64:
            _LOG_MEMO.clear()
        entry = _LOG_MEMO[id(log)] = (log, [])
    memo = entry[1]
    events = list(log.events)
    k, n = 0, min(len(memo), len(events))
    while k < n and memo[k][0] is events[k]:
        k += 1
    del memo[k:]
    memo.extend((e, repr(e.to_dict())) for e in events[k:])
    return (len(log), log.step, tuple(r for _, r in memo))


def scheduler_fingerprint(sched: Scheduler, extra_requests=()) -> tuple:
    cm = sched.caching_metrics
    reqs = {id(r): r for r in [*sched.requests.values(), *sched.running, *sched.waiting, *extra_requests]}
    return (
        manager_fingerprint(sched.kv_cache_manager),
        tuple(r.request_id for r in sched.running),
        tuple(r.request_id for r in sched.waiting),
        tuple(sorted(sched.requests)),
        tuple(sorted(sched.finished_req_ids)),
        tuple(sorted((k, tuple(v)) for k, v in sched._num_sent_blocks.items())),
        (sched.step_count, sched.num_preemptions, sched.prefix_cache_queries, sched.prefix_cache_hits, sched._last_applied_step),
        (cm.aggregated_requests, cm.aggregated_query_total, cm.aggregated_query_hit, tuple(cm.query_queue)),
        None if sched._pending_output is None else id(sched._pending_output),
        sched._txn is None,
        type(sched.kv_event_publisher).__name__,  # not the stand-in that holds a step's batches back
        tuple(sorted((request_fingerprint(r) for r in reqs.values()), key=repr)),
        log_fingerprint(sched.events),
    )


def engine_fingerprint(eng: LLMEngine, extra_requests=()) -> tuple:
    return (
        scheduler_fingerprint(eng.scheduler, [*eng.finished.values(), *extra_requests]),
        eng.clock,
        eng._ids,
        eng._pending is None,
        tuple(sorted((rid, tuple(getattr(m, f.name) for f in fields(m))) for rid, m in eng.metrics.items())),
        tuple(eng.finished),
    )


def comparable(fp: tuple) -> tuple:
    """An engine fingerprint without the blocks already sent to the executor: after an undone
    step the engine re-sends every running request in full (the executor may have seen it)."""
    sched = fp[0]
    return (sched[:5] + sched[6:], *fp[1:])


def fingerprint(obj: Any, extra_requests=()) -> tuple:
    if isinstance(obj, LLMEngine):
        return engine_fingerprint(obj, extra_requests)
    if isinstance(obj, Scheduler):
        return scheduler_fingerprint(obj, extra_requests)
    if isinstance(obj, KVCacheManager):
        return (manager_fingerprint(obj), tuple(request_fingerprint(r) for r in extra_requests), log_fingerprint(obj.events))
    raise TypeError(type(obj).__name__)


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two fingerprints differ (for readable assertion messages)."""
    if a == b:
        return None
    if isinstance(a, tuple) and isinstance(b, tuple):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
    return f"{path}: {str(a)[:300]} != {str(b)[:300]}"
