"""The native small-M float32 GEMM against `F.linear`, and `linear` choosing it."""

from __future__ import annotations

import needs
import pytest
import torch
import torch.nn.functional as F
from triton_cases import TOLERANCE, case_id

from disagg.kernels import cpu_native, quantized

pytestmark = needs.native


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * k**-0.5  # outputs of order 1, as in a model
    bias = torch.randn(n, generator=gen)
    return x, w, bias


# K: below one vector, one vector and one float past, and a model's width plus a ragged tail;
# N: a single row, fewer than a tile (4), ragged past a thread's chunk (64), several chunks.
@pytest.mark.parametrize("k", [5, 16, 17, 781], ids=case_id)
@pytest.mark.parametrize("n", [1, 3, 67, 130], ids=case_id)
def test_matches_f_linear_on_ragged_shapes(n, k):
    for m in (1, 2, 5, 6, 7, 13, 32, 64, 300):  # tiles of 6 inputs, their remainders, two blocks of inputs
        x, w, bias = _operands(m, n, k, seed=m * 1000 + n * 10 + k)
        torch.testing.assert_close(cpu_native.gemm(x, w), F.linear(x, w), **TOLERANCE[torch.float32])
        torch.testing.assert_close(
            cpu_native.gemm(x, w, bias), F.linear(x, w, bias), **TOLERANCE[torch.float32]
        )


@pytest.mark.parametrize("product", [cpu_native.gemm, cpu_native.gemm_packed], ids=["tiles", "packed"])
def test_split_over_threads_equals_one_thread(monkeypatch, product):
    x, w, bias = _operands(29, 300, 96, seed=1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = product(x, w, bias)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(product(x, w, bias), one)


def test_bad_inputs_are_refused():
    x, w, bias = _operands(4, 8, 16, seed=2)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_native.gemm(x, w[:, :15].contiguous())
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_native.gemm(x, w, bias[:7])
    with pytest.raises(ValueError, match="weight"):
        cpu_native.gemm(x, w.double())
    with pytest.raises(ValueError, match="x"):
        cpu_native.gemm(x.t(), w)


def test_the_row_limit_follows_the_width_of_the_tiles():
    wide = cpu_native.gemm_vector_floats() == 16
    assert cpu_native.gemm_vector_floats() in (8, 16)
    assert quantized.gemm_native_max_rows() == (
        quantized.GEMM_NATIVE_MAX_ROWS if wide else quantized.GEMM_NATIVE_MAX_ROWS_AVX2
    )


def test_linear_takes_the_native_gemm_up_to_its_row_limit():
    limit = quantized.gemm_native_max_rows()
    x, w, bias = _operands(limit + 1, 40, 48, seed=3)
    assert torch.equal(quantized.linear(x[:limit], w, bias), cpu_native.gemm(x[:limit], w, bias))
    # beyond: torch's GEMM, or without AVX-512 the packed-panel GEMM (tested below)
    narrow = cpu_native.gemm_vector_floats() < 16
    want = cpu_native.gemm_packed(x, w, bias) if narrow else F.linear(x, w, bias)
    assert torch.equal(quantized.linear(x, w, bias), want)
    # other dtypes keep torch's path
    xd, wd = x[:8].double(), w.double()
    assert torch.equal(quantized.linear(xd, wd), F.linear(xd, wd))


# ---- the packed-panel GEMM (many rows without AVX-512) -------------------------------------------
# K: below and past the 8 steps packed at a time, past one block of 256 steps (blocks of equal size
# with tails of 8); N: a row, past a 16 / 32-column panel, tasks of several panels; M: a
# micro-kernel's 6 rows, their remainders, past a block of 24 rows.
@pytest.mark.parametrize("k", [1, 9, 17, 257, 781], ids=case_id)
@pytest.mark.parametrize("n", [1, 19, 67, 300], ids=case_id)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "fp8"])
def test_packed_matches_f_linear_of_the_widened_weight(n, k, kind):
    gen = torch.Generator().manual_seed(n * 10 + k)
    for m in (1, 5, 6, 7, 40, 101):
        x, w, bias = _operands(m, n, k, seed=m * 1000 + n * 10 + k)
        scale = None
        if kind == "bfloat16":
            w = w.bfloat16()
        elif kind == "int8":
            w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            scale = torch.rand(n, generator=gen) / 127 * k**-0.5
        elif kind == "fp8":  # every byte but e4m3fn's two NaNs, in turn
            codes = torch.arange(n * k) % 256
            codes = torch.where((codes & 0x7F) == 0x7F, 0, codes).to(torch.uint8)
            w = codes.view(torch.float8_e4m3fn).reshape(n, k)
            scale = torch.rand(n, generator=gen) / 448 * k**-0.5
        wide = w.float() if scale is None else w.float() * scale[:, None]
        for b in (None, bias):
            got = cpu_native.gemm_packed(x, w, b, scale)
            torch.testing.assert_close(got, F.linear(x, wide, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [7, 300, 531], ids=case_id)
def test_packed_widens_bf16_exactly(k):
    """One-hot inputs pick single weights: y is the widened weight itself, bit for bit, wherever
    it sits in the panels (ragged columns, steps past 8 at a time, blocks of K)."""
    gen = torch.Generator().manual_seed(k)
    n = 37
    w = (torch.randn(n, k, generator=gen) * 3).bfloat16()
    w[0, :3] = torch.tensor([-3e38, 3e38, 1e-30]).bfloat16()  # no inf: 0 * inf is NaN
    rows = torch.arange(k).repeat(2)[: k + 11]  # past a block of 24 rows
    x = F.one_hot(rows, k).float()
    want = w.float()[:, rows].t()
    assert torch.equal(cpu_native.gemm_packed(x, w), want)
    bias = torch.randn(n, generator=gen)
    assert torch.equal(cpu_native.gemm_packed(x, w, bias), want + bias)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_packed_split_over_threads_equals_one_thread(monkeypatch, kind):
    """Over blocks of K, of rows and tasks of panels, each output's sums run in one order."""
    x, w, bias = _operands(203, 300, 781, seed=11)
    scale = None
    if kind == "bfloat16":
        w = w.bfloat16()
    elif kind == "int8":
        w, scale = (w * 127).round().clamp(-127, 127).to(torch.int8), torch.rand(300) / 127
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = cpu_native.gemm_packed(x, w, bias, scale)
    for threads in (2, 3, 7):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert torch.equal(cpu_native.gemm_packed(x, w, bias, scale), one)


def test_packed_with_no_products_is_the_bias():
    x, w, bias = torch.zeros(3, 0), torch.zeros(5, 0), torch.randn(5)
    assert torch.equal(cpu_native.gemm_packed(x, w, bias), bias.expand(3, 5))


def test_packed_refuses_bad_inputs():
    x, w, bias = _operands(4, 8, 16, seed=7)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_native.gemm_packed(x, w[:, :15].contiguous())
    with pytest.raises(ValueError, match="weight"):
        cpu_native.gemm_packed(x, w.double())
    with pytest.raises(ValueError, match="scale"):
        cpu_native.gemm_packed(x, w.to(torch.int8))
    with pytest.raises(ValueError, match="scale"):
        cpu_native.gemm_packed(x, w, scale=torch.ones(8))
    with pytest.raises(ValueError, match="x"):
        cpu_native.gemm_packed(x.t(), w)


def test_linear_takes_the_packed_gemm_beyond_the_tiles_without_avx512(monkeypatch):
    x, w, bias = _operands(quantized.GEMM_PACKED_MIN_ROWS, 40, 48, seed=8)
    for floats in (8, 16):
        monkeypatch.setattr(cpu_native, "gemm_vector_floats", lambda floats=floats: floats)
        want = cpu_native.gemm_packed(x, w, bias) if floats == 8 else cpu_native.gemm(x, w, bias)
        assert torch.equal(quantized.linear(x, w, bias), want)
        assert torch.equal(quantized.linear(x[:-1], w, bias), cpu_native.gemm(x[:-1], w, bias))


def test_fp8_weights_of_many_rows_take_the_packed_gemm_without_avx512(monkeypatch):
    x, w, bias = _operands(quantized.FP8_NATIVE_MAX_ROWS + 1, 40, 48, seed=9)
    scale = w.abs().amax(1) / 448
    q = quantized.QuantizedWeight((w / scale[:, None]).to(torch.float8_e4m3fn), scale)
    monkeypatch.setattr(cpu_native, "gemm_vector_floats", lambda: 8)
    assert torch.equal(quantized.linear(x, q, bias), cpu_native.gemm_packed(x, q.data, bias, q.scale))
    few = x[: quantized.FP8_NATIVE_MAX_ROWS]
    assert torch.equal(quantized.linear(few, q, bias), cpu_native.gemv_fp8(few, q.data, q.scale, bias))
