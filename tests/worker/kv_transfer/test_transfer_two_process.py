"""Real transfers between two processes, for both transports: NIXL (UCX on CPU) and gRPC on loopback."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from disagg.worker.kv_transfer import IncompatiblePeer, KVLayout, UnknownPeer, create_transport

from .transfer_peer import MODEL, SHAPE, Receiver, make_cache

BACKENDS = ["nixl", "grpc"]


@pytest.fixture(scope="module", params=BACKENDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def receivers(kind):
    """The long-lived receiver and one to kill, started together so their start-up overlaps."""
    pair = Receiver(kind, seed=1), Receiver(kind, seed=5)
    yield pair
    for r in pair:
        r.stop()


@pytest.fixture(scope="module")
def receiver(receivers):
    return receivers[0]


@pytest.fixture(scope="module")
def sender(kind, receiver):
    cache = make_cache(seed=2, num_blocks=12)
    transport = create_transport(kind, cache, KVLayout.from_tensor(cache, MODEL), name="prefill-0")
    transport.add_peer("decode-0", receiver.payload)
    yield transport
    transport.close()


def _expected(before: torch.Tensor, src_cache: torch.Tensor, src, dst, layers=None) -> torch.Tensor:
    out = before.clone()
    for layer in range(SHAPE["num_layers"]) if layers is None else layers:
        out[layer, dst] = src_cache[layer, src]
    return out


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_blocks_land_exactly_where_asked(kind, sender, receiver):
    before = receiver.dump()
    sent_bytes = _sample("disagg_kv_transfer_bytes_total", backend=kind, direction="send")
    timed = _sample("disagg_kv_transfer_seconds_count", backend=kind)
    src, dst = [3, 0, 11, 5], [7, 2, 9, 15]
    handle = sender.send("decode-0", "req-all", src, dst)
    assert handle.wait(20) == "done", handle
    assert (
        _sample("disagg_kv_transfer_bytes_total", backend=kind, direction="send") == sent_bytes + handle.bytes
    )
    assert _sample("disagg_kv_transfer_seconds_count", backend=kind) == timed + 1
    assert handle.bytes == 4 * SHAPE["num_layers"] * KVLayout.from_tensor(before, MODEL).block_bytes
    assert sender.finish("decode-0", "req-all").wait(20) == "done"
    completed, failed = receiver.poll_until_settled("req-all")
    assert completed == ["req-all"] and failed == []
    after = receiver.dump()
    # Exactly the four blocks of every layer changed, to the sender's bytes; nothing else moved.
    assert torch.equal(after, _expected(before, sender.kv_cache, src, dst))


def test_layer_by_layer_completes_once_after_finish(sender, receiver):
    before = receiver.dump()
    src, dst = [1, 2, 4], [4, 1, 12]
    for layer in range(SHAPE["num_layers"]):
        handle = sender.send("decode-0", "req-layers", src, dst, layers=range(layer, layer + 1))
        assert handle.wait(20) == "done", handle
    # Every layer has landed, but only `finish` says no further send follows.
    assert receiver.poll(0.3) == ([], [])
    assert torch.equal(receiver.dump(), _expected(before, sender.kv_cache, src, dst))
    assert sender.finish("decode-0", "req-layers").wait(20) == "done"
    completed, failed = receiver.poll_until_settled("req-layers")
    assert completed == ["req-layers"] and failed == []


def test_partial_layers_leave_other_layers_untouched(sender, receiver):
    before = receiver.dump()
    handles = [
        sender.send("decode-0", "req-part", [6], [3], layers=[2]),
        sender.send("decode-0", "req-part", [7], [0], layers=[0]),
    ]
    assert [h.wait(20) for h in handles] == ["done", "done"]
    assert sender.finish("decode-0", "req-part").wait(20) == "done"
    completed, _ = receiver.poll_until_settled("req-part")
    assert completed == ["req-part"]
    expected = _expected(before, sender.kv_cache, [6], [3], layers=[2])
    expected = _expected(expected, sender.kv_cache, [7], [0], layers=[0])
    assert torch.equal(receiver.dump(), expected)


def test_abort_reaches_the_receiver(sender, receiver):
    sender.send("decode-0", "req-abort", [0], [0], layers=[0]).wait(20)
    assert sender.abort("decode-0", "req-abort", "prefill cancelled").wait(20) == "done"
    completed, failed = receiver.poll_until_settled("req-abort")
    assert completed == [] and failed == [("req-abort", "aborted: prefill cancelled")]


def test_bad_block_ids_are_refused_before_sending(sender):
    with pytest.raises(ValueError, match="dst_block_ids"):
        sender.send("decode-0", "req-bad", [0], [SHAPE["num_blocks"]])
    with pytest.raises(ValueError, match="block ids"):
        sender.send("decode-0", "req-bad", [12], [0])
    with pytest.raises(UnknownPeer):
        sender.send("nobody", "req-bad", [0], [0])


def test_incompatible_handshake_is_rejected(kind, sender):
    other = make_cache(seed=3, head_dim=16)
    transport = create_transport(kind, other, KVLayout.from_tensor(other, MODEL), name="decode-9",
                                 **({"advertise_address": "127.0.0.1:1"} if kind == "grpc" else {}))  # fmt: skip
    try:
        with pytest.raises(IncompatiblePeer, match="head_dim: local 8, peer 16"):
            sender.add_peer("decode-9", transport.handshake_payload())
        assert not sender.has_peer("decode-9")
    finally:
        transport.close()
    with pytest.raises(IncompatiblePeer, match="KV transport differs"):
        wrong = create_transport(
            "grpc" if kind == "nixl" else "nixl", other, KVLayout.from_tensor(other, MODEL), "x"
        )
        try:
            sender.add_peer("decode-9", wrong.handshake_payload())
        finally:
            wrong.close()


def test_receiver_dying_mid_transfer_gives_error_not_hang(kind, sender, receivers):
    doomed = receivers[1]
    sender.add_peer("decode-doomed", doomed.payload)
    first = sender.send("decode-doomed", "req-doomed", [0, 1], [2, 3], layers=[0])
    assert first.wait(20) == "done", first
    doomed.kill()
    state = "done"
    for layer in range(1, SHAPE["num_layers"]):  # the next layer finds the peer gone
        handle = sender.send("decode-doomed", "req-doomed", [0, 1], [2, 3], layers=[layer], timeout=10)
        state = handle.wait(15)
        if state != "done":
            break
    assert state == "error", handle
    assert handle.error_kind in ("disconnect", "timeout"), handle
    # The cached handshake was evicted: the caller must handshake again.
    assert not sender.has_peer("decode-doomed")
    with pytest.raises(UnknownPeer):
        sender.send("decode-doomed", "req-doomed", [0], [0])
    closing = sender.finish("decode-doomed", "req-doomed")
    assert closing.state == "error" and closing.error_kind == "aborted"
