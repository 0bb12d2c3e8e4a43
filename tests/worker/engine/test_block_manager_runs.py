"""Block manager allocation policy: uncached free blocks come out as few ascending runs of ids,
cached free blocks are evicted least recently freed first, and the accounting stays exact."""

from __future__ import annotations

import random

import pytest

from disagg.worker.engine.block_manager import BlockManager, NoFreeBlocksError
from disagg.worker.kv_transfer.region_runs import block_runs


def _holes(bm: BlockManager, keep: list[list[int]], drop: list[list[int]]) -> None:
    """Free `drop` while `keep` stays allocated, leaving holes in the pool."""
    for blocks in drop:
        bm.free(blocks)
    assert all(bm.ref_count(b) == 1 for blocks in keep for b in blocks)


def test_fresh_pool_hands_out_ascending_runs():
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    assert bm.allocate(5) == [0, 1, 2, 3, 4]
    assert bm.allocate(3) == [5, 6, 7]
    assert bm.num_free_runs == 1
    bm.free(list(range(8)))
    bm.check()
    assert bm.num_free_blocks == 32 and bm.num_free_runs == 1  # freed neighbours merge back


def test_smallest_hole_that_fits_is_used_lowest_first():
    bm = BlockManager(20, 4, enable_prefix_caching=False)
    a, b, c, d, e, f = (bm.allocate(n) for n in (2, 1, 5, 1, 3, 8))
    _holes(bm, keep=[b, d, f], drop=[a, c, e])  # holes: [0,1], [3..7], [9..11]
    assert bm.num_free_runs == 3
    assert bm.allocate(3) == [9, 10, 11]  # the 3-hole, not the front of the 5-hole
    assert bm.allocate(2) == [0, 1]
    assert bm.allocate(4) == [3, 4, 5, 6]  # lowest part of the only run that fits
    assert bm.allocate(1) == [7]
    bm.check()
    assert bm.num_free_blocks == 0


def test_when_no_hole_fits_the_longest_runs_are_used_first():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    parts = [
        bm.allocate(n) for n in (1, 1, 4, 1, 2, 1, 3, 3)
    ]  # ids 0 | 1 | 2-5 | 6 | 7-8 | 9 | 10-12 | 13-15
    _holes(bm, keep=[parts[1], parts[3], parts[5]], drop=[parts[0], parts[2], parts[4], parts[6], parts[7]])
    # free runs: [0], [2..5], [7, 8], [10..15]; 9 blocks cannot come from one run: 6 + 3 of the next longest
    got = bm.allocate(9)
    assert got == sorted(got) and block_runs(got) == [(2, 3), (10, 6)]
    assert bm.allocate(3) == [0, 7, 8] and bm.allocate(1) == [5]
    bm.check()


def test_uncached_blocks_go_before_cached_ones_and_cached_ones_leave_in_lru_order():
    bm = BlockManager(12, 4)
    first, second, plain = bm.allocate(3), bm.allocate(3), bm.allocate(6)
    for i, b in enumerate(first + second):
        bm.register(b, 1000 + i)
    bm.free(second)  # freed first: least recently used
    bm.free(first)
    bm.free(plain)  # freed last, but holds no cached prefix
    assert bm.num_cached_blocks == 6 and bm.num_free_runs == 1
    assert bm.allocate(4) == [6, 7, 8, 9]
    assert bm.allocate(2) == [10, 11]
    assert bm.num_cached_blocks == 6  # no cached block was evicted while uncached ones were free
    # LRU: `second` was freed before `first`, each tail first (5, 4, 3, then 2, 1, 0)
    assert bm.allocate(2) == [4, 5]
    assert bm.lookup([1003, 1004]) == [3] and bm.num_cached_blocks == 4
    assert bm.allocate(2) == [2, 3]  # next in LRU order: the rest of `second`, then `first`'s tail
    assert bm.lookup([1000, 1001, 1002]) == [0, 1]
    bm.check()


def test_eviction_sorts_the_evicted_blocks_but_keeps_which_ones():
    bm = BlockManager(8, 4)
    blocks = bm.allocate(8)
    for b in blocks:
        bm.register(b, 50 + b)
    bm.free(blocks[4:])  # LRU: 7, 6, 5, 4
    bm.free(blocks[:4])  # then 3, 2, 1, 0
    assert bm.allocate(3) == [5, 6, 7]
    assert bm.lookup([50 + b for b in range(5)]) == [0, 1, 2, 3, 4]
    assert bm.allocate(5) == [0, 1, 2, 3, 4]
    assert bm.num_cached_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
    bm.check()


def test_reviving_a_free_uncached_block_splits_its_run():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    bm.acquire([4])
    assert bm.ref_count(4) == 1 and bm.num_free_blocks == 9 and bm.num_free_runs == 2
    bm.check()
    assert bm.allocate(4) == [0, 1, 2, 3]
    bm.free([4])
    bm.check()
    assert bm.num_free_runs == 1 and bm.allocate(6) == [4, 5, 6, 7, 8, 9]


def test_reset_prefix_cache_returns_cached_free_blocks_to_the_runs():
    bm = BlockManager(8, 4)
    blocks = bm.allocate(8)
    for b in blocks[2:5]:
        bm.register(b, 7 + b)
    bm.free(blocks)
    assert bm.num_free_runs == 2 and bm.num_cached_blocks == 3
    bm.reset_prefix_cache()
    bm.check()
    assert bm.num_free_runs == 1 and bm.num_cached_blocks == 0 and bm.allocate(8) == list(range(8))


def _serve_like_churn(bm: BlockManager, rng: random.Random, steps: int, max_prompt: int, check: bool):
    """Ragged prompts admitted, grown a block at a time (full blocks cached), finished at random."""
    live: list[list[int]] = []
    next_hash = 1
    for _ in range(steps):
        want = rng.randint(1, max_prompt)
        if want <= bm.num_free_blocks:
            live.append(bm.allocate(want))
        for req in live:
            if rng.random() < 0.3 and bm.num_free_blocks:
                bm.register(req[-1], next_hash)
                next_hash += 1
                req += bm.allocate(1)
        while live and (rng.random() < 0.4 or bm.num_free_blocks < bm.num_blocks // 8):
            bm.free(live.pop(rng.randrange(len(live))))
        if check:
            bm.check()
            assert bm.num_used_blocks == sum(len(r) for r in live)
    return live


@pytest.mark.parametrize("caching", [True, False])
def test_churn_keeps_accounting_exact_and_allocations_ascending(caching):
    bm = BlockManager(256, 16, enable_prefix_caching=caching)
    rng = random.Random(7)
    live = _serve_like_churn(bm, rng, steps=300, max_prompt=24, check=True)
    while bm.num_free_blocks < 64:
        bm.free(live.pop())
    got = bm.allocate(64)
    assert got == sorted(got) and len(set(got)) == 64
    if not caching:
        # A first-in first-out free list scatters these; runs keep them to a handful.
        assert len(block_runs(got)) <= 12, block_runs(got)
    for req in live:
        bm.free(req)
    bm.free(got)
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks


def test_cached_blocks_are_evicted_exactly_in_lru_order_under_churn():
    """Against a plain model: the free cached blocks in the order they were freed."""
    bm = BlockManager(64, 4)
    rng = random.Random(5)
    hash_of: dict[int, int] = {}  # block -> the hash it holds
    lru: list[int] = []  # free cached blocks, least recently freed first
    live: list[list[int]] = []
    next_hash = 1
    for _ in range(400):
        if live and rng.random() < 0.45:
            blocks = live.pop(rng.randrange(len(live)))
            bm.free(blocks)
            lru += [b for b in reversed(blocks) if b in hash_of]
        else:
            n = rng.randint(1, 6)
            if n > bm.num_free_blocks:
                continue
            must_evict = max(0, n - (bm.num_free_blocks - len(lru)))
            blocks = bm.allocate(n)
            assert set(blocks) & set(lru) == set(lru[:must_evict])
            for b in lru[:must_evict]:
                del hash_of[b]
            lru = lru[must_evict:]
            for b in blocks[:-1]:  # full blocks enter the cache; the last one stays partial
                bm.register(b, next_hash)
                hash_of[b] = next_hash
                next_hash += 1
            live.append(blocks)
        assert bm.num_cached_blocks == len(hash_of)
        assert all(bm.lookup([hash_of[b]]) == [b] for b in lru)
    bm.check()


def test_large_pool_churn_matches_a_plain_free_set():
    bm = BlockManager(100_000, 16, enable_prefix_caching=False)
    rng = random.Random(11)
    free = set(range(100_000))
    live = []
    for _ in range(2_000):
        if live and rng.random() < 0.5:
            blocks = live.pop(rng.randrange(len(live)))
            bm.free(blocks)
            free.update(blocks)
        else:
            blocks = bm.allocate(rng.randint(1, 200))
            assert free.issuperset(blocks)
            free.difference_update(blocks)
            live.append(blocks)
        assert bm.num_free_blocks == len(free)
    bm.check()


def test_eviction_window_prefers_runs_among_the_oldest_cached_blocks():
    def freed_in_order(window: int) -> BlockManager:
        bm = BlockManager(10, 4, eviction_window=window)
        blocks = bm.allocate(10)
        for b in blocks:
            bm.register(b, 300 + b)
        for b in (0, 5, 6, 2, 7, 9, 1, 8, 3, 4):  # least recently freed first
            bm.free([b])
        return bm

    strict = freed_in_order(1)
    assert strict.allocate(3) == [0, 5, 6]  # exact LRU
    wide = freed_in_order(2)
    assert wide.allocate(3) == [5, 6, 7]  # the longest run among the 6 oldest: 0, 2, 5, 6, 7, 9
    assert all(wide.lookup([300 + b]) == [b] for b in (0, 1, 2, 3, 4, 8, 9)) and wide.num_cached_blocks == 7
    assert wide.allocate(2) == [0, 1]  # window now 0, 2, 9, 1: the front of run 0-2
    wide.check()
    with pytest.raises(ValueError, match="eviction_window"):
        BlockManager(4, 4, eviction_window=0)
