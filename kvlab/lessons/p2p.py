"""Lesson 12b, section 5: two engines' P2P tiers hand a prefilled prompt's blocks from one CPU
tier to the other, over real ZeroMQ on loopback, the bytes moved by kvlab's loopback NIXL agent.

:func:`pd_fetch_story` plays vLLM 0.33's disaggregated case with two ``P2PSecondaryTierManager``
objects, driven as the tiering manager drives any tier behind the CPU tier (``submit_store``,
``lookup``, ``submit_load``, ``get_finished_jobs``): the prefiller's store waits for a fetch,
the decoder's load fetches it. What crosses the control channel is recorded as it is sent
(a tap on each connection's ``send``, as a packet capture would see it); the rest is what
the tiers return. :func:`p2p_sequence_figure` draws the exchange.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvlab.kv_offload import config as oc
from kvlab.kv_offload.base import LookupResult, OffloadKey, OffloadPolicy, ReqContext, make_offload_key
from kvlab.kv_offload.nixl_loopback import loopback_nixl
from kvlab.kv_offload.tiering.base import JobResult, TransferJob

# A message's place in the protocol, for listing each direction's messages in one stable order:
# the order in which they are *sent* varies run to run (a peer's registration runs on NIXL's
# worker thread, and ZeroMQ delivers in the background).
PROTOCOL_ORDER = ("connect", "connect_ack", "lookup", "lookup_resp", "fetch", "transfer_done", "abort_fetch", "abort_ack", "disconnect")
_WAIT_S = 20.0  # every wait below is bounded


@dataclass(frozen=True)
class Sent:
    """One control message as it left ``sender`` (``"prefiller"`` or ``"decoder"``)."""

    sender: str
    type: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class P2PStory:
    """What :func:`pd_fetch_story` saw. ``parked``: the prefiller's store had no result before
    the decoder asked (it waits for its fetch; when False, ``store`` is the result it had at
    once); ``lookup``: the decoder's answer for the prompt's first block; ``store`` / ``load``:
    the two jobs' results; ``*_chunks``: the first byte of each CPU chunk of the two tiers at
    the end; ``sent``: the control messages in the order this run sent them."""

    parked: bool
    policy: OffloadPolicy
    lookup: LookupResult
    store: JobResult
    load: JobResult
    prefiller_chunks: list[int]
    decoder_chunks: list[int]
    sent: list[Sent]

    def by_direction(self, sender: str) -> list[str]:
        """``sender``'s message types, in protocol order."""
        return sorted((m.type for m in self.sent if m.sender == sender), key=PROTOCOL_ORDER.index)


def _spec() -> SimpleNamespace:
    """What a tier reads of vLLM's ``OffloadingSpec``: one model, one rank, chunks of one block."""
    parallel = oc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True)
    config = oc.OffloadingConfig(
        groups=(oc.OffloadingGroupConfig(16, ("layers.0",), 0),),
        worker_kv_bytes_per_block=64,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="lesson12b",
        model=oc.OffloadingModelConfig("tiny-llama", "float16"),
        cache=oc.OffloadingCacheConfig(16, 1),
        parallel=parallel,
    )
    return SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tier(rows: np.ndarray) -> Any:
    """A P2P tier over ``rows`` (one row per CPU chunk), its control socket on a free loopback port."""
    import zmq

    from kvlab.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

    for _ in range(8):  # a port found free can be taken before the bind
        try:
            with loopback_nixl():
                return P2PSecondaryTierManager(_spec(), rows.data, host="127.0.0.1", port=_free_port())
        except zmq.ZMQError:
            continue
    raise RuntimeError("no free loopback port for the P2P tier's control socket after 8 tries")


def _tap(tier: Any, sender: str, sent: list[Sent]) -> None:
    """Record every message ``tier`` sends, on each connection it opens or accepts."""
    control = tier._control
    connect, poll = control.connect, control.poll

    def wrap(conn: Any) -> Any:
        if not getattr(conn, "_lesson_tap", False):
            send = conn.send

            def tapped(msg: dict) -> None:
                sent.append(Sent(sender, msg["type"], {k: v for k, v in msg.items() if k != "type"}))
                send(msg)

            conn.send, conn._lesson_tap = tapped, True
        return conn

    control.connect = lambda peer_id: wrap(connect(peer_id))
    control.poll = lambda: [wrap(c) for c in poll()]


def _job(job_id: int, keys: list[OffloadKey], chunks: list[int], ctx: ReqContext, promotion: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks), is_promotion=promotion, req_context=ctx)


def pd_fetch_story() -> P2PStory:
    """A prefiller computed a two-block prompt and stores it to its P2P tier for request id
    ``"r1"``; a decoder, told where (``remote_prefiller``: host, port, id), loads it into two of
    its own CPU chunks. Every tier built is shut down at the end, even on an error or an
    interrupt (and if one shutdown raises, the other still runs)."""
    prefiller_rows = np.zeros((4, 64), dtype=np.uint8)
    prefiller_rows[0], prefiller_rows[1] = 0xA1, 0xB2  # the prompt's two blocks, in chunks 0 and 1
    decoder_rows = np.zeros((4, 64), dtype=np.uint8)
    keys = [make_offload_key(name.encode() * 32, 0) for name in "AB"]
    sent: list[Sent] = []
    with contextlib.ExitStack() as tiers:  # every tier built is shut down, whatever raises (a shutdown too)
        prefiller = _tier(prefiller_rows)
        tiers.callback(prefiller.shutdown)
        decoder = _tier(decoder_rows)
        tiers.callback(decoder.shutdown)
        _tap(prefiller, "prefiller", sent)
        _tap(decoder, "decoder", sent)
        producer = ReqContext("r1@prefiller", {"remote_decoder": {"kv_request_id": "r1"}})
        policy = prefiller.on_new_request(producer).policy
        prefiller.submit_store(_job(1, keys, [0, 1], producer, promotion=False))
        stores: list[JobResult] = list(prefiller.get_finished_jobs())
        parked = not stores

        host, port = prefiller._local_id.rsplit(":", 1)
        consumer = ReqContext("r1@decoder", {"remote_prefiller": {"kv_request_id": "r1", "remote_host": host, "remote_port": int(port)}})
        decoder.on_new_request(consumer)  # opens the session: the handshake starts now
        lookup = decoder.lookup(keys[0], consumer)
        decoder.submit_load(_job(1, keys, [2, 3], consumer, promotion=True))

        loads: list[JobResult] = []
        end = time.monotonic() + _WAIT_S
        while not (stores and loads):  # what the engines' polls do, step after step
            stores.extend(prefiller.get_finished_jobs())
            loads.extend(decoder.get_finished_jobs())
            if time.monotonic() > end:
                raise TimeoutError(f"the fetch did not finish within {_WAIT_S:.0f} s (messages so far: {[m.type for m in sent]})")
            time.sleep(0.002)
        prefiller.on_request_finished(producer)
        decoder.on_request_finished(consumer)
        return P2PStory(
            parked=parked,
            policy=policy,
            lookup=lookup,
            store=stores[0],
            load=loads[0],
            prefiller_chunks=[int(r[0]) for r in prefiller_rows],
            decoder_chunks=[int(r[0]) for r in decoder_rows],
            sent=list(sent),
        )


def p2p_sequence_figure(story: P2PStory) -> Any:
    """The exchange as a sequence chart: the decoder's and the prefiller's lifelines, one arrow
    per control message in the order this run sent them, and the data path's WRITE (the bytes,
    outside the control channel) just before the ``transfer_done`` that reports it."""
    import plotly.graph_objects as go

    from kvlab.viz.style import FONT, INK, MID_GREY

    x_of = {"decoder": 0.0, "prefiller": 1.0}
    rows: list[tuple[str, str, str, bool]] = []  # (from, to, label, data path)
    fetched = 0  # blocks the fetch asked for: what the write before transfer_done carries
    for m in story.sent:
        to = "prefiller" if m.sender == "decoder" else "decoder"
        detail = ""
        if m.type == "fetch":
            fetched = len(m.fields["block_indexes"])
            detail = f" r1 -> blocks {m.fields['block_indexes']}"
        elif m.type == "transfer_done":
            rows.append(("prefiller", "decoder", f"WRITE {fetched} blocks (the data path)", True))
            detail = f" success={m.fields['success']}"
        rows.append((m.sender, to, m.type + detail, False))
    fig = go.Figure()
    n = len(rows)
    for name, x in x_of.items():
        fig.add_trace(
            go.Scatter(x=[x, x], y=[0.5, -n - 0.5], mode="lines", line=dict(color=MID_GREY, width=1), showlegend=False, hoverinfo="skip")
        )
        fig.add_annotation(x=x, y=1.0, text=f"<b>{name}</b>", showarrow=False, font=dict(size=13, color=INK))
    for i, (src, dst, label, data) in enumerate(rows):
        y = -i - 0.3
        fig.add_annotation(
            x=x_of[dst],
            y=y,
            ax=x_of[src],
            ay=y,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=2,
            arrowwidth=2.5 if data else 1.2,
            arrowcolor=INK if not data else MID_GREY,
            text="",
        )
        fig.add_annotation(x=0.5, y=y + 0.28, text=label, showarrow=False, font=dict(size=11, color=INK))
    fig.update_layout(
        title="A P2P fetch, in the order this run sent it",
        font=dict(family=FONT),
        height=90 + 48 * (n + 1),
        width=620,
        xaxis=dict(visible=False, range=[-0.25, 1.25]),
        yaxis=dict(visible=False, range=[-n - 0.6, 1.4]),
        margin=dict(l=10, r=10, t=50, b=10),
        plot_bgcolor="white",
    )
    return fig
