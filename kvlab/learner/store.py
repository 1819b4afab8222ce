"""The learner's local record: locked predictions and passed exercises, in one JSON file.

Where: ``$KVLAB_HOME/progress.json`` if ``KVLAB_HOME`` is set, else ``~/.kvlab/progress.json``
-- outside the repository, so ``git pull`` and ``make lab-reset`` never touch it and it is
never committed. The tests and ``scripts/run_notebooks.py`` point ``KVLAB_HOME`` at a
temporary folder, so running the course for CI records nothing in anyone's home.

Why a file and not kernel memory: a learner works over days, restarts kernels and opens
lessons in any order; lesson 00 shows what they passed across all of that.

The file is small and written whole each time (to a temporary name, then renamed: an
interrupted write leaves the old file, never half a file). Two kernels writing at once
are serialised by a lock file where the OS has ``fcntl``. A file that is not valid
progress JSON is moved aside (``progress.json.bad-<time>``) with a warning, never lost and
never allowed to break a check: recording is best effort, a failed write only warns.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VERSION = 1
FILENAME = "progress.json"
MAX_PREDICTIONS = 5000  # the oldest are dropped beyond this: the file stays small


def home() -> Path:
    """The folder of the learner's record: ``$KVLAB_HOME``, else ``~/.kvlab``."""
    env = os.environ.get("KVLAB_HOME", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".kvlab"


def _empty() -> dict[str, Any]:
    return {"version": VERSION, "passed": {}, "predictions": []}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


class Store:
    """One progress file. Reads are fresh each time (another kernel may have written)."""

    def __init__(self, path: Path | str) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path, got {type(path).__name__} {path!r}")
        if not str(path).strip():
            raise ValueError(f"path must be a file path, got {path!r}")
        self.path = Path(path)

    # -- reading ------------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """The whole record; an empty one if there is no file yet."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return _empty()
        except OSError as e:
            warnings.warn(f"kvlab could not read your progress file {self.path}: {e}", stacklevel=2)
            return _empty()
        try:
            try:
                data = json.loads(text)
                _validate(data)
            except RecursionError:
                raise ValueError("nested deeper than JSON can read or write") from None
        except (json.JSONDecodeError, ValueError) as e:
            bad = _aside(self.path)
            with contextlib.suppress(OSError):
                self.path.replace(bad)
            warnings.warn(
                f"kvlab's progress file {self.path} was not valid ({e}); it was moved to {bad} and a new one started", stacklevel=2
            )
            return _empty()
        return data

    def passed(self) -> dict[str, dict[str, Any]]:
        """exercise id -> {"first": time, "last": time, "count": passes}."""
        return self.load()["passed"]

    def predictions(self) -> list[dict[str, Any]]:
        """Every locked prediction, oldest first."""
        return self.load()["predictions"]

    # -- writing ------------------------------------------------------------------------------
    def record_pass(self, exercise_id: str) -> None:
        if not isinstance(exercise_id, str):
            raise TypeError(f"exercise_id must be a non-empty str, got {type(exercise_id).__name__} {exercise_id!r}")
        if not exercise_id:
            raise ValueError(f"exercise_id must be a non-empty str, got {exercise_id!r}")
        with self._update() as data:
            if data is None:
                return
            entry = data["passed"].setdefault(exercise_id, {"first": _now(), "count": 0})
            entry["last"] = _now()
            entry["count"] = int(entry.get("count", 0)) + 1

    def record_prediction(self, entry: dict[str, Any]) -> None:
        """Add one prediction, or update the one with the same ``entry["uid"]``."""
        if not isinstance(entry, dict):
            raise TypeError(f"entry must be a dict with a str 'uid', got {type(entry).__name__}")
        if not isinstance(entry.get("uid"), str):
            raise ValueError("entry must be a dict with a str 'uid'")
        with self._update() as data:
            if data is None:
                return
            preds = data["predictions"]
            for i in range(len(preds) - 1, -1, -1):
                if preds[i].get("uid") == entry["uid"]:
                    preds[i] = {**preds[i], **entry}
                    break
            else:
                preds.append(dict(entry))
            del preds[:-MAX_PREDICTIONS]

    def clear(self) -> None:
        """Forget everything (the file is removed)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    @contextlib.contextmanager
    def _update(self) -> Iterator[dict[str, Any] | None]:
        """Read, let the caller change, write back atomically. Yields None if the folder
        cannot be written (a warning says so; the learner's check still completes)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = os.fdopen(_open_new_or_own(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT), "r+b")
        except OSError as e:
            warnings.warn(f"kvlab could not record your progress in {self.path}: {e}", stacklevel=3)
            yield None
            return
        with lock:
            _lock(lock)
            data = self.load()
            yield data
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                raw = _encode(data)  # before the file is opened: a failure leaves no half file
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()  # a stale one of ours, or a planted link: the link goes, not its target
                with os.fdopen(_open_new_or_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                    f.write(raw)
                tmp.replace(self.path)
            except (OSError, ValueError, RecursionError) as e:
                warnings.warn(f"kvlab could not record your progress in {self.path}: {e}", stacklevel=3)


def _open_new_or_own(path: Path, flags: int) -> int:
    """Open without following a symbolic link: a link planted at the lock or temporary name
    must not make kvlab write through it to a file elsewhere."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)


def _lock(f: Any) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: last writer wins
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file is closed


def _aside(path: Path) -> Path:
    """A free name beside ``path`` for a file that is not valid progress: two bad files in
    the same second must not overwrite each other (the learner's data is never lost)."""
    stem = f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}"
    bad, n = path.with_name(stem), 1
    while bad.exists():
        n += 1
        bad = path.with_name(f"{stem}-{n}")
    return bad


def _encode(data: Any) -> bytes:
    """The file's bytes for ``data``: ValueError (UnicodeEncodeError: a lone surrogate such
    as ``"\\ud800"``, which JSON can spell but UTF-8 cannot) or RecursionError if it has none."""
    return (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def _validate(data: Any) -> None:
    """The whole record, every entry: a file that would make a later read or write fail
    half-way (``"count": "x"``, a prediction that is not an object) is refused here, so it
    is moved aside whole instead of breaking the learner's next check."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, found {type(data).__name__}")
    if data.get("version") != VERSION:
        raise ValueError(f"version {data.get('version')!r} is not {VERSION}")
    if not isinstance(data.get("passed"), dict) or not isinstance(data.get("predictions"), list):
        raise ValueError("'passed' must be an object and 'predictions' a list")
    for eid, entry in data["passed"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"passed[{eid!r}] must be an object, found {type(entry).__name__}")
        count = entry.get("count", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"passed[{eid!r}].count must be an int >= 0, found {count!r}")
    for i, p in enumerate(data["predictions"]):
        if not isinstance(p, dict) or not isinstance(p.get("uid"), str):
            raise ValueError(f"predictions[{i}] must be an object with a str 'uid'")
    try:
        _encode(data)  # it must also write back: every passing check does
    except UnicodeEncodeError as e:
        raise ValueError(f"it cannot be written back as UTF-8: {e.object[e.start : e.end]!r} is a lone surrogate") from None


def store() -> Store:
    """The learner's store, at ``home()`` as the environment says *now*."""
    return Store(home() / FILENAME)
