"""HiSparse (vLLM 0.33: ``vllm/v1/hisparse/``): a sparse-attention MLA model's K/V kept in
host memory, with only what attention is about to read on the GPU.

A sparse-attention model (DeepSeek-V3.2, GLM-5) reads, at each decode step, only the
``index_topk`` earlier tokens its lightning indexer picks -- 2,048 of a 128k context. So the
full K/V need not stay on the GPU: HiSparse keeps it whole in a host pool (the *source*
group), keeps the indexer's small keys whole on the GPU (it must score every token), and
gives each request a little GPU memory of two kinds -- *resident* pages (the newest K/V, not
yet copied to the host) and a *hot* buffer (rows recent steps picked). The GPU pool then
holds many more requests than it would hold whole contexts.

Here: how the groups are laid out and the two pools sized (:mod:`kvlab.hisparse.layout`),
the options (:mod:`kvlab.hisparse.runtime`), and, at vLLM's paths, the coordinator that moves
pages between the pools (:mod:`kvlab.hisparse.coordinator`), its records
(:mod:`kvlab.hisparse.types`) and the host pool (:mod:`kvlab.hisparse.block_pool`). The
coordinator and the three group managers live in the core (``kvlab.core.hisparse_*``): a
``KVCacheManager`` built from a config with ``hisparse_host_num_blocks`` starts them. The
connector that runs the transfers on the worker side is not built.
"""
