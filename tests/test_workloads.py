"""Tests for kvlab.workloads: seeded traces whose statistics and sharing are exact."""

from __future__ import annotations

import hashlib
import math
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.workloads import traces as W
from kvlab.workloads.traces import (
    BYTE_VOCAB,
    Trace,
    TraceRequest,
    alpaca_like,
    document_qa,
    from_lengths,
    multi_tenant,
    multi_turn,
    shared_system_prompt_chat,
    sharegpt_like,
    tenant_salt,
)

# One small call per generator; determinism and validation tests loop over these.
GENERATORS = {
    "sharegpt_like": lambda seed, **kw: sharegpt_like(40, seed, **kw),
    "alpaca_like": lambda seed, **kw: alpaca_like(40, seed, **kw),
    "shared_system_prompt_chat": lambda seed, **kw: shared_system_prompt_chat(20, seed, **kw),
    "document_qa": lambda seed, **kw: document_qa(3, 4, seed, doc_len=300, **kw),
    "multi_turn": lambda seed, **kw: multi_turn(4, 3, seed, **kw),
    "multi_tenant": lambda seed, **kw: multi_tenant(3, 20, seed, salted=True, **kw),
}


@pytest.fixture(scope="module")
def sharegpt_10k() -> Trace:
    return sharegpt_like(10_000, 0)


# ---------------------------------------------------------------------------- lengths


def test_sharegpt_means_match_the_paper(sharegpt_10k: Trace) -> None:
    s = sharegpt_10k.stats()
    assert s.count == 10_000
    assert s.mean_input == pytest.approx(161.31, rel=0.03)
    assert s.mean_output == pytest.approx(337.99, rel=0.03)


def test_alpaca_means_match_the_paper() -> None:
    s = alpaca_like(10_000, 0).stats()
    assert s.mean_input == pytest.approx(19.31, rel=0.03)
    assert s.mean_output == pytest.approx(58.45, rel=0.03)


def test_sharegpt_tail_is_heavier_than_exponential(sharegpt_10k: Trace) -> None:
    # For an exponential distribution p99 / median = ln(100) / ln(2) = 6.64. A heavy-tailed
    # trace has rare very long requests: its ratio is larger, and its max dwarfs its mean.
    s = sharegpt_10k.stats()
    exponential_ratio = math.log(100) / math.log(2)
    assert s.p99_input / s.p50_input > exponential_ratio
    assert s.p99_output / s.p50_output > exponential_ratio
    assert s.max_input > 5 * s.mean_input
    assert s.max_output > 4 * s.mean_output
    # ShareGPT: inputs about 8x and outputs about 6x those of Alpaca (paper: 8.4x, 5.8x).
    a = alpaca_like(2_000, 0).stats()
    assert 6 < s.mean_input / a.mean_input < 11
    assert 4.5 < s.mean_output / a.mean_output < 7


def test_lengths_fit_the_model(sharegpt_10k: Trace) -> None:
    assert all(r.prompt_len >= 1 and r.max_tokens >= 1 for r in sharegpt_10k)
    assert max(r.total_len for r in sharegpt_10k) <= 2048
    short = sharegpt_like(2_000, 3, max_model_len=512)
    assert max(r.total_len for r in short) <= 512
    # Clipping does not drag the means down: the log-normal is calibrated on clipped means.
    assert short.stats().mean_input == pytest.approx(161.31, rel=0.06)


def test_poisson_arrivals(sharegpt_10k: Trace) -> None:
    times = [r.arrival_time for r in sharegpt_10k]
    assert times[0] == 0.0
    assert times == sorted(times)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 2.0, rel=0.05)  # default 2 req/s
    assert gaps.std() == pytest.approx(1 / 2.0, rel=0.08)  # exponential: std == mean
    assert all(r.arrival_time == 0.0 for r in sharegpt_like(10, 1, rate=None))


def test_stats_match_numpy() -> None:
    trace = sharegpt_like(501, 7)
    ins = np.array(trace.input_lengths())
    outs = np.array(trace.output_lengths())
    s = trace.stats()
    assert s.p50_input == pytest.approx(np.percentile(ins, 50))
    assert s.p90_input == pytest.approx(np.percentile(ins, 90))
    assert s.p99_output == pytest.approx(np.percentile(outs, 99))
    assert s.total_input_tokens == ins.sum() and s.total_output_tokens == outs.sum()
    assert s.total_tokens == ins.sum() + outs.sum()
    assert s.max_input == ins.max() and s.max_output == outs.max()
    assert s.duration_s == pytest.approx(trace[-1].arrival_time)
    assert "501 requests" in trace.summary()


# ---------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", GENERATORS)
def test_same_seed_same_trace_other_seed_other_trace(name: str) -> None:
    make = GENERATORS[name]
    a, b, c = make(11), make(11), make(12)
    assert a == b
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert a != c
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_first_requests_do_not_depend_on_n() -> None:
    # Separate random streams per purpose: a longer trace extends a shorter one.
    assert sharegpt_like(50, 4).requests == sharegpt_like(80, 4).requests[:50]


def test_vocabulary_only_changes_token_ids() -> None:
    big = sharegpt_like(30, 5)
    small = sharegpt_like(30, 5, vocab=BYTE_VOCAB)
    assert big.input_lengths() == small.input_lengths()
    assert [r.arrival_time for r in big] == [r.arrival_time for r in small]
    assert all(0 <= t <= 255 for r in small for t in r.prompt_token_ids)
    printable = sharegpt_like(30, 5, vocab=range(32, 127))
    assert all(32 <= t < 127 for r in printable for t in r.prompt_token_ids)


def test_unrelated_prompts_share_nothing() -> None:
    trace = sharegpt_like(300, 2)
    firsts = {tuple(r.prompt_token_ids[:4]) for r in trace if r.prompt_len >= 4}
    assert len(firsts) == sum(r.prompt_len >= 4 for r in trace)
    assert all(r.shared_prefix_len == 0 for r in trace)


# ---------------------------------------------------------------------------- sharing


def test_shared_system_prompt_is_exactly_shared() -> None:
    trace = shared_system_prompt_chat(30, 1, system_prompt_len=100)
    system = trace[0].prompt_token_ids[:100]
    for r in trace:
        assert r.prompt_token_ids[:100] == system
        assert r.prompt_len > 100 and r.shared_prefix_len == 100
        assert r.total_len <= 2048
    user_parts = {tuple(r.prompt_token_ids[100:104]) for r in trace if r.prompt_len >= 104}
    assert len(user_parts) == sum(r.prompt_len >= 104 for r in trace)  # the rest is unique


def test_document_qa_shares_each_document() -> None:
    trace = document_qa(3, 5, 2, doc_len=200)
    assert len(trace) == 15
    by_doc: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_doc.setdefault(r.group, []).append(r)
    assert sorted(by_doc) == ["doc0", "doc1", "doc2"]
    docs = []
    for group, reqs in by_doc.items():
        assert len(reqs) == 5
        doc = reqs[0].prompt_token_ids[:200]
        assert all(r.prompt_token_ids[:200] == doc and r.shared_prefix_len == 200 for r in reqs)
        assert all(r.request_id.startswith(group + "-q") for r in reqs)
        docs.append(doc)
    assert all(a[:16] != b[:16] for a, b in combinations(docs, 2))
    # Interleaved (default) vs grouped order.
    grouped = document_qa(3, 5, 2, doc_len=200, interleave=False)
    assert [r.group for r in grouped] == ["doc0"] * 5 + ["doc1"] * 5 + ["doc2"] * 5
    assert [r.group for r in trace] != [r.group for r in grouped]


def test_multi_turn_resends_the_whole_history() -> None:
    trace = multi_turn(5, 4, 3, system_prompt_len=32)
    conversations: dict[str, list[TraceRequest]] = {}
    for r in trace:
        conversations.setdefault(r.group, []).append(r)
    assert len(conversations) == 5
    system = trace[0].prompt_token_ids[:32]
    for turns in conversations.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("-t", 1)[1]))
        assert [r.request_id.rsplit("-t", 1)[1] for r in turns] == ["0", "1", "2", "3"]
        assert turns[0].prompt_token_ids[:32] == system and turns[0].shared_prefix_len == 32
        for prev, nxt in zip(turns, turns[1:]):
            history = prev.prompt_token_ids + prev.output_token_ids
            assert nxt.prompt_token_ids[: len(history)] == history
            assert nxt.prompt_len > len(history)  # plus a new user turn
            assert nxt.shared_prefix_len == len(history)
            assert nxt.arrival_time > prev.arrival_time
        for r in turns:
            assert len(r.output_token_ids) == r.max_tokens
            assert r.total_len <= 2048
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)


def test_multi_turn_stops_a_conversation_that_no_longer_fits() -> None:
    trace = multi_turn(3, 50, 0, max_model_len=300)
    assert all(r.total_len <= 300 for r in trace)
    assert len(trace) < 150  # conversations ended early
    assert all(r.max_tokens >= 1 for r in trace)


def test_multi_tenant_prefixes_are_shared_across_tenants() -> None:
    trace = multi_tenant(4, 60, 1, shared_prefix_len=64)
    assert all(r.cache_salt is None for r in trace)
    tenants_per_prefix: dict[str, set[str]] = {}
    for r in trace:
        tenants_per_prefix.setdefault(r.group, set()).add(r.tenant)
    popular = max(tenants_per_prefix, key=lambda g: len(tenants_per_prefix[g]))
    assert len(tenants_per_prefix[popular]) >= 2
    same = [r for r in trace if r.group == popular]
    assert all(r.prompt_token_ids[:64] == same[0].prompt_token_ids[:64] for r in same)
    assert {r.tenant for r in trace} == {"tenant0", "tenant1", "tenant2", "tenant3"}
    counts = {g: sum(r.group == g for r in trace) for g in tenants_per_prefix}
    assert counts["prefix0"] == max(counts.values())  # weight 1/(j+1): prefix0 most popular


def test_salted_tenants_have_distinct_unguessable_salts() -> None:
    trace = multi_tenant(5, 80, 9, salted=True)
    salt_of: dict[str, str] = {}
    for r in trace:
        assert salt_of.setdefault(r.tenant, r.cache_salt) == r.cache_salt  # one salt per tenant
    assert len(salt_of) == 5 and len(set(salt_of.values())) == 5
    for i in range(5):
        name = f"tenant{i}"
        salt = salt_of[name]
        assert salt == tenant_salt(9, i)
        assert len(salt) == 32 and int(salt, 16) >= 0  # 128 bits of hex
        assert name not in salt and str(i) != salt
        # Nothing an attacker can compute from public facts (name, index) gives the salt.
        for guess in (name, str(i)):
            assert salt not in (hashlib.sha256(guess.encode()).hexdigest()[:32], hashlib.md5(guess.encode()).hexdigest())
    # The key is the seed: another seed, other salts for the very same tenant names.
    other = {r.tenant: r.cache_salt for r in multi_tenant(5, 80, 10, salted=True)}
    assert all(other[t] != salt_of[t] for t in other)


def test_guessable_salt_scheme_uses_the_name() -> None:
    trace = multi_tenant(3, 10, 0, salted=True, salt_scheme="name")
    assert all(r.cache_salt == r.tenant for r in trace)


# ---------------------------------------------------------------------------- records


def test_from_lengths_builds_exact_requests() -> None:
    trace = from_lengths([(2, 3), (4, 1, 5.0), (3, 2, 1.0)], vocab=BYTE_VOCAB)
    assert [r.request_id for r in trace] == ["r0", "r2", "r1"]  # sorted by arrival
    assert [(r.prompt_len, r.max_tokens, r.arrival_time) for r in trace] == [(2, 3, 0.0), (3, 2, 1.0), (4, 1, 5.0)]
    assert trace == from_lengths([(2, 3), (4, 1, 5.0), (3, 2, 1.0)], vocab=BYTE_VOCAB)


def test_trace_is_list_like() -> None:
    trace = sharegpt_like(10, 0)
    assert len(trace) == 10
    assert trace[0].request_id == "sg0" and trace[-1].request_id == "sg9"
    head = trace[:3]
    assert isinstance(head, Trace) and len(head) == 3 and head.seed == 0
    assert [r.request_id for r in trace] == [f"sg{i}" for i in range(10)]
    assert trace[4] in trace
    assert "10 requests" in repr(trace)
    assert "tokens)" in repr(trace[0])  # short repr, not thousands of ids


def test_to_request_builds_the_engine_request() -> None:
    r = TraceRequest("x", [5, 6, 7], 4, 1.5, cache_salt="s", lora_name="l", priority=2)
    req = r.to_request(eos_token_id=9)
    assert req.request_id == "x" and list(req.prompt_token_ids) == [5, 6, 7]
    assert (req.max_tokens, req.cache_salt, req.lora_name, req.priority, req.arrival_time) == (4, "s", "l", 2, 1.5)
    assert req.eos_token_id == 9
    reqs = multi_tenant(2, 3, 0, salted=True).to_requests()
    assert [q.cache_salt for q in reqs] == [t.cache_salt for t in multi_tenant(2, 3, 0, salted=True)]


# ---------------------------------------------------------------------------- bad input

BAD_CALLS = [
    (lambda: sharegpt_like(0, 0), ValueError, "n=0"),
    (lambda: sharegpt_like(-3, 0), ValueError, "n=-3"),
    (lambda: alpaca_like(5, 0, rate=0), ValueError, "rate"),
    (lambda: sharegpt_like(5, 0, rate=-1.0), ValueError, "rate"),
    (lambda: sharegpt_like(5, 0, vocab=1), ValueError, "vocab"),
    (lambda: sharegpt_like(5, 0, vocab=range(-5, 5)), ValueError, "vocab"),
    (lambda: sharegpt_like(5, 0, max_model_len=400), ValueError, "max_model_len"),
    (lambda: sharegpt_like(5, 0, input_sigma=0), ValueError, "input_sigma"),
    (lambda: sharegpt_like(5, "0"), TypeError, "seed"),
    (lambda: sharegpt_like(5.0, 0), TypeError, "n"),
    (lambda: shared_system_prompt_chat(5, 0, system_prompt_len=2047), ValueError, "system_prompt_len"),
    (lambda: shared_system_prompt_chat(5, 0, system_prompt_len=0), ValueError, "system_prompt_len"),
    (lambda: document_qa(0, 3, 0), ValueError, "num_docs"),
    (lambda: document_qa(2, 0, 0), ValueError, "questions_per_doc"),
    (lambda: document_qa(2, 2, 0, doc_len=4096), ValueError, "doc_len"),
    (lambda: multi_turn(0, 3, 0), ValueError, "num_conversations"),
    (lambda: multi_turn(2, 0, 0), ValueError, "turns"),
    (lambda: multi_turn(2, 2, 0, think_time=-1), ValueError, "think_time"),
    (lambda: multi_tenant(0, 5, 0), ValueError, "num_tenants"),
    (lambda: multi_tenant(2, 0, 0), ValueError, "n=0"),
    (lambda: multi_tenant(2, 5, 0, salted=True, salt_scheme="md5"), ValueError, "salt_scheme"),
    (lambda: multi_tenant(2, 5, 0, num_prefixes=0), ValueError, "num_prefixes"),
    (lambda: from_lengths([]), ValueError, "lengths"),
    (lambda: from_lengths([(0, 3)]), ValueError, "prompt_len"),
    (lambda: from_lengths([(3, 0)]), ValueError, "output_len"),
    (lambda: from_lengths([(3, 1, -1.0)]), ValueError, "arrival_time"),
    (lambda: tenant_salt(0, -1), ValueError, "tenant_index"),
    (lambda: TraceRequest("a", [], 3), ValueError, "prompt_token_ids"),
    (lambda: TraceRequest("a", [1], 0), ValueError, "max_tokens"),
    (lambda: TraceRequest("a", [1], 2, output_token_ids=[1]), ValueError, "output_token_ids"),
    (lambda: TraceRequest("a", [1], 2, shared_prefix_len=2), ValueError, "shared_prefix_len"),
    (lambda: Trace("empty", []).stats(), ValueError, "empty"),
]


@pytest.mark.parametrize("call,exc,needle", BAD_CALLS, ids=[c[2] for c in BAD_CALLS])
def test_bad_input_names_the_argument(call, exc, needle) -> None:
    with pytest.raises(exc, match=needle):
        call()


# ---------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32), n=st.integers(1, 30), max_model_len=st.integers(64, 4096), rate=st.one_of(st.none(), st.floats(0.1, 100))
)
def test_independent_traces_always_fit(seed: int, n: int, max_model_len: int, rate: float | None) -> None:
    mean_in, mean_out = min(161.31, max_model_len / 4), min(337.99, max_model_len / 4)
    trace = sharegpt_like(n, seed, rate=rate, max_model_len=max_model_len, mean_input=mean_in, mean_output=mean_out)
    assert len(trace) == n
    assert all(1 <= r.prompt_len and 1 <= r.max_tokens and r.total_len <= max_model_len for r in trace)
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), k=st.integers(1, 200), n=st.integers(1, 12))
def test_shared_prefix_property(seed: int, k: int, n: int) -> None:
    for trace in (
        shared_system_prompt_chat(n, seed, system_prompt_len=k, vocab=BYTE_VOCAB),
        multi_tenant(2, n, seed, shared_prefix_len=k, num_prefixes=1),
    ):
        first = trace[0].prompt_token_ids[:k]
        assert all(r.prompt_token_ids[:k] == first and r.shared_prefix_len == k for r in trace)


def test_module_has_no_torch() -> None:
    src = open(W.__file__, encoding="utf-8").read()
    assert "import torch" not in src
