"""Redis key names of one deployment.

Every key starts with `disagg:{<deployment>}:`. The braces are a Redis Cluster hash tag: all
keys of a deployment share one slot, so the multi-key Lua scripts stay valid on a cluster.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _checked(field: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{field}: must be a non-empty string of letters, digits, '.', '_' or '-', got {value!r}"
        )
    return value


def hash_key(block_hash: int | str) -> str:
    """Canonical text of a chained block hash (64-bit ints as 16 hex digits)."""
    if isinstance(block_hash, bool) or not isinstance(block_hash, int | str):
        raise ValueError(f"block_hashes: expected int or str hashes, got {type(block_hash).__name__}")
    if isinstance(block_hash, int):
        if not 0 <= block_hash < 1 << 64:
            raise ValueError(f"block_hashes: {block_hash} is not a 64-bit unsigned hash")
        return f"{block_hash:016x}"
    if not block_hash:
        raise ValueError("block_hashes: empty hash")
    return block_hash


class Keys:
    def __init__(self, deployment: str):
        self.deployment = _checked("deployment", deployment)
        self.prefix = f"disagg:{{{deployment}}}:"

    def worker(self, worker_id: str) -> str:
        """Hash: registration and load of a live worker (expires without heartbeats)."""
        return f"{self.prefix}worker:{worker_id}"

    @property
    def workers(self) -> str:
        """Set: ids of registered workers, live or not yet pruned by the reaper."""
        return f"{self.prefix}workers"

    def transfer(self, request_id: str) -> str:
        """Hash: one in-flight transfer record."""
        return f"{self.prefix}xfer:{request_id}"

    @property
    def leases(self) -> str:
        """Sorted set: transfer request ids scored by lease expiry (ms)."""
        return f"{self.prefix}leases"

    @property
    def generation(self) -> str:
        """Counter: every (re)assignment of a transfer takes the next value, never reused."""
        return f"{self.prefix}generation"

    @property
    def reclaims_prefix(self) -> str:
        return f"{self.prefix}reclaim:"

    def reclaims(self, worker_id: str) -> str:
        """List: blocks this worker must free (pushed by the reaper, drained by the worker)."""
        return self.reclaims_prefix + worker_id

    @property
    def block_prefix(self) -> str:
        return f"{self.prefix}blk:"

    def block(self, block_hash: int | str) -> str:
        """Set: workers holding the block with this chained hash."""
        return self.block_prefix + hash_key(block_hash)

    def worker_blocks(self, worker_id: str) -> str:
        """Set: hashes a worker published (to remove them when it dies)."""
        return f"{self.prefix}wblk:{worker_id}"


check_name = _checked
