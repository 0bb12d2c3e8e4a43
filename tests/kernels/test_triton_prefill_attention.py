"""Varlen causal prefill attention (incl. chunked prefill over paged KV) against the torch twin."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_cases import TOLERANCE, case_id, prefill_case

from disagg.kernels import torch_ops
from disagg.kernels.triton_prefill_attention import prefill_attention, varlen_prefill_attention

KV_HEADS = 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRID = [
    (page, head_dim, group, DTYPES[(i + i // 3) % 3])
    for i, (page, head_dim, group) in enumerate(itertools.product((16, 32), (64, 128), (1, 4, 8)))
]


def chunks(page: int) -> tuple[list[int], list[int]]:
    """(earlier tokens in the cache, new tokens) per sequence: whole prompts of length 1, one
    block and one block + 1; chunks after a prefix ending on and one past a block boundary."""
    return [0, 0, 0, page, page + 1], [1, page, page + 1, 5, 2]


def run_both(q, k, v, cache, tables, cu, lens, **tiles):
    scale = q.shape[-1] ** -0.5
    expected = torch_ops.prefill_attention(q, k, v, cache, tables, cu, lens, scale)
    got = varlen_prefill_attention(q, k, v, cache, tables, cu, lens, scale, **tiles)
    return got, expected


@pytest.mark.parametrize("page,head_dim,group,dtype", GRID, ids=case_id)
def test_matches_twin(page, head_dim, group, dtype):
    context, new = chunks(page)
    case = prefill_case(context, new, page, KV_HEADS * group, KV_HEADS, head_dim, dtype)
    got, expected = run_both(*case)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=case_id)
def test_many_tiles_in_both_loops(dtype):
    # small tiles: several query tiles and several KV tiles over both the prefix and the chunk
    case = prefill_case([37, 0], [45, 33], 16, 4, 1, 64, dtype, seed=1)
    got, expected = run_both(*case, block_m=16, block_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_head_dim_not_a_power_of_two():
    case = prefill_case([0, 20], [9, 6], 16, 4, 2, 80, torch.float32, seed=3)
    got, expected = run_both(*case)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_default_tiles_and_an_empty_chunk():
    # a sequence with no new tokens this step produces no rows and disturbs nothing
    q, k, v, cache, tables, cu, lens = prefill_case(
        [0, 16, 0], [70, 0, 3], 16, 4, 2, 64, torch.float32, seed=2
    )
    scale = 64**-0.5
    got = prefill_attention(q, k, v, cache, tables, cu, lens, scale)
    torch.testing.assert_close(got, torch_ops.prefill_attention(q, k, v, cache, tables, cu, lens, scale))


def test_bad_shapes_name_the_field():
    q, k, v, cache, tables, cu, lens = prefill_case([0], [4], 16, 2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        varlen_prefill_attention(q, k, v, cache, tables, cu[:1], lens, 1.0)
    with pytest.raises(ValueError, match="kv_cache"):
        varlen_prefill_attention(q, k, v, cache[..., :32], tables, cu, lens, 1.0)
