"""Errors raised by KV transports (transfer failures are reported through handles, not raised)."""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of KV transfer errors."""


class IncompatiblePeer(KVTransferError):
    """The peer's KV cache cannot exchange blocks with ours (model, dtype, shape or protocol differ)."""


class UnknownPeer(KVTransferError):
    """No cached handshake for this peer (never added, or evicted after an error): handshake again."""
