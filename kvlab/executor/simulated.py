"""A model-free executor: the next token is a fixed function of the context (lesson 00, 05).

It also plays the worker's other parts without tensors: the worker half of a KV connector
(lessons 12-13: its transfers move no bytes but its tier files are real) and the encoder
cache (lesson 14: "running the encoder" records the item's embeddings, and a scheduled
token whose image has no cached embeddings is an error, as in vLLM's model runner).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from kvlab.core.sched.output import SchedulerOutput
from kvlab.utils.checks import check_int, check_optional_int
from kvlab.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin, requests_with_invalid_blocks


class SimulatedExecutor(KVConnectorModelRunnerMixin):
    """Deterministic stand-in for a model: next token = crc32(context) mod vocab.

    Because the token depends on the whole context only, a preempted and recomputed
    request produces exactly the same tokens -- the property the real runner must have.
    """

    #: It writes no K/V: an undone step leaves no stale values in cached blocks (see
    #: ``kvlab.core.transaction.restore_pool``'s ``drop_reused``).
    writes_kv_cache = False
    #: An encoder-decoder model (set by the engine from the manager's groups): the encoder's
    #: output feeds the cross-attention KV on a request's first step and is not read again.
    is_encoder_decoder = False

    def __init__(self, vocab_size: int = 32000, eos_token_id: int | None = None, eos_every: int = 0, *, kv_connector: Any = None) -> None:
        self.vocab_size = check_int("vocab_size", vocab_size, 2)
        self.eos_token_id = check_optional_int("eos_token_id", eos_token_id, 0)
        # > 0: emit eos when crc % eos_every == 0 (varied output lengths); 0: never.
        self.eos_every = check_int("eos_every", eos_every, 0)
        self._tokens: dict[str, list[int]] = {}
        self._tables: dict[str, list[int]] = {}  # group-0 block table (to map failed loads to requests)
        self._mm: dict[str, list] = {}  # request id -> its multimodal items
        self.num_tokens_computed = 0
        # The encoder cache's worker side: item hash -> number of embeddings it holds.
        self.encoder_cache: dict[str, int] = {}
        self.num_encoder_tokens_computed = 0
        if kv_connector is not None:
            self.register_kv_connector(kv_connector, [])

    def next_token(self, context: Sequence[int]) -> int:
        crc = zlib.crc32(len(context).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in context[-8:]))
        if self.eos_token_id is not None and self.eos_every and crc % self.eos_every == 0:
            return self.eos_token_id
        return crc % self.vocab_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        so = scheduler_output
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._tokens.pop(rid, None)
            self._tables.pop(rid, None)
            self._mm.pop(rid, None)
        for h in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(h, None)
        n_sched = so.num_scheduled_tokens
        work: list[tuple[str, int, int]] = []
        for nr in so.scheduled_new_reqs:
            self._tokens[nr.req_id] = list(nr.all_token_ids)
            self._tables[nr.req_id] = list(nr.block_ids[0]) if nr.block_ids else []
            self._mm[nr.req_id] = list(nr.mm_features)
            work.append((nr.req_id, nr.num_computed_tokens, n_sched[nr.req_id]))
        c = so.scheduled_cached_reqs
        for rid, nc, new_ids in zip(c.req_ids, c.num_computed_tokens, c.new_block_ids):
            if new_ids is not None and new_ids:
                self._tables.setdefault(rid, []).extend(new_ids[0])
            work.append((rid, nc, n_sched[rid]))
        invalid = self._kv_connector_start(so)
        skipped: set[str] = set()
        if invalid:
            bs = self.kv_connector.block_size
            # its KV is not there: it sits this step out (the scheduler cuts its computed
            # tokens back and it recomputes them next step, in the same blocks)
            skipped = requests_with_invalid_blocks(((rid, self._tables.get(rid, []), nc) for rid, nc, _ in work), invalid, bs)
        self._run_encoder(so)  # a request sitting out still gets its items encoded (they are cached for it)
        out: dict[str, list[int]] = {}
        for rid, nc, n in work:
            if rid not in skipped:
                self._check_encoder_outputs(rid, nc, n)
                self._step(rid, nc, n, out)
        self._kv_connector_finish(so, invalid, skipped)
        return out

    def _run_encoder(self, so: SchedulerOutput) -> None:
        for rid, input_ids in so.scheduled_encoder_inputs.items():
            items = self._mm.get(rid, [])
            for i in input_ids:
                f = items[i]
                self.encoder_cache[f.identifier] = f.get_num_embeds()
                self.num_encoder_tokens_computed += f.get_num_embeds()

    def _check_encoder_outputs(self, rid: str, num_computed: int, n: int) -> None:
        if self.is_encoder_decoder and num_computed > 0:
            return  # the cross-attention KV holds the encoder's output by now
        end = num_computed + n
        for f in self._mm.get(rid, ()):
            if f.offset >= end or f.offset + f.length <= num_computed or f.identifier in self.encoder_cache:
                continue
            first, last = f.get_embeds_indices_in_range(max(0, num_computed - f.offset), min(f.length, end - f.offset))
            if last > first:  # positions without an embedding (is_embed) need none
                raise RuntimeError(
                    f"request {rid!r}: tokens {num_computed}..{end - 1} need the embeddings of item "
                    f"{f.identifier!r}, which are not in the encoder cache (a scheduler bug)"
                )

    def _step(self, rid: str, num_computed: int, n: int, out: dict[str, list[int]]) -> None:
        toks = self._tokens[rid]
        self.num_tokens_computed += n
        if num_computed + n == len(toks):
            t = self.next_token(toks)
            toks.append(t)
            out[rid] = [t]
