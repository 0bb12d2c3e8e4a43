"""Shared fixtures: a real redis-server on a free loopback port, process helpers.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set here,
before test modules import the kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
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
