"""Copies of an object's attributes, for all-or-nothing calls (see ``KVCacheManager.checkpoint``).

A checkpoint must be cheap enough to take before every engine step, yet complete enough
that restoring it undoes anything the step did -- including what code added later (a new
manager with new bookkeeping) does. So the per-group managers are copied *generically*:
every attribute, with containers copied two levels deep (a ``dict`` of ``list`` block
tables is a new dict of new lists holding the same block objects), everything else kept
by reference (blocks, specs, the pool: those have owners that checkpoint them).
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from typing import Any

__all__ = ["copy_attrs", "put_attrs"]

_FLAT = frozenset((list, dict, set, deque, bytearray, OrderedDict, defaultdict))


def _copy(v: Any) -> Any:
    t = type(v)
    if t is dict:
        return {k: (x.copy() if x.__class__ in _FLAT else x) for k, x in v.items()}
    if t is list:
        return [x.copy() if type(x) in _FLAT else x for x in v]
    if t in _FLAT:
        c = v.copy()
        if isinstance(c, dict):  # an OrderedDict or defaultdict: its values one level down too
            for k, x in c.items():
                if x.__class__ in _FLAT:
                    c[k] = x.copy()
        return c
    return v


def copy_attrs(obj: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Every attribute of ``obj`` (its ``__dict__``) but ``skip``, containers copied two levels deep."""
    return {k: _copy(v) for k, v in vars(obj).items() if k not in skip}


def put_attrs(obj: Any, saved: dict[str, Any]) -> None:
    """Set ``obj``'s attributes back to ``saved`` (copied again: ``saved`` stays reusable)."""
    for k, v in saved.items():
        setattr(obj, k, _copy(v))
