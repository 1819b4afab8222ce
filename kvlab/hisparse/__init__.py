"""HiSparse (vLLM 0.33: ``vllm/v1/hisparse/``): a sparse-attention MLA model's K/V kept in
host memory, with only what attention is about to read on the GPU.

A sparse-attention model (DeepSeek-V3.2, GLM-5) reads, at each decode step, only the
``index_topk`` earlier tokens its lightning indexer picks -- 2,048 of a 128k context. So the
full K/V need not stay on the GPU: HiSparse keeps it whole in a host pool (the *source*
group), keeps the indexer's small keys whole on the GPU (it must score every token), and
gives each request a little GPU memory of two kinds -- *resident* pages (the newest K/V, not
yet copied to the host) and a *hot* buffer (rows recent steps picked). The GPU pool then
holds many more requests than it would hold whole contexts.

kvlab has its configuration: how the groups are laid out and the two pools sized
(:mod:`kvlab.hisparse.layout`), and the options (:mod:`kvlab.hisparse.runtime`). The
scheduler-side coordinator that moves pages between the pools is not built: kvlab's
``KVCacheManager`` refuses a config with a host pool.
"""
