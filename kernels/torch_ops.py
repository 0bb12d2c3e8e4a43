"""Plain-torch implementations of the engine's hot operations.

These are the CPU path and the reference every Triton kernel is tested against.

Shapes used throughout:
  T  tokens in a packed batch, B sequences, Hq query heads, Hkv KV heads, D head dim.
  kv_cache (one layer): [num_blocks, 2, block_size, Hkv, D]; index 0 of dim 1 is K, 1 is V.
    One (layer, block) pair is contiguous, which is what KV transfer moves.
  slot_mapping: [T] int64, block_id * block_size + offset; negative entries are skipped.
  block_tables: [B, max_blocks] int32, padded with any valid id (only the first
    ceil(seq_len / block_size) entries of a row are read).
  seq_lens: [B] int32, total KV length of each sequence *including* this step's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32. With `residual`, first adds it to x and also returns the sum
    (the new residual), as the fused add+norm of a decoder layer does."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = out.to(x.dtype) * weight
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, gate being the first half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (NeoX / Hugging Face "rotate_half" style).

    cos_sin_cache: [max_position, D] float32, cos in the first D/2 columns, sin in the rest.
    """
    cs = cos_sin_cache.index_select(0, positions.long())
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for t in (q, k):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        t[..., :half] = o1.to(t.dtype)
        t[..., half:] = o2.to(t.dtype)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value [T, Hkv, D] into their slots of one layer's paged cache."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [seq_len, Hkv, D] of one sequence, read through its block table."""
    block_size = kv_cache.shape[2]
    n = (seq_len + block_size - 1) // block_size
    blocks = kv_cache.index_select(0, block_table[:n].long())  # [n, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(n * block_size, *kv_cache.shape[3:])[:seq_len]
    v = blocks[:, 1].reshape(n * block_size, *kv_cache.shape[3:])[:seq_len]
    return k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """q [Hq, Lq, D], k/v [Hkv, Lk, D] -> [Hq, Lq, D], GQA by repeating KV heads, float32 softmax."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    dtype = q.dtype
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
    return out.to(dtype)


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
    """Causal attention for packed variable-length prompt chunks.

    q [T, Hq, D]; k/v [T, Hkv, D] are this step's keys/values (already written to the cache).
    Sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1] at positions
    seq_lens[b] - q_len_b ... seq_lens[b] - 1, and attends to every earlier position; the
    part before this chunk (a cached prefix or earlier chunks) is read from the paged cache.
    Returns [T, Hq, D].
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        q_len, kv_len = e - s, lens[b]
        if q_len == 0:
            continue
        if kv_len == q_len:  # whole prompt in this chunk: use the fresh K/V, no gather
            kb, vb = k[s:e], v[s:e]
            mask = None
            causal = True
        else:
            kb, vb = gather_kv(kv_cache, block_tables[b], kv_len)
            causal = False
            # query i sits at position kv_len - q_len + i and sees keys 0..that position
            qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos
        qb = q[s:e].transpose(0, 1)
        if causal:
            group = qb.shape[0] // kb.shape[1]
            kk = kb.transpose(0, 1)
            vv = vb.transpose(0, 1)
            if group > 1:
                kk = kk.repeat_interleave(group, dim=0)
                vv = vv.repeat_interleave(group, dim=0)
            ob = F.scaled_dot_product_attention(
                qb.float(), kk.float(), vv.float(), is_causal=True, scale=scale
            ).to(q.dtype)
        else:
            ob = _sdpa(qb, kb.transpose(0, 1), vb.transpose(0, 1), scale, mask)
        out[s:e] = ob.transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] attends to its first seq_lens[b] cached
    positions (the current token's K/V already written). Returns [B, Hq, D]."""
    B, Hq, D = q.shape
    block_size, Hkv = kv_cache.shape[2], kv_cache.shape[3]
    max_len = int(seq_lens.max())
    n = (max_len + block_size - 1) // block_size
    blocks = kv_cache.index_select(0, block_tables[:, :n].reshape(-1).long())  # [B*n, 2, bs, Hkv, D]
    blocks = blocks.view(B, n, 2, block_size, Hkv, D)
    k = blocks[:, :, 0].reshape(B, n * block_size, Hkv, D)
    v = blocks[:, :, 1].reshape(B, n * block_size, Hkv, D)
    group = Hq // Hkv
    qg = q.view(B, Hkv, group, D).float()
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * scale
    valid = torch.arange(n * block_size, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(B, Hq, D).to(q.dtype)
