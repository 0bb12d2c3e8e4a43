"""Paged KV-cache bookkeeping: block ids, reference counts, free blocks and the prefix cache.

A block is either *in use* (ref_count > 0) or *free* (ref_count == 0). A free block may still
hold a cached prefix (its hash stays in `_cached`), so a later prompt with the same prefix can
take it back without recomputing; the block loses its hash only when it is evicted, i.e. handed
out again by `allocate`.

Free blocks live in one of two places. Those without a cached prefix are kept as runs of
consecutive ids (`_FreeRuns`), and `allocate` hands them out first, as few ascending runs as it
can: a request's blocks then sit next to each other in the KV tensor, so a KV transfer moves
them with a few large copies instead of one per block. Free blocks that hold a cached prefix
wait in an LRU queue (freed blocks join its back) and are evicted from its front only when no
uncached block is left (`eviction_window` can widen that choice to favour runs).

Pins keep a finished request's blocks alive until an outside party (KV transfer) is done.

`on_evict`, when set, is handed the (block id, hash, token ids) of the cached blocks an
allocation evicts, before the caller can overwrite them: the lower KV tiers keep them.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import islice


class _FreeRuns:
    """Free block ids as maximal runs of consecutive ids, found by length for allocation.

    Runs are indexed by start, by end and in a list sorted by (length, start), so taking,
    adding or merging a run costs dict lookups and a bisect (plus a C-level list shift of one
    pointer per run), never a walk over the pool.
    """

    def __init__(self) -> None:
        self._len_at: dict[int, int] = {}  # start -> length
        self._start_at_end: dict[int, int] = {}  # end (exclusive) -> start
        self._by_len: list[tuple[int, int]] = []  # (length, start), sorted
        self.count = 0

    @property
    def num_runs(self) -> int:
        return len(self._len_at)

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run, by start."""
        return sorted(self._len_at.items())

    def _add_run(self, start: int, length: int) -> None:
        self._len_at[start] = length
        self._start_at_end[start + length] = start
        insort(self._by_len, (length, start))

    def _drop_run(self, start: int) -> int:
        length = self._len_at.pop(start)
        del self._start_at_end[start + length]
        del self._by_len[bisect_left(self._by_len, (length, start))]
        return length

    def put(self, start: int, length: int) -> None:
        """Add the free ids start .. start+length-1 (none of them free already), merging neighbours."""
        self.count += length
        left = self._start_at_end.get(start)
        if left is not None:
            length += start - left
            self._drop_run(left)
            start = left
        if start + length in self._len_at:
            length += self._drop_run(start + length)
        self._add_run(start, length)

    def take(self, n: int) -> list[tuple[int, int]]:
        """Remove n ids (n <= count) as (start, length) pieces: the lowest of the shortest runs that
        hold all n, else the longest runs first, so the pieces are as few as the free ids allow."""
        pieces = []
        while n:
            i = bisect_left(self._by_len, (n, -1))
            length, start = self._by_len[i] if i < len(self._by_len) else self._by_len[-1]
            self._drop_run(start)
            used = min(n, length)
            if used < length:
                self._add_run(start + used, length - used)
            pieces.append((start, used))
            n -= used
        self.count -= sum(length for _, length in pieces)
        return pieces

    def remove(self, block: int) -> None:
        """Take one particular id out of its run (a rare path: reviving an uncached free block)."""
        start = self._containing(block)
        assert start is not None, f"block {block} is not in a free run"
        length = self._drop_run(start)
        if block > start:
            self._add_run(start, block - start)
        if block + 1 < start + length:
            self._add_run(block + 1, start + length - block - 1)
        self.count -= 1

    def _containing(self, block: int) -> int | None:
        # Walk left to the run's start: bounded by one run's length, and only the rare paths use it.
        b = block
        while b >= 0 and b not in self._len_at:
            if b in self._start_at_end and b != block:
                return None  # the run ending right here stops before `block`
            b -= 1
        if b < 0 or block >= b + self._len_at[b]:
            return None
        return b

    def check(self) -> None:
        runs = self.runs()
        assert sorted((length, start) for start, length in runs) == self._by_len, "length index drifted"
        assert {start + length: start for start, length in runs} == self._start_at_end, "end index drifted"
        assert sum(length for _, length in runs) == self.count, "free run count drifted"
        for (s1, l1), (s2, _) in zip(runs, runs[1:], strict=False):
            assert s1 + l1 < s2, f"free runs at {s1} and {s2} overlap or touch unmerged"


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free."""


class BlockManager:
    """`eviction_window` W: evicting k cached blocks picks them among the W*k least recently freed,
    whole runs of consecutive ids first. 1 (the default) is exact LRU; larger trades some cache
    recency for fewer, longer runs of ids."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, eviction_window: int = 1
    ):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not isinstance(eviction_window, int) or eviction_window < 1:
            raise ValueError(f"eviction_window must be an integer >= 1, got {eviction_window!r}")
        self.eviction_window = eviction_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # the token ids a cached block holds: a hit must match them, not only the 64-bit hash
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._uncached = _FreeRuns()  # free blocks without a cached prefix
        self._uncached.put(0, num_blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, LRU first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._pins: dict[str, list[int]] = {}
        self.on_evict: Callable[[list[tuple[int, int, tuple[int, ...] | None]]], None] | None = None

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._uncached.count + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_runs(self) -> int:
        """Runs of consecutive free uncached ids: 1 in a fresh pool, more as it fragments."""
        return self._uncached.num_runs

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
    def lookup(self, hashes: Sequence[int], token_ids: Sequence[int] | None = None) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (no references taken).

        With `token_ids` (the sequence the hashes were computed from) a block is a hit only if it
        holds exactly those tokens: a hash collision, chance or crafted, never serves another
        prompt's K/V. Without, hashes alone answer (whether the cache still holds a hash)."""
        found: list[int] = []
        if self.enable_prefix_caching:
            bs = self.block_size
            for i, h in enumerate(hashes):
                block = self._cached.get(h)
                if block is None:
                    break
                if token_ids is not None and self._tokens[block] != tuple(token_ids[i * bs : (i + 1) * bs]):
                    break
                found.append(block)
        return found

    def register(self, block_id: int, block_hash: int, token_ids: Sequence[int] | None = None) -> None:
        """Record that the (full, computed) block `block_id` holds the content `block_hash`
        (computed from `token_ids`, kept beside it to verify hits).

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
        self._tokens[block_id] = None if token_ids is None else tuple(token_ids)
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._tokens = [None] * self.num_blocks
        self._put_uncached(list(self._evictable))
        self._evictable.clear()

    # ---- allocation -------------------------------------------------------------------
    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each (cached) block, reviving it from the free blocks if needed."""
        for b in block_ids:
            if self._ref[b] == 0:
                if b in self._evictable:
                    del self._evictable[b]
                else:
                    self._uncached.remove(b)
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (ref 1), in ascending id order: uncached free blocks first, in as few
        runs of consecutive ids as they allow; then cached ones, least recently freed first."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        from_runs = min(n, self._uncached.count)
        out = [b for start, length in self._uncached.take(from_runs) for b in range(start, start + length)]
        evicted = []
        for b in self._pick_evicted(n - from_runs):
            del self._evictable[b]
            h = self._hash[b]
            evicted.append((b, h, self._tokens[b]))
            self._hash[b] = None
            self._tokens[b] = None
            if self._cached.get(h) == b:
                del self._cached[h]
            out.append(b)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        # Ascending order keeps neighbouring ids neighbours in the block table, whatever the
        # order they were found in; which blocks were evicted does not change.
        out.sort()
        for b in out:
            self._ref[b] = 1
        return out

    def _pick_evicted(self, k: int) -> list[int]:
        """The k cached free blocks to evict: the k least recently freed, or with a wider window the
        longest runs of consecutive ids among the window's (lower ids first on ties)."""
        if k == 0:
            return []
        window = sorted(islice(self._evictable, k * self.eviction_window))
        if len(window) == k:
            return window
        runs: list[tuple[int, int]] = []  # (start index in window, length)
        for i, b in enumerate(window):
            if runs and window[i - 1] == b - 1:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        runs.sort(key=lambda r: (-r[1], r[0]))
        picked: list[int] = []
        for first, length in runs:
            picked += window[first : first + min(length, k - len(picked))]
            if len(picked) == k:
                return picked
        raise AssertionError("eviction window smaller than the blocks to evict")

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Freed in reverse so that a sequence's tail blocks
        (the least shareable) are evicted before its head blocks."""
        uncached = []
        for b in reversed(block_ids):
            assert self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    uncached.append(b)
                else:
                    self._evictable[b] = None
        self._put_uncached(uncached)

    def _put_uncached(self, blocks: list[int]) -> None:
        blocks.sort()
        start = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                self._uncached.put(blocks[start], i - start)
                start = i

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
        self._uncached.check()
        free_uncached = {b for start, length in self._uncached.runs() for b in range(start, start + length)}
        assert not free_uncached & set(self._evictable), "a block is in both free structures"
        for b in range(self.num_blocks):
            assert self._ref[b] >= 0
            is_free = b in free_uncached or b in self._evictable
            assert (self._ref[b] == 0) == is_free, f"block {b}: ref {self._ref[b]} vs free blocks"
            h = self._hash[b]
            if h is not None:
                assert self._cached.get(h) == b, f"block {b} hash not indexed"
            if is_free:
                assert (h is None) == (b in free_uncached), f"free block {b} filed by the wrong cache state"
        for h, b in self._cached.items():
            assert self._hash[b] == h
        assert self.num_free_blocks <= self.num_blocks
