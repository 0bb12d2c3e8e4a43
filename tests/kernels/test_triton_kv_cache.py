"""The slot-mapping scatter into paged blocks against the torch twin."""

from __future__ import annotations

import pytest
import torch
from triton_cases import case_id, paged_cache, slots_for

from disagg.kernels import torch_ops
from disagg.kernels.triton_kv_cache import write_kv_cache


@pytest.mark.parametrize(
    "page,head_dim,kv_heads,src_dtype,cache_dtype",
    [
        (16, 64, 1, torch.float32, torch.float32),
        (32, 128, 2, torch.bfloat16, torch.bfloat16),
        (16, 128, 8, torch.float16, torch.float16),
        (32, 64, 4, torch.float16, torch.float32),
    ],
    ids=case_id,
)
def test_scatter_matches_twin(page, head_dim, kv_heads, src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    lens = [1, page, page + 1]
    cache, tables = paged_cache(lens, page, kv_heads, head_dim, cache_dtype, gen)
    # a prefill-like step: the last tokens of each sequence, plus padding rows (slot -1)
    slots = slots_for(tables, page, 0, range(0, 1)) + [-1]
    slots += slots_for(tables, page, 1, range(page - 3, page)) + slots_for(
        tables, page, 2, range(page - 1, page + 1)
    )
    slots += [-1, -7]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(src_dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(src_dtype)
    expected = cache.clone()
    torch_ops.write_kv_cache(k, v, expected, slot_mapping)
    write_kv_cache(k, v, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_strided_key_value_views():
    # k and v as slices of one fused projection output
    gen = torch.Generator().manual_seed(1)
    cache, tables = paged_cache([20], 16, 2, 64, torch.float32, gen)
    kv = torch.randn(20, 2 * 2 * 64, generator=gen)
    k, v = kv[:, :128].view(20, 2, 64), kv[:, 128:].view(20, 2, 64)
    slot_mapping = torch.tensor(slots_for(tables, 16, 0, range(20)), dtype=torch.int64)
    expected = cache.clone()
    torch_ops.write_kv_cache(k, v, expected, slot_mapping)
    write_kv_cache(k, v, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_bad_shapes_name_the_field():
    cache = torch.zeros(4, 2, 16, 2, 64)
    k = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="key/value"):
        write_kv_cache(k[:, :1], k[:, :1], cache, torch.zeros(3, dtype=torch.int64))
