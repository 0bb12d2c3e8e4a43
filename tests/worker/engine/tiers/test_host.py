"""The host tier's slots: least recently used first out, pinned slots never, tokens verified."""

from __future__ import annotations

import pytest
import torch

from disagg.worker.engine.tiers.host import HostTier


def _tier(capacity: int = 3) -> HostTier:
    return HostTier(capacity, (2, 4), torch.float32, pin_memory=False)


def _fill(tier: HostTier, h: int, value: float):
    slot, demoted = tier.claim(h, (h, h + 1))
    if slot is not None:
        tier.slots[slot].fill_(value)
    return slot, demoted


def test_lru_block_is_demoted_with_its_bytes():
    tier = _tier()
    for h in (1, 2, 3):
        assert _fill(tier, h, float(h))[1] is None
    assert tier.find(1, (1, 2)) is not None  # 1 is now the most recent: 2 goes first
    slot, demoted = _fill(tier, 4, 4.0)
    assert demoted.block_hash == 2 and demoted.token_ids == (2, 3)
    assert torch.equal(torch.frombuffer(demoted.payload, dtype=torch.float32), torch.full((8,), 2.0))
    assert not tier.holds(2) and tier.holds(4) and tier.evictions == 1
    tier.check()


def test_pinned_slots_are_not_reclaimed():
    tier = _tier(2)
    s1, _ = _fill(tier, 1, 1.0)
    s2, _ = _fill(tier, 2, 2.0)
    assert tier.next_victim() == s1  # the least recently used
    tier.pin(s1)
    assert tier.next_victim() == s2
    tier.pin(s2)
    assert tier.next_victim() is None
    assert tier.claim(3, (3, 4)) == (None, None)  # every slot pinned: the new block is not kept
    tier.unpin(s2)
    slot, demoted = _fill(tier, 3, 3.0)
    assert slot == s2 and demoted.block_hash == 2
    tier.unpin(s1)
    with pytest.raises(AssertionError):
        tier.unpin(s1)
    tier.check()


def test_a_hit_needs_the_same_tokens():
    tier = _tier()
    _fill(tier, 7, 1.0)
    assert tier.find(7, (7, 8)) is not None
    assert tier.find(7, (7, 9)) is None
    assert tier.find(8, (7, 8)) is None


def test_drop_frees_the_slot():
    tier = _tier(1)
    assert tier.next_victim() is None  # a free slot: nothing to displace
    slot, _ = _fill(tier, 1, 1.0)
    tier.drop(slot)
    assert not tier.holds(1) and len(tier) == 0
    assert _fill(tier, 2, 2.0) == (slot, None)
    tier.check()
