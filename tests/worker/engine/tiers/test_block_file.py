"""The disk tier's file format: what it writes reads back, and nothing else does."""

from __future__ import annotations

import os
import random

import pytest

from disagg.worker.engine.tiers import block_file
from disagg.worker.engine.tiers.block_file import CorruptBlock


def _file(rng: random.Random, n_tokens: int = 16, payload_len: int = 4096):
    tokens = [rng.randrange(50_000) for _ in range(n_tokens)]
    payload = os.urandom(payload_len)
    h = rng.getrandbits(64)
    return h, tokens, payload, b"".join(block_file.encode(h, tokens, payload))


def test_round_trip():
    rng = random.Random(1)
    h, tokens, payload, data = _file(rng)
    assert len(data) == block_file.file_size(len(tokens), len(payload))
    assert bytes(block_file.decode(data, h, tokens)) == payload


def test_every_flipped_byte_is_refused():
    """Any byte of the file, flipped, is caught: header, tokens or payload."""
    rng = random.Random(2)
    h, tokens, payload, data = _file(rng, n_tokens=4, payload_len=256)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptBlock):
            block_file.decode(bad, h, tokens)


@pytest.mark.parametrize("cut", [0, 5, block_file.HEADER_BYTES, -1])
def test_truncated_files_are_refused(cut):
    rng = random.Random(3)
    h, tokens, _, data = _file(rng)
    with pytest.raises(CorruptBlock):
        block_file.decode(data[:cut], h, tokens)


def test_another_blocks_file_is_refused():
    """An intact file of another hash, or of the same hash with other tokens (a collision), is
    not the block asked for."""
    rng = random.Random(4)
    h, tokens, _, data = _file(rng)
    with pytest.raises(CorruptBlock, match="holds block"):
        block_file.decode(data, h ^ 1, tokens)
    with pytest.raises(CorruptBlock, match="other token ids"):
        block_file.decode(data, h, [t + 1 for t in tokens])
