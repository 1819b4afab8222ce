"""The P2P tier's data path, as an interface (vLLM 0.33:
``vllm/v1/kv_offload/tiering/p2p/data/base.py``).

Once two engines have agreed over the control channel who sends what, the blocks travel
here, RDMA-style: the sender *writes* its blocks straight into the receiver's memory. Each
engine exposes one region of ``num_blocks`` blocks of ``block_len`` bytes (its CPU tier's
chunks), and a transfer names blocks by index on both sides::

    write_blocks("peer:1", local_idxs=[0, 3], remote_idxs=[5, 7])
    # local block 0 -> the peer's block 5, local block 3 -> its block 7

The life of a transfer: the peer is registered first (``add_remote_peer`` with the
metadata it sent -- its agent, base address and layout); ``write_blocks`` starts a write
and returns its id at once (None if it could not start); ``poll`` reports ids that finished
or failed since the last call; ``cancel`` gives up on some.

**Whose failure is it?** The transport decides. A transfer that failed is that transfer's
failure: the round fails and the peer recomputes. A *peer* is judged unusable after one
decisive error (its endpoint vanished, a transfer's state check raised) or after
``_MAX_CONSECUTIVE_TRANSFER_FAILURES`` failures with no success between; ``poll(peer_id)``
then reports the cause in ``peer_fault`` until the peer is removed. The transport never
repairs a peer: the session turns the fault into a disconnection, and the next connection
registers both sides again. ``write_blocks`` and ``poll`` report failures in what they
return and never raise for them.

**Compatibility.** ``config_fingerprint`` hashes the model configuration: peers whose
fingerprints differ hold KV of another layout and must never exchange blocks (the control
handshake checks it).

Nothing runs on a Python thread of the transport's own except peer registration (see
``add_remote_peer_async``): the owner drives it through ``poll``, one caller at a time.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Literal, NamedTuple

CancelMode = Literal["immediate", "wait"]


class PollResult(NamedTuple):
    """What one ``poll`` found: ``done`` and ``failed`` transfer ids (each reported once),
    and, on a poll scoped to one peer, why that peer is unusable (None while it is fine)."""

    done: Sequence[int]
    failed: Sequence[int]
    peer_fault: str | None = None


class DataTransport(ABC):
    """One engine's end of the data path, over ``view``: a 2-D memoryview, one row per block.

    ``config_fields``: the model configuration to fingerprint (None: no fingerprint, which
    matches any peer).
    """

    def __init__(self, view: memoryview, config_fields: dict | None = None) -> None:
        assert view.shape is not None
        self._view = view
        self._base_addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        self._num_blocks, self._block_len = view.shape[0], view.shape[1]
        self._config_fingerprint = self._compute_fingerprint(config_fields)

    @property
    def base_addr(self) -> int:
        return self._base_addr

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        """Bytes per block."""
        return self._block_len

    @property
    def config_fingerprint(self) -> str:
        """16 hex digits of the configuration's SHA-256, or "" without one."""
        return self._config_fingerprint

    @staticmethod
    def _compute_fingerprint(config_fields: dict | None) -> str:
        if not config_fields:
            return ""
        text = json.dumps(config_fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @abstractmethod
    def get_agent_metadata(self) -> bytes:
        """What a peer needs to reach us (sent in the control handshake, handed to the
        peer's ``add_remote_peer``)."""

    @abstractmethod
    def add_remote_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> None:
        """Register ``peer_id``'s region so ``write_blocks`` can target it."""

    def add_remote_peer_async(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> Future[None]:
        """Register without holding up the caller. A registration costs one descriptor per
        block of the peer's region -- seconds for a large tier -- so the session starts it
        here and acknowledges the peer only when the future resolves: no write can arrive
        before this side is ready. A failed future means: reject the peer.

        This default runs ``add_remote_peer`` at once (enough for a cheap registration)."""
        future: Future[None] = Future()
        try:
            self.add_remote_peer(peer_id, agent_metadata=agent_metadata, base_addr=base_addr, num_blocks=num_blocks, block_len=block_len)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    @abstractmethod
    def remove_remote_peer(self, peer_id: str) -> None:
        """Forget ``peer_id`` and free what its registration holds (cancel its transfers first)."""

    @abstractmethod
    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        """Start writing ``local_idxs`` into the peer's ``remote_idxs`` (same length); the
        transfer's id, unique for the transport's life, or None if it did not start."""

    @abstractmethod
    def poll(self, peer_id: str | None = None) -> PollResult:
        """Check running transfers and report those that ended. ``peer_id`` limits the poll
        to that peer's transfers -- one transport serves every peer's session, and a poll
        drains what it reports, so an unscoped poll would steal the others' results. None
        polls all (the shutdown drain)."""

    @abstractmethod
    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        """Give up on transfers (unknown ids are ignored).

        ``"immediate"``: release each at once and return []. ``"wait"``: release only those
        that have stopped and return the ids still running; the caller polls until each of
        them is reported (a running write still lands even if released)."""

    @abstractmethod
    def close(self) -> None:
        """Release everything (registrations, handles). Idempotent; nothing else may follow."""
