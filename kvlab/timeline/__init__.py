"""kvlab's data layer: the replay state, snapshots and the Timeline.

==============  ==========================================================================
``state``       ``ReplayState``: what the events act on; clones and snapshots of it
``snapshot``    ``Snapshot`` and its records (blocks, requests, hash nodes): plain data
``timeline``    ``Timeline`` (any step, fast; per-step series; block histories), ``replay``
``kv_stream``   ``KVStream``: a vLLM KV-event stream (live or recorded) as snapshots of the
                engine's cached prefixes, any batch fast
==============  ==========================================================================

The core writes typed events (``kvlab.eventlog``, below the core); this package replays
them, and every picture reads it and nothing else. It imports no view and nothing of the
engine (a contract checked by ``lint-imports``). ``Event`` and ``EventLog`` are re-exported
here for the views.
"""

from kvlab.eventlog.events import Event, EventLog
from kvlab.timeline.kv_stream import KVStream, StreamSnapshot
from kvlab.timeline.snapshot import Snapshot
from kvlab.timeline.timeline import StepSeries, Timeline, replay

__all__ = ["Event", "EventLog", "KVStream", "Snapshot", "StepSeries", "StreamSnapshot", "Timeline", "replay"]
