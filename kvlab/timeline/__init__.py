"""kvlab's data layer: typed events, snapshots rebuilt from them, and the Timeline.

Every picture reads this package only; the core writes events into it.
"""
