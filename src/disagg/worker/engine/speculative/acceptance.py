"""Each request's running estimate of how likely a proposed token is accepted (the per-position
acceptance rate alpha), from its own recent proposals. A new request starts from the rate of every
request's recent proposals (1.0 before any): with a proposer that rarely hits, short requests would
otherwise each spend their first steps learning it again.

A request that is not speculating learns nothing, so its estimate drifts back up while it decodes
plainly: after a while it proposes again and the estimate meets reality (a low rate cannot lock
speculation off for the rest of a long generation whose text turns repetitive)."""

from __future__ import annotations

# weight of the newest proposal in the running rate
_SMOOTHING = 0.3
# per plain decode step, the share of the distance to 1 the rate recovers
_RECOVERY = 0.05
# weight of the newest proposal in the rate over all requests (a new request's prior)
_OVERALL_SMOOTHING = 0.1


class AcceptanceEstimate:
    def __init__(self, min_acceptance: float):
        self.min_acceptance = min_acceptance
        self._rates: dict[str, float] = {}
        self.overall = 1.0

    def rate(self, request_id: str) -> float:
        """The estimate; 0 while it is below the floor (the request does not propose)."""
        r = self._rates.get(request_id, self.overall)
        return r if r >= self.min_acceptance else 0.0

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verified proposal: `accepted` of its `proposed` tokens were kept (a rejection ends it,
        so the per-position rate is accepted / (accepted + 1) when one was rejected)."""
        tries = accepted + (1 if accepted < proposed else 0)
        observed = accepted / tries
        r = self._rates.get(request_id, self.overall)
        self._rates[request_id] = (1 - _SMOOTHING) * r + _SMOOTHING * observed
        self.overall = (1 - _OVERALL_SMOOTHING) * self.overall + _OVERALL_SMOOTHING * observed

    def idle(self, request_id: str) -> None:
        """The request decoded a step without proposing."""
        r = self._rates.get(request_id, self.overall)
        self._rates[request_id] = r + (1 - r) * _RECOVERY

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)
