"""The disk tier: written off the caller's thread, LRU by bytes, one engine per directory, and no
block served from a corrupt, truncated or stale file."""

from __future__ import annotations

import os

import pytest

from disagg.worker.engine.tiers import block_file
from disagg.worker.engine.tiers.disk import DiskTier, DiskTierInUse
from disagg.worker.engine.tiers.host import Demoted

PAYLOAD = 1000


def _block(h: int) -> Demoted:
    return Demoted(h, (h, h + 1, h + 2), bytearray(os.urandom(PAYLOAD)))


SIZE = block_file.file_size(3, PAYLOAD)


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier(tmp_path / "kv", 4 * SIZE)
    yield tier
    tier.close()


def test_blocks_round_trip_and_are_readable_while_queued(disk):
    blocks = [_block(h) for h in range(1, 4)]
    for b in blocks:
        disk.put(b)
        assert disk.holds(b.block_hash)  # queued or written: either way readable
        assert bytes(disk.read(b.block_hash, b.token_ids)) == bytes(b.payload)
    disk.flush()
    assert sorted(p.name for p in disk.dir.glob("*" + block_file.SUFFIX)) == sorted(
        block_file.file_name(b.block_hash) for b in blocks
    )
    for b in blocks:
        assert bytes(disk.read(b.block_hash, b.token_ids)) == bytes(b.payload)
    assert disk.read(blocks[0].block_hash, (0, 0, 0)) is None  # other tokens: a miss


def test_least_recently_used_files_make_room(disk):
    for h in range(1, 5):
        disk.put(_block(h))
    disk.flush()
    disk.read(1, (1, 2, 3))  # 1 becomes the most recent: 2 is the first to go
    disk.put(_block(5))
    disk.flush()
    assert not disk.holds(2) and not disk.file_path(2).exists()
    assert all(disk.holds(h) for h in (1, 3, 4, 5))
    assert disk.used_bytes == 4 * SIZE and disk.evictions == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_caught_deleted_and_counted(disk, damage):
    b = _block(9)
    disk.put(b)
    disk.flush()
    path = disk.file_path(9)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[block_file.HEADER_BYTES + 30 + len(data) // 2 % 100] ^= 0x40
    else:
        data = data[:-7]
    path.write_bytes(data)
    assert disk.read(9, b.token_ids) is None
    assert disk.corrupt == 1 and not disk.holds(9) and not path.exists()
    assert disk.used_bytes == 0


def test_the_directory_is_one_engines_and_left_empty(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    (d / block_file.file_name(5)).write_bytes(b"left by a crashed engine")
    (d / "keep.txt").write_text("not ours")
    first = DiskTier(d, 4 * SIZE)
    assert first.removed_stale == 1 and not first.holds(5)
    with pytest.raises(DiskTierInUse):
        DiskTier(d, 4 * SIZE)
    first.put(_block(1))
    first.flush()
    first.close()
    assert sorted(p.name for p in d.iterdir()) == [".lock", "keep.txt"]
    DiskTier(d, 4 * SIZE).close()  # released: the next engine takes it


def test_prefetch_stages_blocks_for_the_read(disk):
    blocks = [_block(h) for h in (1, 2)]
    for b in blocks:
        disk.put(b)
    disk.flush()
    disk.prefetch([(b.block_hash, b.token_ids) for b in blocks] + [(77, (1, 2, 3))])
    disk.wait_prefetched()
    for b in blocks:
        disk.file_path(b.block_hash).unlink()  # served from memory now
        assert bytes(disk.read(b.block_hash, b.token_ids)) == bytes(b.payload)


def test_a_block_larger_than_the_tier_is_not_kept(tmp_path):
    tier = DiskTier(tmp_path / "kv", SIZE - 1)
    tier.put(_block(1))
    tier.flush()
    assert not tier.holds(1)
    tier.close()
