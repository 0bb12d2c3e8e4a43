"""Decode CUDA graphs: bucket and padding logic everywhere, capture and replay on CUDA only."""

from __future__ import annotations

import pytest
import torch

from disagg.worker.model.cuda_graphs import (
    CudaGraphRunner,
    DecodeInputBuffers,
    batch_size_buckets,
    bucket_for,
    graphs_enabled_from_env,
)
from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.model.loader import load_model


def test_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(8) == [1, 2, 4, 8]
    assert batch_size_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_size_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_size_buckets(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]
    with pytest.raises(ValueError, match="max_batch"):
        batch_size_buckets(0)
    buckets = batch_size_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 17, 40, 41)] == [1, 4, 8, 16, 24, 40, None]


def test_env_flag(monkeypatch):
    monkeypatch.delenv("DISAGG_CUDA_GRAPHS", raising=False)
    assert graphs_enabled_from_env()
    monkeypatch.setenv("DISAGG_CUDA_GRAPHS", "0")
    assert not graphs_enabled_from_env()
    monkeypatch.setenv("DISAGG_CUDA_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="DISAGG_CUDA_GRAPHS"):
        graphs_enabled_from_env()


def decode_batch(n: int, width: int) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.arange(10, 10 + n),
        positions=torch.arange(20, 20 + n),
        slot_mapping=torch.arange(100, 100 + n),
        seq_lens=torch.arange(21, 21 + n, dtype=torch.int32),
        block_tables=torch.arange(n * width, dtype=torch.int32).view(n, width) + 1,
        logits_indices=torch.arange(n),
        is_prefill=False,
    )


def test_padding_rows_are_inert():
    buffers = DecodeInputBuffers(max_batch=8, max_blocks_per_seq=6, device="cpu", scratch_block=3)
    buffers.load(decode_batch(7, 5), bucket=8)  # an earlier, larger step leaves stale rows
    batch = decode_batch(3, 4)
    padded = buffers.load(batch, bucket=4)
    assert padded.num_seqs == 4 and not padded.is_prefill
    assert padded.input_ids.tolist() == [10, 11, 12, 0]
    assert padded.positions.tolist() == [20, 21, 22, 0]
    assert padded.slot_mapping.tolist() == [100, 101, 102, -1]
    assert padded.seq_lens.tolist() == [21, 22, 23, 1]
    assert torch.equal(padded.block_tables[:3, :4], batch.block_tables)
    assert padded.block_tables[3, 0] == 3
    assert padded.logits_indices.tolist() == [0, 1, 2, 3]
    # the views alias the static buffers: a graph captured on them sees every later load
    assert padded.input_ids.data_ptr() == buffers.input_ids.data_ptr()


def test_unfit_batches_are_refused():
    buffers = DecodeInputBuffers(max_batch=4, max_blocks_per_seq=2, device="cpu")
    with pytest.raises(ValueError, match="block_tables"):
        buffers.load(decode_batch(2, 3), bucket=2)
    with pytest.raises(ValueError, match="seq_lens"):
        buffers.load(decode_batch(5, 2), bucket=5)
    with pytest.raises(ValueError, match="bucket"):
        buffers.load(decode_batch(3, 2), bucket=2)
    prefill = decode_batch(2, 2)
    prefill.is_prefill = True
    with pytest.raises(ValueError, match="is_prefill"):
        buffers.check(prefill)
    runner = CudaGraphRunner(lambda b, kv: None, torch.zeros(1), 4, 2, "cpu", enabled=True)
    assert not runner.enabled and not runner.can_run(decode_batch(2, 2))  # no CUDA here


def _prefilled(model_dir, paged, device):
    """The tiny model, its cache, and a decode step for 3 sequences after their prompts."""
    model, _ = load_model(model_dir, device=device)
    kv = model.allocate_kv_cache(num_blocks=16, block_size=16)
    seqs = paged(16)
    prompts = [list(range(5, 22)), list(range(30, 46)), [7]]  # one block + 1, one block, one token
    model.forward(seqs.prefill(list(enumerate(prompts))).to(device), kv)
    step = seqs.decode([(0, 3), (1, 4), (2, 5)]).to(device)
    return model, kv, step


def test_padded_decode_gives_the_same_logits_and_cache(tiny_llama_dir, paged):
    model, kv, step = _prefilled(tiny_llama_dir, paged, "cpu")
    kv_padded = kv.clone()
    expected = model.forward(step, kv)
    buffers = DecodeInputBuffers(max_batch=8, max_blocks_per_seq=4, device="cpu", scratch_block=15)
    logits = model.forward(buffers.load(step, bucket=8), kv_padded)
    torch.testing.assert_close(logits[step.logits_indices], expected)
    # the real rows wrote the same K/V (up to matmul rounding at another batch size) ...
    torch.testing.assert_close(kv_padded, kv)
    # ... and nothing else changed: padded rows wrote nothing
    blocks, offsets = step.slot_mapping // 16, step.slot_mapping % 16
    for cache in (kv, kv_padded):
        cache[:, blocks, :, offsets] = 0
    assert torch.equal(kv_padded, kv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_capture_and_replay_match_eager(tiny_llama_dir, paged, monkeypatch):
    monkeypatch.setenv("DISAGG_KERNELS", "triton")
    model, kv, step = _prefilled(tiny_llama_dir, paged, "cuda")
    runner = CudaGraphRunner(
        model.forward, kv, max_batch=8, max_blocks_per_seq=4, device="cuda", scratch_block=15
    )
    runner.capture()
    assert runner.captured_buckets == [1, 2, 4, 8]
    kv_eager = kv.clone()
    assert runner.can_run(step)
    replayed = runner.run(step)
    torch.testing.assert_close(replayed, model.forward(step, kv_eager), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(kv, kv_eager)
    # a second step through the same graph sees the new inputs
    two = ForwardBatch(**{**step.__dict__, "input_ids": step.input_ids.flip(0)})
    torch.testing.assert_close(runner.run(two), model.forward(two, kv_eager.clone()), atol=1e-3, rtol=1e-3)
