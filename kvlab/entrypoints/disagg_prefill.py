"""Disaggregated prefill with two engines in two processes (lesson 13).

vLLM runs P/D disaggregation as two servers (``--kv-transfer-config`` with
``kv_role="kv_producer"`` and ``"kv_consumer"``) and a proxy in front: the proxy sends each
request to the prefill server with ``max_tokens=1``, then to the decode server, which loads
the prompt's KV instead of computing it (vLLM's ``examples/online_serving/disaggregated_prefill``).
kvlab does the same with two OS processes, each running its own engine on the real tiny
model, connected by an :class:`~kvlab.distributed.kv_transfer.kv_connector.v1.example_connector.ExampleConnector`
over a shared directory. :class:`DisaggregatedPrefill` is the proxy.

A process speaks JSON lines on stdin/stdout: it prints ``{"ready": ...}`` once its engine is
built, answers ``{"op": "generate", "id", "prompt", "max_tokens"}`` with the outputs and the
work done, and ``{"op": "shutdown"}`` by saving its event log and exiting. The proxy bounds
every wait (``timeout_s``) and kills both children when it leaves, even on an error.

Run one process by hand: ``python -m kvlab.entrypoints.disagg_prefill --role prefill
--storage /tmp/kv --log /tmp/p.json`` and type a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.utils.checks import check_int, check_number
from kvlab.utils.hashing import MAX_TOKEN_ID, MIN_TOKEN_ID, TOKEN_ID_WHY

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


# -- one engine process ---------------------------------------------------------------------------
def _build(role: str, storage: str, num_blocks: int, block_size: int, model_seed: int) -> Any:
    import torch

    import kvlab.kernels  # noqa: F401,I001 - sets TRITON_INTERPRET before triton is imported
    from kvlab.config.kv_transfer import KVTransferConfig
    from kvlab.engine.llm_engine import build_engine
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    model = TinyLlama(seed=model_seed)
    runner = ModelRunner(model)  # build_engine sizes it from the manager
    cfg = KVTransferConfig("ExampleConnector", kv_role=ROLES[role], kv_connector_extra_config={"shared_storage_path": storage})
    return build_engine(num_blocks=num_blocks, block_size=block_size, executor=runner, kv_transfer_config=cfg)


def serve(role: str, storage: str, log_path: str, num_blocks: int = 32, block_size: int = 16, model_seed: int = 0) -> None:
    """Run one engine process until it is told to shut down (stdin closes: the same)."""
    from kvlab.request import Request

    t0 = time.perf_counter()
    eng = _build(role, storage, num_blocks, block_size, model_seed)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "role": role, "pid": os.getpid(), "startup_s": time.perf_counter() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "shutdown":
            break
        try:
            rid = str(msg["id"])
            req = Request(rid, [int(t) for t in msg["prompt"]], max_tokens=int(msg["max_tokens"]))
            before = eng.executor.num_tokens_computed
            eng.add_request(req)
            eng.run()
            done = eng.finished[rid]
            reply = {
                "ok": True,
                "id": rid,
                "output": list(done.output_token_ids),
                "num_cached_tokens": eng.metrics[rid].num_cached_tokens,
                "num_tokens_computed": eng.executor.num_tokens_computed - before,
                "block_ids": eng.events is not None and _last_table(eng, rid),
                "kv_transfer_params": done.kv_transfer_params,
                "finish_reason": done.finish_reason,
            }
        except Exception as e:  # noqa: BLE001 - reported to the proxy, the process keeps serving
            reply = {"ok": False, "id": msg.get("id"), "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    if eng.events is not None:
        eng.events.save(log_path)
    out.write(json.dumps({"ok": True, "bye": True}) + "\n")
    out.flush()


def _last_table(eng: Any, rid: str) -> list[int]:
    """The blocks the request's prompt occupied (from the event log: it has finished)."""
    from kvlab.eventlog.events import BlocksAllocated

    return [b for e in eng.events.of_type(BlocksAllocated) if e.request_id == rid for b in e.block_ids]


# -- the proxy ---------------------------------------------------------------------------------------
def _check_prompt(name: str, prompt: Any) -> list[int]:
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids, got {type(prompt).__name__} {prompt!r:.60}")
    toks = [check_int(f"{name}[{j}]", t, MIN_TOKEN_ID, MAX_TOKEN_ID, why=TOKEN_ID_WHY) for j, t in enumerate(prompt)]
    if not toks:
        raise ValueError(f"{name} must not be empty")
    return toks


class EngineProcessError(RuntimeError):
    """An engine process died, answered with an error, or did not answer in time."""


@dataclass
class _Child:
    role: str
    proc: subprocess.Popen
    err_path: str
    buf: bytes = b""
    ready: dict[str, Any] = field(default_factory=dict)

    def stderr_tail(self) -> str:
        try:
            with open(self.err_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""


class DisaggregatedPrefill:
    """A prefill engine and a decode engine in two processes, and the proxy between them.

    ``with DisaggregatedPrefill(storage_dir) as pd: outputs = pd.generate(prompts, 8)``.
    ``pd.replies`` keeps every answer (what each engine computed, which blocks it used);
    after ``close()`` the two event logs are in ``storage_dir`` (``prefill_log.json``,
    ``decode_log.json``) for the pictures.
    """

    def __init__(
        self, storage_dir: str, *, num_blocks: int = 32, block_size: int = 16, model_seed: int = 0, timeout_s: float = 60.0
    ) -> None:
        # Checked here, in the proxy: a bad setting is named before any process starts
        # (a child given "--num-blocks x" would only die with an argparse message).
        if not isinstance(storage_dir, (str, os.PathLike)) or not os.fspath(storage_dir):
            raise TypeError(f"storage_dir must be a directory path, got {storage_dir!r}")
        num_blocks = check_int("num_blocks", num_blocks, 2)
        block_size = check_int("block_size", block_size, 1)
        model_seed = check_int("model_seed", model_seed, 0)
        timeout_s = check_number("timeout_s", timeout_s, 0, strict=True)
        if timeout_s > 600:
            raise ValueError(f"timeout_s={timeout_s!r} is out of range; timeout_s must be in (0, 600] seconds")
        self.storage_dir = os.fspath(storage_dir)
        self.kv_dir = os.path.join(self.storage_dir, "kv")
        self.num_blocks, self.block_size, self.model_seed = num_blocks, block_size, model_seed
        self.timeout_s = timeout_s
        self.children: dict[str, _Child] = {}
        self.replies: list[dict[str, Any]] = []
        self.log_paths = {r: os.path.join(self.storage_dir, f"{r}_log.json") for r in ROLES}

    def __enter__(self) -> DisaggregatedPrefill:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        os.makedirs(self.kv_dir, exist_ok=True)
        try:
            for role in ROLES:  # both start at once: their imports overlap
                err = os.path.join(self.storage_dir, f"{role}_stderr.txt")
                cmd = [
                    sys.executable,
                    "-m",
                    "kvlab.entrypoints.disagg_prefill",
                    "--role",
                    role,
                    "--storage",
                    self.kv_dir,
                    "--log",
                    self.log_paths[role],
                    "--num-blocks",
                    str(self.num_blocks),
                    "--block-size",
                    str(self.block_size),
                    "--model-seed",
                    str(self.model_seed),
                ]
                with open(err, "wb") as ef:
                    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ef)
                self.children[role] = _Child(role, proc, err)
            for child in self.children.values():
                child.ready = self._read(child)
        except BaseException:
            self.kill()
            raise

    def _read(self, child: _Child, timeout_s: float | None = None) -> dict[str, Any]:
        """One JSON line from ``child``, waiting at most ``timeout_s``."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        out = child.proc.stdout
        assert out is not None
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while b"\n" not in child.buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineProcessError(f"the {child.role} engine did not answer within {self.timeout_s:.0f} s\n{child.stderr_tail()}")
                if not sel.select(timeout=left):
                    continue
                chunk = os.read(out.fileno(), 65536)
                if not chunk:
                    code = child.proc.poll()
                    raise EngineProcessError(f"the {child.role} engine exited (code {code}) without answering\n{child.stderr_tail()}")
                child.buf += chunk
        line, child.buf = child.buf.split(b"\n", 1)
        return json.loads(line)

    def _ask(self, role: str, msg: dict[str, Any]) -> dict[str, Any]:
        child = self.children[role]
        assert child.proc.stdin is not None
        try:
            child.proc.stdin.write((json.dumps(msg) + "\n").encode())
            child.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineProcessError(f"the {role} engine is gone\n{child.stderr_tail()}") from None
        reply = self._read(child)
        if not reply.get("ok"):
            raise EngineProcessError(f"the {role} engine failed on {msg.get('id')!r}: {reply.get('error')}")
        reply["role"] = role
        self.replies.append(reply)
        return reply

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Each prompt: prefill engine (``max_tokens=1``: compute the prompt, save its KV),
        then decode engine (load the KV, generate). Returns the decode engine's outputs."""
        # Every prompt is checked before the first is sent: a bad one sends none.
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
        prompts = [_check_prompt(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
        max_tokens = check_int("max_tokens", max_tokens, 1)
        if not self.children:
            raise RuntimeError("start() the engines first (or use the object as a context manager)")
        outputs = []
        for i, prompt in enumerate(prompts):
            rid = f"req-{len(self.replies) // 2}"
            self._ask("prefill", {"op": "generate", "id": rid, "prompt": list(prompt), "max_tokens": 1})
            outputs.append(self._ask("decode", {"op": "generate", "id": rid, "prompt": list(prompt), "max_tokens": max_tokens})["output"])
        return outputs

    def close(self) -> None:
        """Ask both engines to save their logs and exit; kill whatever does not."""
        try:
            for role, child in self.children.items():
                if child.proc.poll() is None and child.proc.stdin is not None:
                    try:
                        child.proc.stdin.write(b'{"op": "shutdown"}\n')
                        child.proc.stdin.flush()
                        self._read(child, timeout_s=min(self.timeout_s, 30.0))
                    except (EngineProcessError, BrokenPipeError, OSError, ValueError):
                        pass
        finally:
            self.kill()

    def kill(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.kill()
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a kill that did not take
                pass
            for stream in (child.proc.stdin, child.proc.stdout):
                if stream is not None:
                    stream.close()
        self.children = {}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one engine process of a disaggregated prefill pair")
    ap.add_argument("--role", choices=sorted(ROLES), required=True)
    ap.add_argument("--storage", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--num-blocks", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--model-seed", type=int, default=0)
    a = ap.parse_args(argv)
    serve(a.role, a.storage, a.log, a.num_blocks, a.block_size, a.model_seed)


if __name__ == "__main__":
    main()
