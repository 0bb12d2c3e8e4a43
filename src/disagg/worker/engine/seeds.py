"""Random draws keyed by (seed, output position): token N of a seeded request is drawn from the
same random numbers wherever and whenever it is drawn.

A request's draws used to come from one generator that advanced draw by draw, so continuing a
stream elsewhere (the prefill worker samples the first token, the decode worker the rest; a
migrated stream resumes on another worker) meant replaying the draws before it. Reseeding the
generator from the seed and the position before each draw removes that history: nothing is
carried between workers but the seed and the tokens. `stream` separates the draws of one
position (speculative decoding draws a draft token, an acceptance test and a residual there).
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1

SAMPLE = 0  # the token itself (plain sampling; speculative decoding's bonus token)
DRAFT = 1  # a draft model's proposal
ACCEPT = 2  # the acceptance test of a proposal
RESIDUAL = 3  # the replacement of a rejected proposal


def _mix(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated outputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int, stream: int = SAMPLE) -> int:
    """The generator seed of the draw at output `position` (0: the first generated token)."""
    x = _mix((seed & _MASK) ^ 0x9E3779B97F4A7C15)
    x = _mix((x + position * 0x9E3779B97F4A7C15) & _MASK)
    return _mix((x + stream * 0xD1B54A32D192ED03) & _MASK) >> 1  # torch seeds are < 2**63


class PositionRng:
    """A request's random draws: `at(position, stream)` is a generator seeded for that draw."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.seed = seed
        self._generator = torch.Generator(device=device)

    def at(self, position: int, stream: int = SAMPLE) -> torch.Generator:
        return self._generator.manual_seed(draw_seed(self.seed, position, stream))
