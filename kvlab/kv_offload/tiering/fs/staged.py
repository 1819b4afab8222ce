"""The storage tier's books, run in step with kvlab's worker (lesson 12). vLLM's tier,
asynchronous, is :class:`~kvlab.kv_offload.tiering.fs.manager.FileSystemTierManager`.

One file per block under ``root_dir`` (:class:`~kvlab.kv_offload.file_mapper.FileMapper`:
vLLM 0.33's names), and the run's ``config.json`` beside them.
A lookup trusts the index only if the file is still there (vLLM's tier checks the file
system too): a file deleted behind the tier's back -- or replaced by a link, a FIFO or a
device -- is a miss, and its entry is dropped with a reason naming the file. vLLM's file
tier grows until the disk is full; kvlab gives it a capacity and the CPU tier's books (LRU), so the lessons can watch it evict (the evicted files are deleted by the worker).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from kvlab.kv_offload.base import ConfigInfoMapping, LookupResult, Medium, OffloadKey, ReqContext
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.file_mapper import FileMapper, check_disk_root
from kvlab.kv_offload.stats import OffloadingConnectorStats
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.kv_offload.tiering.fs.io import is_regular_file
from kvlab.utils.checks import check_int


class StagedFileSystemTier(CPUOffloadingManager):
    """The CPU tier's books (LRU policy, events on) over files instead of host memory: a
    file is named by its block, so no chunk can hold a stale block (no slot tracking)."""

    medium = Medium.STORAGE.value
    _tracks_slot_writes = False

    tier_type = "fs"

    def __init__(
        self, num_blocks: int, root_dir: str, *, block_size: int = 16, backpressure_detector: BackpressureDetector | None = None
    ) -> None:
        if backpressure_detector is not None and not isinstance(backpressure_detector, BackpressureDetector):
            raise TypeError(f"backpressure_detector must be None or a BackpressureDetector, got {type(backpressure_detector).__name__}")
        super().__init__(check_int("num_blocks", num_blocks, 1), enable_events=True)
        root_dir = check_disk_root(root_dir)
        self._bp_detector = backpressure_detector
        # One worker, so its bytes do not depend on a parallel split: vLLM's tier opts in to
        # the parallel-agnostic folder the same way.
        self.file_mapper = FileMapper(root_dir, tokens_per_hash=check_int("block_size", block_size, 1), parallel_agnostic=True)
        # What the folder holds, for whoever reads it later (vLLM writes it once, as here).
        config_path = self.file_mapper.get_config_file_path()
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        if not os.path.exists(config_path):
            with open(config_path, "w") as f:
                json.dump(self.file_mapper.get_run_config(), f, indent=2, sort_keys=True)

    @property
    def bp_detector(self) -> BackpressureDetector | None:
        """Decides whether a cascade to this tier is sent (None: always); see
        :mod:`kvlab.kv_offload.tiering.backpressure`."""
        return self._bp_detector

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The disk tier keeps no metrics of its own (vLLM 0.33's file-system tier neither);
        its back-pressure is reported by the tiering manager."""
        return None

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """No facts of its own: one empty series (the tiering manager adds its tier label)."""
        return [{}]

    def path_of(self, key: OffloadKey) -> str:
        return self.file_mapper.get_file_name(key)

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        result = super().lookup(key, req_context)
        if result is LookupResult.HIT and not is_regular_file(path := self.path_of(key)):
            # Gone, or something that is not a file the tier wrote (a link, a FIFO, a device).
            why = "file missing" if not os.path.lexists(path) else "not a regular file"
            self.remove([key], reason=f"{why}: {path}")
            return LookupResult.MISS
        return result
