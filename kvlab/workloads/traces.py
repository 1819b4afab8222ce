"""Seeded request traces: the workloads that the lessons, the simulator and the tests replay.

A serving engine's memory behaviour depends less on the model than on *what arrives*: how
long the prompts and answers are, how heavy the tail is, and which requests share their
first tokens. Every generator here turns a few numbers plus a ``seed`` into a
:class:`Trace` of :class:`TraceRequest` records, and the same arguments always give the same
trace (on any machine: only :mod:`random`, :mod:`hashlib` and :mod:`hmac` are used).

The generators, and the lesson each one is for:

* :func:`sharegpt_like`, :func:`alpaca_like` - independent chat requests with heavy-tailed
  lengths whose means match the traces of the PagedAttention paper (Kwon et al., SOSP 2023):
  ShareGPT 161.31 input / 337.99 output tokens, Alpaca 19.31 / 58.45. Used to reproduce the
  paper's memory-waste figure (``kvlab.workloads.memory_sim``). The paper gives no standard deviations, so
  the spreads (``input_sigma``, ``output_sigma``) are our choice, stated where defined.
* :func:`shared_system_prompt_chat` - every request opens with the same system prompt: the
  textbook prefix-cache win.
* :func:`document_qa` - many questions about the same long document(s).
* :func:`multi_turn` - chat sessions that resend the whole history each turn.
* :func:`multi_tenant` - tenants whose prompts share popular prefixes, optionally isolated by
  a secret per-tenant ``cache_salt``.
* :func:`from_lengths` - a trace from explicit (prompt, output) lengths, for hand-made
  examples whose memory use you can work out on paper.

Conventions shared by all generators:

* ``max_tokens`` is the request's *true* output length: a trace request always generates
  exactly that many tokens (there is no end-of-sequence token among the generated ids). The
  memory simulator relies on it; ``Orca(Oracle)`` is "knows max_tokens in advance".
* Token ids are drawn uniformly from ``vocab``: an ``int`` V means ids ``0 .. V-1`` (default
  32,000, a Llama-sized vocabulary), a ``range`` gives any id range. Pass
  ``vocab=BYTE_VOCAB`` (ids 0-255) to feed a trace to kvlab's byte-level toy model, whose
  special tokens (``<bos>``, ``<eos>``, ``<pad>``) lie above 255 and are never drawn.
  Random ids mean unrelated prompts share nothing a prefix cache could find (two prompts
  agreeing on a whole 16-token block by chance has odds of V**-16); everything that *is*
  shared is shared on purpose, and ``TraceRequest.shared_prefix_len`` says how much.
* Arrivals form a Poisson process at ``rate`` requests per second (``rate=None``: everything
  arrives at t = 0). The first request arrives at t = 0.
* Every prompt plus its output fits in ``max_model_len`` tokens (default 2,048, the OPT-13B
  setting of the paper).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal, overload

from kvlab.utils.checks import check_int, check_number

if TYPE_CHECKING:  # only for type checkers: the engine's Request is imported lazily
    from kvlab.request import Request

__all__ = [
    "ALPACA_MEAN_INPUT",
    "ALPACA_MEAN_OUTPUT",
    "BYTE_VOCAB",
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_VOCAB",
    "SHAREGPT_MEAN_INPUT",
    "SHAREGPT_MEAN_OUTPUT",
    "Trace",
    "TraceRequest",
    "TraceStats",
    "alpaca_like",
    "document_qa",
    "from_lengths",
    "multi_tenant",
    "multi_turn",
    "sharegpt_like",
    "shared_system_prompt_chat",
    "percentile",
    "tenant_salt",
]

# Trace statistics from the PagedAttention paper (Kwon et al., SOSP 2023, Sec. 6.1).
SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
ALPACA_MEAN_INPUT = 19.31
ALPACA_MEAN_OUTPUT = 58.45

DEFAULT_MAX_MODEL_LEN = 2048  # OPT-13B's context length, the paper's setting
DEFAULT_VOCAB = 32_000
BYTE_VOCAB = range(256)  # kvlab's byte tokenizer: one id per UTF-8 byte

# Log-normal spreads (sigma of log length). Not from the paper, which gives no spread for
# its traces, only "higher variance" for ShareGPT. With these values the p99 of a ShareGPT
# length is about 7-10x its median - more than an exponential's 6.6x - and Alpaca's
# instructions stay short and tight.
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.9
ALPACA_INPUT_SIGMA = 0.6
ALPACA_OUTPUT_SIGMA = 0.8

Vocab = int | range


# --------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------


@dataclass(slots=True, repr=False)
class TraceRequest:
    """One request of a trace: what a client sends, plus what the trace knows about it.

    The first eight fields mirror the engine's ``kvlab.Request`` so that :meth:`to_request`
    is a plain copy. The rest is ground truth the engine never sees but a lesson wants:

    * ``tenant`` - who sent it (multi-tenant traces).
    * ``output_token_ids`` - the scripted answer, when the workload fixes it (multi-turn:
      the answer of turn k is part of the prompt of turn k+1, so the trace must know it).
      Feed these to ``Scheduler.update_from_output`` to replay the conversation exactly.
    * ``group`` - the document, conversation or popular prefix the request belongs to.
    * ``shared_prefix_len`` - how many leading prompt tokens were built to be shared with
      other requests (system prompt, document, conversation history). The best possible
      prefix-cache hit for block size B is that length rounded down to a multiple of B
      (and at most ``prompt_len - 1``, since the last prompt token is always computed).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    cache_salt: str | None = None
    lora_name: str | None = None
    priority: int = 0
    tenant: str | None = None
    output_token_ids: list[int] | None = None
    group: str | None = None
    shared_prefix_len: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of {self.request_id!r} is empty; a request needs >= 1 token")
        self.max_tokens = check_int(f"max_tokens of {self.request_id!r}", self.max_tokens, 1)
        if not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise ValueError(f"arrival_time of {self.request_id!r} is {self.arrival_time!r}; it must be finite and >= 0")
        if not 0 <= self.shared_prefix_len <= len(self.prompt_token_ids):
            raise ValueError(
                f"shared_prefix_len of {self.request_id!r} is {self.shared_prefix_len}; "
                f"it must lie in 0..{len(self.prompt_token_ids)} (the prompt length)"
            )
        if self.output_token_ids is not None and len(self.output_token_ids) != self.max_tokens:
            raise ValueError(
                f"output_token_ids of {self.request_id!r} has {len(self.output_token_ids)} ids; "
                f"it must have exactly max_tokens={self.max_tokens}"
            )

    def __repr__(self) -> str:
        # Prompts run to thousands of ids; a notebook wants the shape, not the numbers.
        head = ", ".join(map(str, self.prompt_token_ids[:4]))
        more = ", ..." if len(self.prompt_token_ids) > 4 else ""
        extras = "".join(
            f", {name}={getattr(self, name)!r}"
            for name in ("cache_salt", "lora_name", "tenant", "group")
            if getattr(self, name) is not None
        )
        if self.priority:
            extras += f", priority={self.priority}"
        if self.shared_prefix_len:
            extras += f", shared_prefix_len={self.shared_prefix_len}"
        return (
            f"TraceRequest({self.request_id!r}, prompt=[{head}{more}] ({self.prompt_len} tokens), "
            f"max_tokens={self.max_tokens}, arrival_time={self.arrival_time}{extras})"
        )

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        """Prompt plus output tokens: the KV slots the request fills by the time it finishes."""
        return len(self.prompt_token_ids) + self.max_tokens

    def to_request(self, *, eos_token_id: int | None = None) -> Request:
        """Build the engine's ``kvlab.Request`` for this trace entry.

        The import happens here, not at module level, so traces can be generated (and the
        simulator run) without loading the engine at all.
        """
        from kvlab.request import Request

        return Request(
            self.request_id,
            list(self.prompt_token_ids),
            max_tokens=self.max_tokens,
            eos_token_id=eos_token_id,
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
            priority=self.priority,
            arrival_time=self.arrival_time,
        )


@dataclass(slots=True)
class TraceStats:
    """Summary of a trace's lengths. Percentiles interpolate linearly between order
    statistics (numpy's default), so they can be checked against ``numpy.percentile``."""

    count: int
    mean_input: float
    mean_output: float
    p50_input: float
    p90_input: float
    p99_input: float
    max_input: int
    p50_output: float
    p90_output: float
    p99_output: float
    max_output: int
    total_input_tokens: int
    total_output_tokens: int
    total_tokens: int
    duration_s: float  # last arrival minus first arrival


@dataclass(slots=True, repr=False)
class Trace(Sequence[TraceRequest]):
    """An ordered list of :class:`TraceRequest` (by arrival time) plus how it was made.

    Behaves like a read-only list: ``len(trace)``, ``trace[3]``, ``trace[:10]`` (another
    ``Trace``), iteration. ``params`` records the generator's arguments so that a printed
    trace says where it came from. Two traces compare equal when every field matches,
    which is how the tests check determinism.
    """

    name: str
    requests: list[TraceRequest]
    seed: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self.requests)} requests, seed={self.seed})"

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @overload
    def __getitem__(self, index: int) -> TraceRequest: ...

    @overload
    def __getitem__(self, index: slice) -> Trace: ...

    def __getitem__(self, index: int | slice) -> TraceRequest | Trace:
        if isinstance(index, slice):
            return Trace(self.name, self.requests[index], self.seed, dict(self.params))
        return self.requests[index]

    def input_lengths(self) -> list[int]:
        return [len(r.prompt_token_ids) for r in self.requests]

    def output_lengths(self) -> list[int]:
        return [r.max_tokens for r in self.requests]

    def stats(self) -> TraceStats:
        """Count, means, percentiles and totals of the input and output lengths."""
        if not self.requests:
            raise ValueError("stats() of an empty trace: it has no lengths to summarise")
        ins = sorted(self.input_lengths())
        outs = sorted(self.output_lengths())
        n = len(ins)
        times = [r.arrival_time for r in self.requests]
        return TraceStats(
            count=n,
            mean_input=sum(ins) / n,
            mean_output=sum(outs) / n,
            p50_input=percentile(ins, 50),
            p90_input=percentile(ins, 90),
            p99_input=percentile(ins, 99),
            max_input=ins[-1],
            p50_output=percentile(outs, 50),
            p90_output=percentile(outs, 90),
            p99_output=percentile(outs, 99),
            max_output=outs[-1],
            total_input_tokens=sum(ins),
            total_output_tokens=sum(outs),
            total_tokens=sum(ins) + sum(outs),
            duration_s=max(times) - min(times),
        )

    def summary(self) -> str:
        """A two-line human-readable description (what the bench and notebooks print)."""
        s = self.stats()
        return (
            f"{self.name} (seed {self.seed}): {s.count} requests over {s.duration_s:.1f} s, "
            f"{s.total_tokens:,} tokens\n"
            f"  input  mean {s.mean_input:7.2f}  p50 {s.p50_input:6.0f}  p99 {s.p99_input:6.0f}  max {s.max_input}\n"
            f"  output mean {s.mean_output:7.2f}  p50 {s.p50_output:6.0f}  p99 {s.p99_output:6.0f}  max {s.max_output}"
        )

    def to_requests(self, *, eos_token_id: int | None = None) -> list[Request]:
        """Every entry as an engine ``Request``, in arrival order."""
        return [r.to_request(eos_token_id=eos_token_id) for r in self.requests]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of already sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile() of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} must lie in 0..100")
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


# --------------------------------------------------------------------------------------
# Argument checks (raised before anything is generated)
# --------------------------------------------------------------------------------------


def _check_rate(rate: float | None) -> float | None:
    if rate is None or rate == math.inf:
        return None
    return check_number("rate", rate, 0, strict=True)


def _vocab_range(vocab: Vocab) -> range:
    if isinstance(vocab, range):
        r = vocab
    else:
        try:
            r = range(check_int("vocab", vocab))
        except TypeError:
            raise TypeError(f"vocab must be an int (ids 0..vocab-1) or a range, got {type(vocab).__name__}") from None
    if len(r) < 2:
        raise ValueError(f"vocab={vocab!r} holds {len(r)} token ids; it must hold at least 2")
    if min(r) < 0:
        raise ValueError(f"vocab={vocab!r} contains negative ids; token ids must be >= 0")
    return r


# --------------------------------------------------------------------------------------
# Randomness: named streams, lengths, arrivals, tokens
# --------------------------------------------------------------------------------------


def _stream(kind: str, seed: int, purpose: str) -> random.Random:
    """An independent RNG per (generator, seed, purpose).

    Lengths, token ids and arrival times come from separate streams, so changing e.g. the
    vocabulary leaves the lengths and arrival times of a trace untouched, and the first k
    requests of an n-request trace are the same for every n >= k. Seeding ``random.Random``
    with a str hashes it with SHA-512, which is stable across platforms and Python runs.
    """
    return random.Random(f"kvlab.workloads/{kind}/{seed}/{purpose}")


def _tokens(rng: random.Random, vocab: range, k: int) -> list[int]:
    return rng.choices(vocab, k=k)


def _arrivals(rng: random.Random, n: int, rate: float | None) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate; the first arrival at t = 0."""
    if rate is None:
        return [0.0] * n
    times = [0.0] * n
    t = 0.0
    for i in range(1, n):
        t += rng.expovariate(rate)
        times[i] = round(t, 6)
    return times


_STD_NORMAL = NormalDist()


def _mean_clamped_lognormal(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clamp(X, lo, hi)] for X = exp(mu + sigma * Z), in closed form.

    clamp(X, lo, hi) = X - (X - hi)+ + (lo - X)+, and the partial expectations of a
    log-normal are E[X; X <= c] = exp(mu + sigma^2/2) * Phi((ln c - mu - sigma^2) / sigma).
    """
    m = math.exp(mu + sigma * sigma / 2)
    cdf = _STD_NORMAL.cdf

    def partial(c: float) -> float:  # E[X; X <= c]
        return m * cdf((math.log(c) - mu - sigma * sigma) / sigma)

    def below(c: float) -> float:  # P(X <= c)
        return cdf((math.log(c) - mu) / sigma)

    upper = (m - partial(hi)) - hi * (1 - below(hi))  # E[(X - hi)+]
    lower = lo * below(lo) - partial(lo)  # E[(lo - X)+]
    return m - upper + lower


def _solve_mu(mean_of_mu: Any, target: float, what: str) -> float:
    """Bisection for the mu whose clamped mean equals ``target`` (the mean is increasing in mu)."""
    lo, hi = -20.0, 20.0
    if not mean_of_mu(lo) <= target <= mean_of_mu(hi):
        raise ValueError(f"{what}={target} cannot be reached with these length limits")
    for _ in range(48):  # 40 / 2**48: far below a thousandth of a token
        mid = (lo + hi) / 2
        if mean_of_mu(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@lru_cache(maxsize=64)
def _calibrate(
    mean_input: float, mean_output: float, input_sigma: float, output_sigma: float, input_cap: int, max_model_len: int
) -> tuple[float, float]:
    """Log-normal mus such that the means *after clipping* equal the targets.

    Clipping (input <= input_cap, output <= max_model_len - input) cuts the tail and so
    lowers the mean; solving for mu on the clipped mean keeps the paper's means exact in
    expectation instead of a few percent low. The output's cap depends on the input, so its
    mean is averaged over 128 quantiles of the (clipped) input distribution.
    """
    mu_in = _solve_mu(lambda mu: _mean_clamped_lognormal(mu, input_sigma, 1, input_cap), mean_input, "mean_input")
    zs = [_STD_NORMAL.inv_cdf((k + 0.5) / 128) for k in range(128)]
    inputs = [min(max(math.exp(mu_in + input_sigma * z), 1.0), input_cap) for z in zs]
    caps = [max(max_model_len - x, 1.0) for x in inputs]

    def mean_out(mu: float) -> float:
        return sum(_mean_clamped_lognormal(mu, output_sigma, 1, c) for c in caps) / len(caps)

    mu_out = _solve_mu(mean_out, mean_output, "mean_output")
    return mu_in, mu_out


def _draw_length(rng: random.Random, mu: float, sigma: float, lo: int, hi: int) -> int:
    return min(max(int(rng.lognormvariate(mu, sigma) + 0.5), lo), hi)


def _lengths(rng: random.Random, n: int, mean: float, sigma: float, lo: int, hi: int) -> list[int]:
    """n log-normal lengths with the given clamped mean (used for the parts of a prompt)."""
    mu = _solve_mu(lambda m: _mean_clamped_lognormal(m, sigma, lo, hi), mean, "mean length")
    return [_draw_length(rng, mu, sigma, lo, hi) for _ in range(n)]


# --------------------------------------------------------------------------------------
# Independent requests with paper-matched lengths
# --------------------------------------------------------------------------------------


def _independent(
    kind: str,
    n: int,
    seed: int,
    *,
    rate: float | None,
    max_model_len: int,
    mean_input: float,
    mean_output: float,
    input_sigma: float,
    output_sigma: float,
    vocab: Vocab,
    id_prefix: str,
) -> Trace:
    n = check_int("n", n, 1)
    seed = check_int("seed", seed)
    rate = _check_rate(rate)
    max_model_len = check_int("max_model_len", max_model_len, 2)
    mean_input = check_number("mean_input", mean_input, 0, strict=True)
    mean_output = check_number("mean_output", mean_output, 0, strict=True)
    input_sigma = check_number("input_sigma", input_sigma, 0, strict=True)
    output_sigma = check_number("output_sigma", output_sigma, 0, strict=True)
    ids = _vocab_range(vocab)
    if mean_input + mean_output >= max_model_len:
        raise ValueError(f"mean_input + mean_output = {mean_input + mean_output} must be < max_model_len={max_model_len}")
    input_cap = max_model_len - 1  # leave room for at least one output token
    mu_in, mu_out = _calibrate(float(mean_input), float(mean_output), float(input_sigma), float(output_sigma), input_cap, max_model_len)

    len_rng = _stream(kind, seed, "lengths")
    tok_rng = _stream(kind, seed, "tokens")
    times = _arrivals(_stream(kind, seed, "arrivals"), n, rate)
    reqs: list[TraceRequest] = []
    for i in range(n):
        p = _draw_length(len_rng, mu_in, input_sigma, 1, input_cap)
        o = _draw_length(len_rng, mu_out, output_sigma, 1, max_model_len - p)
        reqs.append(TraceRequest(f"{id_prefix}{i}", _tokens(tok_rng, ids, p), o, times[i]))
    params = dict(
        n=n,
        rate=rate,
        max_model_len=max_model_len,
        mean_input=mean_input,
        mean_output=mean_output,
        input_sigma=input_sigma,
        output_sigma=output_sigma,
        vocab=vocab,
    )
    return Trace(kind, reqs, seed, params)


def sharegpt_like(
    n: int,
    seed: int,
    *,
    rate: float | None = 2.0,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    mean_input: float = SHAREGPT_MEAN_INPUT,
    mean_output: float = SHAREGPT_MEAN_OUTPUT,
    input_sigma: float = SHAREGPT_INPUT_SIGMA,
    output_sigma: float = SHAREGPT_OUTPUT_SIGMA,
    vocab: Vocab = DEFAULT_VOCAB,
) -> Trace:
    """``n`` independent chat requests shaped like the paper's ShareGPT trace.

    Lengths are log-normal - a few very long conversations among many short ones - clipped
    so that input <= max_model_len - 1 and input + output <= ``max_model_len``, with the
    log-normal location solved so that the *clipped* means are 161.31 input and 337.99
    output tokens (the paper's ShareGPT figures). At n = 10,000 the sample means land
    within about 3 % of those. Arrivals are Poisson at ``rate`` requests/s (the paper's
    batch-size comparison ran ShareGPT at 2 req/s; ``None`` = all at t = 0).

    Why heavy tails matter here: a system that reserves memory for the *possible* length of
    a request wastes most of it on the typical, much shorter one.
    """
    return _independent(
        "sharegpt_like",
        n,
        seed,
        rate=rate,
        max_model_len=max_model_len,
        mean_input=mean_input,
        mean_output=mean_output,
        input_sigma=input_sigma,
        output_sigma=output_sigma,
        vocab=vocab,
        id_prefix="sg",
    )


def alpaca_like(
    n: int,
    seed: int,
    *,
    rate: float | None = 2.0,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    mean_input: float = ALPACA_MEAN_INPUT,
    mean_output: float = ALPACA_MEAN_OUTPUT,
    input_sigma: float = ALPACA_INPUT_SIGMA,
    output_sigma: float = ALPACA_OUTPUT_SIGMA,
    vocab: Vocab = DEFAULT_VOCAB,
) -> Trace:
    """``n`` short instruction-following requests shaped like the paper's Alpaca trace
    (means 19.31 input / 58.45 output tokens). Short requests are where block size matters
    most: a 16-token block is most of a 19-token prompt."""
    return _independent(
        "alpaca_like",
        n,
        seed,
        rate=rate,
        max_model_len=max_model_len,
        mean_input=mean_input,
        mean_output=mean_output,
        input_sigma=input_sigma,
        output_sigma=output_sigma,
        vocab=vocab,
        id_prefix="al",
    )


def from_lengths(
    lengths: Iterable[tuple[int, int] | tuple[int, int, float]], *, seed: int = 0, vocab: Vocab = DEFAULT_VOCAB, name: str = "from_lengths"
) -> Trace:
    """A trace from explicit ``(prompt_len, output_len)`` or ``(prompt_len, output_len,
    arrival_time)`` tuples (arrival defaults to 0). Request ids are ``r0, r1, ...``.

    This is how the simulator's tests and the lessons build examples small enough to check
    by hand, e.g. ``from_lengths([(2, 3), (3, 2)])``.
    """
    seed = check_int("seed", seed)
    ids = _vocab_range(vocab)
    rng = _stream("from_lengths", seed, "tokens")
    reqs: list[TraceRequest] = []
    for i, spec in enumerate(lengths):
        if len(spec) not in (2, 3):
            raise ValueError(f"lengths[{i}]={spec!r} must be (prompt_len, output_len[, arrival_time])")
        p = check_int(f"lengths[{i}] prompt_len", spec[0], 1)
        o = check_int(f"lengths[{i}] output_len", spec[1], 1)
        t = check_number(f"lengths[{i}] arrival_time", spec[2], 0) if len(spec) == 3 else 0.0
        reqs.append(TraceRequest(f"r{i}", _tokens(rng, ids, p), o, t))
    if not reqs:
        raise ValueError("lengths is empty; a trace needs at least one request")
    order = sorted(range(len(reqs)), key=lambda j: reqs[j].arrival_time)  # stable: ties keep order
    return Trace(name, [reqs[j] for j in order], seed, {"vocab": vocab})


# --------------------------------------------------------------------------------------
# Workloads with shared prefixes
# --------------------------------------------------------------------------------------


def _fit_output(prompt_len: int, wanted: int, max_model_len: int) -> int:
    return min(wanted, max_model_len - prompt_len)


def shared_system_prompt_chat(
    n: int,
    seed: int,
    *,
    system_prompt_len: int = 256,
    mean_user_len: float = 48.0,
    mean_output: float = 128.0,
    sigma: float = 0.8,
    rate: float | None = 2.0,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    vocab: Vocab = DEFAULT_VOCAB,
) -> Trace:
    """``n`` chat requests that all begin with one system prompt of ``system_prompt_len``
    tokens, followed by a unique user message (log-normal, mean ``mean_user_len``).

    With prefix caching only the first request computes the system prompt; every later one
    hits ``system_prompt_len // block_size`` full blocks of it.
    """
    n = check_int("n", n, 1)
    seed = check_int("seed", seed)
    max_model_len = check_int("max_model_len", max_model_len, 3)
    system_prompt_len = check_int("system_prompt_len", system_prompt_len, 1, max_model_len - 2)
    mean_user_len = check_number("mean_user_len", mean_user_len, 0, strict=True)
    mean_output = check_number("mean_output", mean_output, 0, strict=True)
    sigma = check_number("sigma", sigma, 0, strict=True)
    rate = _check_rate(rate)
    ids = _vocab_range(vocab)
    kind = "shared_system_prompt_chat"
    len_rng, tok_rng = _stream(kind, seed, "lengths"), _stream(kind, seed, "tokens")
    times = _arrivals(_stream(kind, seed, "arrivals"), n, rate)
    room = max_model_len - system_prompt_len  # for user message + output
    user_lens = _lengths(len_rng, n, min(mean_user_len, room / 2), sigma, 1, room - 1)
    out_lens = _lengths(len_rng, n, min(mean_output, room / 2), sigma, 1, room - 1)
    system = _tokens(tok_rng, ids, system_prompt_len)
    reqs = []
    for i in range(n):
        prompt = system + _tokens(tok_rng, ids, user_lens[i])
        out = _fit_output(len(prompt), out_lens[i], max_model_len)
        reqs.append(TraceRequest(f"chat{i}", prompt, out, times[i], group="system", shared_prefix_len=system_prompt_len))
    params = dict(
        n=n,
        system_prompt_len=system_prompt_len,
        mean_user_len=mean_user_len,
        mean_output=mean_output,
        sigma=sigma,
        rate=rate,
        max_model_len=max_model_len,
        vocab=vocab,
    )
    return Trace(kind, reqs, seed, params)


def document_qa(
    num_docs: int,
    questions_per_doc: int,
    seed: int,
    *,
    doc_len: int = 1024,
    mean_question_len: float = 24.0,
    mean_output: float = 64.0,
    sigma: float = 0.6,
    rate: float | None = 2.0,
    interleave: bool = True,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    vocab: Vocab = DEFAULT_VOCAB,
) -> Trace:
    """Many questions about the same long documents: prompt = document + question.

    ``num_docs`` documents of ``doc_len`` tokens each get ``questions_per_doc`` questions.
    With ``interleave=True`` (default) the questions arrive in a seeded random order, so
    documents compete for the cache; ``False`` sends all of document 0's questions first.
    Request ids are ``doc{d}-q{j}``; ``group`` is ``doc{d}``.
    """
    num_docs = check_int("num_docs", num_docs, 1)
    questions_per_doc = check_int("questions_per_doc", questions_per_doc, 1)
    seed = check_int("seed", seed)
    max_model_len = check_int("max_model_len", max_model_len, 3)
    doc_len = check_int("doc_len", doc_len, 1, max_model_len - 2)
    mean_question_len = check_number("mean_question_len", mean_question_len, 0, strict=True)
    mean_output = check_number("mean_output", mean_output, 0, strict=True)
    sigma = check_number("sigma", sigma, 0, strict=True)
    rate = _check_rate(rate)
    ids = _vocab_range(vocab)
    kind = "document_qa"
    len_rng, tok_rng = _stream(kind, seed, "lengths"), _stream(kind, seed, "tokens")
    n = num_docs * questions_per_doc
    room = max_model_len - doc_len
    q_lens = _lengths(len_rng, n, min(mean_question_len, room / 2), sigma, 1, room - 1)
    o_lens = _lengths(len_rng, n, min(mean_output, room / 2), sigma, 1, room - 1)
    docs = [_tokens(tok_rng, ids, doc_len) for _ in range(num_docs)]
    pairs = [(d, j) for d in range(num_docs) for j in range(questions_per_doc)]
    if interleave:
        _stream(kind, seed, "order").shuffle(pairs)
    times = _arrivals(_stream(kind, seed, "arrivals"), n, rate)
    reqs = []
    for i, (d, j) in enumerate(pairs):
        prompt = docs[d] + _tokens(tok_rng, ids, q_lens[i])
        out = _fit_output(len(prompt), o_lens[i], max_model_len)
        reqs.append(TraceRequest(f"doc{d}-q{j}", prompt, out, times[i], group=f"doc{d}", shared_prefix_len=doc_len))
    params = dict(
        num_docs=num_docs,
        questions_per_doc=questions_per_doc,
        doc_len=doc_len,
        mean_question_len=mean_question_len,
        mean_output=mean_output,
        sigma=sigma,
        rate=rate,
        interleave=interleave,
        max_model_len=max_model_len,
        vocab=vocab,
    )
    return Trace(kind, reqs, seed, params)


def multi_turn(
    num_conversations: int,
    turns: int,
    seed: int,
    *,
    system_prompt_len: int = 0,
    mean_user_len: float = 40.0,
    mean_output: float = 120.0,
    sigma: float = 0.8,
    rate: float | None = 0.5,
    think_time: float = 5.0,
    decode_seconds_per_token: float = 0.04,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    vocab: Vocab = DEFAULT_VOCAB,
) -> Trace:
    """Chat sessions where every turn resends the whole history.

    Turn k+1's prompt is turn k's prompt, then turn k's answer (``output_token_ids``,
    drawn from the seed), then a new user message. So the prefix cache can serve the whole
    history, and an engine replaying the scripted answers sees exactly this trace.

    Conversations start as a Poisson process at ``rate`` per second. The next turn arrives
    after the previous answer would have streamed at ``decode_seconds_per_token`` per token,
    plus an exponential think time (mean ``think_time`` s): always later, but a trace cannot
    know the real finish time, so a slow engine may still be answering turn k when turn k+1
    arrives. A conversation stops early when the next turn would not fit in
    ``max_model_len``. ``system_prompt_len > 0`` opens every conversation with one shared
    system prompt. Ids are ``conv{c}-t{k}``; ``group`` is ``conv{c}``.
    """
    num_conversations = check_int("num_conversations", num_conversations, 1)
    turns = check_int("turns", turns, 1)
    seed = check_int("seed", seed)
    max_model_len = check_int("max_model_len", max_model_len, 3)
    system_prompt_len = check_int("system_prompt_len", system_prompt_len, 0, max_model_len - 2)
    mean_user_len = check_number("mean_user_len", mean_user_len, 0, strict=True)
    mean_output = check_number("mean_output", mean_output, 0, strict=True)
    sigma = check_number("sigma", sigma, 0, strict=True)
    think_time = check_number("think_time", think_time, 0)
    decode_seconds_per_token = check_number("decode_seconds_per_token", decode_seconds_per_token, 0)
    rate = _check_rate(rate)
    ids = _vocab_range(vocab)
    kind = "multi_turn"
    len_rng, tok_rng = _stream(kind, seed, "lengths"), _stream(kind, seed, "tokens")
    gap_rng = _stream(kind, seed, "think")
    starts = _arrivals(_stream(kind, seed, "arrivals"), num_conversations, rate)
    room = max_model_len - system_prompt_len
    n = num_conversations * turns
    u_lens = _lengths(len_rng, n, min(mean_user_len, room / 2), sigma, 1, room - 1)
    o_lens = _lengths(len_rng, n, min(mean_output, room / 2), sigma, 1, room - 1)
    system = _tokens(tok_rng, ids, system_prompt_len)
    reqs: list[TraceRequest] = []
    for c in range(num_conversations):
        history = list(system)
        t = starts[c]
        for k in range(turns):
            i = c * turns + k
            if len(history) + u_lens[i] + 1 > max_model_len:
                break  # no room for even a one-token answer: the conversation ends here
            prompt = history + _tokens(tok_rng, ids, u_lens[i])
            out = _fit_output(len(prompt), o_lens[i], max_model_len)
            answer = _tokens(tok_rng, ids, out)
            reqs.append(
                TraceRequest(
                    f"conv{c}-t{k}", prompt, out, round(t, 6), output_token_ids=answer, group=f"conv{c}", shared_prefix_len=len(history)
                )
            )
            history = prompt + answer
            t += out * decode_seconds_per_token + (gap_rng.expovariate(1 / think_time) if think_time else 0.0)
    reqs.sort(key=lambda r: r.arrival_time)  # stable: simultaneous arrivals keep their order
    params = dict(
        num_conversations=num_conversations,
        turns=turns,
        system_prompt_len=system_prompt_len,
        mean_user_len=mean_user_len,
        mean_output=mean_output,
        sigma=sigma,
        rate=rate,
        think_time=think_time,
        decode_seconds_per_token=decode_seconds_per_token,
        max_model_len=max_model_len,
        vocab=vocab,
    )
    return Trace(kind, reqs, seed, params)


def tenant_salt(seed: int, tenant_index: int) -> str:
    """The secret ``cache_salt`` of tenant ``tenant_index`` in a trace made with ``seed``.

    HMAC-SHA256 keyed by a hash of the seed: without the key the salt looks like 128
    random bits, and nothing about the tenant's name or number lets an attacker guess it.
    (A deployment would draw each tenant's salt once with ``secrets.token_hex(16)`` and
    store it; we derive it from the seed only so that the trace is reproducible.)
    """
    seed = check_int("seed", seed)
    tenant_index = check_int("tenant_index", tenant_index, 0)
    key = hashlib.sha256(f"kvlab.workloads/tenant-salt-key/{seed}".encode()).digest()
    return hmac.new(key, f"tenant/{tenant_index}".encode(), hashlib.sha256).hexdigest()[:32]


def multi_tenant(
    num_tenants: int,
    n: int,
    seed: int,
    *,
    salted: bool = False,
    salt_scheme: Literal["secret", "name"] = "secret",
    shared_prefix_len: int = 256,
    num_prefixes: int = 4,
    mean_suffix_len: float = 48.0,
    mean_output: float = 128.0,
    sigma: float = 0.8,
    rate: float | None = 2.0,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    vocab: Vocab = DEFAULT_VOCAB,
) -> Trace:
    """Tenants whose prompts open with popular prefixes that are shared *across* tenants.

    There are ``num_prefixes`` prefixes of ``shared_prefix_len`` tokens (think: a popular
    template or public system prompt); prefix j is chosen with weight 1/(j+1), so prefix 0
    is the most popular. Each request picks a tenant uniformly, a prefix by popularity, and
    appends a unique suffix. ``tenant`` is ``tenant{t}`` and ``group`` is ``prefix{j}``.

    ``salted=True`` gives every tenant a ``cache_salt``: with ``salt_scheme="secret"``
    (default) an unpredictable one from :func:`tenant_salt`, so tenants never share blocks
    and one tenant's cache hit cannot reveal what another sent. ``salt_scheme="name"`` uses
    the tenant name as its salt - the classic mistake: an attacker who can guess the salt
    can put it on their own requests and probe the victim's cache as if unsalted.
    """
    num_tenants = check_int("num_tenants", num_tenants, 1)
    n = check_int("n", n, 1)
    seed = check_int("seed", seed)
    max_model_len = check_int("max_model_len", max_model_len, 3)
    shared_prefix_len = check_int("shared_prefix_len", shared_prefix_len, 1, max_model_len - 2)
    num_prefixes = check_int("num_prefixes", num_prefixes, 1)
    mean_suffix_len = check_number("mean_suffix_len", mean_suffix_len, 0, strict=True)
    mean_output = check_number("mean_output", mean_output, 0, strict=True)
    sigma = check_number("sigma", sigma, 0, strict=True)
    if salt_scheme not in ("secret", "name"):
        raise ValueError(f"salt_scheme={salt_scheme!r} is unknown; choose 'secret' or 'name'")
    rate = _check_rate(rate)
    ids = _vocab_range(vocab)
    kind = "multi_tenant"
    len_rng, tok_rng = _stream(kind, seed, "lengths"), _stream(kind, seed, "tokens")
    pick_rng = _stream(kind, seed, "picks")
    times = _arrivals(_stream(kind, seed, "arrivals"), n, rate)
    room = max_model_len - shared_prefix_len
    s_lens = _lengths(len_rng, n, min(mean_suffix_len, room / 2), sigma, 1, room - 1)
    o_lens = _lengths(len_rng, n, min(mean_output, room / 2), sigma, 1, room - 1)
    prefixes = [_tokens(tok_rng, ids, shared_prefix_len) for _ in range(num_prefixes)]
    weights = [1 / (j + 1) for j in range(num_prefixes)]
    names = [f"tenant{t}" for t in range(num_tenants)]
    if not salted:
        salts: list[str | None] = [None] * num_tenants
    elif salt_scheme == "secret":
        salts = [tenant_salt(seed, t) for t in range(num_tenants)]
    else:
        salts = list(names)
    reqs = []
    for i in range(n):
        t = pick_rng.randrange(num_tenants)
        j = pick_rng.choices(range(num_prefixes), weights=weights)[0]
        prompt = prefixes[j] + _tokens(tok_rng, ids, s_lens[i])
        out = _fit_output(len(prompt), o_lens[i], max_model_len)
        reqs.append(
            TraceRequest(
                f"{names[t]}-r{i}",
                prompt,
                out,
                times[i],
                cache_salt=salts[t],
                tenant=names[t],
                group=f"prefix{j}",
                shared_prefix_len=shared_prefix_len,
            )
        )
    params = dict(
        num_tenants=num_tenants,
        n=n,
        salted=salted,
        salt_scheme=salt_scheme,
        shared_prefix_len=shared_prefix_len,
        num_prefixes=num_prefixes,
        mean_suffix_len=mean_suffix_len,
        mean_output=mean_output,
        sigma=sigma,
        rate=rate,
        max_model_len=max_model_len,
        vocab=vocab,
    )
    return Trace(kind, reqs, seed, params)
