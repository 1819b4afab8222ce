"""How an executor drives the worker half of a KV connector (vLLM:
``vllm/v1/worker/kv_connector_model_runner_mixin.py``; lessons 12-13).

Around every step: bind the scheduler's metadata, ``start_load_kv()`` (kvlab's loads finish
there), run the forward pass -- ``wait_for_layer_load`` / ``save_kv_layer`` around each
layer -- then ``wait_for_save()``, collect the report into a :class:`KVConnectorOutput` and
unbind. A request whose computed prefix holds a block that failed to load sits the forward
pass out (its KV is not there); the scheduler cuts its computed tokens back to that block,
and it recomputes from there the next step. Torch-free: the simulated executor uses it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvlab.distributed.kv_transfer.kv_connector.v1.base import layer_name
from kvlab.outputs import KVConnectorOutput
from kvlab.utils.math_utils import cdiv


def requests_with_invalid_blocks(rows: Iterable[tuple[str, list[int], int]], invalid: set[int], block_size: int) -> set[str]:
    """Ids of requests (``(req_id, block_table_row, num_computed_tokens_before_the_step)``)
    whose computed prefix holds an invalid block -- the same rule as the scheduler's."""
    out: set[str] = set()
    if not invalid:
        return out
    for rid, row, num_computed in rows:
        n = cdiv(num_computed, block_size)
        if any(b in invalid for b in row[:n]):
            out.add(rid)
    return out


def kv_caches_by_layer(kv_caches: Any) -> dict[str, Any]:
    """The runner's per-layer caches as vLLM's runner registers them with a connector:
    ``{layer name: cache}``, layer ``i`` named ``"layers.{i}"`` (:func:`layer_name`). A
    connector that copies a layer's bytes finds it by the name its ``kv_cache_config``
    gives (vLLM's spec-built offloading worker); kvlab's own connectors read the values in
    layer order. A dict is passed as it is."""
    if isinstance(kv_caches, Mapping):
        return dict(kv_caches)
    return {layer_name(i): cache for i, cache in enumerate(kv_caches)}


class KVConnectorModelRunnerMixin:
    kv_connector: Any = None
    _kv_connector_output: KVConnectorOutput | None = None

    def register_kv_connector(self, connector: Any, kv_caches: Any = ()) -> None:
        """Attach the worker half of a connector and show it the paged caches (``None``: they
        do not exist yet, and the executor shows them when it allocates them). A list of
        per-layer caches is shown in vLLM's form, ``{layer name: cache}``
        (:func:`kv_caches_by_layer`)."""
        role = getattr(getattr(connector, "role", None), "name", None)
        if role != "WORKER":
            raise ValueError(f"the executor needs the connector's worker half (role=KVConnectorRole.WORKER), got role {role}")
        if kv_caches is not None:
            connector.register_kv_caches(kv_caches_by_layer(kv_caches))
        self.kv_connector = connector

    def _kv_connector_start(self, scheduler_output: Any) -> set[int]:
        """Bind the metadata and run the loads; returns the block ids that failed."""
        conn = self.kv_connector
        if conn is None or scheduler_output.kv_connector_metadata is None:
            return set()
        conn.handle_preemptions(scheduler_output.kv_connector_metadata)  # before the step's metadata is bound (vLLM 0.33)
        conn.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        conn.start_load_kv()
        return set(conn.get_block_ids_with_load_errors())

    def _kv_connector_finish(self, scheduler_output: Any, invalid: set[int], skipped: set[str]) -> None:
        conn = self.kv_connector
        if conn is None or scheduler_output.kv_connector_metadata is None:
            return
        conn.wait_for_save(skip_req_ids=frozenset(skipped))
        # vLLM 0.33's order: the transfer results first -- a worker that marks a job done
        # when it sees it finish (the spec-built offloading worker) reports it in this very
        # step's metadata, not the next one's.
        done = conn.get_transfer_results(set(scheduler_output.finished_req_ids))
        meta = conn.build_connector_worker_meta()
        self._kv_connector_output = KVConnectorOutput(
            finished_sending=set(done.finished_sending),
            finished_recving=set(done.finished_recving),
            failed_recving=set(done.failed_recving),
            invalid_block_ids=set(invalid),
            worker_meta=meta,
            num_loaded_tokens=dict(getattr(meta, "num_loaded_tokens", {}) or {}),
            num_stored_tokens=dict(getattr(meta, "num_stored_tokens", {}) or {}),
            errors=dict(getattr(meta, "errors", {}) or {}),
        )
        conn.clear_connector_metadata()

    def _kv_layer_hooks(self, scheduler_output: Any, attn_metadata: Any) -> "_LayerHooks | None":
        """Per-layer hooks for the forward pass, or None without a connector this step."""
        conn = self.kv_connector
        if conn is None or scheduler_output.kv_connector_metadata is None:
            return None
        return _LayerHooks(conn, attn_metadata)

    def take_kv_connector_output(self) -> KVConnectorOutput | None:
        """This step's connector report, once (the engine hands it to the scheduler)."""
        out, self._kv_connector_output = self._kv_connector_output, None
        return out


class _LayerHooks:
    """What the model calls around each layer: wait for its KV to be loaded before
    attention reads the cache, offer it for saving after the layer wrote it."""

    __slots__ = ("conn", "attn_metadata")

    def __init__(self, conn: Any, attn_metadata: Any) -> None:
        self.conn, self.attn_metadata = conn, attn_metadata

    def before(self, layer_idx: int) -> None:
        self.conn.wait_for_layer_load(layer_name(layer_idx))

    def after(self, layer_idx: int, kv_layer: Any) -> None:
        self.conn.save_kv_layer(layer_name(layer_idx), kv_layer, self.attn_metadata)
