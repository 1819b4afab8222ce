"""A model-free executor: the next token is a fixed function of the context (lesson 00, 05)."""
from __future__ import annotations

import zlib
from collections.abc import Sequence

from kvlab.core.sched.output import SchedulerOutput
from kvlab.utils.checks import check_int, check_optional_int


class SimulatedExecutor:
    """Deterministic stand-in for a model: next token = crc32(context) mod vocab.

    Because the token depends on the whole context only, a preempted and recomputed
    request produces exactly the same tokens -- the property the real runner must have.
    """

    def __init__(self, vocab_size: int = 32000, eos_token_id: int | None = None, eos_every: int = 0) -> None:
        self.vocab_size = check_int("vocab_size", vocab_size, 2)
        self.eos_token_id = check_optional_int("eos_token_id", eos_token_id, 0)
        # > 0: emit eos when crc % eos_every == 0 (varied output lengths); 0: never.
        self.eos_every = check_int("eos_every", eos_every, 0)
        self._tokens: dict[str, list[int]] = {}
        self.num_tokens_computed = 0

    def next_token(self, context: Sequence[int]) -> int:
        crc = zlib.crc32(len(context).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in context[-8:]))
        if self.eos_token_id is not None and self.eos_every and crc % self.eos_every == 0:
            return self.eos_token_id
        return crc % self.vocab_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        for rid in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._tokens.pop(rid, None)
        out: dict[str, list[int]] = {}
        n_sched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            self._tokens[nr.req_id] = list(nr.all_token_ids)
            self._step(nr.req_id, nr.num_computed_tokens, n_sched[nr.req_id], out)
        c = scheduler_output.scheduled_cached_reqs
        for rid, nc in zip(c.req_ids, c.num_computed_tokens):
            self._step(rid, nc, n_sched[rid], out)
        return out

    def _step(self, rid: str, num_computed: int, n: int, out: dict[str, list[int]]) -> None:
        toks = self._tokens[rid]
        self.num_tokens_computed += n
        if num_computed + n == len(toks):
            t = self.next_token(toks)
            toks.append(t)
            out[rid] = [t]
