"""HiSparse's shared constants (vLLM 0.33: ``vllm/v1/hisparse/types.py``)."""

#: Sealed pages this close to the end of a request's block table stay pinned on the GPU: a
#: step still in flight may be writing them, so their blocks must not be handed out yet.
#: It is also all a running request that reads from the host keeps of its resident pages.
ACTIVE_TAIL_PAGES = 2
