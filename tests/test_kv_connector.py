"""KV connectors and disaggregated prefill (lesson 13): the hooks of KVConnectorBase_V1 are
called where vLLM calls them, the file-backed ExampleConnector hands a prompt's KV from a
prefill engine to a decode engine -- in one process and in two -- and a broken hand-off
falls back to computing the prompt."""

from __future__ import annotations

import os

import pytest
import torch

import kvlab.kernels  # noqa: F401,I001 - sets TRITON_INTERPRET before triton is imported
from kvlab import KVCacheManager, Request, Scheduler
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.metrics.cache_hit_source import CacheHitSource
from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.entrypoints.disagg_prefill import DisaggregatedPrefill, EngineProcessError
from kvlab.timeline import Timeline
from kvlab.eventlog.events import EventLog, KVLoadFailed, KVTransfer
from kvlab.worker.model import TinyLlama
from kvlab.worker.model_runner import ModelRunner
from kvlab.worker.tokenizer import ByteTokenizer
from scheduler_side_connector import SchedulerSideConnector

TOK = ByteTokenizer()
PROMPTS = [
    TOK.encode(s) for s in ("Disaggregated prefill: one engine reads, ", "the other one writes the answer. Here", "Blocks, not buffers.")
]


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    torch.set_num_threads(1)
    return TinyLlama(seed=0)


def _engine(model, role, path, num_blocks=32, **extra):
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=16, device="cpu")
    cfg = KVTransferConfig("ExampleConnector", kv_role=role, kv_connector_extra_config={"shared_storage_path": str(path), **extra})
    return build_engine(num_blocks=num_blocks, block_size=16, executor=runner, kv_transfer_config=cfg)


# -- the hooks ---------------------------------------------------------------------------------------
class Recorder(KVConnectorBase_V1):
    """A connector that supplies the first 16 tokens of any prompt from "elsewhere" (zeros)
    and writes down every hook, in order."""

    calls: list[str] = []

    def on_new_request(self, request):
        self.calls.append(f"S.on_new_request({request.request_id})")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(f"S.get_num_new_matched_tokens({request.request_id}, {num_computed_tokens})")
        return (16 - num_computed_tokens if request.num_tokens > 16 else 0), False

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        self.calls.append(f"S.get_external_cache_hit_sources({request.request_id}, {num_external_tokens})")
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(f"S.update_state_after_alloc({request.request_id}, {blocks.get_block_ids()[0]}, {num_external_tokens})")

    def build_connector_meta(self, scheduler_output):
        self.calls.append(f"S.build_connector_meta(step {scheduler_output.step})")
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(f"S.request_finished({request.request_id}, {block_ids})")
        return False, {"done": True}

    def handle_preemptions(self, kv_connector_metadata):
        self.calls.append("W.handle_preemptions")

    def bind_connector_metadata(self, connector_metadata):
        self.calls.append("W.bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, **kwargs):
        self.calls.append("W.start_load_kv")

    def wait_for_layer_load(self, layer_name):
        self.calls.append(f"W.wait_for_layer_load({layer_name})")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.calls.append(f"W.save_kv_layer({layer_name}, {tuple(kv_layer.shape)})")

    def wait_for_save(self, skip_req_ids=frozenset()):
        self.calls.append("W.wait_for_save")

    def clear_connector_metadata(self):
        self.calls.append("W.clear_connector_metadata")
        super().clear_connector_metadata()


def test_every_hook_is_called_where_vllm_calls_it(model) -> None:
    Recorder.calls = []
    log = EventLog()
    mgr = KVCacheManager(num_blocks=8, block_size=16, event_log=log)
    sched = Scheduler(mgr, connector=Recorder(KVConnectorRole.SCHEDULER))
    runner = ModelRunner(model, num_blocks=8, block_size=16, device="cpu", kv_connector=Recorder(KVConnectorRole.WORKER))
    eng = LLMEngine(mgr, sched, runner)
    eng.add_request(Request("r", PROMPTS[0], max_tokens=2))
    eng.run()
    layers = [
        "W.wait_for_layer_load(layers.0)",
        "W.save_kv_layer(layers.0, (8, 2, 16, 2, 32))",
        "W.wait_for_layer_load(layers.1)",
        "W.save_kv_layer(layers.1, (8, 2, 16, 2, 32))",
    ]
    worker_step = [
        "W.handle_preemptions",
        "W.bind_connector_metadata",
        "W.start_load_kv",
        *layers,
        "W.wait_for_save",
        "W.clear_connector_metadata",
    ]
    assert Recorder.calls == [
        "S.on_new_request(r)",
        "S.get_num_new_matched_tokens(r, 0)",
        "S.update_state_after_alloc(r, [1, 2, 3], 16)",
        "S.get_external_cache_hit_sources(r, 16)",
        "S.build_connector_meta(step 1)",
        *worker_step,
        "S.build_connector_meta(step 2)",
        *worker_step,
        "S.request_finished(r, [1, 2, 3])",
    ]
    # the 16 external tokens were never computed: the model ran 41 - 16 prompt tokens + 1 decode
    assert runner.num_tokens_computed == 41 - 16 + 1
    assert eng.finished["r"].kv_transfer_params == {"done": True}
    assert [(e.num_cached_tokens, e.num_external_tokens) for e in log if e.kind == "request_scheduled" and e.phase == "new"] == [(16, 16)]
    # a connector that does not split its hits: all 16 from an unnamed source (vLLM 0.33's default)
    assert sched.connector_prefix_cache_stats.hits_by_source == {CacheHitSource.EXTERNAL_UNSPECIFIED: 16}


def test_a_connector_that_cannot_tell_yet_holds_the_request_back() -> None:
    class NotYet(Recorder):
        answer = None

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.answer, False

    conn = NotYet(KVConnectorRole.SCHEDULER)
    mgr = KVCacheManager(num_blocks=8, block_size=16)
    eng = LLMEngine(mgr, Scheduler(mgr, connector=conn), __import__("kvlab").SimulatedExecutor())
    eng.add_request(Request("r", list(range(40)), max_tokens=1))
    assert eng.step().scheduler_output.num_scheduled_tokens == {}
    conn.answer = 48  # more than the prompt holds: refused with a clear error
    with pytest.raises(ValueError, match=r"get_num_new_matched_tokens\(\)\[0\]=48 is out of range"):
        eng.step()


def test_a_request_that_skips_reading_the_cache_gets_nothing_from_the_connector_either() -> None:
    """vLLM 0.33's scheduler asks the connector, then takes 0 external tokens for a request
    with ``skip_reading_prefix_cache`` (one that wants its prompt's logprobs)."""
    Recorder.calls = []
    conn = Recorder(KVConnectorRole.SCHEDULER)
    mgr = KVCacheManager(num_blocks=8, block_size=16)
    eng = LLMEngine(mgr, Scheduler(mgr, connector=conn), __import__("kvlab").SimulatedExecutor())
    eng.add_request(Request("plain", list(range(40)), max_tokens=1))
    eng.add_request(Request("logprobs", list(range(100, 140)), max_tokens=1, prompt_logprobs=2))
    out = eng.step().scheduler_output
    assert out.num_scheduled_tokens == {"plain": 24, "logprobs": 40}  # 16 of plain's came from "elsewhere"
    assert [c for c in Recorder.calls if c.startswith("S.get_num")] == [
        "S.get_num_new_matched_tokens(plain, 0)",
        "S.get_num_new_matched_tokens(logprobs, 0)",
    ]
    assert "S.update_state_after_alloc(logprobs, [4, 5, 6], 0)" in Recorder.calls


# -- the example connector, one process -----------------------------------------------------------------
def test_prefill_engine_hands_the_prompt_to_the_decode_engine(model, tmp_path) -> None:
    P, D = _engine(model, "kv_producer", tmp_path), _engine(model, "kv_consumer", tmp_path)
    outs = []
    for i, p in enumerate(PROMPTS):
        P.add_request(Request(f"r{i}", p, max_tokens=1))
        P.run()
        D.add_request(Request(f"r{i}", p, max_tokens=8))
        D.run()
        outs.append(D.finished[f"r{i}"].output_token_ids)
        assert P.finished[f"r{i}"].output_token_ids == outs[-1][:1]  # both engines sample the same first token
    assert outs == [model.generate_dense(p, 8) for p in PROMPTS]
    # the decode engine computed only each prompt's last token and its decode steps
    assert D.executor.num_tokens_computed == 3 * 8
    assert P.executor.num_tokens_computed == sum(len(p) for p in PROMPTS)
    saved = [(e.request_id, e.block_ids, e.num_tokens) for e in P.events if isinstance(e, KVTransfer)]
    loaded = [(e.request_id, e.block_ids, e.num_tokens) for e in D.events if isinstance(e, KVTransfer)]
    assert saved == [("r0", [1, 2, 3], 41), ("r1", [3, 4, 5], 37), ("r2", [5, 6], 20)]
    assert loaded == [("r0", [1, 2, 3], 40), ("r1", [4, 5, 6], 36), ("r2", [6, 7], 19)]
    params = P.finished["r0"].kv_transfer_params
    assert params["num_tokens"] == 41 and os.path.exists(os.path.join(str(tmp_path), params["folder"], "meta.json"))
    assert sorted(os.listdir(os.path.join(str(tmp_path), params["folder"]))) == ["layers.0.kv", "layers.1.kv", "meta.json"]


def test_a_missing_layer_file_falls_back_to_computing_the_prompt(model, tmp_path) -> None:
    P, D = _engine(model, "kv_producer", tmp_path), _engine(model, "kv_consumer", tmp_path)
    P.add_request(Request("r", PROMPTS[0], max_tokens=1))
    P.run()
    folder = os.path.join(str(tmp_path), P.finished["r"].kv_transfer_params["folder"])
    os.remove(os.path.join(folder, "layers.1.kv"))
    D.add_request(Request("r", PROMPTS[0], max_tokens=8))
    D.run()
    failed = [e for e in D.events if isinstance(e, KVLoadFailed)]
    assert [(e.request_id, e.block_ids) for e in failed] == [("r", [1, 2, 3])]
    assert "layers.1.kv: missing" in failed[0].reason
    assert D.finished["r"].output_token_ids == model.generate_dense(PROMPTS[0], 8)
    # layer 0 was written before layer 1 failed, but nothing of the load is trusted: the
    # whole prompt was computed again (41) + 7 decode steps
    assert D.executor.num_tokens_computed == 41 + 7
    D.scheduler.check_invariants()
    assert D.kv_cache_manager.block_pool.get_num_free_blocks() == 31


@pytest.mark.parametrize("broken", [False, True])
def test_the_decode_engine_takes_the_kv_asynchronously_while_others_run(model, tmp_path, broken) -> None:
    """``load_async_steps``: r waits in WAITING_FOR_REMOTE_KVS holding its blocks while x
    decodes, and runs when the worker reports the load; a load that failed is reported too,
    and r computes its prompt after all."""
    P = _engine(model, "kv_producer", tmp_path)
    P.add_request(Request("r", PROMPTS[0], max_tokens=1))
    P.run()
    if broken:
        os.remove(os.path.join(str(tmp_path), P.finished["r"].kv_transfer_params["folder"], "layers.1.kv"))
    D = _engine(model, "kv_consumer", tmp_path, load_async_steps=2)
    D.add_request(Request("x", PROMPTS[2], max_tokens=6))
    D.step()
    D.add_request(Request("r", PROMPTS[0], max_tokens=8))
    seen = []
    while D.has_unfinished_requests():
        res = D.step()
        r = D.scheduler.requests.get("r")
        seen.append(
            (res.scheduler_output.num_scheduled_tokens.get("r", 0), r.status.name if r else None, r.num_computed_tokens if r else None)
        )
    assert seen[:4] == [
        (0, "WAITING_FOR_REMOTE_KVS", 0 if broken else 40),  # the files are read (a failure cuts it to 0)
        (0, "WAITING_FOR_REMOTE_KVS", 0 if broken else 40),  # the load is reported at the end of this step
        (41 if broken else 1, "RUNNING", 41),
        (1, "RUNNING", 42),
    ]
    assert D.finished["r"].output_token_ids == model.generate_dense(PROMPTS[0], 8)
    assert D.finished["x"].output_token_ids == model.generate_dense(PROMPTS[2], 6)
    failed = [(e.request_id, e.block_ids, e.num_computed_tokens) for e in D.events if isinstance(e, KVLoadFailed)]
    assert failed == ([("r", [3, 4, 5], 0)] if broken else [])
    D.scheduler.check_invariants()
    assert D.kv_cache_manager.block_pool.get_num_free_blocks() == 31
    with pytest.raises(ValueError, match=r"load_async_steps.*>= 0"):
        _engine(model, "kv_consumer", tmp_path, load_async_steps=-1)


def test_connector_bad_input(tmp_path) -> None:
    from kvlab.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    with pytest.raises(TypeError, match="shared_storage_path"):
        ExampleConnector(KVConnectorRole.SCHEDULER, 16, {})
    with pytest.raises(ValueError, match="kv_role must be"):
        ExampleConnector(KVConnectorRole.SCHEDULER, 16, {"shared_storage_path": str(tmp_path)}, kv_role="both")
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig("ExampleConnector", kv_role="prefill")
    with pytest.raises(ValueError, match="worker half"):
        ModelRunner(
            TinyLlama(seed=0),
            num_blocks=4,
            block_size=16,
            device="cpu",
            kv_connector=ExampleConnector(KVConnectorRole.SCHEDULER, 16, {"shared_storage_path": str(tmp_path)}),
        )


# -- two processes -------------------------------------------------------------------------------------
def test_two_engine_processes_give_the_single_engine_outputs(model, tmp_path) -> None:
    with DisaggregatedPrefill(str(tmp_path), timeout_s=120) as pd:
        pids = [c.proc.pid for c in pd.children.values()]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        outs = pd.generate(PROMPTS, 8)
        children = list(pd.children.values())
    assert all(c.proc.returncode is not None for c in children)  # both exited
    single = build_engine(num_blocks=32, block_size=16, executor=ModelRunner(model, num_blocks=32, block_size=16, device="cpu"))
    assert outs == single.generate(PROMPTS, max_tokens=8) == [model.generate_dense(p, 8) for p in PROMPTS]
    decode = [r for r in pd.replies if r["role"] == "decode"]
    assert [(r["num_cached_tokens"], r["num_tokens_computed"]) for r in decode] == [(40, 8), (36, 8), (19, 8)]
    # both engines' logs are back for the pictures
    for role, path in pd.log_paths.items():
        tl = Timeline(EventLog.load(path))
        assert tl.last_step > 0, role


def test_every_wait_on_an_engine_process_is_bounded(tmp_path) -> None:
    pd = DisaggregatedPrefill(str(tmp_path), timeout_s=0.2)  # far less than an engine needs to start
    with pytest.raises(EngineProcessError, match="did not answer within"):
        pd.start()  # returns at all: the wait was bounded
    assert pd.children == {}  # killed, not left behind


# -- vLLM 0.33's scheduler-side hooks beyond the load ------------------------------------------------------
class Hooks(SchedulerSideConnector):
    """Do-nothing connector whose pending-work answers a test sets."""

    frees = False
    pushes = 0
    shutdowns = 0

    def build_connector_meta(self, scheduler_output):
        if not scheduler_output.num_scheduled_tokens and self.pushes:
            self.pushes -= 1  # one idle step pushes one piece
        return super().build_connector_meta(scheduler_output)

    def has_pending_block_frees(self):
        return self.frees

    def has_pending_push_work(self):
        return self.pushes > 0

    def shutdown(self):
        Hooks.shutdowns += 1


def _two_requests_that_outgrow_the_pool(conn: Hooks) -> tuple[LLMEngine, KVCacheManager]:
    mgr = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks: two 7-token prompts fill them
    eng = LLMEngine(mgr, Scheduler(mgr, connector=conn), __import__("kvlab").SimulatedExecutor())
    eng.add_request(Request("a", list(range(7)), max_tokens=10))
    eng.add_request(Request("b", list(range(100, 107)), max_tokens=10))
    return eng, mgr


@pytest.mark.parametrize("frees", [False, True])
def test_blocks_a_connector_will_give_back_are_waited_for_instead_of_preempting(frees) -> None:
    """Step 3: a's ninth token needs a third block and none is free. vLLM 0.33 preempts b --
    unless the connector says blocks are on their way back; then it schedules no one this step."""
    conn = Hooks(KVConnectorRole.SCHEDULER)
    conn.frees = frees
    eng, mgr = _two_requests_that_outgrow_the_pool(conn)
    outs = [eng.step().scheduler_output for _ in range(3)]
    assert [o.num_scheduled_tokens for o in outs[:2]] == [{"a": 7, "b": 7}, {"a": 1, "b": 1}]
    if frees:
        assert (outs[2].num_scheduled_tokens, outs[2].preempted_req_ids) == ({}, set())
        assert (mgr.get_block_ids("a"), mgr.get_block_ids("b")) == (([1, 2],), ([3, 4],))
    else:
        assert (outs[2].num_scheduled_tokens, outs[2].preempted_req_ids) == ({"a": 1}, {"b"})
        assert (mgr.get_block_ids("a"), mgr.get_block_ids("b")) == (([1, 2, 4],), ([],))


@pytest.mark.parametrize("pushes", [0, 2])
def test_the_engine_steps_on_while_the_connector_has_work_to_push(pushes) -> None:
    conn = Hooks(KVConnectorRole.SCHEDULER)
    conn.pushes = pushes
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    eng = LLMEngine(mgr, Scheduler(mgr, connector=conn), __import__("kvlab").SimulatedExecutor())
    eng.add_request(Request("a", list(range(7)), max_tokens=2))
    eng.run()
    assert "a" in eng.finished and conn.pushes == 0
    assert eng.scheduler.step_count == 2 + pushes  # the prefill, the decode, then one idle step per push


def test_shutdown_reaches_the_connector_and_a_refused_request_leaves_no_trace() -> None:
    Hooks.shutdowns = 0

    class Refuses(Hooks):
        def on_new_request(self, request):
            raise ValueError(f"no room for {request.request_id}")

    mgr = KVCacheManager(num_blocks=5, block_size=4)
    sched = Scheduler(mgr, connector=Refuses(KVConnectorRole.SCHEDULER))
    with pytest.raises(ValueError, match="no room for a"):
        sched.add_request(Request("a", list(range(7)), max_tokens=2))
    assert (sched.requests, len(sched.waiting)) == ({}, 0)  # on_new_request comes last: the request is taken back
    sched.shutdown()
    assert Hooks.shutdowns == 1


def test_a_hit_split_that_does_not_add_up_counts_as_unknown() -> None:
    from kvlab.metrics.stats import PrefixCacheStats

    stats = PrefixCacheStats()
    stats.record(40, 16, False, {CacheHitSource.HOST: 12, CacheHitSource.DISK: 4})
    stats.record(40, 8, False, {CacheHitSource.HOST: 4})  # 4 of 8: the whole 8 are "unknown"
    stats.record(40, 16, True, {CacheHitSource.HOST: 16})  # a preempted request's lookup is not split
    stats.record(40, 0, False, {})
    assert stats.hits_by_source == {CacheHitSource.HOST: 12, CacheHitSource.DISK: 4, CacheHitSource.EXTERNAL_UNSPECIFIED: 8}
    assert (stats.requests, stats.hits, stats.preempted_hits) == (3, 24, 16)
    copy = stats.copy()
    copy.hits_by_source[CacheHitSource.DISK] = 0
    assert stats.hits_by_source[CacheHitSource.DISK] == 4  # a checkpoint's copy is its own
