"""When a request speculates: a proposal costs verify work whether or not it is accepted, so a
request whose recent proposals are mostly rejected pauses for a while, then tries again."""

from __future__ import annotations

from dataclasses import dataclass

# weight of the newest proposal in the running acceptance rate
_SMOOTHING = 0.3
# decode steps a request sits out after its rate falls below the floor
_PAUSE_STEPS = 16


@dataclass
class _Track:
    rate: float = 1.0
    paused: int = 0


class AcceptanceGate:
    def __init__(self, min_acceptance: float):
        self.min_acceptance = min_acceptance
        self._tracks: dict[str, _Track] = {}

    def allows(self, request_id: str) -> bool:
        """Whether the request proposes this step (counts down a pause)."""
        t = self._tracks.get(request_id)
        if t is None or t.paused == 0:
            return True
        t.paused -= 1
        return False

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        t = self._tracks.setdefault(request_id, _Track())
        t.rate = (1 - _SMOOTHING) * t.rate + _SMOOTHING * (accepted / proposed)
        if t.rate < self.min_acceptance:
            # after the pause one proposal at the floor decides: a good one resumes, a bad one pauses again
            t.paused = _PAUSE_STEPS
            t.rate = self.min_acceptance

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
