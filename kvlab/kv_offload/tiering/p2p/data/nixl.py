"""The P2P data path over NIXL (vLLM 0.33: ``NixlTransport`` in
``vllm/v1/kv_offload/tiering/p2p/data/nixl.py``).

One NIXL agent per engine registers the local block region once; each peer gets a remote
agent and a prepared descriptor list over its whole region; a transfer is a prepared WRITE
from local block indices to remote ones, polled until NIXL says DONE or ERR.

Three rules carry the design:

* **A write is not over until NIXL says so.** Releasing a running WRITE's handle does not
  stop it (UCX keeps landing the bytes), so ``poll`` and ``cancel(mode="wait")`` let a
  transfer go only when it is DONE or ERR -- or when its peer's endpoint is gone
  (``nixlRemoteDisconnectError``): then nothing more can land. (``cancel(mode="immediate")``
  and ``close`` drop running transfers on purpose: their caller no longer cares.) Any other error from a state check says nothing about the write
  (vLLM measured writes landing while the handle raised ``nixlNotFoundError``), so the
  transfer is kept, and its peer faulted so that the session's teardown bounds the wait.
* **Registration runs on a worker thread**, one at a time (NIXL's calls are not made
  thread-safe here). A registration carries a generation: a removal or a newer
  registration of the same peer bumps it, and a worker that finishes under a stale
  generation releases what it built instead of publishing it, so a late registration can
  never bring back a peer that was reaped. A failed registration removes the remote agent it
  added -- unless that agent was already published (the same metadata loaded twice).
* **Everything else runs under the caller's lock** (the tiering manager's): the agent is
  created without NIXL's own locking.

Without NIXL (CUDA wheels only) the transport is built with ``available = False``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from kvlab.kv_offload.nixl_api import nixl_agent as _NixlAgent
from kvlab.kv_offload.nixl_api import nixl_agent_config as _NixlAgentConfig
from kvlab.kv_offload.tiering.p2p.data.base import CancelMode, DataTransport, PollResult

logger = logging.getLogger(__name__)

_EMPTY_POLL_RESULT = PollResult(done=(), failed=())
_MAX_CONSECUTIVE_TRANSFER_FAILURES = 3
# NIXL errors that make the peer unusable at once (matched by the binding's class name or,
# if it is renamed, by the status in the message): its endpoint is gone, or its agent unknown.
_PEER_FAULT_ERRORS = {"nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT", "nixlNotFoundError": "NIXL_ERR_NOT_FOUND"}
_RUNNING = ("PROC", "PEND")


def _peer_fault_status(exc: Exception) -> str | None:
    status = _PEER_FAULT_ERRORS.get(type(exc).__name__)
    if status is None:
        status = next((s for s in _PEER_FAULT_ERRORS.values() if s in str(exc)), None)
    return status


def _ends_the_transfer(exc: Exception) -> bool:
    """A raising state check ends the write only if the peer's endpoint is gone."""
    return _peer_fault_status(exc) == "NIXL_ERR_REMOTE_DISCONNECT"


class _Inflight(NamedTuple):
    peer_id: str  # so a poll can be scoped to one peer's session
    handle: object
    struck: bool = False  # already counted against its peer (a check that keeps raising counts once)


class NixlTransport(DataTransport):
    """``agent_name``: this engine's NIXL agent. ``backends``: NIXL backends (default UCX,
    created here with ``num_threads`` progress threads and without UCX's GPU lanes: the
    tier moves host memory only)."""

    def __init__(
        self,
        agent_name: str,
        view: memoryview,
        config_fields: dict | None = None,
        backends: list[str] | None = None,
        num_threads: int = 4,
    ) -> None:
        super().__init__(view, config_fields=config_fields)
        self._agent_name = agent_name
        self._backends = list(backends) if backends else ["UCX"]
        self._num_threads = num_threads
        self._agent: Any = None
        self._reg: Any = None
        self._local_dlist: Any = None
        self._remote_dlists: dict[str, object] = {}
        self._peer_nixl_names: dict[str, str] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._next_id = itertools.count()
        self._peer_strikes: dict[str, int] = {}  # transfer failures since the peer's last success
        self._peer_faults: dict[str, str] = {}  # why a peer is unusable, until it is removed
        self._reg_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-p2p-nixl-reg")
        self._peer_gen: dict[str, int] = {}  # bumped by every registration and removal
        self._peer_lock = threading.Lock()  # _peer_gen with the published names and lists
        if _NixlAgent is not None:
            self._start_agent()

    @property
    def available(self) -> bool:
        return self._agent is not None

    def _start_agent(self) -> None:
        ucx_only = all(b == "UCX" for b in self._backends)
        # UCX is created here, with options; other backends are left to NIXL's own config.
        self._agent = _NixlAgent(self._agent_name, _NixlAgentConfig(backends=[] if ucx_only else self._backends, capture_telemetry=True))
        if ucx_only:
            params = {"engine_config": "TLS=^rc_gda"}  # no GPU lanes: they break after a peer stalls
            if self._num_threads > 0:
                params["num_threads"] = str(self._num_threads)
            self._agent.create_backend("UCX", params)
        self._reg = self._agent.register_memory([(self._base_addr, self._num_blocks * self._block_len, 0, "")], mem_type="DRAM")
        blocks = [(self._base_addr + i * self._block_len, self._block_len, 0) for i in range(self._num_blocks)]
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._agent.get_xfer_descs(blocks, mem_type="DRAM"))

    def get_agent_metadata(self) -> bytes:
        assert self._agent is not None, "NIXL is not available"
        return self._agent.get_agent_metadata()

    # -- peers --------------------------------------------------------------------------------

    def add_remote_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> None:
        # Through the same single worker, so a synchronous registration queues behind
        # (and never overlaps) an asynchronous one.
        self.add_remote_peer_async(peer_id, agent_metadata, base_addr, num_blocks, block_len).result()

    def add_remote_peer_async(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> Future[None]:
        with self._peer_lock:
            gen = self._peer_gen[peer_id] = self._peer_gen.get(peer_id, 0) + 1

        def register() -> None:
            nixl_name, dlist = self._build_peer(peer_id, agent_metadata, base_addr, num_blocks, block_len)
            with self._peer_lock:
                current = self._peer_gen.get(peer_id) == gen
                if current:
                    self._peer_nixl_names[peer_id], self._remote_dlists[peer_id] = nixl_name, dlist
            if not current:
                logger.info("NixlTransport %s: dropping a superseded registration of peer %s", self._agent_name, peer_id)
                self._release_peer(peer_id, dlist, nixl_name)
                raise RuntimeError(f"registration for peer {peer_id} was superseded (peer removed or re-registered while registering)")

        return self._reg_executor.submit(register)

    def _build_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> tuple[str, Any]:
        """The costly part, outside the lock: the remote agent and one descriptor per block."""
        nixl_name = self._agent.add_remote_agent(agent_metadata)
        try:
            blocks = [(base_addr + i * block_len, block_len, 0) for i in range(num_blocks)]
            return nixl_name, self._agent.prep_xfer_dlist(nixl_name, self._agent.get_xfer_descs(blocks, mem_type="DRAM"))
        except Exception:
            with self._peer_lock:
                published = nixl_name in self._peer_nixl_names.values()
            if not published:  # ours to roll back (a published one belongs to its registration)
                self._release_peer(peer_id, None, nixl_name)
            raise

    def remove_remote_peer(self, peer_id: str) -> None:
        with self._peer_lock:
            self._peer_gen[peer_id] = self._peer_gen.get(peer_id, 0) + 1  # a registration still running is void
            nixl_name = self._peer_nixl_names.pop(peer_id, None)
            dlist = self._remote_dlists.pop(peer_id, None)
        self._peer_strikes.pop(peer_id, None)
        self._peer_faults.pop(peer_id, None)
        if self._agent is not None:
            self._release_peer(peer_id, dlist, nixl_name)

    def _release_peer(self, peer_id: str, dlist: object | None, nixl_name: str | None) -> None:
        """Two independent releases: one failing must not skip the other (a remote agent left
        registered would outlive its peer)."""
        if dlist is not None:
            try:
                self._agent.release_dlist_handle(dlist)
            except Exception as exc:
                logger.warning("NixlTransport %s: releasing the descriptor list of peer %s failed: %s", self._agent_name, peer_id, exc)
        if nixl_name:
            try:
                self._agent.remove_remote_agent(nixl_name)
            except Exception as exc:
                logger.warning("NixlTransport %s: removing the remote agent of peer %s failed: %s", self._agent_name, peer_id, exc)

    # -- transfers ----------------------------------------------------------------------------

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        remote = self._remote_dlists.get(peer_id)
        if remote is None:
            logger.warning(
                "NixlTransport %s: write to unregistered peer %s (known: %s)", self._agent_name, peer_id, sorted(self._remote_dlists)
            )
            return None
        local = np.asarray(local_idxs, dtype=np.int32)  # a caller's bad indices raise here, not strike the peer
        remote_arr = np.asarray(remote_idxs, dtype=np.int32)
        handle = None
        try:
            handle = self._agent.make_prepped_xfer("WRITE", self._local_dlist, local, remote, remote_arr)
            if self._agent.transfer(handle) == "ERR":  # a failed post is a status, not an exception
                raise RuntimeError("transfer() posted with status ERR")
        except Exception as exc:
            logger.warning("NixlTransport %s: write to peer %s failed to start: %s", self._agent_name, peer_id, exc)
            if handle is not None:
                self._release_handles([handle])
            status = _peer_fault_status(exc)
            if status is not None:
                self._set_peer_fault(peer_id, status)
            else:
                self._strike(peer_id, f"{type(exc).__name__}: {exc}")
            return None
        transfer_id = next(self._next_id)
        self._inflight[transfer_id] = _Inflight(peer_id, handle)
        return transfer_id

    def poll(self, peer_id: str | None = None) -> PollResult:
        done: list[int] = []
        failed: list[int] = []
        succeeded: set[str] = set()
        failures: list[tuple[str, str]] = []
        for tid, entry in list(self._inflight.items()):
            if peer_id is not None and entry.peer_id != peer_id:
                continue
            try:
                state = self._agent.check_xfer_state(entry.handle)
            except Exception as exc:
                # The bindings raise for every error status: NIXL reported a failure. Its
                # peer cannot be trusted (strikes could be reset by other successes forever).
                (logger.debug if entry.struck else logger.warning)(
                    "NixlTransport %s: check_xfer_state failed for transfer %d: %s", self._agent_name, tid, exc
                )
                if not entry.struck:
                    self._state_check_failed(entry.peer_id, exc)
                    entry = self._inflight[tid] = entry._replace(struck=True)
                if not _ends_the_transfer(exc):
                    continue  # may still be landing: kept until the peer's teardown
                state = "ERR"
            if state == "DONE":
                done.append(tid)
                succeeded.add(entry.peer_id)
            elif state not in _RUNNING:
                failed.append(tid)
                if not entry.struck:
                    failures.append((entry.peer_id, f"state {state}"))
        # Strikes after the whole batch: a DONE anywhere in it is the success "between" failures.
        for pid in succeeded:
            self._peer_strikes.pop(pid, None)
        for pid, cause in failures:
            self._strike(pid, cause)
        self._release_handles([self._inflight.pop(tid).handle for tid in done + failed])
        fault = self._peer_faults.get(peer_id) if peer_id is not None else None
        if not done and not failed and fault is None:
            return _EMPTY_POLL_RESULT
        return PollResult(done=done or (), failed=failed or (), peer_fault=fault)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        if mode == "immediate":
            self._release_handles([self._inflight.pop(t).handle for t in transfer_ids if t in self._inflight])
            return []
        running: list[int] = []
        for tid in transfer_ids:
            entry = self._inflight.get(tid)
            if entry is None:
                continue
            try:
                state = self._agent.check_xfer_state(entry.handle)
            except Exception as exc:
                logger.debug("NixlTransport %s: state check while cancelling transfer %d failed: %s", self._agent_name, tid, exc)
                self._state_check_failed(entry.peer_id, exc)
                if not _ends_the_transfer(exc):
                    running.append(tid)
                    continue
                self._release_handles([entry.handle])  # over either way; a failed release is only logged
                del self._inflight[tid]
                continue
            if state in _RUNNING:
                running.append(tid)
                continue
            try:
                self._agent.release_xfer_handle(entry.handle)
            except Exception as exc:
                logger.debug("NixlTransport %s: transfer %d not released yet: %s", self._agent_name, tid, exc)
                running.append(tid)
                continue
            del self._inflight[tid]
        return running

    def close(self) -> None:
        self._reg_executor.shutdown(wait=True)  # a registration in progress finishes first
        if self._agent is None:
            return
        self._release_handles([e.handle for e in self._inflight.values()])
        self._inflight.clear()
        for peer_id in list(self._remote_dlists):
            self.remove_remote_peer(peer_id)
        if self._local_dlist is not None:
            self._agent.release_dlist_handle(self._local_dlist)
            self._local_dlist = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        self._agent = None

    # -- failures -----------------------------------------------------------------------------

    def _strike(self, peer_id: str, cause: str) -> None:
        strikes = self._peer_strikes[peer_id] = self._peer_strikes.get(peer_id, 0) + 1
        if strikes >= _MAX_CONSECUTIVE_TRANSFER_FAILURES:
            self._set_peer_fault(peer_id, f"{strikes} consecutive transfer failures (last: {cause})")

    def _state_check_failed(self, peer_id: str, exc: Exception) -> None:
        """A raising state check faults the peer at once (by NIXL's status if it names one)."""
        self._set_peer_fault(peer_id, _peer_fault_status(exc) or f"check_xfer_state raised {type(exc).__name__}: {exc}")

    def _set_peer_fault(self, peer_id: str, cause: str) -> None:
        if peer_id not in self._peer_faults:
            self._peer_faults[peer_id] = cause
            logger.warning("NixlTransport %s: peer %s judged unusable: %s", self._agent_name, peer_id, cause)

    def _release_handles(self, handles: list[object]) -> None:
        if self._agent is None:
            return
        for handle in handles:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:
                logger.warning("NixlTransport %s: release_xfer_handle failed: %s", self._agent_name, exc)
