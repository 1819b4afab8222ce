"""vLLM's ``vllm/entrypoints``: processes that serve an engine. ``kv_server``: a kvlab engine
in its own process, publishing vLLM's KV events over ZeroMQ (lessons 10, 11);
``disagg_prefill``: a prefill engine and a decode engine in two processes, and the proxy
between them (lesson 13)."""
