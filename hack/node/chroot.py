"""The command that runs one RUN step of an image build inside its root filesystem: a private mount
namespace (`unshare -m`, so nothing mounted for the step outlives it), /proc and /dev, the host's
resolver and read-only build inputs bound in, then `chroot` and `env -i` with only the step's
environment. Pure: builds the command line."""

from __future__ import annotations

import shlex


def passwd_entry(passwd: str, user: str) -> tuple[int, int, str] | None:
    """(uid, gid, home) of a user name or uid in an /etc/passwd text."""
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and user in (parts[0], parts[2]):
            return int(parts[2]), int(parts[3]), parts[5]
    return None


def userspec(user: str, passwd: str) -> tuple[str | None, str]:
    """(`chroot --userspec` value or None for root, HOME) of a Dockerfile USER value."""
    if user in ("", "root", "0", "0:0"):
        return None, "/root"
    name, _, group = user.partition(":")
    entry = passwd_entry(passwd, name)
    if entry is None:
        if not name.isdigit():
            raise ValueError(f"USER {user}: no such user in the image")
        uid, gid, home = int(name), int(name), "/"
    else:
        uid, gid, home = entry
    if group:
        if not group.isdigit():
            raise ValueError(f"USER {user}: give the group as a number")
        gid = int(group)
    return f"{uid}:{gid}", home


def command(rootfs: str, argv: list[str], env: dict[str, str], workdir: str, user: str | None,
            binds: list[str] = ()) -> list[str]:  # fmt: skip
    """`binds`: host folders mounted read-only at the same path inside (their mount points exist)."""
    r = shlex.quote(rootfs.rstrip("/"))
    lines = [
        "set -e",
        f"mount -t proc proc {r}/proc",
        f"mount --rbind /dev {r}/dev",
        f"mount --bind /etc/resolv.conf {r}/etc/resolv.conf",
    ]
    for path in binds:
        q = shlex.quote(path)
        lines.append(f"mount --bind -o ro {q} {r}{q}")
    inner = ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "build", workdir, *argv]
    chroot = ["chroot"] + ([f"--userspec={user}"] if user else []) + [rootfs.rstrip("/")]
    env_args = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in sorted(env.items()))]
    lines.append("exec " + " ".join(shlex.quote(a) for a in [*chroot, *env_args, *inner]))
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines)]
