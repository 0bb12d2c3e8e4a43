"""The native bf16 kernels against float32 twins computed from the same bf16 inputs.

Widening bf16 to float32 is exact, so a twin run in float32 on the widened inputs is what each
kernel computes before its one rounding to bf16; the kernel may differ from it by that rounding
(half a unit in the last place: a relative 2^-9, bf16 keeping 8 significant bits) and by float32
summation order (relative ~1e-7 per term, far below it). Hence rtol = 2^-8 (one unit, twice the
rounding) and an atol only for sums that cancel (the GEMV: float32 sums of K exact products
whose order differs, ~sqrt(K) * 2^-24 of the largest term). A wrong element, a wrong row or
block, a missing bias or scale is off by whole units and fails.
"""

from __future__ import annotations

import needs
import pytest
import torch
import torch.nn.functional as F
from triton_cases import case_id, paged_cache

from disagg.kernels import cpu_bf16, cpu_native, native_build, quantized, torch_ops

pytestmark = needs.native

ONE_UNIT = 2.0**-8  # relative: one unit in the last place of bf16 (8 significant bits)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=ONE_UNIT, atol=atol)


def _bf16(*shape, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


# K: below one 32-value step, one step and one past, two steps (the unrolled loop) and one past,
# a model width with a ragged tail; N: a row, a few, past a thread's chunk of 32 rows.
@pytest.mark.parametrize("k", [5, 32, 33, 64, 65, 781], ids=case_id)
@pytest.mark.parametrize("n", [1, 3, 67], ids=case_id)
def test_gemv_matches_float32_on_ragged_shapes(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, bias = _bf16(n, k, gen=gen, scale=k**-0.5), _bf16(n, gen=gen)
    for batch in (1, 2, 3, 4, 5, 8, 9):  # groups of four inputs per weight row, and remainders
        x = _bf16(batch, k, gen=gen)
        atol = k**0.5 * 2**-20
        for portable in (False, True):  # the portable loop is what CPUs without AVX-512 BF16 run
            _close(cpu_bf16.gemv(x, w, portable=portable), F.linear(x.float(), w.float()), atol)
            _close(
                cpu_bf16.gemv(x, w, bias, portable=portable),
                F.linear(x.float(), w.float(), bias.float()),
                atol,
            )


@pytest.mark.parametrize(("kernel", "rows"), [("gemv", 3), pytest.param("gemm_amx", 40, marks=needs.amx)])
def test_split_over_threads_equals_one_thread(monkeypatch, kernel, rows):
    gen = torch.Generator().manual_seed(1)
    w, x = _bf16(300, 96, gen=gen), _bf16(rows, 96, gen=gen)
    product = getattr(cpu_bf16, kernel)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = product(x, w)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(product(x, w), one)


def test_gemv_refuses_bad_inputs():
    gen = torch.Generator().manual_seed(2)
    w, x = _bf16(8, 16, gen=gen), _bf16(2, 16, gen=gen)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_bf16.gemv(x, w[:, :15].contiguous())
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_bf16.gemv(x, w, _bf16(7, gen=gen))
    with pytest.raises(ValueError, match="weight: .*bfloat16"):
        cpu_bf16.gemv(x, w.float())
    with pytest.raises(ValueError, match="x: .*contiguous"):
        cpu_bf16.gemv(_bf16(16, 2, gen=gen).t(), w)


# M: below, at and past the register tiles' 3 / 6 inputs and one block of inputs (128 / 256 rows);
# N: past the 4-row tiles and a thread's 64 rows; K: past the 8 / 16-value vectors, with a tail.
@pytest.mark.parametrize("m", [1, 7, 300], ids=case_id)
@pytest.mark.parametrize("n,k", [(3, 5), (67, 33), (130, 781)], ids=case_id)
def test_gemm_matches_float32_on_ragged_shapes(m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n * 1000 + k)
    w, bias, x = _bf16(n, k, gen=gen, scale=k**-0.5), _bf16(n, gen=gen), _bf16(m, k, gen=gen)
    atol = k**0.5 * 2**-20
    _close(cpu_bf16.gemm(x, w), F.linear(x.float(), w.float()), atol)
    _close(cpu_bf16.gemm(x, w, bias), F.linear(x.float(), w.float(), bias.float()), atol)


def test_gemm_of_no_products_is_the_bias():
    gen = torch.Generator().manual_seed(5)
    bias = _bf16(5, gen=gen)
    assert torch.equal(cpu_bf16.gemm(_bf16(3, 0, gen=gen), _bf16(5, 0, gen=gen), bias), bias.expand(3, 5))
    assert cpu_bf16.gemm(_bf16(0, 4, gen=gen), _bf16(5, 4, gen=gen)).shape == (0, 5)


def test_gemm_refuses_bad_inputs():
    gen = torch.Generator().manual_seed(4)
    w, x = _bf16(8, 16, gen=gen), _bf16(20, 16, gen=gen)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_bf16.gemm(x, w[:, :15].contiguous())
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_bf16.gemm(x, w, _bf16(7, gen=gen))
    with pytest.raises(ValueError, match="x: .*bfloat16"):
        cpu_bf16.gemm(x.float(), w)


@needs.amx
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 16, 32),
        (2, 32, 64),
        (16, 96, 576),
        (17, 40, 48),
        (33, 77, 40),
        (64, 33, 100),
        (5, 3, 7),
        (130, 50, 64),
    ],
)
def test_the_amx_gemm_equals_float32_products_rounded_once(m, n, k):
    """Whole and partial tiles: rows of W past a 16- or 32-row block, K not a multiple of 32, inputs
    past a 16- or 32-row block; with and without bias. float32 sums: within one bf16 rounding."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w, bias, x = _bf16(n, k, gen=gen), _bf16(n, gen=gen), _bf16(m, k, gen=gen)
    for b in (None, bias):
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        got = cpu_bf16.gemm_amx(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)
    assert cpu_bf16.gemm_amx(x[:0], w).shape == (0, n)


@needs.amx
def test_the_amx_gemm_rounds_to_nearest_even_keeping_subnormals_and_nan():
    """Small integers make every sum exact, so the result is the float32 value rounded once:
    ties go to even, a subnormal bias stays subnormal, a NaN bias gives NaN (torch's bf16
    conversion rounds the same way)."""
    gen = torch.Generator().manual_seed(11)
    m, n, k = 20, 48, 64
    x = torch.randint(-8, 9, (m, k), generator=gen).to(torch.bfloat16)
    w = torch.randint(-8, 9, (n, k), generator=gen).to(torch.bfloat16)
    bias = torch.randint(-3, 4, (n,), generator=gen).float() + 0.5  # x.5 after large sums: ties
    bias[5], bias[6] = 2.0**-130, -(2.0**-128)  # subnormal in float32 and in bf16
    bias[7] = float("nan")
    want = (F.linear(x.float(), w.float()) + bias.bfloat16().float()).bfloat16()
    got = cpu_bf16.gemm_amx(x, w, bias.bfloat16())
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[:, 7].all()
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))


@needs.amx
def test_linear_takes_the_amx_gemm_between_its_row_limits():
    gen = torch.Generator().manual_seed(5)
    w, bias = _bf16(40, 48, gen=gen), _bf16(40, gen=gen)
    lo, hi = quantized.BF16_AMX_MIN_ROWS, quantized.BF16_AMX_MAX_ROWS
    for m, want in (
        (lo - 1, cpu_bf16.gemv),
        (lo, cpu_bf16.gemm_amx),
        (hi, cpu_bf16.gemm_amx),
        (hi + 1, F.linear),
    ):
        x = _bf16(m, 48, gen=gen)
        assert torch.equal(quantized.linear(x, w, bias), want(x, w, bias)), m


def test_linear_takes_the_bf16_gemv_up_to_its_row_limit(monkeypatch):
    monkeypatch.setattr(native_build, "amx_usable", lambda: False)  # where AMX is, BF16_AMX_* apply
    limit = quantized.BF16_GEMV_MAX_ROWS
    gen = torch.Generator().manual_seed(3)
    w, bias, x = _bf16(40, 48, gen=gen), _bf16(40, gen=gen), _bf16(limit + 1, 48, gen=gen)
    assert torch.equal(quantized.linear(x[:limit], w, bias), cpu_bf16.gemv(x[:limit].contiguous(), w, bias))
    # beyond: oneDNN where the CPU multiplies bf16 itself, else the native GEMM (torch's converts
    # as it goes, an eighth of its float32 speed)
    for native_dot in (True, False):
        monkeypatch.setattr(cpu_bf16, "dot_native", lambda native_dot=native_dot: native_dot)
        want = F.linear(x, w, bias) if native_dot else cpu_bf16.gemm(x, w, bias)
        assert torch.equal(quantized.linear(x, w, bias), want)


def test_8bit_weights_widen_to_bf16_exactly(monkeypatch):
    """Every int8 value and every finite e4m3 value is a bf16 value: widening is exact, over
    chunks split between threads as in one thread."""
    ints = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).repeat(700)  # > one 64 Ki chunk
    got = cpu_bf16.widen_8bit(ints)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), ints.float())
    fp8 = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = fp8[~fp8.float().isnan()]
    assert torch.equal(cpu_bf16.widen_8bit(finite.contiguous()).float(), finite.float())
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(cpu_bf16.widen_8bit(ints), got)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        cpu_bf16.widen_8bit(ints.float())


def test_scale_columns_is_the_float32_product_with_bias():
    g = torch.Generator().manual_seed(5)
    y = torch.randn(37, 300, generator=g).bfloat16()
    scale, bias = torch.rand(300, generator=g), torch.randn(300, generator=g)
    torch.testing.assert_close(cpu_bf16.scale_columns(y, scale), y.float() * scale, rtol=0, atol=0)
    torch.testing.assert_close(cpu_bf16.scale_columns(y, scale, bias), y.float() * scale + bias)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_bf16.scale_columns(y, scale[:7])


@pytest.mark.parametrize("amx", [True, False], ids=["amx-if-usable", "torch-bf16-gemm"])
def test_scaled_linear_bf16_rounds_only_inputs_and_products(monkeypatch, amx):
    """W8A16 equals the float32 product of the bf16-rounded inputs with the exact 8-bit values, up
    to (through torch's bf16 GEMM) the product's one rounding to bf16, then scaled in float32."""
    if not amx:
        monkeypatch.setattr(native_build, "amx_usable", lambda: False)
    g = torch.Generator().manual_seed(6)
    w = quantized.QuantizedWeight(
        torch.randint(-127, 128, (96, 200), generator=g, dtype=torch.int8), torch.rand(96, generator=g) + 0.5
    )
    x, bias = torch.randn(70, 200, generator=g), torch.randn(96, generator=g)
    exact = x.bfloat16().float() @ w.data.float().T
    got = quantized.scaled_linear_bf16(x, w, bias)
    bound = ONE_UNIT * exact.abs() * w.scale + 1e-4
    assert ((got - (exact * w.scale + bias)).abs() <= bound).all()


def test_add_rms_norm_matches_float32_and_rounds_the_residual_like_torch():
    gen = torch.Generator().manual_seed(4)
    x, res, weight = _bf16(5, 97, gen=gen), _bf16(5, 97, gen=gen), _bf16(97, gen=gen)
    want_sum = x + res  # torch's bf16 addition: the float32 sum rounded once, as the kernel stores it
    want = F.rms_norm(want_sum.float(), (97,), weight.float(), 1e-5)
    got = cpu_bf16.add_rms_norm(x, weight, 1e-5, res)
    _close(got, want)
    assert torch.equal(res, want_sum)
    _close(cpu_bf16.add_rms_norm(x, weight, 1e-5), F.rms_norm(x.float(), (97,), weight.float(), 1e-5))
    with pytest.raises(ValueError, match="residual"):
        cpu_bf16.add_rms_norm(x, weight, 1e-5, res[:2])
    with pytest.raises(ValueError, match="weight"):
        cpu_bf16.add_rms_norm(x, weight[:96], 1e-5)
    with pytest.raises(ValueError, match="x: .*bfloat16"):
        cpu_bf16.add_rms_norm(x.float(), weight, 1e-5)


def test_silu_and_mul_matches_float32_over_the_whole_exp_range():
    gate = torch.linspace(-120, 120, 4001)
    x = torch.cat([gate, torch.linspace(-3, 3, 4001)]).view(1, -1).bfloat16()
    # exp_approx's relative 1e-6 is far below one bf16 unit
    _close(cpu_bf16.silu_and_mul(x), torch_ops.silu_and_mul(x.float()), atol=1e-30)


@pytest.mark.parametrize("q_heads,kv_heads,d", [(4, 4, 64), (8, 2, 64), (6, 3, 80)], ids=case_id)
def test_rotary_write_kv_matches_float32(q_heads, kv_heads, d):
    gen = torch.Generator().manual_seed(6)
    page, tokens = 16, 7
    cos_sin = torch.randn(100, d, generator=gen)
    qkv = _bf16(tokens, (q_heads + 2 * kv_heads) * d, gen=gen)
    positions = torch.tensor([0, 5, 17, 99, 3, 3, 42])
    slots = torch.tensor([0, 17, 33, -1, 2, 47, 16])  # one token not written
    cache = _bf16(3, 2, page, kv_heads, d, gen=gen)
    want_qkv, want_cache = qkv.float(), cache.float()
    q = want_qkv[:, : q_heads * d].view(tokens, q_heads, d)
    k = want_qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = want_qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d)
    torch_ops.rotary_embedding(positions, q, k, cos_sin)
    torch_ops.write_kv_cache(k, v, want_cache, slots)
    cpu_bf16.rotary_write_kv(qkv, cos_sin, positions, cache, slots, q_heads, kv_heads)
    _close(qkv, want_qkv, atol=1e-5)
    _close(cache, want_cache, atol=1e-5)
    # the cache holds exactly the rotated bf16 k and v of the written tokens
    got_k = qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    got_v = qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, page)
            assert torch.equal(cache[block, 0, offset], got_k[t]) and torch.equal(
                cache[block, 1, offset], got_v[t]
            )
    with pytest.raises(ValueError, match="int64"):
        cpu_bf16.rotary_write_kv(qkv, cos_sin, positions.int(), cache, slots, q_heads, kv_heads)
    with pytest.raises(ValueError, match="heads"):
        cpu_bf16.rotary_write_kv(qkv, cos_sin, positions, cache, slots, q_heads + 1, kv_heads)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        cpu_bf16.rotary_write_kv(qkv, cos_sin.bfloat16(), positions, cache, slots, q_heads, kv_heads)


@pytest.mark.parametrize("page", [16, 32], ids=case_id)
@pytest.mark.parametrize("head_dim", [64, 128, 80], ids=case_id)
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (8, 2), (8, 1), (9, 3)], ids=case_id)
def test_decode_attention_matches_float32(page, head_dim, q_heads, kv_heads):
    # lengths of 1, on and one past a block boundary, and a long one, in one ragged batch
    seq_lens = [1, page, page + 1, 3 * page - 1, 5 * page + 7]
    gen = torch.Generator().manual_seed(page + head_dim + kv_heads)
    cache, tables = paged_cache(seq_lens, page, kv_heads, head_dim, torch.bfloat16, gen)
    q = _bf16(len(seq_lens), q_heads, head_dim, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = torch_ops.decode_attention(q.float(), cache.float(), tables, lens, scale)
    got = cpu_bf16.PagedDecodeAttention(tables, lens, q_heads, kv_heads)(q, cache, scale)
    _close(got, want, atol=1e-5)


def test_decode_attention_reads_a_strided_q_and_splits_over_threads(monkeypatch):
    seq_lens = [40, 3, 77, 16, 9, 120, 1, 64]
    gen = torch.Generator().manual_seed(1)
    cache, tables = paged_cache(seq_lens, 16, 2, 64, torch.bfloat16, gen)
    qkv = _bf16(len(seq_lens), (4 + 2 * 2) * 64, gen=gen)
    q = qkv[:, : 4 * 64].view(len(seq_lens), 4, 64)  # the model passes a column slice of qkv
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    one = cpu_bf16.PagedDecodeAttention(tables, lens, 4, 2)
    want = torch_ops.decode_attention(q.float(), cache.float(), tables, lens, 0.125)
    _close(one(q, cache, 0.125), want, atol=1e-5)
    monkeypatch.setattr(cpu_native, "_PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    split = cpu_bf16.PagedDecodeAttention(tables, lens, 4, 2)
    assert one.threads == 1 and split.threads == 3
    assert torch.equal(split(q, cache, 0.125), one(q, cache, 0.125))


def test_decode_attention_refuses_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    cache, tables = paged_cache([4], 16, 2, 64, torch.bfloat16, gen)
    attn = cpu_bf16.PagedDecodeAttention(tables, torch.tensor([0], dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        attn(_bf16(1, 4, 64, gen=gen), cache, 0.125)
    attn = cpu_bf16.PagedDecodeAttention(tables, torch.tensor([4], dtype=torch.int32), 4, 2)
    with pytest.raises(TypeError, match="bfloat16"):
        attn(torch.randn(1, 4, 64), cache.float(), 0.125)
    with pytest.raises(ValueError, match="plan"):
        attn(_bf16(2, 4, 64, gen=gen), cache, 0.125)
