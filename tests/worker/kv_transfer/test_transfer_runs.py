"""Runs of adjacent regions: the pure run finding, and real transfers that send each run as one piece."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.worker.kv_transfer import KVLayout, create_transport
from disagg.worker.kv_transfer.nixl_transport import MERGE_RATIO
from disagg.worker.kv_transfer.region_runs import block_runs, find_runs, run_descriptors, segment_descriptors

from .transfer_peer import MODEL, SHAPE, Receiver, make_cache

# ---- pure logic ----------------------------------------------------------------------------------


def test_runs_break_where_either_side_stops_advancing_by_one():
    runs = find_runs([4, 5, 6, 9, 10, 2, 3], [0, 1, 2, 3, 7, 8, 9])
    # 4-6 -> 0-2 | 9 -> 3 (dst continues but src jumps) | 10 -> 7 (src continues, dst jumps) | 2-3 -> 8-9
    assert list(runs) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 2)]
    assert len(runs) == 4 and int(runs.lengths.sum()) == 7


def test_runs_of_descending_or_repeated_ids_do_not_merge():
    assert list(find_runs([5, 4, 3], [5, 4, 3])) == [(5, 5, 1), (4, 4, 1), (3, 3, 1)]
    assert list(find_runs([1, 1], [2, 3])) == [(1, 2, 1), (1, 3, 1)]


def test_runs_cross_layer_boundaries_when_flat_regions_touch():
    layout = KVLayout("m", "bfloat16", num_layers=3, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    regions = layout.region_indices(range(3), [0, 1, 2, 3])  # every block of every layer: one stretch
    assert list(find_runs(regions, regions)) == [(0, 0, 12)]
    partial = layout.region_indices(range(3), [2, 3])  # 2,3 | 6,7 | 10,11: layers do not touch
    assert list(find_runs(partial, partial)) == [(2, 2, 2), (6, 6, 2), (10, 10, 2)]


def test_empty_and_mismatched_inputs():
    assert len(find_runs([], [])) == 0
    with pytest.raises(ValueError, match="dst"):
        find_runs([1, 2], [1])


def test_run_descriptors_are_address_length_device_rows():
    runs = find_runs([3, 4, 8], [0, 1, 5])
    table = run_descriptors(1 << 20, runs.src_starts, runs.lengths, unit=256, device_id=2)
    assert table.dtype == np.uint64 and table.shape == (2, 3)
    assert table.tolist() == [[(1 << 20) + 3 * 256, 512, 2], [(1 << 20) + 8 * 256, 256, 2]]


def test_segment_descriptors_are_each_segment_of_each_region_region_major():
    segments = np.array([[16, 8], [48, 8]], dtype=np.uint64)  # (offset, length) inside a region
    table = segment_descriptors(4096, np.array([2, 0]), 64, segments, device_id=1)
    assert table.dtype == np.uint64
    assert table.tolist() == [[4096 + 128 + 16, 8, 1], [4096 + 128 + 48, 8, 1], [4096 + 16, 8, 1],
                              [4096 + 48, 8, 1]]  # fmt: skip


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([7, 8, 9, 2, 3, 5]) == [(7, 3), (2, 2), (5, 1)]


# ---- real transfers ------------------------------------------------------------------------------

NUM_BLOCKS = 12  # sender and receiver pools are the same size, so whole-pool sends are one region


@pytest.fixture(scope="module")
def receivers():
    pair = {kind: Receiver(kind, seed=1, num_blocks=NUM_BLOCKS) for kind in ("nixl", "grpc")}
    yield pair
    for r in pair.values():
        r.stop()


# (backend, descriptor mode, UCX threads): the default 2 threads, and one thread for the auto mode
SENDERS = [("nixl", "auto", None), ("nixl", "auto", 0), ("nixl", "prepped", None), ("nixl", "merged", None),
           ("grpc", None, None)]  # fmt: skip


@pytest.fixture(
    scope="module",
    params=SENDERS,
    ids=lambda s: f"{s[0]}-{s[1] or 'chunks'}" + ("" if s[2] is None else f"-t{s[2]}"),
)
def sender(request, receivers):
    kind, descriptors, threads = request.param
    cache = make_cache(seed=request.param_index + 2, num_blocks=NUM_BLOCKS)
    options = {"descriptors": descriptors} if descriptors else {}
    if threads is not None:
        options["threads"] = threads
    transport = create_transport(kind, cache, KVLayout.from_tensor(cache, MODEL), "prefill-runs", **options)
    transport.add_peer("decode", receivers[kind].payload)
    yield transport, receivers[kind]
    transport.close()


def _send_and_check(sender, receiver, tid, src, dst, layers=None):
    before = receiver.dump()
    handle = sender.send("decode", tid, src, dst, layers=layers)
    assert handle.wait(20) == "done", handle
    assert sender.finish("decode", tid).wait(20) == "done"
    completed, failed = receiver.poll_until_settled(tid)
    assert completed == [tid] and failed == []
    expected = before.clone()
    for layer in range(SHAPE["num_layers"]) if layers is None else layers:
        expected[layer, dst] = sender.kv_cache[layer, src]
    assert torch.equal(receiver.dump(), expected)


def test_mixed_runs_land_exactly_where_asked(sender):
    transport, receiver = sender
    src, dst = [0, 1, 2, 3, 7, 9, 10, 11], [4, 5, 6, 7, 0, 1, 2, 3]  # runs of 4, 1 and 3 per layer
    _send_and_check(transport, receiver, f"mixed-{id(transport)}", src, dst)
    if transport.backend == "nixl":
        regions, runs = len(src) * SHAPE["num_layers"], 3 * SHAPE["num_layers"]
        merged = transport.descriptors == "merged" or (
            transport.descriptors == "auto" and runs * MERGE_RATIO <= regions
        )
        assert transport.last_descriptors == (runs if merged else regions)


def test_whole_pool_crosses_layers_as_one_region(sender):
    transport, receiver = sender
    blocks = list(range(NUM_BLOCKS))
    _send_and_check(transport, receiver, f"whole-{id(transport)}", blocks, blocks)
    if transport.backend == "nixl" and transport.descriptors != "prepped":
        assert transport.last_descriptors == 1


def test_scattered_ids_and_partial_layers(sender):
    transport, receiver = sender
    src, dst = [11, 3, 5, 4], [2, 9, 0, 8]
    _send_and_check(transport, receiver, f"scattered-{id(transport)}", src, dst, layers=[2, 0])
    if transport.backend == "nixl" and transport.descriptors == "auto":
        assert transport.last_descriptors == 8  # nothing merges: the prepared per-region path


def test_unknown_descriptor_mode_is_refused():
    cache = make_cache(seed=9, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="descriptors"):
        create_transport("nixl", cache, KVLayout.from_tensor(cache, MODEL), "x", descriptors="fast")
    with pytest.raises(ValueError, match="threads"):
        create_transport("nixl", cache, KVLayout.from_tensor(cache, MODEL), "x", threads=-1)
