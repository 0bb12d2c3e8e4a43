"""Blocks kept allocated apart from the request that holds them.

KV writes are one-sided: a block a transfer may still read (on P) or write (on D) must not be
reused before the transfer settles, even when its request is gone. Such blocks take a reference
of their own under a key, released by `block_manager.unpin(key)`.
"""

from __future__ import annotations


def hold(block_manager, key: str, block_ids: list[int]) -> None:
    """Keep `block_ids` allocated under `key` until `unpin(key)`, whatever happens to the request
    that holds them now."""
    block_manager.acquire(block_ids)
    block_manager.pin(key, block_ids)
