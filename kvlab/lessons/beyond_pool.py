"""Helpers for lessons 12-14 (offload tiers, connectors, the encoder cache): the scripted
stories and the plotting recipes, so the notebooks keep to one idea per cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.core.transaction import unguarded
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.request import Request
from kvlab.eventlog.events import EventLog, KVLoadFailed, KVTransfer, OffloadEvicted
from kvlab.utils.notebook_display import OUTPUT_WIDTH
from kvlab.utils.math_utils import round_up

if TYPE_CHECKING:
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from kvlab.executor.simulated import SimulatedExecutor
    from kvlab.worker.model_runner import ModelRunner

# The offload story of lesson 12 (and tests/test_kv_offload.py): three prompts push each other
# out of a 5-block pool and a 5-block CPU tier; then three requests come back for them.
A = list(range(100, 109))
B = list(range(200, 217))
C = list(range(300, 313))
OFFLOAD_STORY: list[tuple[str, list[int]]] = [("A", A), ("B", B), ("C", C), ("A2", A + [109]), ("C2", C + [313, 314, 315]), ("B2", B[:13])]


def offload_config(storage_path: str, *, num_cpu_blocks: int = 5, num_storage_blocks: int = 12, **extra: Any) -> KVTransferConfig:
    """The story's tiers: a CPU tier of ``num_cpu_blocks`` and a disk tier of ``num_storage_blocks``
    under ``storage_path``, as kvlab's offloading connector reads them."""
    return KVTransferConfig(
        "OffloadingConnector",
        kv_connector_extra_config=dict(
            num_cpu_blocks=num_cpu_blocks, storage_path=storage_path, num_storage_blocks=num_storage_blocks, **extra
        ),
    )


def offload_engine(
    storage_path: str,
    *,
    executor: Any = None,
    num_blocks: int = 6,
    block_size: int = 4,
    num_cpu_blocks: int = 5,
    num_storage_blocks: int = 12,
    **extra: Any,
) -> LLMEngine:
    """An engine with a CPU tier and a disk tier behind its pool (the story's sizes)."""
    cfg = offload_config(storage_path, num_cpu_blocks=num_cpu_blocks, num_storage_blocks=num_storage_blocks, **extra)
    return build_engine(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=64, executor=executor, kv_transfer_config=cfg)


def tier_block_stored(prompt: Sequence[int], *, self_describing: bool, block_size: int = 4) -> list[Any]:
    """Lesson 12b, section 1: the ``BlockStored`` events an engine publishes while ``prompt``
    is prefilled and its full blocks are copied to a CPU tier -- the GPU pool's event, then
    the CPU tier's, as vLLM 0.33 publishes them: placeholders, or with
    ``self_describing_kv_events`` each chunk's hashes, parent and tokens."""
    from kvlab.distributed.kv_events import BlockStored

    events: list[Any] = []

    class Collect:
        def publish(self, batch: Any) -> None:
            events.extend(e for e in batch.events if isinstance(e, BlockStored))

    cfg = KVTransferConfig(
        "OffloadingConnector", kv_connector_extra_config={"num_cpu_blocks": 4, "self_describing_kv_events": self_describing}
    )
    eng = build_engine(
        num_blocks=8,
        block_size=block_size,
        kv_transfer_config=cfg,
        kv_event_publisher=Collect(),
        manager_kwargs={"enable_kv_cache_events": True},
    )
    eng.add_request(Request("chat", list(prompt), max_tokens=1))
    eng.run()
    return events


def vllm_offload_configs(cfg: KVTransferConfig, block_bytes: int, page_bytes: int | None = None) -> dict[str, dict[str, Any]]:
    """kvlab's tier config beside the two vLLM 0.33 ``--kv-transfer-config`` records that set up
    the same CPU tier (lesson 12b, section 1). vLLM sizes a CPU tier in bytes, not blocks:

    * ``OffloadingConnector`` (``vllm/v1/kv_offload/cpu/spec.py``, ``CPUOffloadingSpec``) rounds
      every offloaded block up to a memory page (``mmap.PAGESIZE``) and keeps
      ``cpu_bytes_to_use // padded block`` slots; a file tier behind it is a ``secondary_tiers``
      entry of ``TieringOffloadingSpec`` (``{"type": "fs", "root_dir": ...}``), with no capacity
      of its own.
    * ``SimpleCPUOffloadConnector`` (``vllm/v1/simple_kv_offload/manager.py``,
      ``SimpleCPUOffloadScheduler._derive_cpu_config``) keeps ``cpu_bytes_to_use // block`` blocks
      (or ``num_cpu_blocks``, bounded by those bytes) and has one tier only
      (``kv_offload_backend``: ``"cpu"`` or ``"disk"``).
    """
    import mmap

    extra = cfg.kv_connector_extra_config
    n_cpu, path = int(extra["num_cpu_blocks"]), extra.get("storage_path")
    page = int(page_bytes or mmap.PAGESIZE)
    padded = round_up(int(block_bytes), page)
    tiering: dict[str, Any] = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": n_cpu * padded}
    if path is not None:
        tiering["secondary_tiers"] = [{"type": "fs", "root_dir": path}]
    return {
        "kvlab (lesson 12a's tiers)": {"kv_connector": cfg.kv_connector, "kv_role": cfg.kv_role, "kv_connector_extra_config": dict(extra)},
        "vLLM 0.33, offloading connector": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": tiering,
        },
        "vLLM 0.33, simple CPU connector": {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": n_cpu * int(block_bytes), "num_cpu_blocks": n_cpu},
        },
    }


def run_one_by_one(engine: LLMEngine, story: Sequence[tuple[str, list[int]]], max_tokens: int = 1) -> None:
    """Each request alone, to the end: the order of the story is the order of events."""
    run_with_metrics(engine, story, max_tokens)


def run_with_metrics(engine: LLMEngine, story: Sequence[tuple[str, list[int]]], max_tokens: int = 1) -> Any:
    """:func:`run_one_by_one`, returning the KV connector's metrics over the whole story: the
    payload the scheduler takes each step (``scheduler.kv_connector_stats``), merged as vLLM's
    metrics logger merges them over an interval -- or None without a connector."""
    total = None
    for rid, prompt in story:
        engine.add_request(Request(rid, list(prompt), max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            engine.run(max_steps=1)  # one step, with run()'s check that it made progress
            step = engine.scheduler.kv_connector_stats
            if step is not None:
                total = step if total is None else total.aggregate(step)
    return total


def offload_metric_lines(stats: Any) -> list[str]:
    """The byte, size and count metrics of an offloading connector's payload, one line each
    (vLLM 0.33's names). Left out: durations, lookup delays and latencies (they depend on the
    machine), usage shares, and the tiering manager's in-flight job gauges (kvlab's jobs finish
    within their step, so those read 0 at every report)."""
    lines = []
    for name, value in sorted(stats.reduce().items()):
        if name.startswith("vllm:kv_offload_") and not any(w in name for w in ("time", "delay", "perc", "latency", "_active_")):
            # a tier-labelled series reduces to "name:('1:fs',)"; print it as Prometheus does
            metric, _, label = name.partition(":('")
            tier = label.removesuffix("',)")
            shown = f'{metric}{{tier="{tier}"}}' if label else name
            lines.append(f"{shown:62} {value:>7,}")
    return lines


def transfer_lines(log: EventLog, request_ids: Sequence[str] | None = None, from_step: int = 0) -> list[str]:
    """Every KV transfer and tier eviction of a run (from ``from_step`` on), one line each."""
    lines = []
    for e in log:
        if e.step >= from_step and isinstance(e, (KVTransfer, OffloadEvicted, KVLoadFailed)):
            rid = getattr(e, "request_id", None)
            if request_ids is None or rid is None or rid in request_ids:
                lines.append(f"step {e.step}: {e.describe()}")
    return lines


def offload_bench_figure(runs: Sequence[Any]) -> Any:
    """Bars: where each run's prompt tokens came from (GPU pool / CPU / disk); markers: mean TTFT."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from kvlab.viz.style import FONT, HIT, INK

    names = [r.name.strip() for r in runs]
    fig = make_subplots(
        rows=1, cols=2, column_widths=[0.6, 0.4], subplot_titles=("prompt tokens served from a cache", "mean TTFT (simulated)")
    )
    # Every segment is a prefix hit (kvlab's hit colour); the pattern says where it came from.
    for label, values, shape in (
        ("GPU pool", [r.gpu_share for r in runs], ""),
        ("CPU tier", [r.share("CPU") for r in runs], "/"),
        ("disk tier", [r.share("STORAGE") for r in runs], "x"),
    ):
        fig.add_trace(
            go.Bar(
                y=names,
                x=values,
                name=label,
                orientation="h",
                marker=dict(color=HIT, line=dict(color=INK, width=1), pattern=dict(shape=shape, fgcolor=INK)),
                hovertemplate="%{x:.1%}<extra>" + label + "</extra>",
            ),
            row=1,
            col=1,
        )
    fig.add_trace(
        go.Bar(
            y=names,
            x=[r.mean_ttft * 1e3 for r in runs],
            orientation="h",
            marker=dict(color="white", line=dict(color=INK, width=1)),
            showlegend=False,
            text=[f"{r.mean_ttft * 1e3:.0f} ms" for r in runs],
            textposition="inside",
            hovertemplate="%{x:.1f} ms<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.update_layout(
        barmode="stack",
        width=OUTPUT_WIDTH,
        height=300,
        font=dict(family=FONT, size=11),
        margin=dict(l=10, r=10, t=40, b=30),
        legend=dict(orientation="h", y=-0.15, traceorder="normal"),
        plot_bgcolor="white",
    )
    fig.update_xaxes(tickformat=".0%", range=[0, 1], row=1, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_yaxes(showticklabels=False, row=1, col=2)
    return fig


def backpressure_figure(samples: Sequence[tuple[str, float, bool | None]], high_water_s: float, low_water_s: float) -> Any:
    """Lesson 12b's back-pressure run as a picture: the detector's average write time per MiB
    after each store (filled: the block was written to disk; hollow: the write was dropped,
    the block stayed in the CPU tier only; a grey diamond: a quiet spell with no store),
    against the two marks, on a log scale. ``samples``: (label, average s/MiB, written or
    None); an average of 0 (no write finished yet) has no place on a log scale and is left out."""
    import math

    import plotly.graph_objects as go

    from kvlab.viz.style import FONT, INK, MID_GREY

    shown = [(label, avg, written) for label, avg, written in samples if avg > 0]
    labels = [label for label, _, _ in shown]
    fig = go.Figure()
    for y, name, dash in (
        (high_water_s, "high mark: pressure on above it", "dash"),
        (low_water_s, "low mark: pressure off below it", "dot"),
    ):
        fig.add_trace(
            go.Scatter(x=labels, y=[y] * len(labels), mode="lines", name=name, line=dict(color=INK, width=1, dash=dash), hoverinfo="skip")
        )
    fig.add_trace(
        go.Scatter(
            x=labels, y=[avg for _, avg, _ in shown], mode="lines", line=dict(color=MID_GREY, width=1), showlegend=False, hoverinfo="skip"
        )
    )
    for name, keep, symbol, fill in (
        ("written to disk", True, "circle", INK),
        ("write dropped (CPU tier only)", False, "circle-open", INK),
        ("no store (time passes)", None, "diamond", MID_GREY),
    ):
        points = [(label, avg) for label, avg, written in shown if written is keep]
        if points:
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in points],
                    y=[y for _, y in points],
                    mode="markers",
                    name=name,
                    marker=dict(symbol=symbol, size=10, color=fill, line=dict(color=INK, width=1.5)),
                    hovertemplate="%{x}: %{y:.4f} s/MiB<extra>" + name + "</extra>",
                )
            )
    lows = [avg for _, avg, _ in shown] + [low_water_s]
    highs = [avg for _, avg, _ in shown] + [high_water_s]
    fig.update_layout(
        width=OUTPUT_WIDTH,
        height=340,
        font=dict(family=FONT, size=11),
        margin=dict(l=10, r=10, t=40, b=30),
        title=dict(text="the disk's average write time per MiB, after each store", x=0.01, font=dict(size=12)),
        legend=dict(orientation="h", y=-0.25),
        plot_bgcolor="white",
    )
    fig.update_xaxes(title_text="block stored", type="category", showgrid=False)
    fig.update_yaxes(
        title_text="s per MiB", type="log", gridcolor="#eeeeee", range=[math.log10(min(lows)) - 0.2, math.log10(max(highs)) + 0.2]
    )
    return fig


def encoder_story(scheduler_cls: type | None = None, *, executor: Any = None, **scheduler_kwargs: Any) -> LLMEngine:
    """Lesson 14's four requests with images (12 tokens per step, an encoder budget of 8
    embeddings, an encoder cache of 16); not yet run. ``scheduler_cls``: a Scheduler
    subclass to run them (the ``encoder_inputs`` checker's seam); ``executor``: another
    executor than the simulated one."""
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.executor.simulated import SimulatedExecutor
    from kvlab.request import MultiModalFeature as MM

    kw: dict[str, Any] = dict(max_num_batched_tokens=12, max_num_encoder_input_tokens=8, encoder_cache_size=16)
    kw.update(scheduler_kwargs)
    mgr = KVCacheManager(num_blocks=32, block_size=4, event_log=EventLog(), max_in_flight_tokens=kw["max_num_batched_tokens"])
    eng = LLMEngine(mgr, (scheduler_cls or Scheduler)(mgr, **kw), executor if executor is not None else SimulatedExecutor())
    eng.add_request(Request("r0", list(range(100, 120)), max_tokens=2, mm_features=[MM("img-a", offset=4, length=8)]))
    eng.add_request(Request("r1", list(range(200, 214)), max_tokens=2, mm_features=[MM("img-a", offset=2, length=8)]))
    eng.add_request(Request("r2", list(range(300, 316)), max_tokens=2, mm_features=[MM("img-b", offset=2, length=8)]))
    eng.add_request(Request("r3", list(range(400, 420)), max_tokens=2, mm_features=[MM("img-c", offset=6, length=8)]))
    return eng


def hook_recorder() -> tuple[Any, Any, list[str]]:
    """Both halves of a connector that writes down every hook call (lesson 13): it offers
    the first 16 tokens of any longer prompt as external (and loads nothing -- a demo)."""
    from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

    calls: list[str] = []

    class HookRecorder(KVConnectorBase_V1):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
            n = 16 - num_computed_tokens if request.num_tokens > 16 else 0
            calls.append(f"scheduler: get_num_new_matched_tokens({request.request_id}, local hit {num_computed_tokens}) -> {n}")
            return n, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
            calls.append(
                f"scheduler: update_state_after_alloc({request.request_id}, blocks {blocks.get_block_ids()[0]}, "
                f"external {num_external_tokens})"
            )

        def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
            calls.append(f"scheduler: build_connector_meta(step {scheduler_output.step})")
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
            calls.append(f"scheduler: request_finished({request.request_id}, blocks {block_ids})")
            return False, None

        def start_load_kv(self, **kwargs):  # noqa: ANN003, ANN201
            calls.append("worker:    start_load_kv()")

        def wait_for_layer_load(self, layer_name):  # noqa: ANN001, ANN201
            calls.append(f"worker:      wait_for_layer_load({layer_name})")

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):  # noqa: ANN001, ANN003, ANN201
            calls.append(f"worker:      save_kv_layer({layer_name}, kv {tuple(kv_layer.shape)})")

        def wait_for_save(self, skip_req_ids=frozenset()):  # noqa: ANN001, ANN201
            calls.append("worker:    wait_for_save()")

    return HookRecorder(KVConnectorRole.SCHEDULER), HookRecorder(KVConnectorRole.WORKER), calls


def tiers_holding(engine: LLMEngine, request_id: str) -> str:
    """Where a finished request's full blocks sit now (lesson 12's first prediction):
    'in the CPU tier and on disk', 'only on disk', 'only in the CPU tier' or 'in neither tier'
    -- the answer for *all* its blocks, or 'split' when they differ."""
    from kvlab.kv_offload.base import make_offload_key

    tiers = cast("OffloadingConnector", engine.scheduler.connector).manager  # lesson 12's engines offload
    places = set()
    for h in engine.finished[request_id].block_hashes:
        key = make_offload_key(h)
        cpu, disk = key in tiers.primary, tiers.secondary is not None and key in tiers.secondary
        places.add(
            {
                (True, True): "in the CPU tier and on disk",
                (False, True): "only on disk",
                (True, False): "only in the CPU tier",
                (False, False): "in neither tier",
            }[(cpu, disk)]
        )
    return places.pop() if len(places) == 1 else "split"


def first_load(log: EventLog, request_id: str | None = None) -> KVTransfer:
    """The first load of a run (of ``request_id``, if given)."""
    return next(
        e for e in log if isinstance(e, KVTransfer) and e.direction == "load" and (request_id is None or e.request_id == request_id)
    )


def tier_files(root: str) -> list[str]:
    """Every block file the disk tier wrote under ``root``, sorted."""
    import os

    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".bin"))


def flip_last_byte(path: str) -> None:
    """Corrupt a tier file the way a bad disk would: one bit pattern of its last byte flipped."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def printable(story: Sequence[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """The story with token ids the tiny model's byte vocabulary can print (32..121)."""
    return [(rid, [t % 90 + 32 for t in p]) for rid, p in story]


# --- lesson 13 -------------------------------------------------------------------------------------
def pd_engine(model: Any, role: str, path: str, num_blocks: int = 16, block_size: int = 16, load_async_steps: int = 0) -> LLMEngine:
    """A prefill (``kv_producer``) or decode (``kv_consumer``) engine on the real tiny model,
    handing KV over through files under ``path`` (vLLM's ExampleConnector); with
    ``load_async_steps`` the decode engine's loads take that many steps, asynchronously."""
    from kvlab.worker.model_runner import ModelRunner

    extra: dict[str, Any] = {"shared_storage_path": path}
    if load_async_steps:
        extra["load_async_steps"] = load_async_steps
    cfg = KVTransferConfig("ExampleConnector", kv_role=role, kv_connector_extra_config=extra)
    return build_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        kv_transfer_config=cfg,
        executor=ModelRunner(model),  # sized by the engine, from its manager
    )


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """KV bytes one token takes in a real engine's cache: K and V of every layer
    (caches ``[num_blocks, 2, block_size, kv_heads, head_dim]``)."""
    runner = cast("ModelRunner", engine.executor)  # a real engine: its executor runs the model
    return sum(kv[0, :, 0].numel() * kv.element_size() for kv in runner.kv_caches)


def handoff_line(prefill: LLMEngine, decode: LLMEngine, request_id: str) -> str:
    """One request's hand-off: what the prefill engine saved, what the decode engine loaded
    (tokens and KV bytes), from which blocks into which, and both engines' first token."""
    assert prefill.events is not None and decode.events is not None  # both engines log events (build_engine's default)
    saved = next(e for e in prefill.events if isinstance(e, KVTransfer) and e.request_id == request_id)
    loaded = next(e for e in decode.events if isinstance(e, KVTransfer) and e.request_id == request_id)
    n, per_token = prefill.finished[request_id].num_prompt_tokens, kv_bytes_per_token(decode)
    return (
        f"{request_id} ({n} tokens): prefill saved {saved.num_tokens} tokens ({saved.num_tokens * per_token:,} B) "
        f"from blocks {saved.block_ids}, decode loaded {loaded.num_tokens} ({loaded.num_tokens * per_token:,} B) "
        f"into blocks {loaded.block_ids}; first token "
        f"{prefill.finished[request_id].output_token_ids} vs {decode.finished[request_id].output_token_ids[:1]}"
    )


# vLLM 0.33's connector registry: the register_connector(name, module, class) calls at the bottom of
# vllm/distributed/kv_transfer/kv_connector/factory.py (lesson 13, section 6).
_V1 = "vllm.distributed.kv_transfer.kv_connector.v1."
VLLM_KV_CONNECTORS: dict[str, tuple[str, str]] = {
    "ExampleConnector": (_V1 + "example_connector", "ExampleConnector"),
    "ExampleHiddenStatesConnector": (_V1 + "example_hidden_states_connector", "ExampleHiddenStatesConnector"),
    "LMCacheConnectorV1": (_V1 + "lmcache_connector", "LMCacheConnectorV1"),
    "LMCacheMPConnector": (_V1 + "lmcache_mp_connector", "LMCacheMPConnector"),
    "NixlConnector": (_V1 + "nixl", "NixlConnector"),
    "NixlPullConnector": (_V1 + "nixl", "NixlPullConnector"),
    "NixlPushConnector": (_V1 + "nixl", "NixlPushConnector"),
    "MultiConnector": (_V1 + "multi_connector", "MultiConnector"),
    "HiSparseConnector": (_V1 + "hisparse.connector", "HiSparseConnector"),
    "MoRIIOConnector": (_V1 + "moriio.moriio_connector", "MoRIIOConnector"),
    "OffloadingConnector": (_V1 + "offloading_connector", "OffloadingConnector"),
    "DecodeBenchConnector": (_V1 + "decode_bench_connector", "DecodeBenchConnector"),
    "MooncakeConnector": (_V1 + "mooncake.mooncake_connector", "MooncakeConnector"),
    "MooncakeStoreConnector": (_V1 + "mooncake.store.connector", "MooncakeStoreConnector"),
    "FlexKVConnectorV1": (_V1 + "flexkv_connector", "FlexKVConnectorV1"),
    "SimpleCPUOffloadConnector": (_V1 + "simple_cpu_offload_connector", "SimpleCPUOffloadConnector"),
    "HF3FSKVConnector": (_V1 + "hf3fs.hf3fs_connector", "HF3FSKVConnector"),
}


class ConnectorRegistry:
    """How vLLM 0.33's ``KVConnectorFactory`` finds a connector class, in miniature: names map
    to (module, class) and a module is imported only when an engine asks for its name
    (``register_connector``, ``get_connector_class``). A ``kv_connector_module_path`` in the
    config wins over the registry: a connector outside vLLM's tree needs no registration."""

    def __init__(self, entries: dict[str, tuple[str, str]] | None = None) -> None:
        self._registry: dict[str, tuple[str, str]] = dict(entries or {})

    @property
    def names(self) -> list[str]:
        return list(self._registry)

    def register_connector(self, name: str, module_path: str, class_name: str) -> None:
        if name in self._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        self._registry[name] = (module_path, class_name)

    def get_connector_class(self, kv_connector: str, kv_connector_module_path: str | None = None) -> type:
        import importlib

        if kv_connector_module_path is not None and not kv_connector_module_path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if kv_connector_module_path:
            return getattr(importlib.import_module(kv_connector_module_path), kv_connector)
        if kv_connector not in self._registry:
            raise ValueError(f"Unsupported connector type: {kv_connector}")
        module, cls = self._registry[kv_connector]
        return getattr(importlib.import_module(module), cls)


def pid_alive(pid: int) -> bool:
    """Whether a process still exists (signal 0 checks without touching it)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- lesson 14 -------------------------------------------------------------------------------------
VQA_ORDER = [0, 0, 1, 0, 2, 1, 0, 3, 1, 2, 0, 4, 1, 0, 2, 5, 0, 1, 3, 0, 2, 1, 4, 5]


def vqa(cache_images: int, image_tokens: int = 64) -> tuple[int, float]:
    """Lesson 14's 24 questions about 6 images (one every 50 ms) with an encoder cache that
    holds ``cache_images`` images: (embeddings the encoder computed, mean TTFT in s)."""
    import random

    from kvlab.request import MultiModalFeature as MM

    rng = random.Random(0)
    e = build_engine(
        num_blocks=256, block_size=16, max_num_batched_tokens=256, encoder_cache_size=image_tokens * cache_images, event_log=None
    )
    reqs = []
    for k, img in enumerate(VQA_ORDER):
        prompt = [rng.randrange(1000) for _ in range(8)] + [9] * image_tokens + [rng.randrange(1000) for _ in range(24)]
        reqs.append(
            Request(f"q{k}", prompt, max_tokens=16, arrival_time=0.05 * k, mm_features=[MM(f"img-{img}", offset=8, length=image_tokens)])
        )
    with unguarded(e):  # a private engine: if the run stops, it is dropped
        e.run_trace(reqs)
    # build_engine's default executor is a SimulatedExecutor; every request finished, so each has a TTFT
    executor = cast("SimulatedExecutor", e.executor)
    return executor.num_encoder_tokens_computed, sum(cast(float, e.metrics[r.request_id].ttft) for r in reqs) / len(reqs)


def encoder_runs_figure(results: dict[int, tuple[int, float]], image_tokens: int = 64) -> Any:
    """Bars: embeddings the encoder computed for each cache size (a neutral quantity: outlined)."""
    import plotly.graph_objects as go

    from kvlab.viz.style import FONT, INK

    return go.Figure(
        go.Bar(
            x=[f"room for {n}" for n in results],
            y=[enc for enc, _ in results.values()],
            marker=dict(color="white", line=dict(color=INK, width=1)),
            text=[f"{enc // image_tokens} runs" for enc, _ in results.values()],
            textposition="outside",
        ),
        layout=dict(
            width=420,
            height=300,
            title=f"embeddings the encoder computed<br>({len(VQA_ORDER)} requests, {len(set(VQA_ORDER))} images)",
            font=dict(family=FONT),
            margin=dict(l=40, r=10, t=60, b=30),
            yaxis=dict(title="embeddings"),
            plot_bgcolor="white",
        ),
    )


def offload_table(runs: Sequence[Any]) -> str:
    """Lesson 12's bench table: hit rate, where the hits came from, mean and p90 TTFT per run."""
    lines = [f"{'run':30} {'hit rate':>8} {'GPU':>6} {'CPU':>6} {'disk':>6} {'TTFT mean':>9} {'p90':>8}"]
    for r in runs:
        lines.append(
            f"{r.name:30} {r.hit_rate:>8.1%} {r.gpu_share:>6.1%} {r.share('CPU'):>6.1%} {r.share('STORAGE'):>6.1%} "
            f"{r.mean_ttft * 1e3:>7.1f}ms {r.ttft_pct(90) * 1e3:>6.1f}ms"
        )
    return "\n".join(lines)


def ec_consumer_engine(remote: Sequence[str], num_blocks: int = 32, block_size: int = 4, **scheduler_kwargs: Any) -> LLMEngine:
    """An engine with an encoder-cache connector in the consumer role (lesson 14, section 4;
    vLLM 0.33's ``vllm/distributed/ec_transfer/``, ``ec_role="ec_consumer"``): another instance
    has encoded the items whose hash is in ``remote``, and the connector has them.

    The scheduler's rule is vLLM's (``Scheduler._try_schedule_encoder_inputs``): an item not in
    the local encoder cache must pass ``can_allocate`` (room in the cache, and no more embeddings
    than the budget left); if the connector then has it (``has_cache_item``), it is an external
    load -- room reserved, no encoder budget spent -- and the worker loads it instead of running
    the encoder (``executor.num_encoder_tokens_loaded``)."""
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.executor.simulated import SimulatedExecutor

    store = set(remote)

    class ECConsumerScheduler(Scheduler):
        def _try_schedule_encoder_inputs(self, request, num_computed_tokens, num_new_tokens, encoder_budget, shift_computed_tokens=0):  # noqa: ANN001, ANN202  # no drafter here: no shift
            ecm = self.encoder_cache_manager
            to_schedule: list[int] = []
            duplicates: list[int] = []
            scheduled: set[str] = set()
            num_embeds_to_schedule = 0
            end = num_computed_tokens + num_new_tokens
            for i, f in enumerate(request.mm_features):
                if f.offset >= end:
                    break
                if f.offset + f.length <= num_computed_tokens:
                    continue
                if f.identifier in scheduled:
                    duplicates.append(i)
                    continue
                if ecm.check_and_update_cache(request, i):
                    continue
                if not ecm.can_allocate(request, i, encoder_budget, num_embeds_to_schedule):
                    num_new_tokens = min(num_new_tokens, f.offset - num_computed_tokens) if num_computed_tokens < f.offset else 0
                    break
                num_embeds_to_schedule += f.length
                scheduled.add(f.identifier)
                to_schedule.append(i)
                if f.identifier not in store:  # has_cache_item() is False: the encoder runs here
                    encoder_budget -= f.length
            return to_schedule, duplicates, num_new_tokens, encoder_budget

    class ECConsumerExecutor(SimulatedExecutor):
        num_encoder_tokens_loaded = 0

        def _run_encoder(self, so):  # noqa: ANN001, ANN202
            for rid, input_ids in so.scheduled_encoder_inputs.items():
                for i in input_ids:
                    f = self._mm[rid][i]
                    self.encoder_cache[f.identifier] = f.length
                    if f.identifier in store:
                        self.num_encoder_tokens_loaded += f.length  # the worker's EC connector loads it
                    else:
                        self.num_encoder_tokens_computed += f.length

    scheduler_kwargs.setdefault("max_num_batched_tokens", 32)
    mgr = KVCacheManager(
        num_blocks=num_blocks, block_size=block_size, event_log=EventLog(), max_in_flight_tokens=scheduler_kwargs["max_num_batched_tokens"]
    )
    return LLMEngine(mgr, ECConsumerScheduler(mgr, **scheduler_kwargs), ECConsumerExecutor())


def whisper_steps(num_blocks: int = 40, audio_tokens: int = 20, encoder_budget: int = 24) -> list[str]:
    """Lesson 14, section 4: two requests of a Whisper-like encoder-decoder model (full
    attention for the decoder, cross-attention for the encoder's output; blocks of 4 tokens,
    no prefix caching, as vLLM runs such models), each a 3-token decoder prompt with
    ``audio_tokens`` audio embeddings at offset 0, and an encoder budget of ``encoder_budget``
    embeddings per step. One line per engine step: the tokens each request computes, the
    audio the encoder runs, the encoder outputs the worker drops before it runs the step, and
    the blocks a request gets when it is admitted, per group."""
    from kvlab.kv_cache_interface import CrossAttentionSpec, FullAttentionSpec
    from kvlab.request import MultiModalFeature

    eng = build_engine(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=encoder_budget,
        manager_kwargs=dict(kv_cache_groups=[FullAttentionSpec(block_size=4), CrossAttentionSpec(block_size=4)], enable_caching=False),
    )
    for rid in "AB":
        eng.add_request(
            Request(rid, [7, 8, 9], max_tokens=3, mm_features=[MultiModalFeature(f"audio-{rid}", 0, audio_tokens, modality="audio")])
        )
    lines = []
    while eng.has_unfinished_requests():
        out = eng.step().scheduler_output
        tokens = ", ".join(f"{rid} {n}" for rid, n in out.num_scheduled_tokens.items())
        encoded = ", ".join(f"{rid}'s audio" for rid in out.scheduled_encoder_inputs) or "-"
        dropped = ", ".join(out.free_encoder_mm_hashes) or "-"
        new = "  ".join(f"{nr.req_id} gets decoder {nr.block_ids[0]} cross {nr.block_ids[1]}" for nr in out.scheduled_new_reqs)
        lines.append(f"step {out.step}: tokens {tokens:9} encoder runs {encoded:11} worker drops {dropped:9} {new}".rstrip())
    return lines


def hisparse_offload_and_finish(
    kv: Any, conn: OffloadingConnector, tokens: Sequence[int], request_id: str = "chat"
) -> tuple[list[int], list[int]]:
    """Lesson 12b, section 4: one request's life on a HiSparse KV-cache manager ``kv`` with
    the offloading connector's scheduler half ``conn`` bound to it. ``tokens`` are prefilled in
    one step; the workers write its pages back to the host pool (which publishes them) and
    copy its indexer keys to the CPU tier; then it finishes. Returns its (host pool, indexer)
    block ids, for a story that evicts some of them."""
    from kvlab.core.sched.output import NewRequestData, SchedulerOutput
    from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from kvlab.outputs import KVConnectorOutput

    r = Request(request_id, list(tokens))
    n = len(r.all_token_ids)
    _, num_hit = kv.get_computed_blocks(r)
    if num_hit or conn.get_num_new_matched_tokens(r, 0)[0]:
        raise ValueError(f"request {request_id!r} must find nothing cached: this story starts from an empty cache")
    if kv.allocate_slots(r, n) is None:
        raise ValueError(f"{n} tokens do not fit the pools")
    conn.update_state_after_alloc(r, kv.get_blocks(request_id), 0)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [
        NewRequestData(
            req_id=request_id,
            prompt_token_ids=list(tokens),
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=kv.get_block_ids(request_id),
            num_computed_tokens=0,
            lora_request=None,
            prefill_token_ids=list(tokens),
            new_token_ids=list(tokens),
        )
    ]
    step.num_scheduled_tokens, step.total_num_scheduled_tokens = {request_id: n}, n
    stores = conn.build_connector_meta(step).stores  # the step's store jobs, run after its forward pass
    r.num_computed_tokens = n
    coordinator = kv.hisparse
    coordinator.advance_scheduled([(request_id, n)])
    done = [t.transfer_id for t in coordinator.build_offload_command().page_transfers]
    coordinator.update_spills(dict.fromkeys(done, 1), dict.fromkeys(done, 1))  # the host copies landed
    conn.update_connector_output(
        KVConnectorOutput(worker_meta=OffloadingWorkerMetadata(stores={s.job_id: (True, False, "") for s in stores}))
    )
    host, indexer = kv.get_block_ids(request_id)[:2]
    kv.free(r)
    conn.request_finished(r, [])
    return host, indexer
