"""What keeps one learner's submission from hurting the kernel, the engine or the next check.

A check runs learner code inside the real engine. Three things can go wrong that the
learner did not mean, and each has a guard here:

* **It never ends** (``while True:``, a queue whose ``popleft`` never advances, a Triton
  step that loops). :func:`time_limit` stops it with :class:`CheckTimeout` -- a
  ``BaseException``, so a learner's ``except Exception:`` (or the Triton interpreter's own
  error wrapping) cannot swallow it. The limit is **CPU time** of the checking thread, not
  the wall clock: on a busy machine (a shared hub, a slow Binder pod, CI beside other jobs)
  correct code gets fewer seconds of CPU per second of wall time, and a wall-clock limit
  turned it into "an endless loop?". An endless loop burns CPU wherever it runs, so the CPU
  limit gives the same verdict on every machine. A loop that burns none (``time.sleep``, a
  wait that never returns) is stopped by a ceiling on the time the code spends **waiting**,
  ``WALL_FACTOR`` times the CPU limit: wall time minus the time the thread ran or sat in the
  run queue for a CPU (Linux's per-thread ``schedstat``). On a busy machine a computing thread
  queues for a CPU instead of waiting, so load never turns an endless loop into "a wait";
  where ``schedstat`` is missing, the plain wall clock stands in.

  A watchdog thread reads the checking thread's CPU clock (``pthread_getcpuclockid``) ten
  times a second. In the main thread (where Jupyter runs every cell) it stops the code with
  a signal: the handler raises between two bytecodes of a pure-Python loop or of the
  interpreted kernel, and interrupts a ``time.sleep``. It knocks again at every poll until
  the check ends (the code may have caught one knock in a ``finally`` that loops), and since
  the watchdog is a thread, not an interval timer, ``signal.setitimer(...)`` in learner code
  does not switch it off. (A loop that catches ``BaseException`` itself and carries on
  cannot be stopped from inside the process; nor can Jupyter's interrupt stop it.) In
  another thread the watchdog raises ``CheckTimeout`` there with
  ``PyThreadState_SetAsyncExc``, again and again until the check ends (a loop in C code, e.g.
  one huge numpy call, is stopped when it returns to Python). Why not a subprocess: the
  learner's function lives in the notebook's kernel -- defined in a cell, closing over its
  globals -- and forking a kernel that holds ZMQ and torch threads is not sound.
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
import importlib.util
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

__all__ = ["CheckTimeout", "Limit", "time_limit", "kvlab_state_restored", "WALL_FACTOR"]

#: The ceiling on waiting (neither running nor queued for a CPU) is this many times the CPU
#: limit: only code that waits without computing ever reaches it, so it can be generous.
WALL_FACTOR = 10.0
_POLL_S = 0.1
_SIGNAL = signal.SIGUSR2  # the watchdog's knock on the main thread (no timer: see the docstring)


class CheckTimeout(BaseException):
    """The learner's code ran past the check's limit (a BaseException on purpose: no
    ``except Exception`` in learner code or in the Triton interpreter can swallow it)."""

    def __init__(self, seconds: float | None = None) -> None:
        super().__init__("ran past the time limit" if seconds is None else f"used more than {seconds:g} s of CPU time")
        self.seconds = seconds


@dataclass
class Limit:
    """The limits of one :func:`time_limit` block and, once it fired, which one: ``"cpu"``
    (the code kept computing) or ``"wall"`` (it kept waiting)."""

    cpu_s: float
    wall_s: float
    reason: str | None = None

    def message(self) -> str:
        if self.reason == "wall":
            return (
                f"your code waited more than {self.wall_s:g} s without finishing, computing nothing — "
                "a sleep, or a wait for something that never comes?"
            )
        return f"your code used more than {self.cpu_s:g} s of CPU time — an endless loop?"


def _thread_busy_clock(native_id: int) -> Any:
    """Seconds the thread has run or waited in the run queue for a CPU (``schedstat``'s first
    two fields), or None where the kernel does not report them."""
    path = f"/proc/self/task/{native_id}/schedstat"

    def busy() -> float:
        with open(path, "rb") as f:
            on_cpu, queued = f.read().split()[:2]
        return (int(on_cpu) + int(queued)) / 1e9

    try:
        busy()
    except (OSError, ValueError):
        return None
    return busy


def _thread_cpu_clock(tid: int) -> Any:
    try:
        clock = time.pthread_getcpuclockid(tid)
        time.clock_gettime(clock)
        return lambda: time.clock_gettime(clock)
    except (AttributeError, OSError):  # no per-thread CPU clock here: the wall clock stands in
        return time.monotonic


@contextmanager
def time_limit(seconds: float, wall_s: float | None = None) -> Iterator[Limit]:
    """Raise :class:`CheckTimeout` in this thread once the body has used ``seconds`` of CPU
    time, or has waited (neither run nor queued for a CPU) ``wall_s`` seconds (default
    ``WALL_FACTOR * seconds``); the yielded :class:`Limit` says which."""
    limit = Limit(float(seconds), float(seconds * WALL_FACTOR if wall_s is None else wall_s))
    tid = threading.get_ident()
    cpu = _thread_cpu_clock(tid)
    busy = _thread_busy_clock(threading.get_native_id()) or (lambda: 0.0)
    main = threading.current_thread() is threading.main_thread()
    cpu0, wall0, busy0 = cpu(), time.monotonic(), busy()
    done = threading.Event()

    def knock() -> None:
        if main:
            signal.pthread_kill(tid, _SIGNAL)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(CheckTimeout))

    def watch() -> None:
        while not done.wait(_POLL_S):
            if limit.reason is None:
                if cpu() - cpu0 > limit.cpu_s:
                    limit.reason = "cpu"
                elif (time.monotonic() - wall0) - (busy() - busy0) > limit.wall_s:  # waited, not computed
                    limit.reason = "wall"
            if limit.reason is not None and not done.is_set():
                knock()  # again at every poll: the code may have caught the last one

    def on_knock(signum: int, frame: FrameType | None) -> None:
        if limit.reason is not None and not done.is_set():
            raise CheckTimeout(limit.cpu_s)

    old_handler = signal.signal(_SIGNAL, on_knock) if main else None
    watchdog = threading.Thread(target=watch, name="kvlab-check-watchdog", daemon=True)
    watchdog.start()

    def stop() -> None:
        done.set()
        watchdog.join()  # no knock after this: only then may the signal's old handler come back
        if main:
            signal.signal(_SIGNAL, old_handler)
        elif limit.reason is not None:
            _drain_pending_timeout()

    try:
        yield limit
    finally:
        while True:  # a timeout still pending when the body ended may land in here: finish anyway
            try:
                stop()
                break
            except CheckTimeout:
                continue


def _drain_pending_timeout() -> None:
    """Let a ``CheckTimeout`` the watchdog sent into this thread arrive now, and drop it.

    Why not ``PyThreadState_SetAsyncExc(tid, NULL)``: clearing raises the interpreter's
    "something is pending" flag and, with nothing pending, CPython 3.11 never lowers it again;
    the next time any thread runs under a trace function (a debugger, coverage, the work
    counter of :mod:`kvlab.exercises.work`) it spins at its next function entry."""
    try:
        for _ in range(1000):  # each backward jump checks for a pending exception
            pass
    except CheckTimeout:
        pass


def _not_learner_dirs() -> tuple[str, ...]:
    kvlab_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sysconfig.get_paths()
    dirs = {kvlab_dir, paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    kernels = importlib.util.find_spec("kvlab.kernels")  # installed from the top-level kernels/ folder
    if kernels is not None and kernels.origin:
        dirs.add(os.path.dirname(kernels.origin))
    return (*(os.path.join(d, "") for d in dirs if d), "<frozen")


_NOT_LEARNER = _not_learner_dirs()
_learner_code: dict[CodeType, bool] = {}


def is_learner_file(filename: str) -> bool:
    """A file that is neither kvlab's, the standard library's nor an installed package's: the
    learner's cell (or a test's stand-in for it), wherever the course is checked out."""
    return not filename.startswith(_NOT_LEARNER)


def is_learner_code(code: CodeType) -> bool:
    """:func:`is_learner_file` of a code object, cached per code object: asked per call."""
    mine = _learner_code.get(code)
    if mine is None:
        mine = _learner_code[code] = is_learner_file(code.co_filename)
    return mine


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
