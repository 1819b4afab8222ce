"""The waiting queue, in the order requests leave it (lesson 05).

vLLM: ``vllm/v1/core/sched/request_queue.py``. FCFS is a deque (a preempted request goes
back to the *front*); ``priority`` is a heap on ``(priority, arrival_time)`` -- a preempted
request simply goes back onto the heap, where its old key puts it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kvlab.request import Request

POLICIES = ("fcfs", "priority")


class FCFSRequestQueue:
    """Waiting queue in arrival order; a preempted request is put back at the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, r: Request) -> None:
        self._q.append(r)

    def prepend_request(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek_request(self) -> Request:
        return self._q[0]

    def pop_request(self) -> Request:
        return self._q.popleft()

    def remove_request(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue:
    """Waiting queue ordered by (priority, arrival_time, request_id): lower runs first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, r.request_id, r))

    prepend_request = add_request  # a preempted request simply goes back into the heap

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_request(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In pop order."""
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))
