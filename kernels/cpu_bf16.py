"""Native CPU kernels for bfloat16 models (`cpu_bf16.c`): the same calls as `cpu_native`'s float32
kernels (add + RMSNorm, SiLU x mul, rotary + KV write, paged decode attention) plus the bf16
matrix-vector product, on bf16 tensors and a bf16 KV cache. Sums are float32 inside; every output
is rounded to bf16 once.

The GEMV multiplies bf16 values directly with AVX-512 BF16 (`vdpbf16ps`) where the CPU has it
(`dot_native()`), else widens them to float32 (exact): both are correct everywhere, only speed
differs. Built and loaded with the other native kernels (`cpu_native.available()`).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from disagg.kernels import cpu_native

_bound: ctypes.CDLL | None = None
_bind_lock = threading.Lock()


def _lib() -> ctypes.CDLL:
    global _bound
    if _bound is None:
        with _bind_lock:
            lib = cpu_native.library()
            p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            signatures = {
                "bf16_dot_native": ([], i64),
                "gemv_bf16": ([p, p, p, p, i64, i64, i64, i64], None),
                "gemv_bf16_portable": ([p, p, p, p, i64, i64, i64, i64], None),
                "add_rms_norm_bf16": ([p, p, p, p, i64, i64, f32], None),
                "silu_and_mul_bf16": ([p, p, i64, i64], None),
                "rotary_write_kv_bf16": ([p, i64, p, p, p, p, i64, i64, i64, i64, i64], None),
                "paged_decode_attention_bf16": (
                    [p, i64, p, p, i64, p, p, i64, i64, i64, i64, i64, f32, p, i64, i64],
                    ctypes.c_int,
                ),
            }
            for name, (argtypes, restype) in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            _bound = lib
    return _bound


def dot_native() -> bool:
    """Whether the GEMV multiplies bf16 in hardware here (AVX-512 BF16), not widened to float32."""
    return cpu_native.available() and bool(_lib().bf16_dot_native())


def _check_bf16(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"{name}: native bf16 kernels take contiguous bfloat16 CPU tensors, got {t.dtype} {t.device}"
            )


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


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x + residual) * weight over the last dim; with `residual`, the bf16 sum is written
    back into it (in place), as a decoder layer's fused add + norm."""
    _check_bf16(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight: shape {tuple(weight.shape)}, need ({hidden},)")
    out = torch.empty_like(x)
    _lib().add_rms_norm_bf16(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // hidden, hidden, eps,
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(first half) * second half."""
    _check_bf16(x=x)
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _lib().silu_and_mul_bf16(x.data_ptr(), out.data_ptr(), x.numel() // (2 * inter), inter)
    return out


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
    _check_bf16(qkv=qkv, kv_cache=kv_cache)
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache: need contiguous float32, got {cos_sin_cache.dtype}")
    head_dim = kv_cache.shape[-1]
    if qkv.shape[-1] != (num_q_heads + 2 * num_kv_heads) * head_dim or kv_cache.shape[3] != num_kv_heads:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match the heads of cache {tuple(kv_cache.shape)}")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()  # alive through the call
    _lib().rotary_write_kv_bf16(
        qkv.data_ptr(), qkv.shape[-1], cos_sin_cache.data_ptr(), positions.data_ptr(), kv_cache.data_ptr(),
        slot_mapping.data_ptr(), qkv.shape[0], num_q_heads, num_kv_heads, head_dim, kv_cache.shape[2],
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
