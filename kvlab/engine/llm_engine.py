"""The engine loop: schedule -> execute -> update, with a simulated clock (lesson 00, 05).

vLLM: ``vllm/v1/engine/core.py`` (``EngineCore.step``). The executor is an interface: the
``SimulatedExecutor`` here needs no model (the next token is a fixed function of the
context), and ``kvlab.worker.model_runner.ModelRunner`` runs the real tiny model through the Triton
kernels. Either way the clock advances by a ``CostModel`` of the step, so TTFT, TPOT and
throughput can be read off without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.sched.output import SchedulerOutput
from kvlab.core.sched.scheduler import Scheduler
from kvlab.core.transaction import EngineCheckpoint, Unguarded, engine_call, rollback_engine
from kvlab.engine.cost_model import CostModel
from kvlab.executor.abstract import Executor
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.metrics.stats import IterationStats
from kvlab.request import Request
from kvlab.eventlog.events import EventLog
from kvlab.utils.checks import check_optional_int
from kvlab.utils.progress import progress_bar


@dataclass(slots=True)
class RequestMetrics:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    prefill_tokens_computed: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class EngineInterruptedError(RuntimeError):
    """The engine stopped in the middle of a call and could not put itself back (an
    interrupt arrived while it was undoing the call): ``engine.restore()`` does it."""


@dataclass(slots=True)
class StepResult:
    step: int
    time: float
    scheduler_output: SchedulerOutput
    finished: list[Request] = field(default_factory=list)
    #: a KV connector's asynchronous transfer had not reported yet when the step ended
    pending_kv_transfers: bool = False
    #: ... and when it began: a step that ends such a wait progressed, even scheduling nothing
    waited_on_kv_transfers: bool = False


def initialize_kv_cache(executor: object, kv_cache_manager: KVCacheManager) -> None:
    """Give an executor that holds real paged caches, built without a size, the manager's
    ``kv_cache_config`` (vLLM 0.33: ``EngineCore._initialize_kv_caches`` hands the workers
    the plan through ``initialize_from_config``). A runner sized by hand must hold the
    manager's pool -- the same block ids, the same tokens per block -- else the manager's
    block 15 is no block of the runner's. The simulated executor holds no cache; it is told
    whether the model is an encoder-decoder one (a cross-attention group), as vLLM's runner
    knows from the model config: there the encoder's output is read on the first step only."""
    if isinstance(executor, SimulatedExecutor):
        executor.is_encoder_decoder = bool(kv_cache_manager.coordinator.cross_attention_group_ids)
    allocated = getattr(executor, "kv_cache_allocated", None)
    if allocated is False:
        executor.initialize_kv_cache(kv_cache_manager.kv_cache_config)  # type: ignore[attr-defined]  # a runner: it has kv_cache_allocated
    elif allocated:
        have = (getattr(executor, "num_blocks", None), getattr(executor, "block_size", None))
        want = (kv_cache_manager.block_pool.num_gpu_blocks, kv_cache_manager.kv_cache_groups[0].block_size)
        if have != want:
            raise ValueError(
                f"executor holds {have[0]} blocks of {have[1]} tokens, but the kv_cache_manager's pool has {want[0]} blocks "
                f"of {want[1]}; build the runner without num_blocks and block_size: the engine sizes it from the manager"
            )


class LLMEngine:
    """The loop that drives everything: schedule, execute, update, repeat (vLLM: the
    ``EngineCore`` step of ``vllm/v1/engine/core.py``; lessons 00, 05 and 08).

    Why it is this small: every decision about memory is the :class:`Scheduler`'s and the
    :class:`KVCacheManager`'s; the executor only computes the tokens it is told to (the
    model-free :class:`SimulatedExecutor`, or the real ``ModelRunner`` with the Triton
    kernels). The engine adds what a serving system measures: a simulated clock advanced
    by a :class:`CostModel` per step, so time to first token, time per output token and
    throughput can be read without a GPU (lesson 08), and per-request metrics; the
    per-step series come from the event log (each ``StepFinished`` carries the clock).
    ``run`` steps until done, ``run_trace`` admits requests at their arrival
    times, ``generate`` is the one-call API for prompts (text when a tokenizer is given).

    Every call is all or nothing -- learners press "interrupt kernel" in the middle of
    ``run()`` and plug in functions that raise. A step first takes a cheap checkpoint
    (``kvlab.core.transaction``); if anything raises before the step ends -- an
    exception, ``KeyboardInterrupt``, a failing event subscriber, the executor -- the engine
    goes back to the end of the previous step (the event log is cut back too: that step
    never happened) and the exception goes on with a note saying so. Nothing is lost: no
    request, no block. If the interrupt hits while it is undoing, the engine refuses to go
    on (:class:`EngineInterruptedError`) until :meth:`restore` finishes the job.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        scheduler: Scheduler,
        executor: Executor,
        cost_model: CostModel | None = None,
        tokenizer: object | None = None,
    ) -> None:
        if not isinstance(kv_cache_manager, KVCacheManager):
            raise TypeError(f"kv_cache_manager must be a KVCacheManager, got {type(kv_cache_manager).__name__}")
        if not isinstance(scheduler, Scheduler):
            raise TypeError(f"scheduler must be a Scheduler, got {type(scheduler).__name__}")
        if scheduler.kv_cache_manager is not kv_cache_manager:
            raise ValueError("scheduler was built on a different kv_cache_manager")
        if not callable(getattr(executor, "execute_model", None)):
            raise TypeError(f"executor must have an execute_model(scheduler_output) method, got {type(executor).__name__}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be None or a CostModel, got {type(cost_model).__name__}")
        if tokenizer is not None and (isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None))):
            raise TypeError(f"tokenizer must be None or have an encode(text) method, got {type(tokenizer).__name__}")
        initialize_kv_cache(executor, kv_cache_manager)
        self.kv_cache_manager = kv_cache_manager
        self.scheduler = scheduler
        self.executor = executor
        self.cost_model = cost_model or CostModel()
        self.tokenizer = tokenizer
        self.clock = 0.0
        # Block residency (lesson 08): a collector without a clock measures simulated time.
        collector = kv_cache_manager.metrics_collector
        if collector is not None and collector.clock is None:
            collector.clock = lambda: self.clock
        self.kv_cache_eviction_events: list = []  # every sampled residency that ended
        self.metrics: dict[str, RequestMetrics] = {}
        self.finished: dict[str, Request] = {}
        self._ids = 0
        # Adapter name -> the id this engine gave it, in order of first use from 1 (vLLM's
        # OpenAI server numbers the adapters it loads that way; the KV events carry the id).
        self.lora_ids: dict[str, int] = {}
        self._pending: EngineCheckpoint | None = None  # a call in progress (or one left unfinished)
        self._unguarded: Unguarded | None = None  # set inside kvlab.core.transaction.unguarded(self)
        self.fault: str | None = None  # what stopped the last call that failed

    @property
    def events(self) -> EventLog | None:
        return self.kv_cache_manager.events

    # -- all or nothing ------------------------------------------------------------------------
    @property
    def interrupted(self) -> bool:
        """True when a call stopped half way and could not undo itself: call :meth:`restore`."""
        return self._pending is not None

    def _check_usable(self) -> None:
        cp = self._pending
        if isinstance(cp, Unguarded):
            raise EngineInterruptedError(
                f"a call failed at step {cp.step + 1} while the engine ran without undo points "
                f"(kvlab.core.transaction.unguarded) -- {self.fault or 'interrupted'} -- so its state is unfinished "
                "and there is nothing to go back to: build a new engine"
            )
        if cp is not None:
            raise EngineInterruptedError(
                f"the engine stopped in the middle of {cp.what} (step {cp.step + 1}) -- {self.fault or 'interrupted'} -- "
                "and was interrupted again while it was undoing it, so its state is unfinished and it will not go on. "
                f"Call engine.restore() to go back to the end of step {cp.step} (every request is kept), then continue."
            )

    def restore(self) -> str:
        """Finish undoing a call that stopped half way (see :class:`EngineInterruptedError`):
        the engine goes back to the end of its last completed step, every request kept.
        Returns what it did; safe to call again if it is itself interrupted."""
        cp = self._pending
        if cp is None:
            return f"nothing to restore: the engine is at the end of step {self.scheduler.step_count}"
        rollback_engine(self, cp)
        self._pending = None
        return f"restored: the engine is back at the end of step {cp.step}, before the {cp.what} that failed ({self.fault})"

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (all or nothing). A LoRA request without an adapter id gets the
        one this engine gave its adapter's name (see :meth:`lora_id_for`).

        A streaming-input session (vLLM 0.33): a first request with ``resumable=True`` runs
        its turn, then waits holding its blocks; each later request with its id is the next
        chunk (``resumable=True``) or closes it (``resumable=False``) --
        :meth:`Scheduler.add_streaming_update`."""
        self._check_usable()
        sched = self.scheduler
        session = sched.open_session(request)
        if session is not None:
            sched.check_streaming_update(request)
            if request.resumable:
                _check_runnable_ids(request)
            with engine_call(self, "add_request") as cp:
                cp.save_metrics(self.metrics, request.request_id)
                cp.save_finished(self.finished, request.request_id)
                sched.add_streaming_update(request)
                if session.is_finished():  # closed between turns
                    m = self.metrics.get(request.request_id)
                    if m is not None:
                        m.finished_time = self.clock
                    self.finished[request.request_id] = session
            return
        sched.check_request(request)
        _check_runnable_ids(request)
        lora_int_id = self.lora_id_for(request.lora_name, request.lora_int_id)
        known = request.lora_name in self.lora_ids
        rid = request.request_id
        old = self.metrics.get(rid)
        given = request.lora_int_id
        try:
            self.metrics[rid] = RequestMetrics(rid, self.clock, request.num_prompt_tokens)
            request.lora_int_id = lora_int_id
            if request.lora_name is not None and lora_int_id is not None:
                self.lora_ids[request.lora_name] = lora_int_id
            self.scheduler.add_request(request)
        except BaseException:  # (each undo below is right whether or not its change was made)
            if old is None:
                self.metrics.pop(rid, None)
            else:
                self.metrics[rid] = old
            request.lora_int_id = given
            if not known and request.lora_name is not None:
                self.lora_ids.pop(request.lora_name, None)
            raise

    def lora_id_for(self, lora_name: str | None, lora_int_id: int | None = None) -> int | None:
        """The adapter id a request naming ``lora_name`` runs with: ``lora_int_id`` if given,
        else the id this engine already gave that name, else the next one (1, 2, ... in order
        of first use -- how vLLM's OpenAI server numbers the adapters it loads). One adapter,
        one id: an id that another name holds, or a second id for a known name, is refused.
        Changes nothing."""
        if lora_name is None:
            return None
        known = self.lora_ids.get(lora_name)
        if lora_int_id is None:
            return known if known is not None else max(self.lora_ids.values(), default=0) + 1
        if known is not None and known != lora_int_id:
            raise ValueError(
                f"lora_int_id = {lora_int_id} for adapter {lora_name!r}, which this engine numbers {known}; one adapter, one id"
            )
        other = next((n for n, i in self.lora_ids.items() if i == lora_int_id and n != lora_name), None)
        if other is not None:
            raise ValueError(
                f"lora_int_id = {lora_int_id} for adapter {lora_name!r}, but adapter {other!r} has that id; one id, one adapter"
            )
        return lora_int_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (vLLM's name): they finish with reason "abort" and free their
        blocks; ids that are not queued are ignored. All or nothing."""
        sched = self.scheduler
        ids, _ = sched.check_finish_args(request_ids)
        with engine_call(self, "abort_request") as cp:
            queued = [sched.requests[rid] for rid in ids if rid in sched.requests]
            sched.finish_requests(ids)
            for r in queued:
                cp.save_metrics(self.metrics, r.request_id)
                cp.save_finished(self.finished, r.request_id)
                m = self.metrics.get(r.request_id)
                if m is not None:
                    m.finished_time = self.clock
                self.finished[r.request_id] = r

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drop every cached prefix (vLLM's ``LLM.reset_prefix_cache``): False while a running
        request holds blocks, unless ``reset_running_requests`` preempts them all first;
        ``reset_connector`` empties the connector's tiers too. All or nothing."""
        with engine_call(self, "reset_prefix_cache"):
            return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _has_work(self) -> bool:
        """Unfinished requests, or a connector's transfer still holding blocks: ``run()``
        steps on until the sends of finished requests are done too."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_transfers()

    # -- steps ---------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, execute, update: one engine step, all or nothing (see the class doc)."""
        with engine_call(self, "step") as cp:
            return self._step(cp)

    def _step(self, cp: EngineCheckpoint | Unguarded) -> StepResult:
        sched = self.scheduler
        waited = sched.has_pending_kv_transfers()
        out = sched.schedule()
        cp.save_metrics_of(self.metrics, out.num_scheduled_tokens)
        # Also a step that only preempted: the executor must drop the victims' state; and
        # while a connector's asynchronous transfer runs, every step: its worker half reports
        # what finished (vLLM: kv_connector_no_forward).
        busy = out.total_num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids or sched.has_pending_kv_transfers()
        sampled: Any = {}
        if busy:
            cp.executor_called = True
            sampled = self.executor.execute_model(out)
            if not isinstance(sampled, Mapping):
                raise TypeError(
                    f"{type(self.executor).__name__}.execute_model returned {type(sampled).__name__}; "
                    "it must return a dict {request_id: [sampled token ids]}"
                )
            _check_sampled_ids(type(self.executor).__name__, sampled)
        take = getattr(self.executor, "take_kv_connector_output", None)
        kv_out = take() if busy and take is not None else None
        prefill = decode = context = 0
        decode_ids = set(out.scheduled_running_req_ids)
        for rid, n in out.num_scheduled_tokens.items():
            r = sched.requests[rid]
            m = self.metrics.get(rid)
            if m is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = self.clock
            if rid in decode_ids and n == 1 and r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1:
                decode += 1
            else:
                prefill += n
                if m is not None:
                    m.prefill_tokens_computed += n
            context += r.num_computed_tokens + n
        encoder = sum(sched.requests[rid].get_num_encoder_embeds(i) for rid, ids in out.scheduled_encoder_inputs.items() for i in ids)
        loaded = kv_out.num_loaded_tokens if kv_out is not None else None
        self.clock += self.cost_model.step_time(prefill, decode, context, loaded, encoder)
        before = {rid: sched.requests[rid].num_output_tokens for rid in out.num_scheduled_tokens}
        finished = sched.update_from_output(out, sampled, iteration=IterationStats(self.clock, prefill, decode), kv_connector_output=kv_out)
        for rid, n0 in before.items():
            m = self.metrics.get(rid)
            req = sched.requests.get(rid) or next((f for f in finished if f.request_id == rid), None)
            if m is None or req is None:
                continue
            if n0 == 0 and req.num_output_tokens > 0 and m.first_token_time is None:
                m.first_token_time = self.clock
            m.num_output_tokens = req.num_output_tokens
            m.num_preemptions = req.num_preemptions
            if req.num_cached_tokens >= 0:
                m.num_cached_tokens = req.num_cached_tokens
        for r in finished:
            cp.save_finished(self.finished, r.request_id)
            m = self.metrics.get(r.request_id)
            if m is not None:
                m.finished_time = self.clock
            self.finished[r.request_id] = r
        collector = self.kv_cache_manager.metrics_collector
        if collector is not None:  # vLLM drains it into SchedulerStats.kv_cache_eviction_events
            self.kv_cache_eviction_events += collector.drain_events()
        return StepResult(out.step, self.clock, out, finished, sched.has_pending_kv_transfers(), waited)

    def run(self, max_steps: int | None = None, progress: bool = False) -> None:
        """Step until every request has finished (or ``max_steps`` steps have run)."""
        max_steps = check_optional_int("max_steps", max_steps, 0)
        self._check_usable()
        self._step_while(self._has_work, _progress(progress, total=None, desc="steps"), max_steps=max_steps)

    def run_trace(self, requests: Iterable[Request], progress: bool = False) -> None:
        """Add each request when the simulated clock reaches its ``arrival_time``.

        Every request is checked before the first is added (a bad one changes nothing). If
        the run stops (an interrupt), the requests added so far stay in the engine -- call
        ``run()`` to finish them -- and the rest were never added."""
        if isinstance(requests, (str, bytes, Request)) or not isinstance(requests, Iterable):
            raise TypeError(f"requests must be a list of Request, got {type(requests).__name__}")
        pending = list(requests)
        seen: set[str] = set()
        for i, r in enumerate(pending):
            if not isinstance(r, Request):
                raise TypeError(f"requests[{i}] must be a kvlab.Request, got {type(r).__name__}")
            self.scheduler.check_request(r)
            if r.request_id in seen:
                raise ValueError(f"requests[{i}]: request id {r.request_id!r} appears twice; ids must be unique")
            seen.add(r.request_id)
        self._check_usable()
        pending.sort(key=lambda r: r.arrival_time)
        i = 0

        def arrivals() -> None:  # before each step: jump an idle clock forward, then admit who has arrived
            nonlocal i
            if not self._has_work() and i < len(pending):
                self.clock = max(self.clock, pending[i].arrival_time)
            while i < len(pending) and pending[i].arrival_time <= self.clock:
                self.add_request(pending[i])
                self.metrics[pending[i].request_id].arrival_time = pending[i].arrival_time
                i += 1

        bar = _progress(progress, total=len(pending), desc="requests")
        self._step_while(lambda: i < len(pending) or self._has_work(), bar, before_step=arrivals, bar_counts="finished")

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_tokens: int = 16,
        progress: bool = False,
        **request_kwargs,
    ) -> list[list[int]]:
        """Run ``prompts`` to completion; return each one's output token ids, in order.

        All or nothing: every prompt becomes a checked Request before the first is queued,
        so a prompt that can never fit leaves nothing behind. The generated ids
        (``gen-1``, ``gen-2``, ...) skip every id the engine already knows."""
        self._check_usable()
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(
                "prompts must be a list of prompts (token-id lists, or strings with a tokenizer), got "
                f"{type(prompts).__name__}"
                + (" (a bare string would be read as one prompt per character)" if isinstance(prompts, str) else "")
            )
        taken = set(self.scheduler.requests) | set(self.metrics) | set(self.finished)
        next_id = self._ids
        reqs = []
        for i, p in enumerate(prompts):
            ids: list[int]
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise TypeError(f"prompts[{i}] is a string; string prompts need an engine built with a tokenizer")
                ids = list(self.tokenizer.encode(p))  # type: ignore[attr-defined]  # checked in __init__: it has encode()
            elif isinstance(p, Sequence) and not isinstance(p, bytes):
                ids = list(cast("Sequence[int]", p))  # not a str: that went to the tokenizer above
            elif hasattr(p, "tolist"):  # a numpy array or a tensor
                ids = list(p.tolist())
            else:
                hint = " (one prompt of token ids is generate([[1, 2, 3]]))" if isinstance(p, int) or hasattr(p, "__index__") else ""
                raise TypeError(f"prompts[{i}] must be a list of token ids or a str, got {type(p).__name__} {p!r}{hint}")
            next_id += 1
            while f"gen-{next_id}" in taken:
                next_id += 1
            r = Request(f"gen-{next_id}", ids, max_tokens=max_tokens, **request_kwargs)
            self.scheduler.check_request(r)
            _check_runnable_ids(r)
            reqs.append(r)
        lora_int_id = self.lora_id_for(request_kwargs.get("lora_name"), request_kwargs.get("lora_int_id"))
        with engine_call(self, "generate") as cp:
            if lora_int_id is not None:
                self.lora_ids[request_kwargs["lora_name"]] = lora_int_id
            for r in reqs:
                r.lora_int_id = lora_int_id
                cp.save_metrics(self.metrics, r.request_id)
                self.metrics[r.request_id] = RequestMetrics(r.request_id, self.clock, r.num_prompt_tokens)
                self.scheduler.add_request(r)
            self._ids = next_id
        self._step_while(self._has_work, _progress(progress, total=len(reqs), desc="generate"), bar_counts="finished")
        return [list(r.output_token_ids) for r in reqs]

    def _step_while(
        self,
        more: Callable[[], bool],
        bar: Any,
        *,
        before_step: Callable[[], None] | None = None,
        max_steps: int | None = None,
        bar_counts: Literal["steps", "finished"] = "steps",
    ) -> None:
        """The run loop ``run``, ``run_trace`` and ``generate`` share: step while ``more()``
        (at most ``max_steps`` steps), refuse a run that stops progressing
        (:func:`_check_progress`), move the bar by steps or by finished requests, and close
        it however the loop ends (an interrupt included)."""
        steps = idle = 0
        try:
            while more() and (max_steps is None or steps < max_steps):
                if before_step is not None:
                    before_step()
                res = self.step()
                idle = _check_progress(res, idle)
                steps += 1
                if bar is not None:
                    n = 1 if bar_counts == "steps" else len(res.finished)
                    if n:
                        bar.update(n)
        finally:
            if bar is not None:
                bar.close()


def _check_runnable_ids(request: Request) -> None:
    """A Request may hold negative ids (int32, as vLLM's: -1 is vLLM's placeholder for a token
    not sampled yet), but a prompt an engine runs goes through a model's embedding, where a
    negative id would index from the end of the table: refuse it before anything is queued."""
    ids = request.prompt_token_ids
    if not ids or min(ids) >= 0:  # one pass in C; the walk below only names the culprit
        return
    for i, t in enumerate(ids):
        if t < 0:
            raise ValueError(
                f"prompt_token_ids[{i}]={t} is out of range; an engine runs prompts of real token ids (>= 0) -- negative ids are "
                "placeholders (vLLM writes -1 for a token not sampled yet) and reach no model"
            )


def _check_sampled_ids(executor_name: str, sampled: Mapping[str, Any]) -> None:
    """A model samples from its vocabulary, so an executor's token ids are >= 0 (the
    scheduler, like vLLM's, accepts -1 placeholders from a caller that drives it directly)."""
    for rid, toks in sampled.items():
        ids = toks.tolist() if hasattr(toks, "tolist") else toks
        if not isinstance(ids, (list, tuple)) or not ids:
            continue
        try:
            if min(ids) >= 0:  # one pass in C per request; the walk below only names the culprit
                continue
        except TypeError:
            continue  # not all numbers: the scheduler says what is wrong
        for i, t in enumerate(ids):
            if isinstance(t, int) and t < 0:
                raise ValueError(
                    f"{executor_name}.execute_model sampled token id {t} for {rid!r} (sampled_token_ids[{rid!r}][{i}]); "
                    "a model samples ids >= 0 from its vocabulary"
                )


#: Steps in a row a run waits on a connector's asynchronous transfers with nothing else to do
#: before it gives up: a worker half that never reports a transfer done would loop forever.
MAX_STEPS_WAITING_ON_TRANSFERS = 10_000


def _check_progress(res: StepResult, idle: int) -> int:
    """A step may schedule nothing and still progress (under "priority" a request can be its
    own victim, and a step that preempts admits no one; if no running request after it fits
    either, nothing is scheduled; a connector's asynchronous load may still be on its way, or
    its work to push -- ``res.waited_on_kv_transfers``: something was pending before the
    step, so a step that ends it progressed); a step that does nothing at all would repeat forever. Returns the
    steps in a row that only waited on transfers."""
    so = res.scheduler_output
    if so.total_num_scheduled_tokens or res.finished or so.preempted_req_ids:
        return 0
    if not res.pending_kv_transfers:
        if res.waited_on_kv_transfers:
            return 0  # the transfer or push it waited on ended in this step
        raise RuntimeError("the engine made no progress in a step (nothing could be scheduled)")
    if idle + 1 >= MAX_STEPS_WAITING_ON_TRANSFERS:
        raise RuntimeError(
            f"the engine waited {idle + 1} steps in a row on a KV connector's asynchronous transfers with nothing else to "
            "do: its worker half must report each load in get_finished() / get_transfer_results() (finished_recving) "
            "and each send of a finished request whose request_finished returned True (finished_sending); "
            "its has_pending_push_work() must turn False once its work is pushed"
        )
    return idle + 1


def _progress(enabled: bool, total: int | None, desc: str) -> Any:
    return progress_bar(total, desc) if enabled else None


def build_engine(
    num_blocks: int = 64,
    block_size: int = 16,
    executor: Executor | None = None,
    event_log: EventLog | bool | None = True,
    cost_model: CostModel | None = None,
    tokenizer: object | None = None,
    manager_kwargs: dict | None = None,
    kv_transfer_config: Any = None,
    **scheduler_kwargs,
) -> LLMEngine:
    """One call for the lessons: manager + scheduler + executor (simulated by default).

    The manager's ``max_in_flight_tokens`` (what vLLM's admission gate counts at most for a
    window or chunk group) defaults to the scheduler's ``max_num_batched_tokens``, as vLLM
    derives it for one batch in flight.

    ``kv_transfer_config``: a :class:`~kvlab.config.kv_transfer.KVTransferConfig` -- both
    halves of the KV connector it names are built (vLLM's ``--kv-transfer-config``): the
    scheduler half goes to the scheduler, the worker half to the executor (lessons 12-13).
    ``event_log``: True (a new log), an ``EventLog`` to record into, or None/False (none)."""
    if event_log is True:
        log: EventLog | None = EventLog()
    elif event_log is None or event_log is False:
        log = None
    elif isinstance(event_log, EventLog):
        log = event_log  # an empty log is falsy by length: test its type, not its truth
    else:
        raise TypeError(f"event_log must be True, False, None or an EventLog, got {type(event_log).__name__}")
    if manager_kwargs is not None and not isinstance(manager_kwargs, Mapping):
        raise TypeError(f"manager_kwargs must be None or a dict, got {type(manager_kwargs).__name__}")
    mkw = dict(manager_kwargs or {})
    mkw.setdefault("max_in_flight_tokens", scheduler_kwargs.get("max_num_batched_tokens", 2048))
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, event_log=log, **mkw)
    worker_connector = None
    if kv_transfer_config is not None:
        from kvlab.config.kv_transfer import KVTransferConfig
        from kvlab.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        if not isinstance(kv_transfer_config, KVTransferConfig):
            raise TypeError(f"kv_transfer_config must be a KVTransferConfig, got {type(kv_transfer_config).__name__}")
        sched_connector = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.SCHEDULER, block_size)
        worker_connector = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.WORKER, block_size)
        scheduler_kwargs = dict(
            scheduler_kwargs,
            connector=sched_connector,
            kv_load_failure_policy=kv_transfer_config.kv_load_failure_policy,
            kv_transfer_config=kv_transfer_config,
        )
    sched = Scheduler(mgr, **scheduler_kwargs)
    if executor is None:
        executor = SimulatedExecutor()
    initialize_kv_cache(executor, mgr)  # before a connector is shown the caches
    if worker_connector is not None:
        register = getattr(executor, "register_kv_connector", None)
        if register is None:
            raise TypeError(f"{type(executor).__name__} cannot run a KV connector (no register_kv_connector)")
        register(worker_connector, getattr(executor, "kv_caches", []))
    return LLMEngine(mgr, sched, executor, cost_model, tokenizer)
