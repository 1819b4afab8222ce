"""What keeps one learner's submission from hurting the kernel, the engine or the next check.

A check runs learner code inside the real engine. Three things can go wrong that the
learner did not mean, and each has a guard here:

* **It never ends** (``while True:``, a queue whose ``popleft`` never advances, a Triton
  step that loops). :func:`time_limit` stops it after N seconds with :class:`CheckTimeout`
  -- a ``BaseException``, so a learner's ``except Exception:`` (or the Triton
  interpreter's own error wrapping) cannot swallow it. In the main thread (where Jupyter
  runs every cell) it is a ``SIGALRM`` timer: the handler raises between two bytecodes of
  a pure-Python loop, of the interpreted kernel, or interrupts a ``time.sleep``; the
  previous handler and timer (pytest-timeout's, say) are put back afterwards. In another
  thread a watchdog raises it there with ``PyThreadState_SetAsyncExc`` (a loop in C code,
  e.g. one huge numpy call, is stopped when it returns to Python). Why not a subprocess:
  the learner's function lives in the notebook's kernel -- defined in a cell, closing over
  its globals -- and forking a kernel that holds ZMQ and torch threads is not sound; the
  in-process timer stops the runaway for real (no thread left spinning).
* **It changes kvlab itself** (``kv_cache_utils.NONE_HASH = b""``, ``BlockPool.touch =
  mine``): :func:`kvlab_state_restored` puts every module global and class attribute of
  every loaded ``kvlab`` module back as it was before the check, so the next check (and
  the learner's next lesson cell) sees kvlab unchanged. Names *added* are left (harmless,
  and the Triton interpreter adds helpers to a kernel's module); changes *inside* mutable
  module objects are not undone -- the checks keep no such state of their own.
* **Its answer only looks right**: see :mod:`kvlab.exercises.answers`.
"""
from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["CheckTimeout", "time_limit", "kvlab_state_restored"]


class CheckTimeout(BaseException):
    """The learner's code ran past the check's time limit (a BaseException on purpose: no
    ``except Exception`` in learner code or in the Triton interpreter can swallow it)."""

    def __init__(self, seconds: float | None = None) -> None:
        super().__init__("ran past the time limit" if seconds is None else f"ran longer than {seconds:g} s")
        self.seconds = seconds


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CheckTimeout` in this thread if the body runs longer than ``seconds``."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        yield from _alarm(seconds)
    else:
        yield from _watchdog(seconds)


def _alarm(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise CheckTimeout(seconds)

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:  # someone else's timer was running: give it back, minus our time
            left = old_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), old_interval)


def _watchdog(seconds: float) -> Iterator[None]:
    tid = threading.get_ident()
    done = threading.Event()
    lock = threading.Lock()
    fired = [False]

    def watch() -> None:
        if not done.wait(seconds):
            with lock:
                if not done.is_set():
                    fired[0] = True
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(CheckTimeout))

    t = threading.Thread(target=watch, name="kvlab-check-watchdog", daemon=True)
    t.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if fired[0]:  # raised but perhaps not delivered yet: take it back
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
        t.join()


def _kvlab_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "kvlab" or name.startswith("kvlab."))]


@contextmanager
def kvlab_state_restored() -> Iterator[None]:
    """Put back every module global and class attribute of the loaded kvlab modules."""
    saved: list[tuple[Any, dict[str, Any]]] = []
    for mod in _kvlab_modules():
        names = dict(vars(mod))
        saved.append((mod, names))
        for v in names.values():
            if isinstance(v, type) and v.__module__ == mod.__name__:
                saved.append((v, dict(vars(v))))
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            # Names added since stay: a new name changes nothing kvlab reads, and the
            # Triton interpreter itself adds helpers to the globals of the kernels it runs.
            for k, v in before.items():
                if now.get(k, _MISSING) is not v:
                    try:
                        setattr(obj, k, v)
                    except (AttributeError, TypeError):
                        pass


_MISSING = object()
