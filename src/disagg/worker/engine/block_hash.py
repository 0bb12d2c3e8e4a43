"""Deterministic chained hashes of full KV blocks.

The prefix cache, the router and the Redis prefix index all key KV blocks by these hashes,
so they must agree across processes, Python versions and machines: blake2b over a fixed
seed, the parent hash and the token ids packed as little-endian int64. Python's `hash()`
is salted per process and must never be used here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = 1
# Bumping HASH_VERSION changes every hash, which invalidates indexes built by older workers.
_SEED = b"disagg-kv-block-v%d" % HASH_VERSION
_NO_PARENT = b"\xff" * 8


def _root(extra_key: str | bytes | None) -> bytes:
    """The parent bytes of a first block; `extra_key` (model, adapter...) separates namespaces."""
    if extra_key is None:
        return _NO_PARENT
    raw = extra_key.encode() if isinstance(extra_key, str) else bytes(extra_key)
    return hashlib.blake2b(raw, digest_size=8, key=_SEED).digest()


def hash_block(parent: int | None, token_ids: Sequence[int], extra_key: str | bytes | None = None) -> int:
    """64-bit hash of one block given its parent block's hash (None for the first block).

    `extra_key` only matters for a first block: every later block inherits it through the chain.
    """
    h = hashlib.blake2b(digest_size=8, key=_SEED)
    h.update(_root(extra_key) if parent is None else parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: str | bytes | None = None,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the FULL blocks of `token_ids` (a trailing partial block has none).

    `parent` continues an existing chain (the hash of the block before token_ids[0]).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_key)
        out.append(parent)
    return out
