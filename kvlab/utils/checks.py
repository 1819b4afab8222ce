"""Argument checks for kvlab's public doors: one place that says what "an int" means.

Learners call kvlab from notebooks, with values that come from ``range``, numpy arrays,
torch tensors or a typo. Every public entry point validates its own arguments with these
helpers, *before* it changes any state, so a bad call raises and leaves everything as it
was (kvlab's all-or-nothing rule). An argument is checked once, at the door that
owns it; the layers behind that door trust what they are handed.

What counts as an int: anything ``operator.index`` accepts (``int``, numpy and torch
integer scalars), except ``bool`` -- ``True`` where a count belongs is always a bug. The
helpers return a plain ``int``/``float``, so numpy scalars never leak into kvlab's state
(where, for instance, they would hash differently from the ints they equal).
"""

from __future__ import annotations

import math
import numbers
import operator

__all__ = ["AssertedValueError", "check_int", "check_optional_int", "check_number"]


class AssertedValueError(ValueError, AssertionError):
    """A bad argument to a call that vLLM guards with ``assert``: its callers (and its tests)
    expect an AssertionError, while kvlab refuses bad input with a ValueError that names the
    argument. This is both, so either ``except`` catches it."""


def _int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an int in {lo}..{hi}"
    if lo is not None:
        return f"an int >= {lo}"
    if hi is not None:
        return f"an int <= {hi}"
    return "an int"


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, *, why: str = "") -> int:
    """``value`` as a plain int in ``lo..hi`` (either bound may be None), or raise.

    ``TypeError`` for a non-integer (bool included), ``ValueError`` outside the range; both
    name the argument and the allowed values. ``why`` is appended to the range message
    (e.g. ``" (block 0 is the null block)"``).
    """
    if type(value) is int:  # the common case, without operator.index's call
        v = value
    else:
        if isinstance(value, bool):  # numpy's bool has no __index__: operator.index refuses it
            raise TypeError(f"{name} must be {_int_range(lo, hi)}, got a bool ({value!r})")
        try:
            v = operator.index(value)  # type: ignore[arg-type]  # any object: one without __index__ raises the TypeError caught below
        except TypeError:
            raise TypeError(f"{name} must be {_int_range(lo, hi)}, got {type(value).__name__} {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}={v} is out of range; {name} must be {_int_range(lo, hi)}{why}")
    return v


def check_optional_int(name: str, value: object, lo: int | None = None, hi: int | None = None, *, why: str = "") -> int | None:
    """``None``, or ``check_int(name, value, lo, hi)`` (messages say "None or ...")."""
    if value is None:
        return None
    try:
        return check_int(name, value, lo, hi, why=why)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace(" must be ", " must be None or ", 1)) from None


def check_number(name: str, value: object, lo: float | None = None, *, strict: bool = False, why: str = "") -> float:
    """``value`` as a finite float ``>= lo`` (``> lo`` when ``strict``), or raise.

    Ints and numpy/torch real scalars are accepted; bools, NaN and infinities are not.
    """
    bound = "" if lo is None else f" {'>' if strict else '>='} {lo:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number{bound}, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or (lo is not None and (v <= lo if strict else v < lo)):
        raise ValueError(f"{name}={value!r} is out of range; {name} must be a finite number{bound}{why}")
    return v
