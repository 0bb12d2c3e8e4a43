"""The head copies between prefill and decode workers of different tensor-parallel degrees: each
decode rank gets exactly its heads, from ranks holding them, and the byte segments rebuild its
cache from the prefill ranks' caches."""

from __future__ import annotations

import itertools

import pytest
import torch

from disagg.worker.kv_transfer import IncompatiblePeer, KVLayout
from disagg.worker.kv_transfer.handshake import decode_handshake, encode_handshake
from disagg.worker.kv_transfer.tp_layout import HeadCopy, TPLayout, block_segments, head_copies

BLOCK_SIZE, HEAD_DIM = 4, 3
GRID = [
    (a, b, h)
    for a, b, h in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4))
    if (a <= h and h % a == 0 or a % h == 0) and (b <= h and h % b == 0 or b % h == 0)
]


def test_equal_degrees_send_each_rank_whole_to_its_namesake():
    layout = TPLayout(2, 4)
    assert head_copies(layout, layout) == [
        HeadCopy(0, 0, range(0, 2), 0, 0),
        HeadCopy(1, 1, range(2, 4), 0, 0),
    ]
    (segment,) = block_segments(head_copies(layout, layout)[0], layout, layout, BLOCK_SIZE, 8)
    assert segment == (0, 0, 2 * BLOCK_SIZE * 2 * 8)


def test_fan_in_and_fan_out():
    one, two = TPLayout(1, 4), TPLayout(2, 4)
    assert head_copies(two, one) == [HeadCopy(0, 0, range(0, 2), 0, 0), HeadCopy(1, 0, range(2, 4), 0, 2)]
    assert head_copies(one, two) == [HeadCopy(0, 0, range(0, 2), 0, 0), HeadCopy(0, 1, range(2, 4), 2, 0)]


def test_replicated_heads_are_sent_by_one_holder_each_spread_over_the_replicas():
    # prefill TP=4 over 2 KV heads: ranks 0,1 hold head 0, ranks 2,3 head 1
    p4, d2 = TPLayout(4, 2), TPLayout(2, 2)
    assert head_copies(p4, d2) == [HeadCopy(0, 0, range(0, 1), 0, 0), HeadCopy(3, 1, range(1, 2), 0, 0)]
    # decode TP=4 over 2 KV heads: every replica receives its copy
    d4 = TPLayout(4, 2)
    assert [(c.src_rank, c.dst_rank, c.heads) for c in head_copies(TPLayout(1, 2), d4)] == [
        (0, 0, range(0, 1)), (0, 1, range(0, 1)), (0, 2, range(1, 2)), (0, 3, range(1, 2))
    ]  # fmt: skip


def test_mismatched_models_and_unsplittable_layouts_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads differ"):
        head_copies(TPLayout(2, 4), TPLayout(2, 8))
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        TPLayout(3, 4)


def _rank_caches(full: torch.Tensor, layout: TPLayout) -> list[torch.Tensor]:
    """Each rank's block [2, block_size, its heads, head_dim] cut from the model's."""
    return [
        full[:, :, layout.heads(r).start : layout.heads(r).stop].contiguous() for r in range(layout.tp_size)
    ]


@pytest.mark.parametrize(("src_tp", "dst_tp", "heads"), GRID)
def test_segments_rebuild_every_decode_ranks_block_from_the_prefill_ranks(src_tp, dst_tp, heads):
    src, dst = TPLayout(src_tp, heads), TPLayout(dst_tp, heads)
    full = torch.randn(2, BLOCK_SIZE, heads, HEAD_DIM)
    sent = [c.view(torch.uint8).flatten() for c in _rank_caches(full, src)]
    want = _rank_caches(full, dst)
    got = [torch.full_like(w, float("nan")).view(torch.uint8).flatten() for w in want]
    head_bytes = HEAD_DIM * full.element_size()
    written = [set() for _ in got]
    for copy in head_copies(src, dst):
        assert set(copy.heads) <= set(src.heads(copy.src_rank)) and set(copy.heads) <= set(
            dst.heads(copy.dst_rank)
        )
        for s_off, d_off, n in block_segments(copy, src, dst, BLOCK_SIZE, head_bytes):
            got[copy.dst_rank][d_off : d_off + n] = sent[copy.src_rank][s_off : s_off + n]
            span = set(range(d_off, d_off + n))
            assert not span & written[copy.dst_rank], "a byte is written twice"
            written[copy.dst_rank] |= span
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.float32).view(w.shape), w)


def _layout(**over) -> KVLayout:
    fields = dict(
        model_id="m", dtype="float32", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=4, head_dim=8
    )
    return KVLayout(**{**fields, **over})


def test_the_handshake_carries_the_tensor_parallel_layout():
    one_rank = _layout()
    assert (one_rank.tp_size, one_rank.model_kv_heads) == (1, 4)
    sharded = _layout(num_kv_heads=2, tp_size=2, model_kv_heads=4)
    _msg, remote = decode_handshake(encode_handshake(sharded, "grpc", "p"), sharded, "grpc")
    assert remote == sharded
    # a one-rank layout hashes as before tensor parallelism existed; a sharded one differs
    assert one_rank.compat_hash() == _layout(tp_size=1, model_kv_heads=4).compat_hash()
    assert sharded.compat_hash() != _layout(num_kv_heads=2).compat_hash()


def test_a_peer_split_differently_is_refused_saying_how():
    local = _layout()
    peer = _layout(num_kv_heads=2, tp_size=2, model_kv_heads=4)
    with pytest.raises(
        IncompatiblePeer, match=r"local TP=1 \(4 of 4 KV heads per rank\), peer TP=2 \(2 of 4"
    ):
        decode_handshake(encode_handshake(peer, "nixl", "p"), local, "nixl")


def test_a_payload_without_tensor_parallel_fields_is_one_rank():
    from disagg.proto import kv_transfer_pb2 as pb

    msg = pb.KVHandshake()
    msg.ParseFromString(encode_handshake(_layout(), "nixl", "p"))
    msg.layout.ClearField("tp_size")
    msg.layout.ClearField("model_kv_heads")
    _msg, remote = decode_handshake(msg.SerializeToString(), _layout(), "nixl")
    assert (remote.tp_size, remote.model_kv_heads) == (1, 4)
