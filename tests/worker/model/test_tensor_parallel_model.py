"""The sharded model: the split of heads, features and vocabulary, and logits at TP=2 and TP=4 equal
to the whole model's (gloo ranks as threads of this process, so the comparison is cheap)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disagg.worker.model import parallel
from disagg.worker.model.loader import load_model
from disagg.worker.model.parallel import TensorParallel, shard_plan

from ..conftest import llama_config, mistral_config, qwen2_config, save_hf_model

BLOCK_SIZE = 8
TOL = dict(atol=1e-4, rtol=1e-4)


def _plan(rank, world, hq=8, hkv=2, inter=64, vocab=10):
    return shard_plan(rank, world, num_attention_heads=hq, num_key_value_heads=hkv, intermediate_size=inter,
                      vocab_size=vocab)  # fmt: skip


def test_kv_heads_split_while_ranks_do_not_outnumber_them():
    plans = [_plan(r, 2) for r in range(2)]
    assert [(p.q_head_start, p.num_heads, p.kv_head_start, p.num_kv_heads) for p in plans] == [
        (0, 4, 0, 1),
        (4, 4, 1, 1),
    ]
    assert not plans[0].kv_replicated


def test_kv_heads_replicated_so_each_rank_holds_the_head_its_queries_read():
    group = 8 // 2  # query heads per KV head
    for rank in range(4):
        p = _plan(rank, 4)
        assert p.num_kv_heads == 1 and p.kv_replicated
        assert p.q_head_start // group == p.kv_head_start
        assert (p.q_head_start + p.num_heads - 1) // group == p.kv_head_start


def test_vocabulary_shards_cover_it_once_padding_the_last():
    plans = [_plan(r, 4) for r in range(4)]
    assert {p.vocab_shard for p in plans} == {3}
    assert [(p.vocab_start, p.vocab_end) for p in plans] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    weight = torch.arange(10.0).unsqueeze(1)
    assert parallel.vocab_rows(plans[3], weight).squeeze(1).tolist() == [9.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("world", "kwargs", "field"),
    [
        (3, {}, "num_attention_heads"),
        (4, dict(hkv=3, hq=12), "num_key_value_heads 3"),
        (2, dict(inter=63), "intermediate_size"),
        (8, dict(hkv=3, hq=24), "multiple"),
    ],
)
def test_unshardable_models_are_refused_naming_the_setting_and_the_field(world, kwargs, field):
    with pytest.raises(ValueError, match="tensor_parallel_size") as info:
        _plan(0, world, **kwargs)
    assert field in str(info.value)


def run_ranks(world: int, fn):
    """`fn(rank, group)` on `world` threads sharing a gloo group over loopback; their results."""
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    results: list = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int):
        try:
            own = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world, False)
            group = dist.ProcessGroupGloo(own, rank, world, timedelta(seconds=30))
            results[rank] = fn(rank, group)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _steps(model_dir, paged, tp_world: int | None, prompts: list[list[int]], chunk: int):
    """Logits of a chunked ragged prefill then three greedy decode steps, on one rank's model."""

    def on_rank(rank, group):
        tp = None
        if tp_world is not None:
            from disagg.worker.model.config import ModelConfig

            config = ModelConfig.from_pretrained(model_dir)
            tp = TensorParallel(parallel.plan_for(rank, tp_world, config), group)
        model, _ = load_model(model_dir, tp=tp)
        kv = model.allocate_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)
        seqs = paged(BLOCK_SIZE)
        out, final = [], {}
        for start in range(0, max(map(len, prompts)), chunk):  # chunked prefill, ragged rows
            rows = [(i, p[start : start + chunk]) for i, p in enumerate(prompts) if len(p) > start]
            out.append(model.forward(seqs.prefill(rows), kv))
            final.update(
                {i: out[-1][row] for row, (i, ids) in enumerate(rows) if start + len(ids) == len(prompts[i])}
            )
        last = torch.stack([final[i] for i in range(len(prompts))])
        for _ in range(3):
            last = model.forward(seqs.decode(list(enumerate(last.argmax(-1).tolist()))), kv)
            out.append(last)
        return out

    if tp_world is None:
        return _steps_single(on_rank)
    return run_ranks(tp_world, on_rank)


def _steps_single(on_rank):
    return on_rank(0, None)


@pytest.fixture(scope="module")
def tiny_qwen2_one_kv_head_dir(tmp_path_factory):
    """Qwen2 (q/k/v bias, tied embeddings) with one KV head: TP=2 replicates it."""
    return save_hf_model(qwen2_config(num_key_value_heads=1), tmp_path_factory.mktemp("qwen2-1kv"), seed=4)


@pytest.fixture(scope="module")
def tiny_llama_all_biases_dir(tmp_path_factory):
    """Llama with attention and MLP biases: the row-parallel o and down biases are added once."""
    config = llama_config(attention_bias=True, mlp_bias=True)
    return save_hf_model(config, tmp_path_factory.mktemp("llama-biases"), seed=6)


@pytest.fixture(scope="module")
def tiny_mistral_odd_vocab_dir(tmp_path_factory):
    """Mistral with a vocabulary four ranks cannot split evenly (the last shard is padded)."""
    return save_hf_model(mistral_config(vocab_size=510), tmp_path_factory.mktemp("mistral-510"), seed=5)


@pytest.mark.parametrize(
    ("model_fixture", "world"),
    [
        ("tiny_llama_dir", 2),
        ("tiny_llama_all_biases_dir", 2),
        ("tiny_qwen2_dir", 2),
        ("tiny_qwen2_one_kv_head_dir", 2),
        ("tiny_mistral_dir", 2),
        ("tiny_mistral_odd_vocab_dir", 4),
    ],
)
def test_sharded_logits_equal_the_whole_models(request, paged, one_torch_thread, model_fixture, world):
    model_dir = request.getfixturevalue(model_fixture)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 11, 20)]
    expected = _steps(model_dir, paged, None, prompts, chunk=8)
    per_rank = _steps(model_dir, paged, world, prompts, chunk=8)
    for logits in per_rank:  # every rank ends with the full logits
        assert len(logits) == len(expected)
        for got, want in zip(logits, expected, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, **TOL)
