"""A kvlab engine in its own process, publishing vLLM's KV events over ZeroMQ (lessons 10, 11).

vLLM: ``vllm serve MODEL --kv-events-config '{"enable_kv_cache_events": true, ...}'`` --
an engine process whose scheduler publishes a ``KVEventBatch`` after every step. This
module is kvlab's stand-in: ``python -m kvlab.entrypoints.kv_server --kv-events-config
'{...}' --engine-config '{...}'`` runs a kvlab engine (model-free, simulated clock) whose
scheduler owns a real :class:`~kvlab.distributed.kv_publisher.ZmqEventPublisher` built from
the same JSON. Anything that reads a vLLM server's stream reads this one.

Instead of an HTTP API the process takes commands on a ZeroMQ ROUTER socket it binds on
loopback (``tcp://127.0.0.1:<free port>``); :class:`KVServer` is the client that starts the
process and sends them. Two ways to run:

* **free-running** (``"autostep": true``): like a server, it steps whenever it has work
  (``step_delay_s`` paces the steps so a live view can follow) -- lesson 10;
* **lock-step** (default): it steps only when told ``advance(until=t)`` -- until its
  simulated clock reaches t -- so N replicas and a router replay a trace deterministically,
  each replica's events reaching the router before the next routing decision -- lesson 11.

Every wait is bounded: the client gives each command ``timeout_s`` and checks that the
process is alive while it waits (a dead server raises :class:`ServerDied` with its exit code
and the end of its stderr); the server exits by itself when its parent process is gone;
:func:`stop_all` (also registered with ``atexit``) kills every server this process started.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, cast

import msgspec
import zmq

from kvlab.distributed.kv_events import KVEventBatch
from kvlab.distributed.kv_publisher import EventPublisherFactory, KVEventsConfig
from kvlab.engine.cost_model import CostModel
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.executor.scripted import ScriptedExecutor
from kvlab.request import Request
from kvlab.utils.checks import check_int, check_number
from kvlab.utils.hashing import HASH_ALGOS

READY = "KVLAB-SERVER-READY "
ENGINE_DEFAULTS: dict[str, Any] = dict(
    num_blocks=256,
    block_size=16,
    hash_algo="sha256_cbor",
    max_num_batched_tokens=2048,
    max_num_seqs=128,
    autostep=False,
    step_delay_s=0.0,
    cost_model=None,
)
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class ServerError(RuntimeError):
    """The server answered a command with an error (the server keeps running)."""


class ServerDied(RuntimeError):
    """The server process is gone (crashed, killed, or never started)."""


# ==================================================================================================
# The server process
# ==================================================================================================


def _engine_config(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The engine settings, every value checked (and numpy numbers made plain, so they go
    into JSON): a bad one is refused here, in the parent, before any process starts."""
    if raw is not None and not isinstance(raw, Mapping):
        raise TypeError(f"engine must be None or a dict of engine settings, got {type(raw).__name__}")
    cfg = dict(ENGINE_DEFAULTS)
    unknown = set(raw or {}) - set(cfg)
    if unknown:
        raise ValueError(f"engine config has unknown keys {sorted(unknown)}; allowed: {sorted(cfg)}")
    cfg.update(raw or {})
    cfg["num_blocks"] = check_int("engine['num_blocks']", cfg["num_blocks"], 2)
    cfg["block_size"] = check_int("engine['block_size']", cfg["block_size"], 1)
    cfg["max_num_batched_tokens"] = check_int("engine['max_num_batched_tokens']", cfg["max_num_batched_tokens"], 1)
    cfg["max_num_seqs"] = check_int("engine['max_num_seqs']", cfg["max_num_seqs"], 1)
    if cfg["hash_algo"] not in HASH_ALGOS:
        raise ValueError(f"engine['hash_algo'] must be one of {', '.join(HASH_ALGOS)}, got {cfg['hash_algo']!r}")
    if not isinstance(cfg["autostep"], bool):
        raise TypeError(f"engine['autostep'] must be True or False, got {cfg['autostep']!r}")
    cfg["step_delay_s"] = check_number("engine['step_delay_s']", cfg["step_delay_s"], 0)
    cost = cfg["cost_model"]
    if cost is not None:
        if not isinstance(cost, Mapping):
            raise TypeError(f"engine['cost_model'] must be None or a dict of CostModel fields, got {type(cost).__name__}")
        try:
            CostModel(**cost)
        except TypeError as e:
            raise TypeError(f"engine['cost_model']: {e}") from None
        except ValueError as e:
            raise ValueError(f"engine['cost_model']: {e}") from None
    return cfg


RECONFIGURABLE = ("autostep", "step_delay_s")
"""The engine settings :meth:`KVServer.configure` may change while the server runs."""


def _configure_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``configure`` settings, checked as :func:`_engine_config` checks them at start:
    a value the server could not step with is refused before it is applied."""
    unknown = sorted(set(settings) - set(RECONFIGURABLE))
    if unknown:
        raise ValueError(f"configure: unknown settings {unknown}; allowed: {list(RECONFIGURABLE)}")
    checked = _engine_config(settings)
    return {k: checked[k] for k in settings}


def _build(cfg: dict[str, Any], publisher: Any) -> LLMEngine:
    cost = CostModel(**cfg["cost_model"]) if cfg["cost_model"] else None
    return build_engine(
        num_blocks=cfg["num_blocks"],
        block_size=cfg["block_size"],
        executor=ScriptedExecutor(),
        event_log=None,
        cost_model=cost,
        manager_kwargs=dict(enable_kv_cache_events=True, hash_algo=cfg["hash_algo"]),
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_num_seqs=cfg["max_num_seqs"],
        kv_event_publisher=publisher,
    )


class _Server:
    def __init__(self, name: str, engine_cfg: dict[str, Any], events_cfg: KVEventsConfig, control: str) -> None:
        self.name = name
        self.cfg = engine_cfg
        self.publisher = EventPublisherFactory.create(events_cfg)
        self.engine = _build(engine_cfg, self.publisher)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.ctl = self.ctx.socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.bind(control)
        self.control = self.ctl.getsockopt_string(zmq.LAST_ENDPOINT)
        self.running = True

    def status(self, flush: bool = False) -> dict[str, Any]:
        """``flush``: first wait (<= 5 s) until the publisher has sent every batch, so a
        reply that says "published N" is never ahead of the stream."""
        if flush and hasattr(self.publisher, "flush"):
            self.publisher.flush(5.0)
        e = self.engine
        s = e.scheduler
        return dict(
            name=self.name,
            clock=e.clock,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_unfinished=s.get_num_unfinished_requests(),
            num_finished=len(e.finished),
            published=getattr(self.publisher, "num_published", 0),
            kv_cache_usage=e.kv_cache_manager.usage,
            pid=os.getpid(),
        )

    def _step_checked(self) -> None:
        res = self.engine.step()
        so = res.scheduler_output
        if so.total_num_scheduled_tokens == 0 and not res.finished and not so.preempted_req_ids:
            raise RuntimeError("the engine made no progress in a step (a request larger than the whole pool?)")

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        e = self.engine
        if op == "status":
            return self.status()
        if op == "add":
            reqs = []
            for r in msg.get("requests", []):
                req = Request(
                    r["request_id"],
                    r["prompt_token_ids"],
                    max_tokens=r["max_tokens"],
                    cache_salt=r.get("cache_salt"),
                    lora_name=r.get("lora_name"),
                    arrival_time=r.get("arrival_time", e.clock),
                )
                reqs.append((req, r))
            for req, r in reqs:  # all checked first: a bad request adds none
                if req.request_id in e.scheduler.requests or req.request_id in e.metrics:
                    raise ValueError(f"request_id {req.request_id!r} was already added to {self.name}")
            for req, r in reqs:
                if r.get("output_token_ids"):
                    # _build gives every server engine a ScriptedExecutor
                    cast(ScriptedExecutor, e.executor).add_script(req.request_id, req.num_prompt_tokens, r["output_token_ids"])
                e.add_request(req)
                if r.get("arrival_time") is not None:
                    e.metrics[req.request_id].arrival_time = float(r["arrival_time"])
            return self.status()
        if op == "advance":
            until = float(msg["until"])
            while e.has_unfinished_requests() and e.clock < until:
                self._step_checked()
            e.clock = max(e.clock, until)
            return self.status(flush=True)
        if op == "run":
            max_steps = msg.get("max_steps")
            n = 0
            while e.has_unfinished_requests() and (max_steps is None or n < max_steps):
                self._step_checked()
                n += 1
            return self.status(flush=True)
        if op == "metrics":
            rows = [
                [
                    m.request_id,
                    m.arrival_time,
                    m.first_token_time,
                    m.finished_time,
                    m.num_prompt_tokens,
                    m.num_cached_tokens,
                    m.num_preemptions,
                ]
                for m in e.metrics.values()
            ]
            return dict(self.status(), metrics=rows)
        if op == "reset":
            if e.has_unfinished_requests():
                raise ValueError(f"{self.name} still has {e.scheduler.get_num_unfinished_requests()} unfinished requests; run() first")
            if not e.kv_cache_manager.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() failed")
            events = e.kv_cache_manager.take_events()
            if events:
                self.publisher.publish(KVEventBatch(ts=e.clock, events=events))
            self.engine = _build(self.cfg, self.publisher)
            return self.status(flush=True)
        if op == "configure":
            # All or nothing: every setting is checked before any is applied (an unchecked
            # step_delay_s=-1 once killed the server at its next autostep).
            self.cfg.update(_configure_settings({k: v for k, v in msg.items() if k not in ("op", "id")}))
            return dict(self.status(), **{k: self.cfg[k] for k in RECONFIGURABLE})
        if op == "stop":
            self.running = False
            return self.status()
        raise ValueError(f"unknown op {op!r}; choose add, advance, run, status, metrics, reset, configure or stop")

    def serve(self) -> None:
        ppid = os.getppid()
        ctl = self.ctl
        while self.running:
            busy = bool(self.cfg["autostep"]) and self.engine.has_unfinished_requests()
            if ctl.poll(0 if busy else 100):
                frames = ctl.recv_multipart()
                if len(frames) != 3:
                    continue  # not [client, b"", body]: not ours
                client, _, body = frames
                mid = None
                try:
                    msg = _dec.decode(body)
                    if not isinstance(msg, dict):
                        raise ValueError("a command must be a map with an 'op'")
                    mid = msg.get("id")
                    reply = dict(ok=True, id=mid, **self.handle(msg))
                except Exception as ex:  # noqa: BLE001 - one bad command must not stop the server
                    reply = dict(ok=False, id=mid, error=f"{type(ex).__name__}: {ex}")
                ctl.send_multipart((client, b"", _enc.encode(reply)))
            elif busy:
                try:
                    self._step_checked()
                except Exception as ex:  # noqa: BLE001
                    print(f"[{self.name}] step failed: {ex}", file=sys.stderr, flush=True)
                    self.cfg["autostep"] = False
                if self.cfg["step_delay_s"]:
                    time.sleep(float(self.cfg["step_delay_s"]))
            if os.getppid() != ppid:  # the parent is gone: nobody will ever stop us
                break
        self.engine.scheduler.shutdown()
        ctl.close(linger=0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.entrypoints.kv_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="kvlab-server")
    ap.add_argument(
        "--kv-events-config",
        default='{"enable_kv_cache_events": true}',
        help="vLLM's --kv-events-config JSON (endpoint, replay_endpoint, topic, buffer_steps, hwm, ...)",
    )
    ap.add_argument("--engine-config", default="{}", help=f"JSON: engine settings (defaults {json.dumps(ENGINE_DEFAULTS)})")
    ap.add_argument("--control", default="tcp://127.0.0.1:0", help="where to bind the command socket (loopback)")
    args = ap.parse_args(argv)
    events_cfg = KVEventsConfig.from_cli(args.kv_events_config)
    engine_cfg = _engine_config(json.loads(args.engine_config))
    t0 = time.perf_counter()
    server = _Server(args.name, engine_cfg, events_cfg, args.control)
    pub = server.publisher
    info = dict(
        name=args.name,
        pid=os.getpid(),
        control=server.control,
        endpoint=getattr(pub, "endpoint", None),
        replay_endpoint=getattr(pub, "replay_endpoint", None),
        topic=events_cfg.topic,
        build_s=time.perf_counter() - t0,
        engine=engine_cfg,
    )
    print(READY + json.dumps(info), flush=True)
    sys.stdout = sys.stderr  # nobody reads stdout after the handshake: never block on a full pipe
    server.serve()
    return 0


# ==================================================================================================
# The client
# ==================================================================================================

_LIVE: "weakref.WeakSet[KVServer]" = weakref.WeakSet()


def stop_all() -> None:
    """Stop (then kill) every server this process started and has not stopped yet."""
    for srv in list(_LIVE):
        srv.stop(timeout_s=1.0)


atexit.register(stop_all)


class KVServer:
    """A running kvlab server process and its command socket. Start one with :meth:`start`
    (or several at once with :meth:`start_many`); always :meth:`stop` it (``with`` does)."""

    def __init__(self, proc: subprocess.Popen, info: dict[str, Any], stderr_path: str, startup_s: float) -> None:
        self.proc = proc
        self.info = info
        self.name: str = info["name"]
        self.control: str = info["control"]
        self.endpoint: str | None = info.get("endpoint")
        self.replay_endpoint: str | None = info.get("replay_endpoint")
        self.topic: str = info.get("topic", "")
        self.engine_config: dict[str, Any] = info.get("engine", {})
        self.startup_s = startup_s  # spawn -> ready, seconds
        self.stop_s: float | None = None
        self._stderr_path = stderr_path
        self._ids = itertools.count(1)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.control)
        _LIVE.add(self)

    # -- starting ---------------------------------------------------------------------------------
    @staticmethod
    def _spawn(
        name: str, kv_events_config: Any, engine: Mapping[str, Any] | None, env: Mapping[str, str] | None
    ) -> tuple[subprocess.Popen, str, float]:
        if isinstance(kv_events_config, KVEventsConfig):
            events_json = json.dumps(asdict(kv_events_config))
        elif isinstance(kv_events_config, str):
            events_json = json.dumps(asdict(KVEventsConfig.from_cli(kv_events_config)))
        elif isinstance(kv_events_config, Mapping):
            events_json = json.dumps(asdict(KVEventsConfig(**kv_events_config)))
        else:
            raise TypeError(f"kv_events_config must be a dict, a JSON string or a KVEventsConfig, got {type(kv_events_config).__name__}")
        _engine_config(engine)  # unknown keys raise here, before a process starts
        fd, err_path = tempfile.mkstemp(prefix=f"kvlab-{name}-", suffix=".stderr")
        cmd = [
            sys.executable,
            "-m",
            "kvlab.entrypoints.kv_server",
            "--name",
            name,
            "--kv-events-config",
            events_json,
            "--engine-config",
            json.dumps({k: v for k, v in _engine_config(engine).items() if k in (engine or {})}),
        ]
        with os.fdopen(fd, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=dict(os.environ if env is None else env)
            )
        return proc, err_path, time.perf_counter()

    @classmethod
    def _wait_ready(cls, proc: subprocess.Popen, err_path: str, t0: float, deadline: float) -> "KVServer":
        buf = b""
        assert proc.stdout is not None
        while True:
            left = deadline - time.perf_counter()
            if proc.poll() is not None:
                raise ServerDied(f"the server exited with code {proc.returncode} before it was ready:\n{_tail(err_path)}")
            if left <= 0:
                proc.kill()
                proc.wait(timeout=5)
                raise TimeoutError(f"the server was not ready within the start timeout:\n{_tail(err_path)}")
            r, _, _ = select.select([proc.stdout], [], [], min(left, 0.2))
            if r:
                chunk = os.read(proc.stdout.fileno(), 65536)
                buf += chunk
                if b"\n" in buf:
                    line = buf.split(b"\n", 1)[0].decode(errors="replace")
                    if line.startswith(READY):
                        proc.stdout.close()
                        return cls(proc, json.loads(line[len(READY) :]), err_path, time.perf_counter() - t0)
                    buf = buf.split(b"\n", 1)[1]

    @classmethod
    def start(
        cls,
        *,
        name: str = "kvlab-server",
        kv_events_config: Any = None,
        engine: Mapping[str, Any] | None = None,
        start_timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> "KVServer":
        """Start one server process and wait (at most ``start_timeout_s``) until it is ready.

        ``kv_events_config``: vLLM's ``--kv-events-config`` as a dict, JSON text or
        ``KVEventsConfig`` (default: events on, ``tcp://*:5557`` -- pass a loopback endpoint);
        ``engine``: ``num_blocks``, ``block_size``, ``hash_algo``, ``max_num_batched_tokens``,
        ``max_num_seqs``, ``autostep``, ``step_delay_s``, ``cost_model`` (CostModel fields).
        """
        return cls.start_many(
            [dict(name=name, kv_events_config=kv_events_config, engine=engine)], start_timeout_s=start_timeout_s, env=env
        )[0]

    @classmethod
    def start_many(
        cls, specs: Iterable[Mapping[str, Any]], *, start_timeout_s: float = 30.0, env: Mapping[str, str] | None = None
    ) -> list["KVServer"]:
        """Start several servers at once (each spec: ``name``, ``kv_events_config``, ``engine``),
        then wait for all; if one fails, every one started is killed and the error raised."""
        spawned: list[tuple[subprocess.Popen, str, float]] = []
        servers: list[KVServer] = []
        try:
            for spec in specs:
                events = spec.get("kv_events_config") or {"enable_kv_cache_events": True}
                spawned.append(cls._spawn(spec.get("name", "kvlab-server"), events, spec.get("engine"), env))
            deadline = time.perf_counter() + start_timeout_s
            for proc, err, t0 in spawned:
                servers.append(cls._wait_ready(proc, err, t0, deadline))
        except BaseException:
            for s in servers:
                s.stop(timeout_s=1.0)
            served = {s._stderr_path for s in servers}
            for proc, err, _ in spawned:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=5)
                if err not in served:  # its tail is in the error already; leave no file behind
                    with contextlib.suppress(OSError):
                        os.unlink(err)
            raise
        return servers

    # -- commands ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, op: str, *, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one command and wait for its reply (bounded; the process is watched)."""
        return self.wait(self.send(op, **args), op, timeout_s=timeout_s)

    def send(self, op: str, **args: Any) -> int:
        """Send a command without waiting; :meth:`wait` collects the reply. (A router sends
        ``advance`` to every replica first, so they all compute at once.)"""
        if self._sock.closed:
            raise ServerDied(f"{self.name} was stopped")
        if not self.alive:
            raise ServerDied(f"{self.name} (pid {self.proc.pid}) exited with code {self.proc.returncode}:\n{_tail(self._stderr_path)}")
        mid = next(self._ids)
        self._sock.send_multipart((b"", _enc.encode(dict(args, op=op, id=mid))))
        return mid

    def wait(self, mid: int, op: str = "command", *, timeout_s: float = 60.0) -> dict[str, Any]:
        """The reply to command ``mid`` (TimeoutError, ServerError or ServerDied otherwise)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name} did not answer {op!r} within {timeout_s} s")
            if self._sock.poll(int(min(left, 0.2) * 1000) + 1):
                frames = self._sock.recv_multipart()
                reply = _dec.decode(frames[-1])
                if reply.get("id") != mid:
                    continue  # the late answer to a command that timed out
                if not reply.get("ok"):
                    raise ServerError(f"{self.name}: {reply.get('error')}")
                return reply
            if not self.alive:
                raise ServerDied(
                    f"{self.name} (pid {self.proc.pid}) exited with code {self.proc.returncode} while "
                    f"answering {op!r}:\n{_tail(self._stderr_path)}"
                )

    def add(self, requests: Iterable[Any], **kw: Any) -> dict[str, Any]:
        """Add requests: kvlab ``Request`` s or trace entries (``TraceRequest``: their scripted
        answers, ``output_token_ids``, become the server's output for them)."""
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
            raise TypeError(f"requests must be a list of Requests or trace entries, got {type(requests).__name__}")
        return self.call("add", requests=[_request_dict(r) for r in requests], **kw)

    def advance(self, until: float, **kw: Any) -> dict[str, Any]:
        return self.call("advance", until=float(until), **kw)

    def run(self, max_steps: int | None = None, **kw: Any) -> dict[str, Any]:
        return self.call("run", max_steps=max_steps, **kw)

    def status(self, **kw: Any) -> dict[str, Any]:
        return self.call("status", **kw)

    def metrics(self, **kw: Any) -> list[dict[str, Any]]:
        keys = (
            "request_id",
            "arrival_time",
            "first_token_time",
            "finished_time",
            "num_prompt_tokens",
            "num_cached_tokens",
            "num_preemptions",
        )
        return [dict(zip(keys, row)) for row in self.call("metrics", **kw)["metrics"]]

    def reset(self, **kw: Any) -> dict[str, Any]:
        return self.call("reset", **kw)

    def configure(self, *, timeout_s: float = 60.0, **settings: Any) -> dict[str, Any]:
        """Change ``autostep`` / ``step_delay_s`` while the server runs (checked as at
        :meth:`start`: a bad value raises here and nothing is sent). The reply holds the
        status and the settings now in force."""
        return self.call("configure", timeout_s=timeout_s, **_configure_settings(settings))

    def stop(self, timeout_s: float = 5.0) -> float:
        """Ask the server to exit, wait at most ``timeout_s``, then kill it. Returns seconds."""
        t0 = time.perf_counter()
        if self.alive and not self._sock.closed:
            try:
                self.call("stop", timeout_s=timeout_s)
            except (ServerDied, ServerError, TimeoutError):
                pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if not self._sock.closed:
            self._sock.close(linger=0)
        _LIVE.discard(self)
        try:
            os.unlink(self._stderr_path)
        except OSError:
            pass
        if self.stop_s is None:
            self.stop_s = time.perf_counter() - t0
        return self.stop_s

    def kill(self) -> None:
        """Kill the process now (a crash, for tests and the dead-peer lesson)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def __enter__(self) -> "KVServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited ({self.proc.returncode})"
        return f"KVServer({self.name!r}, pid {self.proc.pid}, {state}, events -> {self.endpoint}, replay {self.replay_endpoint})"


def _request_dict(r: Any) -> dict[str, Any]:
    """A request as the command socket carries it. A trace entry brings its arrival time
    (lock-step replay) and its scripted answer; a live ``Request`` arrives "now"."""
    if not all(hasattr(r, a) for a in ("request_id", "prompt_token_ids", "max_tokens")):
        raise TypeError(f"requests must be kvlab Requests or trace entries (TraceRequest), got {type(r).__name__}")
    d = dict(
        request_id=r.request_id,
        prompt_token_ids=list(r.prompt_token_ids),
        max_tokens=r.max_tokens,
        cache_salt=r.cache_salt,
        lora_name=r.lora_name,
    )
    if not isinstance(r, Request):
        d["arrival_time"] = r.arrival_time
        out = getattr(r, "output_token_ids", None)
        if out is not None:
            d["output_token_ids"] = list(out)
    return d


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace") or "(no stderr output)"
    except OSError:
        return "(stderr not available)"


if __name__ == "__main__":
    raise SystemExit(main())
