"""The native kernels over a quantized KV cache against the torch twin (`disagg.kernels.kv_quant`)."""

from __future__ import annotations

import needs
import pytest
import torch

from disagg.kernels import cpu_kv_quant, torch_ops
from disagg.kernels.kv_quant import KVQuantFormat, QuantizedKVStep

pytestmark = needs.native


def test_every_e4m3_value_and_the_midpoints_between_them_round_as_torch():
    """The native fp8 encoder against torch's cast, through the write: every finite e4m3 value,
    the midpoints between neighbours (ties to even) and values just off them."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 ... 448
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    d = 8  # each row: 7 values, then 448, so its scale is exactly 1 and the values go as they are
    values = torch.cat([values, values.new_zeros((-values.numel()) % (d - 1))]).view(-1, 1, d - 1)
    rows = torch.cat([values, torch.full((values.shape[0], 1, 1), 448.0)], -1)
    fmt = KVQuantFormat("fp8", block_size=rows.shape[0], num_kv_heads=1, head_dim=d)
    native, twin = fmt.allocate(1, 1, "cpu")[0], fmt.allocate(1, 1, "cpu")[0]
    write_native(rows, fmt, native)
    fmt.write(rows, rows, twin, torch.arange(rows.shape[0]))
    assert bool((fmt.scales(twin) == 1).all())
    assert torch.equal(fmt.scales(native), fmt.scales(twin))
    # equal values (a zero's sign may differ: both read as 0)
    assert torch.equal(fmt.values(native).float(), fmt.values(twin).float())


def write_native(kv: torch.Tensor, fmt: KVQuantFormat, layer_cache: torch.Tensor, q_heads: int = 1):
    """K = V = kv [T, Hkv, D] through the native write at position 0 (no rotation), slots 0..T-1."""
    t, hkv, d = kv.shape
    qkv = torch.cat([torch.zeros(t, q_heads * d), kv.reshape(t, -1), kv.reshape(t, -1)], 1).contiguous()
    cos_sin = torch.cat([torch.ones(1, d // 2), torch.zeros(1, d // 2)], 1)
    cpu_kv_quant.rotary_write_kv(
        qkv, cos_sin, torch.zeros(t, dtype=torch.int64), layer_cache, torch.arange(t), q_heads, hkv, fmt
    )


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_rotary_write_matches_the_twin(name):
    hq, hkv, d, bs = 4, 2, 64, 8
    fmt = KVQuantFormat(name, bs, hkv, d)
    g = torch.Generator().manual_seed(3)
    t = 21
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * torch.rand(t, 1, generator=g) * 5
    angles = torch.rand(64, d // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
    positions = torch.randint(0, 64, (t,), generator=g)
    slots = torch.randperm(6 * bs, generator=g)[:t]
    slots[4] = -1
    native, twin = fmt.allocate(1, 6, "cpu")[0], fmt.allocate(1, 6, "cpu")[0]
    ref = qkv.clone()
    cpu_kv_quant.rotary_write_kv(qkv, cos_sin, positions, native, slots, hq, hkv, fmt)
    q, k, v = (
        ref[:, : hq * d].view(t, hq, d),
        ref[:, hq * d : (hq + hkv) * d].view(t, hkv, d),
        ref[:, (hq + hkv) * d :],
    )
    torch_ops.rotary_embedding(positions, q, k, cos_sin)
    torch.testing.assert_close(qkv[:, : (hq + hkv) * d], ref[:, : (hq + hkv) * d], rtol=1e-6, atol=1e-6)
    fmt.write(k, v.view(t, hkv, d), twin, slots)
    torch.testing.assert_close(fmt.scales(native), fmt.scales(twin), rtol=1e-6, atol=0)
    # the same grid point, but where x / scale lands within rounding of a midpoint
    a, b = fmt.values(native).float(), fmt.values(twin).float()
    step = 1.0 if name == "int8" else b.abs() * 2**-3 + 2**-9
    assert bool(((a - b).abs() <= step).all())
    assert float((a != b).float().mean()) < 0.002


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 32), (6, 1, 128)])
def test_decode_attention_matches_the_twin(name, q_heads, kv_heads, head_dim):
    bs = 16
    seq_lens = [1, bs, bs + 1, 3 * bs - 1, 5 * bs + 7]
    fmt = KVQuantFormat(name, bs, kv_heads, head_dim)
    g = torch.Generator().manual_seed(q_heads + head_dim)
    blocks_per = [-(-n // bs) for n in seq_lens]
    perm = torch.randperm(sum(blocks_per) + 3, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = perm[at : at + n]
        at += n
    cache = fmt.allocate(1, perm.numel(), "cpu")[0]
    slots = torch.arange(perm.numel() * bs)
    kv = torch.randn(slots.numel(), kv_heads, head_dim, generator=g) * 3
    fmt.write(kv, kv.flip(0), cache, slots)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    step = QuantizedKVStep(fmt, tables, lens, torch.float32)
    want = torch_ops.decode_attention(q, step.layer_cache(cache), step.tables, lens, scale)
    got = cpu_kv_quant.QuantizedPagedDecodeAttention(fmt, tables, lens, q_heads, kv_heads)(q, cache, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_attention_over_one_token_reads_every_8_bit_value_exactly(name):
    """Over a single cached token the output is that token's V row: every byte value (but e4m3's
    NaNs), read back by the native kernel, equals torch's own conversion of it."""
    codes = torch.arange(256, dtype=torch.uint8)
    if name == "fp8":
        codes = codes[(codes & 127) != 127]
    d = 256
    codes = torch.cat([codes, codes.new_zeros(d - codes.numel())])
    fmt = KVQuantFormat(name, block_size=1, num_kv_heads=1, head_dim=d)
    cache = fmt.allocate(1, 1, "cpu")[0]
    fmt.values(cache, torch.uint8)[0, 1, 0, 0] = codes
    fmt.scales(cache).fill_(1.0)
    attn = cpu_kv_quant.QuantizedPagedDecodeAttention(fmt, torch.zeros(1, 1, dtype=torch.int32),
                                                      torch.ones(1, dtype=torch.int32), 1, 1)  # fmt: skip
    got = attn(torch.randn(1, 1, d), cache, 1.0)[0, 0]
    assert torch.equal(got, codes.view(fmt.value_dtype).float())


def test_bad_caches_are_refused():
    fmt = KVQuantFormat("int8", 4, 1, 8)
    attn = cpu_kv_quant.QuantizedPagedDecodeAttention(fmt, torch.zeros(1, 1, dtype=torch.int32),
                                                      torch.ones(1, dtype=torch.int32), 1, 1)  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache"):
        attn(torch.zeros(1, 1, 8), torch.zeros(2, fmt.region_bytes - 1, dtype=torch.uint8), 1.0)
    with pytest.raises(ValueError, match="kv_cache"):
        attn(torch.zeros(1, 1, 8), torch.zeros(2, fmt.region_bytes, dtype=torch.float32), 1.0)
