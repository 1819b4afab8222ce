"""Copies of an object's attributes, for all-or-nothing calls (see ``kvlab.core.transaction``).

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


def restore_into(obj: Any, saved: dict[str, Any], memo: dict[int, Any]) -> None:
    """Set ``obj``'s attributes back to ``saved`` (a deep copy of them, taken earlier) without
    replacing the objects a caller may hold: a kvlab object reached through an attribute that
    is, now and then, of the same class (with a ``__dict__``) is restored into; everything else
    becomes a fresh deep copy in which those objects are the current ones -- so objects that
    were shared (a tier in a list and in an attribute) stay shared. ``memo`` maps objects
    to share as they are (``id -> object``); ``saved`` stays reusable."""
    import copy

    pairs: list[tuple[Any, dict[str, Any]]] = [(obj, saved)]

    def pair(cur_obj: Any, saved_attrs: dict[str, Any]) -> None:
        now = vars(cur_obj)
        for k, v in saved_attrs.items():
            cur = now.get(k)
            if (
                cur is not None
                and type(cur) is type(v)
                and type(cur).__module__.startswith("kvlab.")
                and hasattr(cur, "__dict__")
                and id(cur) not in memo
                and id(v) not in memo
            ):
                memo[id(v)] = cur
                pairs.append((cur, vars(v)))
                pair(cur, vars(v))

    pair(obj, saved)
    for cur_obj, saved_attrs in pairs:
        now = vars(cur_obj)
        for k, v in saved_attrs.items():
            if memo.get(id(v)) is not now.get(k, _NO):  # not an object restored in place
                setattr(cur_obj, k, copy.deepcopy(v, memo))


_NO = object()
