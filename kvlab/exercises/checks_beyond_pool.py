"""Checkers for lessons 12-14: ``tier_hits`` and ``promotion_scan`` (offload tiers), ``num_matched_tokens`` and
``token_slots`` (a consumer connector), ``encoder_inputs`` (the encoder budget).

Each one runs the learner's function on cases built to tell the classic wrong answers
apart, then plugs it into the real engine through a seam (a connector's scheduler-half
class, a connector method, a scheduler subclass) and replays the lesson's story.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable
from typing import Any, cast

from kvlab.exercises.answers import describe, is_int
from kvlab.exercises.registry import call, register
from kvlab.exercises.result import CheckResult, failed, passed

# --- tier_hits (lesson 12) ---------------------------------------------------------------------------


def _tier_cases() -> list[tuple[str, list[bytes], int, int, int, set[bytes], set[bytes], list[str]]]:
    h = [f"b{i}".encode() for i in range(8)]
    return [
        # name, hashes, computed, num_tokens, block_size, in CPU, on disk, expected
        ("nothing cached locally, CPU then disk", h, 0, 26, 4, {h[0], h[1]}, {h[2], h[3]}, ["CPU", "CPU", "STORAGE", "STORAGE"]),
        ("a local hit of 8 tokens first", h, 8, 26, 4, {h[0], h[1], h[2]}, {h[3]}, ["CPU", "STORAGE"]),
        ("the prompt is exactly 5 blocks: the last one is the model's", h, 0, 20, 4, set(h), set(), ["CPU"] * 4),
        ("a miss in the middle ends the run", h, 0, 30, 4, {h[0], h[2], h[3]}, set(), ["CPU"]),
        ("on both tiers: CPU is nearer", h, 4, 17, 4, {h[1], h[2]}, {h[1], h[2], h[3]}, ["CPU", "CPU", "STORAGE"]),
        ("nothing anywhere", h, 0, 30, 4, set(), set(), []),
    ]


@register(
    "tier_hits",
    "Which tier serves each block",
    "tier_hits(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, in_storage) -> list[str]",
    "12a_kv_offload_tiers",
    [
        "The GPU pool already served num_computed_tokens (whole blocks): start at block num_computed_tokens // block_size.",
        "A hit never covers the prompt's last token -- the model computes it to sample the next one: stop before block (num_tokens - 1) // block_size.",
        "A prefix is a chain: the first block no tier holds ends the run, even if later blocks are cached.",
        "Ask the CPU tier first ('CPU'), then the disk ('STORAGE'): the CPU copy is faster and a disk block goes through the CPU anyway.",
    ],
    notebook="ex_offload",
)
def check_tier_hits(fn: Any) -> CheckResult:
    eid = "tier_hits"
    for name, hashes, computed, ntok, bs, cpu, disk, want in _tier_cases():
        got = call(fn, list(hashes), computed, ntok, bs, cpu.__contains__, disk.__contains__, where=f"the case '{name}'")
        got = list(got) if isinstance(got, (list, tuple)) else got
        if got == want:
            continue
        return failed(
            eid,
            f"wrong tiers: {name}",
            case=name,
            inputs=f"num_computed_tokens={computed}, num_tokens={ntok}, "
            f"block_size={bs}, CPU holds {sorted(x.decode() for x in cpu)}, disk holds {sorted(x.decode() for x in disk)}",
            expected=repr(want),
            got=repr(got),
            idea=_tier_idea(got, hashes, computed, ntok, bs, cpu, disk, want),
        )
    ok, detail = _tier_story(fn)
    if not ok:
        return failed(
            eid,
            "in the engine: the offload story does not load what vLLM loads",
            details=detail,
            idea="your function runs inside the offloading connector's lookup; compare your cases with the lesson's story",
        )
    return passed(
        eid,
        "every case matches; inside the offloading connector the lesson's story loads A2 from disk, C2's third "
        "block from the CPU tier and B2 from disk, exactly as before.",
    )


def _tier_reference(hashes, computed, ntok, bs, cpu, disk, *, end=None, start=None, skip_miss=False, disk_first=False) -> list[str]:
    out = []
    a = computed // bs if start is None else start
    b = (ntok - 1) // bs if end is None else end
    for h in hashes[a:b]:
        tiers = [("STORAGE", disk), ("CPU", cpu)] if disk_first else [("CPU", cpu), ("STORAGE", disk)]
        m = next((name for name, s in tiers if h in s), None)
        if m is None:
            if skip_miss:
                continue
            break
        out.append(m)
    return out


def _tier_idea(got, hashes, computed, ntok, bs, cpu, disk, want) -> str:
    if got == _tier_reference(hashes, computed, ntok, bs, cpu, disk, end=ntok // bs):
        return "the prompt's last token is never a hit: the model must compute it to sample -- stop before block (num_tokens - 1) // block_size"
    if got == _tier_reference(hashes, computed, ntok, bs, cpu, disk, start=0):
        return "start after the local hit: the GPU pool already served num_computed_tokens, block num_computed_tokens // block_size is the first to look up"
    if got == _tier_reference(hashes, computed, ntok, bs, cpu, disk, skip_miss=True):
        return "a prefix is a chain: a block after a miss cannot be used without the missing one -- stop at the first miss"
    if got == _tier_reference(hashes, computed, ntok, bs, cpu, disk, disk_first=True):
        return "look in the CPU tier first: it is nearer, and a disk block must pass through the CPU anyway"
    if got == _tier_reference(hashes, computed, ntok, bs, cpu, set()):
        return "a block the CPU tier lost may still be on disk: ask the storage tier before calling it a miss"
    return "one medium per block ('CPU' or 'STORAGE'), from the first block after the local hit, up to the first miss"


def _tier_story(fn: Callable) -> tuple[bool, str]:
    """Lesson 12's story with the learner's lookup inside the connector; the transfers must
    equal the reference run's."""
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.staged_scheduler import StagedOffloadingConnectorScheduler
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.executor.simulated import SimulatedExecutor
    from kvlab.kv_offload.base import LookupResult, make_offload_key
    from kvlab.lessons.beyond_pool import OFFLOAD_STORY, run_one_by_one, transfer_lines
    from kvlab.eventlog.events import EventLog

    class LearnerScheduler(StagedOffloadingConnectorScheduler):
        def tier_hits(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
            m = self.manager

            def in_cpu(h: bytes) -> bool:
                return m.primary.lookup(make_offload_key(h)) is LookupResult.HIT

            def in_storage(h: bytes) -> bool:
                return m.secondary is not None and m.secondary.lookup(make_offload_key(h)) is LookupResult.HIT

            media = call(
                fn,
                list(request.block_hashes),
                num_computed_tokens,
                request.num_tokens,
                self.block_size,
                in_cpu,
                in_storage,
                where=f"looking up {request.request_id!r} in the tiers",
            )
            start = num_computed_tokens // self.block_size
            keys = [make_offload_key(h) for h in request.block_hashes[start : start + len(media)]]
            return m.cap_promotions(keys, list(media))

    learner_connector = type("LearnerOffloadingConnector", (OffloadingConnector,), {"scheduler_cls": LearnerScheduler})

    def run(connector_cls: type) -> list[str]:
        with tempfile.TemporaryDirectory() as d:
            extra = dict(num_cpu_blocks=5, storage_path=d, num_storage_blocks=12)
            log = EventLog()
            mgr = KVCacheManager(num_blocks=6, block_size=4, event_log=log)
            sched = Scheduler(mgr, max_num_batched_tokens=64, connector=connector_cls(KVConnectorRole.SCHEDULER, 4, extra))
            eng = LLMEngine(mgr, sched, SimulatedExecutor(kv_connector=OffloadingConnector(KVConnectorRole.WORKER, 4, extra)))
            run_one_by_one(eng, OFFLOAD_STORY)
            return transfer_lines(log)

    want, got = run(OffloadingConnector), run(learner_connector)
    if got == want:
        return True, ""
    diff = next(i for i, (a, b) in enumerate(zip(want + [""], got + [""])) if a != b)
    return (
        False,
        f"   first difference: expected {want[diff] if diff < len(want) else '(nothing)'!r}, got {got[diff] if diff < len(got) else '(nothing)'!r}",
    )


# --- promotion_scan (lesson 12b, section 3) -----------------------------------------------------------

_ANSWERS = ("HIT", "HIT_PENDING", "RETRY", "MISS")


def _scan_cases() -> list[tuple[str, list[str], int | None, int]]:
    # name, what lookup answers for each block in order, expected return, blocks asked about
    return [
        ("every block in the CPU tier", ["HIT", "HIT", "HIT"], 3, 3),
        ("a miss ends the run", ["HIT", "MISS", "HIT"], 1, 2),
        ("nothing cached", ["MISS", "HIT"], 0, 1),
        ("a block on its way into the CPU tier", ["HIT", "HIT_PENDING", "HIT"], None, 3),
        ("on its way, then a miss", ["HIT_PENDING", "HIT", "MISS", "HIT"], None, 3),
        ("a tier still looking", ["HIT", "RETRY", "HIT", "MISS"], None, 4),
        ("no blocks at all", [], 0, 0),
    ]


def _scan_reference(answers: list[str], *, stop_at_wait=False, load_pending=False, retry_is_miss=False, past_miss=False, zero=False):
    hits, wait, asked = 0, False, 0
    for a in answers:
        asked += 1
        if a == "MISS" or (retry_is_miss and a == "RETRY"):
            if not past_miss:
                break
            continue
        if a == "HIT" or (load_pending and a == "HIT_PENDING"):
            hits += 1
            continue
        wait = True
        if stop_at_wait:
            break
    return (0 if zero else None) if wait else hits, asked


def _scan_idea(got, asked, answers) -> str:
    variants = [
        (
            {"stop_at_wait": True},
            "keep asking after a block that is on its way (or still being looked for): your lookups "
            "are what start the promotions of the blocks after it, all in this step -- stop only at a MISS",
        ),
        (
            {"load_pending": True},
            "a HIT_PENDING block is not in the CPU tier yet: loading it would copy a chunk nobody "
            "has written -- the request must wait (return None) and ask again next step",
        ),
        (
            {"retry_is_miss": True},
            "RETRY means a tier has not answered yet, not that the block is missing: the request waits (None) instead of giving up on it",
        ),
        ({"past_miss": True}, "a MISS ends the chain: asking about the blocks after it would start promotions the request can never use"),
        (
            {"zero": True},
            "0 means 'nothing to load, compute it all': the request would recompute blocks that are on "
            "their way -- None says 'ask me again next step'",
        ),
    ]
    for kw, idea in variants:
        if (got, asked) == _scan_reference(answers, **kw):
            return idea
    return "ask in order up to the first MISS; HIT counts a block; HIT_PENDING or RETRY means return None (wait)"


def _scan_story(fn: Any) -> tuple[int | None, list]:
    """vLLM's tiers for real: a CPU tier of 4 chunks, a request's 3 blocks only in the tier
    behind it. Steps until the scan says 3 blocks can be loaded (None: not within 6)."""
    from kvlab.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
    from kvlab.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from kvlab.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
    from kvlab.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

    region = SharedOffloadRegion(f"kvlab_exercise_{os.getpid()}_{next(_SCAN_RUNS)}", 4, None, 4096, 4096)
    try:
        primary = CPUPrimaryTierOffloadingManager(4, region)
        behind = ExampleSecondaryTierManager(None, primary.get_kv_memoryview(), "example")
        tiers = TieringOffloadingManager(primary, [behind], tier_poll_interval_s=0)
        keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(3)]
        behind.chunks.update(dict.fromkeys(keys, True))
        ctx = ReqContext("learner")
        tiers.on_new_request(ctx)
        seen = []
        for step in range(1, 7):
            got = call(fn, list(keys), lambda k: tiers.lookup(k, ctx).name, where=f"step {step} of the engine run")
            seen.append(got)
            tiers.on_schedule_end(ScheduleEndContext(["learner"] if step == 1 else [], []))
            if got == 3:
                tiers.shutdown()
                return step, seen
        tiers.shutdown()
        return None, seen
    finally:
        region.cleanup()


_SCAN_RUNS = itertools.count()


@register(
    "promotion_scan",
    "The connector's scan over asynchronous tiers",
    "promotion_scan(keys, lookup) -> int | None",
    "12b_offload_in_vllm",
    [
        "Ask lookup(key) for each key in order; a 'MISS' ends the scan -- do not ask about the keys after it.",
        "'HIT' is one block the request can load now: count it.",
        "'HIT_PENDING' (on its way into the CPU tier) and 'RETRY' (a tier still looking) mean the request must wait: "
        "remember that, but keep asking -- your lookups are what start the later blocks' promotions.",
        "Return None when the request must wait, else the number of HITs.",
    ],
    notebook="ex_offload",
)
def check_promotion_scan(fn: Any) -> CheckResult:
    eid = "promotion_scan"
    for name, answers, want, want_asked in _scan_cases():
        asked: list[int] = []

        def lookup(key: Any, answers: list[str] = answers, asked: list[int] = asked) -> str:
            if not isinstance(key, int) or not 0 <= key < len(answers):
                raise ValueError(f"lookup was asked about {key!r}; ask about the keys you were given, in order")
            asked.append(key)
            return answers[key]

        got = call(fn, list(range(len(answers))), lookup, where=f"the case '{name}'")
        if got is not None and not is_int(got):
            return failed(eid, f"return an int or None, got {describe(got)}", case=name, expected=repr(want), got=repr(got))
        if (got, len(asked)) == (want, want_asked) and asked == list(range(want_asked)):
            continue
        return failed(
            eid,
            f"wrong scan: {name}",
            case=name,
            inputs=f"lookup answers {answers} for the blocks in order",
            expected=f"return {want!r}, after asking about {want_asked} block(s)",
            got=f"return {got!r}, after asking about {len(asked)} block(s)" + ("" if asked == sorted(asked) else f" in the order {asked}"),
            idea=_scan_idea(got, len(asked), answers),
        )
    steps, seen = _scan_story(fn)
    if steps != 2:
        return failed(
            eid,
            "in vLLM's tiers: the three blocks took " + (f"{steps} steps" if steps else "more than 6 steps") + " to load, not 2",
            details=f"your scan answered {seen}, one answer per step",
            idea="with every promotion started in step 1, all three blocks are in the CPU tier at step 2",
        )
    return passed(
        eid,
        "every case matches; on vLLM's asynchronous tiers your scan started all three promotions in step 1 "
        "(it answered None) and loaded the three blocks in step 2.",
    )


# --- num_matched_tokens and token_slots (lesson 13) ---------------------------------------------------
MATCH_CASES = [
    # name, saved, prompt, local hit, expected
    ("a fresh request, the whole prompt saved", 41, 41, 0, 40),
    ("the local pool already had 32 tokens", 41, 41, 32, 8),
    ("the folder holds only the first 20 tokens", 20, 41, 0, 20),
    ("the local hit is longer than the folder", 20, 41, 32, 0),
    ("nothing saved", 0, 41, 16, 0),
]


@register(
    "num_matched_tokens",
    "How many tokens the consumer takes",
    "num_matched_tokens(saved_tokens, num_prompt_tokens, num_computed_tokens) -> int",
    "13_connectors_and_disaggregated_prefill",
    [
        "The answer counts tokens BEYOND the local hit: the GPU pool already supplies num_computed_tokens.",
        "Never the prompt's last token: the decode engine computes it to sample the first output token.",
        "A folder may hold less than the local hit already covers: then there is nothing to take (never a negative count).",
    ],
    notebook="ex_connector",
)
def check_num_matched_tokens(fn: Any) -> CheckResult:
    eid = "num_matched_tokens"
    for name, saved, prompt, hit, want in MATCH_CASES:
        got = call(fn, saved, prompt, hit, where=f"the case '{name}'")
        if got == want:
            continue
        idea = "take every saved prompt token but the last, minus what the local hit already covers, and never fewer than 0"
        if got == min(saved, prompt - 1):
            idea = "count only the tokens BEYOND the local hit: the GPU pool already supplies num_computed_tokens of them"
        elif got == max(0, min(saved, prompt) - hit):
            idea = "leave the prompt's last token to the model: its logits choose the first output token (at most num_prompt_tokens - 1)"
        elif got == min(saved, prompt - 1) - hit:
            idea = "when the local hit is longer than the folder there is nothing to take: clamp at 0, a negative count is an error"
        return failed(
            eid,
            f"wrong count: {name}",
            case=name,
            inputs=f"saved_tokens={saved}, num_prompt_tokens={prompt}, num_computed_tokens={hit}",
            expected=repr(want),
            got=repr(got),
            idea=idea,
        )
    ok, detail = _pd_run(matched=fn)
    if not ok:
        return failed(
            eid,
            "in the engine: the prefill/decode pair does not behave",
            details=detail,
            idea="your function decides how many tokens the decode engine takes from the prefill engine's files",
        )
    return passed(
        eid,
        "every case matches; a prefill/decode pair with your count gives the dense model's tokens and the decode "
        "engine computes only each prompt's last token.",
    )


SLOT_CASES = [
    # name, block ids, start, end, block size
    ("a whole prompt from token 0", [7, 3, 9], 0, 10, 4),
    ("after a local hit of one block", [7, 3, 9], 4, 11, 4),
    ("a range that starts inside a block", [2, 5], 3, 6, 4),
    ("blocks of 16", [11, 4], 14, 20, 16),
]


@register(
    "token_slots",
    "Where a token range sits in the cache",
    "token_slots(block_ids, start, end, block_size) -> list[int]",
    "13_connectors_and_disaggregated_prefill",
    [
        "Token p sits in block block_ids[p // block_size] (the table is indexed by the token's position, from 0), at offset p % block_size.",
        "A slot numbers every token place of the pool: slot = block id × block_size + offset.",
        "The range is [start, end): end is not included.",
    ],
    notebook="ex_connector",
)
def check_token_slots(fn: Any) -> CheckResult:
    eid = "token_slots"
    for name, ids, a, b, bs in SLOT_CASES:
        want = [ids[p // bs] * bs + p % bs for p in range(a, b)]
        got = call(fn, list(ids), a, b, bs, where=f"the case '{name}'")
        slots = _int_list(got)
        if slots is None:
            return failed(
                eid,
                f"token_slots must return a list of ints (one slot per token) -- got {_slots_kind(got)}",
                case=name,
                inputs=f"block_ids={ids}, start={a}, end={b}, block_size={bs}",
                expected=repr(want),
                got=describe(got),
                idea="a slot is a whole number: block id × block_size + offset (a list, a tuple or a 1-D numpy array of ints)",
            )
        got = slots
        if got == want:
            continue
        idea = "slot = block_ids[p // block_size] * block_size + p % block_size for every p in [start, end)"
        if got == [ids[p // bs] + p % bs for p in range(a, b)]:
            idea = "a block holds block_size slots: multiply the block id by block_size before adding the offset"
        elif got == [ids[(p - a) // bs] * bs + p % bs for p in range(a, b) if (p - a) // bs < len(ids)]:
            idea = "the table is indexed by the token's position in the request (p // block_size), not by its position in the range"
        elif got == [ids[p // bs] * bs + p % bs for p in range(a, b + 1) if p // bs < len(ids)]:
            idea = "the range is half open: end is not included"
        return failed(
            eid,
            f"wrong slots: {name}",
            case=name,
            inputs=f"block_ids={ids}, start={a}, end={b}, block_size={bs}",
            expected=repr(want),
            got=repr(got),
            idea=idea,
        )
    ok, detail = _pd_run(slots=fn)
    if not ok:
        return failed(
            eid,
            "in the engine: the decode engine's tokens differ from the dense model's",
            details=detail,
            idea="your slots place the saved keys and values in the decode engine's cache: a wrong slot is wrong attention",
        )
    return passed(
        eid,
        "every case matches; with your slots the prefill engine saves and the decode engine places the prompt's KV, "
        "and its tokens equal the dense model's.",
    )


def _int_list(got: Any) -> list[int] | None:
    """``got`` as a list of plain ints when it is a sequence of ints (a list, a tuple, a range,
    a 1-D numpy array or tensor; numpy ints welcome); None otherwise."""
    if hasattr(got, "tolist") and getattr(got, "ndim", 1) == 1:
        got = got.tolist()
    if not isinstance(got, (list, tuple, range)) or not all(is_int(x) for x in got):
        return None
    return [int(x) for x in got]


def _slots_kind(got: Any) -> str:
    if getattr(got, "ndim", 1) != 1:
        return f"an array of shape {tuple(got.shape)}"
    items = got.tolist() if hasattr(got, "tolist") else got
    if isinstance(items, (list, tuple, range)):
        bad = next(x for x in items if not is_int(x))
        return f"an item {describe(bad)} of type {type(bad).__name__}"
    return f"{type(got).__name__} {describe(got)}"


def _pd_run(matched: Callable | None = None, slots: Callable | None = None) -> tuple[bool, str]:
    """A prefill/decode pair on the small tiny model, the learner's function inside both
    connectors; outputs must equal the dense forward, and the decode engine must compute
    only each prompt's last token and its decode steps."""
    import torch

    from kvlab.config.kv_transfer import KVTransferConfig  # noqa: F401  (the record the lesson shows)
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvlab.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.request import Request
    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    attrs: dict[str, Any] = {}
    if matched is not None:
        attrs["external_tokens"] = lambda self, saved, prompt, hit: call(matched, saved, prompt, hit, where="the decode engine's lookup")
    if slots is not None:
        attrs["slots_of"] = lambda self, rm, bs: _int_list(
            call(slots, list(rm.block_ids), rm.start, rm.end, bs, where="placing a token range in the cache")
        )
    learner = type("LearnerExampleConnector", (ExampleConnector,), attrs)
    torch.set_num_threads(1)
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)
    prompts = [[40 + (7 * i) % 80 for i in range(n)] for n in (13, 21)]
    with tempfile.TemporaryDirectory() as d:
        extra = {"shared_storage_path": d}

        def engine(role: str) -> LLMEngine:
            mgr = KVCacheManager(num_blocks=16, block_size=4)
            sched = Scheduler(mgr, connector=learner(KVConnectorRole.SCHEDULER, 4, extra, kv_role=role))
            runner = ModelRunner(model, device="cpu", kv_connector=learner(KVConnectorRole.WORKER, 4, extra, kv_role=role))
            return LLMEngine(mgr, sched, runner)

        P, D = engine("kv_producer"), engine("kv_consumer")
        D.add_request(Request("warm", list(range(50, 59)), max_tokens=1))  # the decode pool's blocks differ from the prefill's
        D.run()
        before = cast(ModelRunner, D.executor).num_tokens_computed  # engine() gives each a ModelRunner
        outs = []
        for i, p in enumerate(prompts):
            P.add_request(Request(f"r{i}", p, max_tokens=1))
            P.run()
            D.add_request(Request(f"r{i}", p, max_tokens=4))
            D.run()
            outs.append(D.finished[f"r{i}"].output_token_ids)
    want = [model.generate_dense(p, 4) for p in prompts]
    computed = cast(ModelRunner, D.executor).num_tokens_computed - before
    if outs != want:
        return False, f"   decode outputs {outs}\n   dense outputs  {want}"
    if computed != 2 * 4:
        return False, f"   the decode engine computed {computed} tokens; taking every prompt token but the last, it computes 8"
    return True, ""


# --- encoder_inputs (lesson 14) ------------------------------------------------------------------------
ENC_CASES = [
    # name, items (id, offset, length), computed, new, cached ids, room (embeddings that fit), expected (to encode, new)
    ("one image inside the chunk", [("x", 4, 8)], 0, 16, set(), 100, ([0], 16)),
    ("the image is cached already", [("x", 4, 8)], 0, 16, {"x"}, 100, ([], 16)),
    ("no room: the chunk stops before the image", [("x", 4, 8)], 0, 16, set(), 6, ([], 4)),
    ("a prefix hit ends inside the image: it is still needed", [("x", 4, 8)], 8, 8, set(), 100, ([0], 8)),
    ("a prefix hit ends inside the image and there is no room", [("x", 4, 8)], 8, 8, set(), 6, ([], 0)),
    ("the second image does not fit", [("x", 0, 4), ("y", 6, 8)], 0, 16, set(), 10, ([0], 6)),
    ("an image behind the computed tokens, one beyond the chunk", [("x", 0, 4), ("y", 6, 4), ("z", 14, 4)], 4, 6, set(), 100, ([1], 6)),
    ("the same image twice", [("x", 0, 4), ("x", 6, 4)], 0, 12, set(), 100, ([0], 12)),
    ("4 tokens computed: no room for an image at offset 12", [("x", 12, 8)], 4, 16, set(), 6, ([], 8)),
    ("an image starts exactly where the chunk ends", [("x", 0, 4), ("y", 16, 4)], 0, 16, set(), 100, ([0], 16)),
    ("no room for the first image; a smaller one after it would fit", [("x", 4, 8), ("y", 14, 2), ("z", 18, 8)], 0, 24, set(), 6, ([], 4)),
    ("a cached image, then one to encode", [("x", 0, 4), ("y", 6, 4)], 0, 12, {"x"}, 100, ([1], 12)),
]


@register(
    "encoder_inputs",
    "Which images a chunk must encode",
    "encoder_inputs(items, num_computed_tokens, num_new_tokens, is_cached, fits) -> (list[int], int)",
    "14_encoder_cache",
    [
        "The chunk covers tokens [num_computed_tokens, num_computed_tokens + num_new_tokens): only items overlapping it matter -- skip those behind it, stop at the first beyond it.",
        "An item already in the encoder cache (is_cached) needs no encoder run; neither does a second copy of an item you chose in this call.",
        "An item is encoded whole. If it does not fit, the chunk stops right before it: num_new_tokens = offset - num_computed_tokens -- or 0 if the computed tokens already reach into it.",
        "An item the chunk starts inside of (a prefix hit ended in the image) still needs its embeddings.",
    ],
    notebook="ex_encoder_cache",
)
def check_encoder_inputs(fn: Any) -> CheckResult:
    eid = "encoder_inputs"
    for name, items, computed, new, cached, room, want in ENC_CASES:
        got = _run_enc(fn, items, computed, new, cached, room, where=f"the case '{name}'")
        inputs = f"items={items}, num_computed_tokens={computed}, num_new_tokens={new}, cached={sorted(cached)}, room for {room} embeddings"
        if not _enc_pair(got):
            return failed(
                eid,
                _enc_kind_problem(got),
                case=name,
                inputs=inputs,
                expected=repr(want),
                got=describe(got),
                idea="two values, e.g. `return chosen, num_new_tokens` (a tuple or a list of two): the indices of "
                "the items to encode, and the chunk's token count",
            )
        if got == want:
            continue
        return failed(
            eid,
            f"wrong decision: {name}",
            case=name,
            inputs=inputs,
            expected=repr(want),
            got=repr(got),
            idea=_enc_idea(items, computed, new, cached, room, got),
        )
    ok, detail = _enc_story(fn)
    if not ok:
        return failed(
            eid,
            "in the engine: lesson 14's story does not run as vLLM's",
            details=detail,
            idea="your function decides, inside the scheduler, which images each chunk encodes and where chunks stop",
        )
    return passed(
        eid,
        "every case matches; inside the scheduler lesson 14's story encodes img-a, img-b and img-c once each, "
        "reuses img-a for r1 and evicts img-a for img-c, as vLLM does.",
    )


def _run_enc(fn: Callable, items, computed, new, cached, room, where: str) -> Any:
    left = [room]

    def fits(i: int) -> bool:
        if items[i][2] > left[0]:
            return False
        left[0] -= items[i][2]
        return True

    got = call(fn, list(items), computed, new, lambda i: items[i][0] in cached, fits, where=where)
    return _enc_normal(got)


def _enc_normal(got: Any) -> Any:
    """``(chosen, n)`` as ``(list of ints, int)`` when it is a 2-sequence of that kind (a tuple
    or a list, numpy ints welcome); anything else unchanged, for the message."""
    if isinstance(got, (tuple, list)) and len(got) == 2:
        chosen, n = got
        if isinstance(chosen, (list, tuple, range)) and all(is_int(i) for i in chosen) and is_int(n):
            return ([int(i) for i in chosen], int(n))
    return got


def _enc_pair(got: Any) -> bool:
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and isinstance(got[0], list)
        and all(type(i) is int for i in got[0])
        and type(got[1]) is int
    )


def _enc_kind_problem(got: Any) -> str:
    """What is wrong with the kind of an answer that is not ``(chosen, n)``."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"return (chosen, num_new_tokens), two values -- got {describe(got)}"
    chosen, n = got
    if not isinstance(chosen, (list, tuple, range)) or not all(is_int(i) for i in chosen):
        return f"chosen must be a list of item indices (ints) -- got {describe(chosen)}"
    return f"num_new_tokens must be an int -- got {type(n).__name__} {describe(n)}"


def _enc_reference(
    items,
    computed,
    new,
    cached,
    room,
    *,
    cut_to_zero=False,
    no_cut=False,
    ignore_cache=False,
    only_starting=False,
    no_stop=False,
    abs_cut=False,
    at_end=False,
    carry_on=False,
    stop_at_cached=False,
) -> tuple[list[int], int]:
    out: list[int] = []
    chosen: set[str] = set()
    end = computed + new
    left = room
    for i, (ident, off, length) in enumerate(items):
        if (off > end if at_end else off >= end) and not no_stop:
            break
        if off + length <= computed or (only_starting and off < computed):
            continue
        if ident in chosen:
            continue
        if ident in cached and not ignore_cache:
            if stop_at_cached:
                break
            continue
        if length > left:
            if not no_cut:
                new = 0 if cut_to_zero or computed >= off else (off if abs_cut else min(new, off - computed))
            if carry_on:
                continue
            break
        left -= length
        chosen.add(ident)
        out.append(i)
    return out, new


def _enc_idea(items, computed, new, cached, room, got) -> str:
    args = (items, computed, new, cached, room)
    if got == _enc_reference(*args, no_cut=True):
        return "an item that does not fit cannot be half computed: stop the chunk right before it (num_new_tokens = offset - num_computed_tokens)"
    if got == _enc_reference(*args, cut_to_zero=True):
        return "stop the chunk BEFORE the item, not at 0: the text before the image can still run (0 only if the computed tokens reach into it)"
    if got == _enc_reference(*args, ignore_cache=True):
        return "an item already in the encoder cache is shared by hash: do not run the encoder again"
    if got == _enc_reference(*args, only_starting=True):
        return "a chunk that starts inside an image (a prefix hit ended there) still needs the whole image's embeddings"
    if got == _enc_reference(*args, abs_cut=True):
        off = got[1]  # that variant stops the chunk at the item's offset
        return (
            f"num_new_tokens counts tokens from num_computed_tokens: stop the chunk at offset - num_computed_tokens = "
            f"{off - computed}, not at the offset {off}"
        )
    if got == _enc_reference(*args, at_end=True):
        return (
            "the chunk covers [num_computed_tokens, num_computed_tokens + num_new_tokens): an image starting AT the end is "
            "not in this chunk -- the next chunk encodes it (stop at offset >= the end)"
        )
    carried, right = _enc_reference(*args, carry_on=True), _enc_reference(*args)
    if carried != right and isinstance(got, tuple) and (got == carried or got[0] == carried[0] != right[0]):  # whatever it made of n
        return (
            "once an item does not fit, the chunk ends right before it: stop there (break) -- every item after it lies "
            "beyond the new end, and encoding one now spends the budget on tokens this step does not compute"
        )
    if got == _enc_reference(*args, stop_at_cached=True):
        return "a cached item needs no encoder run, but the items after it may: skip it (continue), do not stop at it"
    if got == _enc_reference(*args, no_stop=True):
        return "only items overlapping the chunk's tokens are needed now: stop at the first item at or beyond its end"
    return "items overlapping [num_computed_tokens, num_computed_tokens + num_new_tokens), each encoded whole if it fits"


def _enc_story(fn: Callable) -> tuple[bool, str]:
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.lessons.beyond_pool import encoder_story

    class LearnerScheduler(Scheduler):
        def _try_schedule_encoder_inputs(self, request, num_computed_tokens, num_new_tokens, encoder_budget, shift_computed_tokens=0):  # noqa: ANN001, ANN201  # no drafter here: no shift
            ecm = self.encoder_cache_manager
            items = [(f.identifier, f.offset, f.length) for f in request.mm_features]
            state = {"budget": encoder_budget, "scheduled": 0}

            def fits(i: int) -> bool:
                if not ecm.can_allocate(request, i, state["budget"], state["scheduled"]):
                    return False
                state["budget"] -= items[i][2]
                state["scheduled"] += items[i][2]
                return True

            picked, n = call(
                fn,
                items,
                num_computed_tokens,
                num_new_tokens,
                lambda i: ecm.check_and_update_cache(request, i),
                fits,
                where=f"scheduling {request.request_id!r}'s images",
            )
            picked = list(picked)
            ids = {items[i][0] for i in picked}
            end = num_computed_tokens + n
            dups = [
                i
                for i, (ident, off, length) in enumerate(items)
                if i not in picked and ident in ids and off < end and off + length > num_computed_tokens
            ]
            return picked, dups, n, state["budget"]

    def run(sched_cls: type) -> list:
        eng = encoder_story(sched_cls)
        rows = []
        while eng.has_unfinished_requests():
            so = eng.step().scheduler_output
            rows.append((so.step, dict(so.num_scheduled_tokens), dict(so.scheduled_encoder_inputs), list(so.free_encoder_mm_hashes)))
        return rows

    want, got = run(Scheduler), run(LearnerScheduler)
    if got == want:
        return True, ""
    diff = next(i for i, (a, b) in enumerate(zip(want + [None], got + [None])) if a != b)
    return False, (
        f"   step {diff + 1}: expected {want[diff] if diff < len(want) else '(done)'}\n"
        f"            got      {got[diff] if diff < len(got) else '(done)'}"
    )
