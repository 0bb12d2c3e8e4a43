"""Chained block hashes: stable across processes (the router and Redis compute them too)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disagg.worker.engine.block_hash import block_hashes, hash_block

# Golden values: changing them breaks every prefix index built by deployed workers.
GOLDEN_FIRST = 14937269884020298731  # hash_block(None, [1, 2, 3, 4])
GOLDEN_CHAIN = [5104823035450413770, 9093917626377940129]  # block_hashes(range(10), 4)


def test_golden_values():
    assert hash_block(None, [1, 2, 3, 4]) == GOLDEN_FIRST
    assert block_hashes(list(range(10)), 4) == GOLDEN_CHAIN


def test_same_value_in_a_fresh_process_with_another_hash_seed():
    code = "from disagg.worker.engine.block_hash import block_hashes; print(block_hashes(list(range(10)), 4))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout
    assert out.strip() == str(GOLDEN_CHAIN)


def test_full_blocks_only_and_chained():
    ids = list(range(100, 111))
    hs = block_hashes(ids, 4)
    assert len(hs) == 2  # 11 tokens: two full blocks, the partial third has no hash
    assert hs[0] == hash_block(None, ids[:4])
    assert hs[1] == hash_block(hs[0], ids[4:8])
    assert block_hashes(ids[:3], 4) == []
    # continuing a chain from a parent gives the same result as hashing everything at once
    assert block_hashes(ids[4:], 4, parent=hs[0]) == hs[1:]


def test_hash_depends_on_the_whole_prefix_and_the_extra_key():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first block
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [1, 2], "model-a") != hash_block(None, [1, 2], "model-b")
    assert hash_block(None, [1, 2], "model-a") != hash_block(None, [1, 2])
    assert hash_block(None, [2**40]) != hash_block(None, [0])  # ids are not truncated to 32 bits
    assert all(0 <= h < 2**64 for h in a)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
