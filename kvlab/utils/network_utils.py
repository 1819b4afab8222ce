"""This node's IP address, as vLLM finds it (``vllm/utils/network_utils.py``: ``get_ip``).

A publisher asked to bind ``tcp://*:0`` binds a port the OS picks on this address and
reports it, so a subscriber on another machine can connect. Nothing is sent: connecting a
UDP socket only asks the kernel which local address its route would use.
"""

from __future__ import annotations

import os
import socket
import warnings


def get_ip() -> str:
    """``VLLM_HOST_IP`` if set; else the address of the interface that routes to the
    Internet (IPv4, then IPv6); else ``"0.0.0.0"`` with a warning -- which a publisher
    refuses to report, since no subscriber could connect to it."""
    host_ip = os.environ.get("VLLM_HOST_IP", "")
    if host_ip:
        return host_ip
    for family, probe in ((socket.AF_INET, ("8.8.8.8", 80)), (socket.AF_INET6, ("2001:4860:4860::8888", 80))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)  # a route lookup only: no packet leaves
                return str(s.getsockname()[0])
        except OSError:
            continue
    warnings.warn("Failed to get the IP address, using 0.0.0.0 by default; set VLLM_HOST_IP", stacklevel=2)
    return "0.0.0.0"
