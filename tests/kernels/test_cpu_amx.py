"""The AMX kernel for 8-bit weights (cpu_amx.c) against float64 sums of the same rounded inputs.

Its inputs are x rounded to bf16 (round to nearest even, as torch rounds) and the 8-bit values
widened exactly; its sums are float32 over K products (relative ~K * 2^-24 of the sum of
magnitudes at worst), then scaled in float32. So against float64 sums of the same values it
differs by float32 summation alone: 1e-5 of the magnitude sum bounds it with room, while a
wrong tile layout, row, column, pair order or scale is off by whole values. Ragged shapes cover
every tail: M not a multiple of 32, N of 32, K of 32.
"""

from __future__ import annotations

import needs
import pytest
import torch
from triton_cases import case_id

from disagg.kernels import cpu_native, quantized
from disagg.worker.model import quantization

pytestmark = [needs.native, needs.amx]

SHAPES = [(1, 1, 1), (5, 17, 33), (31, 33, 31), (70, 96, 200), (64, 576, 576), (100, 300, 1536)]


def _check(x: torch.Tensor, q: quantized.QuantizedWeight, bias: torch.Tensor | None) -> None:
    values = q.data.float()  # int8 and e4m3 values are exact in float32
    sums = x.bfloat16().double() @ values.double().T
    want = sums * q.scale.double() + (0 if bias is None else bias.double())
    got = cpu_native.gemm_8bit_amx(x, q.data, q.scale, bias)
    bound = 1e-5 * (x.bfloat16().double().abs() @ values.double().abs().T) * q.scale.double() + 1e-6
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[case_id(s) for s in SHAPES])
def test_amx_matches_float64_sums_of_the_rounded_inputs(scheme, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) + 0.1)
    q = quantization.quantize(w, scheme)
    x = torch.randn(m, k, generator=g) * 3
    _check(x, q, None)
    _check(x, q, torch.randn(n, generator=g))


def test_amx_split_over_threads_equals_one_thread(monkeypatch):
    g = torch.Generator().manual_seed(3)
    q = quantization.quantize(torch.randn(200, 96, generator=g), "int8")
    x = torch.randn(77, 96, generator=g)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = cpu_native.gemm_8bit_amx(x, q.data, q.scale)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(cpu_native.gemm_8bit_amx(x, q.data, q.scale), one)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_linear_takes_amx_from_its_row_threshold(scheme):
    """fp8 from BF16_PRODUCT_MIN_ROWS; int8 after its own AMX GEMM's rows (16-bit inputs, exact)."""
    g = torch.Generator().manual_seed(4)
    q = quantization.quantize(torch.randn(64, 1536, generator=g), scheme)
    first = quantized.BF16_PRODUCT_MIN_ROWS if scheme == "fp8" else quantized.INT8_AMX_MAX_ROWS + 1
    for rows in (first - 1, first):
        x = torch.randn(rows, 1536, generator=g)
        amx = cpu_native.gemm_8bit_amx(x, q.data, q.scale)
        assert torch.equal(quantized.linear(x, q), amx) == (rows >= first)


def test_bad_inputs_are_refused():
    q = quantization.quantize(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_native.gemm_8bit_amx(torch.randn(3, 15), q.data, q.scale)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        cpu_native.gemm_8bit_amx(torch.randn(3, 16), q.data.float(), q.scale)
