"""Deletion work that owner references do not cover: this deployment's keys in Redis.

Children are garbage-collected by Kubernetes through their owner references, and a managed
Redis goes with them. An external Redis outlives the deployment, so its keys (worker registry,
transfer leases, prefix index) are removed here. Best effort: an unreachable Redis is logged
and does not block deletion.

The key names come from the workers' own `Keys` (one source of truth; it imports no torch).
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from disagg.worker.kv_state.keys import Keys


def key_pattern(deployment_id: str) -> str:
    """SCAN pattern of every key of the deployment: the workers' key prefix (with its Redis Cluster
    hash tag `{<deployment>}`, literal in a glob) and anything after it."""
    prefix = Keys(deployment_id).prefix
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in prefix) + "*"


async def delete_keys(
    url: str,
    deployment_id: str,
    *,
    password: str | None = None,
    timeout: float = 3.0,
    logger: logging.Logger | None = None,
) -> int | None:
    """Delete every key of the deployment; the count, or None when Redis could not be reached."""
    log = logger or logging.getLogger(__name__)
    client = aioredis.from_url(url, password=password, socket_connect_timeout=timeout, socket_timeout=timeout)
    deleted = 0
    try:
        batch = []
        async for key in client.scan_iter(match=key_pattern(deployment_id), count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += await client.unlink(*batch)
                batch = []
        if batch:
            deleted += await client.unlink(*batch)
        return deleted
    except (aioredis.RedisError, OSError) as exc:
        log.warning("could not clean Redis keys of %s at %s: %s", deployment_id, url, exc)
        return None
    finally:
        await client.aclose()
