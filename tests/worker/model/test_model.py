"""The model's logits equal transformers' for packed ragged prefill, decode and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from disagg.worker.model.llama import rope_inv_freq
from disagg.worker.model.loader import load_model

from ..conftest import TINY_VOCAB

BLOCK_SIZE = 16
PROMPT_LENS = (1, 5, 17, 33)
TOL = dict(atol=1e-4, rtol=1e-4)


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def _hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def test_ragged_prefill_then_decode_match_transformers(tiny_model_dir, hf_model, paged):
    assert_ragged_steps_match(tiny_model_dir, hf_model, paged)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_qwen3_matches_transformers(tiny_qwen3_dir, hf_model, paged, native, monkeypatch):
    """Qwen3's q/k norm on both CPU paths: the native per-op kernels and the plain-torch one."""
    monkeypatch.setenv("DISAGG_CPU_NATIVE", native)
    model, config = load_model(tiny_qwen3_dir)
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm and config.head_dim == 32
    assert_ragged_steps_match(tiny_qwen3_dir, hf_model, paged)


def test_qwen3_bfloat16(tiny_qwen3_dir, hf_model, paged):
    model, _ = load_model(tiny_qwen3_dir, dtype="bfloat16")
    ids = _prompts(TINY_VOCAB, lens=(9,))[0]
    kv = model.allocate_kv_cache(num_blocks=4, block_size=BLOCK_SIZE)
    logits = model.forward(paged(BLOCK_SIZE).prefill([(0, ids)]), kv)[0]
    expected = _hf_last_logits(hf_model(tiny_qwen3_dir, torch.bfloat16), ids)
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)


def assert_ragged_steps_match(model_dir, hf_model, paged) -> None:
    """Packed ragged prefill, then decode steps, each equal to a full recompute by transformers."""
    model, config = load_model(model_dir)
    hf = hf_model(model_dir)
    prompts = _prompts(config.vocab_size)
    seqs = paged(BLOCK_SIZE)
    kv = model.allocate_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)

    logits = model.forward(seqs.prefill(list(enumerate(prompts))), kv)
    assert logits.shape == (len(prompts), config.vocab_size) and logits.dtype == torch.float32
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], _hf_last_logits(hf, ids), **TOL)

    # Feed tokens back one step at a time; each step must match a full recompute by transformers.
    for step in range(4):
        nxt = (
            logits.argmax(-1).tolist()
            if step % 2 == 0
            else [(7 * step + i) % config.vocab_size for i in range(4)]
        )
        for ids, tok in zip(prompts, nxt, strict=True):
            ids.append(tok)
        logits = model.forward(seqs.decode(list(enumerate(nxt))), kv)
        for i, ids in enumerate(prompts):
            torch.testing.assert_close(logits[i], _hf_last_logits(hf, ids), **TOL)


def test_prefill_logits_at_every_position(tiny_llama_dir, hf_model, paged):
    model, config = load_model(tiny_llama_dir)
    hf = hf_model(tiny_llama_dir)
    (ids,) = _prompts(config.vocab_size, lens=(40,), seed=3)
    batch = paged(BLOCK_SIZE).prefill([(0, ids)])
    batch.logits_indices = torch.arange(len(ids))
    logits = model.forward(batch, model.allocate_kv_cache(8, BLOCK_SIZE))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, expected, **TOL)


def test_chunked_prefill_attends_to_cached_blocks(tiny_model_dir, hf_model, paged):
    model, config = load_model(tiny_model_dir)
    hf = hf_model(tiny_model_dir)
    long, other = _prompts(config.vocab_size, lens=(45, 9), seed=1)
    seqs = paged(BLOCK_SIZE)
    kv = model.allocate_kv_cache(num_blocks=16, block_size=BLOCK_SIZE)
    # Chunks end mid-block and on a block boundary; another sequence shares the first step.
    model.forward(seqs.prefill([(0, long[:7]), (1, other)]), kv)
    model.forward(seqs.prefill([(0, long[7:32])]), kv)
    logits = model.forward(seqs.prefill([(0, long[32:])]), kv)
    torch.testing.assert_close(logits[0], _hf_last_logits(hf, long), **TOL)
    # The other sequence's cache is intact: decoding it still matches.
    logits = model.forward(seqs.decode([(1, 3)]), kv)
    torch.testing.assert_close(logits[0], _hf_last_logits(hf, other + [3]), **TOL)


def test_layer_hook_runs_after_each_layer_wrote_its_kv(tiny_llama_dir, paged):
    model, config = load_model(tiny_llama_dir)
    (ids,) = _prompts(config.vocab_size, lens=(20,))
    batch = paged(BLOCK_SIZE).prefill([(0, ids)])
    kv = model.allocate_kv_cache(4, BLOCK_SIZE)
    seen = []

    def hook(layer: int) -> None:
        # This layer's blocks are filled, later layers' are still empty.
        assert kv[layer, :2].abs().sum() > 0
        assert all(kv[j].abs().sum() == 0 for j in range(layer + 1, model.num_layers))
        seen.append(layer)

    model.forward(batch, kv, layer_hook=hook)
    assert seen == list(range(model.num_layers))


def test_rope_inv_freq_matches_transformers(tiny_llama_dir, hf_model):
    model, config = load_model(tiny_llama_dir)
    hf = hf_model(tiny_llama_dir)
    assert config.rope.type == "llama3"
    torch.testing.assert_close(
        rope_inv_freq(config.rope, config.head_dim), hf.model.rotary_emb.inv_freq, atol=0, rtol=0
    )


def test_kv_cache_shape_and_bfloat16(tiny_qwen2_dir, hf_model, paged):
    model, config = load_model(tiny_qwen2_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert model.kv_cache_shape(10, BLOCK_SIZE) == (2, 10, 2, BLOCK_SIZE, 2, 16)
    assert model.kv_cache_block_bytes(BLOCK_SIZE) == 2 * 2 * BLOCK_SIZE * 2 * 16 * 2
    (ids,) = _prompts(config.vocab_size, lens=(12,))
    logits = model.forward(paged(BLOCK_SIZE).prefill([(0, ids)]), model.allocate_kv_cache(2, BLOCK_SIZE))
    assert logits.dtype == torch.float32
    expected = _hf_last_logits(hf_model(tiny_qwen2_dir), ids)
    # bfloat16 keeps ~3 significant digits: the top tokens agree and the logits are close.
    assert (logits[0] - expected).abs().max() < 0.15 * expected.abs().max()
    assert logits[0].argmax() == expected.argmax()
