"""Lesson 02 (block pool and tables): what the attention kernel reads, watched -- and what a
wrong block table makes it read.

The kernel view draws the slots a request's queries should read (from the manager's block
table) against the slots the kernel was *seen* to load (``AttentionBatch.kernel_reads``,
traced under the Triton interpreter by the model runner). With a correct runner the two
agree and block 0 is never touched. :class:`SwappedRowsRunner` plants a classic batching
bug -- the runner moves requests around in its batch but forgets to move their block-table
rows with them (vLLM's persistent batch must swap a row of the block table whenever it
swaps two requests) -- and :func:`swapped_rows_run` replays lesson 02's two requests with it:
each request's queries then read the *other* request's blocks, and the padding zeros of the
other row send loads into the null block.
"""

from __future__ import annotations

from typing import Any

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.scheduler import Scheduler
from kvlab.engine.llm_engine import LLMEngine
from kvlab.request import Request
from kvlab.eventlog.events import EventLog
from kvlab.timeline.timeline import Timeline
from kvlab.worker.model import TinyLlama
from kvlab.worker.model_runner import ModelRunner

__all__ = ["SwappedRowsRunner", "kernel_picture", "reads_summary", "swapped_rows_run"]


class SwappedRowsRunner(ModelRunner):
    """A model runner with a planted bug: the first two rows of every block table are
    swapped after the batch is built (the requests keep their places: only their tables
    move). Writes still go through the right slot mapping; reads go astray."""

    def _prepare_inputs(self, step: int, order: list[Any]) -> Any:
        batch, meta, input_ids, positions = super()._prepare_inputs(step, order)
        if len(order) >= 2:
            for tables in (batch.block_tables,):
                for g in tables:
                    g[0], g[1] = g[1], g[0]
            meta.block_tables = tuple(t[[1, 0] + list(range(2, t.shape[0]))] for t in meta.block_tables)
        return batch, meta, input_ids, positions


def swapped_rows_run(
    model: TinyLlama, tokenizer: Any, prompts: dict[str, tuple[str, int]], num_blocks: int = 11, block_size: int = 4, steps: int = 2
) -> EventLog:
    """Run ``prompts`` (request id -> (prompt text, max_tokens)) for ``steps`` steps on a
    fresh engine whose runner has the swapped-rows bug; the first request is added one step
    ahead of the others, as in lesson 02. Returns the event log (kernel loads traced)."""
    log = EventLog()
    manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size, event_log=log)
    runner = SwappedRowsRunner(model, num_blocks=num_blocks, block_size=block_size, event_log=log)
    engine = LLMEngine(manager, Scheduler(manager), runner, tokenizer=tokenizer)
    items = list(prompts.items())
    rid, (text, n) = items[0]
    engine.add_request(Request(rid, tokenizer.encode(text), max_tokens=n))
    engine.step()
    for rid, (text, n) in items[1:]:
        engine.add_request(Request(rid, tokenizer.encode(text), max_tokens=n))
    for _ in range(steps - 1):
        engine.step()
    return log


def kernel_picture(log: EventLog, step: int, request_id: str, *, width: int = 700, height: int = 380) -> Any:
    """A still kernel view (a plain plotly figure, kept in the saved notebook) of
    ``request_id`` at ``step``."""
    import plotly.graph_objects as go

    from kvlab.viz.kernel import KernelView

    tl = Timeline(log)
    view = KernelView(tl, width=width, height=height)
    view.update(tl.at(step), request_id)
    return go.Figure(view.figure)


def reads_summary(log: EventLog, step: int) -> list[str]:
    """One line per request of ``step``'s batch: the table the manager gave it, the table
    the kernel received, and the blocks the kernel was seen to load (with their owners)."""
    tl = Timeline(log)
    batch = tl.attention_batch(step)
    if batch is None or batch.kernel_reads is None:
        return [f"step {step}: no traced attention batch"]
    at = tl.after_event(batch.seq)
    bs = batch.block_size
    lines = []
    for i, rid in enumerate(batch.req_ids):
        own = [b for b in at.requests[rid].block_table[0] if b != 0]
        given = [b for b in batch.block_tables[0][i]]
        loaded = sorted({s // bs for s in batch.kernel_reads[0][i]})

        def whose(b: int) -> str:
            if b == 0:
                return "null"
            owners = [o for o in at.blocks[b].owners if o != rid]
            return "its own" if b in own else (f"{'+'.join(owners)}'s" if owners else at.blocks[b].state)

        lines.append(f"{rid}: its table {own} · the kernel got {given} · loaded blocks " + ", ".join(f"{b} ({whose(b)})" for b in loaded))
    return lines
