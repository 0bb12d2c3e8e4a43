"""Native CPU kernels for bfloat16 models (`cpu_bf16.c`): the same calls as `cpu_native`'s float32
kernels (add + RMSNorm, SiLU x mul, rotary + KV write, paged decode attention) plus the bf16
matrix-vector product, on bf16 tensors and a bf16 KV cache. Sums are float32 inside; every output
is rounded to bf16 once.

The GEMV multiplies bf16 values directly with AVX-512 BF16 (`vdpbf16ps`) where the CPU has it
(`dot_native()`), else widens them to float32 (exact): both are correct everywhere, only speed
differs. Where the CPU has no bf16 products, `gemm` serves the products of more rows (prefill
chunks, batched decode) with the float32 GEMM's tiles, the weights widened in registers. Built and loaded with the other native kernels (`native_build.available()`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from disagg.kernels import cpu_native, native_build

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "bf16_dot_native": ([], _i64),
    "gemv_bf16": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], None),
    "gemv_bf16_portable": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], None),
    "gemm_bf16w": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemm_bf16_amx": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "i8_to_bf16": ([_p, _p, _i64, _i64], None),
    "fp8_to_bf16": ([_p, _p, _i64, _i64], None),
    "bf16_scale_cols": ([_p, _p, _p, _p, _i64, _i64, _i64], None),
    "add_rms_norm_bf16": ([_p, _p, _p, _p, _i64, _i64, _f32], None),
    "silu_and_mul_bf16": ([_p, _p, _i64, _i64], None),
    "rotary_write_kv_bf16": ([_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64], None),
    "paged_decode_attention_bf16": (
        [_p, _i64, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _f32, _p, _i64, _i64],
        ctypes.c_int,
    ),
}


@functools.cache
def _lib() -> ctypes.CDLL:
    return native_build.bind(_SIGNATURES)


def dot_native() -> bool:
    """Whether the GEMV multiplies bf16 in hardware here (AVX-512 BF16), not widened to float32."""
    return native_build.available() and bool(_lib().bf16_dot_native())


def _check_bf16(**tensors: torch.Tensor) -> None:
    cpu_native.check_cpu(torch.bfloat16, **tensors)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, portable: bool = False
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16 x [B, K] and weight [N, K]: each weight row read once
    for up to four inputs, rows split over torch's threads. `portable`: the widening loop even
    where the CPU multiplies bf16 itself (what CPUs without AVX-512 BF16 run)."""
    _check_bf16(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    (b, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    y = torch.empty(b, n, dtype=torch.bfloat16)
    fn = _lib().gemv_bf16_portable if portable else _lib().gemv_bf16
    fn(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), b, n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16 x [M, K] and weight [N, K] of any row count, for CPUs that
    cannot multiply bf16 themselves (`dot_native()` False): the float32 GEMM's register tiles with
    the weights widened in registers (many rows without AVX-512: the packed-panel GEMM, the weights
    widened as packed), float32 sums, each output rounded to bf16 once."""
    _check_bf16(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    if cpu_native.takes_packed(m):
        b = None if bias is None else bias.float()
        return cpu_native.gemm_packed(x.float(), weight, b).to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if _lib().gemm_bf16w(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k,
        torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("gemm (bf16): no memory for the widened inputs")
    return y


def gemm_amx(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16 x [M, K] and weight [N, K] on AMX (cpu_amx.c): the
    weight's rows are read in place as tiles (no repacked copy), the inputs packed once, float32
    sums, each output rounded to bf16 once. Only where `native_build.amx_usable()`."""
    _check_bf16(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m == 0:
        return y
    rc = _lib().gemm_bf16_amx(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    cpu_native.raise_for_amx(rc, "gemm_amx (bf16)")
    return y


def widen_8bit(weight: torch.Tensor) -> torch.Tensor:
    """An int8 or float8_e4m3fn CPU tensor's values as bfloat16, exactly (8-bit values need at most
    8 significant bits): `weight.to(torch.bfloat16)`, in one vectorised pass over threads."""
    if (
        weight.dtype not in (torch.int8, torch.float8_e4m3fn)
        or not weight.is_contiguous()
        or weight.device.type != "cpu"
    ):
        raise ValueError(
            f"weight: need a contiguous int8 or float8_e4m3fn CPU tensor, got {weight.dtype} {weight.device}"
        )
    out = torch.empty(weight.shape, dtype=torch.bfloat16)
    fn = _lib().i8_to_bf16 if weight.dtype == torch.int8 else _lib().fp8_to_bf16
    fn(weight.data_ptr(), out.data_ptr(), weight.numel(), torch.get_num_threads())
    return out


def scale_columns(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `y.float() * scale (+ bias)` for bf16 y [M, N] and float32 scale (and bias) [N]: one pass."""
    _check_bf16(y=y)
    cpu_native.check_cpu(torch.float32, scale=scale, **({} if bias is None else {"bias": bias}))
    (m, n) = y.shape
    if scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"y {tuple(y.shape)}, scale {tuple(scale.shape)}: shapes do not match")
    out = torch.empty(m, n, dtype=torch.float32)
    _lib().bf16_scale_cols(
        y.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), m, n,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x + residual) * weight over the last dim; with `residual`, the bf16 sum is written
    back into it (in place), as a decoder layer's fused add + norm."""
    return cpu_native.add_rms_norm_call(_lib().add_rms_norm_bf16, torch.bfloat16, x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(first half) * second half."""
    return cpu_native.silu_and_mul_call(_lib().silu_and_mul_bf16, torch.bfloat16, x)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> None:
    """`cpu_native.rotary_write_kv` for bf16 qkv and a bf16 one-layer cache; the angles
    (cos_sin_cache) stay float32. Positions and slots are checked once per step by the caller
    (`cpu_native.check_step_bounds`)."""
    cpu_native.rotary_write_kv_call(
        _lib().rotary_write_kv_bf16, torch.bfloat16, qkv, cos_sin_cache, positions, kv_cache, slot_mapping,
        num_q_heads, num_kv_heads,
    )  # fmt: skip


class PagedDecodeAttention(cpu_native.PagedDecodeAttention):
    """`cpu_native.PagedDecodeAttention` over a bf16 cache: bf16 q and output, float32 inside."""

    def __init__(self, block_tables, seq_lens, num_q_heads, num_kv_heads, num_blocks=None):
        super().__init__(block_tables, seq_lens, num_q_heads, num_kv_heads, num_blocks)
        self.scratch = None  # sized on the first call, when the head dim is known

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D] bf16 (rows may be apart), kv_cache (one layer) [blocks, 2, block_size, Hkv, D] bf16."""
        if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
            raise TypeError(
                f"native bf16 decode attention takes bfloat16, got q {q.dtype}, cache {kv_cache.dtype}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        b, hq, d = q.shape
        if b != self.batch or hq != self.num_q_heads or kv_cache.shape[3] != self.num_kv_heads:
            raise ValueError(
                f"q {tuple(q.shape)} / cache {tuple(kv_cache.shape)} do not match this step's plan"
            )
        if q.stride(2) != 1 or q.stride(1) != d:  # heads of a row must be contiguous; rows may be apart
            q = q.contiguous()
        group = hq // self.num_kv_heads
        need = self.threads * group * (self.max_len + 2 * d)
        if self.scratch is None or self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty(b, hq, d, dtype=torch.bfloat16)
        code = _lib().paged_decode_attention_bf16(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), self.tables.data_ptr(), self.tables.shape[1],
            self.lens.data_ptr(), out.data_ptr(), b, hq, self.num_kv_heads, d, kv_cache.shape[2], scale,
            self.scratch.data_ptr(), self.max_len, self.threads,
        )  # fmt: skip
        if code:
            raise ValueError(f"seq_lens: every length must be in [1, {self.max_len}]")
        return out
