"""KV state logic that needs no Redis: key names, records, transitions, prefix matching."""

from __future__ import annotations

import pytest

from disagg.worker.kv_state.keys import Keys, hash_key
from disagg.worker.kv_state.prefix import PrefixMatcher, leading_matches
from disagg.worker.kv_state.records import Reclaim, TransferRecord, WorkerInfo, lease_ms


def test_keys_are_namespaced_and_share_a_cluster_slot():
    k = Keys("prod-1")
    assert k.worker("w0") == "disagg:{prod-1}:worker:w0"
    assert k.block(0xAB) == "disagg:{prod-1}:blk:00000000000000ab"
    assert k.reclaims("w0").startswith("disagg:{prod-1}:")
    with pytest.raises(ValueError, match="deployment"):
        Keys("a b")
    with pytest.raises(ValueError, match="block_hashes"):
        hash_key(-1)
    with pytest.raises(ValueError, match="block_hashes"):
        hash_key(1.5)


def test_lease_and_records_validate_their_fields():
    assert lease_ms(1.5) == 1500
    with pytest.raises(ValueError, match="lease_seconds"):
        lease_ms(0)
    with pytest.raises(ValueError, match="role"):
        WorkerInfo("w", "router", "h:1")
    info = WorkerInfo.from_fields({**{k: str(v) for k, v in WorkerInfo("w", "decode", "h:1").to_fields().items()},
                                   "heartbeat_ms": "2500"})  # fmt: skip
    assert (info.role, info.address, info.heartbeat_at) == ("decode", "h:1", 2.5)
    rec = TransferRecord.from_fields({"request_id": "r", "prefill_owner": "p", "decode_owner": "d",
                                      "dst_blocks": "[3,4]", "generation": "7", "lease_expiry_ms": "1000"})  # fmt: skip
    assert (rec.dst_blocks, rec.generation, rec.lease_expiry) == ([3, 4], 7, 1.0)
    assert Reclaim.decode('{"request_id":"r","generation":3,"reason":"x","blocks":[5]}') == ("r", [5], 3, "x")


def test_longest_leading_prefix_per_worker():
    sets = [{"a", "b", "c"}, {"a", "b"}, {"a", "c"}, {"a"}]
    assert leading_matches(sets) == {"a": 4, "b": 2, "c": 1}
    # A block held after a gap does not count: only a prefix is reusable.
    assert leading_matches([{"a"}, set(), {"a", "b"}]) == {"a": 1}
    assert leading_matches([]) == {}
    m = PrefixMatcher()
    m.feed([{"x"}])
    m.feed([{"y"}])
    assert m.exhausted and m.counts == {"x": 1}
