"""Transfer logic without a peer: layout math, handshake checks, receive bookkeeping."""

from __future__ import annotations

import pytest
import torch

from disagg.proto import kv_transfer_pb2 as pb
from disagg.worker.kv_transfer import IncompatiblePeer, KVLayout
from disagg.worker.kv_transfer.handshake import decode_handshake, encode_handshake
from disagg.worker.kv_transfer.tracker import ReceiveTracker


def _layout(**over) -> KVLayout:
    fields = dict(model_id="m", dtype="bfloat16", num_layers=2, num_blocks=10, block_size=16, num_kv_heads=4,
                  head_dim=64)  # fmt: skip
    return KVLayout(**{**fields, **over})


def test_layout_from_tensor_and_region_math():
    cache = torch.zeros(3, 7, 2, 4, 2, 8, dtype=torch.float16)
    layout = KVLayout.from_tensor(cache, "m")
    assert (layout.num_layers, layout.num_blocks, layout.dtype) == (3, 7, "float16")
    assert layout.block_bytes == 2 * 4 * 2 * 8 * 2 == cache[0, 0].numel() * 2
    # Region (layer, block) starts at (layer * num_blocks + block) * block_bytes in the tensor.
    assert cache[1, 5].data_ptr() - cache.data_ptr() == (1 * 7 + 5) * layout.block_bytes
    assert layout.region_indices([1, 2], [5, 0]) == [12, 7, 19, 14]
    with pytest.raises(ValueError, match="layer 3 out of range"):
        layout.region_indices([3], [0])
    with pytest.raises(ValueError, match="block 7 out of range"):
        layout.region_indices([0], [7])
    with pytest.raises(ValueError, match="kv_cache"):
        KVLayout.from_tensor(torch.zeros(3, 7, 4), "m")
    with pytest.raises(ValueError, match="contiguous"):
        layout.check_tensor(cache.transpose(4, 5).contiguous().transpose(4, 5))


def test_compat_hash_ignores_pool_size_only():
    base = _layout()
    assert base.compat_hash() == _layout(num_blocks=999).compat_hash()
    for change in ({"model_id": "other"}, {"dtype": "float16"}, {"num_layers": 3}, {"num_kv_heads": 8},
                   {"head_dim": 128}, {"block_size": 32}, {"kv_cache_dtype": "int8"},
                   {"weight_quantization": "int8"}):  # fmt: skip
        assert _layout(**change).compat_hash() != base.compat_hash(), change


def test_handshake_roundtrip_and_rejections():
    local = _layout()
    payload = encode_handshake(
        _layout(num_blocks=50), "nixl", "peer-1", agent_metadata=b"md", base_address=4096
    )
    msg, remote = decode_handshake(payload, local, "nixl")
    assert (msg.agent_name, msg.agent_metadata, msg.base_address, remote.num_blocks) == (
        "peer-1",
        b"md",
        4096,
        50,
    )
    with pytest.raises(IncompatiblePeer, match="block_size: local 16, peer 32"):
        decode_handshake(encode_handshake(_layout(block_size=32), "nixl", "p"), local, "nixl")
    # a quantized KV cache, or KV computed with other weights, is refused by name
    with pytest.raises(IncompatiblePeer, match="kv_cache_dtype: local 'auto', peer 'fp8'"):
        decode_handshake(encode_handshake(_layout(kv_cache_dtype="fp8"), "nixl", "p"), local, "nixl")
    with pytest.raises(IncompatiblePeer, match="weight_quantization: local 'none', peer 'int8'"):
        decode_handshake(encode_handshake(_layout(weight_quantization="int8"), "nixl", "p"), local, "nixl")
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        _layout(kv_cache_dtype="int4")
    with pytest.raises(IncompatiblePeer, match="transport differs"):
        decode_handshake(payload, local, "grpc")
    old = pb.KVHandshake.FromString(payload)
    old.protocol_version = 0
    with pytest.raises(IncompatiblePeer, match="protocol version"):
        decode_handshake(old.SerializeToString(), local, "nixl")
    forged = pb.KVHandshake.FromString(payload)
    forged.compat_hash = "0" * 32
    with pytest.raises(IncompatiblePeer, match="compatibility hash"):
        decode_handshake(forged.SerializeToString(), local, "nixl")
    with pytest.raises(ValueError, match="payload"):
        decode_handshake(b"\xff\xff not a handshake", local, "nixl")
    with pytest.raises(ValueError, match="payload"):
        decode_handshake(b"", local, "nixl")


def test_tracker_completes_after_final_and_all_parts_in_any_order():
    t = ReceiveTracker()
    t.on_final("p", "r1", 2)  # FINAL may overtake the parts
    t.on_part("p", "r1", 10)
    assert t.pop_completed() == []
    t.on_part("p", "r1", 10)
    assert t.pop_completed() == ["r1"]
    t.on_part("p", "r1", 10)  # late duplicates never report twice
    t.on_final("p", "r1", 3)
    assert t.pop_completed() == [] and t.in_flight() == 0
    assert t.bytes_received == 30


def test_tracker_keeps_senders_apart_and_reports_failures_once():
    t = ReceiveTracker(stall_timeout=5.0)
    t.on_part("old", "r", 1)
    t.on_part("new", "r", 1)
    t.on_final("new", "r", 1)
    assert t.pop_completed() == ["r"]  # the old sender's part did not count
    t.on_failure("x", "r2", "aborted: gone")
    t.on_failure("x", "r2", "aborted: gone")
    assert t.pop_failed() == [("r2", "aborted: gone")]
    t.on_part("y", "r3", 1)
    assert t.pop_failed(now=1e12) == [("r3", "stalled: nothing received for 5s")]
    assert t.pop_failed(now=1e12) == [] and t.in_flight() == 0  # "old" was dropped when "r" completed
    t.forget("r")
    t.on_part("z", "r4", 1)
    t.fail_sender("z", "disconnect: peer z gone")
    assert t.pop_failed() == [("r4", "disconnect: peer z gone")] and t.in_flight() == 0


def test_tracker_waits_for_every_rank_of_a_tensor_parallel_sender():
    t = ReceiveTracker()
    t.on_part("p-rank0", "r", 5)
    t.on_final("p-rank0", "r", 1, senders=2)
    assert t.pop_completed() == []  # rank 1's heads have not landed yet
    t.on_final("p-rank1", "r", 1, senders=2)
    t.on_part("p-rank1", "r", 5)
    assert t.pop_completed() == ["r"] and t.in_flight() == 0
    t.on_final("a", "r2", 0, senders=2)  # one rank done, the other aborts: failed, once
    t.on_failure("b", "r2", "aborted: rank 1 failed")
    assert t.pop_completed() == [] and t.pop_failed() == [("r2", "aborted: rank 1 failed")]


def test_handshake_between_workers_split_differently():
    """Ranks of workers split differently exchange heads only when asked to (`cross_tp`), and
    only for the same model's KV heads."""
    local = _layout(num_kv_heads=2, tp_size=2, model_kv_heads=4)
    peer = encode_handshake(_layout(num_kv_heads=4), "nixl", "d")
    with pytest.raises(IncompatiblePeer, match="tensor-parallel layouts differ: local TP=2 .* peer TP=1"):
        decode_handshake(peer, local, "nixl")
    _msg, remote = decode_handshake(peer, local, "nixl", cross_tp=True)
    assert remote.tp_key == (1, 4)
    other_model = encode_handshake(_layout(num_kv_heads=8), "nixl", "d")
    with pytest.raises(IncompatiblePeer, match="model's KV heads: local 4, peer 8"):
        decode_handshake(other_model, local, "nixl", cross_tp=True)
    with pytest.raises(IncompatiblePeer, match="head_dim"):
        decode_handshake(encode_handshake(_layout(num_kv_heads=4, head_dim=32), "nixl", "d"), local, "nixl",
                         cross_tp=True)  # fmt: skip


def test_quantized_layout_covers_values_and_scales_and_refuses_mismatches():
    from disagg.kernels.kv_quant import KVQuantFormat

    fmt = KVQuantFormat("int8", block_size=4, num_kv_heads=2, head_dim=8)
    cache = fmt.allocate(3, 7, "cpu")
    geometry = ("bfloat16", 4, 2, 8)
    layout = KVLayout.from_tensor(cache, "m", kv_cache_dtype="int8", quantized_geometry=geometry)
    assert (layout.num_layers, layout.num_blocks, layout.dtype, layout.itemsize) == (3, 7, "bfloat16", 1)
    # a region is the 8-bit values and their scales: what a transfer moves per (layer, block)
    assert layout.block_bytes == fmt.region_bytes == cache[0, 0].numel()
    assert fmt.scales(cache[1, 5]).data_ptr() < cache.data_ptr() + (1 * 7 + 5 + 1) * layout.block_bytes
    assert cache[1, 5].data_ptr() - cache.data_ptr() == (1 * 7 + 5) * layout.block_bytes
    layout.check_tensor(cache)
    with pytest.raises(ValueError, match="quantized_geometry"):
        KVLayout.from_tensor(cache, "m", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache: a int8 KV cache is uint8"):
        KVLayout.from_tensor(cache, "m", kv_cache_dtype="int8", quantized_geometry=("bfloat16", 8, 2, 8))
    # the handshake refuses a peer that stores its KV otherwise, naming the field
    local = encode_handshake(layout, "nixl", "d")
    fp8 = KVLayout.from_tensor(cache, "m", kv_cache_dtype="fp8", quantized_geometry=geometry)
    assert fp8.block_bytes == layout.block_bytes and fp8.compat_hash() != layout.compat_hash()
    with pytest.raises(IncompatiblePeer, match="kv_cache_dtype: local 'fp8', peer 'int8'"):
        decode_handshake(local, fp8, "nixl")
    full = KVLayout.from_tensor(torch.zeros(3, 7, 2, 4, 2, 8, dtype=torch.bfloat16), "m")
    with pytest.raises(IncompatiblePeer, match="kv_cache_dtype: local 'auto', peer 'int8'"):
        decode_handshake(local, full, "nixl")
    _, remote = decode_handshake(local, layout, "nixl")
    assert remote.block_bytes == layout.block_bytes
