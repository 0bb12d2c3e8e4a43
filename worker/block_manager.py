"""Paged KV-cache bookkeeping: block ids, reference counts, a free list and the prefix cache.

A block is either *in use* (ref_count > 0) or *free* (ref_count == 0, in the free queue).
A free block may still hold a cached prefix (its hash stays in `_cached`), so a later prompt
with the same prefix can take it back without recomputing; the block loses its hash only
when it is evicted, i.e. handed out again by `allocate`. The free queue is LRU: blocks are
taken from its front and freed blocks join its back.

Pins keep a finished request's blocks alive until an outside party (KV transfer) is done.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._pins: dict[str, list[int]] = {}

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # ---- prefix cache -----------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (no references taken)."""
        found: list[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                found.append(block)
        return found

    def register(self, block_id: int, block_hash: int) -> None:
        """Record that the (full, computed) block `block_id` holds the content `block_hash`.

        If another block already holds that content, the first stays the canonical copy and
        this one simply remains uncached.
        """
        if not self.enable_prefix_caching:
            return
        assert self._ref[block_id] > 0, f"registering free block {block_id}"
        current = self._hash[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} re-registered with a different hash"
            return
        if block_hash in self._cached:
            return
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self._cached.clear()
        self._hash = [None] * self.num_blocks

    # ---- allocation -------------------------------------------------------------------
    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each (cached) block, reviving it from the free queue if needed."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (ref 1), evicting the least recently freed cached contents."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Freed in reverse so that a sequence's tail blocks
        (the least shareable) are evicted before its head blocks."""
        for b in reversed(block_ids):
            assert self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    # ---- pins -------------------------------------------------------------------------
    def pin(self, owner: str, block_ids: Sequence[int]) -> None:
        """Hand the references of `block_ids` to `owner` until `unpin(owner)` frees them."""
        assert owner not in self._pins, f"{owner} already holds pinned blocks"
        self._pins[owner] = list(block_ids)

    def pinned(self, owner: str) -> list[int] | None:
        return self._pins.get(owner)

    def unpin(self, owner: str) -> bool:
        """Free the blocks pinned for `owner`; False if it held none (already released)."""
        blocks = self._pins.pop(owner, None)
        if blocks is None:
            return False
        self.free(blocks)
        return True

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    # ---- invariants -------------------------------------------------------------------
    def check(self) -> None:
        """Assert the internal invariants (used by tests after every scenario)."""
        for b in range(self.num_blocks):
            assert self._ref[b] >= 0
            assert (self._ref[b] == 0) == (b in self._free), f"block {b}: ref {self._ref[b]} vs free list"
            h = self._hash[b]
            if h is not None:
                assert self._cached.get(h) == b, f"block {b} hash not indexed"
        for h, b in self._cached.items():
            assert self._hash[b] == h
        assert len(self._free) <= self.num_blocks
