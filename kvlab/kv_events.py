"""``kvlab.kv_events`` -- the spelling the lessons use for vLLM's
``vllm/distributed/kv_events.py``: the event structs and wire format
(:mod:`kvlab.distributed.kv_events`), the ZeroMQ publisher (:mod:`kvlab.distributed.kv_publisher`),
the subscriber (:mod:`kvlab.distributed.kv_subscriber`) and recordings
(:mod:`kvlab.distributed.kv_recording`) -- the same objects, re-exported, so
``from kvlab import kv_events`` works without loading the engine."""

from kvlab.distributed.kv_events import *  # noqa: F403
from kvlab.distributed.kv_events import __all__ as _wire
from kvlab.distributed.kv_publisher import *  # noqa: F403
from kvlab.distributed.kv_publisher import __all__ as _pub
from kvlab.distributed.kv_recording import *  # noqa: F403
from kvlab.distributed.kv_recording import __all__ as _rec
from kvlab.distributed.kv_subscriber import *  # noqa: F403
from kvlab.distributed.kv_subscriber import __all__ as _sub

__all__ = [*_wire, *_pub, *_rec, *_sub]
