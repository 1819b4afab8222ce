"""The engine's event log: every state change as a typed event, below the core.

==============  ==========================================================================
``events``      every event kind, each defined once (how it changes the replay state, how
                it reads, how it serialises) and the ``EventLog``
``schema``      strict reading of saved files (event logs, snapshots): versions, fields,
                types and ranges, all checked before anything is built
==============  ==========================================================================

Why a package of its own: the core (block pool, managers, scheduler) writes these events
and the data layer (``kvlab.timeline``) replays them, so they sit below both. Importing
them loads nothing else of kvlab -- no replay, no wire format (contracts checked by
``lint-imports``).
"""

from kvlab.eventlog.events import Event, EventLog

__all__ = ["Event", "EventLog"]
