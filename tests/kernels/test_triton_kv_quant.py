"""The Triton kernels over a quantized KV cache against the torch twin, in the interpreter."""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import torch_ops
from disagg.kernels.kv_quant import KVQuantFormat, QuantizedKVStep
from disagg.kernels.triton_kv_quant import decode_attention_quantized, write_kv_quantized


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("page,kv_heads,head_dim", [(16, 2, 64), (8, 3, 32)])
def test_write_matches_the_twin(name, page, kv_heads, head_dim):
    fmt = KVQuantFormat(name, page, kv_heads, head_dim)
    g = torch.Generator().manual_seed(page + kv_heads)
    t = 11
    k = torch.randn(t, kv_heads, head_dim, generator=g) * torch.rand(t, 1, 1, generator=g) * 4
    v = torch.randn(t, kv_heads, head_dim, generator=g)
    k[3] = 0.0  # an all-zero row: the tiny scale, values 0
    k[5, 0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0]) * (k[5, 0].abs().max() / 127)  # near ties
    slots = torch.randperm(4 * page, generator=g)[:t]
    slots[7] = -1
    got, want = fmt.allocate(1, 4, "cpu")[0], fmt.allocate(1, 4, "cpu")[0]
    write_kv_quantized(k, v, got, slots, fmt)
    fmt.write(k, v, want, slots)
    torch.testing.assert_close(fmt.scales(got), fmt.scales(want), rtol=1e-6, atol=0)
    a, b = fmt.values(got).float(), fmt.values(want).float()
    # the same grid point but where x / scale lands within rounding of a midpoint
    assert float((a != b).float().mean()) < 0.005
    step = 1.0 if name == "int8" else b.abs() * 2**-3 + 2**-9
    assert bool(((a - b).abs() <= step).all())


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("page,group,head_dim", [(16, 1, 64), (32, 4, 128), (8, 8, 32)])
def test_decode_attention_matches_the_twin(name, page, group, head_dim):
    kv_heads = 2
    fmt = KVQuantFormat(name, page, kv_heads, head_dim)
    g = torch.Generator().manual_seed(page + group)
    lens = [1, page, page + 1, 3 * page - 5]
    per = [-(-n // page) for n in lens]
    ids = torch.randperm(sum(per) + 2, generator=g)
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per):
        tables[i, :n] = ids[at : at + n]
        at += n
    cache = fmt.allocate(1, ids.numel(), "cpu")[0]
    kv = torch.randn(ids.numel() * page, kv_heads, head_dim, generator=g) * 2
    fmt.write(kv, -kv.roll(1, 0), cache, torch.arange(ids.numel() * page))
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    step = QuantizedKVStep(fmt, tables, seq_lens, torch.float32)
    want = torch_ops.decode_attention(q, step.layer_cache(cache), step.tables, seq_lens, scale)
    got = decode_attention_quantized(q, cache, tables, seq_lens, scale, fmt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused():
    fmt = KVQuantFormat("int8", 4, 2, 8)
    cache = fmt.allocate(1, 2, "cpu")[0]
    with pytest.raises(ValueError, match="key/value"):
        write_kv_quantized(
            torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), cache, torch.zeros(1, dtype=torch.int64), fmt
        )
    with pytest.raises(ValueError, match="q must be"):
        decode_attention_quantized(torch.zeros(1, 3, 8), cache, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), 1.0, fmt)  # fmt: skip
