"""NIXL's UCX listens only on the interface the worker binds (not on every interface)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SCRIPT = r"""
import os, sys, torch
from disagg.worker.kv_transfer import KVLayout, create_transport
from disagg.worker.kv_transfer.nixl_transport import restrict_ucx_to

print(restrict_ucx_to(sys.argv[1]), flush=True)
cache = torch.zeros(2, 8, 2, 16, 2, 16)
t = create_transport("nixl", cache, KVLayout.from_tensor(cache, "m"), "w")
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(name).readlines()[1:]:
        f = line.split()
        if f[9] in inodes and f[3] == "0A":  # LISTEN
            print(f[1].split(":")[0], flush=True)
t.close()
"""


def _listening(host: str) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, host], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    addrs = []
    for raw in out[1:]:
        addrs.append(socket.inet_ntoa(bytes.fromhex(raw)[::-1]) if len(raw) == 8 else raw)
    return out[0], addrs


def test_ucx_listens_on_loopback_only_when_the_worker_binds_loopback():
    device, addrs = _listening("127.0.0.1")
    assert device == "lo"
    assert addrs and all(a.startswith("127.") for a in addrs), addrs
