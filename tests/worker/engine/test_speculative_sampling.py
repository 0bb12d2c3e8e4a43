"""Sampled speculative decoding keeps the target's distribution: the acceptance rule on its own
(known p and q), and end to end through the engine at temperature 0.7 with top-p 0.9, with a
draft model that differs from the target and with prompt lookup. Chi-square tests at a stated
significance of 0.001, fixed seeds (so each run is the same run: a failure is a real bias)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from disagg.worker import SamplingParams
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.sampler import filter_logits
from disagg.worker.engine.seeds import PositionRng
from disagg.worker.engine.speculative.rejection import accept_greedy, accept_sampled

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALPHA = 1e-3


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of observed counts against expected counts, bins expected below 5 merged."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    obs, exp = obs.double(), exp.double()
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03], [0.05, 0.05, 0.50, 0.20, 0.10, 0.10]])
Q = torch.tensor([[0.10, 0.50, 0.05, 0.05, 0.20, 0.10]])


@pytest.mark.parametrize("q", [Q, None], ids=["draft", "point-mass"])
def test_acceptance_rule_emits_the_target_distribution(q):
    g = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)
    rng = PositionRng(0)
    for trial in range(n):  # each trial at its own position: independent draws
        x = int(torch.multinomial(Q[0], 1, generator=g)) if q is not None else 1
        out = accept_sampled(P, [x], q, rng, 2 * trial)
        first[out[0]] += 1
        if len(out) == 2:  # accepted: the bonus token follows
            second[out[1]] += 1
    assert chi_square_p(first, P[0] * n) > ALPHA
    assert chi_square_p(second, P[1] * second.sum()) > ALPHA
    # and the test can tell: the proposal's own distribution is rejected
    assert chi_square_p(first, Q[0] * n) < ALPHA


def test_greedy_acceptance():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # corrected at the first mismatch
    assert accept_greedy([4], []) == [4]


BASE = [17, 230, 45, 99, 17, 230, 45, 99, 17, 230, 45]
N = 1500


def target_probs(hf, prefixes: list[list[int]], temperature: float, top_p: float) -> torch.Tensor:
    with torch.no_grad():
        logits = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in prefixes])
    one = torch.ones(len(prefixes))
    return filter_logits(logits / temperature, torch.zeros(len(prefixes), dtype=torch.long), one * top_p,
                         one * 0.0).softmax(dim=-1)  # fmt: skip


@pytest.fixture(scope="module")
def near_draft(tiny_llama_dir, tmp_path_factory):
    """The target with a flatter, noisier head: a draft that differs from the target but is
    accepted often, so a biased acceptance rule would move many tokens (a test with power)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near-draft")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    (path,) = out.glob("*.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(5)
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = 0.7 * head + 0.05 * torch.randn(head.shape, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_outputs_keep_the_target_distribution(tiny_llama_dir, near_draft, hf_model, method):
    """Token 2 (the first a verify step emits) and token 3, each against the target's exact
    distribution given the tokens before it, summed over the samples."""
    hf = hf_model(tiny_llama_dir)
    # the target's likeliest next tokens lead the prompt, so prompt lookup finds most sampled tokens
    prompt = target_probs(hf, [BASE], 0.7, 1.0)[0].topk(40).indices.tolist() + BASE
    spec = {
        "speculative_method": method,
        "speculative_max_batch": 4096,
        "speculative_min_acceptance": 0.0,
        "speculative_adaptive": False,
    }
    if method == "draft":
        spec["speculative_draft_model"] = str(near_draft)
    # alternating steps: every request's tokens 2 and 3 come from decode steps, which speculate (a
    # mixed step decodes its rows plainly while the other prompts are still being admitted)
    e = LLMEngine(
        tiny_llama_dir, block_size=8, num_gpu_blocks=2 * N + 8, max_num_seqs=N, mixed_steps=False, **spec
    )
    for i in range(N):
        e.add_request(f"s{i}", prompt, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, ignore_eos=True,
                                                      seed=i))  # fmt: skip
    outs = {}
    while e.has_unfinished():
        outs.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
    stats = e.speculator.stats
    assert stats.num_proposed > N // 4 and stats.num_accepted < stats.num_proposed
    if method == "draft":
        assert stats.acceptance_rate > 0.5
    # prompt lookup's proposals here are mostly tokens top-p removes (a handful of expected
    # acceptances in 1500 requests): this case checks rejection and the residual draw; accepting
    # a point mass is checked by test_acceptance_rule_emits_the_target_distribution
    seqs = [outs[f"s{i}"] for i in range(N)]
    for pos in (1, 2):
        prefixes = sorted({tuple(s[:pos]) for s in seqs})
        probs = dict(
            zip(prefixes, target_probs(hf, [prompt + list(p) for p in prefixes], 0.7, 0.9), strict=True)
        )
        expected = sum(probs[tuple(s[:pos])] for s in seqs)
        observed = torch.bincount(torch.tensor([s[pos] for s in seqs]), minlength=expected.shape[0]).float()
        assert chi_square_p(observed, expected) > ALPHA, f"token {pos + 1}"
