"""Comparing a learner's answer with the expected one: by type AND value.

``got == want`` is not a check when ``got`` is the learner's object: Python asks
``want.__eq__`` first, and when that answers ``NotImplemented`` (an int compared with an
unknown type) it asks ``got.__eq__`` -- which a learner's object (or a mock, or a
``numpy`` array) may answer with anything, even ``True`` for every question. So
:func:`same` looks at the type first and compares values only between kvlab's own kinds
of value (ints -- numpy's count too --, bytes, str, tuples, lists, None, ...).

:func:`type_problem` says what is wrong with the *kind* of answer, in the words a
learner needs: ``got None -- a missing return?``, ``expected an int, got str '3'``.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

__all__ = ["same", "type_problem", "describe", "is_int"]


def _is_int(x: Any) -> bool:
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return False
    if type(x) is int:
        return True
    if isinstance(x, numbers.Integral):  # numpy / torch integer scalars
        try:
            operator.index(x)
            return True
        except TypeError:
            return False
    return False


def is_int(x: Any) -> bool:
    """An int -- numpy's and torch's integer scalars too --, never a bool: what a checker
    accepts where the answer is a whole number."""
    return _is_int(x)


def _kind(want: Any) -> str:
    if want is None:
        return "None"
    if isinstance(want, bool):
        return "True or False"
    if isinstance(want, int):
        return "an int"
    if isinstance(want, bytes):
        return "bytes"
    if isinstance(want, str):
        return "a str"
    if isinstance(want, float):
        return "a float"
    if isinstance(want, tuple):
        return "a tuple"
    if isinstance(want, list):
        return "a list"
    return f"a {type(want).__name__}"


def describe(x: Any, n: int = 60) -> str:
    """A short, safe description of a learner's value (its repr may raise or be huge)."""
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - a learner's __repr__ may raise
        r = f"<{type(x).__name__} object>"
    return r if len(r) <= n else r[: n - 1] + "…"


def same(got: Any, want: Any) -> bool:
    """``got`` equals ``want`` with a type that fits it (an int is an int, numpy's too; a
    tuple is a tuple of equal items). An object that claims to equal everything fails."""
    if want is None:
        return got is None
    if isinstance(want, bool):
        return type(got) is bool and got is want
    if isinstance(want, int):
        return _is_int(got) and operator.index(got) == want
    if isinstance(want, float):
        return type(got) is float and got == want
    if isinstance(want, (bytes, str)):
        return type(got) is type(want) and want == got
    if isinstance(want, (tuple, list)):
        return type(got) is type(want) and len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return type(got) is dict and got.keys() == want.keys() and all(same(got[k], w) for k, w in want.items())
    return type(got) is type(want) and want == got


def type_problem(got: Any, want: Any) -> str | None:
    """What is wrong with the kind of ``got`` (None when its kind fits ``want``)."""
    if want is not None and got is None:
        return "got None — a missing return?"
    if isinstance(want, bool):
        ok = type(got) is bool
    elif isinstance(want, int):
        ok = _is_int(got)
    elif want is None:
        ok = got is None
    elif isinstance(want, (tuple, list)):
        if type(got) is not type(want):
            ok = False
        else:
            for i, (g, w) in enumerate(zip(got, want)):
                p = type_problem(g, w)
                if p is not None:
                    return f"item {i}: {p}"
            ok = True
    else:
        ok = type(got) is type(want)
    return None if ok else f"expected {_kind(want)}, got {type(got).__name__} {describe(got)}"
