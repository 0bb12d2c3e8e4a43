"""Errors of the Redis-backed KV state."""

from __future__ import annotations


class KVStateError(Exception):
    """Base class."""


class RedisUnavailable(KVStateError):
    """Redis cannot be reached; serve without prefix-aware routing until it is back."""


class StaleGeneration(KVStateError):
    """The caller's generation of a transfer record is no longer current: it must not touch the blocks."""


class TransferGone(StaleGeneration):
    """The transfer record no longer exists (finished, or reaped after its lease expired)."""


class TransferExists(KVStateError):
    """A transfer record with this id is already in flight."""
