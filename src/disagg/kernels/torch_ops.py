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

`rotary_cos_sin`, `kv_write_rows` and `plan_decode` hold the part of an op that is the same in
every layer of a step; the model computes them once per forward on this path and calls
`rotate_heads`, `write_kv_rows` and `decode_attention_planned` per layer. The six op-table
functions keep their signatures and compose the two halves.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = F.rms_norm(x, weight.shape, weight, eps)  # one fused pass, same float32 arithmetic
    else:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = out.to(x.dtype) * weight
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, gate being the first half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D/2] of each token's position (shared by every layer of a step)."""
    cs = cos_sin_cache.index_select(0, positions.long())
    half = cs.shape[-1] // 2
    return cs[:, None, :half], cs[:, None, half:]


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, H, D] in place by the angles of `rotary_cos_sin`. The model passes q and k
    (adjacent in its fused qkv output) as one tensor: half the small ops of rotating each."""
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half:]
    x1f, x2f = x1.float(), x2.float()
    o1 = x1f * cos - x2f * sin
    o2 = x2f * cos + x1f * sin
    x1.copy_(o1)
    x2.copy_(o2)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by the angles of `rotary_cos_sin`."""
    rotate_heads(q, cos, sin)
    rotate_heads(k, cos, sin)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (NeoX / Hugging Face "rotate_half" style).

    cos_sin_cache: [max_position, D] float32, cos in the first D/2 columns, sin in the rest.
    """
    cos, sin = rotary_cos_sin(positions, cos_sin_cache)
    apply_rotary(q, k, cos, sin)


def kv_write_rows(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(mask of the tokens to write, or None for all; their K rows in a cache viewed as
    [blocks * 2 * block_size, Hkv, D]). The V row is the K row + block_size. Same for every layer."""
    valid = slot_mapping >= 0
    keep = None if bool(valid.all()) else valid
    if keep is not None:
        slot_mapping = slot_mapping[keep]
    return keep, (slot_mapping // block_size) * (2 * block_size) + slot_mapping % block_size


def write_kv_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    keep: torch.Tensor | None,
    k_rows: torch.Tensor,
) -> None:
    """`write_kv_cache` with the rows of `kv_write_rows` (kv_cache must be contiguous)."""
    if keep is not None:
        key, value = key[keep], value[keep]
    flat = kv_cache.view(-1, *kv_cache.shape[3:])
    flat.index_copy_(0, k_rows, key.to(kv_cache.dtype))
    flat.index_copy_(0, k_rows + kv_cache.shape[2], value.to(kv_cache.dtype))


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value [T, Hkv, D] into their slots of one layer's paged cache."""
    block_size = kv_cache.shape[2]
    if kv_cache.is_contiguous():  # one index_copy_ per K and V instead of a two-index scatter
        write_kv_rows(key, value, kv_cache, *kv_write_rows(slot_mapping, block_size))
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
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


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[len, H, D] -> a float32 [1, H, len, D] view (a copy only to widen the dtype)."""
    return x.float().unsqueeze(0).transpose(1, 2)


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
        # [1, H, len, D] views: with a batch dimension CPU SDPA takes its fused kernel (3-4x the
        # speed of the 3-D call, which materializes every score) and still broadcasts KV heads
        qb = _heads_first(q[s:e])
        if kv_len == q_len:  # whole prompt in this chunk: use the fresh K/V, no gather
            kb, vb = _heads_first(k[s:e]), _heads_first(v[s:e])
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kb, vb = gather_kv(kv_cache, block_tables[b], kv_len)
            kb, vb = _heads_first(kb), _heads_first(vb)
            # query i sits at position kv_len - q_len + i and sees keys 0..that position
            qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = ob[0].transpose(0, 1).to(q.dtype)
    return out


def _length_groups(lens: list[int], block_size: int, min_fill: float = 0.5) -> list[list[int]]:
    """Sequence indices grouped so each group pads its sequences to at most 1/min_fill of their
    block count: attention over one padded group is one SDPA call, and no sequence pays for
    the longest one of the whole batch."""
    nblocks = [(n + block_size - 1) // block_size for n in lens]
    order = sorted(range(len(lens)), key=lambda b: -nblocks[b])
    groups: list[list[int]] = []
    for b in order:
        if groups and nblocks[b] >= min_fill * nblocks[groups[-1][0]]:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


@dataclass
class DecodeGroup:
    """Sequences attended together: padded to the longest, K/V gathered in one index_select."""

    index: torch.Tensor | None  # [b] rows of the batch, None when the group is the whole batch
    rows: torch.Tensor  # [2 * b * Hkv * length] rows of the cache viewed as [-1, D]
    length: int
    mask: torch.Tensor | None  # [b, 1, 1, length] valid positions, None when none are padding


def plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_kv_heads: int
) -> list[DecodeGroup]:
    """Everything `decode_attention_planned` needs that does not depend on the layer."""
    lens = seq_lens.tolist()
    B = len(lens)
    dev = block_tables.device
    tables = block_tables.long()
    plan = []
    for group in _length_groups(lens, block_size):
        length = max(lens[b] for b in group)
        index = torch.tensor(group, dtype=torch.long, device=dev) if len(group) < B else None
        t = tables if index is None else tables.index_select(0, index)
        pos = torch.arange(length, device=dev)
        # row of (block, K|V, offset, head) in the cache viewed as [-1, D], in attention layout
        slot = (t.index_select(1, pos // block_size) * (2 * block_size) + pos % block_size) * num_kv_heads
        kv_off = torch.tensor([0, block_size * num_kv_heads], device=dev)[:, None, None, None]
        heads = torch.arange(num_kv_heads, device=dev)[None, None, :, None]
        rows = (slot[None, :, None, :] + kv_off + heads).reshape(-1)
        mask = None
        if any(lens[b] != length for b in group):
            glens = seq_lens if index is None else seq_lens.index_select(0, index)
            mask = (pos[None, :] < glens[:, None].to(dev))[:, None, None, :]
        plan.append(DecodeGroup(index, rows, length, mask))
    return plan


def decode_attention_planned(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: list[DecodeGroup], scale: float
) -> torch.Tensor:
    """`decode_attention` with the layer-independent work of `plan_decode` done once.

    Each group's K/V rows are gathered straight into [b, Hkv, length, D] (no copy of whole
    blocks, no second copy to transpose them) and go to one SDPA call with GQA and a float32
    softmax; a group never pads to a sequence much longer than its own.
    """
    B, Hq, D = q.shape
    Hkv = kv_cache.shape[3]
    if not kv_cache.is_contiguous():
        kv_cache = kv_cache.contiguous()
    flat = kv_cache.view(-1, D)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    qf = q.float()
    for g in plan:
        b = B if g.index is None else g.index.shape[0]
        kv = flat.index_select(0, g.rows).view(2, b, Hkv, g.length, D).float()
        qg = (qf if g.index is None else qf.index_select(0, g.index)).unsqueeze(2)  # [b, Hq, 1, D]
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.mask, scale=scale, enable_gqa=True)
        if g.index is None:
            out.copy_(o.squeeze(2))
        else:
            out.index_copy_(0, g.index, o.squeeze(2))
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] attends to its first seq_lens[b] cached
    positions (the current token's K/V already written). Returns [B, Hq, D]."""
    plan = plan_decode(block_tables.to(q.device), seq_lens, kv_cache.shape[2], kv_cache.shape[3])
    return decode_attention_planned(q, kv_cache, plan, scale)
