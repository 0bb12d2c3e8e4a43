"""The Redis connection with its availability: a flag, the `disagg_redis_up` gauge and one warning
per outage. redis-py reconnects by itself on the next command once the server is back."""

from __future__ import annotations

import logging
import os
import threading
import urllib.parse
from pathlib import Path

import redis
from prometheus_client import Gauge
from redis.backoff import NoBackoff
from redis.retry import Retry

from disagg.worker.kv_state.errors import RedisUnavailable

log = logging.getLogger(__name__)

REDIS_UP = Gauge("disagg_redis_up", "1 while Redis answers, 0 during an outage (no prefix-aware routing).")

# Errors that mean "the server is not there (yet)", as opposed to a bug in a command.
_OUTAGE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError)


PASSWORD_ENV = "DISAGG_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "DISAGG_REDIS_PASSWORD_FILE"


def redact_url(url: str | None) -> str | None:
    """`url` fit for logs and errors: a password in it becomes `***`."""
    if not url:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        host = parts.netloc.rpartition("@")[2]
        user = parts.username or ""
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "(unparsable Redis URL)"


def redis_password(password_file: str | None = None) -> str | None:
    """The Redis password from a file (a mounted Secret; `password_file` or DISAGG_REDIS_PASSWORD_FILE)
    or DISAGG_REDIS_PASSWORD (a secretKeyRef); None when neither is set."""
    path = password_file or os.environ.get(PASSWORD_FILE_ENV)
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as e:
            raise ValueError(f"Redis password file {path}: {e.strerror}") from None
    return os.environ.get(PASSWORD_ENV) or None


class RedisLink:
    def __init__(self, url: str, timeout: float = 1.0, password: str | None = None):
        """password: AUTH, passed to the client apart from the URL, so no URL ever carries it
        (a password inside `url` still works, and is scrubbed from everything this logs)."""
        if not url:
            raise ValueError("redis_url: must be set, e.g. redis://host:6379/0")
        extra = {"password": password} if password else {}
        # One immediate retry covers a pooled connection the server closed (a restart); more would
        # only delay the caller during an outage.
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1),
            decode_responses=True, **extra,
        )  # fmt: skip
        self.url = redact_url(url)
        self.available = True
        self.outages = 0
        self._lock = threading.Lock()

    def run(self, what: str, fn):
        """fn(client) -> result; outages raise RedisUnavailable and flip the availability flag."""
        try:
            result = fn(self.client)
        except _OUTAGE as exc:
            self._down(what, exc)
            raise RedisUnavailable(f"Redis at {self.url} unreachable during {what}: {exc}") from exc
        self._up()
        return result

    def _down(self, what: str, exc: Exception) -> None:
        with self._lock:
            if self.available:
                self.available = False
                self.outages += 1
                log.warning(
                    "Redis unreachable (%s: %s); serving continues without prefix-aware routing", what, exc
                )
        REDIS_UP.set(0)

    def _up(self) -> None:
        if not self.available:
            with self._lock:
                if not self.available:
                    self.available = True
                    log.warning("Redis reachable again at %s", self.url)
        REDIS_UP.set(1)

    def close(self) -> None:
        self.client.close()
