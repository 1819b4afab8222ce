"""Quizzes with a reveal: each answer is *shown by running the engine*, not just stated.

Follow-up questions on the KV cache and the classic wrong answers interviewers hear. In a
notebook, ``quiz("25_tokens")`` shows the question and a button; the button runs the demo
(a real engine run) and prints what happened next to the answer. A quiz with ``choices``
(``fcfs_victim``, ``swap_to_cpu``) is a prediction (:mod:`kvlab.learner.prediction`): the
learner picks a choice and locks it in, and only then does the run's verdict on every choice
show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.request import Request
from kvlab.eventlog.events import BlocksAllocated, BlocksFreed, KVTransfer, RequestPreempted, RequestScheduled
from kvlab.timeline.timeline import Timeline


@dataclass
class Quiz:
    id: str
    question: str
    answer: str
    demo: Callable[[], str]
    wrong_answer: bool = False  # the question states a classic wrong answer to refute
    # A choice quiz: the learner picks one and locks it in before the demo's verdict shows (the
    # demo returns a QuizRun, whose ``result`` is the choice the run proved right).
    choices: tuple[str, ...] = ()


def _admit(mgr: KVCacheManager, req: Request) -> int:
    hits, n = mgr.get_computed_blocks(req)
    mgr.allocate_slots(req, req.num_tokens - n, n, hits)
    return n


def demo_25_tokens() -> str:
    mgr = KVCacheManager(num_blocks=32, block_size=16)
    shared = list(range(1000, 1025))
    lines = []
    for i in range(3):
        r = Request(f"r{i}", shared + [i] * 10)
        n = _admit(mgr, r)
        lines.append(f"request {i}: {n} of its 25 shared tokens came from the cache")
    return (
        "\n".join(lines) + "\n→ 16: one full block. Tokens 16–24 sit in a partial block, which has no hash, so every request computes them."
    )


def demo_two_tenants() -> str:
    system = list(range(2000, 2000 + 96))
    out = []
    for salted in (False, True):
        eng = build_engine(num_blocks=64, block_size=16, event_log=None)
        a = Request("victim", system + [1, 2, 3], max_tokens=1, cache_salt="a-7f3e9c" if salted else None)
        eng.add_request(a)
        eng.run()
        probe = Request("attacker", system + [9, 9, 9], max_tokens=1, cache_salt="b-51d2aa" if salted else None)
        eng.add_request(probe)
        eng.run()
        m = eng.metrics["attacker"]
        assert m.ttft is not None  # the attacker's request ran to the end
        out.append(
            f"{'salted  ' if salted else 'unsalted'}: attacker's prefix hit = {m.num_cached_tokens} tokens, "
            f"simulated TTFT = {m.ttft * 1000:.1f} ms"
        )
    return (
        "\n".join(out)
        + "\n→ Without salts the attacker's TTFT drops when its guess matches what the victim sent: a timing side channel. Per-tenant secret salts make the chains differ from block 0, so nothing is shared."
    )


def _preemption_run(num_blocks: int, **kwargs: Any) -> LLMEngine:
    """Three equal requests, r0, r1, r2 (8 prompt tokens, 12 to generate), admitted in that
    order on a pool of 4-token blocks, run to the end."""
    eng = build_engine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, executor=SimulatedExecutor(vocab_size=500), **kwargs)
    for i in range(3):
        eng.add_request(Request(f"r{i}", [100 * i + j for j in range(8)], max_tokens=12, arrival_time=float(i)))
    eng.run()
    return eng


class QuizRun(str):
    """What a choice quiz's demo printed, with ``result``: the choice the run proved right."""

    result: str

    def __new__(cls, text: str, result: str) -> QuizRun:
        run = super().__new__(cls, text)
        run.result = result
        return run


def _first_preemption(log: list) -> tuple[int, RequestPreempted, BlocksFreed]:
    """The run's first preemption: its place in the log, the event, and the blocks it freed."""
    i, pre = next((i, e) for i, e in enumerate(log) if isinstance(e, RequestPreempted))
    freed = next(e for e in reversed(log[:i]) if isinstance(e, BlocksFreed) and e.request_id == pre.request_id)
    return i, pre, freed


FCFS_CHOICES = (
    "r0, admitted first",
    "r2, admitted last",
    "the request that needs the new block",
    "none: the request that needs a block waits until one is freed",
)


def demo_fcfs_victim() -> QuizRun:
    eng = _preemption_run(11)
    assert eng.events is not None  # build_engine logs events by default
    log = list(eng.events)
    i, pre, freed = _first_preemption(log)
    big = _preemption_run(200)
    snap = Timeline(log).at(pre.step - 1)
    got = next(e for e in log[i:] if isinstance(e, BlocksAllocated) and e.request_id == pre.for_request_id)
    verdict = {
        FCFS_CHOICES[0]: f"r0 keeps running: FCFS protects the oldest work (admission order {snap.running}).",
        FCFS_CHOICES[1]: f"{pre.request_id} is preempted at step {pre.step}: the last of the running list.",
        FCFS_CHOICES[2]: (
            f"{pre.for_request_id} needed the block"
            + (
                ", yet another request paid for it."
                if pre.for_request_id != pre.request_id
                else "; it is the victim only because it was admitted last."
            )
        ),
        FCFS_CHOICES[3]: (
            f"a running request does not wait for a block: in step {got.step} {pre.for_request_id} got block "
            f"{got.block_ids[0]}, "
            + (f"which {pre.request_id} had held." if got.block_ids[0] in freed.block_ids else "freed by the preemption.")
        ),
    }
    answer = FCFS_CHOICES[1] if pre.request_id == "r2" else FCFS_CHOICES[0]
    lines = [("✔ " if c == answer else "✘ ") + f"{c}: {verdict[c]}" for c in FCFS_CHOICES]
    lines += [
        f"What it costs {pre.request_id}: {len(freed.block_ids)} blocks freed, {pre.num_computed_tokens_lost} computed tokens lost; "
        f"waiting queue after, head first: {Timeline(log).at(pre.step).waiting} (vllm:num_preemptions = {eng.scheduler.num_preemptions}).",
    ]
    for rid in ("r0", "r1", "r2"):
        m, m0 = eng.metrics[rid], big.metrics[rid]
        assert m.e2e_latency is not None and m0.e2e_latency is not None  # both runs go to the end
        lines.append(
            f"  {rid}: latency {m.e2e_latency * 1000:.0f} ms (a big pool: {m0.e2e_latency * 1000:.0f} ms), "
            f"prefill tokens computed {m.prefill_tokens_computed} ({m0.prefill_tokens_computed})"
        )
    return QuizRun("\n".join(lines), answer)


SWAP_CHOICES = (
    "copies them to CPU memory, and back when it resumes",
    "frees them; what no cache holds any more is computed again when it resumes",
    "keeps them on the GPU, reserved until it resumes",
)


def demo_swap_to_cpu() -> QuizRun:
    from kvlab.config.kv_transfer import KVTransferConfig

    eng = _preemption_run(11)
    assert eng.events is not None  # build_engine logs events by default
    log = list(eng.events)
    i, pre, freed = _first_preemption(log)
    reused = next(e for e in log[i:] if isinstance(e, BlocksAllocated) and set(e.block_ids) & set(freed.block_ids))
    back = next(e for e in log[i:] if isinstance(e, RequestScheduled) and e.request_id == pre.request_id and e.phase == "resumed")
    copies = sum(isinstance(e, KVTransfer) for e in log)
    tier = _preemption_run(11, kv_transfer_config=KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 16}))
    assert tier.events is not None  # build_engine logs events by default
    back2 = next(e for e in tier.events if isinstance(e, RequestScheduled) and e.request_id == pre.request_id and e.phase == "resumed")
    verdict = {
        SWAP_CHOICES[0]: (
            f"no copy was made ({copies} KV transfers in the run). Swapping was the V0 engine's "
            "preemption_mode='swap' (V0 was the default before vLLM 0.8 and was removed in 0.11)."
        ),
        SWAP_CHOICES[1]: (
            f"{pre.request_id} gave its {len(freed.block_ids)} blocks back at step {pre.step} and lost "
            f"{pre.num_computed_tokens_lost} computed tokens; resuming at step {back.step}, it found "
            f"{back.num_cached_tokens} of them still cached and computed "
            f"{pre.num_computed_tokens_lost - back.num_cached_tokens} again."
        ),
        SWAP_CHOICES[2]: (
            f"nothing is reserved: {reused.request_id} got block(s) {sorted(set(reused.block_ids) & set(freed.block_ids))} "
            f"of {pre.request_id}'s at step {reused.step}."
        ),
    }
    answer = SWAP_CHOICES[1] if copies == 0 else SWAP_CHOICES[0]
    lines = [("✔ " if c == answer else "✘ ") + f"{c}: {verdict[c]}" for c in SWAP_CHOICES]
    lines.append(
        f"With a CPU tier behind the pool (the offloading connector, lesson 12), {pre.request_id}'s prompt blocks were "
        f"stored there when first computed: on resuming it loaded {back2.num_external_tokens} tokens from the tier "
        f"and found {back2.num_cached_tokens - back2.num_external_tokens} in the pool."
    )
    return QuizRun("\n".join(lines), answer)


def demo_cache_budget() -> str:
    doc = list(range(3000, 3000 + 160))
    lines = []
    for busy in (False, True):
        mgr = KVCacheManager(num_blocks=24, block_size=16)
        first = Request("doc-q1", doc + [1], max_tokens=1)
        _admit(mgr, first)
        mgr.free(first)
        if busy:
            other = Request("busy", list(range(9000, 9000 + 16 * 20)))
            _admit(mgr, other)
            mgr.free(other)
        again = Request("doc-q2", doc + [2])
        lines.append(
            f"{'busy' if busy else 'idle'} server: the document's second question hits {mgr.get_computed_blocks(again)[1]} of 160 tokens"
        )
    return (
        "\n".join(lines)
        + "\n→ Wrong: there is no separate cache memory. Cached blocks are free blocks that kept their hash; new work takes them from the head of the free queue."
    )


def demo_hash_own_tokens() -> str:
    from kvlab.utils.hashing import sha256

    block = list(range(16))
    mgr = KVCacheManager(num_blocks=16, block_size=16)
    a = Request("a", [1] * 16 + block + [7])
    _admit(mgr, a)
    b = Request("b", [2] * 16 + block + [7])
    n = mgr.get_computed_blocks(b)[1]
    return (
        f"block 2 of a: hash {a.block_hashes[1].hex()[:16]}…\n"
        f"block 2 of b: hash {b.block_hashes[1].hex()[:16]}…  (same 16 tokens, different first block)\n"
        f"b's prefix hit: {n} tokens\n"
        f"→ Wrong: each hash is {sha256.__name__}((parent hash, tokens, extra keys)), so one hash names the whole prefix."
    )


QUIZZES: dict[str, Quiz] = {
    q.id: q
    for q in [
        Quiz(
            "25_tokens",
            "Every request starts with the same 25 tokens (block size 16). How many of them come from the cache?",
            "16 — one full block; the last 9 are computed on every request because only full blocks are cached.",
            demo_25_tokens,
        ),
        Quiz(
            "two_tenants",
            "Two tenants send the same system prompt. What can one learn about the other, and what field stops it?",
            "They share blocks, so one tenant's TTFT reveals whether the other sent a prefix; a secret per-tenant cache_salt in the first block's hash means they never share a block.",
            demo_two_tenants,
        ),
        Quiz(
            "fcfs_victim",
            "Three equal requests, r0, r1 and r2, are admitted in that order and decode until no block "
            "is free. Under the default policy (fcfs), which one is preempted?",
            "The newest running request, r2: all its blocks are freed, its computed tokens drop to 0, it goes to the head "
            "of the waiting queue and is computed again later (vllm:num_preemptions counts it).",
            demo_fcfs_victim,
            choices=FCFS_CHOICES,
        ),
        Quiz(
            "swap_to_cpu",
            "A running request is preempted. What does vLLM 0.33 do with the KV blocks it held?",
            "It frees them and recomputes what no cache still holds when the request resumes; it never swaps (the V0 "
            "engine could, before vLLM 0.11). With KV offloading on (lesson 12), the victim's blocks that the CPU tier "
            "stored are loaded back instead of recomputed.",
            demo_swap_to_cpu,
            choices=SWAP_CHOICES,
        ),
        Quiz(
            "cache_budget",
            "True or false: the prefix cache has its own memory budget.",
            "False: the cache is the pool; a busy server keeps fewer old prefixes.",
            demo_cache_budget,
            wrong_answer=True,
        ),
        Quiz(
            "hash_own_tokens",
            "True or false: a block hash covers only its own 16 tokens.",
            "False: it is chained with the parent's hash and covers adapter, images and salt too.",
            demo_hash_own_tokens,
            wrong_answer=True,
        ),
    ]
}


def quiz(quiz_id: str):
    """A question with a "Reveal (runs the engine)" button; a choice quiz is a prediction instead:
    pick an answer and lock it in, and only then does the engine run's verdict show."""
    q = QUIZZES[quiz_id]
    if q.choices:
        from kvlab.learner.prediction import predict

        guess = predict(q.question, choices=list(q.choices), id=f"quiz:{q.id}")
        with guess.reveal():
            run = q.demo()
            print(run)
            print(f"\nAnswer: {q.answer}")
            guess.result = getattr(run, "result", None)
        return None
    import ipywidgets as w

    out = w.Output()
    button = w.Button(description="Reveal — run the engine", button_style="warning", layout=w.Layout(width="240px"))

    def reveal(_=None) -> None:
        button.disabled = True
        with out:
            print(q.demo())
            print(f"\nAnswer: {q.answer}")

    button.on_click(reveal)
    label = "Claim" if q.wrong_answer else "Question"
    still = f"{label}: {q.question} (run the cell to answer it and reveal)"

    head = f"<b>{label}:</b> {q.question}<br><i>Answer it first, then reveal.</i>"

    class QuizBox(w.VBox):
        """Displayed with a still (the question as text): a saved or never-run lesson shows
        the question, not ``VBox(children=…`` or "model not found"."""

        def _repr_mimebundle_(self, **kwargs: object) -> object:
            bundle = super()._repr_mimebundle_(**kwargs)
            if isinstance(bundle, dict):
                bundle["text/plain"] = still
            return bundle

        def _ipython_display_(self) -> None:
            from kvlab.viz.still import display_with_still

            display_with_still(
                self,
                {
                    "text/html": f"<div>{head}<br><span style='color:#666'>(run the cell to reveal the answer)</span></div>",
                    "text/plain": still,
                },
            )

    return QuizBox([w.HTML(head), button, out])
