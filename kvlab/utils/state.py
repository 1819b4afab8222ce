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
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

__all__ = ["UNSET", "copy_attrs", "copy_named", "get_fields", "put_attrs", "set_fields"]

_FLAT = frozenset((list, dict, set, deque, bytearray, OrderedDict, defaultdict))


def _copy(v: Any) -> Any:
    t = type(v)
    if t is dict:
        if _FLAT.isdisjoint(map(type, v.values())):  # no container inside (checked in C): one copy
            return v.copy()
        return {k: (x.copy() if x.__class__ in _FLAT else x) for k, x in v.items()}
    if t is list:
        if _FLAT.isdisjoint(map(type, v)):
            return v.copy()
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


def copy_named(obj: Any, names: Iterable[str]) -> dict[str, Any]:
    """``copy_attrs`` for the attributes ``names`` only, read one by one (``obj.__dict__`` is
    never touched: see ``get_fields``)."""
    return {n: _copy(getattr(obj, n)) for n in names}


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
                and not _frozen(type(cur))  # cannot have changed, and cannot be set into
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


def _frozen(cls: type) -> bool:
    params = getattr(cls, "__dataclass_params__", None)
    return params is not None and bool(params.frozen)


#: A slot that was never set (``get_fields`` records it, ``set_fields`` leaves it unset).
UNSET: Any = object()
#: A class -> its slot names (every base's, in MRO order), and the reader get_fields uses.
_PLANS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple]]] = {}


def _plan(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple]]:
    names = tuple(dict.fromkeys(n for c in cls.__mro__ for n in c.__dict__.get("__slots__", ()) if n not in ("__dict__", "__weakref__")))
    has_dict = "__dict__" in dir(cls)
    if not names:
        return names, lambda obj: ((), obj.__dict__.copy())
    get = attrgetter(*names, "__class__")  # one name would give the value itself: "__class__" keeps it a tuple

    def read(obj: Any) -> tuple:
        try:
            values = get(obj)
        except AttributeError:  # a slot never set
            values = tuple(getattr(obj, n, UNSET) for n in names) + (type(obj),)
        return values, obj.__dict__.copy() if has_dict else None

    return names, read


def get_fields(obj: Any) -> tuple[tuple, dict[str, Any] | None]:
    """Every attribute of ``obj`` as it is now, for :func:`set_fields`: its slots (read at once,
    in C) and a copy of its ``__dict__`` if it has one. Generic, so an attribute added later
    cannot be forgotten; O(attributes). A slotted class is read without touching its
    ``__dict__`` unless it declares one (reading it would turn CPython's compact attribute
    storage into a dict, and every later attribute read of the object slower)."""
    plan = _PLANS.get(type(obj))
    if plan is None:
        plan = _PLANS[type(obj)] = _plan(type(obj))
    return plan[1](obj)


def set_fields(obj: Any, saved: tuple[tuple, dict[str, Any] | None]) -> None:
    """Put ``obj``'s attributes back as :func:`get_fields` read them (``saved`` stays reusable)."""
    values, attrs = saved
    for name, v in zip(_PLANS[type(obj)][0], values):
        if v is UNSET:
            if hasattr(obj, name):
                delattr(obj, name)
        else:
            setattr(obj, name, v)
    if attrs is not None:
        d = obj.__dict__
        d.clear()
        d.update(attrs)
