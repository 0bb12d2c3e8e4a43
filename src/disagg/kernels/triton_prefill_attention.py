"""Causal attention over packed variable-length prompt chunks (flash-attention style).

One program computes a tile of BLOCK_M query rows of one sequence for one query head. It
first attends to the sequence's earlier positions (a cached prefix or earlier chunks of a
chunked prefill) read from the paged cache through the block table, then to this chunk's own
keys/values, read from the packed k/v tensors, under the causal mask. Softmax is online and in
float32; `tl.dot` operands are float32 (the Triton interpreter computes bfloat16 dots wrongly),
rounded on a GPU as `triton_dot.dot_precision` says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels.triton_dot import dot_precision


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ot,
    stride_oh,
    head_dim,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - q_start
    if tile * BLOCK_M < q_len:
        context = tl.load(seq_lens_ptr + seq).to(tl.int64) - q_len  # positions before this chunk
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = m < q_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q = tl.load(
            q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q = q.to(tl.float32) * scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # earlier positions, from the paged cache: all visible to every query row
        table = block_tables_ptr + seq * stride_btb
        for n0 in range(0, context, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < context
            pages = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            rows = pages * stride_cb + (n % PAGE) * stride_cs + kv_head * stride_ch
            kt = tl.load(
                cache_ptr + rows[None, :] + d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0
            )
            s = tl.dot(q, kt.to(tl.float32), input_precision=DOT_PRECISION)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            v = tl.load(
                cache_ptr + stride_ckv + rows[:, None] + d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v.to(tl.float32), DOT_PRECISION)

        # this chunk, causal: row m sees chunk keys 0..m; no tile past the last row is needed
        hi = tl.minimum(q_len, (tile + 1) * BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < q_len
            kt = tl.load(
                k_ptr + (q_start + n)[None, :] * stride_kt + kv_head * stride_kh + d[:, None],
                mask=d_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            s = tl.dot(q, kt.to(tl.float32), input_precision=DOT_PRECISION)
            s = tl.where(n_mask[None, :] & (n[None, :] <= m[:, None]), s, float("-inf"))
            v = tl.load(
                v_ptr + (q_start + n)[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v.to(tl.float32), DOT_PRECISION)

        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def varlen_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """`torch_ops.prefill_attention` with the tile sizes exposed (powers of two, >= 16)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"q must be [T, Hq, D] and k, v [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != (Hkv, D):
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, {Hkv}, {D}], got {tuple(kv_cache.shape)}"
        )
    B = seq_lens.shape[0]
    if cu_seqlens_q.shape != (B + 1,):
        raise ValueError(f"cu_seqlens_q must have shape ({B + 1},), got {tuple(cu_seqlens_q.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [{B}, max_blocks], got {tuple(block_tables.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    out = torch.empty_like(q)
    if B == 0 or T == 0:
        return out
    # prefill runs eagerly, so reading the longest chunk length on the host is fine
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_q_len <= 0:
        return out
    grid = (triton.cdiv(max_q_len, block_m), B, Hq)
    block_d = max(16, triton.next_power_of_2(D))
    _prefill_kernel[grid](
        q, k, v, kv_cache, block_tables, cu_seqlens_q, seq_lens, out, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), D,
        GROUP=Hq // Hkv, PAGE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=8 if block_d >= 128 else 4,  # float32 tiles: spread the registers
    )  # fmt: skip
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `torch_ops.prefill_attention`."""
    return varlen_prefill_attention(q, k, v, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale)
