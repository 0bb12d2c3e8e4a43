"""SamplingParams validation and the batched sampler, against transformers' logits processors."""

from __future__ import annotations

import math

import pytest
import torch

from disagg.worker.engine.request import Request
from disagg.worker.engine.sampler import Sampler, apply_penalties, filter_logits, greedy_tokens
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.seeds import PositionRng

V = 64


def req(params: SamplingParams, prompt=(1, 2, 3), output=(), seed_gen: int | None = None, eos=()) -> Request:
    r = Request("r", list(prompt), params, eos_token_ids=frozenset(eos))
    r.output_token_ids = list(output)
    if not params.greedy:
        r.rng = PositionRng(params.seed if params.seed is not None else seed_gen or 0)
    return r


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1), "temperature must be >= 0, got -1"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(n=2), "n"),
        (dict(seed="x"), "seed"),
        (dict(temperature="hot"), "temperature"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_normalised():
    p = SamplingParams(stop="x", top_k=0, temperature=1e-7)
    assert p.stop_strings == ["x"] and p.top_k == -1 and p.greedy and p.stop_token_ids == []
    assert SamplingParams(stop=["ab", "abcd"]).max_stop_len == 4
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_is_exact_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    logits[2, 10] = logits[2, 11] = logits[2].max() + 1  # a tie: the first index wins, like torch
    reqs = [req(SamplingParams(temperature=0)) for _ in range(5)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 10 and out.logprobs == [None] * 5


def test_greedy_tokens_equal_argmax_with_ties_nan_and_a_real_vocabulary():
    torch.manual_seed(0)
    logits = torch.randint(0, 4, (16, 49152)).float()  # many equal maxima per row
    logits[3, 40000] = float("nan")  # argmax takes a NaN over any number
    logits[5] = 2.0  # all equal: the first
    logits[7, -1] = 9.0  # the last index
    tokens = greedy_tokens(logits)
    assert tokens == logits.argmax(-1).tolist()
    assert tokens[3] == 40000 and tokens[5] == 0 and tokens[7] == 49151


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(1, V)
    r = req(SamplingParams(temperature=0, repetition_penalty=1.3), prompt=(4, 5, 5, 6), output=(7, 4))
    ours = logits.clone()
    apply_penalties(ours, [r])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([r.all_token_ids]), logits.clone())
    torch.testing.assert_close(ours, ref)


def test_presence_and_frequency_penalties_count_generated_tokens():
    logits = torch.zeros(1, V)
    r = req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(9,), output=(3, 3, 8))
    apply_penalties(logits, [r])
    assert logits[0, 3] == pytest.approx(-(0.5 + 2 * 0.25))
    assert logits[0, 8] == pytest.approx(-(0.5 + 0.25))
    assert logits[0, 9] == 0  # prompt tokens are not penalised by these two


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (7, 0.6, 0.05)])
def test_filters_match_transformers_warpers(top_k, top_p, min_p):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(2)
    logits = torch.randn(3, V) * 3
    ours = filter_logits(
        logits, torch.tensor([top_k] * 3), torch.tensor([top_p] * 3), torch.tensor([min_p] * 3)
    )
    ref = logits.clone()
    ids = torch.zeros(3, 1, dtype=torch.long)
    if top_k:
        ref = TopKLogitsWarper(top_k)(ids, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(ids, ref)
    if min_p:
        ref = MinPLogitsWarper(min_p)(ids, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = ~torch.isinf(ours)
    torch.testing.assert_close(ours[kept], logits[kept])


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 1] = 10.0  # EOS would win
    logits[0, 2] = 9.0  # then the stop token
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert Sampler()(logits, [req(params, output=(5,), eos=(1,))]).token_ids == [0]
    assert Sampler()(logits, [req(params, output=(5, 6), eos=(1,))]).token_ids == [1]


def test_seeded_draws_ignore_batch_composition():
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=42)

    def draws(rows: list[int], target: int, n: int = 20) -> list[int]:
        reqs = [req(p if i == target else SamplingParams(temperature=1.0), seed_gen=i) for i in rows]
        out = []
        for _ in range(n):
            res = Sampler()(logits[rows], reqs)
            for r, t in zip(reqs, res.token_ids, strict=True):
                r.output_token_ids.append(t)  # as the engine does: the next draw is the next position
            out.append(res.token_ids[rows.index(target)])
        return out

    alone = draws([2], 2)
    assert alone == draws([0, 1, 2, 3], 2) == draws([3, 2], 2)
    assert len(set(alone)) > 1  # really sampling


def test_a_seeded_draw_depends_on_its_position_not_on_the_draws_before_it():
    """Token N is drawn the same wherever the stream continues (another worker, after a
    migration): nothing but the seed and the position keys it."""
    torch.manual_seed(5)
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=1.0, seed=7)
    history = req(p, output=(9,) * 12)
    for _ in range(5):  # earlier draws at other positions change nothing
        Sampler()(logits, [req(p, output=(3,) * 4)])
    fresh = req(p, output=(1,) * 12)  # same position, other tokens before it, no draws before it
    assert Sampler()(logits, [history]).token_ids == Sampler()(logits, [fresh]).token_ids
    firsts = {Sampler()(logits, [req(p, output=(1,) * n)]).token_ids[0] for n in range(12)}
    assert len(firsts) > 1  # positions draw differently


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [0.0] * (V - 3)]) + 1e-30)
    r = req(SamplingParams(temperature=1.0, seed=0))
    counts = [0, 0, 0]
    for _ in range(2000):
        token = Sampler()(logits, [r]).token_ids[0]
        r.output_token_ids.append(token)
        counts[token] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_logprobs_of_the_final_distribution():
    torch.manual_seed(4)
    logits = torch.randn(2, V)
    greedy = req(SamplingParams(temperature=0, logprobs=2))
    hot = req(SamplingParams(temperature=0.5, top_k=3, logprobs=0, seed=1))
    out = Sampler()(logits, [greedy, hot])
    lp = out.logprobs[0]
    ref = logits[0].log_softmax(-1)
    assert lp.token_id == out.token_ids[0] and lp.logprob == pytest.approx(float(ref.max()))
    assert list(lp.top_logprobs) == ref.topk(2).indices.tolist()
    # sampled row: the distribution after temperature and top-k
    top3 = (logits[1] / 0.5).topk(3)
    probs = top3.values.softmax(-1)
    chosen = out.token_ids[1]
    assert chosen in top3.indices.tolist()
    expected = math.log(float(probs[top3.indices.tolist().index(chosen)]))
    assert out.logprobs[1].logprob == pytest.approx(expected, abs=1e-5)
    assert out.logprobs[1].top_logprobs == {}
