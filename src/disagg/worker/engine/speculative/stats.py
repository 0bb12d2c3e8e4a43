"""Counters of speculation, per proposer: what the metrics page and `engine.spec_stats` show."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    proposer: str
    num_tokens: int  # k: the histogram has k + 1 buckets
    num_verify_steps: int = 0  # target passes that verified proposals
    num_proposals: int = 0  # sequences with at least one proposed token, over all steps
    num_proposed: int = 0  # proposed tokens
    num_accepted: int = 0  # of them, accepted
    num_emitted: int = 0  # tokens emitted by verify steps (accepted + one per sequence)
    # accepted_lengths[a]: proposals of which exactly a leading tokens were accepted
    accepted_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_lengths:
            self.accepted_lengths = [0] * (self.num_tokens + 1)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_proposals += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.accepted_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0
