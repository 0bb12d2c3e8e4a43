"""Triton kernels over a quantized KV cache (`disagg.kernels.kv_quant`): the write that quantizes
this step's K/V rows into their slots, and paged decode attention reading 8-bit K/V with their
scales. Both take the values and the scales as the format's strided views of the one byte cache,
and agree with the torch twin (tests/kernels/test_triton_kv_quant.py, in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagg.kernels.kv_quant import KVQuantFormat
from disagg.kernels.triton_dot import dot_precision


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _round_to_e4m3_grid(y):
    """y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32: the step
    is 2^(E-3) at exponent E >= -6 (below, the subnormal step 2^-9). The cast to fp8 is then
    exact, whatever rounding the conversion does (the interpreter's loses a carry into the exponent)."""
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = _round_half_even(a / step) * step
    return tl.where(y < 0, -r, r)


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] float32 (masked lanes 0) -> (values in the store dtype, scales [BLOCK_H])."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / QMAX
    y = x / scale[:, None]
    if FP8:
        q = _round_to_e4m3_grid(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.float8e4nv)
    else:
        q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
    return q, scale


@triton.jit
def _write_kv_q8_kernel(
    k_ptr,
    v_ptr,
    values_ptr,
    scales_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_vb,
    stride_vkv,
    stride_vs,
    stride_vh_c,
    stride_sb,
    stride_skv,
    stride_ss,
    num_heads,
    head_dim,
    block_size,
    QMAX: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # negative slots are padding or tokens whose KV is not kept
        h = tl.arange(0, BLOCK_H)
        heads = h[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (cols < head_dim)
        blk, off = slot // block_size, slot % block_size
        dst = values_ptr + blk * stride_vb + off * stride_vs + heads * stride_vh_c + cols
        sdst = scales_ptr + blk * stride_sb + off * stride_ss + h
        k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + cols, mask=mask, other=0.0).to(tl.float32)
        qk, sk = _quantize_rows(k, QMAX, FP8)
        qv, sv = _quantize_rows(v, QMAX, FP8)
        tl.store(dst, qk, mask=mask)
        tl.store(dst + stride_vkv, qv, mask=mask)
        tl.store(sdst, sk, mask=h < num_heads)
        tl.store(sdst + stride_skv, sv, mask=h < num_heads)


def write_kv_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVQuantFormat,
) -> None:
    """`KVQuantFormat.write`: key/value [T, Hkv, D] quantized into their slots of one layer's
    quantized cache [blocks, region_bytes] (negative slots skipped)."""
    values, scales = fmt.values(layer_cache), fmt.scales(layer_cache)
    hkv, d = fmt.num_kv_heads, fmt.head_dim
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (hkv, d):
        raise ValueError(
            f"key/value must be [T, {hkv}, {d}], got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous head dim")
    if key.shape[0] == 0:
        return
    _write_kv_q8_kernel[(key.shape[0],)](
        key, value, values, scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        scales.stride(0), scales.stride(1), scales.stride(2),
        hkv, d, fmt.block_size,
        QMAX=fmt.qmax, FP8=fmt.name == "fp8",
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


@triton.jit
def _decode_q8_kernel(
    q_ptr,
    values_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_vb,
    stride_vkv,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_skv,
    stride_ss,
    stride_btb,
    stride_ob,
    stride_oh,
    head_dim,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head) and its GQA group of query heads; online softmax in
    float32 over tiles of BLOCK_N cached tokens, each row dequantized with its own scale."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
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
    for n0 in range(0, seq_len, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        pages = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = pages * stride_vb + (n % PAGE) * stride_vs + kv_head * stride_vh
        srows = pages * stride_sb + (n % PAGE) * stride_ss + kv_head
        nd_mask = n_mask[:, None] & d_mask[None, :]
        ks = tl.load(scales_ptr + srows, mask=n_mask, other=0.0)
        k = (
            tl.load(values_ptr + rows[:, None] + d[None, :], mask=nd_mask, other=0.0).to(tl.float32)
            * ks[:, None]
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vs = tl.load(scales_ptr + stride_skv + srows, mask=n_mask, other=0.0)
        v = tl.load(values_ptr + stride_vkv + rows[:, None] + d[None, :], mask=nd_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32) * vs[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hd_mask,
    )


def decode_attention_quantized(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    fmt: KVQuantFormat,
) -> torch.Tensor:
    """`torch_ops.decode_attention` over one layer of a quantized cache [blocks, region_bytes]."""
    values, scales = fmt.values(layer_cache), fmt.scales(layer_cache)
    if q.dim() != 3 or q.shape[2] != fmt.head_dim or q.shape[1] % fmt.num_kv_heads or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [B, Hq, {fmt.head_dim}] with Hq a multiple of {fmt.num_kv_heads}, got {tuple(q.shape)}"
        )
    b, hq, d = q.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"block_tables [{b}, W] and seq_lens [{b}] expected, got {tuple(block_tables.shape)}, "
                         f"{tuple(seq_lens.shape)}")  # fmt: skip
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    group, page = hq // fmt.num_kv_heads, fmt.block_size
    _decode_q8_kernel[(b, fmt.num_kv_heads)](
        q, values, scales, block_tables, seq_lens, out, float(scale),
        q.stride(0), q.stride(1),
        values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        scales.stride(0), scales.stride(1), scales.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), d,
        GROUP=group, PAGE=page,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs at least 16 rows on GPUs
        BLOCK_N=min(max(32, page), 64), BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out
