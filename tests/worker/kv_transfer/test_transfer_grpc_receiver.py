"""The gRPC receiving end on its own: what it refuses, and a sender that breaks off mid-stream."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from disagg.proto import kv_transfer_pb2 as pb
from disagg.proto import kv_transfer_pb2_grpc as pb_grpc
from disagg.worker.kv_transfer import KVLayout, create_transport
from disagg.worker.kv_transfer.handshake import encode_handshake

from .transfer_peer import MODEL, make_cache


@pytest.fixture
def served():
    cache = make_cache(seed=1)
    transport = create_transport("grpc", cache, KVLayout.from_tensor(cache, MODEL), name="decode-0")
    server = grpc.server(ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    pb_grpc.add_KVTransferServicer_to_server(transport.servicer(), server)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield transport, pb_grpc.KVTransferStub(channel)
    channel.close()
    server.stop(None)


def _chunk(layout: KVLayout, **over) -> pb.KVBlockChunk:
    fields = dict(request_id="r", sender="p", compat_hash=layout.compat_hash(), layer=0, dst_block_ids=[1],
                  data=b"\x01" * layout.block_bytes, last=True)  # fmt: skip
    return pb.KVBlockChunk(**{**fields, **over})


def test_refuses_foreign_hash_and_bad_blocks_without_writing(served):
    transport, stub = served
    layout = transport.layout
    before = transport.kv_cache.clone()
    cases = [
        (_chunk(layout, compat_hash="f" * 32), grpc.StatusCode.FAILED_PRECONDITION, "compatibility hash"),
        (_chunk(layout, dst_block_ids=[layout.num_blocks]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (_chunk(layout, layer=layout.num_layers), grpc.StatusCode.INVALID_ARGUMENT, "layer"),
        (_chunk(layout, data=b"\x01" * 3), grpc.StatusCode.INVALID_ARGUMENT, "bytes for 1 blocks"),
    ]
    for chunk, code, text in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.PushBlocks(iter([chunk]), timeout=10)
        assert info.value.code() == code and text in info.value.details()
    assert torch.equal(transport.kv_cache, before)
    assert transport.poll_completed() == []


def test_writes_regions_and_completes_on_final(served):
    transport, stub = served
    layout = transport.layout
    transport.accept("r", [2, 3])
    ack = stub.PushBlocks(
        iter([_chunk(layout, dst_block_ids=[2, 3], data=b"\x07" * (2 * layout.block_bytes))])
    )
    assert (ack.bytes_written, ack.regions_written) == (2 * layout.block_bytes, 2)
    raw = transport.kv_cache.view(torch.uint8).view(layout.num_layers, layout.num_blocks, -1)
    assert bool((raw[0, 2:4] == 7).all()) and not bool((raw[0, 4] == 7).all())
    assert transport.poll_completed() == []
    stub.Notify(pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="r", parts=1, sender="p"))
    assert transport.poll_completed() == ["r"]


def test_sender_breaking_off_mid_stream_is_reported_failed(served):
    transport, stub = served
    layout = transport.layout

    raw = transport.kv_cache.view(torch.uint8).view(layout.num_layers, layout.num_blocks, -1)
    transport.accept("r-broken", [1])

    def dying_sender():
        yield _chunk(layout, request_id="r-broken", data=b"\x05" * layout.block_bytes, last=False)
        deadline = time.monotonic() + 10
        while not bool((raw[0, 1] == 5).all()) and time.monotonic() < deadline:
            time.sleep(0.005)  # the first chunk is written: the receiver knows the transfer
        raise RuntimeError("prefill worker crashed")

    with pytest.raises(grpc.RpcError):
        stub.PushBlocks(dying_sender(), timeout=10)
    for _ in range(200):
        failed = transport.poll_failed()
        if failed:
            break
        time.sleep(0.01)
    assert failed == [("r-broken", "disconnect: sender stream broke")]


def test_removing_a_dead_sender_fails_its_transfers_in_flight(served):
    transport, stub = served
    layout = transport.layout
    transport.add_peer("prefill-1", encode_handshake(layout, "grpc", "p", grpc_address="127.0.0.1:1"))
    transport.accept("r-orphan", [1])
    stub.PushBlocks(iter([_chunk(layout, request_id="r-orphan")]), timeout=10)  # one part landed, no FINAL
    assert transport.poll_failed() == []
    transport.remove_peer("prefill-1")  # e.g. the Prefill RPC to it failed
    assert transport.poll_failed() == [("r-orphan", "disconnect: peer prefill-1 removed")]


def _refused() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("disagg_kv_transfer_refused_total", {"backend": "grpc"}) or 0.0


def test_pushes_only_into_the_blocks_reserved_for_that_transfer(served):
    """A caller cannot overwrite blocks (prefix-cached ones other requests share) that the receiver
    did not reserve for that transfer id: refused, counted, the cache unchanged."""
    transport, stub = served
    layout = transport.layout
    transport.accept("r:2:0", [4, 5])
    before = transport.kv_cache.clone()
    refused = _refused()
    data = b"\x09" * layout.block_bytes
    cases = [
        _chunk(layout, request_id="r:2:0", dst_block_ids=[6], data=data),  # not its blocks
        _chunk(layout, request_id="r:2:0", dst_block_ids=[4, 6], data=data * 2),  # partly its blocks
        _chunk(layout, request_id="r:1:0", dst_block_ids=[4], data=data),  # an older generation
        _chunk(layout, request_id="unknown", dst_block_ids=[4], data=data),  # no reservation at all
    ]
    for chunk in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.PushBlocks(iter([chunk]), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    assert _refused() == refused + len(cases)
    assert torch.equal(transport.kv_cache, before)
    # its own blocks it may write; once settled, nothing more
    stub.PushBlocks(
        iter([_chunk(layout, request_id="r:2:0", dst_block_ids=[4, 5], data=data * 2)]), timeout=10
    )
    stub.Notify(pb.KVNotice(kind=pb.KVNotice.FINAL, request_id="r:2:0", parts=1, sender="p"))
    assert transport.poll_completed() == ["r:2:0"]
    after = transport.kv_cache.clone()
    with pytest.raises(grpc.RpcError) as info:
        stub.PushBlocks(iter([_chunk(layout, request_id="r:2:0", dst_block_ids=[4], data=data)]), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert torch.equal(transport.kv_cache, after)
