"""kvlab.viz: pictures of the KV cache, drawn from snapshots (never from live objects).

Each view shows one idea as a plotly figure that ``update(snapshot, selected_request)``
redraws in place; each module has a pure ``figure_data(snapshot, ...)`` function returning what the view draws, so tests
check the pictures as data. :class:`Player` composes the views with Play / Step / Back
controls over a whole run; ``kvlab.show(engine_or_scenario_or_log)`` (in :mod:`kvlab.show`)
is the one-line entry point.

==================  ==========================================================
``PoolView``        every block, coloured free / cached / in use / shared / null
``BlockTableView``  each request's logical -> physical block mapping
``HashChainView``   the prefix cache as hash chains, with the last lookup's walk
``FreeQueueView``   the LRU free queue, evicted-next on the left
``TimelineView``    usage, hits, preemptions and a Gantt of requests per step
``KernelView``      the slots the attention kernel reads for one query token
``TiersView``       offload tiers (CPU, disk): LRU strips, the step's stores and loads
``EncoderCacheView`` the encoder cache: items needed, evictable, free room
==================  ==========================================================

``kvlab.viz.transfer.transfer_figure`` draws two engines' pools and the KV handed between
them (disaggregated prefill, lesson 13).

Views read the data layer (:mod:`kvlab.timeline`) and plotting libraries only -- never the
engine, the scheduler, the runner or the scenarios (a contract checked by ``lint-imports``).
plotly is imported when the first view is built, ipywidgets when the first player is;
kvlab's core never imports either.
"""

from kvlab.viz.base import View, figure_widget_class, preload
from kvlab.viz.block_table import BlockTableView
from kvlab.viz.encoder_cache import EncoderCacheView
from kvlab.viz.free_queue import FreeQueueView
from kvlab.viz.hash_chain import HashChainView
from kvlab.viz.kernel import KernelView
from kvlab.viz.offload import TiersView
from kvlab.viz.player import DEFAULT_VIEWS, VIEW_CLASSES, Player
from kvlab.viz.pool import PoolView
from kvlab.viz.style import STATE_COLORS, STATUS_COLORS
from kvlab.viz.timeline import TimelineView

__all__ = [
    "BlockTableView",
    "DEFAULT_VIEWS",
    "EncoderCacheView",
    "FreeQueueView",
    "HashChainView",
    "KernelView",
    "Player",
    "PoolView",
    "STATE_COLORS",
    "STATUS_COLORS",
    "TiersView",
    "TimelineView",
    "VIEW_CLASSES",
    "View",
    "figure_widget_class",
    "preload",
]
