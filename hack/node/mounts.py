"""Mount points the rig leaves behind when something stops uncleanly (the kubelet's bind mount of
its root folder, pod volumes, container root filesystems, pod network namespaces): found in
/proc/self/mountinfo under the rig's folders and unmounted deepest first."""

from __future__ import annotations

from pathlib import Path

from . import proc


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str) -> list[str]:
    return [_unescape(line.split()[4]) for line in mountinfo.splitlines() if line.strip()]


def under(points: list[str], prefix: str) -> list[str]:
    """Mount points at or below `prefix`, deepest (and latest) first."""
    prefix = prefix.rstrip("/")
    found = [p for p in points if p == prefix or p.startswith(prefix + "/")]
    # later mounts over earlier ones at the same point come off first: keep mountinfo order reversed
    return sorted(reversed(found), key=lambda p: p.count("/"), reverse=True)


def current() -> list[str]:
    return mount_points(Path("/proc/self/mountinfo").read_text())


def unmount_under(prefix: str) -> list[str]:
    """Unmount everything at or below `prefix`; returns what was unmounted."""
    done = []
    for _ in range(3):  # stacked mounts come off one per pass
        points = under(current(), prefix)
        if not points:
            break
        for point in points:
            if proc.run(["umount", point], check=False).returncode != 0:
                proc.run(["umount", "-l", point], check=False)
            done.append(point)
    return done
