"""The KV-cache core: blocks, the pool, per-group managers, the manager (``vllm/v1/core/``).

Pure Python and the standard library only: no torch, no widgets. ``sched/`` holds the
scheduler, as ``vllm/v1/core/sched/`` does.
"""

# The managers register themselves in kv_cache_utils.MANAGER_FOR_SPEC when their module is
# imported; importing it with the package means any use of the core finds them there.
from kvlab.core import single_type_kv_cache_manager as _managers  # noqa: E402,F401
