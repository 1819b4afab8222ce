"""Count the work a learner's code does, so "is it O(1)?" has one answer on every machine.

Timing two runs and dividing says more about the machine than about the code: on a busy
2-core box the same correct queue measured 14x one run and 64x the next. Work counted is the
same every run, so the checkers count three things while the learner's code runs:

* **comparisons** -- the ids and blocks a check hands the learner are :class:`CountedInt` /
  counted blocks, whose ``__eq__`` and ``__lt__`` count themselves. ``list.remove``,
  ``list.index``, ``x in list`` and ``deque.remove`` compare item by item in C: each
  comparison lands here. (Python gives the reflected ``__eq__`` of a subclass priority, so a
  plain ``int`` in the learner's list compared with a counted id is counted too.)
* **hashes** -- ``__hash__`` of the same objects: a dict or set lookup costs one.
* **lines** -- lines executed in code that is neither kvlab's nor the standard library's
  (the learner's cell, or a test's mutant), via ``sys.settrace``: a Python loop that scans
  counts once per line per item.

A linked list costs a few lines per operation, a dict a hash and a few lines; a scan costs
n of something. Checkers run the same operations on a small and a large structure and
compare the work per operation (lesson 04b: why ``remove`` must not search).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.exercises.sandbox import is_learner_code

__all__ = ["Work", "CountedInt", "counted_blocks", "counting"]


@dataclass
class Work:
    """What one measured stretch of learner code did (see the module docstring)."""

    comparisons: int = 0
    hashes: int = 0
    lines: int = 0

    @property
    def total(self) -> int:
        return self.comparisons + self.hashes + self.lines

    def per(self, n: int) -> float:
        return self.total / max(n, 1)

    def describe(self, n: int, unit: str = "call", over: str = "calls") -> str:
        return (
            f"{self.per(n):,.1f} steps per {unit} ({self.comparisons:,} comparisons, {self.hashes:,} hashes, "
            f"{self.lines:,} lines of your code over {n} {over})"
        )


_active: list[Work] = []  # the stretch being measured (a stack: measurements do not nest in practice)


def _note(field: str) -> None:
    if _active:
        w = _active[-1]
        setattr(w, field, getattr(w, field) + 1)


class CountedInt(int):
    """An ``int`` whose comparisons and hashes are counted while :func:`counting` is on."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        _note("comparisons")
        return int.__eq__(self, other)  # NotImplemented passes through

    def __ne__(self, other: object) -> bool:
        _note("comparisons")
        return int.__ne__(self, other)

    def __lt__(self, other: int) -> bool:
        _note("comparisons")
        return int.__lt__(self, other)

    def __hash__(self) -> int:
        _note("hashes")
        return int.__hash__(self)


class _CountedBlock(KVCacheBlock):
    """A block that counts being compared or hashed (identity semantics, as KVCacheBlock)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        _note("comparisons")
        return self is other

    def __hash__(self) -> int:
        _note("hashes")
        return id(self) >> 4


def counted_blocks(n: int) -> list[KVCacheBlock]:
    """``n`` fresh blocks (ids 0..n-1) whose ids and selves count comparisons and hashes."""
    return [_CountedBlock(CountedInt(i)) for i in range(n)]


@contextmanager
def counting() -> Iterator[Work]:
    """Count the work done inside the block: comparisons and hashes of counted objects, and
    lines of learner code (``sys.settrace``; the previous tracer, a debugger's or coverage's,
    is put back afterwards)."""
    work = Work()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            work.lines += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if is_learner_code(frame.f_code) else None

    old = sys.gettrace()
    _active.append(work)
    sys.settrace(tracer)
    try:
        yield work
    finally:
        sys.settrace(old)
        _active.remove(work)
