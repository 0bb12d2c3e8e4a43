"""Turn a batch of next-token logits into tokens, one request per row.

Order of processing (as vLLM and transformers do): penalties on the raw logits
(repetition over prompt + output, presence/frequency over the output), EOS/stop ids masked
until `min_tokens`, tokens a structured output grammar forbids masked (`structured_output.py`),
then either argmax (greedy: exactly `torch.argmax`, so it matches transformers) or temperature, top-k, top-p, min-p and a draw from the request's own
generator, seeded from its seed and the output position (`seeds.py`), so a seeded request samples
the same tokens whatever else shares its batch and wherever its stream continues. Logprobs come from the final distribution
(for greedy rows: the penalised logits at temperature 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.worker.engine.outputs import TokenLogprob
from disagg.worker.engine.request import Request
from disagg.worker.engine.structured_output import apply_bitmask, fill_bitmasks


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first of equal maxima, NaN above all, as `torch.argmax`. On CPU
    `max(dim).indices` gives the same index about three times faster than argmax."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices.tolist()
    return logits.argmax(dim=-1).tolist()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> None:
    """Repetition (HF: divide positive logits, multiply negative ones), presence and
    frequency (OpenAI: subtract, over generated tokens) penalties, in place."""
    vocab = logits.shape[-1]
    for i, req in enumerate(reqs):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.all_token_ids, dtype=torch.long, device=logits.device).unique()
            seen = seen[seen < vocab]
            score = logits[i, seen]
            logits[i, seen] = torch.where(
                score > 0, score / p.repetition_penalty, score * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def mask_until_min_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> None:
    """Forbid ending (EOS unless ignored, stop token ids) before `min_tokens` are generated."""
    vocab = logits.shape[-1]
    for i, req in enumerate(reqs):
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned |= req.eos_token_ids
        banned = [t for t in banned if t < vocab]
        if banned:
            logits[i, banned] = float("-inf")


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask to -inf whatever top-k (0: off), top-p (1: off) and min-p (0: off) exclude.

    logits [M, V] already divided by the temperature; the parameters are [M] tensors.
    """
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab)[:, None]
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def _top_logprobs(logprobs_row: torch.Tensor, chosen: int, k: int) -> TokenLogprob:
    top: dict[int, float] = {}
    if k > 0:
        values, ids = logprobs_row.topk(k)
        top = {int(t): float(v) for t, v in zip(ids.tolist(), values.tolist(), strict=True)}
    return TokenLogprob(token_id=chosen, logprob=float(logprobs_row[chosen]), top_logprobs=top)


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SamplerOutput:
        assert logits.shape[0] == len(reqs)
        logits = logits.float()
        needs_edit = any(
            r.params.repetition_penalty != 1.0
            or r.params.presence_penalty
            or r.params.frequency_penalty
            or r.num_output_tokens < r.params.min_tokens
            for r in reqs
        )
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            # the grammars' masks are computed (in parallel threads) before the logits are copied
            bitmask = fill_bitmasks([reqs[i].grammar for i in constrained], logits.shape[-1])
        if needs_edit or constrained:
            logits = logits.clone()
            apply_penalties(logits, reqs)
            mask_until_min_tokens(logits, reqs)
            if constrained:
                apply_bitmask(logits, constrained, bitmask)
            needs_edit = True

        n = len(reqs)
        if not needs_edit and all(r.params.greedy and r.params.logprobs is None for r in reqs):
            # pure greedy without logprobs: one argmax, nothing else to compute
            return SamplerOutput(token_ids=greedy_tokens(logits), logprobs=[None] * n)
        tokens: list[int] = [0] * n
        final = logits  # the distribution logprobs are reported from, row by row
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if greedy:
            rows = logits if len(greedy) == n else logits[greedy]
            for i, t in zip(greedy, greedy_tokens(rows), strict=True):
                tokens[i] = t
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            dev = logits.device
            temps = torch.tensor([reqs[i].params.temperature for i in sampled], device=dev)
            top_k = torch.tensor([reqs[i].params.top_k for i in sampled], device=dev)
            top_p = torch.tensor([reqs[i].params.top_p for i in sampled], device=dev)
            min_p = torch.tensor([reqs[i].params.min_p for i in sampled], device=dev)
            scaled = filter_logits(logits.index_select(0, idx) / temps[:, None], top_k, top_p, min_p)
            probs = scaled.softmax(dim=-1)
            for row, i in enumerate(sampled):
                req = reqs[i]
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=req.rng.at(req.num_output_tokens)))
            if len(sampled) == n:
                final = scaled
            else:
                final = logits.clone()
                final[idx] = scaled

        logprobs: list[TokenLogprob | None] = [None] * n
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if wanted:
            lp = final[wanted].log_softmax(dim=-1)
            for row, i in enumerate(wanted):
                logprobs[i] = _top_logprobs(lp[row], tokens[i], reqs[i].params.logprobs)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)
