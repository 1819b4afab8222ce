"""Quizzes with a reveal: each answer is *shown by running the engine*, not just stated.

Follow-up questions on the KV cache and the classic wrong answers interviewers hear. In a
notebook, ``quiz("25_tokens")`` shows the question and a button; the button runs the demo
(a real engine run) and prints what happened next to the answer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.cost_model import CostModel
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.request import Request


@dataclass
class Quiz:
    id: str
    question: str
    answer: str
    demo: Callable[[], str]
    wrong_answer: bool = False  # the question states a classic wrong answer to refute


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
    return "\n".join(lines) + "\n→ 16: one full block. Tokens 16–24 sit in a partial block, which has no hash, so every request computes them."


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
        out.append(
            f"{'salted  ' if salted else 'unsalted'}: attacker's prefix hit = {m.num_cached_tokens} tokens, "
            f"simulated TTFT = {m.ttft * 1000:.1f} ms"
        )
    return "\n".join(out) + "\n→ Without salts the attacker's TTFT drops when its guess matches what the victim sent: a timing side channel. Per-tenant secret salts make the chains differ from block 0, so nothing is shared."


def _preemption_engine(num_blocks: int) -> tuple[LLMEngine, list[Request]]:
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=4, event_log=None)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    eng = LLMEngine(mgr, sched, SimulatedExecutor(vocab_size=500), CostModel())
    reqs = [Request(f"r{i}", [100 * i + j for j in range(8)], max_tokens=12, arrival_time=float(i)) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    return eng, reqs


def demo_fcfs_victim() -> str:
    eng, reqs = _preemption_engine(num_blocks=11)
    first = None
    while eng.has_unfinished_requests():
        res = eng.step()
        if res.scheduler_output.preempted_req_ids and first is None:
            first = (res.step, sorted(res.scheduler_output.preempted_req_ids), [r.request_id for r in eng.scheduler.waiting])
    big, _ = _preemption_engine(num_blocks=200)
    big.run()
    lines = [
        f"step {first[0]}: preempted {first[1]} (admitted last); waiting queue now {first[2]} — the victim is at the head",
        f"vllm:num_preemptions = {eng.scheduler.num_preemptions}",
    ]
    for r in reqs:
        m, m0 = eng.metrics[r.request_id], big.metrics[r.request_id]
        lines.append(
            f"{r.request_id}: {r.num_preemptions} preemption(s), latency {m.e2e_latency * 1000:.0f} ms vs {m0.e2e_latency * 1000:.0f} ms in a big pool; "
            f"prefill tokens computed {m.prefill_tokens_computed} vs {m0.prefill_tokens_computed}"
        )
    return "\n".join(lines) + "\n→ The newest running request; all its blocks are freed, it waits at the head of the queue and its tokens are computed again."


def demo_swap_to_cpu() -> str:
    eng, reqs = _preemption_engine(num_blocks=11)
    while eng.has_unfinished_requests():
        free_before = eng.kv_cache_manager.block_pool.get_num_free_blocks()
        res = eng.step()
        if res.scheduler_output.preempted_req_ids:
            rid = sorted(res.scheduler_output.preempted_req_ids)[0]
            r = next(x for x in reqs if x.request_id == rid)
            return (
                f"{rid} was preempted at step {res.step}: num_computed_tokens = {r.num_computed_tokens}, "
                f"blocks held = {eng.kv_cache_manager.get_block_ids(rid)}, status = {r.status.name}.\n"
                "Nothing was copied anywhere: its blocks went back to the free queue (their hashes survive "
                "there as prefix-cache entries), and when it resumes its tokens are recomputed (minus what still hits).\n"
                "→ Wrong: vLLM V1 preempts by recompute, never by swapping (the older V0 engine could swap to CPU). "
                "With KV offloading on (lesson 12), though, the victim's prompt blocks that the CPU tier already holds "
                "are loaded back when it resumes, instead of being recomputed."
            )
    return "no preemption happened"  # pragma: no cover


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
        lines.append(f"{'busy' if busy else 'idle'} server: the document's second question hits {mgr.get_computed_blocks(again)[1]} of 160 tokens")
    return "\n".join(lines) + "\n→ Wrong: there is no separate cache memory. Cached blocks are free blocks that kept their hash; new work takes them from the head of the free queue."


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
        Quiz("25_tokens", "Every request starts with the same 25 tokens (block size 16). How many of them come from the cache?",
             "16 — one full block; the last 9 are computed on every request because only full blocks are cached.", demo_25_tokens),
        Quiz("two_tenants", "Two tenants send the same system prompt. What can one learn about the other, and what field stops it?",
             "They share blocks, so one tenant's TTFT reveals whether the other sent a prefix; a secret per-tenant cache_salt in the first block's hash means they never share a block.", demo_two_tenants),
        Quiz("fcfs_victim", "Under the default policy, which request does vLLM preempt when no block is free, and what does it cost?",
             "The newest running request: all its blocks are freed, it goes to the head of the waiting queue, and its tokens are computed again (vllm:num_preemptions counts it).", demo_fcfs_victim),
        Quiz("swap_to_cpu", "True or false: vLLM swaps preempted requests to CPU memory.",
             "False for the current engine: it preempts by recompute, never swaps. With KV offloading on (lesson 12), what the "
             "CPU tier already holds of the victim is loaded back when it resumes.", demo_swap_to_cpu, wrong_answer=True),
        Quiz("cache_budget", "True or false: the prefix cache has its own memory budget.",
             "False: the cache is the pool; a busy server keeps fewer old prefixes.", demo_cache_budget, wrong_answer=True),
        Quiz("hash_own_tokens", "True or false: a block hash covers only its own 16 tokens.",
             "False: it is chained with the parent's hash and covers adapter, images and salt too.", demo_hash_own_tokens, wrong_answer=True),
    ]
}


def quiz(quiz_id: str):
    """A question with a "Reveal (runs the engine)" button."""
    q = QUIZZES[quiz_id]
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

            display_with_still(self, {"text/html": f"<div>{head}<br><span style='color:#666'>(run the cell to reveal the answer)"
                                                   "</span></div>", "text/plain": still})

    return QuizBox([w.HTML(head), button, out])
