"""The rig's long-running processes: started detached with a pid file that also records the
process's start time, so `down` stops exactly the process `up` started (never one that reused
its pid), and commands run to completion."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .layout import Layout


class CommandError(RuntimeError):
    pass


class Exited(RuntimeError):
    """A process the rig started is gone: waiting for it is over."""


def run(argv: list[str], *, check: bool = True, capture: bool = True, input: bytes | None = None,
        timeout: float | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    done = subprocess.run(
        argv,
        input=input,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        timeout=timeout,
        env=env,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and done.returncode != 0:
        err = (done.stderr or b"").decode(errors="replace").strip() if capture else ""
        raise CommandError(f"{' '.join(map(str, argv))}: exit {done.returncode}{': ' + err if err else ''}")
    return done


def output(argv: list[str], **kw) -> str:
    return run(argv, **kw).stdout.decode()


def in_netns(netns: str, argv: list[str]) -> list[str]:
    """Joins only the network namespace (`ip netns exec` would also remount /sys and hide the
    cgroup mounts the kubelet needs)."""
    return ["nsenter", f"--net=/var/run/netns/{netns}", "--", *argv]


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime, in clock ticks since boot


def _pidfile(layout: Layout, name: str) -> Path:
    return layout.pids / f"{name}.pid"


def start(layout: Layout, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    layout.pids.mkdir(parents=True, exist_ok=True)
    layout.logs.mkdir(parents=True, exist_ok=True)
    with open(layout.logs / f"{name}.log", "ab") as log:
        log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env,
        )  # fmt: skip
    _pidfile(layout, name).write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
    return proc.pid


def pid_of(layout: Layout, name: str) -> int | None:
    """The pid of the process `start` started under `name`, while that very process lives."""
    try:
        pid_text, started = _pidfile(layout, name).read_text().split()
    except (OSError, ValueError):
        return None
    pid = int(pid_text)
    state = None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state == "Z" or _start_time(pid) != started:
        return None
    return pid


def alive(layout: Layout, name: str) -> bool:
    return pid_of(layout, name) is not None


def names(layout: Layout) -> list[str]:
    return sorted(p.stem for p in layout.pids.glob("*.pid")) if layout.pids.is_dir() else []


def stop(layout: Layout, name: str, timeout: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after `timeout`, to the process and the processes it forked (its
    process group: `start` made it a session leader, e.g. socat's per-connection children);
    True when a process was stopped."""
    pid = pid_of(layout, name)
    stopped = False
    if pid is not None:
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _group_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if _group_alive(pid):
            _signal_group(pid, signal.SIGKILL)
            while _group_alive(pid):
                _reap(pid)
                time.sleep(0.05)
        stopped = True
    _pidfile(layout, name).unlink(missing_ok=True)
    return stopped


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group `start` created: its id is the leader's pid
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies of this very process aside)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # a child of this process (started by this very command)
    except ChildProcessError:
        pass


def must_live(layout: Layout, name: str) -> bool:
    if not alive(layout, name):
        log = layout.logs / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        raise Exited(f"{name} exited; the end of {log}:\n" + "\n".join(tail))
    return True


def wait_for(check, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            value = check()
            if value:
                return value
        except Exited:
            raise
        except Exception as exc:  # noqa: BLE001 - reported when the wait gives up
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: not after {timeout:.0f}s" + (f" (last error: {last_error})" if last_error else "")
            )
        time.sleep(interval)
