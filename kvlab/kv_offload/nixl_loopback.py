"""A NIXL agent for one process: what kvlab's P2P and object tiers move bytes with when NIXL
itself is absent (its wheels are CUDA builds; kvlab's machines have none).

It answers the agent calls those tiers make (``nixl_api``'s ``nixl_agent``) and really moves
bytes, but only inside this Python process:

* memory is DRAM descriptors ``(address, length, device)``; a *remote* agent is another
  ``LoopbackNixlAgent`` in the same process, so a WRITE into a peer's block is one
  ``ctypes.memmove`` to the address the peer announced -- what RDMA does across machines;
* an object-store descriptor adds a key, ``(address, length, device, key)``, and the objects
  live in this agent's ``bucket``; a READ of a missing object ends in ERR, as NIXL's OBJ
  plugin does;
* a transfer is asynchronous as NIXL's are: ``transfer`` only says ``"PROC"``, and the bytes
  move at the first ``check_xfer_state``, which then says ``"DONE"`` (or ``"ERR"``).

Its books are there to be looked at: every handle handed out stays in ``live`` until it is
given back (registrations, descriptor lists, transfers), every remote agent in ``remotes``
until removed, and ``probes`` counts object lookups -- so a test or a lesson can check that a
tier leaks nothing. vLLM's own tests of these tiers stand in mock agents (``MockNixlAgent`` in
``tests/v1/kv_offload/tiering/test_obj_tier.py``).

:func:`loopback_nixl` makes kvlab's NIXL users take this agent for the length of a ``with``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any


class LoopbackNixlAgent:
    """``name``: the agent's name (its metadata, as a peer receives it); ``config``: kept, unread."""

    def __init__(self, name: str, config: Any = None) -> None:
        self.name, self.config = name, config
        self.params: dict[str, Any] = {}  # backend -> its parameters
        self.bucket: dict[str, bytes] = {}  # the object store: key -> bytes
        self.live: set[int] = set()  # handles handed out and not given back
        self.remotes: set[str] = set()  # remote agents added and not removed
        self.probes = 0  # object lookups (query_memory calls)
        self._ids = itertools.count(1)

    def _handle(self, **fields: Any) -> SimpleNamespace:
        h = SimpleNamespace(id=next(self._ids), **fields)
        self.live.add(h.id)
        return h

    def _give_back(self, h: SimpleNamespace) -> None:
        self.live.remove(h.id)  # KeyError: given back twice, or never handed out

    # -- agents and memory ------------------------------------------------------------------

    def create_backend(self, backend: str, params: Any) -> None:
        self.params[backend] = params

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remotes.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name: str) -> None:
        self.remotes.remove(name)

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> list:
        return list(descs)

    def register_memory(self, descs: Any, mem_type: str | None = None) -> SimpleNamespace:
        descs = list(descs)
        return self._handle(kind=mem_type, descs=descs, trim=lambda: descs)

    def deregister_memory(self, h: SimpleNamespace) -> None:
        self._give_back(h)

    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str | None = None) -> SimpleNamespace:
        return self._handle(kind="dlist", descs=list(descs))

    def release_dlist_handle(self, h: SimpleNamespace) -> None:
        self._give_back(h)

    # -- transfers --------------------------------------------------------------------------

    def make_prepped_xfer(
        self, op: str, local: SimpleNamespace, local_idx: Any, remote: SimpleNamespace, remote_idx: Any
    ) -> SimpleNamespace:
        pairs = [(local.descs[i], remote.descs[j]) for i, j in zip(local_idx.tolist(), remote_idx.tolist(), strict=True)]
        return self._handle(kind="xfer", op=op, pairs=pairs, state="PROC")

    def transfer(self, h: SimpleNamespace) -> str:
        return "PROC"

    def check_xfer_state(self, h: SimpleNamespace) -> str:
        if h.state == "PROC":  # the first check moves the bytes
            h.state = "DONE"
            for (addr, length, *_), remote in h.pairs:
                if len(remote) == 4:  # an object: (addr, len, dev_id, key)
                    key = remote[3]
                    if h.op == "WRITE":
                        self.bucket[key] = ctypes.string_at(addr, length)
                    elif key in self.bucket:
                        ctypes.memmove(addr, self.bucket[key], length)
                    else:
                        h.state = "ERR"
                        break
                elif h.op == "WRITE":  # into another agent's DRAM block
                    ctypes.memmove(remote[0], addr, length)
                else:
                    ctypes.memmove(addr, remote[0], length)
        return h.state

    def get_xfer_telemetry(self, h: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(xferDuration=250 * len(h.pairs))  # microseconds: a fixed 250 per block

    def release_xfer_handle(self, h: SimpleNamespace) -> None:
        self._give_back(h)

    def query_memory(self, descs: Any, mem_type: str | None, agent: str) -> list:
        self.probes += 1
        return [{} if d[3] in self.bucket else None for d in descs]


def _agent_config(**kwargs: Any) -> dict[str, Any]:
    return kwargs


@contextlib.contextmanager
def loopback_nixl() -> Iterator[type[LoopbackNixlAgent]]:
    """Inside the ``with``, kvlab's P2P data path and object tier build a
    :class:`LoopbackNixlAgent` where they would build NIXL's (whether or not NIXL is
    installed); the names they had come back at the end, even after an exception. A tier
    keeps the agent it built, so build tiers inside the block and use them anywhere."""
    from kvlab.kv_offload.tiering.obj import manager as obj_manager
    from kvlab.kv_offload.tiering.p2p.data import nixl as p2p_nixl

    swaps = [
        (p2p_nixl, "_NixlAgent", LoopbackNixlAgent),
        (p2p_nixl, "_NixlAgentConfig", _agent_config),
        (obj_manager, "nixl_agent", LoopbackNixlAgent),
        (obj_manager, "nixl_agent_config", _agent_config),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, value in swaps:
            setattr(module, name, value)
        yield LoopbackNixlAgent
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
