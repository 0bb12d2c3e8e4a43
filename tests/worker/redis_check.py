"""What the serving tests check in Redis: no transfer record outlives its request."""

from __future__ import annotations

import time


def transfer_records(redis_url: str, deployment: str, password: str | None = None) -> list[str]:
    """Keys of the in-flight transfer records of a deployment."""
    import redis

    from disagg.worker.kv_state.keys import Keys

    client = redis.Redis.from_url(redis_url, decode_responses=True, password=password)
    try:
        return sorted(client.scan_iter(match=Keys(deployment).transfer("*")))
    finally:
        client.close()


def assert_no_transfer_records(
    redis_url: str, deployment: str, timeout: float = 10.0, password: str | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = transfer_records(redis_url, deployment, password)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"transfer records left in Redis: {left}"
