"""What every proposer offers the speculator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.worker.engine.request import Request


@dataclass
class Proposal:
    token_ids: list[int]  # at most the budget asked for; empty: nothing to verify
    # the distribution each token was drawn from [len(token_ids), vocab], or None when the
    # proposer is deterministic (a point mass on each token: n-gram lookup, a greedy draft)
    draft_probs: torch.Tensor | None = None


class Proposer:
    """Base of the proposers: `propose` is theirs; the hooks default to holding nothing."""

    name: str

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[Proposal]:
        """Up to `budgets[i]` next tokens for `requests[i]` (running, its last token sampled but
        not yet computed); a budget of 0 asks for nothing."""
        raise NotImplementedError

    def verified(self, request: Request) -> None:
        """`request`'s accepted tokens are appended and its computed length set: drop what no
        longer matches its sequence (a draft model's KV of rejected tokens)."""

    def forget(self, request_id: str) -> None:
        """The request is finished, aborted or preempted: release what is held for it."""

    def step_costs(self, max_batch: int):
        """Measured seconds of the proposer's own forward steps by batch size (a `StepCosts`, called
        once per proposed token), or None when proposing costs nothing worth counting."""
        return None

    def num_held_blocks(self) -> int:
        """KV blocks the proposer holds (0 for proposers without a cache)."""
        return 0
