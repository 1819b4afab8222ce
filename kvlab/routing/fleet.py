"""N engine replicas in their own processes, one router, a trace: who wins (lesson 11).

:class:`Fleet` starts ``num_replicas`` kvlab servers (``kvlab.entrypoints.kv_server``),
each publishing vLLM's KV events to its own :class:`~kvlab.distributed.kv_subscriber.Subscriber`
that the router binds on loopback (the replica's ``endpoint`` is a plain host address, so by
vLLM's rule it *connects* to the router -- the way llm-d collects the streams of a fleet).
:meth:`Fleet.route` replays a trace through a routing policy in **lock step**: before each
request, every replica runs until its simulated clock reaches the request's arrival time,
the router reads every event those steps published (gaps refilled from the replay sockets),
and only then scores the replicas. Same trace, same policy -> the same decisions and numbers
on any machine, although four processes and real sockets are involved.

What it measures, per policy: the prefix-cache **hit rate** (cached / prompt tokens over all
requests, from the replicas' own metrics), **simulated TTFT** (each replica's cost-model
clock), the **load** per replica (requests, and prefill tokens really computed) and the
router's **prediction**: how many tokens it expected each request to find cached, against
what the replica found.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.distributed.kv_subscriber import Gap, Subscriber
from kvlab.entrypoints.kv_server import KVServer, _engine_config
from kvlab.routing.policies import ReplicaState, RoutingPolicy, make_policy, prompt_block_hashes
from kvlab.timeline.kv_stream import KVStream
from kvlab.utils.checks import check_int, check_number


@dataclass
class RoutedRequest:
    request_id: str
    replica: int
    arrival_time: float
    num_prompt_tokens: int
    predicted_cached_tokens: int  # from the router's index at decision time
    num_cached_tokens: int = 0  # what the replica found
    ttft: float | None = None
    group: str | None = None


@dataclass
class RoutingResult:
    """One policy on one trace. ``requests`` in arrival order; per-replica lists by index."""

    policy: str
    trace: str
    num_replicas: int
    requests: list[RoutedRequest]
    replica_names: list[str]
    wall_s: float = 0.0
    gaps: list[Gap] = field(default_factory=list)
    streams: list[KVStream] | None = None

    @property
    def hit_rate(self) -> float:
        p = sum(r.num_prompt_tokens for r in self.requests)
        return sum(r.num_cached_tokens for r in self.requests) / p if p else 0.0

    def _ttfts(self) -> list[float]:
        return sorted(r.ttft for r in self.requests if r.ttft is not None)

    @property
    def ttft_mean(self) -> float:
        t = self._ttfts()
        return statistics.fmean(t) if t else float("nan")

    def ttft_percentile(self, q: float) -> float:
        t = self._ttfts()
        if not t:
            return float("nan")
        k = (len(t) - 1) * q / 100
        lo = int(k)
        return t[lo] + (t[min(lo + 1, len(t) - 1)] - t[lo]) * (k - lo)

    @property
    def requests_per_replica(self) -> list[int]:
        n = [0] * self.num_replicas
        for r in self.requests:
            n[r.replica] += 1
        return n

    @property
    def prefill_per_replica(self) -> list[int]:
        """Prompt tokens each replica really computed (prompt - cached): its prefill work."""
        n = [0] * self.num_replicas
        for r in self.requests:
            n[r.replica] += r.num_prompt_tokens - r.num_cached_tokens
        return n

    @property
    def imbalance(self) -> float:
        """Busiest replica's prefill work / the mean (1.0 = perfectly even)."""
        w = self.prefill_per_replica
        m = statistics.fmean(w) if w else 0.0
        return max(w) / m if m else 1.0

    @property
    def prediction_exact(self) -> float:
        """Share of requests whose cached tokens the router predicted exactly."""
        return sum(r.predicted_cached_tokens == r.num_cached_tokens for r in self.requests) / max(1, len(self.requests))

    def row(self) -> dict[str, Any]:
        """The table row the bench and lesson 11 print."""
        return dict(
            trace=self.trace,
            policy=self.policy,
            hit_rate=self.hit_rate,
            ttft_mean=self.ttft_mean,
            ttft_p50=self.ttft_percentile(50),
            ttft_p90=self.ttft_percentile(90),
            requests_per_replica=self.requests_per_replica,
            prefill_per_replica=self.prefill_per_replica,
            imbalance=self.imbalance,
            prediction_exact=self.prediction_exact,
        )

    def __repr__(self) -> str:
        return (
            f"RoutingResult({self.policy} on {self.trace}: hit {self.hit_rate:.1%}, TTFT mean {self.ttft_mean * 1e3:.0f} ms, "
            f"requests/replica {self.requests_per_replica})"
        )


def format_table(results: Iterable[RoutingResult]) -> str:
    """The routing table: one line per (trace, policy)."""
    lines = [
        f"{'trace':12} {'policy':20} {'hit rate':>8} {'TTFT mean':>9} {'p50':>7} {'p90':>7} {'prefill imbalance':>17}  requests per replica"
    ]
    for r in results:
        lines.append(
            f"{r.trace:12} {r.policy:20} {r.hit_rate:>8.1%} {r.ttft_mean * 1e3:>6.0f} ms {r.ttft_percentile(50) * 1e3:>4.0f} ms "
            f"{r.ttft_percentile(90) * 1e3:>4.0f} ms {r.imbalance:>16.2f}x  {r.requests_per_replica}"
        )
    return "\n".join(lines)


class Fleet:
    """``Fleet(num_replicas, engine={...})``: start the replicas (each a process) and the
    router's subscribers; :meth:`route` a trace under a policy; :meth:`stop` (or ``with``).

    ``engine``: the replicas' settings (``kvlab.entrypoints.kv_server.ENGINE_DEFAULTS``);
    ``keep_streams``: keep each replica's stream as a ``KVStream`` in the results (for the
    views); ``env``: the replicas' environment (default: this process's -- with another
    ``PYTHONHASHSEED`` their chain roots differ from the router's, lesson 11).
    """

    def __init__(
        self,
        num_replicas: int = 4,
        *,
        engine: Mapping[str, Any] | None = None,
        buffer_steps: int = 10_000,
        sync_timeout_s: float = 2.0,
        start_timeout_s: float = 60.0,
        keep_streams: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        # Everything is checked before a socket opens or a process starts.
        self.num_replicas = check_int("num_replicas", num_replicas, 1, 16)
        self.sync_timeout_s = check_number("sync_timeout_s", sync_timeout_s, 0, strict=True)
        buffer_steps = check_int("buffer_steps", buffer_steps, 1)
        start_timeout_s = check_number("start_timeout_s", start_timeout_s, 0, strict=True)
        if not isinstance(keep_streams, bool):
            raise TypeError(f"keep_streams must be True or False, got {keep_streams!r}")
        if env is not None and (not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise TypeError(f"env must be None or a dict of str to str (the replicas' environment), got {type(env).__name__}")
        self.keep_streams = keep_streams
        full = _engine_config(engine)  # TypeError/ValueError naming engine['key']
        self.engine = {k: full[k] for k in (engine or {})}  # plain values (numpy ints made int)
        self.block_size: int = int(self.engine.get("block_size", 16))
        self.hash_algo: str = str(self.engine.get("hash_algo", "sha256_cbor"))
        self.names = [f"replica-{i}" for i in range(self.num_replicas)]
        self.subscribers: list[Subscriber] = []
        self.servers: list[KVServer] = []
        self._used = False
        t0 = time.perf_counter()
        try:
            for name in self.names:
                self.subscribers.append(Subscriber("tcp://127.0.0.1:0", topic=f"kv@{name}", bind=True, catch_up=True))
            specs = [
                dict(
                    name=name,
                    engine=self.engine,
                    kv_events_config=dict(
                        enable_kv_cache_events=True,
                        publisher="zmq",
                        endpoint=sub.endpoint,
                        replay_endpoint="tcp://127.0.0.1:0",
                        topic=f"kv@{name}",
                        buffer_steps=buffer_steps,
                    ),
                )
                for name, sub in zip(self.names, self.subscribers)
            ]
            self.servers = KVServer.start_many(specs, start_timeout_s=start_timeout_s, env=env)
            for sub, srv in zip(self.subscribers, self.servers):
                sub.replay_endpoint = srv.replay_endpoint
                sub.poll(0.01)  # a bound SUB attaches a connecting publisher only inside a call
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0  # all replicas, started at once
        self.replica_startup_s = [s.startup_s for s in self.servers]

    # -- the lock-step loop -------------------------------------------------------------------
    def _broadcast(self, op: str, **args: Any) -> list[dict[str, Any]]:
        mids = [srv.send(op, **args) for srv in self.servers]
        return [srv.wait(mid, op, timeout_s=120.0) for srv, mid in zip(self.servers, mids)]

    def _sync(self, states: Sequence[ReplicaState], statuses: Sequence[Mapping[str, Any]], streams: list[KVStream] | None) -> None:
        """Read every replica's events up to what it reported published; update indexes."""
        for i, (sub, st, status) in enumerate(zip(self.subscribers, states, statuses)):
            st.load = int(status["num_unfinished"])
            last = sub.last_seq if sub.last_seq is not None else -1
            target = int(status["published"]) - 1
            if target <= last:
                continue
            for seq, batch in sub.receive(self.sync_timeout_s, until_seq=target):
                st.index.apply(batch)
                if streams is not None:
                    streams[i].append(seq, batch)
            if (sub.last_seq if sub.last_seq is not None else -1) < target:
                raise RuntimeError(
                    f"{self.names[i]}: the router's stream stopped at seq {sub.last_seq}, the replica published "
                    f"up to {target}; the missing batches are not in its replay buffer"
                )

    def route(
        self, trace: Sequence[Any], policy: str | RoutingPolicy, *, name: str | None = None, router_hash_algo: str | None = None
    ) -> RoutingResult:
        """Replay ``trace`` (arrival order) through ``policy``; return the measurements.

        ``router_hash_algo`` lets the router hash prompts differently from the replicas
        (lesson 11's broken router): by default it is the replicas' own algorithm.
        """
        pol = make_policy(policy)
        t0 = time.perf_counter()
        if self._used:
            self._broadcast("run")
            self._sync(self._states_for_reset(), self._broadcast("reset"), None)
        self._used = True
        states = [ReplicaState(n) for n in self.names]
        streams = [KVStream(name=n) for n in self.names] if self.keep_streams else None
        for sub in self.subscribers:
            sub.gaps.clear()
        reqs = sorted(trace, key=lambda r: r.arrival_time)
        routed: list[RoutedRequest] = []
        algo = router_hash_algo or self.hash_algo
        bs = self.block_size
        for r in reqs:
            self._sync(states, self._broadcast("advance", until=float(r.arrival_time)), streams)
            hashes = prompt_block_hashes(r.prompt_token_ids, bs, hash_algo=algo, cache_salt=r.cache_salt, lora_name=r.lora_name)
            i = check_int(f"the replica index policy {pol.name!r} chose", pol.choose(r, hashes, states), 0, len(states) - 1)
            hit = min(states[i].cached_prefix_blocks(hashes), (len(r.prompt_token_ids) - 1) // bs)
            self.servers[i].add([r])
            states[i].num_routed += 1
            states[i].load += 1
            routed.append(
                RoutedRequest(r.request_id, i, float(r.arrival_time), len(r.prompt_token_ids), hit * bs, group=getattr(r, "group", None))
            )
        self._sync(states, self._broadcast("run"), streams)
        by_id = {x.request_id: x for x in routed}
        for srv in self.servers:
            for m in srv.metrics():
                x = by_id.get(m["request_id"])
                if x is not None:
                    x.num_cached_tokens = int(m["num_cached_tokens"])
                    if m["first_token_time"] is not None:
                        x.ttft = float(m["first_token_time"]) - float(m["arrival_time"])
        gaps = [g for sub in self.subscribers for g in sub.gaps]
        trace_name = name if name else getattr(trace, "kind", "trace")
        return RoutingResult(pol.name, trace_name, self.num_replicas, routed, list(self.names), time.perf_counter() - t0, gaps, streams)

    def _states_for_reset(self) -> list[ReplicaState]:
        return [ReplicaState(n) for n in self.names]

    # -- stopping -------------------------------------------------------------------------------
    def stop(self) -> float:
        """Stop every replica (bounded) and close the router's sockets; returns seconds."""
        t0 = time.perf_counter()
        for srv in self.servers:
            srv.stop(timeout_s=5.0)
        for sub in self.subscribers:
            sub.close()
        self.stop_s = time.perf_counter() - t0
        return self.stop_s

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        alive = sum(s.alive for s in self.servers)
        return f"Fleet({self.num_replicas} replicas, {alive} alive, block_size={self.block_size}, hash={self.hash_algo})"


def compare(
    traces: Mapping[str, Sequence[Any]],
    policies: Sequence[str | RoutingPolicy | type],
    *,
    num_replicas: int = 4,
    engine: Mapping[str, Any] | None = None,
    fleet: Fleet | None = None,
) -> list[RoutingResult]:
    """Every policy on every trace, on one fleet (started here unless given). A policy may
    be a name, or a class or factory (called for a fresh instance per trace)."""
    own = fleet is None
    f = fleet or Fleet(num_replicas, engine=engine)
    try:
        out = []
        for tname, trace in traces.items():
            for p in policies:
                pol = p() if isinstance(p, type) or (callable(p) and not hasattr(p, "choose")) else p
                out.append(f.route(trace, pol, name=tname))
        return out
    finally:
        if own:
            f.stop()


# --- the experiment of lesson 11 and `python -m kvlab.bench routing` -------------------------------
STANDARD_ENGINE: dict[str, Any] = dict(num_blocks=128, block_size=16)  # 2,048 tokens of KV per replica
STANDARD_REPLICAS = 4


def standard_traces(seed: int = 0) -> dict[str, Any]:
    """The two workloads the routing table compares policies on: 8 tenants sharing 4 popular
    256-token prefixes (200 requests at 8/s), and 24 six-turn chats (conversations start at
    2/s; each turn resends the whole history)."""
    from kvlab.workloads.traces import multi_tenant, multi_turn

    return {"multi-tenant": multi_tenant(8, 200, seed, rate=8.0), "multi-turn": multi_turn(24, 6, seed, rate=2.0)}


def standard_policies() -> list[Any]:
    """Round-robin, least-loaded, KV-aware (prefix only) and KV-aware with a load term."""
    from kvlab.routing.policies import KVAware, LeastLoaded, RoundRobin

    return [RoundRobin, LeastLoaded, KVAware, lambda: KVAware(load_weight=2.0)]


__all__ = [
    "STANDARD_ENGINE",
    "STANDARD_REPLICAS",
    "Fleet",
    "RoutedRequest",
    "RoutingResult",
    "compare",
    "format_table",
    "standard_policies",
    "standard_traces",
]
