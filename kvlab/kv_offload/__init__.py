"""KV offload tiers behind the GPU pool (vLLM: ``vllm/v1/kv_offload/``; lesson 12).

``base.py`` -- what every tier shares (offload keys, the request context, tier filters, the
manager's verbs); ``cpu/`` -- the CPU tier: its books (``manager.py``; cache policies by name
in ``policies/``: LRU ranked by request, ARC) and its bytes and copies (``gpu_worker.py``); ``tiering/`` -- a CPU tier with a disk tier behind it
(``manager.py``; the file tier in ``fs/``: books and file format); ``file_mapper.py`` --
which file holds which block; ``config.py`` -- what a backend is told about the engine. The connector that plugs them into the engine is
``kvlab.distributed.kv_transfer.kv_connector.v1.offloading_connector``.

vLLM 0.33's way in, by name: ``factory.py`` (``OffloadingSpecFactory``) picks a backend's
*spec* from ``extra_config["spec_name"]`` -- ``cpu/spec.py`` (``CPUOffloadingSpec``) or
``tiering/spec.py`` (``TieringOffloadingSpec``) -- and the spec sizes the tier from the
``OffloadingConfig`` and builds its manager (scheduler side) and worker (worker side).
"""
