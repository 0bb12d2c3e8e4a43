"""The kubelet's cgroup subtree (`cgroupRoot`) in every hierarchy of this cgroup v1 (hybrid)
machine: made before the kubelet starts, removed depth-first by `down`, after any process left in
it (only the rig's containers can be there) is killed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def hierarchies(mounts_text: str) -> list[tuple[str, str]]:
    """(mount point, fstype) of each cgroup and cgroup2 mount in /proc/mounts text."""
    out = []
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1], parts[2]))
    return out


def _current() -> list[tuple[str, str]]:
    return hierarchies(Path("/proc/mounts").read_text())


def create(root: str) -> list[str]:
    made = []
    for mount, fstype in _current():
        if fstype != "cgroup":
            continue
        path = Path(mount) / root
        if not path.exists():
            path.mkdir()
            made.append(str(path))
        for name in ("cpuset.cpus", "cpuset.mems"):  # a new cpuset has none until given its parent's
            own = path / name
            if own.exists() and not own.read_text().strip():
                own.write_text((Path(mount) / name).read_text())
    return made


def _procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove(root: str, timeout: float = 10.0) -> list[str]:
    """Removes the subtree everywhere; returns the folders that could not be removed."""
    left = []
    for mount, _ in _current():
        top = Path(mount) / root
        if not top.is_dir():
            continue
        dirs = sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True)
        for d in dirs:
            deadline = time.monotonic() + timeout
            while _procs(d) and time.monotonic() < deadline:
                for pid in _procs(d):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            try:
                d.rmdir()
            except OSError:
                left.append(str(d))
    return left


def leftovers(root: str) -> list[str]:
    return [str(Path(m) / root) for m, _ in _current() if (Path(m) / root).exists()]
