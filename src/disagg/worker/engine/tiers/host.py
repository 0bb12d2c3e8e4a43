"""The host-memory tier: KV blocks evicted from the cache, kept in fixed slots of one host tensor.

Slots are allocated once (page-locked on CUDA, so copies to and from the device are asynchronous
DMA). A block is keyed by its prefix-cache hash and keeps its token ids, which a hit must match.
The least recently used unpinned slot is reclaimed for a new block; what it held is handed back
to the caller (to go down to the disk tier). A slot is pinned while a restore may still read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch


class Demoted(NamedTuple):
    """A block leaving the host tier: its hash, tokens and bytes."""

    block_hash: int
    token_ids: tuple[int, ...]
    payload: bytearray


class HostTier:
    def __init__(
        self, capacity_blocks: int, block_shape: Sequence[int], dtype: torch.dtype, pin_memory: bool
    ):
        if capacity_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.slots = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.block_bytes = self.slots[0].numel() * self.slots.element_size()
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._tokens: list[tuple[int, ...] | None] = [None] * capacity_blocks
        self._hash: list[int | None] = [None] * capacity_blocks
        self._pins = [0] * capacity_blocks
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self.evictions = 0
        self.bytes_written = 0  # every slot claimed is filled with one block

    def __len__(self) -> int:
        return len(self._lru)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def find(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The slot holding `block_hash` with exactly `token_ids`, made most recently used."""
        slot = self._lru.get(block_hash)
        if slot is None or self._tokens[slot] != tuple(token_ids):
            return None
        self._lru.move_to_end(block_hash)
        return slot

    def touch(self, block_hash: int) -> None:
        self._lru.move_to_end(block_hash)

    def next_victim(self) -> int | None:
        """The slot the next `claim` takes a block out of: None while a slot is free (or every slot
        is pinned)."""
        if self._free:
            return None
        return next((s for s in self._lru.values() if not self._pins[s]), None)

    def claim(self, block_hash: int, token_ids: Sequence[int]) -> tuple[int | None, Demoted | None]:
        """A slot for a new block (the caller fills it) and the block it displaced, if any; no slot
        when every slot is pinned."""
        assert block_hash not in self._lru, f"block {block_hash:016x} is already in the host tier"
        demoted = None
        if self._free:
            slot = self._free.pop()
        else:
            slot = self.next_victim()
            if slot is None:
                return None, None
            victim = self._hash[slot]
            del self._lru[victim]
            demoted = Demoted(victim, self._tokens[slot], self.payload(slot))
            self.evictions += 1
        self._lru[block_hash] = slot
        self.bytes_written += self.block_bytes
        self._hash[slot] = block_hash
        self._tokens[slot] = tuple(token_ids)
        return slot, demoted

    def payload(self, slot: int) -> bytearray:
        return bytearray(self.slots[slot].view(torch.uint8).numpy())

    def drop(self, slot: int) -> None:
        """Forget a slot's block (its copy failed or never happened)."""
        h = self._hash[slot]
        if h is not None and self._lru.get(h) == slot:
            del self._lru[h]
        self._hash[slot] = self._tokens[slot] = None
        self._free.append(slot)

    def clear(self) -> None:
        """Forget every block (no restore may be under way)."""
        assert not any(self._pins), "clearing the host tier while a restore reads it"
        self._lru.clear()
        self._hash = [None] * self.capacity
        self._tokens = [None] * self.capacity
        self._free = list(range(self.capacity - 1, -1, -1))

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self._pins[slot] > 0, f"host slot {slot} is not pinned"
        self._pins[slot] -= 1

    def check(self) -> None:
        assert len(self._lru) + len(self._free) == self.capacity, "host slots lost or doubled"
        assert not set(self._lru.values()) & set(self._free), "a host slot is both used and free"
        for h, s in self._lru.items():
            assert self._hash[s] == h and self._tokens[s] is not None
        assert all(p >= 0 for p in self._pins)
