"""The float32 decode fast paths give bit-identical results to the general ones they bypass.

The model's in-place residual norm, five-op rotary and one-group decode attention, the runner's
decode batch builder and the sampler's pure-greedy return are all shortcuts: each is compared
with `torch.equal` (not a tolerance) against the path it replaces.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import torch_ops
from disagg.worker.engine.batch_builder import build_decode, build_packed
from disagg.worker.engine.request import Request
from disagg.worker.engine.sampler import Sampler
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from disagg.worker.model.config import RopeConfig
from disagg.worker.model.llama import (
    add_rms_norm_,
    decode_attention_one_group,
    rope_cos_sin_cache,
    rotary_full_width,
    rotate_heads_full_width,
    single_decode_group,
)
from disagg.worker.model.loader import load_model

BLOCK, HQ, HKV, D = 4, 6, 2, 16


def test_add_rms_norm_in_place_equals_the_op():
    g = torch.Generator().manual_seed(0)
    x, residual, weight = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.rand(32)
    want, want_residual = torch_ops.rms_norm(x, weight, 1e-5, residual.clone())
    got = add_rms_norm_(residual, x, weight, 1e-5)
    assert torch.equal(got, want)
    assert torch.equal(residual, want_residual)


@pytest.mark.parametrize("positions", [[0], [37], [3, 250, 9, 0]])
def test_full_width_rotary_equals_rotate_heads(positions):
    cache = rope_cos_sin_cache(RopeConfig(), D, 256)
    cos, sin = torch_ops.rotary_cos_sin(torch.tensor(positions), cache)
    x = torch.randn(len(positions), HQ + HKV, D, generator=torch.Generator().manual_seed(1))
    want = x.clone()
    torch_ops.rotate_heads(want, cos, sin)
    rotate_heads_full_width(x, *rotary_full_width(cos, sin))
    assert torch.equal(x, want)


def _cache_and_tables(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // BLOCK) for n in lens]
    cache = torch.randn(sum(nblocks) + 2, 2, BLOCK, HKV, D, generator=g)
    perm = torch.randperm(cache.shape[0], generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = perm[used : used + n]
        used += n
    return cache, tables, torch.randn(len(lens), HQ, D, generator=g)


@pytest.mark.parametrize("lens", [[1], [9], [13, 13, 13]])
def test_one_group_decode_attention_equals_planned(lens):
    cache, tables, q = _cache_and_tables(lens)
    plan = torch_ops.plan_decode(tables, torch.tensor(lens, dtype=torch.int32), BLOCK, HKV)
    group = single_decode_group(plan)
    assert group is not None
    got = decode_attention_one_group(q, cache, group, D**-0.5)
    assert torch.equal(got, torch_ops.decode_attention_planned(q, cache, plan, D**-0.5))


def test_single_decode_group_refuses_padded_or_split_plans():
    cache, tables, _ = _cache_and_tables([3, 5])  # same group, padded to 5
    plan = torch_ops.plan_decode(tables, torch.tensor([3, 5], dtype=torch.int32), BLOCK, HKV)
    assert single_decode_group(plan) is None
    cache, tables, _ = _cache_and_tables([2, 40])  # two groups
    plan = torch_ops.plan_decode(tables, torch.tensor([2, 40], dtype=torch.int32), BLOCK, HKV)
    assert single_decode_group(plan) is None


def _decoding_request(rid: str, prompt_len: int, outputs: int, blocks: list[int]) -> Request:
    r = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(temperature=0.0))
    r.output_token_ids = list(range(300, 300 + outputs))
    r.block_ids = blocks
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_decode_batch_builder_equals_the_packed_one():
    reqs = [
        _decoding_request("a", 5, 3, [7, 2]),
        _decoding_request("b", 1, 0, [4]),
        _decoding_request("c", 9, 4, [0, 5, 1, 3]),
    ]
    out = SchedulerOutput(is_prefill=False, chunks=[ScheduledChunk(r, r.num_tokens - 1, 1) for r in reqs])
    fast, packed = build_decode(out, BLOCK), build_packed(out, BLOCK)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables", "logits_indices"):
        a, b = getattr(fast, name), getattr(packed, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.is_prefill is False and fast.cu_seqlens_q is None


def test_pure_greedy_sampler_returns_argmax_without_logprobs():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    reqs = [Request(str(i), [1, 2], SamplingParams(temperature=0.0)) for i in range(4)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 4
    reqs[2] = Request("lp", [1, 2], SamplingParams(temperature=0.0, logprobs=2))
    mixed = Sampler()(logits, reqs)  # the general path, for one row asking logprobs
    assert mixed.token_ids == out.token_ids
    assert mixed.logprobs[2] is not None and mixed.logprobs[2].token_id == out.token_ids[2]


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_model_fast_path_equals_the_op_table_path(tiny_model_dir, paged, num_seqs, monkeypatch):
    """A contiguous cache takes the float32 fast path, a non-contiguous one the op table; the
    logits of a prefill and of batch-1 / batch-3 decode steps must be bit-identical. (The native
    decode kernel sums in another order, so it is compared within rounding in tests/kernels.)"""
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
    model, config = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, config.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 3)][
        :num_seqs
    ]
    contiguous = model.allocate_kv_cache(num_blocks=16, block_size=BLOCK)
    shape = model.kv_cache_shape(16, BLOCK)
    strided = torch.zeros(*shape[:-1], shape[-1] + 3)[..., : shape[-1]]  # same values, other path
    assert not strided.is_contiguous()
    seqs_fast, seqs_ops = paged(BLOCK), paged(BLOCK)
    fast = model.forward(seqs_fast.prefill(list(enumerate(prompts))), contiguous)
    general = model.forward(seqs_ops.prefill(list(enumerate(prompts))), strided)
    assert torch.equal(fast, general)
    for _ in range(5):
        step = list(enumerate(fast.argmax(-1).tolist()))
        fast = model.forward(seqs_fast.decode(step), contiguous)
        general = model.forward(seqs_ops.decode(step), strided)
        assert torch.equal(fast, general)
