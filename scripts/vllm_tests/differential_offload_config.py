"""The offloading connector's configuration, vLLM 0.33.0's and kvlab's, on the same engine
configs: ``build_offloading_config`` (groups, chunk, window reach, bytes per block, the
replicated and parallelism-agnostic layouts) and ``SchedulerOffloadConfig.from_spec`` (each
group's chunk, manager, event kind and load window; alignment, partial tails, bytes per token).

Each side runs in its own process (``--side vllm`` / ``--side kvlab``), prints its results
as JSON, and the parent compares them.

    KVLAB_VLLM_PATH=/tmp/vtw/src:/tmp/vtw/deps python scripts/vllm_tests/differential_offload_config.py

Exits 1 when a config's results differ, printing both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any


def _side(side: str) -> dict[str, Any]:
    if side == "vllm":
        import torch

        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import SchedulerOffloadConfig
        from vllm.v1 import kv_cache_interface as K
        from vllm.v1.core.kv_cache_planning import kv_cache_groups_tp_replicas
        from vllm.v1.kv_offload.base import OffloadingSpec

        f32: Any = torch.float32
    else:
        from kvlab import kv_cache_interface as K  # type: ignore[no-redef]
        from kvlab.core.kv_cache_planning import kv_cache_groups_tp_replicas  # type: ignore[no-redef]
        from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # type: ignore[no-redef]
        from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import SchedulerOffloadConfig  # type: ignore[no-redef]
        from kvlab.kv_offload.base import OffloadingSpec  # type: ignore[no-redef]

        f32 = "float32"

    class Spec(OffloadingSpec):  # type: ignore[misc,valid-type]
        def get_manager(self) -> Any:
            raise NotImplementedError

        def get_worker(self, *args: Any) -> Any:
            raise NotImplementedError

    def engine(extra: dict[str, Any], tp: int = 1, mla: bool = False, v2: bool = True, backend: str = "mp", heads: int = 4,
               retention: int | None = None) -> SimpleNamespace:  # fmt: skip
        return SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=16,
                enable_prefix_caching=True,
                prefix_match_unit=None,
                cache_dtype="auto",
                prefix_cache_retention_interval=retention,
                kv_cache_layout=None,
            ),  # fmt: skip
            model_config=SimpleNamespace(
                model="m", dtype="bfloat16", max_model_len=4096, use_mla=mla, get_total_num_kv_heads=lambda: heads
            ),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=tp,
                decode_context_parallel_size=1,
                prefill_context_parallel_size=1,
                pipeline_parallel_size=1,
                world_size=tp,
                distributed_executor_backend=backend,
                nnodes_within_dp=1,
                rank=0,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
            ),  # fmt: skip
            kv_events_config=None,
            use_v2_model_runner=v2,
            speculative_config=None,
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, engine_id="e0"),
        )

    def full(bs: int = 16) -> Any:
        return K.FullAttentionSpec(block_size=bs, num_kv_heads=4, head_size=8, dtype=f32)

    def mla() -> Any:
        return K.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=f32, max_tp_shards=1)

    def swa(window: int, bs: int = 16, **kw: Any) -> Any:
        return K.SlidingWindowSpec(block_size=bs, num_kv_heads=4, head_size=8, dtype=f32, sliding_window=window, **kw)

    def local(chunk: int) -> Any:
        return K.ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=f32, attention_chunk_size=chunk)

    def mamba() -> Any:
        return K.MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(f32,), mamba_cache_mode="align")

    def layout(specs: list[Any], tensors: bool = True) -> Any:
        groups = [K.KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
        page = max(s.page_size_bytes for s in specs)
        layers = [f"l{i}" for i in range(len(specs))]
        ts = [K.KVCacheTensor(size=page * 8 * 3, layers=layers, layer_stride=0, block_stride=page)] if tensors else []
        return K.KVCacheConfig(num_blocks=8, kv_cache_tensors=ts, kv_cache_groups=groups)

    cases = {
        "full, 64-token chunks": (engine({"block_size": 64}), layout([full()])),
        "full, 3 blocks a chunk": (engine({"blocks_per_chunk": 3}), layout([full()])),
        "full, window, local, Mamba": (engine({}), layout([full(), swa(128), local(64), mamba()])),
        "full, window, Mamba, 2 blocks a chunk, retention": (
            engine({"blocks_per_chunk": 2}, retention=64),
            layout([full(), swa(100), mamba()]),
        ),
        "window keeping 3 tokens": (engine({}), layout([full(), swa(128, extra_retained_tokens=3)])),
        "MLA, TP 4": (engine({}, tp=4, mla=True), layout([mla()])),
        "MLA, TP 4, ray": (engine({}, tp=4, mla=True, backend="ray"), layout([mla()])),
        "full, V1 runner": (engine({}, v2=False), layout([full()])),
        "full, V1 runner, TP 2": (engine({}, v2=False, tp=2, heads=8), layout([full()])),
        "full, V2 runner": (engine({}), layout([full()])),
        "canonical MLA, TP 2": (engine({"canonical_layout": True}, tp=2, mla=True, heads=1), layout([mla()])),
        "canonical full, TP 2": (engine({"canonical_layout": True}, tp=2, heads=8), layout([full()])),
        "no tensors described": (engine({}), layout([full(), swa(64)], tensors=False)),
        "32- and 16-token blocks": (engine({}), layout([full(bs=32), swa(64)])),
    }
    out: dict[str, Any] = {}
    for name, (vc, kc) in cases.items():
        par = vc.parallel_config
        kc.kv_tp_replicas = kv_cache_groups_tp_replicas(kc.kv_cache_groups, par.tensor_parallel_size, par.decode_context_parallel_size)
        try:
            oc = build_offloading_config(vc, kc)
            res = dataclasses.asdict(oc)
            res["extra_config"] = dict(oc.extra_config)
            sc = SchedulerOffloadConfig.from_spec(Spec(oc), vc, kc)
            res["scheduler"] = {k: v for k, v in sc._asdict().items() if k != "kv_group_configs"}
            res["scheduler_groups"] = [
                [
                    g.group_idx,
                    g.tokens_per_block,
                    g.tokens_per_chunk,
                    g.hashes_per_chunk,
                    g.sliding_window_size_in_chunks,
                    list(g.kv_event_group_spec),
                    g.manager_cls.__name__,
                    g.requires_cow_source,
                    g.is_eagle_group,
                    [g.load_window_size_in_chunks(n) for n in (16, 40, 100)],
                ]  # fmt: skip
                for g in sc.kv_group_configs
            ]
            res["kv_tp_replicas"] = kc.kv_tp_replicas
            out[name] = res
        except Exception as e:  # noqa: BLE001  (a refusal is a result to compare)
            out[name] = f"{type(e).__name__}: {e}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("vllm", "kvlab"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(_side(args.side), sort_keys=True, default=str))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    vllm_path = os.environ.get("KVLAB_VLLM_PATH", "")
    if not vllm_path:
        sys.exit("set KVLAB_VLLM_PATH to vLLM 0.33.0's package and its dependencies (see the docstring)")
    results = {}
    for side, path in (("vllm", vllm_path), ("kvlab", root)):
        env = dict(os.environ, PYTHONPATH=path, VLLM_TARGET_DEVICE="cpu")
        run = subprocess.run([sys.executable, __file__, "--side", side], env=env, capture_output=True, text=True, timeout=300)
        if run.returncode:
            sys.exit(f"the {side} side failed:\n{run.stderr[-3000:]}")
        results[side] = json.loads(run.stdout.strip().splitlines()[-1])
    bad = [name for name in results["vllm"] if results["vllm"][name] != results["kvlab"].get(name)]
    for name in bad:
        print(f"DIFFERS: {name}\n  vLLM:  {results['vllm'][name]}\n  kvlab: {results['kvlab'].get(name)}")
    print(f"{len(results['vllm']) - len(bad)} of {len(results['vllm'])} configs agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
