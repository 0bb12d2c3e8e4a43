"""Prompt lookup: when the last n tokens occurred earlier in the prompt or output, propose what
followed their latest earlier occurrence. Text that repeats or continues structure (code, lists,
quotes of the prompt) is proposed for free; elsewhere nothing is proposed and nothing is verified."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from disagg.worker.engine.request import Request
from disagg.worker.engine.speculative.proposer import Proposal, Proposer


def lookup(tokens: Sequence[int] | np.ndarray, num_tokens: int, n_min: int, n_max: int) -> list[int]:
    """Up to `num_tokens` tokens following the latest earlier occurrence of the sequence's last n
    tokens, for the longest n in [n_min, n_max] that has one; [] when none does."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    if num_tokens <= 0 or length < 2:
        return []
    # ends of earlier matches of the last token, narrowed one token further back at a time: the
    # latest survivor at depth n ends the latest earlier occurrence of the last n tokens
    ends = np.flatnonzero(seq[: length - 1] == seq[-1])
    best = -1
    for n in range(1, min(n_max, length - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[seq[ends - (n - 1)] == seq[length - n]]
        if ends.size == 0:
            break
        if n >= n_min:
            best = int(ends[-1])
    if best < 0:
        return []
    return seq[best + 1 : best + 1 + num_tokens].tolist()


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got min {n_min}, max {n_max}")
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[Proposal]:
        return [
            Proposal(lookup(req.all_token_ids, k, self.n_min, self.n_max) if k > 0 else [])
            for req, k in zip(requests, budgets, strict=True)
        ]
