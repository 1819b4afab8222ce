"""The P2P tier's data path (vLLM 0.33's ``NixlTransport``) between two engines' regions in this
process, over the NIXL-shaped agent of ``nixl_fake.py`` that really writes the bytes. vLLM's
own 66 tests of the transport pass on kvlab's (``scripts/vllm_tests/run.sh``); these add the
bytes, a whole life with nothing leaked, and what happens without NIXL."""

from __future__ import annotations

from unittest.mock import patch

import numpy as np

from kvlab.kv_offload.tiering.p2p.data import NixlTransport, PollResult
from kvlab.kv_offload.tiering.p2p.data import nixl as nixl_module
from kvlab.kv_offload.nixl_loopback import loopback_nixl
from nixl_fake import FakeNixlAgent


def _engine(name, rows, **kwargs):
    with loopback_nixl():
        return NixlTransport(name, memoryview(rows), **kwargs)


def _connect(a, b, b_name):
    a.add_remote_peer(b_name, b.get_agent_metadata(), b.base_addr, b.num_blocks, b.block_len)


def test_a_write_lands_the_sender_s_blocks_in_the_receiver_s_and_nothing_leaks():
    sender_rows = np.arange(4 * 32, dtype=np.uint8).reshape(4, 32)
    receiver_rows = np.zeros((6, 32), dtype=np.uint8)
    a = _engine("10.0.0.1:5000", sender_rows, num_threads=2)
    b = _engine("10.0.0.2:5000", receiver_rows)
    agent = a._agent
    assert agent.params["UCX"] == {"engine_config": "TLS=^rc_gda", "num_threads": "2"}
    _connect(a, b, "10.0.0.2:5000")
    assert agent.remotes == {"10.0.0.2:5000"}

    tid = a.write_blocks("10.0.0.2:5000", [0, 3], [5, 1])
    assert tid == 0 and receiver_rows.sum() == 0  # nothing lands before the first poll
    assert a.poll(peer_id="10.0.0.2:5000") == PollResult(done=[0], failed=())
    assert receiver_rows[5].tolist() == list(range(0, 32)) and receiver_rows[1].tolist() == list(range(96, 128))
    assert receiver_rows[[0, 2, 3, 4]].sum() == 0
    assert a.poll() is nixl_module._EMPTY_POLL_RESULT  # reported once

    a.close()
    b.close()
    assert agent.live == set() and agent.remotes == set()  # every handle and remote agent given back
    assert not a.available


def test_three_failed_writes_in_a_row_fault_the_peer_until_it_is_registered_again():
    class Refusing(FakeNixlAgent):
        def check_xfer_state(self, h):
            return "ERR"

    rows = np.zeros((2, 8), dtype=np.uint8)
    with patch.object(nixl_module, "_NixlAgent", Refusing), patch.object(nixl_module, "_NixlAgentConfig", lambda **kw: kw):
        a = NixlTransport("a:1", memoryview(rows))
    b = _engine("b:1", np.zeros((2, 8), dtype=np.uint8))
    _connect(a, b, "b:1")
    faults = []
    for _ in range(3):
        tid = a.write_blocks("b:1", [0], [1])
        result = a.poll("b:1")
        assert result.failed == [tid]
        faults.append(result.peer_fault)
    assert faults == [None, None, "3 consecutive transfer failures (last: state ERR)"]
    assert a.poll("b:1").peer_fault == faults[-1]  # until the peer is removed
    a.remove_remote_peer("b:1")
    _connect(a, b, "b:1")
    assert a.poll("b:1") == PollResult(done=(), failed=())
    a.close()
    b.close()


def test_without_nixl_the_transport_is_built_but_not_available():
    rows = np.zeros((3, 16), dtype=np.uint8)
    with patch.object(nixl_module, "_NixlAgent", None):
        t = NixlTransport("a:1", memoryview(rows), config_fields={"model": "m", "tp": 1})
    assert not t.available and t.num_blocks == 3 and t.block_len == 16
    # sha256('{"model":"m","tp":1}')[:16]: the canonical JSON, keys sorted, no spaces
    assert t.config_fingerprint == "a63029791bc948e0"
    assert t.write_blocks("b:1", [0], [0]) is None
    t.close()
