"""Native CPU kernels over a quantized KV cache (`cpu_kv_quant.c`): the rotary + K/V write that
quantizes as it stores, and paged decode attention reading 8-bit K/V with their scales. Both
agree with the torch twin in `disagg.kernels.kv_quant` (tests/kernels/test_cpu_kv_quant.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from disagg.kernels import cpu_native, native_build
from disagg.kernels.kv_quant import KVQuantFormat

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "rotary_write_kv_q8": ([_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_int], None),
    "paged_decode_attention_q8": (
        [_p, _i64, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_int, ctypes.c_float, _p,
         _i64, _i64],
        ctypes.c_int,
    ),
}  # fmt: skip


@functools.cache
def _lib() -> ctypes.CDLL:
    return native_build.bind(_SIGNATURES)


def _check_layer_cache(layer_cache: torch.Tensor, fmt: KVQuantFormat) -> None:
    if (
        layer_cache.dtype != torch.uint8
        or layer_cache.dim() != 2
        or layer_cache.shape[1] != fmt.region_bytes
        or not layer_cache.is_contiguous()
        or layer_cache.device.type != "cpu"
        or layer_cache.data_ptr() % 4
    ):
        raise ValueError(
            f"kv_cache: expected one layer's contiguous uint8 CPU regions [blocks, {fmt.region_bytes}], "
            f"got {layer_cache.dtype} {tuple(layer_cache.shape)}"
        )


def rotary_write_kv(
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    fmt: KVQuantFormat,
) -> None:
    """`cpu_native.rotary_write_kv` into one layer of a quantized cache: q and k rotated in place
    in qkv, then k and v quantized into their slots (negative slots skipped). Positions and
    slots are the caller's to bounds-check (`cpu_native.check_step_bounds`)."""
    cpu_native.check_cpu(torch.float32, qkv=qkv, cos_sin_cache=cos_sin_cache)
    _check_layer_cache(layer_cache, fmt)
    d = fmt.head_dim
    if qkv.shape[-1] != (num_q_heads + 2 * num_kv_heads) * d or fmt.num_kv_heads != num_kv_heads:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not match the cache's {fmt.num_kv_heads} KV heads of {d}"
        )
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()  # alive through the call
    _lib().rotary_write_kv_q8(
        qkv.data_ptr(), qkv.shape[-1], cos_sin_cache.data_ptr(), positions.data_ptr(), layer_cache.data_ptr(),
        slot_mapping.data_ptr(), qkv.shape[0], num_q_heads, num_kv_heads, d, fmt.block_size, fmt.region_bytes,
        int(fmt.name == "fp8"),
    )  # fmt: skip


class QuantizedPagedDecodeAttention(cpu_native.PagedDecodeAttention):
    """`cpu_native.PagedDecodeAttention` reading one layer of a quantized cache [blocks, region_bytes]."""

    def __init__(self, fmt: KVQuantFormat, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fmt = fmt

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        if q.dtype != torch.float32:
            raise TypeError(f"native decode attention takes float32 q, got {q.dtype}")
        _check_layer_cache(kv_cache, self.fmt)
        b, hq, d = q.shape
        if b != self.batch or hq != self.num_q_heads or d != self.fmt.head_dim:
            raise ValueError(f"q {tuple(q.shape)} does not match this step's plan")
        if q.stride(2) != 1 or q.stride(1) != d:  # heads of a row must be contiguous; rows may be apart
            q = q.contiguous()
        out = torch.empty(b, hq, d, dtype=torch.float32)
        code = _lib().paged_decode_attention_q8(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), self.tables.data_ptr(), self.tables.shape[1],
            self.lens.data_ptr(), out.data_ptr(), b, hq, self.num_kv_heads, d, self.fmt.block_size,
            self.fmt.region_bytes, int(self.fmt.name == "fp8"), scale, self.scratch.data_ptr(), self.max_len,
            self.threads,
        )  # fmt: skip
        if code == -2:
            raise ValueError(f"head_dim: the native quantized attention takes up to 512, got {d}")
        if code:
            raise ValueError(f"seq_lens: every length must be in [1, {self.max_len}]")
        return out
