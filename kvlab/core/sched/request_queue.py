"""The waiting queue, in the order requests leave it (lesson 05).

vLLM: ``vllm/v1/core/sched/request_queue.py``. FCFS is a deque (a preempted request goes
back to the *front*); ``priority`` is a heap on ``(priority, arrival_time)`` -- a preempted
request simply goes back onto the heap, where its old key puts it. As in vLLM, the heap compares
the requests' fields as they are at each comparison (a session's next chunk changes its
``arrival_time`` while it waits; the heap is not re-ordered).
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


class _Queued:
    """A request in the priority heap, ordered by its fields *as they are when compared*:
    vLLM 0.33's heap holds the requests themselves (``Request.__lt__``), so a streaming
    session whose next chunk changes its ``arrival_time`` while it waits keeps the place the
    heap's shape gives it -- the heap is not re-ordered. kvlab mirrors that, so both pop the
    same request."""

    __slots__ = ("request",)

    def __init__(self, request: Request) -> None:
        self.request = request

    def __lt__(self, other: _Queued) -> bool:
        a, b = self.request, other.request
        if a.priority != b.priority:
            return a.priority < b.priority
        if a.arrival_time != b.arrival_time:
            return a.arrival_time < b.arrival_time
        if a.request_id != b.request_id:
            return a.request_id < b.request_id
        return id(a) < id(b)


class PriorityRequestQueue:
    """Waiting queue ordered by (priority, arrival_time, request_id): lower runs first."""

    def __init__(self) -> None:
        self._heap: list[_Queued] = []

    def add_request(self, r: Request) -> None:
        heapq.heappush(self._heap, _Queued(r))

    prepend_request = add_request  # a preempted request simply goes back into the heap

    def peek_request(self) -> Request:
        return self._heap[0].request

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap).request

    def remove_request(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e.request is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In pop order (popped from a copy of the heap, as vLLM's)."""
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap).request
