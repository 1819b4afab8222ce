"""Checkers: bug_hunt (name the planted bug of each incident) and bug_fix (fix incident 3's
hash map). The incidents and their bugs: :mod:`kvlab.exercises.bug_hunt`."""

from __future__ import annotations

from typing import Any

from kvlab.core.block_pool import BlockHashToBlockMap
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.exercises.bug_hunt import INCIDENTS, RULED_OUT, SUSPECTS, OneBlockPerHash, incident_duplicates, map_pool
from kvlab.exercises.registry import call, register
from kvlab.exercises.result import CheckResult, failed, passed
from kvlab.request import Request


@register(
    "bug_hunt",
    "Bug hunt: three incidents, three planted bugs",
    "answers: dict {incident number: suspect name} (or a function returning it)",
    "09_capstone",
    [
        "Open each incident at the step its report is about, then step back: which block misbehaves, and when did it change hands?",
        "An eviction is an event. A cached block handed to a new request WITHOUT one keeps a hash that no longer describes it.",
        "Compare a request's hit (in tokens) with its prompt length: the last prompt token is never a hit.",
        "Two blocks may carry one hash. Which map entry vanishes when one of them is evicted?",
    ],
    notebook="ex_bug_hunt",
)
def check_bug_hunt(answers: Any) -> CheckResult:
    eid = "bug_hunt"
    if callable(answers):  # the notebook passes a function returning the dict (its stub raises NotImplementedError)
        # Through call(): an error in it is the learner's ("your code raised ..."), not the engine's.
        answers = call(answers, where="calling your answers function")
    if not isinstance(answers, dict):
        return failed(
            eid,
            f"answers must be a dict {{incident number: suspect name}}, got {type(answers).__name__}",
            expected="{1: '...', 2: '...', 3: '...'}",
            got=repr(answers),
            idea="one suspect name per incident",
        )
    missing = [n for n in INCIDENTS if n not in answers]
    if missing:
        return failed(
            eid,
            f"no answer for incident {missing[0]}",
            expected=f"a suspect for each of {sorted(INCIDENTS)}",
            got=repr(answers),
            idea=f"the suspects: {', '.join(SUSPECTS)}",
        )
    for n, (_, truth) in INCIDENTS.items():
        name = answers[n]
        if name not in SUSPECTS:
            return failed(
                eid,
                f"incident {n}: {name!r} is not a suspect",
                expected=f"one of {', '.join(SUSPECTS)}",
                got=repr(name),
                idea="the suspects and what each does: kvlab.exercises.bug_hunt.SUSPECTS",
            )
        if name != truth:
            return failed(
                eid,
                f"incident {n}: not {name}",
                case=f"incident {n}",
                got=name,
                idea=RULED_OUT.get((n, name), "look again at the step the report is about"),
            )
    return passed(
        eid,
        "all three: a reallocated block that kept its hash (kvcached #362), a hit that covered the whole "
        "prompt (InfiniLM #381), a map that kept one block per hash (kvcached #401). Now fix the third: bug_fix.",
    )


def _blk(i: int) -> KVCacheBlock:
    return KVCacheBlock(i)


@register(
    "bug_fix",
    "Bug fix: a hash map that keeps duplicates",
    "class FixedMap(OneBlockPerHash): insert(key, block), pop(key, block_id)",
    "09_capstone",
    [
        "self._cache[key] is either one block (the usual case) or a dict {block_id: block} once a key has several.",
        "insert: no entry -> the block itself; one block -> a dict of both (the older first); a dict -> add to it.",
        "pop(key, block_id) removes exactly that block and returns it (None if it is not there); other blocks under the key stay.",
    ],
    notebook="ex_bug_hunt",
)
def check_bug_fix(cls: Any) -> CheckResult:
    eid = "bug_fix"
    if not isinstance(cls, type):
        return failed(eid, f"pass the class itself, got {type(cls).__name__}", got=repr(cls), idea="check('bug_fix', FixedMap)")
    m = call(cls, where="constructing your map")
    a, b, c = _blk(1), _blk(4), _blk(7)
    steps = [
        ("insert(k, block 1)", lambda: m.insert(b"k", a), [1]),
        ("insert(k, block 4): a duplicate", lambda: m.insert(b"k", b), [1, 4]),
        ("insert(k, block 7)", lambda: m.insert(b"k", c), [1, 4, 7]),
        ("pop(k, 4)", lambda: m.pop(b"k", 4), [1, 7]),
        ("pop(k, 9): not there", lambda: m.pop(b"k", 9), [1, 7]),
        ("pop(k, 1)", lambda: m.pop(b"k", 1), [7]),
        ("pop(k, 7)", lambda: m.pop(b"k", 7), []),
    ]
    for name, op, want in steps:
        ret = call(op, where=name)
        got = [x.block_id for x in m.blocks_for(b"k")]
        if got != want:
            idea = (
                "pop removes exactly block_id; the other blocks under the key stay"
                if name.startswith("pop")
                else "keep every block cached under the key, oldest first"
            )
            return failed(eid, f"after {name}, the map holds {got} under k", case=name, expected=str(want), got=str(got), idea=idea)
        if name.startswith("pop(k, 9)") and ret is not None:
            return failed(eid, "pop of a block that is not under the key must return None and change nothing", got=repr(ret))
        if name in ("pop(k, 4)", "pop(k, 1)") and getattr(ret, "block_id", None) != int(name[7]):
            missing = " — got None: a missing return?" if ret is None else ""
            return failed(
                eid,
                f"{name} must return the removed block{missing}",
                expected=f"block {name[7]}",
                got=repr(ret),
                idea="return what you removed (the pool checks it)",
            )
    if b"k" in m:
        return failed(
            eid,
            "a key with no block left must leave the map",
            expected="k not in the map",
            got="k still there",
            idea="delete the entry when its last block is popped",
        )
    inc = incident_duplicates(cls)
    if inc.facts["c_cached_tokens"] != 8:
        return failed(
            eid,
            "incident 3 again, with your map: c still misses",
            case="incident 3",
            expected="8 of 8 tokens from the cache",
            got=f"{inc.facts['c_cached_tokens']} tokens",
        )
    # vLLM's duplicate scenario (test_duplicate_blocks_with_one_hash_coexist) on a pool with your map
    mgr = KVCacheManager(num_blocks=11, block_size=16, block_pool_cls=map_pool(cls))
    prompt = list(range(32)) + [5]
    x, y = Request("a", prompt), Request("b", prompt)
    looked = [(r, *mgr.get_computed_blocks(r)) for r in (x, y)]
    for r, h, n in looked:
        mgr.allocate_slots(r, r.num_tokens - n, n, h)
    mgr.free(x)
    mgr.free(y)
    z = Request("c", [77] * 128)
    h, n = mgr.get_computed_blocks(z)
    mgr.allocate_slots(z, 128 - n, n, h)
    hits, n = mgr.get_computed_blocks(Request("y", prompt))
    if hits.get_block_ids() != ([4, 5],):
        return failed(
            eid,
            "vLLM's duplicate scenario: after a's copies are evicted, b's must still hit",
            case="test_duplicate_blocks_with_one_hash_coexist",
            expected="hit [4, 5]",
            got=str(hits.get_block_ids()[0]),
        )
    mgr.block_pool.check_invariants()
    return passed(
        eid,
        "duplicates kept and popped by block id: incident 3's c now gets 8 of 8 tokens, and vLLM's duplicate scenario hits b's copies [4, 5].",
        extra={"log": inc.log},
    )


__all__ = ["BlockHashToBlockMap", "OneBlockPerHash"]
