"""The target's sampling distribution at every verified position, exactly as `Sampler` would build
it had the earlier proposals already been appended: penalties see them as output, `min_tokens`
counts them, the grammar's mask of that position applies, then temperature, top-k, top-p and min-p. Greedy rows keep the processed logits at
temperature 1 (what greedy logprobs are reported from)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.worker.engine.request import Request
from disagg.worker.engine.sampler import apply_penalties, filter_logits, mask_until_min_tokens
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.structured_output import apply_bitmask


@dataclass
class PositionView:
    """The fields of `Request` the sampler's logit processing reads, for one verified position."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def position_views(req: Request, proposed: Sequence[int]) -> list[PositionView]:
    """One view per verified position: position j follows the first j proposals."""
    return [
        PositionView(
            req.params, req.prompt_token_ids, req.output_token_ids + list(proposed[:j]), req.eos_token_ids
        )
        for j in range(len(proposed) + 1)
    ]


def needs_processing(req: Request, num_proposed: int) -> bool:
    """Whether penalties or the min_tokens mask change this request's logits at some position."""
    p = req.params
    return (
        p.repetition_penalty != 1.0
        or bool(p.presence_penalty)
        or bool(p.frequency_penalty)
        or req.num_output_tokens < p.min_tokens
    )


def final_logits(
    logits: torch.Tensor, req: Request, proposed: Sequence[int], grammar_masks: torch.Tensor | None = None
) -> torch.Tensor:
    """[len(proposed) + 1, V] float32: for a sampled request the filtered, temperature-scaled
    logits (softmax gives p), for a greedy one the processed logits (argmax gives the token).
    `grammar_masks`: the structured-output bitmask of each position (`grammar.verified_masks`)."""
    logits = logits.float()
    if needs_processing(req, len(proposed)) or grammar_masks is not None:
        logits = logits.clone()
        views = position_views(req, proposed)
        apply_penalties(logits, views)
        mask_until_min_tokens(logits, views)
        if grammar_masks is not None:
            apply_bitmask(logits, list(range(logits.shape[0])), grammar_masks)
    p = req.params
    if p.greedy:
        return logits
    rows = logits.shape[0]
    dev = logits.device
    return filter_logits(
        logits / p.temperature,
        torch.full((rows,), p.top_k, device=dev),
        torch.full((rows,), p.top_p, device=dev),
        torch.full((rows,), p.min_p, device=dev),
    )
