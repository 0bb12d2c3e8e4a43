"""Free loopback ports for local deployments and tests.

Ports handed out by `bind(0)` come from the kernel's ephemeral range, which outgoing
connections draw from too: between choosing such a port and a child process binding it, a
client socket can take it ("address already in use"). Choosing below the ephemeral range
avoids that race; the bind check still skips ports other servers hold.
"""

from __future__ import annotations

import random
import socket

_RANGE = (20000, 32000)  # below Linux's default ephemeral range (32768-60999)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, outside the ephemeral range."""
    low, high = _RANGE
    start = random.randrange(low, high)
    for i in range(high - low):
        port = low + (start - low + i) % (high - low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {low}-{high}")
