"""Lesson 12b, section 5: the P2P story (two tiers over real ZeroMQ on loopback, the bytes
moved by kvlab's loopback NIXL agent), its picture, and the agent swap it rests on."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.kv_offload.base import LookupResult, OffloadPolicy
from kvlab.kv_offload.nixl_loopback import LoopbackNixlAgent, loopback_nixl
from kvlab.kv_offload.tiering.base import JobResult
from kvlab.kv_offload.tiering.obj import manager as obj_manager
from kvlab.kv_offload.tiering.p2p.data import nixl as nixl_module
from kvlab.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager
from kvlab.lessons import p2p


def test_the_prefiller_s_parked_blocks_land_in_the_chunks_the_decoder_named():
    story = p2p.pd_fetch_story()
    assert story.parked is True and story.policy is OffloadPolicy.REQUEST_LEVEL and story.lookup is LookupResult.HIT
    assert story.store == JobResult(job_id=1, success=True) and story.load == JobResult(job_id=1, success=True)
    assert story.prefiller_chunks == [0xA1, 0xB2, 0, 0] and story.decoder_chunks == [0, 0, 0xA1, 0xB2]
    assert story.by_direction("decoder") == ["connect", "connect_ack", "fetch"]
    assert story.by_direction("prefiller") == ["connect", "connect_ack", "transfer_done"]
    [fetch] = [m for m in story.sent if m.type == "fetch"]
    assert (fetch.fields["kv_request_id"], fetch.fields["block_indexes"], fetch.fields["round_seq"]) == ("r1", [2, 3], 0)
    assert len(fetch.fields["keys"]) == 2
    # Each side's connect carries its own layout, and each side's first message is its connect.
    for sender in ("decoder", "prefiller"):
        first = next(m for m in story.sent if m.sender == sender)
        assert first.type == "connect" and (first.fields["num_blocks"], first.fields["block_len"]) == (4, 64)
    # transfer_done comes after the fetch it answers.
    types = [m.type for m in story.sent]
    assert types.index("fetch") < types.index("transfer_done")


def test_the_sequence_figure_draws_one_arrow_per_message_and_the_write_before_transfer_done():
    story = p2p.pd_fetch_story()
    fig = p2p.p2p_sequence_figure(story)
    labels = [a.text for a in fig.layout.annotations if a.text and not a.showarrow and not a.text.startswith("<b>")]
    assert len(labels) == len(story.sent) + 1 == 7
    i = labels.index("transfer_done success=True")
    assert labels[i - 1] == "WRITE 2 blocks (the data path)"
    assert "fetch r1 -> blocks [2, 3]" in labels
    arrows = [a for a in fig.layout.annotations if a.showarrow]
    assert len(arrows) == 7 and sum(a.arrowwidth == 2.5 for a in arrows) == 1  # the write is the one wide arrow


def test_a_fetch_that_does_not_finish_in_time_raises_naming_what_was_sent(monkeypatch):
    # No time may pass: the first poll cannot finish a handshake that needs two round trips.
    monkeypatch.setattr(p2p, "_WAIT_S", -1.0)
    shut: list[str] = []
    real_shutdown = P2PSecondaryTierManager.shutdown

    def counted(self):
        shut.append(self._local_id)
        real_shutdown(self)

    monkeypatch.setattr(P2PSecondaryTierManager, "shutdown", counted)
    with pytest.raises(TimeoutError, match=r"the fetch did not finish within -1 s \(messages so far: \['connect'"):
        p2p.pd_fetch_story()
    assert len(set(shut)) == 2  # both tiers shut down on the way out: their sockets and registrations are gone


def test_a_shutdown_that_raises_does_not_keep_the_other_tier_from_shutting_down(monkeypatch):
    shut: list[str] = []
    real_shutdown = P2PSecondaryTierManager.shutdown

    def first_one_raises(self):
        shut.append(self._local_id)
        real_shutdown(self)
        if len(shut) == 1:
            raise KeyboardInterrupt  # a second Ctrl-C during the decoder's drain

    monkeypatch.setattr(P2PSecondaryTierManager, "shutdown", first_one_raises)
    with pytest.raises(KeyboardInterrupt):
        p2p.pd_fetch_story()
    assert len(set(shut)) == 2


def test_loopback_nixl_swaps_the_agents_in_and_always_puts_the_names_back():
    before = (nixl_module._NixlAgent, nixl_module._NixlAgentConfig, obj_manager.nixl_agent, obj_manager.nixl_agent_config)
    with pytest.raises(KeyError):
        with loopback_nixl() as agent_cls:
            assert agent_cls is LoopbackNixlAgent
            assert nixl_module._NixlAgent is LoopbackNixlAgent and obj_manager.nixl_agent is LoopbackNixlAgent
            assert nixl_module._NixlAgentConfig(backends=["UCX"]) == {"backends": ["UCX"]}
            raise KeyError("a learner's mistake inside the block")
    assert (nixl_module._NixlAgent, nixl_module._NixlAgentConfig, obj_manager.nixl_agent, obj_manager.nixl_agent_config) == before


def test_the_loopback_agent_moves_bytes_at_the_first_state_check_and_counts_its_handles():
    src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    a, b = LoopbackNixlAgent("a"), LoopbackNixlAgent("b")
    assert a.add_remote_agent(b.get_agent_metadata()) == "b" and a.remotes == {"b"}
    local = a.prep_xfer_dlist("", [(src.ctypes.data + 4 * i, 4, 0) for i in range(2)])
    remote = a.prep_xfer_dlist("b", [(dst.ctypes.data + 4 * i, 4, 0) for i in range(2)])
    xfer = a.make_prepped_xfer("WRITE", local, np.array([0, 1]), remote, np.array([1, 0]))
    assert a.transfer(xfer) == "PROC" and dst.tolist() == [0] * 8  # nothing moved yet
    assert a.check_xfer_state(xfer) == "DONE" and dst.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert len(a.live) == 3
    for h, give_back in ((xfer, a.release_xfer_handle), (local, a.release_dlist_handle), (remote, a.release_dlist_handle)):
        give_back(h)
    assert a.live == set()
    with pytest.raises(KeyError):
        a.release_xfer_handle(xfer)  # twice
    a.remove_remote_agent("b")
    assert a.remotes == set()
