"""Lesson 04: "a shared or cached block is never written", checked on a real run.

The model runner records, every step, the slot each new token's K/V is written to
(``AttentionBatch.slot_mappings``, what ``reshape_and_cache`` receives). :func:`scan_writes`
takes each of those writes and looks up the block it lands in, as it was when the step began:
a write is *safe* when the block was not the writer's yet (it was handed over this step, after
any old hash was dropped) or was the writer's alone and not yet complete (no hash). A write
into a block that was shared, or already complete and cached, when the step began would change
KV that another request reads or that the cache key promises: the scan counts those.

One case looks like sharing and is not: a request admitted later in the same step may hit a
block another request fills in this very step (it was cached when it was allocated). Both run
in one forward pass, where every layer writes the step's K/V before it reads, so the reader
sees exactly what is written; after that step the block never changes. A write into a block that another request also
held, or one that already carried a hash (other requests could hit it), would change KV that
someone else reads or that the cache key promises -- the scan counts those as violations.

Why it holds in vLLM V1 without any copy (a model of attention layers only): a prefix hit only ever adopts *full* blocks, whose
positions lie before the request's ``num_computed_tokens``; new tokens are written at
positions after it, which always fall in blocks the request allocated for itself. Even a
request that resends a cached prompt recomputes its last block into a block of its own
(that is where duplicates come from). So V1's prefix sharing needs no copy-on-write: nothing
shared is ever extended in place. (Parallel sampling, ``n > 1``, fans out into child requests
that share the prompt's full blocks through the prefix cache, each writing its own last block.)
vLLM 0.33 copies blocks only elsewhere: a prefix hit that ends inside a block on a Mamba
hybrid (``_apply_cow``), Mamba states in "align" mode, and moves between offload tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.eventlog.events import BlocksTouched

__all__ = ["WriteScan", "scan_writes"]


@dataclass
class WriteScan:
    writes: int = 0  # K/V writes (tokens x groups) scanned
    steps: int = 0  # steps with an attention batch
    to_fresh: int = 0  # into a block the writer got this step (free before: nothing of it is readable)
    to_private: int = 0  # into a block the writer already held alone, still without a hash
    same_step_readers: int = 0  # writes into a block another request adopted in the same step (it reads them)
    violations: list[tuple[int, str, int, str]] = field(default_factory=list)  # (step, request, block, why)
    shared_blocks: set[int] = field(default_factory=set)  # blocks held by two requests at some step
    hit_blocks: set[int] = field(default_factory=set)  # blocks a request adopted from the cache (a hit)
    written_blocks: set[int] = field(default_factory=set)

    @property
    def safe(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = [
            f"{self.writes} K/V writes in {self.steps} steps: {self.to_fresh} into blocks allocated that step, "
            f"{self.to_private} into the writer's own unfinished blocks, {len(self.violations)} anywhere else",
            f"({self.same_step_readers} of them into blocks another request hit in that same step: it reads what is written)",
            f"blocks ever shared by two requests: {sorted(self.shared_blocks)}; adopted by a prefix hit: {sorted(self.hit_blocks)}",
            f"written while shared or cached: {sorted({b for _, _, b, _ in self.violations}) or 'none'}",
        ]
        for step, rid, b, why in self.violations[:5]:
            lines.append(f"  step {step}: {rid} wrote into block {b}, which was {why}")
        return "\n".join(lines)


def scan_writes(timeline: Any) -> WriteScan:
    """Check every K/V write of a run (a ``Timeline`` of a run with the model runner).

    Each step is looked at twice: at the end of the step before (was the block already
    complete and cached in the writer's table?) and at the moment the kernel gets the batch,
    after this step's scheduling, preemptions and allocations (who holds the block now?)."""
    from kvlab.timeline.timeline import replay

    out = WriteScan()
    events = timeline.events
    prev = timeline.at(0)
    for step in range(1, timeline.last_step + 1):
        snap = timeline.at(step)
        for b in snap.blocks:
            if len(set(b.owners)) > 1:
                out.shared_blocks.add(b.block_id)
        for e in timeline.events_of(step):
            if isinstance(e, BlocksTouched):
                out.hit_blocks.update(e.block_ids)
        batch = timeline.attention_batch(step)
        if batch is not None:
            out.steps += 1
            at = replay(events[: events.index(batch)])  # the pool as the kernel found it
            for slots in batch.slot_mappings:
                pos = 0
                for rid, q in zip(batch.req_ids, batch.query_lens):
                    for slot in slots[pos : pos + q]:
                        if slot >= 0:  # a skipped position (outside a window) writes nothing
                            _check(out, prev, at, step, rid, slot // batch.block_size)
                    pos += q
        prev = snap
    return out


def _check(out: WriteScan, prev: Any, at: Any, step: int, rid: str, block_id: int) -> None:
    out.writes += 1
    out.written_blocks.add(block_id)
    now, before = at.block(block_id), prev.block(block_id)
    if rid not in now.owners:
        out.violations.append((step, rid, block_id, f"not in its block table (held by {', '.join(now.owners) or 'nobody'})"))
    elif rid not in before.owners:
        out.to_fresh += 1  # handed to the writer this step; requests that hit it this step read what it writes now
        if len(set(now.owners)) > 1:
            out.same_step_readers += 1
    elif before.ref_cnt == 1 and before.block_hash is None:
        out.to_private += 1
    elif before.block_hash is not None:
        out.violations.append((step, rid, block_id, f"already complete and cached when the step began (hash {before.block_hash[:8]}…)"))
    else:
        out.violations.append((step, rid, block_id, f"shared when the step began: {', '.join(before.owners)}"))
