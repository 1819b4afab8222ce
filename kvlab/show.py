"""``kvlab.show(x)``: one call from whatever a learner holds to a :class:`~kvlab.viz.Player`.

This is the one module that knows both sides: the engine and the scenarios (which produce
event logs) and the views (which read them). Everything below it stays layered -- the
views import only the data layer, the engine imports no view (contracts checked by
``lint-imports``).

=========================  ============================================================
``show(engine)``           live: the Player follows the engine's event log -- every
                           ``engine.step()`` from any cell, and its "Run step" button
``show(scenario)``         replay with the scenario's named steps, notes and ``decode``
``show("run.json")``       a saved log (``EventLog.save``), replayed
``show(log)``              an ``EventLog``, a ``Timeline`` or a list of events
``show(stream)``           a ``KVStream`` (a vLLM KV-event stream, live or recorded):
                           a :class:`~kvlab.viz.stream.StreamPlayer`
``show("run.kvev")``       a recorded KV-event stream (``Subscriber(record_to=...)``)
=========================  ============================================================

The module itself is callable: ``import kvlab; kvlab.show(engine)`` and
``from kvlab.show import show`` are the same function.

``export_html(x, "run.html")`` takes the same sources (or a Player or StreamPlayer) and
writes the whole run as one self-contained HTML replay (:mod:`kvlab.viz.export`): the
Player's controls, every view, plotly.js inlined -- no kernel, no network. A KV-event stream
is exported batch by batch.

The views draw every block of the pool, so a run whose ``PoolCreated.num_blocks`` is over
:data:`MAX_SHOW_BLOCKS` is refused before a view is built (a 5 KB log that claims a
million blocks would otherwise take minutes and gigabytes); ``kvlab.replay`` and
``Timeline`` still read it.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvlab.distributed.kv_recording import is_recording
from kvlab.engine.llm_engine import LLMEngine
from kvlab.scenarios import Scenario
from kvlab.eventlog.events import EventLog, PoolCreated
from kvlab.timeline.kv_stream import KVStream
from kvlab.timeline.timeline import Timeline
from kvlab.utils.checks import check_optional_int
from kvlab.viz.player import Player
from kvlab.viz.stream import StreamPlayer

MAX_SHOW_BLOCKS = 1 << 16
"""The largest pool (``PoolCreated.num_blocks``) the views draw: 65,536 blocks. Each view
draws every block, at every step; a pool 16 times larger took 220 s and 2 GB to show."""


def _check_pool_size(events: EventLog | Timeline | list[Any] | Any) -> None:
    """Refuse a run whose pool is too large to draw, before a Player sizes anything by it."""
    if isinstance(events, (EventLog, Timeline)):
        events = events.events
    elif not isinstance(events, list):
        return  # not a run: the Player names the type
    for i, e in enumerate(events):
        if isinstance(e, PoolCreated) and isinstance(e.num_blocks, int) and e.num_blocks > MAX_SHOW_BLOCKS:
            raise ValueError(
                f"source: events[{i}].num_blocks = {e.num_blocks:,} (PoolCreated) is more blocks than the views draw "
                f"(at most MAX_SHOW_BLOCKS = {MAX_SHOW_BLOCKS:,}); read the run without views: kvlab.replay(log) or Timeline(log)"
            )


def show(source: Any, **kwargs: Any) -> Player | StreamPlayer:
    """A :class:`Player` on an engine (live), a scenario, a saved log's path, a log, a
    timeline or a list of events; a :class:`StreamPlayer` on a ``KVStream`` or a recorded
    KV-event stream's path. ``kwargs`` go to the player (``views``, ``start``, ``probe``, ...).

    Returns the player; like any widget it is displayed when it is the last expression of
    a cell. Keep the handle to drive it from code: ``p = kvlab.show(log); p.go_to(3); p``.
    """
    if isinstance(source, LLMEngine):
        if source.events is None:
            raise ValueError("the engine has no event log; build it with build_engine(..., event_log=True) to watch it live")
        kwargs.setdefault("title", "live engine")
        _check_pool_size(source.events)
        return Player(source.events, follow=True, run_step=source.step, has_work=source.has_unfinished_requests, **kwargs)
    if isinstance(source, Scenario):
        kwargs.setdefault("decode", source.decode)
        kwargs.setdefault("title", source.name)
        kwargs.setdefault("description", source.description)
        timeline = source.timeline()
        _check_pool_size(timeline)
        return Player(timeline, named_steps=source.named_steps, notes=source.notes, **kwargs)
    if isinstance(source, KVStream):
        return StreamPlayer(source, **kwargs)
    if isinstance(source, (str, os.PathLike)):
        if not os.path.exists(source):
            raise FileNotFoundError(f"source: no saved event log at {os.fspath(source)!r}")
        if not os.path.isfile(source):  # a FIFO would block the read, /dev/zero never end it
            raise ValueError(
                f"source: {os.fspath(source)!r} is not a regular file (a folder, a FIFO or a device); "
                "show reads a saved event log (.json) or a recorded KV-event stream (.kvev)"
            )
        if is_recording(source):
            return StreamPlayer(KVStream.load(source), **kwargs)
        log = EventLog.load(os.fspath(source))
        _check_pool_size(log)
        return Player(log, **kwargs)
    if isinstance(source, Iterable) and not isinstance(source, (EventLog, Timeline, str, bytes, Mapping)):
        source = list(source)  # an iterator is read once: for the check and for the Player
    _check_pool_size(source)
    return Player(source, **kwargs)


def export_html(source: Any, path: str | os.PathLike, *, max_steps: int | None = None, **kwargs: Any) -> Path:
    """Write a self-contained HTML replay of ``source`` to ``path`` (returns the path).

    ``source``: an engine (its run so far), a scenario, a saved log's path, an
    ``EventLog``, a ``Timeline``, a list of events, a ``Player`` (exported as it stands:
    its views and selection), or a KV-event stream -- a ``KVStream``, a recording's path
    (``.kvev``) or a ``StreamPlayer`` -- exported batch by batch. ``kwargs`` go to the
    player (``views``, ``start``, ``title``, ``decode``, ...). Runs longer than
    ``max_steps`` steps (batches) are exported at every k-th one (default 3,000).
    """
    from kvlab.viz.export import MAX_STEPS, write_html

    # The arguments first: a bad path or max_steps is named before a Player is built.
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path ending in .html, got {type(path).__name__} {path!r}")
    max_steps = check_optional_int("max_steps", max_steps, 2)
    if isinstance(source, (Player, StreamPlayer)):
        if kwargs:
            raise TypeError(f"export_html: options {sorted(kwargs)} apply to a new Player, not to an existing one")
        player = source
    elif isinstance(source, LLMEngine):
        if source.events is None:
            raise ValueError("the engine has no event log; build it with build_engine(..., event_log=True) to export it")
        kwargs.setdefault("title", "engine run")
        _check_pool_size(source.events)
        player = Player(source.events, **kwargs)  # a replay of the run so far, not a live player
    else:
        player = show(source, **kwargs)
    return write_html(player, path, max_steps=MAX_STEPS if max_steps is None else max_steps)


class _CallableModule(types.ModuleType):
    """``kvlab.show`` is this module; calling it calls :func:`show`."""

    def __call__(self, source: Any, **kwargs: Any) -> Player | StreamPlayer:
        return show(source, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
