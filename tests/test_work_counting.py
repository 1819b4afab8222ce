"""Complexity verdicts by counting work (issue: the same verdict on a busy machine).

The O(1) checks count comparisons, hashes and lines of the learner's code at two sizes
(kvlab/exercises/work.py). The counts are exact and the same every run, so these tests pin
them: a timing-based checker could never be asserted like this.
"""

from __future__ import annotations

from collections import OrderedDict

from kvlab.exercises import check
from kvlab.exercises.work import CountedInt, counted_blocks, counting
from test_capstone import ListQueue, ManagerOk
from test_exercises import QueueList, QueueOk


class QueueByIdDict:
    """An OrderedDict keyed by block id: O(1), hashes CountedInt ids."""

    def __init__(self, blocks):
        self.d = OrderedDict((b.block_id, b) for b in blocks)

    @property
    def num_free_blocks(self):
        return len(self.d)

    def popleft(self):
        return self.d.popitem(last=False)[1]

    def remove(self, block):
        del self.d[block.block_id]

    def append(self, block):
        self.d[block.block_id] = block

    def get_all_free_blocks(self):
        return list(self.d.values())


class QueueScanLoop(QueueByIdDict):
    """Right order, but remove() walks a list in Python with `is`: no comparison to count,
    every step a line of the learner's code."""

    def __init__(self, blocks):
        self.l = list(blocks)

    @property
    def num_free_blocks(self):
        return len(self.l)

    def popleft(self):
        return self.l.pop(0)

    def remove(self, block):
        for i, b in enumerate(self.l):
            if b is block:
                del self.l[i]
                return

    def append(self, block):
        self.l.append(block)

    def get_all_free_blocks(self):
        return list(self.l)


def test_counted_objects_count_what_c_code_does():
    blocks = counted_blocks(10)
    ids = [CountedInt(i) for i in range(10)]
    with counting() as w:
        [1, 2, 3, 4, 5, 6, 7, 8, 9].index(ids[7])  # 7 comparisons, plain ints on the left
        {b: None for b in blocks[:4]}  # 4 hashes
        blocks.remove(blocks[3])  # 3 misses, then the identity hit (no comparison)
    assert (w.comparisons, w.hashes) == (7 + 3, 4)
    assert w.lines == 5  # this test is "learner code" too: the with body and its exit


def test_correct_queues_do_the_same_work_at_both_sizes_every_run():
    for cls, per_call in ((QueueOk, "2.0 and 2.0"), (QueueByIdDict, "2.0 and 2.0")):
        messages = {check("free_queue", cls).message for _ in range(3)}
        assert messages == {
            (
                "exact queue order in vLLM's story, and remove() does the same work at 500 and 8,000 blocks "
                f"({per_call} counted steps per call)."
            )
        }


def test_scanning_queues_are_refused_with_what_was_counted():
    res = check("free_queue", QueueList)
    assert not res and res.message == (
        "remove() is not O(1): with 500 blocks it did 236.4 steps per call (23,539 comparisons, 0 hashes, 100 lines of "
        "your code over 100 calls); with 8,000 blocks 4,437.7 steps per call (443,672 comparisons, 0 hashes, 100 lines "
        "of your code over 100 calls)"
    )
    res = check("free_queue", QueueScanLoop)
    assert not res and "0 comparisons, 0 hashes, 887,744 lines of your code" in res.message, res.message


def test_capstone_counts_touch_and_free_per_block():
    ok = check("block_manager", ManagerOk)
    assert ok and "touch + free did 16.0 and 16.0 counted steps per block with 500 and 8,000 blocks" in ok.message, ok.message
    res = check("block_manager", ListQueue)
    assert not res and res.message.startswith(
        "touch/free are not O(1): with 500 blocks they did 244.7 steps per block (23,569 comparisons"
    ), res.message
