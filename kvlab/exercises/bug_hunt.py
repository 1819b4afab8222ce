"""The bug hunt: three incidents, each a run of the engine with one planted bug from real
projects' history. The learner replays each in the Player, names the bug, then fixes one.

The bugs (the suspects below) all happened in real KV-cache code:

* ``stale_hash`` -- a reallocated block keeps its hash and its map entry, so a later lookup
  "hits" a block that now holds another prompt's tokens (kvcached issue #362: "vLLM prefix
  cache blocks keep stale block_hash after eviction"; imp issue #1301: a stale-hash cleanup
  that never runs "would serve one request's KV blocks to another request").
* ``full_hit_crash`` -- the hit is not capped at ``num_tokens - 1``: a prompt whose blocks
  are all cached leaves nothing to compute and no logits to sample from, and the request
  can never run (InfiniLM PR #381: "a 100% prefix cache hit causes an empty input_ids
  tensor, crashing"; tensai PR #221: "asking the same question twice killed the request").
* ``duplicate_overwritten`` -- the hash map holds one block per hash: caching a second
  block with the same hash (two requests computed one prefix at once) overwrites the
  first, and evicting the first then drops the entry of the second, which still holds the
  prefix (kvcached issue #401: duplicate in-flight prefixes collapsed into one entry).

Two more suspects are decoys: bugs that exist, but not in these incidents.

Everything a learner needs is in the pictures: the pool (which block holds what, and its
hash), the block tables, the hash chains and each step's events (an eviction is an event;
a missing one is a clue).
"""

from __future__ import annotations

import html
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from kvlab.core.block_pool import BlockHashToBlockMap, BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.request import Request
from kvlab.eventlog.events import EventLog, PrefixLookup

SUSPECTS: dict[str, str] = {
    "stale_hash": "a block that is reallocated keeps its old hash and map entry (no eviction happens)",
    "full_hit_crash": "a lookup may hit every token of the prompt: nothing is left to compute",
    "duplicate_overwritten": "the map keeps one block per hash: a second block with the same hash replaces the first",
    "touch_without_remove": "a hit block at ref_cnt 0 stays on the free queue and can be evicted while in use",
    "forward_free_order": "a finished request frees its blocks head first, so its prefix is evicted before its tail",
}


# --- the planted bugs -------------------------------------------------------------------------
class StaleHashPool(BlockPool):
    """Incident 1's pool."""

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        # "The block goes to a new owner; its content will be overwritten anyway."
        return False


class GreedyHitManager(KVCacheManager):
    """Incident 2's manager."""

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None) -> tuple[Any, int]:
        self._bind(request)
        max_hit = request.num_tokens  # "why recompute a token we already have?"
        blocks, n = self.coordinator.find_longest_cache_hit(request.block_hashes, max_hit)
        if self.events is not None:
            self.events.emit(
                PrefixLookup(
                    request_id=request.request_id,
                    num_tokens=request.num_tokens,
                    block_hashes=list(request.block_hashes),
                    hit_block_ids=[[b.block_id for b in g] for g in blocks],
                    num_hit_tokens=n,
                    max_hit_tokens=max_hit,
                    preempted=request.num_preemptions > 0,
                )
            )
        return self.create_kv_cache_blocks(blocks), n


class OneBlockPerHash(BlockHashToBlockMap):
    """Incident 3's hash map. Storage as kvlab's (``self._cache``: key -> a block, or a dict
    ``{block_id: block}`` once a key has several blocks); ``insert`` and ``pop`` are the
    suspects."""

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        self._cache[key] = block  # "one hash, one block: the newest copy is as good as any"

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        v = self._cache.pop(key, None)  # "the block's hash is leaving: so does its entry"
        return v if type(v) is KVCacheBlock else None


class MapPool(BlockPool):
    """A pool whose prefix-cache map is ``map_cls()`` (incident 3; the fix is plugged in here)."""

    map_cls: Callable[[], Any] = OneBlockPerHash

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cached_block_hash_to_block = self.map_cls()


def map_pool(cls: Any) -> type[MapPool]:
    return type("LearnerMapPool", (MapPool,), {"map_cls": staticmethod(cls)})


# --- the incidents ----------------------------------------------------------------------------
@dataclass
class Incident:
    number: int
    title: str
    report: str
    engine: LLMEngine
    named_steps: dict[str, int]
    start: str
    error: str = ""
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> EventLog:
        return cast(EventLog, self.engine.events)  # an incident's engine always logs events

    def show(self, **kwargs: Any) -> Any:
        """The Player on this incident's run, opened at the step the report is about."""
        from kvlab.viz.player import Player

        kwargs.setdefault("title", f"incident {self.number}: {self.title}")
        kwargs.setdefault("start", self.start)
        return Player(self.log, named_steps=self.named_steps, **kwargs)

    def __str__(self) -> str:
        text = f"Incident {self.number} — {self.title}\n{self.report}"
        if self.error:
            text += f"\nThe engine stopped with: {self.error}"
        steps = ", ".join(f"{k} (step {v})" for k, v in self.named_steps.items())
        return text + f"\nSteps worth a look: {steps}."

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "<pre style='white-space:pre-wrap;border-left:4px solid #8a6d00;padding:4px 10px'>" + html.escape(str(self)) + "</pre>"


def _mark(eng: LLMEngine, marks: dict[str, int], name: str) -> None:
    assert eng.events is not None  # an incident's engine always logs events
    marks[name] = eng.events.step + 1  # the step the next engine.step() records


def _run(eng: LLMEngine, marks: dict[str, int], name: str, *reqs: Request) -> None:
    for r in reqs:
        eng.add_request(r)
    _mark(eng, marks, name)
    eng.run(max_steps=100)


def incident_stale_hash() -> Incident:
    eng = build_engine(num_blocks=6, block_size=4, max_num_batched_tokens=32, manager_kwargs={"block_pool_cls": StaleHashPool})
    marks: dict[str, int] = {}
    doc_a = [11, 12, 13, 14, 15, 16, 17, 18]
    _run(eng, marks, "a arrives", Request("a", doc_a, max_tokens=1))
    _run(eng, marks, "b arrives", Request("b", [90 + i for i in range(14)], max_tokens=2))
    _run(eng, marks, "c arrives", Request("c", doc_a + [21, 22, 23], max_tokens=1))
    c = eng.metrics["c"]
    return Incident(
        1,
        "an answer from someone else's document",
        "Request c resends a's 8-token document with a new question. It was served 8 tokens from the cache, "
        "and answered about b's text instead of a's.",
        eng,
        marks,
        "c arrives",
        facts={"c_cached_tokens": c.num_cached_tokens},
    )


def incident_full_hit() -> Incident:
    log = EventLog()
    mgr = GreedyHitManager(num_blocks=16, block_size=4, event_log=log)
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.executor.simulated import SimulatedExecutor

    eng = LLMEngine(mgr, Scheduler(mgr, max_num_batched_tokens=32), SimulatedExecutor())
    marks: dict[str, int] = {}
    prompt = [31, 32, 33, 34, 35, 36, 37, 38]
    _run(eng, marks, "a arrives", Request("a", prompt, max_tokens=3))
    error = ""
    try:
        _run(eng, marks, "the same prompt again", Request("b", prompt, max_tokens=3))
    except RuntimeError as e:
        error = f"RuntimeError: {e}"
    return Incident(
        2,
        "the same prompt twice stops the server",
        "A user pressed 'retry': request b is exactly request a's prompt. The server never answered b, and the engine stopped.",
        eng,
        marks,
        "the same prompt again",
        error=error,
    )


def incident_duplicates(map_cls: Any = OneBlockPerHash) -> Incident:
    doc = [41, 42, 43, 44, 45, 46]
    scratch = build_engine(num_blocks=12, block_size=4, event_log=None)
    x0 = Request("x", doc, max_tokens=3)
    scratch.add_request(x0)
    scratch.run()
    said = list(x0.output_token_ids[:2])  # what x will answer first (the simulated model is deterministic)
    eng = build_engine(num_blocks=12, block_size=4, max_num_batched_tokens=64, manager_kwargs={"block_pool_cls": map_pool(map_cls)})
    marks: dict[str, int] = {}
    eng.add_request(Request("x", doc, max_tokens=3))
    _mark(eng, marks, "x starts answering")
    eng.step()
    _run(eng, marks, "y quotes x while x still answers", Request("y", doc + said + [7], max_tokens=1))
    _run(eng, marks, "a burst of other traffic", Request("d", [70 + i for i in range(36)], max_tokens=1))
    _run(eng, marks, "c asks about the same text", Request("c", doc + said + [9], max_tokens=1))
    c = eng.metrics["c"]
    return Incident(
        3,
        "a cached text recomputed",
        "Request x answered a 6-token question. Request y, sent while x was still answering, quoted the question "
        "and x's first two words. After a burst of other traffic, c asked about that same 8-token text: "
        f"only {c.num_cached_tokens} of its 8 tokens came from the cache. An engineer swears the rest was still "
        "in the pool.",
        eng,
        marks,
        "c asks about the same text",
        facts={"c_cached_tokens": c.num_cached_tokens},
    )


INCIDENTS: dict[int, tuple[Callable[[], Incident], str]] = {
    1: (incident_stale_hash, "stale_hash"),
    2: (incident_full_hit, "full_hit_crash"),
    3: (incident_duplicates, "duplicate_overwritten"),
}

# Why a wrong name does not fit an incident: what its pictures show instead.
RULED_OUT: dict[tuple[int, str], str] = {
    (1, "full_hit_crash"): "c's hit is 8 tokens of an 11-token prompt: capped correctly, and nothing crashed",
    (1, "duplicate_overwritten"): "no two blocks ever carried the same hash here: a ran alone, b and c hold other tokens",
    (1, "touch_without_remove"): "step 'c arrives' shows c's hit blocks leaving the free queue; but look at what block 2 held "
    "before that: at step 'b arrives' b was given block 2 and no block was evicted",
    (1, "forward_free_order"): "a's blocks went back tail first (2 before 1 at the tail); the trouble is what happened to "
    "block 2 when b took it -- look for an eviction event at step 'b arrives'",
    (2, "stale_hash"): "b's hit blocks really hold b's tokens (the same prompt); the problem is how many tokens were hit",
    (2, "duplicate_overwritten"): "a and b never ran at the same time, so no duplicate was made",
    (2, "touch_without_remove"): "b's hit blocks left the free queue correctly; compare b's hit with its prompt length",
    (2, "forward_free_order"): "the free order does not matter here; compare b's hit (tokens) with its prompt length",
    (3, "stale_hash"): "every reallocated block lost its hash (each has an eviction event); the block that still holds "
    "the text was never reallocated -- so why does c's lookup miss it?",
    (3, "full_hit_crash"): "nothing crashed, and c was not hit too much -- it was hit too little",
    (3, "touch_without_remove"): "no held block was ever evicted; look at which hashes two blocks shared after step 3, "
    "and what the burst of traffic evicted",
    (3, "forward_free_order"): "x and y freed tail first; one block with the text's hash is still in the pool -- "
    "why does c's lookup not find it?",
}


def incident(number: int) -> Incident:
    """Incident ``number`` (1, 2 or 3): ``print`` it for the report, ``.show()`` for the Player."""
    if number not in INCIDENTS:
        raise ValueError(f"number must be one of {sorted(INCIDENTS)}, got {number!r}")
    return INCIDENTS[number][0]()


def suspect_code(name: str) -> str:
    """The source of a planted bug's class, once you have a suspect (no peeking before!)."""
    classes = {"stale_hash": StaleHashPool, "full_hit_crash": GreedyHitManager, "duplicate_overwritten": OneBlockPerHash}
    if name not in SUSPECTS:
        raise ValueError(f"name must be one of {sorted(SUSPECTS)}, got {name!r}")
    if name not in classes:
        return f"{name}: not planted in any incident"
    return inspect.getsource(classes[name])
