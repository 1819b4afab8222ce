"""The file tier's I/O threads (vLLM 0.33: ``DualQueueThreadPool`` in
``vllm/v1/kv_offload/tiering/fs/thread_pool.py``).

Two queues, loads and stores, and two groups of threads: read-priority threads take a load
when there is one, else a store; write-priority threads the reverse. A promotion, which a
request is waiting for, is never stuck behind a burst of cascades, and neither queue starves.
A job is a list of tasks; it is finished when its last task is, and failed if any raised.
The scheduler collects finished jobs with ``get_finished`` and never blocks on one (only
``wait_idle``, used by a cache reset, waits -- bounded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvlab.kv_offload.tiering.base import JobId
from kvlab.utils.checks import check_int

logger = logging.getLogger(__name__)

Task = Callable[[], None]


class JobState:
    """How many of a job's tasks ended, whether all succeeded, and their summed time."""

    __slots__ = ("job_id", "_n_tasks", "_completed", "_success", "_transfer_time", "_lock")

    def __init__(self, job_id: JobId, n_tasks: int) -> None:
        self.job_id = job_id
        self._n_tasks = n_tasks
        self._completed = 0
        self._success = True
        self._transfer_time = 0.0
        self._lock = threading.Lock()

    def task_done(self, success: bool, transfer_time: float) -> tuple[bool, bool, float]:
        """(job finished, job succeeded so far, its transfer time so far)."""
        with self._lock:
            self._completed += 1
            self._transfer_time += transfer_time
            self._success &= success
            return self._completed == self._n_tasks, self._success, self._transfer_time


class DualQueueThreadPool:
    def __init__(self, n_read_threads: int, n_write_threads: int, thread_name_prefix: str = "fs_secondary_tier") -> None:
        check_int("n_read_threads", n_read_threads, 1)
        check_int("n_write_threads", n_write_threads, 1)
        self._load_q: deque[tuple[JobState, Task]] = deque()
        self._store_q: deque[tuple[JobState, Task]] = deque()
        self._finished: deque[tuple[JobId, bool, float]] = deque()
        self._cv = threading.Condition()
        self._running = 0
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._work, args=(reads_first,), name=f"{thread_name_prefix}_{'r' if reads_first else 'w'}{i}", daemon=True
            )
            for reads_first, n in ((True, n_read_threads), (False, n_write_threads))
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _enqueue(self, queue: deque[tuple[JobState, Task]], job_id: JobId, n_tasks: int, tasks: list[Task]) -> None:
        if n_tasks != len(tasks) or n_tasks < 1:
            raise ValueError(f"job {job_id}: n_tasks={n_tasks} but {len(tasks)} tasks were given (at least 1)")
        state = JobState(job_id, n_tasks)
        with self._cv:
            if self._closed:
                raise RuntimeError("the thread pool was shut down")
            queue.extend((state, task) for task in tasks)
            self._cv.notify_all()

    def enqueue_load(self, job_id: JobId, n_tasks: int, tasks: list[Task]) -> None:
        self._enqueue(self._load_q, job_id, n_tasks, tasks)

    def enqueue_store(self, job_id: JobId, n_tasks: int, tasks: list[Task]) -> None:
        self._enqueue(self._store_q, job_id, n_tasks, tasks)

    def _work(self, reads_first: bool) -> None:
        order = (self._load_q, self._store_q) if reads_first else (self._store_q, self._load_q)
        while True:
            with self._cv:
                while not (self._closed or self._load_q or self._store_q):
                    self._cv.wait()
                if self._closed and not (self._load_q or self._store_q):
                    return
                state, task = (order[0] or order[1]).popleft()
                self._running += 1
            start = time.monotonic()  # reported as the job's transfer time (metrics only)
            try:
                task()
                ok = True
            except Exception:
                logger.debug("tier I/O task of job %s failed", state.job_id, exc_info=True)
                ok = False
            done, success, seconds = state.task_done(ok, time.monotonic() - start)
            with self._cv:
                self._running -= 1
                if done:
                    self._finished.append((state.job_id, success, seconds))
                self._cv.notify_all()

    def get_finished(self) -> list[tuple[JobId, bool, float]]:
        """(job id, success, transfer seconds) of the jobs finished since the last call."""
        with self._cv:
            out = list(self._finished)
            self._finished.clear()
        return out

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Wait until no task is queued or running (TimeoutError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._load_q or self._store_q or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"tier I/O still busy after {timeout_s:.0f} s ({len(self._load_q)} loads, {len(self._store_q)} stores queued)"
                    )
                self._cv.wait(left)

    def shutdown(self, wait: bool = True, timeout_s: float = 120.0) -> None:
        """Drop queued tasks (their jobs fail), let running ones end, stop the threads."""
        with self._cv:
            dropped = list(self._load_q) + list(self._store_q)
            self._load_q.clear()
            self._store_q.clear()
            self._closed = True
            for state, _ in dropped:
                done, success, seconds = state.task_done(False, 0.0)
                if done:
                    self._finished.append((state.job_id, success, seconds))
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                t.join(timeout=timeout_s)
