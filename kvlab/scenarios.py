"""Built-in scenarios: short, deterministic engine runs that each tell one story.

Every scenario is a *real* run -- ``build_engine`` with the simulated executor, requests
added between steps exactly as a user would -- so its event log is the same kind of log
any learner's run produces, and every view and test works on it unchanged. A scenario
returns a :class:`Scenario`: the log, the engine (to keep stepping or inspect), a
description of what to watch, and ``named_steps`` that point at the moments worth seeing.
``kvlab.show(scenario)`` opens it in a Player (this module knows nothing of the views).

Prompts are short English strings tokenized with kvlab's byte tokenizer (one token per
byte), and the simulated model answers with lowercase letters, so every block in a
picture can be rendered as the characters it holds (``scenario.decode``).

>>> from kvlab.scenarios import shared_prefix
>>> sc = shared_prefix()
>>> sc.at("both freed").free_queue
[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvlab.request import Request
from kvlab.eventlog.events import EventLog, RequestPreempted, RequestScheduled
from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import Timeline
from kvlab.worker.tokenizer import ByteTokenizer

_TOKENIZER = ByteTokenizer()


class LetterExecutor(SimulatedExecutor):
    """The simulated model, answering in lowercase letters ('a'..'z').

    Only the *rendering* changes: the next token is still a fixed function of the context
    (so preempted requests recompute the same tokens), but it is a printable byte, which
    keeps block labels readable with the byte tokenizer.
    """

    def next_token(self, context: Sequence[int]) -> int:
        return ord("a") + super().next_token(context) % 26


@dataclass
class Scenario:
    """One finished scenario run.

    ``named_steps`` maps a short name to a step number, in story order; ``at(name)`` gives
    the snapshot there. ``decode`` renders one token id as text (pass it to the views).
    """

    name: str
    description: str
    engine: LLMEngine
    named_steps: dict[str, int]
    decode: Callable[[int], str] = _TOKENIZER.token_to_text
    notes: dict[str, str] = field(default_factory=dict)
    _timeline: Timeline | None = field(default=None, repr=False)

    @property
    def log(self) -> EventLog:
        log = self.engine.events
        assert log is not None, "scenarios always run with an event log"
        return log

    def timeline(self) -> Timeline:
        """Snapshots of every step (built once, cached)."""
        if self._timeline is None:
            self._timeline = Timeline(self.log)
        return self._timeline

    def step_of(self, name_or_step: str | int) -> int:
        if isinstance(name_or_step, int) and not isinstance(name_or_step, bool):
            return name_or_step
        try:
            return self.named_steps[name_or_step]  # type: ignore[index]  # a bool lands here too: its KeyError is reported below
        except KeyError:
            raise KeyError(f"{self.name}: no step named {name_or_step!r}; named steps are {list(self.named_steps)}") from None

    def at(self, name_or_step: str | int) -> Snapshot:
        """The snapshot at a named step (or a step number)."""
        return self.timeline().at(self.step_of(name_or_step))

    def __iter__(self):
        """``log, info = scenario`` also works: the log and the scenario itself."""
        return iter((self.log, self))


class _Script:
    """Drives an engine like a user at a notebook: add requests, step, name moments."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.named: dict[str, int] = {}

    def add(self, request_id: str, text: str, *, max_tokens: int, **kwargs: Any) -> None:
        # arrival_time = the simulated clock: deterministic, and it orders priority ties.
        req = Request(request_id, _TOKENIZER.encode(text), max_tokens=max_tokens, arrival_time=self.engine.clock, **kwargs)
        self.engine.add_request(req)

    def step(self, name: str | None = None) -> int:
        step = self.engine.step().step
        if name is not None:
            self.named[name] = step
        return step

    def run(self, name: str | None = None) -> int:
        """Step until every request has finished; name the last step."""
        step = self.engine.scheduler.step_count
        while self.engine.has_unfinished_requests():
            step = self.step()
        if name is not None:
            self.named[name] = step
        return step


def _engine(num_blocks: int, block_size: int, **kwargs: Any) -> LLMEngine:
    return build_engine(num_blocks=num_blocks, block_size=block_size, executor=LetterExecutor(), tokenizer=_TOKENIZER, **kwargs)


# --------------------------------------------------------------------------------------------
SYSTEM_48 = "You are a tutor. Explain vLLM's paged KV cache.\n"  # exactly 48 bytes = 3 blocks of 16


def shared_prefix() -> Scenario:
    """vLLM's prefix-caching story, block id for block id (11 blocks of 16 tokens).

    * req0 = 48 shared tokens + 7 gets blocks 1-4 (1-3 full and cached, 4 partial);
    * req1 = the same 48 tokens + 5 hits blocks 1, 2, 3 and gets block 5 -- 1-3 are shared;
    * both finish; each frees its table tail first, so the free queue becomes
      ``[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]``: partial tails at the head (reused first),
      the cached prefix at the tail, its *last* block ahead of its first;
    * req2 hits 1-3 again (they were free but still cached) and takes block 5;
    * a 159-token request needs all 10 blocks and takes them in queue order
      ``[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]``, evicting the prefix tail first.
    """
    assert len(SYSTEM_48) == 48
    e = _engine(11, 16)
    s = _Script(e)
    s.add("req0", SYSTEM_48 + "Blocks?", max_tokens=3)
    s.step("req0 prefill")
    s.add("req1", SYSTEM_48 + "Hash?", max_tokens=3)
    s.step("req1 prefix hit")
    s.step("req0 freed")
    s.step("both freed")
    s.add("req2", SYSTEM_48 + "Evict?\n", max_tokens=2)
    s.step("req2 hit")
    s.step("req2 freed")
    s.add("long", ("Sixteen bytes!! " * 10)[:159], max_tokens=2)
    s.step("long request evicts")
    s.run("end")
    return Scenario(
        "shared_prefix",
        "Two requests share a 48-token prefix: the second hits blocks 1-3 instead of computing "
        "them. When both finish, their tails go to the head of the free queue and the cached "
        "prefix to its tail -- last block first -- so a later request still hits it, and a long "
        "request evicts it tail first.",
        e,
        s.named,
        notes={
            "req0 prefill": "req0 (55 tokens) holds blocks 1-4; 1-3 are full and got hashes, 4 is partial.",
            "req1 prefix hit": "req1 hit blocks 1-3 (ref count 2: shared) and got only block 5.",
            "req0 freed": "req0 finished: its partial block 4 went to the free-queue head; 1-3 stay held by req1.",
            "both freed": "Free queue [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]: tails first, the cached prefix last.",
            "req2 hit": "req2 found blocks 1-3 on the free queue, still cached: they left the queue, ref 1.",
            "req2 freed": "The same free-queue order again.",
            "long request evicts": "159 tokens need all 10 blocks: taken in queue order, evicting 3, 2, 1 last.",
        },
    )


def eviction() -> Scenario:
    """LRU eviction of cached blocks under pressure (12 blocks of 4 tokens).

    A and B (13 tokens each) finish and leave 3 cached blocks each on the free queue, A's
    ahead of B's. C (26 tokens, 7 blocks) takes the never-used blocks and then the queue
    head: A's blocks 3 and 2 are evicted -- A's *tail* first. A2, the same prompt as A,
    then hits only block 1 and misses at its second block; its own allocation evicts B's
    tail, so B2 also hits only its first block. Eviction eats chains from the end, which is
    why what survives is always a usable prefix.
    """
    e = _engine(12, 4)
    s = _Script(e)
    a_text, b_text = "Alice: hi, why?"[:13], "Bob: tell me more"[:13]
    s.add("A", a_text, max_tokens=1)
    s.step("A cached")
    s.add("B", b_text, max_tokens=1)
    s.step("B cached")
    s.add("C", "Carol pastes a long essay....."[:26], max_tokens=2)
    s.step("C evicts A's tail")
    s.step("C freed")
    s.add("A2", a_text, max_tokens=2)
    s.step("A2 partial hit")
    s.step("A2 freed")
    s.add("B2", b_text, max_tokens=2)
    s.step("B2 partial hit")
    s.run("end")
    return Scenario(
        "eviction",
        "Cached blocks live on the free queue until the head reaches them. A's blocks were freed "
        "first, so a large request evicts them first -- tail first -- and a later copy of A "
        "hits only what survived.",
        e,
        s.named,
        notes={
            "A cached": "A finished: blocks 1-3 cached at the queue tail, partial block 4 at the head.",
            "B cached": "B's blocks 4-6 are cached behind A's.",
            "C evicts A's tail": "C took the never-used blocks, then 3 and 2: A's hashes for them are gone.",
            "A2 partial hit": "A2 hits block 1 only; its second block is the first miss. Its new blocks evict B's tail.",
            "B2 partial hit": "B2 hits its first block only.",
        },
    )


def preemption(policy: str = "fcfs") -> Scenario:
    """Preemption by recompute in a 9-block pool of 4-token blocks.

    P (12 tokens, up to 10 more) runs alone for a step; then Q (priority 0) and R (a short
    request, priority 2) arrive. Q is admitted, R waits. P and Q grow a block every 4 tokens
    until no block is left. Under ``fcfs`` the newest running request, Q, is preempted;
    under ``priority`` the one with the largest ``(priority, arrival_time)``, P (priority 1).
    The victim frees every block, loses its computed tokens and goes to the head of the
    waiting queue -- ahead of R. Its full blocks stay cached on the free queue, so when it
    resumes it hits those that were not evicted meanwhile and recomputes the rest.
    """
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
    e = _engine(9, 4, policy=policy)
    s = _Script(e)
    s.add("P", "Paul: 1 2 3 ", max_tokens=10, priority=1)
    s.step("P running")
    s.add("Q", "Quinn: a b c", max_tokens=10, priority=0)
    s.add("R", "Rita:!", max_tokens=2, priority=2)
    s.step("Q admitted, R waits")
    s.run("end")
    named = dict(s.named)
    log = e.events
    assert log is not None
    pre = next(ev for ev in log if isinstance(ev, RequestPreempted))
    victim = pre.request_id
    named["preempted"] = pre.step
    resumed = next(ev for ev in log if isinstance(ev, RequestScheduled) and ev.request_id == victim and ev.phase == "resumed")
    named["resumed with hits"] = resumed.step
    order = ["P running", "Q admitted, R waits", "preempted", "resumed with hits", "end"]
    named = {k: named[k] for k in order}
    return Scenario(
        f"preemption_{policy}",
        f"Policy {policy}: when a running request needs a block and none is free, the scheduler preempts "
        f"{'the newest running request' if policy == 'fcfs' else 'the lowest-priority running request'} "
        f"({victim}). It loses all its blocks and computed tokens and goes to the head of the waiting "
        "queue; when it runs again it hits its own blocks that are still cached and recomputes the rest.",
        e,
        named,
        notes={
            "preempted": f"{victim} was preempted: its blocks are back on the free queue (cached ones keep their hash).",
            "resumed with hits": f"{victim} resumed and hit {resumed.num_cached_tokens} of its own tokens.",
        },
    )


SYSTEM_24 = "System: answer briefly. "  # 24 bytes = 3 blocks of 8


def salts() -> Scenario:
    """Tenant isolation with ``cache_salt`` (24 blocks of 8 tokens).

    Two tenants send the same 24-token system prompt. Without a salt (anon-a, anon-b) the
    second request hits the first one's blocks: sharing, and a timing side channel. With a
    per-tenant secret salt (alice-1 vs bob-1) the salt enters the first block's hash, so the
    whole chain differs and nothing is shared -- while alice-2 still hits alice-1's blocks.
    """
    assert len(SYSTEM_24) == 24
    e = _engine(24, 8)
    s = _Script(e)
    s.add("anon-a", SYSTEM_24 + "Hi?", max_tokens=3)
    s.add("anon-b", SYSTEM_24 + "Yo?", max_tokens=3)
    s.step("no salt: shared")
    s.run("unsalted done")
    s.add("alice-1", SYSTEM_24 + "Hi?", max_tokens=3, cache_salt="alice:7f3c9e21")
    s.add("bob-1", SYSTEM_24 + "Yo?", max_tokens=3, cache_salt="bob:c41d08aa")
    s.step("salted: not shared")
    s.add("alice-2", SYSTEM_24 + "Ok?", max_tokens=3, cache_salt="alice:7f3c9e21")
    s.step("same salt: shared")
    s.run("end")
    return Scenario(
        "salts",
        "The same system prompt is shared between requests without a salt, but never between "
        "tenants with different cache_salt values: the salt is mixed into the first block's "
        "hash, and every later hash chains from it.",
        e,
        s.named,
    )


def sliding_window() -> Scenario:
    """A hybrid model: one full-attention group and one sliding-window group (W = 32).

    21 blocks of 16 tokens shared by both groups. S1 (70 tokens, chunked into 64 + 6)
    holds one table per group. Once 70 tokens are computed, the window group's first two
    blocks can never be read again (the next query reads positions 39..70): they are replaced
    by the null block (id 0, drawn ∅) and freed -- still cached. S2 shares the 70-token prompt:
    the full group hits 4 blocks; the window group needs only the last two of them and pads
    the rest with null blocks.
    """
    groups = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=32)]
    e = _engine(21, 16, max_num_batched_tokens=64, manager_kwargs=dict(kv_cache_groups=groups))
    s = _Script(e)
    doc = "Sliding windows keep only the last 32 tokens of a layer; older blocks go."
    s.add("S1", doc[:70], max_tokens=12)
    s.step("chunked prefill")
    s.step("blocks leave the window")
    s.add("S2", doc[:70] + "?", max_tokens=6)
    s.step("S2 hit with null padding")
    s.run("end")
    return Scenario(
        "sliding_window",
        "Two KV-cache groups draw from one pool. The sliding-window group drops blocks that left "
        "the window (null block ∅ in the table) and, on a prefix hit, pads the blocks it does "
        "not need with the null block.",
        e,
        s.named,
    )


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "shared_prefix": shared_prefix,
    "eviction": eviction,
    "preemption": preemption,
    "salts": salts,
    "sliding_window": sliding_window,
}


def get_scenario(name: str, **kwargs: Any) -> Scenario:
    """Build a scenario by name (``list(SCENARIOS)`` lists them)."""
    try:
        fn = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose one of {sorted(SCENARIOS)}") from None
    return fn(**kwargs)
