"""Block manager: reference counts, free list, prefix cache, pins; all-free after every scenario."""

from __future__ import annotations

import pytest

from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import BlockManager, NoFreeBlocksError


@pytest.fixture
def bm():
    m = BlockManager(num_blocks=8, block_size=4)
    yield m
    m.check()
    assert m.num_free_blocks == m.num_blocks and m.num_pinned == 0, "blocks leaked"


def test_allocate_free_accounting(bm):
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a + b)) == 8 and bm.num_free_blocks == 0 and bm.usage == 1.0
    with pytest.raises(NoFreeBlocksError, match="asked for 1 KV blocks, only 0 free"):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free_blocks == 3
    bm.check()
    bm.free(b)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2


def test_double_free_is_caught(bm):
    a = bm.allocate(1)
    bm.free(a)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a)


def test_prefix_cache_hit_shares_and_revives_blocks(bm):
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    blocks = bm.allocate(3)
    for b, h in zip(blocks, hashes, strict=True):
        bm.register(b, h)
    # shared while the first owner still holds them
    hit = bm.lookup(hashes)
    assert hit == blocks
    bm.acquire(hit)
    assert all(bm.ref_count(b) == 2 for b in blocks)
    bm.free(hit)
    bm.free(blocks)
    # freed but still cached: a later lookup revives them without recomputation
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    assert bm.lookup(hashes[:2]) == blocks[:2]
    bm.acquire(blocks[:2])
    assert bm.num_free_blocks == 6
    bm.free(blocks[:2])
    # a different prefix misses at its first block
    assert bm.lookup(block_hashes([99] + tokens[1:], 4)) == []


def test_eviction_is_lru_and_drops_the_hash(bm):
    hashes = block_hashes(list(range(8)), 4)
    cached = bm.allocate(2)
    for b, h in zip(cached, hashes, strict=True):
        bm.register(b, h)
    bm.free(cached)  # join the back of the free queue
    fresh = bm.allocate(6)  # the 6 never-cached blocks come first
    assert not set(fresh) & set(cached)
    assert bm.lookup(hashes) == cached
    # freed in reverse: the tail block (hashes[1]) is evicted before the head block
    one = bm.allocate(1)
    assert one == [cached[1]]
    assert bm.lookup(hashes) == [cached[0]]
    bm.free(one + fresh)


def test_duplicate_content_keeps_the_first_copy(bm):
    h = block_hashes([1, 2, 3, 4], 4)[0]
    a, b = bm.allocate(2)
    bm.register(a, h)
    bm.register(b, h)
    assert bm.lookup([h]) == [a]
    bm.free([a, b])


def test_pins_hold_blocks_until_unpinned(bm):
    blocks = bm.allocate(4)
    bm.pin("req-1", blocks)
    assert bm.pinned("req-1") == blocks and bm.num_pinned == 1
    assert bm.num_free_blocks == 4
    assert bm.unpin("req-1") and not bm.unpin("req-1")
    assert bm.pinned("req-1") is None


def test_no_prefix_caching_never_hits():
    m = BlockManager(4, 4, enable_prefix_caching=False)
    h = block_hashes([1, 2, 3, 4], 4)
    (b,) = m.allocate(1)
    m.register(b, h[0])
    assert m.lookup(h) == [] and m.num_cached_blocks == 0
    m.free([b])
    m.check()


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
