"""What UCX_TLS asks of this machine, checked before NIXL starts.

UCX quietly drops a listed transport it cannot open and carries everything over what is left
(usually tcp), so a deployment asking for RDMA on a node without it would run slowly and say
nothing. A worker refuses to start instead, naming the transport and what it lacks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RDMA_TRANSPORTS = ("rc", "rc_x", "rc_v", "rc_verbs", "rc_mlx5", "ud", "ud_x", "ud_v", "ud_verbs", "ud_mlx5",
                   "dc", "dc_x", "dc_mlx5")  # fmt: skip
CUDA_TRANSPORTS = ("cuda_copy", "cuda_ipc")


@dataclass(frozen=True)
class Machine:
    """What the transports need, as found on this machine."""

    rdma_devices: tuple[str, ...]
    cuda: bool
    gdrcopy: bool


def this_machine(cuda: bool) -> Machine:
    ib = Path("/sys/class/infiniband")
    devices = tuple(sorted(p.name for p in ib.iterdir())) if ib.is_dir() else ()
    return Machine(rdma_devices=devices, cuda=cuda, gdrcopy=Path("/dev/gdrdrv").exists())


def requested(tls: str | None) -> list[str]:
    """The transports UCX_TLS lists; none for unset, empty or a `^`-exclusion list."""
    if not tls or tls.startswith("^"):
        return []
    return [t.strip() for t in tls.split(",") if t.strip()]


def problems(tls: str | None, machine: Machine) -> list[str]:
    """One line per listed transport this machine cannot open (names UCX knows only by alias,
    such as `ib` or `shm`, are left to UCX)."""
    names = requested(tls)
    out = []
    if names and "tcp" not in names:
        out.append(f"UCX_TLS={tls!r} lacks tcp, which NIXL needs for notifications; add it or unset UCX_TLS")
    for name in names:
        if name in RDMA_TRANSPORTS and not machine.rdma_devices:
            out.append(
                f"UCX_TLS lists {name}, but this machine has no RDMA device (/sys/class/infiniband is empty)"
            )
        elif name in CUDA_TRANSPORTS and not machine.cuda:
            out.append(f"UCX_TLS lists {name}, but the KV cache is not on a CUDA device")
        elif name == "gdr_copy" and not machine.gdrcopy:
            out.append("UCX_TLS lists gdr_copy, but /dev/gdrdrv (the gdrcopy driver) is missing")
    return out


def check_ucx_env(cuda: bool) -> None:
    found = problems(os.environ.get("UCX_TLS"), this_machine(cuda))
    if found:
        raise RuntimeError("; ".join(found))
