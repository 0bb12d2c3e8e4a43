"""The float32 native ops (`cpu_native`: decode attention, add + RMSNorm, SiLU x mul, rotary + KV
write) against the torch twins, and the model using them."""

from __future__ import annotations

import needs
import pytest
import torch
from triton_cases import TOLERANCE, case_id, paged_cache

from disagg.kernels import cpu_native, torch_ops
from disagg.worker.model.loader import load_model

pytestmark = needs.native


@pytest.mark.parametrize("page", [16, 32], ids=case_id)
@pytest.mark.parametrize("head_dim", [64, 128], ids=case_id)
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (8, 2), (8, 1), (9, 3)], ids=case_id)
def test_matches_the_torch_twin(page, head_dim, q_heads, kv_heads):
    # lengths of 1, on and one past a block boundary, and a long one, in one ragged batch
    seq_lens = [1, page, page + 1, 3 * page - 1, 5 * page + 7]
    gen = torch.Generator().manual_seed(page + head_dim + kv_heads)
    cache, tables = paged_cache(seq_lens, page, kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = torch_ops.decode_attention(q, cache, tables, lens, scale)
    got = cpu_native.PagedDecodeAttention(tables, lens, q_heads, kv_heads)(q, cache, scale)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_split_over_threads_equals_one_call(monkeypatch):
    seq_lens = [40, 3, 77, 16, 9, 120, 1, 64]
    gen = torch.Generator().manual_seed(1)
    cache, tables = paged_cache(seq_lens, 16, 2, 64, torch.float32, gen)
    q = torch.randn(len(seq_lens), 4, 64, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    one = cpu_native.PagedDecodeAttention(tables, lens, 4, 2)
    monkeypatch.setattr(cpu_native, "_PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    split = cpu_native.PagedDecodeAttention(tables, lens, 4, 2)
    assert one.threads == 1 and split.threads == 3
    assert torch.equal(split(q, cache, 0.125), one(q, cache, 0.125))


def test_strided_q_view_is_read_correctly():
    """The model passes q as a column slice of its fused qkv output."""
    gen = torch.Generator().manual_seed(2)
    cache, tables = paged_cache([5, 33], 16, 2, 64, torch.float32, gen)
    qkv = torch.randn(2, (4 + 2 * 2) * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(2, 4, 64)
    lens = torch.tensor([5, 33], dtype=torch.int32)
    want = torch_ops.decode_attention(q.contiguous(), cache, tables, lens, 0.125)
    got = cpu_native.PagedDecodeAttention(tables, lens, 4, 2)(q, cache, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(3)
    cache, tables = paged_cache([4], 16, 2, 64, torch.float32, gen)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cpu_native.PagedDecodeAttention(tables, torch.tensor([4], dtype=torch.int32), 3, 2)
    attn = cpu_native.PagedDecodeAttention(tables, torch.tensor([0], dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        attn(torch.randn(1, 4, 64), cache, 0.125)
    attn = cpu_native.PagedDecodeAttention(tables, torch.tensor([4], dtype=torch.int32), 4, 2)
    with pytest.raises(TypeError, match="float32"):
        attn(torch.randn(1, 4, 64).bfloat16(), cache.bfloat16(), 0.125)
    with pytest.raises(ValueError, match="plan"):
        attn(torch.randn(2, 4, 64), cache, 0.125)


def test_add_rms_norm_matches_torch_and_updates_the_residual():
    gen = torch.Generator().manual_seed(4)
    x, res = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    want_sum = x + res
    want = torch_ops.rms_norm(want_sum, weight, 1e-5)
    got = cpu_native.add_rms_norm(x, weight, 1e-5, res)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(res, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(cpu_native.add_rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5))
    with pytest.raises(ValueError, match="residual"):
        cpu_native.add_rms_norm(x, weight, 1e-5, res[:2])
    with pytest.raises(ValueError, match="x: .*float32"):
        cpu_native.add_rms_norm(x.double(), weight, 1e-5)


def test_silu_and_mul_matches_torch_over_the_whole_exp_range():
    gate = torch.linspace(-120, 120, 4001)
    x = torch.cat([gate, torch.linspace(-3, 3, 4001)]).view(1, -1)
    torch.testing.assert_close(cpu_native.silu_and_mul(x), torch_ops.silu_and_mul(x), atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)], ids=case_id)
def test_rotary_write_kv_matches_the_torch_ops(q_heads, kv_heads):
    gen = torch.Generator().manual_seed(6)
    d, page, tokens = 64, 16, 7
    cos_sin = torch.randn(100, d, generator=gen)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.tensor([0, 5, 17, 99, 3, 3, 42])
    slots = torch.tensor([0, 17, 33, -1, 2, 47, 16])  # one token not written
    cache = torch.randn(3, 2, page, kv_heads, d, generator=gen)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    q = want_qkv[:, : q_heads * d].view(tokens, q_heads, d)
    k = want_qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = want_qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d)
    torch_ops.rotary_embedding(positions, q, k, cos_sin)
    torch_ops.write_kv_cache(k, v, want_cache, slots)
    cpu_native.rotary_write_kv(qkv, cos_sin, positions, cache, slots, q_heads, kv_heads)
    torch.testing.assert_close(qkv, want_qkv, **TOLERANCE[torch.float32])
    torch.testing.assert_close(cache, want_cache, **TOLERANCE[torch.float32])
    with pytest.raises(ValueError, match="int64"):
        cpu_native.rotary_write_kv(qkv, cos_sin, positions.int(), cache, slots, q_heads, kv_heads)
    with pytest.raises(ValueError, match="heads"):
        cpu_native.rotary_write_kv(qkv, cos_sin, positions, cache, slots, q_heads + 1, kv_heads)


def test_step_bounds_are_checked_before_the_kernels_trust_them():
    cpu_native.check_step_bounds(torch.tensor([0, 9]), torch.tensor([-1, 31]), 10, 32)
    with pytest.raises(IndexError, match="positions"):
        cpu_native.check_step_bounds(torch.tensor([10]), torch.tensor([0]), 10, 32)
    with pytest.raises(IndexError, match="slot_mapping"):
        cpu_native.check_step_bounds(torch.tensor([1]), torch.tensor([32]), 10, 32)
    tables = torch.tensor([[0, 7]], dtype=torch.int32)
    with pytest.raises(IndexError, match="block_tables"):
        cpu_native.PagedDecodeAttention(tables, torch.tensor([20], dtype=torch.int32), 4, 2, num_blocks=7)


def test_model_with_and_without_the_native_kernels(tiny_llama_dir, paged, monkeypatch):
    """Prefill and decode steps through the model: logits within float32 rounding, same argmax."""
    model, config = load_model(tiny_llama_dir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, config.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 3)]
    caches = [model.allocate_kv_cache(num_blocks=16, block_size=4) for _ in range(2)]
    seqs = [paged(4), paged(4)]

    def both(build):
        out = []
        for native, s, c in zip("10", seqs, caches, strict=True):
            monkeypatch.setenv("DISAGG_CPU_NATIVE", native)
            out.append(model.forward(build(s), c))
        torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)
        assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
        return out[0]

    logits = both(lambda s: s.prefill(list(enumerate(prompts))))
    for _ in range(6):
        step = list(enumerate(logits.argmax(-1).tolist()))
        logits = both(lambda s, step=step: s.decode(step))
    torch.testing.assert_close(caches[0], caches[1], **TOLERANCE[torch.float32])
