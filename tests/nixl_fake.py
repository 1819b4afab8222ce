"""The NIXL-shaped agent the tests move bytes with: kvlab's own loopback agent (NIXL itself
ships CUDA wheels only). See ``kvlab/kv_offload/nixl_loopback.py``: a transfer runs when it
is first polled, a READ of a missing object ends in ERR, and ``live``/``remotes`` count what
was handed out and not given back, so a test can check that nothing leaks."""

from __future__ import annotations

from kvlab.kv_offload.nixl_loopback import LoopbackNixlAgent as FakeNixlAgent

__all__ = ["FakeNixlAgent"]
