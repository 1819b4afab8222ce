"""A connector backed by files: one engine saves a prompt's KV, another loads it (vLLM:
``ExampleConnector`` in ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``,
the "shared storage" example; lesson 13).

**Disaggregated prefill** splits serving in two: a *prefill* engine computes each prompt
once and hands its KV over; a *decode* engine receives it and only generates. vLLM's
production connectors hand KV over GPU to GPU (NIXL, Mooncake, LMCache); this one -- like
vLLM's example -- goes through a shared directory, which is enough to see every hook:

* producer (``kv_role="kv_producer"``, the prefill engine): when a request's prompt has been
  computed, ``build_connector_meta`` plans a save; the worker's ``save_kv_layer`` gathers the
  prompt's keys and values from each layer's paged cache (through the request's block
  table: slot = block id × block size + offset) into ``<dir>/<prompt hash>/layers.<i>.kv``,
  and ``wait_for_save`` writes ``meta.json`` last -- a folder without it is not complete.
* consumer (``kv_role="kv_consumer"``, the decode engine): ``get_num_new_matched_tokens``
  finds the folder of the same prompt and offers every prompt token but the last as
  external computed tokens (the decode engine recomputes the last one to sample, as vLLM's
  P/D connectors do); ``start_load_kv`` scatters the saved rows into whatever blocks this
  engine gave the request. The decode engine never computes the rest of the prompt.

vLLM's example names a folder by the prompt tokens only and loads whole blocks up to the
last token; kvlab also loads the partial last block (like the P/D connectors), so the two
engines' outputs can be compared token for token. Files carry kvlab's checked format: a
missing or corrupt layer file is a load failure, recomputed by the decode engine.

``kv_connector_extra_config={"load_async_steps": k}`` (kvlab's, k >= 1) makes the consumer's
loads asynchronous, as a P/D connector's transfers are: the request gets its blocks and waits
(``WAITING_FOR_REMOTE_KVS``) while the other requests run; the worker reads the files when
the step starts and reports the load received at the end of the ``k``-th step, counting
that one (``get_finished``), standing in for a transfer that takes that long.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvlab.kv_offload.tiering.fs.io import read_block_file, write_block_file
from kvlab.utils.checks import check_int
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvlab.core.sched.output import SchedulerOutput
    from kvlab.request import Request

MANIFEST = "meta.json"


def prompt_folder_name(token_ids: list[int], mm_hashes: list[str]) -> str:
    """The folder of a prompt's KV: SHA-256 of its token ids (int32 little-endian) and item hashes."""
    h = hashlib.sha256(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    for m in mm_hashes:
        h.update(b"\x00" + m.encode())
    return h.hexdigest()


@dataclass(slots=True)
class ReqMeta:
    """Move tokens ``[start, end)`` of ``req_id`` between its blocks and ``folder``."""

    req_id: str
    folder: str
    block_ids: list[int]
    start: int
    end: int
    is_store: bool
    token_ids: list[int] = field(default_factory=list)

    def slots(self, block_size: int) -> list[int]:
        return [self.block_ids[p // block_size] * block_size + p % block_size for p in range(self.start, self.end)]


@dataclass(slots=True)
class ExampleConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)
    block_size: int = 16


@dataclass(slots=True)
class ExampleWorkerReport:
    errors: dict[str, str] = field(default_factory=dict)  # req id -> what failed
    num_loaded_tokens: dict[str, int] = field(default_factory=dict)
    num_stored_tokens: dict[str, int] = field(default_factory=dict)


class ExampleConnector(KVConnectorBase_V1):
    def __init__(
        self, role: KVConnectorRole, block_size: int, extra_config: dict[str, Any] | None = None, kv_role: str = "kv_both"
    ) -> None:
        super().__init__(role)
        cfg = dict(extra_config or {})
        unknown = set(cfg) - {"shared_storage_path", "load_async_steps"}
        if unknown:
            raise ValueError(
                f"ExampleConnector: unknown extra config {sorted(unknown)}; known: ['load_async_steps', 'shared_storage_path']"
            )
        self.load_async_steps = check_int(
            "kv_connector_extra_config['load_async_steps']", cfg.get("load_async_steps", 0), 0, why=" (0: load within the step)"
        )
        path = cfg.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise TypeError(f"ExampleConnector needs kv_connector_extra_config={{'shared_storage_path': <dir>}}, got {path!r}")
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}")
        self.block_size = check_int("block_size", block_size, 1)
        self.storage_path = path
        self.kv_role = kv_role
        os.makedirs(path, exist_ok=True)
        # scheduler side
        self._loads: dict[str, ReqMeta] = {}
        self._saved: set[str] = set()  # folders this engine planned to write
        self._local: dict[str, int] = {}
        self._prompts: dict[str, tuple[list[int], list[str]]] = {}  # req id -> (prompt, item hashes)
        self._failed: set[str] = set()  # requests whose load failed: not offered the folder again
        self.events: Any = None
        # worker side
        self.kv_caches: list[Any] = []
        self._report = ExampleWorkerReport()
        self._invalid: set[int] = set()
        self._recving: dict[str, int] = {}  # asynchronous loads read: request id -> steps until reported
        self.before_layer_io: Any = None  # (direction, layer, path) -> None; raise to fail a transfer

    def folder_of(self, request: Request) -> str:
        return self._folder(list(request.prompt_token_ids), [f.identifier for f in request.mm_features])

    def _folder(self, prompt: list[int], mm_hashes: list[str]) -> str:
        return os.path.join(self.storage_path, prompt_folder_name(prompt, mm_hashes))

    # ==============================  scheduler side  ==============================
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._check_role(KVConnectorRole.SCHEDULER, "bind_kv_cache_manager")
        groups = kv_cache_manager.kv_cache_groups
        if len(groups) != 1 or getattr(groups[0], "type_name", "full") != "full" or groups[0].block_size != self.block_size:
            raise ValueError(f"the example connector needs one full-attention group of block_size={self.block_size}")
        super().bind_kv_cache_manager(kv_cache_manager)
        self.events = kv_cache_manager.events

    def _saved_tokens(self, request: Request) -> int:
        """How many of this prompt's tokens a complete folder holds (0 if none)."""
        folder = self.folder_of(request)
        try:
            with open(os.path.join(folder, MANIFEST)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return 0
        if meta.get("token_ids") != list(request.prompt_token_ids) or meta.get("block_size") != self.block_size:
            return 0  # another prompt under a colliding name, or another layout: not ours
        return int(meta.get("num_tokens", 0))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._check_role(KVConnectorRole.SCHEDULER, "get_num_new_matched_tokens")
        if (
            self.kv_role == "kv_producer"
            or request.num_preemptions
            or request.num_tokens != request.num_prompt_tokens
            or request.request_id in self._failed
        ):
            return 0, False
        n = self.external_tokens(self._saved_tokens(request), request.num_prompt_tokens, num_computed_tokens)
        self._local[request.request_id] = num_computed_tokens
        return n, n > 0 and self.load_async_steps > 0

    def external_tokens(self, saved_tokens: int, num_prompt_tokens: int, num_computed_tokens: int) -> int:
        """Tokens to take from a folder holding ``saved_tokens``, after a local hit of
        ``num_computed_tokens``: every saved prompt token but the last (the engine computes
        it to sample), beyond the hit. (The ``num_matched_tokens`` exercise swaps this.)"""
        return max(0, min(saved_tokens, num_prompt_tokens - 1) - num_computed_tokens)

    def slots_of(self, rm: ReqMeta, block_size: int) -> list[int]:
        """The cache slots of tokens ``[rm.start, rm.end)`` through the request's table.
        (The ``token_slots`` exercise swaps this.)"""
        return rm.slots(block_size)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        start = self._local.pop(request.request_id, 0)
        row = [b.block_id for b in blocks.blocks[0]]
        meta = ReqMeta(request.request_id, self.folder_of(request), row, start, start + num_external_tokens, is_store=False)
        self._loads[request.request_id] = meta
        if self.events is not None:
            bs = self.block_size
            ids = row[start // bs : cdiv(meta.end, bs)]
            self.events.record(
                "kv_transfer",
                direction="load",
                request_id=request.request_id,
                media=["FILE"] * len(ids),
                block_ids=ids,
                paths=[meta.folder],
                num_tokens=num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        self._check_role(KVConnectorRole.SCHEDULER, "build_connector_meta")
        meta = ExampleConnectorMetadata(requests=list(self._loads.values()), block_size=self.block_size)
        self._loads = {}
        if self.kv_role == "kv_consumer" or self._kv_cache_manager is None:
            return meta
        mgr = self._kv_cache_manager
        for nr in scheduler_output.scheduled_new_reqs:
            self._prompts[nr.req_id] = (list(nr.prompt_token_ids or ()), [f.identifier for f in nr.mm_features])
        computed = {nr.req_id: nr.num_computed_tokens for nr in scheduler_output.scheduled_new_reqs}
        computed.update(zip(scheduler_output.scheduled_cached_reqs.req_ids, scheduler_output.scheduled_cached_reqs.num_computed_tokens))
        bs = self.block_size
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            before = computed[rid]
            prompt, mm_hashes = self._prompts[rid]
            p = len(prompt)
            if not before < p <= before + n:
                continue  # the prompt is not completed in this step
            folder = self._folder(prompt, mm_hashes)
            if folder in self._saved or os.path.exists(os.path.join(folder, MANIFEST)):
                continue  # saved already (vLLM's example skips a prompt it finds)
            self._saved.add(folder)
            row = mgr.get_block_ids(rid)[0]
            meta.requests.append(ReqMeta(rid, folder, row, 0, p, is_store=True, token_ids=list(prompt)))
            if self.events is not None:
                ids = row[: cdiv(p, bs)]
                self.events.record(
                    "kv_transfer", direction="store", request_id=rid, media=["FILE"] * len(ids), block_ids=ids, paths=[folder], num_tokens=p
                )
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """The worker's report: a request whose load failed is not offered its folder again
        (an asynchronous load that failed sends it back to the prefix lookup, which would ask
        again, and the same broken folder would fail forever)."""
        self._failed.update(getattr(connector_output, "errors", None) or {})

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._failed.discard(request.request_id)
        self._local.pop(request.request_id, None)
        self._prompts.pop(request.request_id, None)
        if self.kv_role == "kv_consumer":
            return False, None
        # A prefill engine answers with where the decode engine finds the KV (vLLM's
        # kv_transfer_params; a P/D proxy forwards them).
        return False, {
            "shared_storage_path": self.storage_path,
            "folder": os.path.basename(self.folder_of(request)),
            "num_tokens": request.num_prompt_tokens,
        }

    # ==============================  worker side  ==============================
    def register_kv_caches(self, kv_caches: Any) -> None:
        self._check_role(KVConnectorRole.WORKER, "register_kv_caches")
        # vLLM's {layer name: cache} (kvlab's runner: "layers.{i}", in layer order) or a list
        self.kv_caches = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)

    def _layer_path(self, folder: str, layer: int) -> str:
        return os.path.join(folder, f"layers.{layer}.kv")

    def _key(self, folder: str, layer: int) -> bytes:
        return f"{os.path.basename(folder)}/layers.{layer}".encode()

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        self._report, self._invalid = ExampleWorkerReport(), set()
        bs = meta.block_size
        for rm in meta.requests:
            if rm.is_store:
                continue
            slots = self.slots_of(rm, bs)
            try:
                for layer, kv in enumerate(self.kv_caches):
                    path = self._layer_path(rm.folder, layer)
                    if self.before_layer_io is not None:
                        self.before_layer_io("load", layer, path)
                    data = self._read_layer(path, rm, layer, kv)
                    blocks = [s // bs for s in slots]
                    offsets = [s % bs for s in slots]
                    kv[blocks, :, offsets] = data[rm.start : rm.end].to(kv.device)
            except Exception as e:  # noqa: BLE001 - a failed load is reported, the blocks recomputed
                self._report.errors[rm.req_id] = f"{type(e).__name__}: {e}"
                self._invalid.update(rm.block_ids[rm.start // bs : cdiv(rm.end, bs)])
            else:
                self._report.num_loaded_tokens["FILE"] = self._report.num_loaded_tokens.get("FILE", 0) + rm.end - rm.start
            if self.load_async_steps:
                self._recving[rm.req_id] = self.load_async_steps  # reported then, failed or not

    def _read_layer(self, path: str, rm: ReqMeta, layer: int, kv: Any) -> Any:
        import torch

        row = kv[0, :, 0]  # one token's [2, kv_heads, head_dim]
        nbytes = rm.end * row.numel() * row.element_size()
        # The file may hold more tokens than we load (the whole prompt): read its length first.
        raw = read_block_file(path, self._key(rm.folder, layer), _payload_len(path, nbytes, row.numel() * row.element_size()))
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kv.dtype).view(-1, *row.shape)
        if data.shape[0] < rm.end:
            raise ValueError(f"{path} holds {data.shape[0]} tokens, {rm.end} are needed")
        return data

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        layer = int(layer_name.rsplit(".", 1)[1])
        bs = meta.block_size
        for rm in meta.requests:
            if not rm.is_store or rm.req_id in self._report.errors:
                continue
            slots = self.slots_of(rm, bs)
            path = self._layer_path(rm.folder, layer)
            try:
                if self.before_layer_io is not None:
                    self.before_layer_io("store", layer, path)
                data = kv_layer[[s // bs for s in slots], :, [s % bs for s in slots]].contiguous().cpu()
                import torch

                write_block_file(path, self._key(rm.folder, layer), data.view(torch.uint8).numpy().tobytes())
            except Exception as e:  # noqa: BLE001 - a failed save: the decode engine will find no folder
                self._report.errors[rm.req_id] = f"{type(e).__name__}: {e}"

    def wait_for_save(self, skip_req_ids: AbstractSet[str] = frozenset()) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        for rm in meta.requests:
            if not rm.is_store or rm.req_id in skip_req_ids or rm.req_id in self._report.errors:
                continue
            manifest = {"token_ids": rm.token_ids, "num_tokens": rm.end, "block_size": meta.block_size, "num_layers": len(self.kv_caches)}
            os.makedirs(rm.folder, exist_ok=True)
            tmp = os.path.join(rm.folder, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f)
            os.replace(tmp, os.path.join(rm.folder, MANIFEST))  # the folder is complete from now on
            self._report.num_stored_tokens["FILE"] = self._report.num_stored_tokens.get("FILE", 0) + rm.end

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._invalid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads whose time has come (one step less for each call, once a
        step). A failed one is reported too: its blocks were named invalid when it ran."""
        done = set()
        for rid in list(self._recving):
            self._recving[rid] -= 1
            if self._recving[rid] <= 0:
                del self._recving[rid]
                done.add(rid)
        return None, done

    def build_connector_worker_meta(self) -> ExampleWorkerReport:
        report, self._report = self._report, ExampleWorkerReport()
        return report


def _payload_len(path: str, at_least: int, row_bytes: int) -> int:
    """The payload length a layer file declares (so a file holding the whole prompt can be
    read when only a prefix of it is loaded); read_block_file checks it against the file."""
    import struct

    from kvlab.kv_offload.tiering.fs.io import MAGIC, TierFileError

    try:
        with open(path, "rb") as f:
            head = f.read(10)
            if len(head) < 10 or head[:8] != MAGIC:
                raise TierFileError(path, "not a kvlab block file (bad magic)")
            (klen,) = struct.unpack("<H", head[8:10])
            f.seek(10 + klen)
            (length,) = struct.unpack("<Q", f.read(8))
    except FileNotFoundError:
        raise TierFileError(path, "missing") from None
    except struct.error:
        raise TierFileError(path, "truncated header") from None
    if length < at_least or length % row_bytes:
        raise TierFileError(path, f"declares {length} bytes, needs at least {at_least} in rows of {row_bytes}")
    return length
