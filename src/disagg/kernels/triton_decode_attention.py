"""Paged decode attention: one query token per sequence against its paged KV cache.

One program serves one (sequence, KV head) pair and all the query heads of that GQA group,
so each K/V tile is loaded once per group. Softmax is online (running max and sum over KV
tiles) and in float32. For long contexts with few sequences, the flash-decoding variant
splits each context into partitions handled by separate programs, each writing a partial
output plus its log-sum-exp, and a second kernel merges the partitions.

Nothing here reads device values on the host (the split count depends on shapes only), so
the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from disagg.kernels.triton_dot import dot_precision

# A partition shorter than this does not pay for the extra launch and the merge.
MIN_PARTITION_TOKENS = 256
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    partition,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    head_dim,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        start = split * partition
        end = tl.minimum(seq_len, start + partition)
    else:
        start = 0
        end = seq_len

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    hd_mask = head_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hd_mask, other=0.0)
    q = q.to(tl.float32) * scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_btb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        pages = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = pages * stride_cb + (n % PAGE) * stride_cs + kv_head * stride_ch
        nd_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=nd_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(cache_ptr + stride_ckv + rows[:, None] + d[None, :], mask=nd_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty partition (past the end of a short sequence) leaves l_i == 0: output 0, lse -inf
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(dst + split * stride_os, out, mask=hd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_mask)
    else:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit
def _merge_partitions_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # 0 for empty partitions
    parts = tl.load(
        part_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many partitions to split each context into: enough programs to fill the device
    (about two per SM), never partitions shorter than MIN_PARTITION_TOKENS. Depends on shapes
    only, so a captured CUDA graph and its replays agree."""
    programs = num_seqs * num_kv_heads
    by_length = triton.cdiv(max_context, MIN_PARTITION_TOKENS)
    if programs >= num_sms or by_length <= 1:
        return 1
    return max(1, min(by_length, triton.cdiv(2 * num_sms, programs), MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: one program at a time, splitting gains nothing


def _check(q, kv_cache, block_tables, seq_lens) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    B, Hq, D = q.shape
    Hkv = kv_cache.shape[3]
    if kv_cache.shape[4] != D:
        raise ValueError(f"kv_cache head dim {kv_cache.shape[4]} != q head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [{B}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must have shape ({B},), got {tuple(seq_lens.shape)}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dim")


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`torch_ops.decode_attention` with the split count exposed: None picks it from the
    shapes (`choose_num_splits`), 1 forces the single-pass kernel, more forces flash-decoding."""
    _check(q, kv_cache, block_tables, seq_lens)
    B, Hq, D = q.shape
    _, _, page, Hkv, _ = kv_cache.shape
    group = Hq // Hkv
    out = torch.empty_like(q)
    if B == 0:
        return out
    max_context = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_context, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_n = min(max(32, page), 64)
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows on GPUs
    block_d = max(16, triton.next_power_of_2(D))
    partition = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    splits = triton.cdiv(max_context, partition) if num_splits > 1 else 1
    common = dict(
        GROUP=group,
        PAGE=page,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
    )
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    if splits == 1:
        _decode_kernel[(B, Hkv, 1)](
            q, kv_cache, block_tables, seq_lens, out, out, float(scale), 0,
            q.stride(0), q.stride(1), *cache_strides, block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0, D,
            SPLIT=False, **common,
        )  # fmt: skip
        return out
    parts = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(B, Hkv, splits)](
        q, kv_cache, block_tables, seq_lens, parts, lse, float(scale), partition,
        q.stride(0), q.stride(1), *cache_strides, block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1), D,
        SPLIT=True, **common,
    )  # fmt: skip
    _merge_partitions_kernel[(B, Hq)](
        parts, lse, out, splits,
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), D,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same contract as `torch_ops.decode_attention`; the split count is chosen automatically."""
    return paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)
