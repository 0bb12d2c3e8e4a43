"""The slot-mapping scatter: this step's K/V rows into one layer's paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    num_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # negative slots are padding or tokens whose KV is not kept
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (cols < head_dim)
        dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        dst = dst + heads * stride_ch + cols
        k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + cols, mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + cols, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as `torch_ops.write_kv_cache`: key/value [T, Hkv, D] into their slots."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, Hkv, D = kv_cache.shape
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (Hkv, D):
        raise ValueError(
            f"key/value must be [T, {Hkv}, {D}], got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache need a contiguous head dim")
    T = key.shape[0]
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        Hkv,
        D,
        block_size,
        BLOCK_H=triton.next_power_of_2(Hkv),
        BLOCK_D=triton.next_power_of_2(D),
    )
