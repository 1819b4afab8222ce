"""The offloading connector's halves (vLLM: ``.../kv_connector/v1/offloading/``)."""
