"""KV-aware routing across engine replicas (lesson 11; kvlab's own -- vLLM's routers live in
llm-d, NVIDIA Dynamo and vLLM's production stack).

==============  ==========================================================================
``policies``    round-robin, least-loaded and KV-aware policies; ``prompt_block_hashes``:
                a prompt's block keys exactly as its replica will publish them
``fleet``       ``Fleet``: N replica processes publishing KV events, a router replaying a
                trace in lock step; ``RoutingResult`` (hit rate, simulated TTFT, load)
==============  ==========================================================================
"""
