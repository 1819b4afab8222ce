"""NIXL's agent, if NIXL is installed (vLLM 0.33 reaches it through
``vllm/distributed/nixl_utils.py``).

NIXL is the transfer library of vLLM's disaggregated serving: an *agent* registers memory
(DRAM, GPU, files, S3 objects through plugins), prepares descriptor lists, and runs
asynchronous READ/WRITE transfers that are polled to completion. Two of vLLM 0.33's offload
tiers move their bytes with it: the object store and P2P's data path. NIXL's wheels are CUDA
builds (``nixl`` pulls ``nixl-cu12``), so a CPU machine -- kvlab's CI -- has none: both
names are then None, as in vLLM, and each user decides what that means (the object-store
tier refuses to start; P2P's transport reports ``available = False``). Tests hand in a
NIXL-shaped agent instead, as vLLM's own tests do.
"""

from __future__ import annotations

from typing import Any

try:
    from nixl._api import nixl_agent as _agent  # type: ignore[import-not-found]
    from nixl._api import nixl_agent_config as _agent_config
except ImportError:
    _agent = _agent_config = None

nixl_agent: Any = _agent
nixl_agent_config: Any = _agent_config

__all__ = ["nixl_agent", "nixl_agent_config"]
