"""What `up` changes on the host outside the namespace and the state folder, recorded before the
change so `down` can put it back: the machine-wide sysctls the kubelet rewrites when it starts,
and host folders that the runtime makes on first use."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .layout import Layout

# kubelet's setupKernelTunables: vm.overcommit_memory 0->1, kernel.panic 1->10, kernel.panic_on_oops 0->1
KUBELET_SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops")
# made by `ip netns add` (a shared bind mount of itself), containerd's shims (sockets), the CNI
# library (its result cache) and the kubelet (container log links), when missing
RUNTIME_DIRS = ("/run/netns", "/run/containerd", "/var/lib/cni", "/var/log/containers")


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    return {name: _sysctl_path(name).read_text().strip() for name in KUBELET_SYSCTLS}


def restore_sysctls(values: dict[str, str]) -> list[str]:
    """Writes back the recorded values; returns the names that had changed."""
    changed = []
    for name, value in values.items():
        path = _sysctl_path(name)
        if path.read_text().strip() != value:
            path.write_text(value + "\n")
            changed.append(name)
    return changed


def record(layout: Layout) -> dict:
    """Records the host as it is, unless a record of an earlier `up` is still waiting for `down`."""
    if layout.host_record.exists():
        return json.loads(layout.host_record.read_text())
    rec = {"sysctls": read_sysctls(), "missing_dirs": [d for d in RUNTIME_DIRS if not os.path.lexists(d)]}
    layout.host_record.parent.mkdir(parents=True, exist_ok=True)
    layout.host_record.write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def load(layout: Layout) -> dict | None:
    try:
        return json.loads(layout.host_record.read_text())
    except FileNotFoundError:
        return None


def remove_made_dirs(rec: dict) -> list[str]:
    """Folders that were missing before `up`: removed when nothing but empty folders, sockets or
    dangling links of the rig remain in them (a mount point like /run/netns is unmounted first by
    the caller)."""
    removed = []
    for d in rec.get("missing_dirs", []):
        path = Path(d)
        if not path.is_dir() or path.is_mount():
            continue
        leftovers = [p for p in path.rglob("*") if not p.is_dir() or p.is_symlink()]
        if any(p.is_file() and not p.is_symlink() and p.stat().st_size > 0 for p in leftovers):
            continue  # someone else's data: keep
        shutil.rmtree(path)
        removed.append(d)
    return removed
