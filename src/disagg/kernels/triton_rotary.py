"""Rotary position embedding (NeoX / Hugging Face rotate-half), applied in place to q and k.

Any RoPE scaling (llama3, linear, ...) lives in the cos/sin cache the model builds; the kernel
only looks rows up by position and rotates, so it is the same kernel for every variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    ptr, stride_t, stride_h, tok, num_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    base = ptr + tok * stride_t + heads * stride_h + cols
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + half, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, tok, num_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, tok, num_k_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Same contract as `torch_ops.rotary_embedding`: q [T, Hq, D], k [T, Hkv, D] rotated in place.

    q and k may be strided views (e.g. slices of a fused qkv projection) as long as the head
    dim is contiguous, since the kernel writes through the given strides.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"positions must have shape ({T},), got {tuple(positions.shape)}")
    if cos_sin_cache.shape[-1] != D or D % 2:
        raise ValueError(
            f"cos_sin_cache last dim must equal the (even) head dim {D}, got {cos_sin_cache.shape[-1]}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dim (the kernel writes in place)")
    if T == 0:
        return
    half = D // 2
    _rotary_kernel[(T,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        Hq,
        k.shape[1],
        half,
        BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
