"""Where a block's file lives (vLLM 0.33: ``vllm/v1/kv_offload/file_mapper.py``).

``<root>/<model>_<run digest>_r<rank>/<hhh>/<hh>_g<group>/<block hash hex>.bin``:

* the file is named by the block's content hash, so two engines that share ``root`` (and
  the hash function) name the same prefix with the same file -- how vLLM's file-system tier
  shares a cache across instances;
* the *run digest* is the first 12 hex digits of the SHA-256 of the run's fields (model,
  tokens per hash, blocks per file, parallel sizes, dtype, KV-cache groups, ...) as sorted
  JSON: engines whose KV bytes would differ (another dtype, another tensor-parallel split)
  never read each other's files; ``parallel_agnostic`` drops the parallel sizes and the rank
  from it, for layouts whose bytes do not depend on them;
* ``_r<rank>`` keeps each worker's share apart; the two levels of hash-prefix folders keep
  any one directory small.

``get_run_config`` is what a tier writes to ``get_config_file_path()`` so a reader can tell
what the folder holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from kvlab.kv_offload.base import OffloadKey, canonical_format_id, get_offload_block_hash, get_offload_group_idx
from kvlab.kv_offload.config import OffloadingConfig

_BASE_PATH_HASH_LEN = 12
_CONFIG_FILENAME = "config.json"


def check_disk_root(root_dir: Any) -> str:
    """A file tier's ``root_dir``: a path, and not ``""`` -- which :class:`FileMapper` accepts
    for an object store's keys, but which for files would be the disk's root."""
    if not isinstance(root_dir, (str, os.PathLike)):
        raise TypeError(f"root_dir must be a directory path, got {type(root_dir).__name__}")
    if not os.fspath(root_dir):
        raise ValueError("root_dir must not be empty: the tier's folder would land at the disk's root")
    return os.fspath(root_dir)


class FileMapper:
    """Maps offload keys to file names under ``root_dir``. kvlab's storage tier builds one
    with the defaults below (its tiny model, one worker); vLLM's tier fills every field from
    its ``OffloadingConfig``."""

    def __init__(
        self,
        root_dir: str,
        model_name: str = "kvlab",
        tokens_per_hash: int = 16,
        blocks_per_file: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        rank: int = 0,
        dtype: str = "float32",
        kv_cache_groups: list[dict[str, Any]] | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: str | None = None,
    ) -> None:
        # "" is allowed, as in vLLM: an object store's keys start at the bucket (they then
        # begin "/"). The file tiers refuse it (check_disk_root): for them it is the disk's root.
        if not isinstance(root_dir, (str, os.PathLike)):
            raise TypeError(f"root_dir must be a directory path, got {root_dir!r}")
        if not isinstance(model_name, str) or not model_name:
            raise TypeError(f"model_name must be a non-empty str, got {model_name!r}")
        if parallel_agnostic:
            tp_size = pp_size = pcp_size = dcp_size = 1
            rank = 0
        self.rank = rank
        self.fields: dict[str, Any] = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": kv_cache_groups or [],
            "inference_engine": inference_engine,
        }
        # Fields that were added later appear only when they are not the old default, so the
        # folders of runs that never set them keep their digest.
        if not parallel_agnostic:
            self.fields["parallel_agnostic"] = False
        if replicated_layout:
            self.fields["replicated_layout"] = True
        if canonical_format is not None:
            self.fields["canonical_format"] = canonical_format
        self.root_dir = os.fspath(root_dir)
        self.base_path = self._compute_base_path(self.root_dir, self.fields)

    @classmethod
    def from_offloading_spec(
        cls, root_dir: str, offloading_spec: Any, blocks_per_file: int = 1, parallel_agnostic: bool = False
    ) -> FileMapper:
        """The mapper for a spec's :class:`OffloadingConfig` (``offloading_spec.config``):
        every field from the config; parallel-agnostic only when asked *and* the layout allows
        it (a block's bytes do not depend on the split, or every worker stores the same)."""
        config = offloading_spec.config
        if not isinstance(config, OffloadingConfig):
            raise TypeError(f"offloading_spec.config must be an OffloadingConfig, got {type(config).__name__}")
        canonical_format = None
        if config.canonical_layout:  # canonical bytes are not the direct layout's: another folder
            if config.kv_cache_layout is None:
                raise ValueError("canonical_layout needs config.kv_cache_layout (the worker's KV layout names the format)")
            canonical_format = canonical_format_id(config.kv_cache_layout)
        parallel = config.parallel
        return cls(
            root_dir=root_dir,
            model_name=config.model.name,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_file=blocks_per_file,
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
            rank=parallel.rank,
            dtype=config.model.dtype,
            kv_cache_groups=[{"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)} for g in config.groups],
            parallel_agnostic=parallel_agnostic and (parallel.is_parallelism_agnostic or config.replicated_layout),
            replicated_layout=parallel_agnostic and config.replicated_layout,
            canonical_format=canonical_format,
        )

    def get_file_name(self, key: OffloadKey) -> str:
        h = get_offload_block_hash(key).hex()
        return f"{self.base_path}_r{self.rank}/{h[:3]}/{h[3:5]}_g{get_offload_group_idx(key)}/{h}.bin"

    def get_run_config(self) -> dict[str, Any]:
        return dict(self.fields)

    def get_config_file_path(self) -> str:
        return f"{self.base_path}/{_CONFIG_FILENAME}"

    @staticmethod
    def _compute_base_path(root_dir: str, fields: dict[str, Any]) -> str:
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:_BASE_PATH_HASH_LEN]
        return f"{root_dir}/{fields['model_name'].replace('/', '_')}_{digest}"
