"""The tiny model end to end with the engine's ops forced to the Triton kernels (interpreter):
the same greedy tokens as the torch path, through prefill (incl. a chunked prompt) and decode."""

from __future__ import annotations

import torch

from disagg.worker import LLM, SamplingParams

NEW_TOKENS = 8


def greedy_tokens(model_dir, monkeypatch, kernels: str, **engine) -> tuple[str, list[list[int]]]:
    monkeypatch.setenv("DISAGG_KERNELS", kernels)
    g = torch.Generator().manual_seed(0)
    # ragged prompts: one token, one block + 1, and one longer than the token budget (chunked)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    llm = LLM(model=model_dir, block_size=16, num_gpu_blocks=32, max_num_batched_tokens=32, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, params)
    return llm.engine.runner.model.ops.backend, [o.outputs[0].token_ids for o in outs]


def test_triton_path_generates_the_same_greedy_tokens(tiny_llama_dir, monkeypatch):
    backend, expected = greedy_tokens(tiny_llama_dir, monkeypatch, "torch")
    assert backend == "torch"
    backend, got = greedy_tokens(tiny_llama_dir, monkeypatch, "triton")
    assert backend == "triton"
    assert got == expected
    assert all(len(t) == NEW_TOKENS for t in got)


def test_triton_path_over_an_int8_kv_cache_generates_the_torch_paths_tokens(tiny_llama_dir, monkeypatch):
    """The quantizing write and the 8-bit decode attention in Triton, prompt chunks over the
    dequantized blocks: the int8-KV engine's tokens on the torch path."""
    _, expected = greedy_tokens(tiny_llama_dir, monkeypatch, "torch", kv_cache_dtype="int8")
    backend, got = greedy_tokens(tiny_llama_dir, monkeypatch, "triton", kv_cache_dtype="int8")
    assert backend == "triton"
    assert got == expected
