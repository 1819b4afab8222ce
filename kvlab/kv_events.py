"""``kvlab.kv_events`` -- the spelling DESIGN.md and the lessons use for
``kvlab.distributed.kv_events`` (vLLM's ``vllm/distributed/kv_events.py``): the same objects,
re-exported, so ``from kvlab import kv_events`` works without loading the engine."""
from kvlab.distributed.kv_events import *  # noqa: F403
from kvlab.distributed.kv_events import __all__  # noqa: F401
