"""Where a block's file lives (vLLM: ``vllm/v1/kv_offload/file_mapper.py``).

``<root>/<first two hex digits>/<block hash hex>_g<group>.bin``: the name is the block's
content hash, so two engines that share ``root`` (and hash function) name the same prefix
with the same file -- how vLLM's file-system tier shares a cache across instances. The
two-digit subdirectory keeps any one directory small.
"""

from __future__ import annotations

import os

from kvlab.kv_offload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx


class FileMapper:
    def __init__(self, root_dir: str) -> None:
        if not isinstance(root_dir, (str, os.PathLike)) or not str(root_dir):
            raise TypeError(f"root_dir must be a directory path, got {root_dir!r}")
        self.root_dir = os.fspath(root_dir)

    def get_file_name(self, key: OffloadKey) -> str:
        h = get_offload_block_hash(key).hex()
        return os.path.join(self.root_dir, h[:2], f"{h}_g{get_offload_group_idx(key)}.bin")
