"""The CPU attention and cache ops against direct per-sequence formulas.

`decode_attention` groups sequences by length and gathers K/V rows straight into attention
layout; `write_kv_cache` scatters through a flat view. Both must give what the plain
definitions give, for ragged lengths, shuffled block tables and non-contiguous caches.
"""

from __future__ import annotations

import sys

import pytest
import torch

from disagg.kernels import torch_ops
from disagg.worker.model.runner import keep_freed_cpu_memory

BLOCK, HQ, HKV, D = 4, 6, 2, 8


def _paged_setup(lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // BLOCK) for n in lens]
    total = sum(nblocks) + 3
    cache = torch.randn(total, 2, BLOCK, HKV, D, generator=g)
    perm = torch.randperm(total, generator=g)
    tables = torch.full((len(lens), max(nblocks) + 2), 7, dtype=torch.int32)  # padded with a valid id
    used = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(len(lens), HQ, D, generator=g)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


def _reference_decode(q, cache, tables, lens, scale):
    out = torch.empty_like(q)
    group = HQ // HKV
    for b, n in enumerate(lens.tolist()):
        k, v = torch_ops.gather_kv(cache, tables[b], n)  # [n, Hkv, D]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize(
    "lens",
    [[1], [5], [4, 4, 4], [1, 2, 3, 17, 40, 41, 9, 16], [33, 3, 30, 2, 31, 5]],
)
def test_decode_attention_matches_per_sequence_softmax(lens):
    q, cache, tables, seq_lens = _paged_setup(lens)
    scale = D**-0.5
    got = torch_ops.decode_attention(q, cache, tables, seq_lens, scale)
    torch.testing.assert_close(got, _reference_decode(q, cache, tables, seq_lens, scale))


def test_decode_attention_on_a_non_contiguous_cache():
    lens = [6, 13, 2]
    q, cache, tables, seq_lens = _paged_setup(lens, seed=1)
    layered = torch.stack([torch.zeros_like(cache), cache], dim=1)[:, 1]  # non-contiguous view
    assert not layered.is_contiguous()
    scale = 0.3
    expected = _reference_decode(q, cache, tables, seq_lens, scale)
    torch.testing.assert_close(torch_ops.decode_attention(q, layered, tables, seq_lens, scale), expected)


def test_decode_attention_keeps_the_query_dtype():
    q, cache, tables, seq_lens = _paged_setup([3, 9])
    got = torch_ops.decode_attention(q.bfloat16(), cache.bfloat16(), tables, seq_lens, 0.25)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape


def test_length_groups_cover_every_sequence_once_and_bound_padding():
    lens = [1, 2, 3, 17, 40, 41, 9, 16, 100, 64, 65]
    groups = torch_ops._length_groups(lens, BLOCK, min_fill=0.5)
    assert sorted(b for g in groups for b in g) == list(range(len(lens)))
    for g in groups:
        blocks = [-(-lens[b] // BLOCK) for b in g]
        assert min(blocks) >= 0.5 * max(blocks)


@pytest.mark.parametrize("contiguous", [True, False])
def test_write_kv_cache_fills_exactly_the_mapped_slots(contiguous):
    g = torch.Generator().manual_seed(2)
    base = torch.zeros(5, 2, BLOCK, HKV, D)
    cache = base if contiguous else torch.stack([base, base.clone()], dim=1)[:, 0]
    key = torch.randn(4, HKV, D, generator=g)
    value = torch.randn(4, HKV, D, generator=g)
    slots = torch.tensor([0, 7, -1, 19])  # -1: skipped
    torch_ops.write_kv_cache(key, value, cache, slots)
    expected = torch.zeros(5, 2, BLOCK, HKV, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // BLOCK, 0, s % BLOCK] = key[i]
            expected[s // BLOCK, 1, s % BLOCK] = value[i]
    assert torch.equal(cache, expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc setting")
def test_keep_freed_cpu_memory_applies_on_linux_and_is_idempotent():
    assert keep_freed_cpu_memory() is True
    assert keep_freed_cpu_memory() is True
