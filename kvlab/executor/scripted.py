"""An executor that answers each request with the tokens its trace scripted (lessons 03, 11).

A multi-turn chat resends turn k's prompt *and answer* as the start of turn k + 1, so a
prefix cache can serve the whole history -- if the engine really produced that answer. The
model-free :class:`SimulatedExecutor` invents its own tokens; this one looks up the answer
the trace wrote (``TraceRequest.output_token_ids``) by request and position, so a replayed
conversation is exactly the trace, even after a preemption recomputes it. Requests without
a script fall back to the simulated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.executor.simulated import SimulatedExecutor


class ScriptedExecutor(SimulatedExecutor):
    """``add_script(request_id, prompt_len, output_token_ids)``, then run as usual."""

    def __init__(self, vocab_size: int = 32000) -> None:
        super().__init__(vocab_size=vocab_size)
        self._scripts: dict[str, tuple[int, list[int]]] = {}

    def add_script(self, request_id: str, prompt_len: int, output_token_ids: Sequence[int]) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
        self._scripts[request_id] = (prompt_len, [int(t) for t in output_token_ids])

    def _step(self, rid: str, num_computed: int, n: int, out: dict[str, list[int]]) -> None:
        script = self._scripts.get(rid)
        toks = self._tokens[rid]
        if script is None or num_computed + n != len(toks):
            super()._step(rid, num_computed, n, out)
            return
        prompt_len, answer = script
        k = len(toks) - prompt_len
        self.num_tokens_computed += n
        t = answer[k] if 0 <= k < len(answer) else self.next_token(toks)
        toks.append(t)
        out[rid] = [t]
