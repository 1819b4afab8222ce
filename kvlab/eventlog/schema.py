"""Strict reading of saved files: event logs and snapshots (lesson 00: "someone sent you a run").

A file is an outsider: it may be from another version, hand-edited, truncated, or made to
hurt. So reading one is all or nothing and says exactly what is wrong:

* every file carries a ``version``; a version this kvlab does not know is refused (no
  guessing what a newer writer meant);
* every record has exactly its fields -- none missing, none unknown -- each of its type
  (from the dataclass annotations, the one definition of each record) and in its range;
  the ``ValueError`` names the field (``events[12].block_ids[3]``) and what is allowed;
* nothing is allocated from what a file *claims* before the claim is checked: a few
  kilobytes saying "10**9 blocks" are refused at once, not after gigabytes of lists
  (``max_blocks``, default :data:`MAX_BLOCKS`).

The checks here are structural (one record at a time); whether the events make sense one
after another (a block freed that nobody holds, a request that was never added) is
checked when they are replayed (``ReplayState`` raises a ``ValueError`` naming the event).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_BLOCKS", "HashKeys", "parse_json", "check_record", "check_version", "check_num_blocks"]

MAX_BLOCKS = 1 << 20
"""The most blocks a file may declare unless the reader raises the limit (``max_blocks=``):
about a million, more than a large GPU's pool at block size 16, while a replay of that
many blocks stays near 100 MB."""

HashKeys = typing.NewType("HashKeys", tuple)
"""The type of a block's extra hash keys (``BlockCached.extra_keys``, ``HashNode.extra_keys``):
tuples in memory -- ``(("lora", name, path), ("mm", hash, offset), ("cache_salt", salt))``,
hashable, as the hash function takes them -- and JSON lists in a file. Read back, every list
becomes a tuple again, so a saved log's events equal the live ones (lessons 06 and 14)."""

# Fields whose ints may be negative (everything else counts something or names an id).
_SIGNED = frozenset({"priority", "free_position", "seq"})
# Floats with a range narrower than "finite".
_FLOAT_RANGE = {"kv_cache_usage": (0.0, 1.0), "time": (0.0, math.inf)}


def parse_json(text: Any, what: str) -> Any:
    """``json.loads`` with every failure as a ``ValueError`` that says what was read."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be JSON text (str or bytes), got {type(text).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to be a kvlab file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text: {e.reason} at byte {e.start}") from None


def check_version(data: Any, supported: int, what: str) -> None:
    """``data`` is an object whose ``version`` is ``supported``."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object with a 'version', got {type(data).__name__}")
    if "version" not in data:
        raise ValueError(f"{what} has no 'version' field: it was not written by kvlab (this kvlab reads version {supported})")
    v = data["version"]
    if type(v) is not int:
        raise ValueError(f"version must be an int, got {type(v).__name__} {v!r}")
    if v != supported:
        raise ValueError(f"version {v} is not supported: this kvlab reads version {supported} files only")


def check_num_blocks(n: int, where: str, max_blocks: int) -> None:
    """Refuse a block count over ``max_blocks`` BEFORE anything is sized by it."""
    if n > max_blocks:
        raise ValueError(
            f"{where} = {n:,} is more blocks than this reader allows (max_blocks = {max_blocks:,}); "
            "a replay allocates per block, so the claim is refused before anything is allocated "
            "(pass max_blocks= to read a genuinely larger run)"
        )


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is list:
        (arg,) = typing.get_args(hint) or (Any,)
        return f"a list of {_type_name(arg)}"
    if origin is dict:
        return "an object"
    if hint is Any:
        return "a JSON value"
    if hint is type(None):
        return "null"
    if hint is bytes:
        return 'bytes ({"hex": "..."})'
    if hint is HashKeys:
        return "a list (extra hash keys)"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"a {hint.__name__} object"
    return getattr(hint, "__name__", str(hint))


def _json_value(v: Any, where: str) -> Any:
    """Any JSON value (as an ``Any`` field holds it), ``{"hex": ...}`` read back as bytes."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{where} = {v!r}: a number must be finite")
        return v
    if isinstance(v, list):
        return [_json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        if set(v) == {"hex"}:
            return _hex(v, where)
        return {k: _json_value(x, f"{where}.{k}") for k, x in v.items()}
    raise ValueError(f"{where}: not a JSON value ({type(v).__name__})")


def _as_tuples(v: Any) -> Any:
    return tuple(_as_tuples(x) for x in v) if isinstance(v, list) else v


def _hex(v: Any, where: str) -> bytes:
    if not (isinstance(v, dict) and set(v) == {"hex"} and isinstance(v["hex"], str)):
        raise ValueError(f'{where} must be bytes written as {{"hex": "..."}}, got {v!r:.80}')
    try:
        return bytes.fromhex(v["hex"])
    except ValueError:
        raise ValueError(f"{where}: {v['hex']!r:.80} is not hexadecimal") from None


def check_value(v: Any, hint: Any, where: str, name: str) -> Any:
    """``v`` (read from JSON) as a value of type ``hint``, or a ValueError naming ``where``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return check_value(v, a, where, name)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where} must be {_type_name(hint)}, got {v!r:.80}")
    if origin is list:
        if not isinstance(v, list):
            raise ValueError(f"{where} must be {_type_name(hint)}, got {type(v).__name__} {v!r:.80}")
        (arg,) = typing.get_args(hint) or (Any,)
        return [check_value(x, arg, f"{where}[{i}]", name) for i, x in enumerate(v)]
    if origin is tuple:  # written as a JSON list
        args = typing.get_args(hint)
        if not isinstance(v, list):
            raise ValueError(f"{where} must be a list of {len(args)} values, got {type(v).__name__} {v!r:.80}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_value(x, args[0], f"{where}[{i}]", name) for i, x in enumerate(v))
        if len(v) != len(args):
            raise ValueError(f"{where} must be a list of {len(args)} values, got {len(v)}: {v!r:.80}")
        return tuple(check_value(x, a, f"{where}[{i}]", name) for i, (x, a) in enumerate(zip(v, args)))
    if origin is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{where} must be an object, got {type(v).__name__} {v!r:.80}")
        _, val = typing.get_args(hint) or (str, Any)
        return {k: check_value(x, val, f"{where}.{k}", name) for k, x in v.items()}
    if hint is Any:
        return _json_value(v, where)
    if hint is HashKeys:
        if not isinstance(v, list):
            raise ValueError(f"{where} must be null or a list (the block's extra hash keys), got {type(v).__name__} {v!r:.80}")
        return _as_tuples(_json_value(v, where))
    if hint is bool:
        if type(v) is not bool:
            raise ValueError(f"{where} must be true or false, got {v!r:.80}")
        return v
    if hint is int:
        if type(v) is not int:
            raise ValueError(f"{where} must be an int, got {type(v).__name__} {v!r:.80}")
        if v < 0 and name not in _SIGNED:
            raise ValueError(f"{where} = {v} is out of range: it must be an int >= 0")
        return v
    if hint is float:
        if type(v) not in (int, float) or not math.isfinite(v):
            raise ValueError(f"{where} must be a finite number, got {v!r:.80}")
        lo, hi = _FLOAT_RANGE.get(name, (-math.inf, math.inf))
        if not lo <= v <= hi:
            raise ValueError(f"{where} = {v!r} is out of range: it must be in [{lo}, {hi}]")
        return v
    if hint is str:
        if not isinstance(v, str):
            raise ValueError(f"{where} must be a string, got {type(v).__name__} {v!r:.80}")
        return v
    if hint is bytes:
        return _hex(v, where)
    if isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields"):  # a NamedTuple
        if not isinstance(v, list) or len(v) != len(hint._fields):
            raise ValueError(f"{where} must be a list of {len(hint._fields)} values {list(hint._fields)}, got {v!r:.80}")
        hints = typing.get_type_hints(hint)
        return hint(*(check_value(x, hints[f], f"{where}.{f}", f) for f, x in zip(hint._fields, v)))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint(**check_record(hint, v, where))
    raise TypeError(f"schema: no rule for {hint!r} at {where}")  # a kvlab bug, not the file's


def check_record(cls: type, d: Any, where: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The init fields of dataclass ``cls`` read from ``d``: exactly those keys (besides
    ``skip``), each checked against its annotation. Returns them by name."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be an object, got {type(d).__name__} {d!r:.80}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    keys = set(d) - set(skip)
    unknown = sorted(keys - set(names), key=str)
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {unknown}; allowed: {names}")
    missing = [n for n in names if n not in keys]
    if missing:
        raise ValueError(f"{where} is missing field(s) {missing}")
    return {n: check_value(d[n], hints[n], f"{where}.{n}", n) for n in names}
