"""Prompt logprobs (`SamplingParams.prompt_logprobs`): every prompt token's logprob and top-k equal
transformers' log_softmax, whatever chunked prefill, the prefix cache or batching does."""

from __future__ import annotations

import pytest
import torch

from disagg.worker import LLM, SamplingParams

LENS = (2, 7, 16, 17, 45)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=g).tolist() for n in LENS]


def _hf_logprobs(hf_model, path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row j is the distribution of token j + 1."""
    model = hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def _check(out, prompt: list[int], want: torch.Tensor, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt)
    assert lps[0] is None
    for j, lp in enumerate(lps[1:]):
        assert lp.token_id == prompt[j + 1]
        assert lp.logprob == pytest.approx(float(want[j, prompt[j + 1]]), abs=2e-4)
        assert len(lp.top_logprobs) == k
        top_vals, top_ids = want[j].topk(k)
        for tid, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True):
            assert lp.top_logprobs[tid] == pytest.approx(v, abs=2e-4)


@pytest.mark.parametrize("chunk", [2048, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, hf_model, chunk):
    prompts = _prompts()
    llm = LLM(tiny_llama_dir, block_size=8, num_gpu_blocks=64, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out, prompt, _hf_logprobs(hf_model, tiny_llama_dir, prompt), 3)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_prompt_logprobs_ignore_the_prefix_cache(tiny_llama_dir, hf_model):
    """A prompt whose blocks are cached is still computed whole: every position needs its logits."""
    prompt = _prompts(5)[-1]
    llm = LLM(tiny_llama_dir, block_size=8, num_gpu_blocks=64)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert out.num_cached_tokens == 0
    _check(out, prompt, _hf_logprobs(hf_model, tiny_llama_dir, prompt), 0)
    # without prompt logprobs the cache serves it as before
    (again,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    assert again.num_cached_tokens > 0


def test_prompt_logprobs_do_not_change_generation(tiny_llama_dir):
    prompts = _prompts(9)
    llm = LLM(tiny_llama_dir, block_size=8, num_gpu_blocks=64, max_num_batched_tokens=6)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=i % 2 or None)
              for i in range(len(prompts))]  # fmt: skip
    mixed = llm.generate(prompts, params)
    for a, b, p in zip(plain, mixed, params, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (b.prompt_logprobs is None) == (p.prompt_logprobs is None)
