"""Matmul with 8-bit weights and per-output-channel scales (W8A16): y = (x @ W^T) * scale + bias.

x [M, K] in float32 / bfloat16 / float16, W [N, K] float8_e4m3fn or int8, scale [N] float32. Each
program computes a [BLOCK_M, BLOCK_N] tile: weight tiles are loaded as 8-bit (half or a quarter of
the bytes of the activations' dtype), widened in registers to the dot's dtype, and the scale,
constant along K, is applied once to the float32 accumulator. The torch twin is
`disagg.kernels.quantized.scaled_linear_torch`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rows[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        w_mask = (cols[None, :] < N) & (kk[:, None] < K)
        # [BLOCK_K, BLOCK_N]: W^T's tile; masked lanes zeroed after widening (an 8-bit `other`
        # does not cast in the interpreter, and a stale e4m3 NaN times a zero x is NaN)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=w_mask)
        if DOT_F32:  # float32 activations, or the interpreter (its bfloat16 dot is wrong)
            w = tl.where(w_mask, w.to(tl.float32), 0.0)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:  # widening int8 / e4m3 into bf16 / fp16 is exact (through float32 as well)
            w = tl.where(w_mask, w.to(tl.float32), 0.0).to(x_ptr.dtype.element_ty)
            acc += tl.dot(x, w)
    scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def scaled_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    dot_f32: bool | None = None,
) -> torch.Tensor:
    """`scaled_linear_torch(x, QuantizedWeight(weight, scale), bias)`: x [..., K] -> [..., N] in x's dtype.
    `dot_f32`: the tile products in float32 (default: for float32 x, and in the interpreter)."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.int8) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D float8_e4m3fn or int8 tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.shape[-1] != k or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)}: shapes do not match"
        )
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        if dot_f32 is None:
            dot_f32 = os.environ.get("TRITON_INTERPRET") == "1" or x.dtype == torch.float32
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        _scaled_matmul_kernel[grid](
            x2, weight, scale.float().contiguous(), bias if bias is not None else y, y, m, n, k, x2.stride(0),
            weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)
