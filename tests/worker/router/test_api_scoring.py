"""Prompt scoring through the disaggregated path: `echo` with `max_tokens=0` (and lm-eval's own
requests) return every prompt token's logprob, equal to the engine's `prompt_logprobs` and to
transformers' log_softmax; the prefill worker computes them and they travel back over gRPC."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from disagg.worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

LENGTHS = (5, 16, 17, 40)


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


@pytest.fixture(scope="module")
def prompts(reference_llm) -> list[list[int]]:
    rng = random.Random(11)
    vocab = reference_llm.engine.config.vocab_size
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf(tiny_model, prompts) -> list[tuple[list[float], list[bool]]]:
    """transformers' logprob of each prompt token after the ones before it (from the second on),
    and whether it is the most likely token there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            lp = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
        out.append(
            ([float(lp[j, p[j + 1]]) for j in range(len(p) - 1)],
             [int(lp[j].argmax()) == p[j + 1] for j in range(len(p) - 1)])
        )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def engine_logprobs(reference_llm, prompts) -> list[list[float]]:
    outs = reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    return [[lp.logprob for lp in o.prompt_logprobs[1:]] for o in outs]


def _decode(reference_llm, ids: list[int]) -> str:
    return reference_llm.get_tokenizer().decode(ids, skip_special_tokens=False)


def test_echo_max_tokens_0_scores_the_prompt(
    api_cluster, client, reference_llm, prompts, engine_logprobs, hf
):
    for prompt, want, (hf_lps, _) in zip(prompts, engine_logprobs, hf, strict=True):
        raw = client.completions.with_raw_response.create(
            model=api_cluster.model_name, prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0
        )
        assert "X-Disagg-Prefill-Worker" in raw.headers  # prefilled (and scored) on the prefill worker
        resp = raw.parse()
        choice = resp.choices[0]
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.token_logprobs) == len(prompt) == len(lp.tokens)
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
        assert lp.token_logprobs[1:] == pytest.approx(hf_lps, abs=1e-4)
        # each position's alternatives: the most likely token and the prompt token itself (keyed by
        # text, so two ids that decode alike share one key, as in OpenAI's format)
        for tok, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert tok in top and max(top.values()) >= value - 1e-6 and 1 <= len(top) <= 2
        assert choice.text == _decode(reference_llm, prompt)
        assert choice.finish_reason == "length"
        assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(prompt)


def test_echo_streamed_with_generation(api_cluster, client, reference_llm, prompts, engine_logprobs):
    prompt = prompts[2]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    want = reference_llm.generate([prompt], params)[0].outputs[0]
    stream = client.completions.create(
        model=api_cluster.model_name, prompt=prompt, echo=True, max_tokens=4, logprobs=2, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, values, tops = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                values += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
    n = len(prompt)
    assert text == _decode(reference_llm, prompt) + want.text
    assert values[0] is None and tops[0] is None and len(values) == n + 4
    assert values[1:n] == pytest.approx(engine_logprobs[2], abs=1e-5)
    assert values[n:] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    # generated positions: the top 2, of which greedy's choice is the first
    for top, value in zip(tops[n:], values[n:], strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value)


def test_echo_of_a_text_prompt_without_logprobs(api_cluster, client, reference_llm):
    prompt = "The lighthouse keeper counts the boxes"
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    resp = client.completions.create(
        model=api_cluster.model_name, prompt=prompt, echo=True, max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].text == prompt + want.outputs[0].text and resp.choices[0].logprobs is None


def test_lm_eval_loglikelihood_requests(api_cluster, prompts, engine_logprobs, hf):
    """lm-eval's `local-completions` loglikelihood request and its parsing, as it sends and reads them:
    a batch of context + continuation token lists, echo, max_tokens=1, logprobs=1; the score is the
    sum of the continuation's logprobs (`token_logprobs[ctxlen:-1]`: the generated token dropped),
    greedy when each equals the best of its `top_logprobs`."""
    ctxlen = 9
    body = {"model": api_cluster.model_name, "prompt": prompts[2:], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    r = httpx.post(f"{api_cluster.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, want, (hf_lps, hf_greedy) in zip(choices, engine_logprobs[2:], hf[2:], strict=True):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert sum(lps) == pytest.approx(sum(want[ctxlen - 1 :]), abs=1e-4)
        assert sum(lps) == pytest.approx(sum(hf_lps[ctxlen - 1 :]), abs=1e-3)
        is_greedy = all(tok == max(top.values()) for tok, top in zip(lps, tops, strict=True))
        assert is_greedy == all(hf_greedy[ctxlen - 1 :])
        per_token = [tok == max(top.values()) for tok, top in zip(lps, tops, strict=True)]
        assert per_token == hf_greedy[ctxlen - 1 :]
