"""Builders of paged-KV scenarios shared by the kernel tests (random contents, shuffled blocks)."""

from __future__ import annotations

import torch

from disagg.kernels import torch_ops

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def paged_cache(
    seq_lens: list[int], page: int, kv_heads: int, head_dim: int, dtype, gen, spare_blocks: int = 2
):
    """A random cache and block tables: each sequence owns shuffled blocks; the table rows are
    padded with a valid id; the spare blocks are never referenced. Stale random data sits in
    every slot past each sequence's end, so a missing mask changes the result."""
    needed = [cdiv(n, page) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(needed) + 1
    tables = torch.full((len(seq_lens), width), int(ids[-1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[used : used + n]
        used += n
    cache = torch.randn(num_blocks, 2, page, kv_heads, head_dim, generator=gen).to(dtype)
    return cache, tables


def slots_for(tables: torch.Tensor, page: int, seq: int, positions: range) -> list[int]:
    return [int(tables[seq, p // page]) * page + p % page for p in positions]


def prefill_case(context_lens, q_lens, page, q_heads, kv_heads, head_dim, dtype, seed=0):
    """Packed chunks: sequence b has context_lens[b] earlier tokens in the cache and q_lens[b]
    new ones, whose K/V are written to the cache first (as the model does)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    cache, tables = paged_cache(seq_lens, page, kv_heads, head_dim, dtype, gen)
    total = sum(q_lens)
    q = torch.randn(total, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    slots = []
    for b, (c, n) in enumerate(zip(context_lens, q_lens, strict=True)):
        slots += slots_for(tables, page, b, range(c, c + n))
    torch_ops.write_kv_cache(k, v, cache, torch.tensor(slots, dtype=torch.int64))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32)


def case_id(value) -> str:
    """Readable test ids: dtypes by name, everything else as is."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)
