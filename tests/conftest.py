"""Shared fixtures: a real redis-server on a free loopback port, process helpers.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set here,
before test modules import the kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from disagg.worker.cli.ports import free_port  # noqa: E402
from disagg.worker.cli.up import redis_command, write_redis_config  # noqa: E402


class RedisServer:
    """A throwaway redis-server process; `restart()` keeps the port (for fault tests)."""

    def __init__(self, tmp_path, password: str | None = None):
        """password: protected mode and AUTH, from a 0600 config file (as `disagg up` runs it)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found: run `make install` (installs Debian's redis-server)")
        self.port = free_port()
        self.dir = tmp_path
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        config = None
        if self.password is not None:
            config = write_redis_config(self.dir / "redis.conf", self.port, self.password, self.dir)
        self.proc = subprocess.Popen(
            redis_command(self.port, self.dir, config),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """A clean database on the shared server for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory):
    """A redis-server in protected mode with a password (`.password`), as `disagg up` runs it."""
    import secrets

    server = RedisServer(tmp_path_factory.mktemp("redis-secure"), password=f"planted-{secrets.token_hex(8)}")
    yield server
    server.stop()


# ---- the e2e marker ------------------------------------------------------------------------------
# A test is `e2e` when it starts processes: a serving Cluster (router and workers), a redis-server,
# `disagg up`, tensor-parallel ranks, a transfer peer, a compiler or a fresh interpreter. It is
# found from the code the test runs, not marked by hand: the test function, every fixture it
# uses (directly or through other fixtures), and the functions and classes of tests/ those call,
# searched for a name that starts a process. `make test-fast` runs the tests without the marker.

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# names (globals, attributes) whose use starts a process
PROCESS_NAMES = frozenset(
    {
        "subprocess",  # subprocess.run / Popen: redis-server, the product's commands, cc, python -c
        "Popen",
        "create_subprocess_exec",
        "create_subprocess_shell",
        "get_context",  # multiprocessing.get_context("spawn"): the transfer peers
    }
)
# keyword arguments that start processes: an engine of two or more ranks starts its rank processes
PROCESS_KEYWORDS = frozenset({"tensor_parallel_size"})


def _codes_of(obj) -> list:
    """The code objects of a function (unwrapped), or of every method of a class."""
    obj = getattr(obj, "__wrapped__", obj)
    if isinstance(obj, type):
        return [c for v in vars(obj).values() for c in _codes_of(v)]
    if isinstance(obj, staticmethod | classmethod):
        obj = obj.__func__
    code = getattr(obj, "__code__", None)
    return [(code, obj.__globals__)] if code is not None else []


def _in_tests(obj) -> bool:
    path = getattr(getattr(obj, "__code__", None), "co_filename", None)
    if path is None:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(module, "__file__", None)
    return bool(path) and os.path.abspath(path).startswith(TESTS_DIR + os.sep)


def starts_processes(objs, seen: set | None = None) -> bool:
    """Whether any of `objs` (functions, classes), or a helper of tests/ they name, uses a name of
    PROCESS_NAMES or passes a keyword of PROCESS_KEYWORDS."""
    seen = set() if seen is None else seen
    todo = [pair for obj in objs for pair in _codes_of(obj)]
    while todo:
        code, scope = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        keywords = set()
        for const in code.co_consts:
            if hasattr(const, "co_code"):  # a nested function, lambda or comprehension
                todo.append((const, scope))
            elif isinstance(const, tuple):  # a call's keyword names, a dict literal's keys
                keywords.update(c for c in const if isinstance(c, str))
        if PROCESS_NAMES.intersection(code.co_names) or PROCESS_KEYWORDS & keywords:
            return True
        for name in code.co_names:
            helper = scope.get(name)
            if (
                helper is not None
                and (inspect.isfunction(helper) or inspect.isclass(helper))
                and _in_tests(helper)
            ):
                todo.extend(_codes_of(helper))
    return False


def pytest_collection_modifyitems(config, items):
    verdicts: dict = {}  # one verdict per test function or fixture function
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        fixtures = [d.func for defs in info.name2fixturedefs.values() for d in defs] if info else []
        for func in [getattr(item, "function", None), *(f for f in fixtures if _in_tests(f))]:
            if func is None:
                continue
            if func not in verdicts:
                verdicts[func] = starts_processes([func])
            if verdicts[func]:
                item.add_marker(pytest.mark.e2e)
                break


def _in_child_as(uid: int, gid: int, fn) -> str:
    """`fn()`'s string result, computed in a forked child that dropped to uid:gid (as a pod's
    process runs); a failure there comes back as `error|<exception>`. Needs root."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(gid)
            os.setuid(uid)
            os.write(write, str(fn()).encode())
        except BaseException as exc:  # reported to the parent, which fails the test
            os.write(write, f"error|{exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return f.read().decode()


@pytest.fixture
def as_user():
    """Run a function as another user (a forked child), for what only shows under a pod's uid."""
    if os.getuid() != 0:
        pytest.skip("dropping to another uid needs root")
    return _in_child_as
