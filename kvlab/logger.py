"""kvlab's loggers, with vLLM's ``*_once`` methods (vLLM 0.33: ``vllm/logger.py``).

``init_logger(__name__)`` is the standard library's logger for that module, plus
``info_once`` / ``warning_once``: a message (with its arguments) is written the first time
only, for the life of the process -- for a condition met on every step, where one line
says it and a thousand would drown the log.
"""

from __future__ import annotations

import logging
from typing import Any

_SEEN: set[tuple[str, str, tuple[Any, ...]]] = set()


class _Logger(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return msg, kwargs

    def _once(self, level: int, msg: str, args: tuple[Any, ...], kwargs: Any) -> None:
        key = (self.logger.name, msg, tuple(map(repr, args)))
        if key in _SEEN:
            return
        _SEEN.add(key)
        self.log(level, msg, *args, **kwargs)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.INFO, msg, args, kwargs)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.WARNING, msg, args, kwargs)


def init_logger(name: str) -> _Logger:
    """The logger of module ``name``, with ``info_once`` and ``warning_once``."""
    return _Logger(logging.getLogger(name), {})
