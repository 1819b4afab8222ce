"""The pictures of lessons 12-14 as data: offload tiers, the encoder cache, a P/D hand-off."""

from __future__ import annotations

import torch

from kvlab import MultiModalFeature as MM
from kvlab import Request
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.engine.llm_engine import build_engine
from kvlab.timeline import Timeline
from kvlab.viz import EncoderCacheView, Player, TiersView
from kvlab.viz import encoder_cache as ev
from kvlab.viz import offload as ov
from kvlab.viz import transfer as tv

A = list(range(100, 109))
B = list(range(200, 217))
C = list(range(300, 313))


def _offload_timeline(tmp_path) -> Timeline:
    cfg = KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config=dict(num_cpu_blocks=5, storage_path=str(tmp_path), num_storage_blocks=12)
    )
    eng = build_engine(num_blocks=6, block_size=4, max_num_batched_tokens=64, kv_transfer_config=cfg)
    for rid, p in [("A", A), ("B", B), ("C", C), ("A2", A + [109]), ("C2", C + [313, 314, 315])]:
        eng.add_request(Request(rid, p, max_tokens=1))
        eng.run()
    return Timeline(eng.events)


def test_tiers_view_data_says_what_each_step_stored_and_which_tier_served(tmp_path) -> None:
    tl = _offload_timeline(tmp_path)
    d1, d4, d5 = (ov.figure_data(tl.at(s)) for s in (1, 4, 5))
    assert d1["transfers"] == ["store GPU [1, 2] → CPU (A)", "cascade 2 block(s) CPU → disk (files)"]
    assert [[c["status"] for c in r["cells"]] for r in d1["rows"]] == [["stored"] * 2, ["stored"] * 2]
    assert d4["transfers"] == ["load 2 block(s) disk → GPU [4, 3] for A2"] and d4["served"] == {"STORAGE": 2}
    # A's blocks came from disk through the CPU tier: the newest two CPU entries, touched on disk
    # (A2 finished: its head is the newest, its tail next)
    assert [c["status"] for c in d4["rows"][0]["cells"]] == ["resident"] * 3 + ["loaded"] * 2
    assert [c["to"] for c in d4["rows"][0]["cells"]][3:] == [("A2", 3), ("A2", 4)]
    assert d5["served"] == {"CPU": 1} and d5["title"] == "Offload tiers · step 5 · CPU 5/5, disk 10/12"
    assert d5["z"][0][5:] == [None] * 7 and d5["z"][1][10:] == [0, 0]  # CPU has 5 slots; disk 2 free of 12
    p = Player(tl, views=("pool", TiersView), start=4)
    assert p.views["tiers"].last_data["served"] == {"STORAGE": 2}


def test_encoder_cache_view_data() -> None:
    eng = build_engine(num_blocks=32, block_size=4, max_num_batched_tokens=12, max_num_encoder_input_tokens=8, encoder_cache_size=16)
    eng.add_request(Request("r0", list(range(100, 120)), max_tokens=2, mm_features=[MM("img-a", offset=4, length=8)]))
    eng.add_request(Request("r1", list(range(200, 216)), max_tokens=2, mm_features=[MM("img-b", offset=8, length=8)]))
    eng.step()
    d = ev.figure_data(Timeline(eng.events).at(1))
    assert [(s["mm_hash"], s["start"], s["length"], s["status"]) for s in d["segments"]] == [
        ("img-a", 0, 8, "freeable"),
        ("", 8, 8, "free"),
    ]
    assert d["decisions"] == ["encode img-a for r0"] and d["title"] == "Encoder cache · step 1 · 8/16 embeddings"
    v = EncoderCacheView(Timeline(eng.events))
    v.update(Timeline(eng.events).at(1))
    assert list(v.figure.data[0].text) == ["img-a", ""]


def test_transfer_view_pairs_the_two_engines_blocks(tmp_path) -> None:
    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)

    def engine(role):
        cfg = KVTransferConfig("ExampleConnector", kv_role=role, kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
        return build_engine(
            num_blocks=12, block_size=4, executor=ModelRunner(model, num_blocks=12, block_size=4, device="cpu"), kv_transfer_config=cfg
        )

    P, D = engine("kv_producer"), engine("kv_consumer")
    D.add_request(Request("warm", list(range(40, 50)), max_tokens=1))  # the decode pool is not empty
    D.run()
    P.add_request(Request("r", list(range(60, 71)), max_tokens=1))
    P.run()
    D.add_request(Request("r", list(range(60, 71)), max_tokens=3))
    D.run()
    tp, td = Timeline(P.events), Timeline(D.events)
    assert (tv.find_transfer(tp, "r", "store"), tv.find_transfer(td, "r", "load")) == (1, 2)
    d = tv.figure_data(tp.at(1), td.at(2), "r")
    assert d["pairs"] == [
        (1, 3),
        (2, 4),
        (3, 5),
    ]  # warm's partial block 3 was reused first and (d["saved_tokens"], d["loaded_tokens"]) == (11, 10)
    fig = tv.transfer_figure(tp, td, "r")
    assert len(fig.layout.annotations) == 4  # three arrows and the files label
