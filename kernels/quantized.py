"""Matmuls with 8-bit weights: the weight type and the one `linear` every caller uses.

A `QuantizedWeight` is W [N, K] stored as int8 or float8_e4m3fn values with one float32 scale per
output row (W ~= data * scale[:, None]); activations stay in the model's dtype. Because the
scale is constant along a row it factors out of every dot product: y = (x . data_r) * scale_r,
which is what every implementation below computes.

`linear(x, w, bias)` takes a plain tensor (then it is `F.linear`, through the native float32 GEMM
on CPU up to `GEMM_NATIVE_MAX_ROWS` rows (`GEMM_NATIVE_MAX_ROWS_AVX2` without AVX-512), the native
bf16 GEMV up to `BF16_GEMV_MAX_ROWS`, beyond that the native bf16 GEMM where the CPU has no bf16
products) or a `QuantizedWeight` and picks: for int8 and float32
inputs on CPU, from `BF16_PRODUCT_MIN_ROWS` rows on a CPU with bf16 products (AVX-512 BF16)
`scaled_linear_bf16` (fp8 too: inputs rounded to bf16, the weight widened exactly, torch's bf16
GEMM); below `W8A8_MIN_ROWS` rows the native int8 GEMV (decode: reading a quarter of the
bytes is the point; it rounds the inputs to int16 per row, a relative 3e-5, below bfloat16's own
rounding), from there, on a CPU with AVX-512 VNNI, the native VNNI GEMM up to `GEMM_INT8_MAX_ROWS`
with rows rounded to 16 bits, or, if the caller asks (`w8a8=True`), W8A8 (each input row rounded
to int8 with its own scale, integer products: that GEMM, else beyond it the torch twin
`scaled_linear_w8a8_torch`), else the twin as below; without VNNI the int8 GEMV up to
`GEMV_INT8_MAX_ROWS_NO_VNNI` rows (16-bit inputs at any row count); the native fp8
GEMV (e4m3 widened in registers); the Triton scaled matmul on CUDA (fp8 and int8); else the torch
twin (`scaled_linear_torch`: widen the weight on the fly, matmul, scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from disagg.kernels import cpu_bf16, cpu_native

SCHEMES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Up to this many rows the native int8 GEMV (one weight row against up to four inputs at a time,
# the row reused from L1 for the next four; integer dot products under VNNI) beats widening the
# weight to float32 for torch's GEMM, and float32 weights too (measured here, 4096 x 768: 3x at 16
# rows, 1.5x at 128, par at 256-512); beyond, prefill-sized products amortise the widening.
NATIVE_MAX_ROWS = 256
# From this many rows, int8 weights meet float32 activations in the native VNNI GEMM
# (cpu_gemm_int8.c: rows rounded to 16 bits, or to int8 with their own scale when the caller asks
# for W8A8): a batched step or a prefill chunk is compute-bound, and VPDPBUSD does four times the
# multiply-adds of a float32 FMA. Below, the W8A16 GEMV (memory-bound: the same bytes, 16-bit
# activations). Measured with bench/small_gemm.py --int8 on this CPU (see there).
W8A8_MIN_ROWS = 5
# From this many rows, on a CPU that multiplies bf16 in hardware (`cpu_bf16.dot_native()`), 8-bit
# weights meet float32 inputs as W8A16 (`scaled_linear_bf16`: the weight widened exactly to bf16,
# the inputs rounded to bf16; the AMX kernel where AMX is granted, else torch's bf16 GEMM). Two reasons. Quality: per-token int8 inputs
# cost SmolLM2-135M +3.8% perplexity (bench/perplexity.py), bf16 inputs about what per-channel int8
# weights with float32 inputs cost (see README). Speed: oneDNN's bf16 GEMM runs on AMX where the
# kernel grants it, and the widening is one pass over the weight's bytes, amortised over the rows:
# measured on SmolLM2's shapes (qkv, gate_up, down; 1 thread, Sapphire Rapids with AMX granted),
# against the VNNI GEMM with 16-bit rows: 1.2-1.6x at 64 rows, 2.2-2.4x at 128, 4-5x at 512 (and
# level with its W8A8 at 64, 2-2.6x at 512); below 64 the widening's fixed cost loses. The AMX
# kernel (cpu_amx.c) against that torch route, 2 threads: level on K = 576 (64-512 rows), 1.25-2.3x
# on K = 1536, where the route's widened copy no longer stays in cache.
BF16_PRODUCT_MIN_ROWS = 64
# Up to this many rows the native VNNI GEMM; beyond, the torch twin (rounded rows, widened weight).
GEMM_INT8_MAX_ROWS = 1024
# fp8 widens every weight in float (no integer dot product): par with the float32 GEMM at 16 rows;
# beyond, without AVX-512 the packed GEMM (weights widened as they are packed), with it the weight
# widened once per call (natively) for torch's GEMM.
FP8_NATIVE_MAX_ROWS = 16
# Up to this many rows the native float32 GEMM (register tiles of 4 weight rows by up to 6 inputs)
# beats torch's on an AVX-512 CPU (measured with bench/small_gemm.py, 2 threads, on the small preset's
# five matmul shapes: 1.5-3x at 8-32 rows (weights read from memory, as in decode), 1.3-1.7x at
# 64, 1.1-1.3x at 256, 1.0-1.2x at 512-1024 (prefill chunks; the LM head 0.96x, but prefill
# projects only the sampled rows), par or behind from 2048.
GEMM_NATIVE_MAX_ROWS = 1024
# The same without AVX-512 (AVX2: 16 registers of 8 floats, tiles of 4 by 3): 1.1-4x torch up to 32
# rows, behind from 64 (0.8-0.9x), about 0.55x at 512-1024, where torch's packed GEMM runs at twice
# the tiles' 65-73 GFLOP/s (Zen 3, 2 threads, quiet).
GEMM_NATIVE_MAX_ROWS_AVX2 = cpu_native.NARROW_TILES_MAX_ROWS
# Without AVX-512, products of more rows than that take the packed-panel GEMM
# (`cpu_native.gemm_packed`: weight panels packed once per call, an outer-product micro-kernel):
# float32, bf16 (widened as packed) and int8 weights alike.
GEMM_PACKED_MIN_ROWS = GEMM_NATIVE_MAX_ROWS_AVX2 + 1
# Without VNNI (AVX2) W8A8 has no fast instruction, and the int8 GEMV (16-bit inputs, VPMADDWD: 16
# products per instruction, the weight row widened once per four inputs, inputs in blocks of 64)
# is the fastest int8 product up to this many rows: 1.4-3.3x the native float32 GEMM at 1-2048
# rows, ahead of widening the weight for torch's GEMM below ~1024 rows, level there; beyond, the
# widening twin (Zen 3, 2 threads, weights from memory).
GEMV_INT8_MAX_ROWS_NO_VNNI = 1024
# Up to this many rows of bf16 inputs the native bf16 GEMV (`vdpbf16ps`, one weight row against up
# to four inputs) beats torch's bf16 GEMM (oneDNN): 1.5-5x at 1-4 rows, 1.1-3.5x at 8 (cold weights,
# `bench/small_gemm.py --dtype bfloat16`, 2 threads, under load); from 12-16 rows oneDNN's
# register-tiled kernels are level or ahead (compute, not the weight bytes, bounds the product).
# On a CPU without AVX-512 BF16 torch's bf16 GEMM converts as it goes, at an eighth of its float32
# speed (15-19 GFLOP/s, AVX2, Zen 3, 2 threads): there, beyond these rows, the native bf16 GEMM
# (`cpu_bf16.gemm`: the float32 tiles, weights widened in registers) at every row count.
BF16_GEMV_MAX_ROWS = 8


def _native_fits(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, max_rows: int
) -> bool:
    """A plain CPU product of up to `max_rows` rows, all in `dtype`, that a native kernel takes
    (no autograd through it)."""
    return (
        x.device.type == "cpu"
        and x.dtype == dtype
        and w.dtype == dtype
        and x.dim() == 2
        and x.shape[0] <= max_rows
        and w.is_contiguous()
        and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and cpu_native.available()
    )


@dataclass(frozen=True)
class QuantizedWeight:
    data: torch.Tensor  # [N, K] int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor  # [N] float32
    # int8: each row's sum [N] int32, computed once here (the W8A8 GEMM takes its inputs' +128
    # shift back with it); None for fp8
    row_sums: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.data.dtype not in SCHEMES.values():
            raise TypeError(f"quantized weight data must be int8 or float8_e4m3fn, got {self.data.dtype}")
        if self.data.dim() != 2 or tuple(self.scale.shape) != (self.data.shape[0],):
            raise ValueError(
                f"quantized weight: data {tuple(self.data.shape)} needs one scale per row, "
                f"got scale {tuple(self.scale.shape)}"
            )
        if self.scale.dtype != torch.float32:
            raise TypeError(f"quantized weight scale must be float32, got {self.scale.dtype}")
        sums = self.data.sum(1, dtype=torch.int32) if self.data.dtype == torch.int8 else None
        object.__setattr__(self, "row_sums", sums)

    @property
    def scheme(self) -> str:
        return "int8" if self.data.dtype == torch.int8 else "fp8"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale[:, None]).to(dtype)


def tensor_bytes(w: torch.Tensor | QuantizedWeight | None) -> int:
    """Bytes a (possibly quantized) weight occupies: what a matmul with it reads."""
    if w is None:
        return 0
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return w.numel() * w.element_size()


def scaled_linear_torch(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: x [..., K] @ (data [N, K] widened to x's dtype)^T * scale (+ bias). Widening is
    exact for int8 and e4m3 into float32, bfloat16 and float16 (their values fit all three)."""
    y = F.linear(x, w.data.to(x.dtype)) * w.scale.to(x.dtype)
    return y if bias is None else y + bias


def _gemm_native_max_rows() -> int:
    """Rows up to which the native float32 GEMM beats torch's: by the width its tiles were built for."""
    if not cpu_native.available():
        return 0
    return GEMM_NATIVE_MAX_ROWS if cpu_native.gemm_vector_floats() >= 16 else GEMM_NATIVE_MAX_ROWS_AVX2


def _w8a8_rows(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Float32 CPU products of W8A8_MIN_ROWS rows or more: int8 weights take them as W8A8."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] >= W8A8_MIN_ROWS
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def scaled_linear_w8a8_torch(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The W8A8 reference (`cpu_native.gemm_int8` computes the same): each row of x [M, K] rounded
    to int8 with its own scale sx = max|x_row| / 127 (1 for a zero row), products with the int8
    weight, then sx * scale (+ bias). Summed in float32 here (|sums| < 2^24 * 16: a relative 6e-8,
    against the kernel's exact integers)."""
    amax = x.abs().amax(-1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x * (1.0 / sx))
    y = F.linear(q, w.data.to(x.dtype)) * (sx * w.scale)
    return y if bias is None else y + bias


def _bf16_product_rows(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Float32 CPU products of `BF16_PRODUCT_MIN_ROWS` rows or more on a CPU that multiplies bf16 in
    hardware: 8-bit weights take them as `scaled_linear_bf16`."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] >= BF16_PRODUCT_MIN_ROWS
        and (bias is None or bias.dtype == torch.float32)
        and not (torch.is_grad_enabled() and x.requires_grad)
        and cpu_native.available()
        and cpu_bf16.dot_native()
    )


def scaled_linear_bf16(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A16 for many rows: x [M, K] rounded to bfloat16, the 8-bit weight widened exactly to bf16,
    float32 sums, times the float32 row scales (+ bias) in float32. Where AMX is usable
    (`cpu_native.amx_usable()`), one native call does it all
    (`cpu_native.gemm_8bit_amx`: the weight widened block by block into tiles, never to memory);
    elsewhere torch's bf16 GEMM (oneDNN) on the weight widened natively (`cpu_bf16.widen_8bit`), its
    bf16 product scaled natively (`cpu_bf16.scale_columns`), which also rounds the product to
    bf16."""
    b = None if bias is None else bias.contiguous()
    if cpu_native.amx_usable():
        return cpu_native.gemm_8bit_amx(x.contiguous(), w.data, w.scale, b)
    y = F.linear(x.to(torch.bfloat16), cpu_bf16.widen_8bit(w.data))
    return cpu_bf16.scale_columns(y, w.scale, b)


def linear(
    x: torch.Tensor,
    w: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    w8a8: bool = False,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for a plain or a quantized weight (see the module text). `w8a8=True`
    rounds the inputs of int8 products of `W8A8_MIN_ROWS` to `BF16_PRODUCT_MIN_ROWS` rows (all of
    them where the CPU has no bf16 products) to int8 per row; by default they keep 16 bits (the
    native GEMM rounds rows to 16 bits, at about two thirds of its W8A8 speed): an input row's int8
    grid, set by its largest value, rounds the typical values coarsely, which costs SmolLM2-135M
    +3.8% perplexity when every matmul does it."""
    if not isinstance(w, QuantizedWeight):
        if _native_fits(x, w, bias, torch.float32, _gemm_native_max_rows()):
            return cpu_native.gemm(x.contiguous(), w, bias)
        if cpu_native.narrow_tiles() and _native_fits(x, w, bias, torch.float32, 1 << 62):
            return cpu_native.gemm_packed(x.contiguous(), w, bias)
        if _native_fits(x, w, bias, torch.bfloat16, BF16_GEMV_MAX_ROWS):
            return cpu_bf16.gemv(x.contiguous(), w, bias)
        if _native_fits(x, w, bias, torch.bfloat16, 1 << 62) and not cpu_bf16.dot_native():
            return cpu_bf16.gemm(x.contiguous(), w, bias)
        return F.linear(x, w, bias)
    if x.device.type == "cpu":
        if _bf16_product_rows(x, bias):
            return scaled_linear_bf16(x, w, bias)
        vnni = cpu_native.available() and cpu_native.gemm_int8_is_fast()
        if w.scheme == "int8" and vnni and _w8a8_rows(x, bias):
            if x.shape[0] <= GEMM_INT8_MAX_ROWS:
                bits = 8 if w8a8 else 16
                return cpu_native.gemm_int8(
                    x.contiguous(), w.data, w.scale, w.row_sums, bias, input_bits=bits
                )
            if w8a8:
                return scaled_linear_w8a8_torch(x, w, bias)
        if (
            w.scheme == "int8"
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] <= (NATIVE_MAX_ROWS if vnni else GEMV_INT8_MAX_ROWS_NO_VNNI)
            and (bias is None or bias.dtype == torch.float32)
            and cpu_native.available()
        ):
            return cpu_native.gemv_int8(x.contiguous(), w.data, w.scale, bias)
        if (
            w.scheme == "int8"
            and not vnni
            and cpu_native.narrow_tiles()
            and x.dtype == torch.float32
            and x.dim() == 2
        ):
            b = None if bias is None else bias.float().contiguous()
            return cpu_native.gemm_packed(x.contiguous(), w.data, b, w.scale)
        if w.scheme == "fp8" and cpu_native.available():
            if (
                x.dtype == torch.float32
                and x.dim() == 2
                and x.shape[0] <= FP8_NATIVE_MAX_ROWS
                and (bias is None or bias.dtype == torch.float32)
            ):
                return cpu_native.gemv_fp8(x.contiguous(), w.data, w.scale, bias)
            if cpu_native.narrow_tiles() and x.dtype == torch.float32 and x.dim() == 2:
                b = None if bias is None else bias.float().contiguous()
                return cpu_native.gemm_packed(x.contiguous(), w.data, b, w.scale)
            # many rows: widen the weight once, natively (torch's e4m3 conversion is scalar)
            y = F.linear(x, cpu_native.fp8_to_float32(w.data).to(x.dtype)) * w.scale.to(x.dtype)
            return y if bias is None else y + bias
    elif x.device.type == "cuda":
        from disagg.kernels.triton_scaled_matmul import scaled_matmul

        return scaled_matmul(x, w.data, w.scale, bias)
    return scaled_linear_torch(x, w, bias)
