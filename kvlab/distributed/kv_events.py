"""vLLM's ``vllm/distributed/kv_events.py`` (v0.33.0), at its path: the KV cache event types
and their wire format (lesson 08).

The code lives in :mod:`kvlab.utils.kv_events`, below the core: the core builds these events,
and the KV connectors beside this module (``kv_transfer``) build on the core -- so the types
cannot sit in this package without an import cycle between the two. This module re-exports
the same objects; ``kvlab.kv_events`` adds the ZeroMQ publisher and subscriber (lesson 10).
"""

from kvlab.utils.kv_events import *  # noqa: F403
from kvlab.utils.kv_events import __all__
from kvlab.utils.network_utils import get_ip  # noqa: F401  # vLLM's kv_events has it: the publishers bind tcp://*:0 with it

__all__ = list(__all__)
