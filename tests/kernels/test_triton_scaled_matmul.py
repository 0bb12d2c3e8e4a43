"""The Triton scaled matmul (8-bit weights, per-channel scales) against its torch twin, in the
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from triton_cases import TOLERANCE, case_id

from disagg.kernels.quantized import QuantizedWeight, scaled_linear_torch
from disagg.kernels.triton_scaled_matmul import scaled_matmul
from disagg.worker.model.quantization import quantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=case_id)
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 70, 100), (20, 130, 64)], ids=case_id)
def test_scaled_matmul_matches_the_twin(dtype, scheme, m, n, k):
    """Partial tiles in every dimension (rows, output channels, K) and a bias."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    q = quantize(torch.randn(n, k, generator=g), scheme)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    want = scaled_linear_torch(x, q, bias)
    got = scaled_matmul(x, q.data, q.scale, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    # the kernel accumulates in float32 and rounds once; the twin rounds the matmul in dtype
    tol = {torch.float32: dict(atol=1e-4, rtol=1e-4)}.get(dtype, TOLERANCE[dtype])
    torch.testing.assert_close(got.float(), want.float(), **{k: 2 * v for k, v in tol.items()})
    torch.testing.assert_close(scaled_matmul(x, q.data, q.scale).float(), scaled_linear_torch(x, q).float(),
                               **{k: 2 * v for k, v in tol.items()})  # fmt: skip


def test_scaled_matmul_keeps_leading_dims_and_refuses_bad_shapes():
    q = quantize(torch.randn(64, 32), "fp8")
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(
        scaled_matmul(x, q.data, q.scale), scaled_linear_torch(x, q), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="shapes"):
        scaled_matmul(torch.randn(2, 31), q.data, q.scale)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        scaled_matmul(x, q.data.float(), q.scale)
    assert isinstance(q, QuantizedWeight)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_half_precision_dot_branch(scheme):
    """The branch a GPU takes for 16-bit activations (weights widened to the activations' dtype,
    tile products in it), run in the interpreter with float16 (its bfloat16 dot is wrong)."""
    g = torch.Generator().manual_seed(9)
    q = quantize(torch.randn(70, 100, generator=g), scheme)
    x = torch.randn(5, 100, generator=g).to(torch.float16)
    got = scaled_matmul(x, q.data, q.scale, dot_f32=False)
    torch.testing.assert_close(got.float(), scaled_linear_torch(x, q).float(), atol=4e-3, rtol=4e-3)
