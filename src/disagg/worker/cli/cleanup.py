"""`disagg cleanup`: delete one deployment's keys from Redis (the operator's deletion Job runs it).

The worker registry, transfer records, reclaim lists and the prefix index of a deployment outlive
it in an external Redis; not all of them expire. This runs where the Redis password is mounted
(DISAGG_REDIS_PASSWORD or DISAGG_REDIS_PASSWORD_FILE), so the operator never holds it. Exit 0 when
the keys are gone (or there were none), 1 when Redis could not be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

from disagg.worker.engine.settings import env_name
from disagg.worker.serving.process_args import DeploymentArgs

BATCH = 500


def key_pattern(deployment_id: str) -> str:
    """SCAN pattern of every key of the deployment: the workers' key prefix (with its Redis Cluster
    hash tag `{<deployment>}`, literal in a glob) and anything after it."""
    from disagg.worker.kv_state.keys import Keys

    prefix = Keys(deployment_id).prefix
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in prefix) + "*"


def delete_keys(client, deployment_id: str) -> int:
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=key_pattern(deployment_id), count=BATCH):
        batch.append(key)
        if len(batch) >= BATCH:
            deleted += client.unlink(*batch)
            batch = []
    if batch:
        deleted += client.unlink(*batch)
    return deleted


def add_arguments(p: argparse.ArgumentParser) -> None:
    # every process's flags and variables for the same Redis and deployment, here without defaults:
    # a cleanup deletes the keys of the deployment it is named, never of "default"
    flag = DeploymentArgs.cli_flag
    p.add_argument(
        flag("redis_url"), default=os.environ.get(env_name("redis_url")), help="Redis URL (no password)"
    )
    p.add_argument(flag("deployment"), default=os.environ.get(env_name("deployment")),
                   help="the deployment id whose keys go (<namespace>.<name>)")  # fmt: skip
    p.add_argument(flag("redis_password_file"), default=None,
                   help="file with the Redis password (or DISAGG_REDIS_PASSWORD / DISAGG_REDIS_PASSWORD_FILE)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for Redis")


def run(args) -> int:
    import redis

    from disagg.worker.kv_state.link import redact_url, redis_password

    if not args.redis_url or not args.deployment:
        raise SystemExit("disagg cleanup: give --redis-url and --deployment")
    password = redis_password(args.redis_password_file)
    client = redis.Redis.from_url(
        args.redis_url,
        **({"password": password} if password else {}),
        socket_connect_timeout=args.timeout,
        socket_timeout=args.timeout,
    )
    try:
        count = delete_keys(client, args.deployment)
    except (redis.RedisError, OSError) as exc:
        print(f"disagg cleanup: Redis at {redact_url(args.redis_url)}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"deleted {count} keys of {args.deployment}", flush=True)
    return 0
