"""Facts a single snapshot does not hold, recovered from the event log.

A snapshot says where every block *is*; the free-queue picture also wants to say where a
free block *came from* ("the tail of req0"), which is history. ``BlockHistory`` indexes
the log once -- for every block, each (event position, request, group, logical index)
at which a block table took it -- and answers "who held block b last, before event n?"
with a binary search. It extends itself when a live log grows.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.timeline import events as ev


@dataclass(frozen=True, slots=True)
class Holding:
    request_id: str
    group: int
    logical_index: int  # position in that request's block table


class BlockHistory:
    """Per block: every time a block table took it, in log order."""

    def __init__(self, events: Sequence[ev.Event] = ()) -> None:
        self._seqs: dict[int, list[int]] = {}
        self._holds: dict[int, list[Holding]] = {}
        self._table_len: dict[tuple[str, int], int] = {}
        self._n = 0
        self.extend(events)

    def extend(self, events: Sequence[ev.Event]) -> None:
        """Index the events not seen yet (``events`` is the whole log, in order)."""
        for i in range(self._n, len(events)):
            e = events[i]
            k = e.kind
            if k in ("blocks_allocated", "blocks_touched") and e.request_id is not None:
                key = (e.request_id, e.group)
                n = self._table_len.get(key, 0)
                for j, bid in enumerate(e.block_ids):
                    if bid != 0:
                        self._seqs.setdefault(bid, []).append(i)
                        self._holds.setdefault(bid, []).append(Holding(e.request_id, e.group, n + j))
                self._table_len[key] = n + len(e.block_ids)
            elif k == "blocks_freed" and e.reason == "request" and e.request_id is not None:
                self._table_len[(e.request_id, e.group)] = 0
        self._n = max(self._n, len(events))

    def last_holder(self, block_id: int, before: int) -> Holding | None:
        """The last table to take ``block_id`` among the first ``before`` events."""
        seqs = self._seqs.get(block_id)
        if not seqs:
            return None
        i = bisect_left(seqs, before) - 1
        return self._holds[block_id][i] if i >= 0 else None
