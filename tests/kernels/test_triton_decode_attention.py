"""Paged decode attention (single pass and split-KV) against the torch twin, in the interpreter."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_cases import TOLERANCE, case_id, paged_cache

from disagg.kernels import torch_ops
from disagg.kernels.triton_decode_attention import (
    MIN_PARTITION_TOKENS,
    choose_num_splits,
    decode_attention,
    paged_decode_attention,
)

KV_HEADS = 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# every (block size, head dim, GQA ratio) once, the dtypes rotated through them
GRID = [
    (page, head_dim, group, DTYPES[(i + i // 3) % 3])
    for i, (page, head_dim, group) in enumerate(itertools.product((16, 32), (64, 128), (1, 4, 8)))
]


def decode_case(page, head_dim, group, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # a length-1 sequence, one ending exactly on a block boundary, one a token past it, a longer one
    lens = [1, page, page + 1, 3 * page - 5]
    cache, tables = paged_cache(lens, page, KV_HEADS, head_dim, dtype, gen)
    q = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5


@pytest.mark.parametrize("page,head_dim,group,dtype", GRID, ids=case_id)
def test_single_pass_matches_twin(page, head_dim, group, dtype):
    q, cache, tables, lens, scale = decode_case(page, head_dim, group, dtype)
    expected = torch_ops.decode_attention(q, cache, tables, lens, scale)
    got = paged_decode_attention(q, cache, tables, lens, scale, num_splits=1)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("page,head_dim,group,dtype", GRID[::2], ids=case_id)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_matches_single_pass_and_twin(page, head_dim, group, dtype, num_splits):
    q, cache, tables, lens, scale = decode_case(page, head_dim, group, dtype, seed=1)
    expected = torch_ops.decode_attention(q, cache, tables, lens, scale)
    single = paged_decode_attention(q, cache, tables, lens, scale, num_splits=1)
    split = paged_decode_attention(q, cache, tables, lens, scale, num_splits=num_splits)
    torch.testing.assert_close(split, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(split, single, **TOLERANCE[dtype])


def test_split_partitions_past_a_short_sequence_are_ignored():
    # 4 partitions over a 4-block table: the length-1 sequence leaves three of them empty
    q, cache, tables, lens, scale = decode_case(16, 64, 4, torch.float32, seed=2)
    got = paged_decode_attention(q, cache, tables, lens, scale, num_splits=4)
    torch.testing.assert_close(got, torch_ops.decode_attention(q, cache, tables, lens, scale))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_head_dim_not_a_power_of_two(num_splits):
    q, cache, tables, lens, scale = decode_case(16, 80, 2, torch.float32, seed=4)
    got = paged_decode_attention(q, cache, tables, lens, scale, num_splits=num_splits)
    torch.testing.assert_close(got, torch_ops.decode_attention(q, cache, tables, lens, scale))


def test_dispatch_signature_matches_twin():
    q, cache, tables, lens, scale = decode_case(32, 64, 4, torch.float32, seed=3)
    torch.testing.assert_close(
        decode_attention(q, cache, tables, lens, scale),
        torch_ops.decode_attention(q, cache, tables, lens, scale),
    )


def test_choose_num_splits():
    # a full device, or a short context, never splits
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_context=32768, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=MIN_PARTITION_TOKENS, num_sms=132) == 1
    # one long sequence: split until the device is busy, bounded by partition length and the cap
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=32768, num_sms=132) == 32
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_context=32768, num_sms=132) == 9
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=1024, num_sms=132) == 4


def test_bad_shapes_name_the_field():
    q, cache, tables, lens, scale = decode_case(16, 64, 1, torch.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, cache, tables, lens[:2], scale)
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(q[:, :1].repeat(1, 3, 1), cache, tables, lens, scale)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, cache, tables, lens, scale, num_splits=0)
