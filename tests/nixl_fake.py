"""A NIXL-shaped agent for tests: NIXL itself ships CUDA wheels only.

It implements the agent calls kvlab's object-store tier and P2P data path make, and really
moves bytes: DRAM descriptors are (address, length, device) triples in this process, an
object-store descriptor adds a key into ``bucket``, and a remote agent is another
``FakeNixlAgent`` whose memory lives in this process too. A transfer runs when it is first
polled (``transfer`` only says PROC); a READ of a missing object ends in ERR, as NIXL's OBJ
plugin does. Every handle handed out is counted in ``live`` until it is given back, and
every remote agent in ``remotes`` until it is removed, so a test can check that nothing leaks.
"""

from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace


class FakeNixlAgent:
    def __init__(self, name, config):
        self.name, self.config = name, config
        self.params: dict = {}
        self.bucket: dict[str, bytes] = {}
        self.live: set[int] = set()
        self.remotes: set[str] = set()
        self.probes = 0
        self._ids = itertools.count(1)

    def _handle(self, **fields):
        h = SimpleNamespace(id=next(self._ids), **fields)
        self.live.add(h.id)
        return h

    def _give_back(self, h):
        self.live.remove(h.id)  # KeyError: given back twice, or never handed out

    def create_backend(self, backend, params):
        self.params[backend] = params

    def get_agent_metadata(self):
        return self.name.encode()

    def add_remote_agent(self, metadata):
        self.remotes.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name):
        self.remotes.remove(name)

    def get_xfer_descs(self, descs, mem_type=None):
        return list(descs)

    def register_memory(self, descs, mem_type=None):
        descs = list(descs)
        return self._handle(kind=mem_type, descs=descs, trim=lambda: descs)

    def deregister_memory(self, h):
        self._give_back(h)

    def prep_xfer_dlist(self, agent, descs, mem_type=None):
        return self._handle(kind="dlist", descs=list(descs))

    def release_dlist_handle(self, h):
        self._give_back(h)

    def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx):
        pairs = [(local.descs[i], remote.descs[j]) for i, j in zip(local_idx.tolist(), remote_idx.tolist())]
        return self._handle(kind="xfer", op=op, pairs=pairs, state="PROC")

    def transfer(self, h):
        return "PROC"

    def check_xfer_state(self, h):
        if h.state == "PROC":
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
                elif h.op == "WRITE":  # another agent's DRAM block
                    ctypes.memmove(remote[0], addr, length)
                else:
                    ctypes.memmove(addr, remote[0], length)
        return h.state

    def get_xfer_telemetry(self, h):
        return SimpleNamespace(xferDuration=250 * len(h.pairs))  # microseconds

    def release_xfer_handle(self, h):
        self._give_back(h)

    def query_memory(self, descs, mem_type, agent):
        self.probes += 1
        return [{} if d[3] in self.bucket else None for d in descs]
