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


def test_a_hash_hit_must_hold_the_same_tokens():
    """Two blocks whose hashes collide: the cached one is not served for the other's tokens."""
    bm = BlockManager(num_blocks=4, block_size=4)
    (b,) = bm.allocate(1)
    bm.register(b, 12345, [1, 2, 3, 4])
    assert bm.lookup([12345], [1, 2, 3, 4]) == [b]
    assert bm.lookup([12345], [9, 9, 9, 9]) == []  # same 64-bit hash, other tokens: a miss
    assert bm.lookup([12345, 777], [1, 2, 3, 4, 5, 6, 7, 8]) == [b]


def test_engine_never_reuses_blocks_of_a_colliding_hash(tiny_llama_dir, monkeypatch):
    """With every block hash forced to collide, a second prompt gets no cached tokens and the
    same output as a fresh engine (it would read the first prompt's K/V on a hash-only match)."""
    from disagg.worker.engine import request as request_module
    from disagg.worker.engine.llm import LLM
    from disagg.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, second = list(range(10, 42)), list(range(300, 332))  # two full blocks of 16 each
    want = LLM(model=str(tiny_llama_dir), num_gpu_blocks=32).generate([second], params)[0]
    monkeypatch.setattr(request_module, "hash_block", lambda parent, tokens, extra=None: hash((parent, 0)))
    llm = LLM(model=str(tiny_llama_dir), num_gpu_blocks=32)
    llm.generate([first], params)
    got = llm.generate([second], params)[0]
    assert got.num_cached_tokens == 0
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
